#!/usr/bin/env python
"""Where a `household` GRPO step of the self-improvement benchmark spends its time, stage by stage
and path by path (issue 46).

    python benchmarks/profile_household.py                      # from runs/household_sft_light
    python benchmarks/profile_household.py --eval-n 20 --steps 1 --out /tmp/prof
    python benchmarks/profile_household.py --model tiny-random --eval-n 2   # checks the script in seconds

The settings are the benchmark's `household_light` GRPO run (`benchmarks/rsipo_vs_grpo.py`,
tag `@progress+epochs2`: 4 games x 8 episodes, at most 12 turns, replies of at most 12 tokens,
GiGPO, two optimisation epochs, micro-batches of 8). For each of `--steps` training steps:

* **rollout**: the step's 32 episodes on each rollout path (`current`: the synchronous loop;
  `continuous`: continuous batching with prompt-prefix reuse; `continuous-bf16`: the same
  with the bfloat16 sampling copy), in an order rotated between steps;
* **batch**: what the update runs: rows, real tokens, the tokens a micro-batch of the
  current order pads to, the distinct-prompt tokens the shared-prefix forward runs, and the
  tokens of the rows' prefix tree (every distinct prefix once: the floor of any prefix
  sharing);
* **update**: the GRPO update of that batch from the same weights and optimizer state, per
  update variant (`fp32`: today's; `bf16`: train.precision = "bf16"), each from a copy of
  the same starting state;

then **eval**: `--eval-n` held-out games, greedy, through each rollout path.

Ratios within one invocation are what to read; the host's fp32 matmul rate is printed at the
start and the end. Writes profile_household.json / .md to --out (default benchmarks/results/).
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from recursa.config import load_config  # noqa: E402
from recursa.engines import NativeEngine  # noqa: E402
from recursa.envs import EnvPool, make_env  # noqa: E402
from recursa.envs.protocol import split_seeds  # noqa: E402
from recursa.evaluate import evaluate  # noqa: E402
from recursa.generation import SamplingParams, group_generators, prefix_lengths  # noqa: E402
from recursa.rollout import rollout_episodes  # noqa: E402
from recursa.models import load_policy  # noqa: E402
from recursa.recipes.common import init_weights_dir, make_optimizer, step_generator  # noqa: E402
from recursa.recipes.grpo import episode_rows, prompt_groups, train_seeds, update  # noqa: E402
from recursa.algorithms.advantages import compute_advantages  # noqa: E402
from recursa.trajectory import collate  # noqa: E402

PATHS = {
    "current": dict(),
    "continuous": dict(continuous=True),
    "continuous-bf16": dict(continuous=True, decode_dtype="bfloat16"),
}
UPDATES = {"fp32": [], "bf16": ['train.precision="bf16"']}


def bench_sets(model: str | None, warm: str | None) -> list[str]:
    """The benchmark run's settings (household_light, @progress+epochs2) as --set overrides."""
    import rsipo_vs_grpo as bench

    game = bench.GAMES["household_light"]
    sets = [s for s in game["sets"] if not s.startswith("model.name=")]
    sets += [f"model.name={model or 'smollm2-135m-instruct'}", *([f"init.from_run={warm}"] if warm else [])]
    sets += ["train.lr=1e-5", "train.warmup_steps=2", "train.skip_empty_steps=true", "train.micro_batch_size=8",
             "train.epochs=2", "train.seed=0"]  # the curriculum only chooses which games: not part of a step's cost
    return sets


def matmul_gflops() -> float:
    """The host's fp32 matmul rate (vs_trl's probe), GFLOP/s."""
    import vs_trl

    return vs_trl.matmul_gflops()["best_gflops"]


def batch_stats(batch, micro: int) -> dict:
    """Token counts of what the update runs (see the module docstring)."""
    ids, mask = batch.input_ids.tolist(), batch.attention_mask
    first = prefix_lengths(batch.action_mask).tolist()
    real = mask.sum(dim=1).tolist()
    rows = [ids[i][: real[i]] for i in range(len(ids))]  # right-padded rows: the real tokens first
    order = torch.cat(prompt_groups(batch)).tolist()
    padded = 0
    for lo in range(0, len(order), micro):
        chunk = order[lo : lo + micro]
        distinct = {tuple(rows[i][: first[i]]) for i in chunk}
        padded += len(distinct) * max(first[i] for i in chunk) + len(chunk) * max(real[i] - first[i] for i in chunk)
    distinct_prompts = {tuple(r[: first[i]]) for i, r in enumerate(rows)}
    trie = set()
    for r in rows:
        for k in range(1, len(r) + 1):
            trie.add(hash(tuple(r[:k])))
    return {
        "rows": len(rows), "real_tokens": sum(real), "prompt_tokens": sum(first), "completion_tokens": sum(r - f for r, f in zip(real, first)),
        "padded_tokens_current_order": padded, "distinct_prompt_tokens": sum(len(p) for p in distinct_prompts),
        "distinct_prompts": len(distinct_prompts), "prefix_tree_tokens": len(trie),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct from --warm-start")
    ap.add_argument("--warm-start", default="runs/household_sft_light", help="run directory of the warm start (read only); '' = the model's own weights")
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--eval-n", type=int, default=20)
    ap.add_argument("--paths", default=",".join(PATHS))
    ap.add_argument("--updates", default=",".join(UPDATES))
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    args = ap.parse_args()
    torch.set_num_threads(2)
    warm = args.warm_start if args.model is None and args.warm_start and (REPO / args.warm_start).exists() else None
    sets = bench_sets(args.model, warm)
    cfg = load_config(None, sets, recipe="grpo")
    g0 = matmul_gflops()
    policy = load_policy(cfg.model, init_weights_dir(cfg))
    pool = EnvPool(lambda: make_env(cfg.env.name, **cfg.env.kwargs))
    sampling = SamplingParams(cfg.sampling.max_new_tokens, cfg.sampling.temperature, cfg.sampling.top_p, ())
    B, G = cfg.train.prompts_per_step, cfg.train.group_size
    paths = args.paths.split(",")
    engines = {p: NativeEngine(policy, **PATHS[p]) for p in paths}
    start_state = copy.deepcopy(policy.model.state_dict())
    out: dict = {"command": "python benchmarks/profile_household.py " + " ".join(sys.argv[1:]), "host": platform.machine(),
                 "torch": torch.__version__, "warm_start": warm, "sets": sets, "steps": []}
    print(f"matmul fp32 {g0:.0f} GFLOP/s; warm start {warm}", flush=True)
    for step in range(args.steps):
        seeds = train_seeds(cfg, step)
        rec: dict = {"step": step, "rollout": {}, "update": {}}
        for k in range(len(paths)):
            path = paths[(k + step) % len(paths)]
            gen = step_generator(cfg.train.seed, step)
            t0 = time.perf_counter()
            ero = rollout_episodes(policy, pool, seeds, G, sampling, group_generators(gen, B), None, cfg.agent, engine=engines[path])
            dt = time.perf_counter() - t0
            turns = sum(len(e.turns) for e in ero.episodes)
            rec["rollout"][path] = {"s": dt, "episodes": len(ero.episodes), "turns": turns, "won": sum(e.won for e in ero.episodes)}
            print(f"step {step} rollout {path}: {dt:.1f} s, {turns} turns, {rec['rollout'][path]['won']} won", flush=True)
            if path == paths[0]:  # the update variants train on the first path's batch
                rewards = torch.tensor([e.total_reward for e in ero.episodes], dtype=torch.float32).view(B, G)
                trajs, row_adv, _ = episode_rows(ero.episodes, compute_advantages(cfg.algo.advantage, rewards), cfg)
                batch = collate(trajs, row_adv, policy.tokenizer.pad_token_id, policy.device)
        rec["batch"] = batch_stats(batch, cfg.train.micro_batch_size)
        rec["batch"]["live_rows"] = int((batch.advantages != 0).sum())
        print(f"step {step} batch: {rec['batch']}", flush=True)
        for name in args.updates.split(","):
            ucfg = load_config(None, [*sets, *UPDATES[name]], recipe="grpo")
            policy.model.load_state_dict(start_state)
            opt = make_optimizer([p for p in policy.model.parameters() if p.requires_grad], ucfg)
            t0 = time.perf_counter()
            st = update(policy, opt, batch, ucfg, step_generator(cfg.train.seed, step), 0)
            dt = time.perf_counter() - t0
            rec["update"][name] = {"s": dt, "rows_run": st.rows_run, "opt_steps": st.opt_steps, "loss": st.loss}
            print(f"step {step} update {name}: {dt:.1f} s ({st.rows_run} rows run)", flush=True)
        policy.model.load_state_dict(start_state)
        for e in engines.values():
            e.load_weights(policy)
        out["steps"].append(rec)
    out["eval"] = {}
    if args.eval_n:
        for path in paths:
            t0 = time.perf_counter()
            res = evaluate(policy, pool, cfg.env.name, "test", args.eval_n, cfg.sampling.max_new_tokens, None, batch_size=min(args.eval_n, 100),
                           agent=cfg.agent, seeds=split_seeds("test", args.eval_n), engine=engines[path])
            dt = time.perf_counter() - t0
            out["eval"][path] = {"s": dt, "n": args.eval_n, "success_rate": res.success_rate}
            print(f"eval {path}: {dt:.1f} s on {args.eval_n} games, success {res.success_rate:.2f}", flush=True)
    out["matmul_gflops"] = {"start": g0, "end": matmul_gflops()}
    dest = Path(args.out)
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "profile_household.json").write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out["matmul_gflops"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
