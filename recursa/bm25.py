"""Okapi BM25 over a fixed list of documents: skill retrieval (`recursa.skills.retrieval`) and the
search testbed's tool (`recursa.envs.search`) rank with this one index.

BM25 (Robertson and Zaragoza 2009, "The Probabilistic Relevance Framework: BM25 and
Beyond") scores document D for query Q as

    score(D, Q) = sum over distinct terms q of Q of
                  idf(q) * f(q, D) * (k1 + 1) / (f(q, D) + k1 * (1 - b + b * |D| / avgdl))
    idf(q)      = ln(1 + (N - n(q) + 0.5) / (n(q) + 0.5))

with f(q, D) the count of q in D, |D| the length of D in terms, avgdl the mean length over the
N documents, n(q) the number of documents that contain q; k1 = 1.5, b = 0.75 by default.
Departure from the classic idf ln((N - n + 0.5) / (n + 0.5)): the "+ 1" inside the log
(Lucene's form) keeps idf positive, so a term found in more than half of a small collection
still counts for, not against, a document. Query terms count once each. The caller chooses the
tokenizer (skills drop a few stopwords; the search tool keeps every word).
"""

from __future__ import annotations

import math
import re
from collections import Counter
from typing import Callable

_WORD = re.compile(r"[a-z0-9]+")


def words(text: str) -> list[str]:
    """Lower-cased runs of letters and digits."""
    return _WORD.findall(text.lower())


def ranked(scores: list[float], k: int) -> list[tuple[int, float]]:
    """The k best (index, score) pairs, highest score first, ties by index."""
    order = sorted(range(len(scores)), key=lambda i: (-scores[i], i))
    return [(i, scores[i]) for i in order[: max(k, 0)]]


class BM25Index:
    """Okapi BM25 over a fixed list of documents (formula in the module doc)."""

    def __init__(self, k1: float = 1.5, b: float = 0.75, tokenize: Callable[[str], list[str]] = words):
        self.k1, self.b, self.tokenize = k1, b, tokenize
        self.docs: list[Counter] = []  # term counts f(q, D) per document
        self.lengths: list[int] = []  # |D|
        self.idf: dict[str, float] = {}  # idf(q) of every term of the collection
        self.avgdl = 0.0

    def build(self, docs: list[str]) -> "BM25Index":
        self.docs = [Counter(self.tokenize(d)) for d in docs]
        self.lengths = [sum(c.values()) for c in self.docs]
        self.avgdl = sum(self.lengths) / len(self.docs) if self.docs else 0.0
        df = Counter(t for c in self.docs for t in c)
        n = len(self.docs)
        self.idf = {t: math.log(1 + (n - m + 0.5) / (m + 0.5)) for t, m in df.items()}
        return self

    def scores(self, query: str) -> list[float]:
        """score(D, query) for each document, in document order."""
        terms = set(self.tokenize(query)) & self.idf.keys()
        if not terms:  # also covers an empty index and a query of stopwords only (avgdl = 0)
            return [0.0] * len(self.docs)
        out = []
        for doc, length in zip(self.docs, self.lengths):
            norm = self.k1 * (1 - self.b + self.b * length / self.avgdl)
            out.append(sum(self.idf[t] * doc[t] * (self.k1 + 1) / (doc[t] + norm) for t in terms if t in doc))
        return out

    def top_k(self, query: str, k: int) -> list[tuple[int, float]]:
        """The k best (document index, score) pairs with a positive score (sharing at least one
        term with the query), highest first, ties by index."""
        return [(i, s) for i, s in ranked(self.scores(query), k) if s > 0]
