"""Rollouts on a pool of Ray actors (`distributed.backend = "ray"`).

    driver (the recipe: learner, evaluation, run store)           Ray actors (RolloutWorker x N)
    ------------------------------------------------------         ------------------------------
    start: N actors, each loads the model's architecture  ---->    load_policy(model config), own EnvPool
           (+ the frozen weights, under LoRA, once)
    each call:  ray.put(trainable weights)  (one copy)     ---->    copy them into the local policy
                group seeds <- step generator (B draws)
                shard w = groups [lo_w, hi_w)              ---->    play(shard, its group seeds)
                concatenate shards in order                <----    trajectories / episodes
                a dead actor: replace it, redo its shard

Every call ships the policy's current trainable weights once through the object store (the
frozen base, under LoRA, goes once at start), so a worker always plays the weights the
learner holds at that moment: after an update, a gate rollback or a resume alike. The
shards use per-group random streams (`generation.group_seeds`), so the concatenated result
equals `LocalRollouts` with `sampling.streams = "group"` on the same device, and a shard
redone on a replacement worker draws the same numbers as the first try.

Workers are started from this module's `RolloutWorker` class; every node needs recursa
installed (and, for an env added with `register_env`, its module importable: the worker
receives the env's own factory, not the registration).
"""

from __future__ import annotations

import logging
import math
import os
import time
import warnings
from typing import Callable

import numpy as np
import ray
import torch

from recursa.envs import EnvPool
from recursa.envs.dataset import task_factory
from recursa.errors import UserError
from recursa.generation import generators_from, group_seeds
from recursa.models import Policy, load_policy
from recursa.distributed.local import RolloutRequest, merge, play, shard_bounds

# What a dead worker looks like from the driver: its process killed (ray.kill, a crash, Ray's
# out-of-memory killer), its node gone, or its result lost with it.
_DEATHS = tuple(
    getattr(ray.exceptions, name)
    for name in ("RayActorError", "WorkerCrashedError", "NodeDiedError", "ObjectLostError", "OutOfMemoryError")
    if hasattr(ray.exceptions, name)
)


# ------------------------------------------------------------------------ weights transport


def weights_payload(model: torch.nn.Module, trainable: bool) -> dict[str, np.ndarray]:
    """The model's trainable (or frozen) parameters as host numpy arrays by name (tied
    parameters once): what goes into the object store. bfloat16 travels as its int16 bits."""
    out = {}
    for name, p in model.named_parameters():
        if p.requires_grad == trainable:
            t = p.detach().to("cpu")
            out[name] = t.view(torch.int16).numpy() if t.dtype == torch.bfloat16 else t.numpy()
    return out


@torch.no_grad()
def load_payload(model: torch.nn.Module, payload: dict[str, np.ndarray]) -> None:
    """Copy a `weights_payload` into `model`'s parameters of the same names (in place)."""
    params = dict(model.named_parameters())
    for name, array in payload.items():
        if name not in params:
            raise UserError(f"a Ray worker's model has no parameter {name!r}: the workers must build the same model as the trainer (same model.name and lora)")
        p = params[name]
        with warnings.catch_warnings():  # arrays read from the object store are read-only; they are copied at once
            warnings.simplefilter("ignore", UserWarning)
            src = torch.from_numpy(array)
        if p.dtype == torch.bfloat16:
            src = src.view(torch.bfloat16)
        p.copy_(src)


# ------------------------------------------------------------------------------- the worker


class RolloutWorker:
    """A rollout worker (a Ray actor): a copy of the policy and its own env pool.

    `setup` loads the model's architecture (its weights come from the trainer); `play` loads
    the weights it is given and plays its shard of a step."""

    def setup(self, model_cfg, envs: Callable, threads: int, frozen: dict | None) -> int:
        torch.set_num_threads(threads)
        self.policy = load_policy(model_cfg)
        self.pool = EnvPool(envs)
        if frozen:
            load_payload(self.policy.model, frozen)
        return os.getpid()

    def play(self, weights: dict, request: RolloutRequest, streams: list[int]):
        load_payload(self.policy.model, weights)
        return play(self.policy, self.pool, request, generators_from(streams))

    def pid(self) -> int:
        return os.getpid()

    def close(self) -> None:
        self.pool.close()


# ------------------------------------------------------------------------------- the driver


def connect(address: str, cpus_needed: float) -> bool:
    """Attach to Ray: reuse a Ray this process already started, else start a local one
    (address '') or join the cluster at `address`. True when this call started it."""
    if ray.is_initialized():
        return False
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    try:
        if address == "":  # "local": a new Ray of our own, even where `ray start` left a cluster (or its address file)
            ray.init(address="local", num_cpus=max(os.cpu_count() or 1, math.ceil(cpus_needed)), include_dashboard=False, log_to_driver=False,
                     logging_level=logging.WARNING)
        else:
            ray.init(address=address, log_to_driver=False, logging_level=logging.WARNING)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UserError(
            f"cannot reach a Ray cluster at distributed.address = {address!r} ({first}): start one with `ray start --head` "
            "and use 'auto', or set distributed.address = '' to start a local Ray"
        ) from None
    return True


def _task_error(exc: Exception) -> Exception:
    """A worker's own UserError (a bad env spec, a missing model) comes back as that one-line
    error; anything else is re-raised as Ray reports it (with the worker's traceback)."""
    cause = getattr(exc, "cause", None)
    return UserError(str(cause)) if isinstance(cause, UserError) else exc


def _first_line(exc: Exception, limit: int = 200) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:limit]}{'...' if len(text) > limit else ''}"


class RayRollouts:
    """The rollout backend on `distributed.workers` Ray actors (see the module doc)."""

    name = "ray"

    def __init__(self, cfg, policy: Policy, log: Callable[[str], None] = print):
        dc = cfg.distributed
        self.dc, self.policy, self.log = dc, policy, log
        self.started = connect(dc.address, dc.workers * dc.worker_cpus)
        self._check_fits()
        device = "cuda" if dc.worker_gpus > 0 else "cpu"
        self.model_cfg = cfg.model.model_copy(update={"device": device})
        self.envs = task_factory(cfg)  # picklable: a 'pkg.module:attr' / entry-point env or a dataset is rebuilt by name in the worker
        self.threads = max(1, int(dc.worker_cpus))
        frozen = weights_payload(policy.model, trainable=False)
        self.frozen = ray.put(frozen) if frozen else None  # under LoRA the base never changes: shipped once, kept for replacements
        self.workers: list = [None] * dc.workers
        self.restarts_total = 0
        self._metrics: dict[str, float] = {}
        t0 = time.perf_counter()
        try:
            self._wait_ready({w: self._start(w) for w in range(dc.workers)})
        except _DEATHS as exc:
            self.close()
            raise UserError(f"a Ray rollout worker died while starting ({_first_line(exc)}): see the Ray logs (/tmp/ray/session_latest/logs)") from None
        log(f"rollouts: {dc.workers} Ray workers ({dc.worker_cpus:g} CPU, {dc.worker_gpus:g} GPU each, policy on {device}) ready in {time.perf_counter() - t0:.1f}s")

    def _check_fits(self) -> None:
        have = ray.cluster_resources()
        for key, per in (("CPU", self.dc.worker_cpus), ("GPU", self.dc.worker_gpus)):
            need = self.dc.workers * per
            if need > have.get(key, 0) + 1e-9:
                raise UserError(
                    f"distributed.workers x worker_{key.lower()}s = {need:g} {key}s, but the Ray cluster has {have.get(key, 0):g}: "
                    "use fewer workers, fewer per worker, or a larger cluster"
                )

    def _start(self, w: int):
        """Start worker `w` (replacing a dead one); returns the ref of its setup call."""
        actor = ray.remote(RolloutWorker).options(num_cpus=self.dc.worker_cpus, num_gpus=self.dc.worker_gpus).remote()
        self.workers[w] = actor
        return actor.setup.remote(self.model_cfg, self.envs, self.threads, self.frozen)

    def _wait_ready(self, readies: dict) -> None:
        """Wait for the workers' setup calls; a worker's own error comes back as it is, one
        that died while starting is a one-line error (at start) or a death (a replacement)."""
        for w, ref in readies.items():
            try:
                ray.get(ref)
            except ray.exceptions.RayTaskError as exc:
                raise _task_error(exc) from None

    def _died(self, j: int, exc: Exception, restarts: int) -> int:
        """Count a death of worker j in this call; stop the run past max_restarts."""
        restarts += 1
        self.restarts_total += 1
        if restarts > self.dc.max_restarts:
            raise UserError(
                f"Ray rollout workers died {restarts} times in one step (last: {_first_line(exc)}): see the Ray logs "
                "(/tmp/ray/session_latest/logs on the node), give the workers more memory, or raise distributed.max_restarts"
            ) from None
        self.log(f"rollouts: worker {j} died ({type(exc).__name__}); replacing it and redoing its share of the step")
        return restarts

    def _replace(self, j: int, restarts: int) -> int:
        """Start a replacement for worker j (again, if the replacement dies while starting)."""
        while True:
            self._kill(self.workers[j])
            try:
                self._wait_ready({j: self._start(j)})
                return restarts
            except _DEATHS as exc:
                restarts = self._died(j, exc, restarts)

    def _call(self, request: RolloutRequest, generator: torch.Generator):
        t0 = time.perf_counter()
        streams = group_seeds(generator, len(request.seeds))  # the same draws as LocalRollouts with group streams
        weights = ray.put(weights_payload(self.policy.model, trainable=True))  # once per call, read by every worker
        t1 = time.perf_counter()
        bounds = shard_bounds(len(request.seeds), len(self.workers))
        submit = lambda j: self.workers[j].play.remote(weights, request.shard(*bounds[j]), streams[bounds[j][0] : bounds[j][1]])  # noqa: E731
        pending = {submit(j): j for j in range(len(bounds))}
        parts: list = [None] * len(bounds)
        restarts = 0
        while pending:
            [ref], _ = ray.wait(list(pending), num_returns=1)
            j = pending.pop(ref)
            try:
                parts[j] = ray.get(ref)
            except ray.exceptions.RayTaskError as exc:
                raise _task_error(exc) from None
            except _DEATHS as exc:
                restarts = self._replace(j, self._died(j, exc, restarts))
                pending[submit(j)] = j
            except ray.exceptions.RayError as exc:
                raise UserError(f"a Ray rollout worker failed: {_first_line(exc)}") from None
        del weights
        self._metrics = {"distributed/restarts": float(restarts), "time/weights_s": t1 - t0}
        return merge(parts, [lo for lo, _ in bounds])

    def rollout(self, seeds, group_size, sampling, generator, system_prompt, hints=None):
        return self._call(RolloutRequest(list(seeds), group_size, sampling, system_prompt, None, hints), generator)

    def episodes(self, seeds, group_size, sampling, generator, system_prompt, agent, hints=None, prefixes=None):
        return self._call(RolloutRequest(list(seeds), group_size, sampling, system_prompt, agent, hints, prefixes), generator)

    def metrics(self) -> dict[str, float]:
        return dict(self._metrics)

    @staticmethod
    def _kill(actor) -> None:
        try:
            ray.kill(actor, no_restart=True)
        except Exception:  # already gone
            pass

    def close(self) -> None:
        for actor in self.workers:
            if actor is not None:
                self._kill(actor)
        self.workers = []
        if self.started and ray.is_initialized():
            ray.shutdown()
