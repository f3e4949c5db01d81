"""BM25 retrieval over a local document collection: the ``search`` tool's engine, and a small
generated collection to search (no download, the same documents on every host).

BM25 (Robertson & Zaragoza, "The Probabilistic Relevance Framework: BM25 and Beyond", 2009),
score of document d for query q::

    sum over terms t of q:  idf(t) * tf(t,d) * (k1 + 1) / (tf(t,d) + k1 * (1 - b + b * |d| / avgdl))
    idf(t) = log(1 + (N - df(t) + 0.5) / (df(t) + 0.5))

with the Lucene idf (never negative). Terms are lower-cased word characters.
"""
from __future__ import annotations

import collections
import math
import re
from typing import Mapping, Sequence

import numpy as np

__all__ = ["BM25Index", "tokenize", "world_facts", "world_questions"]

_WORD = re.compile(r"\w+")


def tokenize(text: str) -> list[str]:
    """Lower-cased word tokens."""
    return _WORD.findall(text.lower())


class BM25Index:
    """An in-memory BM25 index over ``docs`` (strings, or dicts with ``text`` and optional
    ``title``; the title is searched too)."""

    def __init__(self, docs: Sequence[str | Mapping], k1: float = 1.5, b: float = 0.75):
        if not docs:
            raise ValueError("BM25Index needs at least one document")
        self.docs = [d if isinstance(d, Mapping) else {"text": str(d)} for d in docs]
        self.k1, self.b = float(k1), float(b)
        counts = [collections.Counter(tokenize(f"{d.get('title', '')} {d['text']}"))
                  for d in self.docs]
        lengths = np.array([sum(c.values()) for c in counts], np.float64)
        # Per term: the documents holding it and its frequency there (postings lists).
        postings: dict[str, tuple[list[int], list[int]]] = collections.defaultdict(lambda: ([], []))
        for i, c in enumerate(counts):
            for term, tf in c.items():
                postings[term][0].append(i)
                postings[term][1].append(tf)
        n = len(self.docs)
        self._postings = {t: (np.array(ids), np.array(tfs, np.float64))
                          for t, (ids, tfs) in postings.items()}
        self._idf = {t: math.log(1.0 + (n - len(ids) + 0.5) / (len(ids) + 0.5))
                     for t, (ids, _) in self._postings.items()}
        # The length normaliser k1 * (1 - b + b * |d| / avgdl), per document.
        self._norm = self.k1 * (1.0 - self.b + self.b * lengths / max(lengths.mean(), 1e-9))

    def scores(self, query: str) -> np.ndarray:
        """BM25 score of every document for ``query``: float64 [num_docs]."""
        out = np.zeros(len(self.docs))
        for term in tokenize(query):  # a repeated query term counts again, as in the formula
            if term not in self._postings:
                continue
            ids, tf = self._postings[term]
            out[ids] += self._idf[term] * tf * (self.k1 + 1.0) / (tf + self._norm[ids])
        return out

    def search(self, query: str, k: int = 3) -> list[tuple[int, float]]:
        """The ``k`` best (document index, score) pairs with a positive score, best first;
        ties broken by document order (deterministic)."""
        scores = self.scores(query)
        order = sorted(np.flatnonzero(scores > 0), key=lambda i: (-scores[i], i))
        return [(int(i), float(scores[i])) for i in order[:k]]


# ---------------------------------------------------------------------------- a generated world

_SYLLABLES = ("ka", "lo", "mir", "ta", "ven", "dor", "sha", "ri", "bel", "nu", "ox", "quil",
              "zan", "pe", "thu", "gar", "ly", "fen", "cas", "mo")
_GOODS = ("salt", "copper", "amber", "wool", "tea", "glass", "silk", "tin", "cedar", "pearls")
_COLOURS = ("red", "blue", "green", "gold", "white", "black", "violet", "orange")


def _name(rng: np.random.Generator, parts: int) -> str:
    return "".join(_SYLLABLES[int(i)] for i in rng.integers(len(_SYLLABLES), size=parts)).title()


def world_facts(num_countries: int = 120, seed: int = 0) -> list[dict]:
    """Documents about a made-up world (so no model knows them without searching): one per
    country, ``{"id", "title", "text", "facts"}``, where ``facts`` holds the answers a question
    generator can ask about (capital, currency, export, flag colour, population, founded)."""
    rng = np.random.default_rng([int(seed), 15])
    names: set[str] = set()
    docs = []
    while len(docs) < num_countries:
        country = _name(rng, int(rng.integers(2, 4)))
        capital = _name(rng, 3)
        if country in names or capital in names:
            continue  # unique names keep every question's answer unique
        names.update((country, capital))
        facts = {"country": country, "capital": capital,
                 "currency": _name(rng, 2).lower(),
                 "export": _GOODS[int(rng.integers(len(_GOODS)))],
                 "flag": _COLOURS[int(rng.integers(len(_COLOURS)))],
                 "population": int(rng.integers(10, 990)) * 10_000,
                 "founded": int(rng.integers(1000, 2000))}
        text = (f"{country} is a country whose capital is {capital}. Its currency is the "
                f"{facts['currency']} and its main export is {facts['export']}. The flag of "
                f"{country} is {facts['flag']}. {country} has a population of "
                f"{facts['population']} and was founded in {facts['founded']}.")
        docs.append({"id": len(docs), "title": country, "text": text, "facts": facts})
    return docs


# Numeric facts only, so the existing answer-matching rewards (``arithmetic``, ``gsm8k``) score
# the final answer; every 10th country is held out.
_QUESTIONS = (("founded", "In which year was {country} founded?"),
              ("population", "What is the population of {country}?"))


def world_questions(split: str = "train", num_countries: int = 120, seed: int = 0) -> list[dict]:
    """Questions about ``world_facts(num_countries, seed)`` that need the ``search`` tool:
    ``[{"question", "answer", "country"}]``. Train and eval ask about disjoint countries.

    Usable as a data source by name: ``data.source="rljax.envs.search:world_questions"`` (the
    other data keys, e.g. ``num_countries``, are its options), with ``reward.names=("arithmetic",)``
    and ``make_tool("search", seed=seed)`` over the same world."""
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    rows = []
    for doc in world_facts(num_countries, seed):
        if (doc["id"] % 10 == 9) != (split == "eval"):
            continue
        for key, template in _QUESTIONS:
            rows.append({"question": template.format(country=doc["title"]),
                         "answer": str(doc["facts"][key]), "country": doc["title"]})
    return rows
