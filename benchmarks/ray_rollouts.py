"""Rollout throughput on Ray workers against the single process, on a game.

    python benchmarks/ray_rollouts.py                        # embedded model on household, 1 and 2 workers
    python benchmarks/ray_rollouts.py --model tiny-random --calls 2   # a quick check of the script

Plays the same rollout calls (B game seeds x G episodes each, per-group random streams,
fixed weights) with four setups in one process and one local Ray:

* local, torch on 1 thread and on `--threads` threads (the single-process backend);
* Ray, 1 worker and 2 workers (each worker 1 CPU, torch on 1 thread).

All setups are started first (one pool of max(--workers) Ray actors; "Ray, k workers"
gives each call to the first k actors of the pool, so only one set of model copies is in
memory), then one warm-up call each, then `--calls` rounds in which every setup plays the
round's call in turn, so a change of load on a shared machine hits every setup alike. The figure is episodes per minute of
rollout wall time (for Ray: weights shipped through the object store, the shards played,
the results gathered). Every Ray call is checked against the local call at the same seeds
(same sampled tokens). Read the ratios against the local 1-thread baseline measured in the
same run, not the absolute numbers.
Writes benchmarks/results/ray_rollouts.json and .md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

from recursa.agent import AgentConfig
from recursa.config import load_config
from recursa.distributed.rollouts import LocalRollouts
from recursa.envs import EnvPool, make_env, split_seed
from recursa.generation import SamplingParams
from recursa.models import load_policy

OUT = Path(__file__).resolve().parent / "results"


def timed(backend, seeds, group_size, sampling, agent, call: int, threads: int | None = None):
    """(seconds, result) of one call with the step generator of `call`."""
    if threads is not None:
        torch.set_num_threads(threads)
    t0 = time.perf_counter()
    result = backend.episodes(seeds, group_size, sampling, torch.Generator().manual_seed(call), None, agent)
    return time.perf_counter() - t0, result


class FirstWorkers:
    """A RayRollouts whose calls go to the first k actors of its pool (the shards follow)."""

    def __init__(self, remote, k: int):
        self.remote, self.k = remote, k

    def episodes(self, *args, **kwargs):
        pool = self.remote.workers
        self.remote.workers = pool[: self.k]
        try:
            return self.remote.episodes(*args, **kwargs)
        finally:
            self.remote.workers = pool

    def metrics(self):
        return self.remote.metrics()

    def close(self):
        self.remote.close()


def same_tokens(a, b) -> bool:
    return all(
        [t.action_ids for t in x.turns] == [t.action_ids for t in y.turns] and x.group == y.group
        for ra, rb in zip(a, b) for x, y in zip(ra.episodes, rb.episodes)
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct", help="model.name (default: the embedded model)")
    ap.add_argument("--env", default="household")
    ap.add_argument("--env-kwargs", default='{"rooms": 1, "objects_per_room": 2, "distractors": 0, "tasks": "pick_and_place", "max_steps": 6}')
    ap.add_argument("--groups", type=int, default=4, help="B: game seeds per call")
    ap.add_argument("--group-size", type=int, default=2, help="G: episodes per seed")
    ap.add_argument("--max-new-tokens", type=int, default=12)
    ap.add_argument("--calls", type=int, default=4, help="timed rounds (every setup plays each round's call once)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads of the multi-threaded local baseline")
    ap.add_argument("--workers", default="1,2", help="Ray worker counts to measure")
    ap.add_argument("--out", default=str(OUT / "ray_rollouts"), help="output path without extension")
    args = ap.parse_args()
    kwargs = json.loads(args.env_kwargs)
    worker_counts = [int(w) for w in args.workers.split(",")]
    cfg_sets = [f"model.name={args.model}", f"env.name={args.env}", f"sampling.max_new_tokens={args.max_new_tokens}", "distributed.backend=ray"]
    cfg = load_config(None, cfg_sets)
    cfg = cfg.model_copy(update={"env": cfg.env.model_copy(update={"kwargs": kwargs}), "model": cfg.model.model_copy(update={"device": "cpu"})})
    policy = load_policy(cfg.model)
    sampling = SamplingParams(args.max_new_tokens, 1.0, 1.0, ())
    agent = AgentConfig()
    seeds = [[split_seed("train", 1000 * c + i) for i in range(args.groups)] for c in range(args.calls)]

    import ray

    from recursa.distributed.ray_rollout import RayRollouts, connect

    setups: list[dict] = []
    for threads in sorted({1, args.threads}):
        local = LocalRollouts(policy, EnvPool(lambda: make_env(args.env, **kwargs)), "group")
        setups.append({"setup": f"local, {threads} thread{'s' if threads > 1 else ''}", "backend": local, "threads": threads})
    pool_size = max(worker_counts)
    connect("", pool_size)
    torch.set_num_threads(1)  # the driver only ships weights and gathers results
    t0 = time.perf_counter()
    remote = RayRollouts(cfg.model_copy(update={"distributed": cfg.distributed.model_copy(update={"workers": pool_size})}), policy, log=lambda s: None)
    startup = time.perf_counter() - t0
    for w in worker_counts:
        setups.append({"setup": f"Ray, {w} worker{'s' if w > 1 else ''}", "backend": FirstWorkers(remote, w), "threads": 1, "startup_s": startup})
    for s in setups:  # warm-up
        timed(s["backend"], seeds[0], args.group_size, sampling, agent, 10_000, s["threads"])
        s["seconds"], s["episodes"], s["results"], s["weights_put_s"] = 0.0, 0, [], 0.0
    for c in range(args.calls):
        for s in setups:
            secs, result = timed(s["backend"], seeds[c], args.group_size, sampling, agent, c, s["threads"])
            s["seconds"] += secs
            s["episodes"] += len(result.episodes)
            s["results"].append(result)
            s["weights_put_s"] += s["backend"].metrics().get("time/weights_s", 0.0) / args.calls
        print(f"round {c + 1}/{args.calls}: " + ", ".join(f"{s['setup']} {s['seconds']:.1f} s" for s in setups), flush=True)
    reference = setups[0]["results"]
    rows = []
    for s in setups:
        row = {"setup": s["setup"], "episodes_per_min": 60.0 * s["episodes"] / s["seconds"], "seconds": s["seconds"], "episodes": s["episodes"]}
        if "startup_s" in s:
            row.update(startup_s=s["startup_s"], weights_put_s=s["weights_put_s"], same_tokens_as_local=same_tokens(s["results"], reference))
        rows.append(row)
    remote.close()
    ray.shutdown()

    base = rows[0]["episodes_per_min"]
    for r in rows:
        r["ratio_vs_local_1_thread"] = r["episodes_per_min"] / base
    meta = {
        "model": args.model, "env": args.env, "env_kwargs": kwargs, "groups": args.groups, "group_size": args.group_size,
        "max_new_tokens": args.max_new_tokens, "calls": args.calls, "cpus": os.cpu_count(), "python": platform.python_version(),
        "torch": torch.__version__, "ray": ray.__version__, "load_avg_at_end": os.getloadavg(), "command": " ".join(sys.argv),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    lines = [
        f"# Ray rollouts: {args.model} on {args.env}, {args.groups} seeds x {args.group_size} episodes per call, {args.calls} timed rounds",
        "",
        f"`{meta['command']}`; {meta['cpus']} CPUs, load average at the end {meta['load_avg_at_end'][0]:.1f} (a shared machine: read the ratios).",
        "",
        "| setup | episodes / min | ratio vs local 1 thread | Ray pool start-up (s) | weights put per call (s) | same tokens as local |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        ray_cols = f"{r['startup_s']:.1f} | {r['weights_put_s']:.2f} | {r['same_tokens_as_local']}" if "startup_s" in r else "- | - | -"
        lines.append(f"| {r['setup']} | {r['episodes_per_min']:.1f} | {r['ratio_vs_local_1_thread']:.2f} | {ray_cols} |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
