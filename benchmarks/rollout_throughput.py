"""Multi-turn rollout throughput: the current (synchronous) path against continuous batching.

    python benchmarks/rollout_throughput.py                                  # twx:twc and household, 2 repeats
    python benchmarks/rollout_throughput.py --games household --repeats 1 --paths current,continuous
    python benchmarks/rollout_throughput.py --model tiny-random --games household --repeats 1   # quick look

Each game plays the rollout of a GRPO step of its example config (`examples/twx_twc_sft_grpo.toml`,
`examples/household.toml`: B = 2 games x G = 4 episodes, at most 10 turns, replies of at most 12
tokens) with the embedded SmolLM2-135M, from the SFT warm start of that game when its run
directory exists (`--twx-run`, `--household-run`; read only), else from the model's own weights.
Paths, all through `recursa.rollout.rollout_episodes` on the native engine:

* `current`: the synchronous loop (one batched `generate` per turn), what every run does by
  default; here with per-episode streams (`sampling.streams = "group"`) so that it plays the
  same episodes as the continuous paths (the loop's cost does not depend on the streams);
* `continuous`: `rollout.continuous = true` (continuous batching, prompt-prefix reuse, static
  KV slots), float32: the same tokens as `current` up to float rounding (reported as
  `agree`, the fraction of turns whose reply tokens are identical);
* `continuous-bf16`: the same with `rollout.decode_dtype = "bfloat16"` (a bfloat16 sampling
  copy; its log-probs differ from the float32 trainer's: `mismatch` is the mean
  |logp_sampler - logp_trainer| over the sampled tokens, the run's `rollout/logprob_mismatch`);
* `continuous-serial`: `continuous` with each prompt prefilled in a forward of its own (the
  batcher before batched prefill; an ablation);
* `continuous-int8`, `current-bf16`: further combinations (not in the default list).

Every repeat plays the task seeds of the next step on every path, one path after the other,
in an order rotated between repeats, so that a change in the machine's load hits all paths
alike; report ratios within one run. Reported per path: episodes per minute, generated tokens
per second, turns, and the profile of where the rollout's seconds went: prefill forwards
(decoder calls of more than one position), decode forwards (one position per row), the
vocabulary projection, the games (reset, step, admissible actions), and the rest (prompt
rendering and tokenizing, sampling, stop checks, Python). Writes rollout_throughput.json and
rollout_throughput.md to --out (default benchmarks/results/).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from recursa.config import load_config  # noqa: E402
from recursa.engines import NativeEngine  # noqa: E402
from recursa.envs import EnvPool, make_env  # noqa: E402
from recursa.generation import SamplingParams, group_generators, shared_prefix_logprobs  # noqa: E402
from recursa.models import load_policy  # noqa: E402
from recursa.recipes.common import init_weights_dir, step_generator  # noqa: E402
from recursa.recipes.grpo import train_seeds  # noqa: E402
from recursa.rollout import rollout_episodes  # noqa: E402
from recursa.trajectory import collate  # noqa: E402

GAMES = {  # game -> (example config, warm-start flag)
    "twx": ("examples/twx_twc_sft_grpo.toml", "twx_run"),
    "household": ("examples/household.toml", "household_run"),
}
PATHS = {  # path -> engine options
    "current": dict(),
    "continuous": dict(continuous=True),
    "continuous-serial": dict(continuous=True, prefill_rows=1),
    "continuous-bf16": dict(continuous=True, decode_dtype="bfloat16"),
    "continuous-int8": dict(continuous=True, decode_dtype="int8"),
    "current-bf16": dict(decode_dtype="bfloat16"),
}


class Clock:
    """Seconds per category, from forward hooks on the sampling module and a timing env proxy."""

    def __init__(self):
        self.s = {"prefill": 0.0, "decode": 0.0, "lm_head": 0.0, "env": 0.0}
        self.calls = {"prefill": 0, "decode": 0}
        self._t0: dict[str, float] = {}

    def hook(self, module: torch.nn.Module) -> list:
        base, head = module.get_decoder(), module.get_output_embeddings()

        def base_pre(mod, args, kwargs):
            ids = kwargs.get("input_ids", args[0] if args else None)
            self._kind = "prefill" if ids.shape[1] > 1 else "decode"
            self._t0["base"] = time.perf_counter()

        def base_post(mod, args, kwargs, out):
            self.s[self._kind] += time.perf_counter() - self._t0["base"]
            self.calls[self._kind] += 1

        def head_pre(mod, args):
            self._t0["head"] = time.perf_counter()

        def head_post(mod, args, out):
            self.s["lm_head"] += time.perf_counter() - self._t0["head"]

        return [
            base.register_forward_pre_hook(base_pre, with_kwargs=True),
            base.register_forward_hook(base_post, with_kwargs=True),
            head.register_forward_pre_hook(head_pre),
            head.register_forward_hook(head_post),
        ]


class TimedEnv:
    """Forwards everything to the env; adds the seconds of reset/step/admissible_actions to a clock."""

    def __init__(self, env, clock_ref: list):
        self._env, self._clock = env, clock_ref

    def __getattr__(self, name):
        return getattr(self._env, name)

    def _timed(self, fn, *a):
        t = time.perf_counter()
        try:
            return fn(*a)
        finally:
            self._clock[0].s["env"] += time.perf_counter() - t

    def reset(self, seed):
        return self._timed(self._env.reset, seed)

    def step(self, action):
        return self._timed(self._env.step, action)

    def admissible_actions(self):
        return self._timed(self._env.admissible_actions)


def trainer_mismatch(policy, episodes, temperature: float) -> float:
    """Mean |logp_sampler - logp_trainer| over the sampled tokens of every turn."""
    rows = [row for ep in episodes for row in ep.rows()]
    total, count = 0.0, 0
    for s in range(0, len(rows), 8):
        batch = collate(rows[s : s + 8], torch.zeros(len(rows[s : s + 8])), policy.tokenizer.pad_token_id, policy.device)
        with torch.no_grad():
            logp, _ = shared_prefix_logprobs(policy.causal_lm, batch.input_ids, batch.attention_mask, batch.action_mask, temperature)
        total += float(((logp - batch.sample_logprobs).abs() * batch.action_mask).sum())
        count += int(batch.action_mask.sum())
    return total / max(count, 1)


def play(game: str, args) -> dict:
    rel, run_flag = GAMES[game]
    warm = getattr(args, run_flag)
    overrides = [f"model.name={args.model}"] if args.model else []
    if args.group_size:
        overrides.append(f"train.group_size={args.group_size}")
    use_warm = bool(warm) and Path(warm, "config.toml").exists() and not args.model
    cfg = load_config(REPO / rel, overrides + [f"init.from_run={warm if use_warm else ''}"])
    init_dir = init_weights_dir(cfg) if cfg.init.from_run else None
    policy = load_policy(cfg.model, base_dir=init_dir)
    clock_ref = [Clock()]
    pool = EnvPool(lambda: TimedEnv(make_env(cfg.env.name, **cfg.env.kwargs), clock_ref))
    sampling = SamplingParams(cfg.sampling.max_new_tokens, cfg.sampling.temperature, cfg.sampling.top_p, tuple(cfg.sampling.stop))
    B, G = cfg.train.prompts_per_step, cfg.train.group_size
    paths = args.paths.split(",")
    engines = {p: NativeEngine(policy, **PATHS[p]) for p in paths}
    recs = {p: {"path": p, "rollout_s": [], "episodes": [], "turns": [], "gen_tokens": [], "prefill_tokens": [], "reused_tokens": [],
                "profile": [], "agree": [], "mismatch": None} for p in paths}
    print(f"{game}: {cfg.env.name}, weights {init_dir or cfg.model.name}, B={B} G={G}, paths {paths}", flush=True)
    for rep in range(args.repeats):
        seeds = train_seeds(cfg, rep)
        order = paths[rep % len(paths):] + paths[: rep % len(paths)]
        played = {}
        for p in order:
            engine = engines[p]
            clock = clock_ref[0] = Clock()
            hooks = clock.hook(engine.module)
            streams = group_generators(step_generator(cfg.train.seed, rep), B)
            t = time.perf_counter()
            ero = rollout_episodes(policy, pool, seeds, G, sampling, streams, cfg.model.system_prompt, cfg.agent, engine=engine)
            dt = time.perf_counter() - t
            for h in hooks:
                h.remove()
            played[p] = ero
            rec = recs[p]
            rec["rollout_s"].append(dt)
            rec["episodes"].append(len(ero.episodes))
            rec["turns"].append(sum(len(e.turns) for e in ero.episodes))
            rec["gen_tokens"].append(ero.stats.generated_tokens)
            rec["prefill_tokens"].append(ero.stats.prefill_tokens)
            rec["reused_tokens"].append(ero.stats.prefix_reused_tokens)
            prof = {k: round(v, 3) for k, v in clock.s.items()}
            prof["other"] = round(dt - sum(clock.s.values()), 3)
            prof["prefill_calls"], prof["decode_calls"] = clock.calls["prefill"], clock.calls["decode"]
            rec["profile"].append(prof)
            print(f"  {game} rep {rep} {p:16s} {dt:7.1f} s  {len(ero.episodes)} episodes, {rec['turns'][-1]} turns, {ero.stats.generated_tokens} tokens, "
                  f"prefill {ero.stats.prefill_tokens} (+{ero.stats.prefix_reused_tokens} reused)  profile {prof}", flush=True)
        if "current" in played:
            ref = played["current"]
            for p, ero in played.items():
                pairs = [(a.action_ids, b.action_ids) for ea, eb in zip(ref.episodes, ero.episodes) for a, b in zip(ea.turns, eb.turns)]
                same_len = all(len(ea.turns) == len(eb.turns) for ea, eb in zip(ref.episodes, ero.episodes))
                recs[p]["agree"].append(round(sum(a == b for a, b in pairs) / max(len(pairs), 1), 4) if same_len else
                                        round(sum(a == b for a, b in pairs) / max(sum(len(e.turns) for e in ref.episodes), 1), 4))
        if rep == 0:
            for p, ero in played.items():
                if p not in args.mismatch_paths.split(","):
                    continue
                recs[p]["mismatch"] = trainer_mismatch(policy, ero.episodes, sampling.temperature)
                print(f"  {game} {p}: mismatch {recs[p]['mismatch']:.2e}", flush=True)
    pool.close()
    out = {"game": game, "env": cfg.env.name, "env_kwargs": cfg.env.kwargs, "weights": str(init_dir or cfg.model.name), "B": B, "G": G,
           "max_new_tokens": sampling.max_new_tokens, "paths": {}}
    for p, rec in recs.items():
        s = sum(rec["rollout_s"])
        rec["episodes_per_min"] = 60 * sum(rec["episodes"]) / s
        rec["gen_tokens_per_s"] = sum(rec["gen_tokens"]) / s
        rec["turns_per_min"] = 60 * sum(rec["turns"]) / s
        out["paths"][p] = rec
    if "current" in recs:
        base = recs["current"]
        out["ratios"] = {
            p: {
                "episodes_per_min": rec["episodes_per_min"] / base["episodes_per_min"],
                "per_repeat": [b / a for a, b in zip(rec["rollout_s"], base["rollout_s"])],  # time(current) / time(path), same episodes
            }
            for p, rec in recs.items() if p != "current"
        }
    return out


def write_md(res: dict, path: Path) -> None:
    lines = ["# Multi-turn rollout throughput", "", f"`{res['command']}` ({res['date']}, {res['machine']}).", "", res["note"], ""]
    for g in res["games"]:
        lines += [f"## {g['game']} (`{g['env']}`, {g['weights']}; B = {g['B']} x G = {g['G']}, replies <= {g['max_new_tokens']} tokens)", ""]
        lines += ["| path | episodes/min | gen tok/s | turns/min | x current (episodes/min) | per repeat | agree | mismatch | prefill tokens (+reused) |",
                  "|---|---:|---:|---:|---:|---|---:|---:|---|"]
        for p, rec in g["paths"].items():
            ratio = g.get("ratios", {}).get(p)
            x = "1.00" if p == "current" else (f"{ratio['episodes_per_min']:.2f}" if ratio else "-")
            lines.append(
                f"| {p} | {rec['episodes_per_min']:.2f} | {rec['gen_tokens_per_s']:.1f} | {rec['turns_per_min']:.1f} | "
                f"{x} | "
                f"{', '.join(f'{r:.2f}' for r in ratio['per_repeat']) if ratio else '-'} | "
                f"{statistics.mean(rec['agree']) if rec['agree'] else float('nan'):.3f} | "
                f"{rec['mismatch'] if rec['mismatch'] is not None else float('nan'):.1e} | "
                f"{sum(rec['prefill_tokens'])} (+{sum(rec['reused_tokens'])}) |"
            )
        lines += ["", "Profile (seconds summed over the repeats; prefill/decode = decoder forwards of >1 / 1 position per row):", "",
                  "| path | total | prefill (calls) | decode (calls) | lm_head | games | other |", "|---|---:|---:|---:|---:|---:|---:|"]
        for p, rec in g["paths"].items():
            pr = {k: sum(x[k] for x in rec["profile"]) for k in rec["profile"][0]}
            lines.append(f"| {p} | {sum(rec['rollout_s']):.1f} | {pr['prefill']:.1f} ({pr['prefill_calls']}) | {pr['decode']:.1f} ({pr['decode_calls']}) | "
                         f"{pr['lm_head']:.1f} | {pr['env']:.1f} | {pr['other']:.1f} |")
        lines.append("")
    path.write_text("\n".join(lines) + "\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--games", default="twx,household")
    ap.add_argument("--paths", default="current,continuous,continuous-bf16")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--group-size", type=int, default=0, help="G (default: the example config's)")
    ap.add_argument("--model", default="", help="override model.name (e.g. tiny-random; no warm start then)")
    ap.add_argument("--twx-run", default="/work/main/runs/twx_twc_sft", help="SFT warm start for twx:twc (read only; skipped when absent)")
    ap.add_argument("--household-run", default="/work/main/runs/household_sft", help="SFT warm start for household (skipped when absent)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--mismatch-paths", default="continuous-bf16", help="paths whose first repeat the trainer re-scores (mean |logp_sampler - logp_trainer|)")
    ap.add_argument("--merge", default="", help="comma-separated result folders of earlier runs (e.g. one per game): write their games together to --out and exit")
    ap.add_argument("--note", default="", help="a line for the report (e.g. the machine's load)")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    os.environ.setdefault("RECURSA_DEVICE", "cpu")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.merge:
        parts = [json.loads((Path(d) / "rollout_throughput.json").read_text()) for d in args.merge.split(",")]
        res = {"command": " ; ".join(p["command"] for p in parts), "date": parts[-1]["date"], "machine": parts[0]["machine"],
               "load_avg_end": [p["load_avg_end"] for p in parts], "note": parts[0]["note"], "games": [g for p in parts for g in p["games"]]}
        (out / "rollout_throughput.json").write_text(json.dumps(res, indent=1, default=str))
        write_md(res, out / "rollout_throughput.md")
        return 0
    games = []
    for g in args.games.split(","):  # results are written after each game
        games.append(play(g, args))
        res = {
            "command": "python " + " ".join(sys.argv),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "machine": f"{platform.processor() or platform.machine()}, {args.threads} threads, torch {torch.__version__}",
            "load_avg_end": os.getloadavg(),
            "note": args.note,
            "games": games,
        }
        (out / "rollout_throughput.json").write_text(json.dumps(res, indent=1, default=str))
        write_md(res, out / "rollout_throughput.md")
    for g in games:
        for p, r in g.get("ratios", {}).items():
            print(f"{g['game']}: {p} / current = {r['episodes_per_min']:.2f}x episodes per minute")
    return 0


if __name__ == "__main__":
    sys.exit(main())
