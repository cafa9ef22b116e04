"""A search-agent testbed, offline: questions about invented people and places, a BM25
search tool over a small encyclopedia generated from the seed, an exact-match answer.

Each seed generates its own world: `people` invented people, each with a trade and a home
town, `towns` towns each in one of `provinces` provinces, and one short article per
person, town and province. The names are made of random syllables, so no model has seen
them and no answer can come from memory; the item is a pure function of the seed and the
kwargs, so recursa's seed splits keep every held-out world out of training.

A question asks for one fact that only the articles hold:

    hops = 1   "In which town was Velmo Quarst born?"           the person's article names the town
    hops = 2   "In which province was Velmo Quarst born?"       the person's article names the town,
                                                                 the town's article its province

The episode is a chat (`agent.episode = "chat"`, recursa/chat.py): the policy calls
`search(query)` as often as `agent.max_tool_calls` allows; each call returns the `k`
best articles by BM25 (Okapi, k1 = 1.5, b = 0.75, Lucene's idf ln(1 + (N - df + 0.5) /
(df + 0.5)), computed exactly here over the world's few dozen articles), and the first
reply without a tool call is the answer: reward 1 when its `<answer>...</answer>` content
(or the whole reply, without a tag) equals the right name, case, spaces and punctuation
aside; 0 otherwise. `walkthrough()` is that answer; `oracle_queries()` the searches that
find it (the person's name, then the town's with the word "province").
"""

from __future__ import annotations

import random

from recursa.answers import extract_answer
from recursa.bm25 import BM25Index, words
from recursa.envs.protocol import StepResult
from recursa.envs.tools import Tool

_ONSETS = ["b", "br", "d", "dr", "f", "g", "gr", "h", "k", "kr", "l", "m", "n", "p", "pr", "q", "r", "s", "st", "t", "tr", "v", "z"]
_VOWELS = ["a", "e", "i", "o", "u", "ae", "ei", "ou"]
_CODAS = ["", "", "n", "r", "l", "s", "th", "x", "m", "nd", "rk"]
_TRADES = ["glassblower", "cartographer", "beekeeper", "clockmaker", "ferryman", "weaver", "astronomer", "cooper", "herbalist", "mason"]
_GOODS = ["salt", "amber", "wool", "copper", "figs", "slate", "honey", "linen", "pearls", "rye"]


tokenize = words  # every word counts in a search (no stopwords)


def BM25(texts: list[str], k1: float = 1.5, b: float = 0.75) -> BM25Index:
    """The search tool's index over `texts`: `recursa.bm25.BM25Index` with every word a term."""
    return BM25Index(k1, b, tokenize=words).build(texts)


def _name(rng: random.Random, syllables: int) -> str:
    return "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS) for _ in range(syllables)).capitalize()


def _names(rng: random.Random, n: int, syllables: int, taken: set[str]) -> list[str]:
    out = []
    while len(out) < n:
        name = _name(rng, syllables)
        if name.lower() not in taken:
            taken.add(name.lower())
            out.append(name)
    return out


def normalise(text: str) -> str:
    """Lower case, letters and digits only, single spaces: how answers are compared."""
    return " ".join(tokenize(text or ""))


class SearchEnv:
    """Questions about an invented world, answered by searching its articles (see the module doc)."""

    name = "search"
    system_prompt = ("You answer questions about a small encyclopedia of invented people and places. "
                     "Nobody knows these facts by heart: look them up with the search tool, then answer.")
    invalid_penalty = 0.0
    max_steps = 1  # one answer ends the episode (tool calls are not steps; agent.max_tool_calls bounds them)

    def __init__(self, hops: int = 2, people: int = 12, towns: int = 6, provinces: int = 3, k: int = 3):
        if hops not in (1, 2):
            raise ValueError(f"hops must be 1 or 2, got {hops!r}")
        if min(people, towns, provinces) < 1 or k < 1:
            raise ValueError("people, towns, provinces and k must be at least 1")
        self.hops, self.n_people, self.n_towns, self.n_provinces, self.k = hops, people, towns, provinces, k
        self.articles: list[str] = []
        self.index: BM25Index | None = None
        self.task, self.answer, self.person, self.town = "", "", "", ""
        self.searches = 0

    def reset(self, seed: int) -> str:
        rng = random.Random(f"search:{seed}")
        taken: set[str] = set()
        provinces = _names(rng, self.n_provinces, 3, taken)
        towns = _names(rng, self.n_towns, 2, taken)
        people = [f"{first} {last}" for first, last in zip(_names(rng, self.n_people, 2, taken), _names(rng, self.n_people, 2, taken))]
        town_province = {t: rng.choice(provinces) for t in towns}
        home = {p: rng.choice(towns) for p in people}
        trades = [rng.choice(_TRADES) for _ in people]
        articles = [f"{p} is {'an' if t[0] in 'aeiou' else 'a'} {t} who was born in the town of {home[p]}." for p, t in zip(people, trades)]
        articles += [f"{t} is a town in the province of {town_province[t]}, known for its {rng.choice(_GOODS)}." for t in towns]
        articles += [f"{v} is a province with {sum(1 for t in towns if town_province[t] == v)} towns on the map." for v in provinces]
        rng.shuffle(articles)
        self.articles, self.index = articles, BM25(articles)
        self.person = rng.choice(people)
        self.town = home[self.person]
        if self.hops == 1:
            self.task, self.answer = f"In which town was {self.person} born?", self.town
        else:
            self.task, self.answer = f"In which province was {self.person} born?", town_province[self.town]
        self.searches = 0
        return "Search the encyclopedia with the search tool, then reply with only the name, as <answer>NAME</answer>."

    def search(self, query: str) -> str:
        """The best articles for `query`, one per line, or a line saying none matched."""
        self.searches += 1
        hits = [i for i, _ in self.index.top_k(query, self.k)] if self.index is not None else []
        if not hits:
            return f"no article matches {query!r}"
        return "\n".join(f"[{i}] {self.articles[i]}" for i in hits)

    def tools(self) -> list[Tool]:
        return [Tool("search", "Search the encyclopedia; returns the best-matching articles.",
                     {"type": "object", "properties": {"query": {"type": "string", "description": "words to look for"}},
                      "required": ["query"], "additionalProperties": False}, self.search)]

    def admissible_actions(self) -> None:
        return None

    def walkthrough(self) -> list[str]:
        return [f"<answer>{self.answer}</answer>"]

    def oracle_queries(self) -> list[str]:
        """Searches that find the answer: the person, then (two hops) the town and the word 'province'."""
        return [self.person] if self.hops == 1 else [self.person, f"{self.town} province"]

    def step(self, action_text: str) -> StepResult:
        tagged = extract_answer(action_text)
        parsed = tagged if tagged is not None else (action_text or "").strip()
        won = bool(parsed) and normalise(parsed) == normalise(self.answer)
        info = {"won": won, "success": won, "invalid": False, "admissible": None, "steps": 1, "score": float(won),
                "answer": self.answer, "parsed": parsed, "searches": self.searches, "note": ""}
        return StepResult("", float(won), True, info)
