#!/usr/bin/env python
"""Which hint lets the policy win a game it always loses? The ceiling of hinted re-rolls.

RSIPO's `[hatch]` re-rolls every group whose G episodes all lost with a hint in the prompt,
and trains on the re-rolls' tokens under the un-hinted prompt. A re-roll only carries signal
when it wins (0/1 rewards, an all-fail group's mean is 0), and then only as much of it as the
importance weight w_t = min(pi(a_t | no hint) / pi(a_t | hint), cap) lets through. This probe
measures both on the warm start, without training. It plays G sampled episodes of each game
(as RL would), takes the games where all G lost, and re-rolls each of them k times per hint:

* `none`: no hint, k more sampled episodes (how often a lost game is won by chance);
* `win`: `hatch.hint = "win"`, the actions of the policy's own most similar winning episode
  (BM25 over task lines; the buffer is every episode this probe played before the re-rolls,
  all task types together, as a training step's buffer holds recent steps);
* `reflection`: `hatch.hint = "reflection"`, advice the policy writes on one failed episode;
* `alike_walkthrough`: the walkthrough of the most alike of 32 other training games (BM25
  over task lines; the games `examples/household_sft_light.toml` learns from), in the form of
  `win` -- what `data.win_hints` teaches a warm start to read (a deployed agent could carry
  such a library of demonstrations);
* `oracle_walkthrough`: the game's walkthrough (an ablation only: a deployed agent never has it).

Per hint it reports the re-rolls won (Wilson 95% interval), the lost games won at least once,
per task type, and over the winning re-rolls' action tokens the mean importance weight and
the share truncated at the cap (what of a hinted win reaches the un-hinted policy). Each lost
re-roll gets a failure mode (`failure_mode`): it took nothing, took another object than the
task's, put the object down before the step the task needs (heat / cool / clean), did
another step, or something else.

    python benchmarks/hint_probe.py                         # household from runs/household_sft_light
    python benchmarks/hint_probe.py --games 4 --rerolls 4 --hints none,win
    python benchmarks/hint_probe.py --from-json benchmarks/results/hint_probe.json   # rebuild the .md only
    python benchmarks/hint_probe.py --eval runs/household_sft_light/eval/after.json runs/household_sft_search/eval/after.json

Games come from the train split (what RL plays), the same seeds and re-roll generator seed for
every hint. Writes benchmarks/results/hint_probe.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

TASKS = ["pick_and_place", "heat_then_place", "cool_then_place", "clean_then_place"]
HINTS = ("none", "win", "reflection", "alike_walkthrough", "oracle_walkthrough")
LIBRARY_GAMES = 32  # alike_walkthrough: train seeds 0..31, the light and hinted warm starts' demonstration games
FIRST_SEED = 7_300_000  # train-split games, away from teacher_probe's and exploration_probe's


def lost_games(successes: list[bool], group_size: int) -> list[int]:
    """Indices of the groups (consecutive runs of `group_size` episodes) that won no episode."""
    return [g for g in range(len(successes) // group_size) if not any(successes[g * group_size : (g + 1) * group_size])]


def summarise(rerolls: list[dict], cap: float) -> dict:
    """One hint's summary from its re-roll records ({task, seed, hinted, won, weights: the
    importance weights of the episode's action tokens, untruncated}); re-rolls without a hint
    (none found for their game) count as not played."""
    from recursa.stats import wilson_interval

    played = [r for r in rerolls if r["hinted"]]
    won = [r for r in played if r["won"]]
    weights = [w for r in won for w in r["weights"]]
    games = {(r["task"], r["seed"]) for r in played}
    won_games = {(r["task"], r["seed"]) for r in won}
    by_task = {}
    for task in dict.fromkeys(r["task"] for r in rerolls):
        mine = [r for r in played if r["task"] == task]
        by_task[task] = {"won": sum(r["won"] for r in mine), "played": len(mine)}
    lo, hi = wilson_interval(len(won), len(played)) if played else (None, None)
    return {
        "rerolls": len(played), "won": len(won), "win_rate": len(won) / len(played) if played else None, "interval": [lo, hi],
        "games": len(games), "games_won": len(won_games), "unhinted_games": len({(r["task"], r["seed"]) for r in rerolls} - games),
        "by_task": by_task,
        "weight_mean": sum(min(w, cap) for w in weights) / len(weights) if weights else None,
        "truncated_frac": sum(w > cap for w in weights) / len(weights) if weights else None,
    }


FAILURES = ("took nothing", "took another object", "placed it before the step", "did the wrong step", "other")
STEP_OF = {"hot": "heat", "cool": "cool", "clean": "clean"}  # the task line's adjective -> the action it needs


def failure_mode(task_line: str, actions: list[str]) -> str:
    """Why a lost household episode lost, read from its task line ("put a hot apple on the
    countertop.") and its actions, first match wins: it never took an object; the first object
    it took is not the task's; after taking it, it put it down before the step the task needs
    (heat / cool / clean); its first step on it was another one (cooled a hot task's apple);
    anything else (took it and did the step, then ran out of turns or looped) is "other"."""
    import re

    m = re.search(r"put (?:a|an|some) (?:(hot|cool|clean) )?(\w+) (?:in|on) ", task_line)
    if m is None:
        return "other"
    need, goal = STEP_OF.get(m.group(1) or ""), m.group(2)
    taken = [i for i, a in enumerate(actions) if a.startswith("take ")]
    if not taken:
        return "took nothing"
    if actions[taken[0]].split()[1:2] != [goal]:
        return "took another object"
    if need is None:
        return "other"
    for a in actions[taken[0] + 1:]:
        words = a.split()
        if words[:1] == ["put"] and words[1:2] == [goal]:
            return "placed it before the step"
        if words[:1] and words[0] in STEP_OF.values() and words[1:2] == [goal]:
            return "other" if words[0] == need else "did the wrong step"
    return "other"


def failure_modes(records: list[dict], task_line) -> dict[str, dict[str, int]]:
    """{task type: {failure: lost re-rolls}} over the hinted re-rolls that lost; `task_line(task,
    seed)` gives a game's task line."""
    out: dict[str, dict[str, int]] = {}
    for r in records:
        if r["hinted"] and not r["won"] and r.get("actions") is not None:
            mode = failure_mode(task_line(r["task"], r["seed"]), r["actions"])
            row = out.setdefault(r["task"], dict.fromkeys(FAILURES, 0))
            row[mode] += 1
    return out


def hints_for(kind: str, policy, cfg, attempts: list, lost: list[int], group_size: int, buffer: list, pool, system, gen) -> list[str | None]:
    """The hint each lost game is re-rolled with under `kind` (None: not re-rolled)."""
    from recursa.recipes.rsipo import oracle_hint, reflection_hints, win_hints

    firsts = [attempts[g * group_size] for g in lost]
    if kind == "none":
        return [""] * len(lost)  # played without a hint; "" marks "re-roll" (the rollout shows no hint for a falsy one)
    if kind == "win":
        return win_hints([a.task for a in firsts], buffer, True, cfg.teacher.max_hint_chars)
    if kind == "reflection":  # on the group's first failed episode (training draws one at random)
        return reflection_hints(policy, firsts, cfg, system, gen)
    if kind == "alike_walkthrough":
        return alike_walkthroughs([a.task for a in firsts], pool.take(1)[0].__class__, cfg.teacher.max_hint_chars)
    env = pool.take(1)[0]
    return [oracle_hint(env, a.seed, True, 0, cfg.teacher.max_hint_chars) for a in firsts]


def alike_walkthroughs(tasks: list[str], env_cls, limit: int) -> list[str | None]:
    """For each task line, the walkthrough of the most alike of the LIBRARY_GAMES training
    games of all four task types (BM25 over task lines, ties to the first), as a win hint."""
    from recursa.agent import win_hint
    from recursa.envs.base import split_seeds
    from recursa.skills.retrieval import BM25Index

    env = env_cls(rooms=1, objects_per_room=2, distractors=0, tasks=TASKS, max_steps=12)
    library = []
    for seed in split_seeds("train", LIBRARY_GAMES):
        env.reset(seed)
        library.append((env.task, env.walkthrough()))
    index = BM25Index().build([t for t, _ in library])
    out: list[str | None] = []
    for task in tasks:
        top = index.top_k(task, 1)
        out.append(win_hint(*library[top[0][0]], limit) if top else None)
    return out


def probe(policy, cfg, pools: dict, seeds: dict, hints: list[str], group_size: int, rerolls: int, cap: float, log=print) -> tuple[dict, list[dict]]:
    """Play every task type's games, then re-roll the lost ones under each hint.
    Returns ({hint: summary}, per-game records)."""
    import torch

    from recursa.distributed.rollouts import LocalRollouts
    from recursa.generation import SamplingParams
    from recursa.recipes.rsipo import episode_attempts, score_actions, user_message
    from recursa.rollout import render_prompt, system_prompt_of

    sampling = SamplingParams(cfg.sampling.max_new_tokens, cfg.sampling.temperature, cfg.sampling.top_p, tuple(cfg.sampling.stop))
    tok, G = policy.tokenizer, group_size
    played, games = {}, []
    for task, pool in pools.items():  # first pass: G episodes per game, no hint
        system = system_prompt_of(pool.take(1)[0]) or cfg.model.system_prompt or None
        ro = LocalRollouts(policy, pool).episodes(seeds[task], G, sampling, torch.Generator().manual_seed(0), system, cfg.agent)
        attempts = episode_attempts(ro.episodes, 0, cfg.agent)
        played[task] = (attempts, system)
        wins = [a.success for a in attempts]
        for g, seed in enumerate(seeds[task]):
            games.append({"task": task, "seed": seed, "wins": sum(wins[g * G : (g + 1) * G]), "group_size": G})
        log(f"{task:>17}: {sum(wins)}/{len(wins)} episodes won, {len(lost_games(wins, G))} of {len(seeds[task])} games lost every episode")
    buffer = [a for attempts, _ in played.values() for a in attempts]
    records: dict[str, list[dict]] = {h: [] for h in hints}
    for task, pool in pools.items():
        attempts, system = played[task]
        lost = lost_games([a.success for a in attempts], G)
        if not lost:
            continue
        for kind in hints:
            gen = torch.Generator().manual_seed(1)  # the same draws for every hint
            shown = hints_for(kind, policy, cfg, attempts, lost, G, buffer, pool, system, gen)
            chosen = [(g, h) for g, h in zip(lost, shown) if h is not None]
            for g, h in zip(lost, shown):
                if h is None:
                    records[kind] += [{"task": task, "seed": seeds[task][g], "hinted": False, "won": False, "weights": []}] * rerolls
            if not chosen:
                continue
            ro = LocalRollouts(policy, pool).episodes([seeds[task][g] for g, _ in chosen], rerolls, sampling, gen, system, cfg.agent,
                                                      hints=[h or None for _, h in chosen])
            again = episode_attempts(ro.episodes, 0, cfg.agent)
            jobs, where = [], []  # winning re-rolls of a real hint: each turn's actions under the un-hinted and the hinted prompt
            for i, (e, a) in enumerate(zip(ro.episodes, again)):
                if a.success and kind != "none":
                    for turn, ctx in zip(e.turns, a.contexts):
                        jobs += [(render_prompt(tok, user_message(ctx, cfg.agent), system), list(turn.action_ids)), (list(turn.prompt_ids), list(turn.action_ids))]
                        where.append(i)
            scored = score_actions(policy, jobs, cfg) if jobs else []
            weights: dict[int, list[float]] = {}
            for k, i in enumerate(where):
                weights.setdefault(i, []).extend(torch.exp(scored[2 * k] - scored[2 * k + 1]).tolist())
            for i, a in enumerate(again):
                records[kind].append({"task": task, "seed": a.seed, "hinted": True, "won": a.success, "weights": weights.get(i, []),
                                      "hint": chosen[i // rerolls][1] or None, "actions": a.texts})
            log(f"{task:>17} {kind:>18}: {sum(a.success for a in again)}/{len(again)} re-rolls won")
    return {h: {**summarise(records[h], cap), "records": records[h]} for h in hints}, games


def household_task_line(task: str | None, seed: int) -> str:
    """The task line of a game of the environment the probe and the household warm starts
    play: one task type's (`task`), or all four's (None, as the warm starts' evaluations)."""
    from recursa.envs import make_env

    env = make_env("household", rooms=1, objects_per_room=2, distractors=0, tasks=[task] if task else TASKS, max_steps=12)
    env.reset(seed)
    return env.task


def eval_report(paths: list[str]) -> list[str]:
    """Success and the failure modes of the lost games of evaluation files (a household warm
    start's `eval/after.json`, or a benchmark run's result file, whose final evaluation is
    `heldout`: greedy episodes of the 4-task-type game, actions joined by " | "), one row
    each, with the paired comparison against the first when they share items."""
    from recursa.envs.household import HouseholdEnv
    from recursa.stats import mcnemar_exact, wilson_interval

    env = HouseholdEnv(rooms=1, objects_per_room=2, distractors=0, tasks=TASKS, max_steps=12)
    evals = [json.loads(Path(p).read_text()) for p in paths]
    evals = [ev.get("heldout", ev) for ev in evals]  # a benchmark run's file holds its final evaluation there
    lines = ["| evaluation | won [Wilson 95%] | paired with the first (b, c, p) | lost | " + " | ".join(FAILURES) + " |",
             "|---|---|---|---:|" + "---:|" * len(FAILURES)]
    first = {it["seed"]: it["success"] for it in evals[0]["items"]}
    for path, ev in zip(paths, evals):
        items = ev["items"]
        won = sum(it["success"] for it in items)
        lo, hi = wilson_interval(won, len(items))
        counts = dict.fromkeys(FAILURES, 0)
        for it in items:
            if not it["success"]:
                env.reset(it["seed"])
                counts[failure_mode(env.task, [a.strip() for a in it["completion"].split(" | ")])] += 1
        paired = "-"
        if path != paths[0] and {it["seed"] for it in items} == set(first):
            b = sum(it["success"] and not first[it["seed"]] for it in items)
            c = sum(first[it["seed"]] and not it["success"] for it in items)
            paired = f"{b}, {c}, {mcnemar_exact(b, c):.3f}"
        lines.append(f"| `{path}` | {won}/{len(items)} [{lo:.2f}, {hi:.2f}] | {paired} | {len(items) - won} | "
                     + " | ".join(str(counts[m]) for m in FAILURES) + " |")
    return lines


def report(record: dict) -> list[str]:
    """The markdown report's lines, from a probe's JSON record."""
    def f(x, spec=".2f"):
        return "-" if x is None else format(x, spec)

    games, hints, cap = record["games"], list(record["hints"]), record["is_cap"]
    won = sum(g["wins"] for g in games)
    lost = sum(g["wins"] == 0 for g in games)
    lines = [f"# Which hint wins a game the policy always loses? household, from `{record['warm_start'] or record['model']}`", "",
             f"Command: `python benchmarks/hint_probe.py{' --warm-start ' + record['warm_start'] if record['warm_start'] else ' --tiny'} "
             f"--games {record['games_per_task']} --group-size {record['group_size']} --rerolls {record['rerolls']} --hints {','.join(hints)}`; "
             f"{record['games_per_task']} train-split games per task type x {record['group_size']} sampled episodes (T = 1), {won}/{record['group_size'] * len(games)} won; "
             f"{lost} of {len(games)} games lost every episode, each re-rolled {record['rerolls']} times per hint; {record['wall_s']:.0f} s.", "",
             "| hint | re-rolls won [Wilson 95%] | lost games won at least once | games with no hint | "
             + " | ".join(TASKS) + f" | importance weight on winning tokens (cap {cap:g}) | share truncated |",
             "|---|---|---:|---:|" + "---:|" * len(TASKS) + "---:|---:|"]
    for h, e in record["hints"].items():
        lo, hi = e["interval"]
        per = " | ".join(f"{e['by_task'].get(t, {}).get('won', 0)}/{e['by_task'].get(t, {}).get('played', 0)}" for t in TASKS)
        lines.append(f"| {h} | {e['won']}/{e['rerolls']} = {f(e['win_rate'])} [{f(lo)}, {f(hi)}] | {e['games_won']}/{e['games']} | {e['unhinted_games']} "
                     f"| {per} | {f(e['weight_mean'])} | {f(e['truncated_frac'])} |")
    modes = {h: failure_modes(e.get("records", []), household_task_line) for h, e in record["hints"].items()}
    if any(modes.values()):
        lines += ["", "Why the lost re-rolls lost (`failure_mode`: the first object taken, then the first thing done with it):", "",
                  "| | lost re-rolls | " + " | ".join(FAILURES) + " |", "|---|---:|" + "---:|" * len(FAILURES)]
        rows = [(f"hint `{h}`", {m: sum(t[m] for t in by.values()) for m in FAILURES}) for h, by in modes.items()]
        rows += [(task, {m: sum(by.get(task, {}).get(m, 0) for by in modes.values()) for m in FAILURES}) for task in TASKS]
        for name, counts in rows:
            lines.append(f"| {name} | {sum(counts.values())} | " + " | ".join(str(counts[m]) for m in FAILURES) + " |")
        lines.append("")
        lines.append("Task-type rows sum over the hints.")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--warm-start", default="runs/household_sft_light", help="the SFT run whose last checkpoint is probed")
    p.add_argument("--games", type=int, default=6, help="train-split games per task type")
    p.add_argument("--group-size", type=int, default=8, help="G: episodes per game in the first pass")
    p.add_argument("--rerolls", type=int, default=4, help="k: hinted episodes per lost game and hint")
    p.add_argument("--hints", default=",".join(HINTS), help=f"comma-separated, from {', '.join(HINTS)}")
    p.add_argument("--is-cap", type=float, default=2.0, help="hatch.is_cap: the importance weight's truncation")
    p.add_argument("--threads", type=int, default=2, help="torch threads (1 beside another run on a 2-core machine)")
    p.add_argument("--tiny", action="store_true", help="the tiny random model (checks the script; its episodes rarely win)")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "hint_probe"))
    p.add_argument("--from-json", help="rebuild the .md next to this committed .json (no games played)")
    p.add_argument("--eval", nargs="+", metavar="EVAL_JSON", help="instead: the failure modes of the lost games in these evaluation "
                   "files (e.g. runs/household_sft_light/eval/after.json), paired with the first (no games played)")
    args = p.parse_args(argv)
    if args.eval:
        print("\n".join(eval_report(args.eval)))
        return 0
    if args.from_json:
        src = Path(args.from_json)
        lines = report(json.loads(src.read_text()))
        src.with_suffix(".md").write_text("\n".join(lines) + "\n")
        print("\n".join(lines))
        return 0
    hints = [h for h in args.hints.split(",") if h]
    bad = [h for h in hints if h not in HINTS]
    if bad:
        raise SystemExit(f"--hints: unknown {', '.join(bad)}; choose from {', '.join(HINTS)}")

    import torch

    from recursa.config import load_config
    from recursa.envs import make_env
    from recursa.envs.base import EnvPool, split_seed
    from recursa.models import load_policy
    from recursa.recipes.common import init_weights_dir

    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    sets = ["model.name=tiny-random"] if args.tiny else ["model.name=smollm2-135m-instruct", f'init.from_run="{args.warm_start}"']
    sets += ['env.name="household"', "agent.history_turns=1", "sampling.temperature=1.0", f"sampling.max_new_tokens={5 if args.tiny else 12}",
             "train.micro_batch_size=16", 'teacher.source="none"', "teacher.lam=0"]
    cfg = load_config(None, sets, recipe="rsipo")  # skills.* as the recipe's defaults: the reflections are written with them
    policy = load_policy(cfg.model, base_dir=None if args.tiny else init_weights_dir(cfg))
    max_steps = 4 if args.tiny else 12
    pools = {t: EnvPool(lambda t=t: make_env("household", rooms=1, objects_per_room=2, distractors=0, tasks=[t], max_steps=max_steps)) for t in TASKS}
    seeds = {t: [split_seed("train", FIRST_SEED + 1000 * n + k) for k in range(args.games)] for n, t in enumerate(TASKS)}
    t0 = time.perf_counter()
    summary, games = probe(policy, cfg, pools, seeds, hints, args.group_size, args.rerolls, args.is_cap)
    wall = round(time.perf_counter() - t0, 1)
    record = {"warm_start": None if args.tiny else args.warm_start, "model": cfg.model.name, "games_per_task": args.games, "group_size": args.group_size,
              "rerolls": args.rerolls, "is_cap": args.is_cap, "hints": summary, "games": games, "wall_s": wall, "torch": torch.__version__}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(record, indent=1) + "\n")
    lines = report(record)
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
