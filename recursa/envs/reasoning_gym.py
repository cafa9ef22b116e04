"""Adapter for reasoning-gym procedural datasets (`rg:<dataset>` specs).

The item for a seed is `reasoning_gym.create_dataset(name, seed=seed, size=1, **config)[0]`,
so it is a pure function of (dataset name, config kwargs, seed). The reward is the
dataset's own `score_answer`; a scorer that raises gives 0.0 and a note, never a crash.

Speed. Building a dataset is ~0.02 ms for most datasets, but some load data files in their
constructor (spell_backward ~25 ms, figlet_font ~140 ms, group_anagrams ~200 ms, arc_agi
~300 ms). So per (name, config) we build one template dataset and make the dataset for a
seed as a shallow copy with the seed swapped in. That is only used when it is provably the
same thing: for two probe seeds we build the dataset the slow way and check its state
(every attribute but the seed) equals the reseeded copy's. Datasets whose constructor
uses the seed (acre, list_functions, gsm_symbolic, ...) or holds state we cannot compare
fail the probe and are built afresh for every seed. Generated items are also kept in a
small per-config LRU cache, because held-out seeds are scored again and again.

reasoning_gym is imported lazily here and nowhere else in recursa.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import json
import math
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from recursa.answers import extract_answer
from recursa.envs.protocol import StepResult
from recursa.errors import UserError

__all__ = ["DEFAULT_INSTRUCTION", "ReasoningGymEnv", "dataset_names"]

DEFAULT_INSTRUCTION = "Put your final answer inside <answer></answer> tags."
_PROBE_SEEDS = (1, 2_000_000_029)
_ITEM_CACHE_SIZE = 4096
_RESERVED = ("seed", "size")


def _rg():
    try:
        import reasoning_gym
        from reasoning_gym.factory import DATASETS
    except ImportError:
        raise UserError("rg:<dataset> envs need reasoning-gym; install it with: pip install 'recursa[envs]'") from None
    return reasoning_gym, DATASETS


def dataset_names() -> list[str]:
    """All registered reasoning-gym dataset names, sorted."""
    _, datasets = _rg()
    return sorted(datasets)


def _state(ds: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    attrs = {k: v for k, v in vars(ds).items() if k not in ("seed", "config")}
    config = {k: v for k, v in vars(ds.config).items() if k != "seed"}
    return attrs, config


def _same_state(a: Any, b: Any) -> bool:
    try:
        return bool(_state(a) == _state(b))
    except Exception:  # objects whose == raises (arrays) count as "not provably the same"
        return False


class _Source:
    """Datasets and items for one (name, config): the template, the reseed check, the LRU."""

    def __init__(self, name: str, kwargs: dict[str, Any]) -> None:
        self.name = name
        self.kwargs = kwargs
        self.template = self._fresh(0)
        self.reseed = self._reseed_is_exact()
        self._items: OrderedDict[int, tuple[Any, dict[str, Any]]] = OrderedDict()
        self._lock = threading.Lock()

    def _fresh(self, seed: int) -> Any:
        reasoning_gym, _ = _rg()
        return reasoning_gym.create_dataset(self.name, seed=seed, size=1, **self.kwargs)

    def _reseeded(self, seed: int) -> Any:
        ds = copy.copy(self.template)
        config = copy.copy(self.template.config)
        config.seed = seed
        ds.config = config
        ds.seed = seed
        return ds

    def _reseed_is_exact(self) -> bool:
        try:
            return all(
                _same_state(self._fresh(seed), self._reseeded(seed)) and self._reseeded(seed).seed == seed
                for seed in _PROBE_SEEDS
            )
        except Exception:
            return False

    def dataset(self, seed: int) -> Any:
        return self._reseeded(seed) if self.reseed else self._fresh(seed)

    def item(self, seed: int) -> tuple[Any, dict[str, Any]]:
        """(dataset, item) for `seed`."""
        with self._lock:
            hit = self._items.get(seed)
            if hit is not None:
                self._items.move_to_end(seed)
                return hit
        ds = self.dataset(seed)
        entry = ds[0]
        with self._lock:
            self._items[seed] = (ds, entry)
            while len(self._items) > _ITEM_CACHE_SIZE:
                self._items.popitem(last=False)
        return ds, entry


_SOURCES: OrderedDict[str, _Source] = OrderedDict()
_SOURCES_LOCK = threading.Lock()
_MAX_SOURCES = 64


def _source(name: str, kwargs: dict[str, Any]) -> _Source:
    key = json.dumps([name, kwargs], sort_keys=True, default=repr)
    with _SOURCES_LOCK:
        if key in _SOURCES:
            _SOURCES.move_to_end(key)
            return _SOURCES[key]
    source = _Source(name, kwargs)
    with _SOURCES_LOCK:
        _SOURCES[key] = source
        while len(_SOURCES) > _MAX_SOURCES:
            _SOURCES.popitem(last=False)
    return source


def _check_config(name: str, kwargs: dict[str, Any]) -> None:
    _, datasets = _rg()
    config_cls = datasets[name][1]
    reserved = [k for k in kwargs if k in _RESERVED]
    if reserved:
        raise UserError(f"rg:{name}: {', '.join(reserved)} is set per item by recursa; remove it from the env kwargs")
    if dataclasses.is_dataclass(config_cls):
        allowed = [f.name for f in dataclasses.fields(config_cls) if f.init and f.name not in _RESERVED]
        unknown = [k for k in kwargs if k not in allowed]
        if unknown:
            raise UserError(
                f"rg:{name} has no config option {', '.join(map(repr, unknown))}; options: {', '.join(allowed)}"
            )


@dataclass(frozen=True)
class _Current:
    seed: int
    dataset: Any
    entry: dict[str, Any]


class ReasoningGymEnv:
    """Single-turn env over one reasoning-gym dataset; reward = the dataset's own scorer."""

    def __init__(
        self,
        dataset: str,
        success_threshold: float = 1.0,
        instruction: str = DEFAULT_INSTRUCTION,
        system_prompt: str | None = None,
        **config: Any,
    ) -> None:
        _, datasets = _rg()
        if dataset not in datasets:
            close = difflib.get_close_matches(dataset, list(datasets), n=4, cutoff=0.5)
            hint = f" (did you mean {', '.join('rg:' + c for c in close)}?)" if close else ""
            raise UserError(
                f"unknown reasoning-gym dataset {dataset!r}{hint}; "
                "all names: recursa.envs.list_reasoning_gym_datasets()"
            )
        if isinstance(success_threshold, bool) or not isinstance(success_threshold, (int, float)):
            raise UserError(f"success_threshold must be a number, got {success_threshold!r}")
        _check_config(dataset, config)
        try:
            self._source = _source(dataset, dict(config))
        except (TypeError, ValueError, AssertionError) as exc:
            raise UserError(f"invalid config for rg:{dataset}: {exc or type(exc).__name__}") from None
        self.dataset_name = dataset
        self.name = f"rg:{dataset}"
        self.config = dict(config)
        self.success_threshold = float(success_threshold)
        self.instruction = instruction
        self.system_prompt = system_prompt
        self._current: _Current | None = None

    def entry(self, seed: int) -> dict[str, Any]:
        """The reasoning-gym item (question, answer, metadata) for `seed`."""
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise UserError(f"seed must be a non-negative int, got {seed!r}")
        return self._source.item(seed)[1]

    def observation(self, entry: dict[str, Any]) -> str:
        question = str(entry["question"]).rstrip()
        return f"{question}\n\n{self.instruction}" if self.instruction else question

    def reset(self, seed: int) -> str:
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise UserError(f"seed must be a non-negative int, got {seed!r}")
        ds, entry = self._source.item(seed)
        self._current = _Current(seed, ds, entry)
        return self.observation(entry)

    def reference(self) -> str | None:
        """The dataset's reference answer for the current item in <answer> tags (for SFT;
        None when the item has none). Demonstration builders check that it scores."""
        if self._current is None:
            raise RuntimeError("call reset(seed) before reference()")
        answer = self._current.entry.get("answer")
        return None if answer is None else f"<answer>{answer}</answer>"

    @staticmethod
    def parse(action_text: str) -> str | None:
        """The <answer> tag content, else the stripped last non-empty line, else None."""
        tagged = extract_answer(action_text or "")
        if tagged is not None:
            return tagged
        lines = [line.strip() for line in (action_text or "").splitlines() if line.strip()]
        return lines[-1] if lines else None

    def step(self, action_text: str) -> StepResult:
        if self._current is None:
            raise RuntimeError("call reset(seed) before step(); reasoning-gym episodes end after one step")
        current, self._current = self._current, None
        parsed = self.parse(action_text)
        note = ""
        try:
            reward = float(current.dataset.score_answer(answer=parsed, entry=current.entry))
            if not math.isfinite(reward):
                note = f"scorer returned {reward}"
                reward = 0.0
        except Exception as exc:  # a third-party scorer must never crash a run
            reward = 0.0
            note = f"scorer error: {type(exc).__name__}: {exc}"
        answer = current.entry.get("answer")
        return StepResult(
            obs="",
            reward=reward,
            done=True,
            info={
                "success": reward >= self.success_threshold,
                "answer": "" if answer is None else str(answer),
                "parsed": parsed,
                "note": note,
            },
        )
