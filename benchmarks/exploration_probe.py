#!/usr/bin/env python
"""Can RL find the winning path? The warm start's probability of the oracle's actions.

GRPO learns only from groups whose episodes differ in outcome. This probe asks, per task
type of a game, how likely the warm-start policy is to *sample* a winning path at all: it
plays each game's oracle walkthrough and, at every turn, scores the walkthrough's action
(reply tokens plus the end-of-turn token) under the policy's prompt for that turn, at
several sampling temperatures (exact: the logits divided by T before the softmax, as the
sampler does). Reported per task type, averaged over games:

* `log10 P(walkthrough)`: the log-probability of replaying the whole walkthrough (a lower
  bound on winning: other paths may win too);
* the worst turn: the smallest per-turn probability of the oracle action, and the share of
  games where some group of G samples would contain it at that turn, 1 - (1 - p)^G;
* the oracle action's rank among the admissible actions at that turn (T = 1).

    python benchmarks/exploration_probe.py                    # household from runs/household_sft
    python benchmarks/exploration_probe.py --games 12 --temperatures 1,1.5,2

Games come from the train split (what RL would play). Writes
benchmarks/results/exploration_probe.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

TASKS = ["pick_and_place", "heat_then_place", "cool_then_place", "clean_then_place"]


def sequence_logprobs(model, prompt: list[int], replies: list[list[int]], temperatures: list[float]):
    """{T: [log p_T(reply | prompt) for each reply]} from one batched forward."""
    import torch

    rows = [prompt + r for r in replies]
    width = max(len(r) for r in rows)
    ids = torch.zeros((len(rows), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
        mask[i, : len(r)] = 1
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits.float()  # (N, L, V)
    out = {}
    for t in temperatures:
        lp = torch.log_softmax(logits / t, dim=-1)
        values = []
        for i, r in enumerate(replies):
            start = len(prompt)
            positions = torch.arange(start - 1, start - 1 + len(r))
            values.append(lp[i, positions, torch.tensor(r)].sum().item())
        out[t] = values
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--warm-start", default="runs/household_sft", help="the SFT run whose last checkpoint is probed")
    p.add_argument("--games", type=int, default=8, help="train-split games per task type")
    p.add_argument("--temperatures", default="1,1.5,2")
    p.add_argument("--group-size", type=int, default=8, help="G, for the chance that a group samples the oracle action")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "exploration_probe"))
    args = p.parse_args(argv)
    temps = [float(t) for t in args.temperatures.split(",")]

    import torch

    from recursa.agent import AgentConfig, render_turn
    from recursa.config import load_config
    from recursa.envs import make_env, split_seed
    from recursa.models import load_policy
    from recursa.recipes.common import init_weights_dir
    from recursa.rollout import render_prompt, system_prompt_of

    torch.manual_seed(0)
    cfg = load_config(None, ["model.name=smollm2-135m-instruct", 'env.name="household"', f'init.from_run="{args.warm_start}"'], recipe="grpo")
    policy = load_policy(cfg.model, base_dir=init_weights_dir(cfg))
    model, tok = policy.causal_lm.eval(), policy.tokenizer
    end = tok.convert_tokens_to_ids("<|im_end|>")
    agent = AgentConfig(history_turns=1)  # the benchmark's prompt format
    t0 = time.perf_counter()
    rows = []
    for task in TASKS:
        env = make_env("household", rooms=1, objects_per_room=2, distractors=0, tasks=[task], max_steps=12)
        for k in range(args.games):
            seed = split_seed("train", 7_000_000 + k)  # fixed, and far from the seeds SFT imitated
            obs = env.reset(seed)
            walkthrough, history, turns = env.walkthrough(), [], []
            for action in walkthrough:
                admissible = env.admissible_actions()
                prompt = render_prompt(tok, render_turn(env.task, obs, admissible, history, agent), system_prompt_of(env))
                candidates = [action] + [a for a in admissible if a != action]
                replies = [tok(c, add_special_tokens=False)["input_ids"] + [end] for c in candidates]
                lps = sequence_logprobs(model, prompt, replies, sorted({1.0, *temps}))
                rank = sorted(range(len(candidates)), key=lambda i: -lps[1.0][i]).index(0)  # 0: the policy's favourite
                turns.append({"action": action, "rank": rank, **{f"logp_T{t:g}": lps[t][0] for t in lps}})
                result = env.step(action)
                history.append((obs, action))
                obs = result.obs
            rows.append({"task": task, "seed": seed, "won": bool(result.info.get("success")), "turns": turns})
            print(f"{task:>17} game {k}: log10 P(walkthrough) at T=1 {sum(t['logp_T1'] for t in turns) / math.log(10):.1f}", flush=True)
    summary = {}
    for task in TASKS:
        games = [r for r in rows if r["task"] == task]
        entry = {"games": len(games)}
        for t in temps:
            key = f"logp_T{t:g}"
            total = [sum(x[key] for x in g["turns"]) / math.log(10) for g in games]
            worst = [min(g["turns"], key=lambda x: x[key]) for g in games]
            hit = [1 - (1 - math.exp(w[key])) ** args.group_size for w in worst]
            entry[f"T{t:g}"] = {"log10_p_walkthrough": sum(total) / len(total), "worst_turn_p": sum(math.exp(w[key]) for w in worst) / len(worst),
                                "group_hits_worst_turn": sum(hit) / len(hit)}
        worst1 = [min(g["turns"], key=lambda x: x["logp_T1"]) for g in games]
        entry["worst_turn_actions"] = sorted({w["action"].split()[0] for w in worst1})
        entry["worst_turn_rank_mean"] = sum(w["rank"] for w in worst1) / len(worst1)
        summary[task] = entry
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    record = {"warm_start": args.warm_start, "temperatures": temps, "group_size": args.group_size, "summary": summary, "games": rows,
              "wall_s": round(time.perf_counter() - t0, 1), "torch": torch.__version__}
    out.with_suffix(".json").write_text(json.dumps(record, indent=1) + "\n")
    lines = [f"# Can RL find the winning path? household, from `{args.warm_start}`", "",
             f"Command: `python benchmarks/exploration_probe.py --games {args.games} --temperatures {args.temperatures}`; "
             f"{args.games} train-split games per task type; the oracle walkthrough scored turn by turn under the policy's own prompts.", "",
             "| task type | " + " | ".join(f"T={t:g}: log10 P(walkthrough) / worst-turn p / a group of {args.group_size} samples it" for t in temps)
             + " | worst turn's verb (rank among admissible, T=1) |",
             "|---|" + "---|" * len(temps) + "---|"]
    for task, e in summary.items():
        cells = [f"{e[f'T{t:g}']['log10_p_walkthrough']:.1f} / {e[f'T{t:g}']['worst_turn_p']:.2g} / {e[f'T{t:g}']['group_hits_worst_turn']:.2f}" for t in temps]
        lines.append(f"| {task} | " + " | ".join(cells) + f" | {', '.join(e['worst_turn_actions'])} ({e['worst_turn_rank_mean']:.1f}) |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
