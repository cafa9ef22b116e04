#!/usr/bin/env python
"""Does the self-teacher know better where it matters? Its preference at the critical turn.

RSIPO's teacher is the policy itself with extra text in its context (`teacher.source`: a
winning sibling's actions, SDPO; the game's walkthrough, OPSD). It can only help a failed
episode if, with that text, it prefers a better action than the policy did. This probe
measures that on the warm start, without training: it plays G episodes of each game
(sampled, as RL would), and for every failed episode whose group also won, finds the
critical turn (`recursa.algorithms.routing.divergence_turn`: the first turn where the failed
episode took another action than a winning sibling from the same state) and scores, with
and without each teacher's text, the two actions taken there. Reported per teacher source:

* `student prefers win`: the share of critical turns where the bare policy already gives the
  winner's action a higher log-probability than the failed one (the baseline);
* `teacher prefers win`: the same with the teacher's text in the context;
* `flips`: the critical turns where the text turns the preference toward the winner's action,
  and those where it turns it away;
* `margin shift`: the mean and median change the text makes to log p(win action) - log
  p(failed action), in nats (positive: the text moves the policy toward the winning action);
* on the critical turns where the game's walkthrough takes the winner's action: how many, and
  on how many of them the bare policy and the teacher prefer that action;
* `Delta at critical / before / after`: the teacher's token Delta = log pi(a | ctx + text) -
  log pi(a | ctx) on the failed episode's own actions, at the critical turn, on the turns
  before it (shared with the winner) and after it. The advantage-mode teacher adds psi(Delta)
  to these tokens, so a useful teacher gives the critical turn a clearly lower Delta than
  the others;
* `corr(Delta, A)`: over the episodes of groups that both won and failed (the only ones
  whose outcome advantage is not 0; the teacher is scored on these alone), the correlation
  of an episode's mean token Delta with its group-centred outcome advantage (training's
  `teacher/corr_delta_adv` uses the recipe's normalised advantage, so the two can differ).

    python benchmarks/teacher_probe.py                         # household from runs/household_sft_light
    python benchmarks/teacher_probe.py --games 8 --sources sibling,reference

Games come from the train split (what RL plays), the same seeds for every source. Writes
benchmarks/results/teacher_probe.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

TASKS = ["pick_and_place", "heat_then_place", "cool_then_place", "clean_then_place"]
FIRST_SEED = 7_100_000  # train-split games, far from the seeds the warm start imitated and from exploration_probe's


def critical_pairs(attempts: list, group_size: int) -> list[tuple[int, int, int]]:
    """(failed attempt, winning sibling, critical turn) for every failed attempt of a group
    that also won, paired with the first winner of its group whose path it left from a
    state both shared; attempts are grouped: group g holds [g * G, (g + 1) * G)."""
    from recursa.algorithms.routing import divergence_turn

    out = []
    for i, a in enumerate(attempts):
        if a.success:
            continue
        first = i - i % group_size
        for j in range(first, first + group_size):
            w = attempts[j]
            if not w.success:
                continue
            turn = divergence_turn([(c.observation, t) for c, t in zip(a.contexts, a.texts)],
                                   [(c.observation, t) for c, t in zip(w.contexts, w.texts)])
            if turn is not None:
                out.append((i, j, turn))
                break
    return out


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def pearson(x: list[float], y: list[float]) -> float | None:
    """Pearson correlation (recursa.algorithms.self_reward.pearson); None for fewer than 3
    points or a constant side."""
    from recursa.algorithms.self_reward import pearson as corr

    r = corr(x, y) if len(x) >= 3 else float("nan")
    return None if math.isnan(r) else r


def summarise(turns: list[dict], episodes: list[dict]) -> dict:
    """One source's summary from its critical-turn records (student / teacher log-probs of the
    failed and the winning action, the failed episode's token Delta at / before / after the
    critical turn) and its per-episode (mean Delta, advantage) records."""
    n = len(turns)
    student = [t["student_win"] > t["student_fail"] for t in turns]
    teacher = [t["teacher_win"] > t["teacher_fail"] for t in turns]
    shifts = [(t["teacher_win"] - t["teacher_fail"]) - (t["student_win"] - t["student_fail"]) for t in turns]
    agree = [k for k, t in enumerate(turns) if t.get("walkthrough_action") == t["win_action"]]
    return {
        "critical_turns": n,
        "student_prefers_win": _mean([float(x) for x in student]),
        "teacher_prefers_win": _mean([float(x) for x in teacher]),
        "margin_shift": _mean(shifts),
        "margin_shift_median": statistics.median(shifts) if n else None,
        "flips_to_win": sum(t and not s for s, t in zip(student, teacher)),
        "flips_to_fail": sum(s and not t for s, t in zip(student, teacher)),
        # the turns where the game's walkthrough takes the winner's action: how often each side prefers it there
        "walkthrough_is_win": len(agree),
        "student_prefers_win_there": sum(student[k] for k in agree),
        "teacher_prefers_win_there": sum(teacher[k] for k in agree),
        "delta_critical": _mean([t["delta_at"] for t in turns]),
        "delta_before": _mean([t["delta_before"] for t in turns if t["delta_before"] is not None]),
        "delta_after": _mean([t["delta_after"] for t in turns if t["delta_after"] is not None]),
        "episodes_with_text": len(episodes),
        "corr_delta_advantage": pearson([e["delta"] for e in episodes], [e["advantage"] for e in episodes]),
    }


def walkthrough_action(pool, seed: int, turn: int) -> str | None:
    """The game's walkthrough action at `turn` (None past its end)."""
    env = pool.take(1)[0]
    env.reset(seed)
    plan = env.walkthrough()
    return plan[turn] if turn < len(plan) else None


def probe(policy, cfg, pools: dict, seeds: dict, sources: list[str], group_size: int, log=print) -> tuple[dict, list[dict]]:
    """Play every task type's games, then score each source's teacher on the same episodes.
    Returns ({source: summary}, per-game records)."""
    import torch

    from recursa.distributed.rollouts import LocalRollouts
    from recursa.generation import SamplingParams
    from recursa.recipes.rsipo import episode_attempts, score_actions, teacher_hints, user_message
    from recursa.rollout import render_prompt, system_prompt_of

    sampling = SamplingParams(cfg.sampling.max_new_tokens, cfg.sampling.temperature, cfg.sampling.top_p, tuple(cfg.sampling.stop))
    tok, G = policy.tokenizer, group_size
    turns: dict[str, list[dict]] = {s: [] for s in sources}
    eps: dict[str, list[dict]] = {s: [] for s in sources}
    games = []
    for task, pool in pools.items():
        system = system_prompt_of(pool.take(1)[0]) or cfg.model.system_prompt or None
        gen = torch.Generator().manual_seed(0)
        ro = LocalRollouts(policy, pool).episodes(seeds[task], G, sampling, gen, system, cfg.agent)
        attempts = episode_attempts(ro.episodes, 0, cfg.agent)
        pairs = critical_pairs(attempts, G)
        wins = [a.success for a in attempts]
        mixed = [0 < sum(wins[g * G : (g + 1) * G]) < G for g in range(len(seeds[task]))]  # groups that both won and failed
        for g, seed in enumerate(seeds[task]):
            games.append({"task": task, "seed": seed, "wins": sum(wins[g * G : (g + 1) * G]), "group_size": G})
        log(f"{task:>17}: {sum(wins)}/{len(wins)} episodes won, {len(pairs)} failed episodes with a critical turn")
        for source in sources:
            tcfg = cfg.model_copy(update={"teacher": cfg.teacher.model_copy(update={"source": source})})
            hints, _ = teacher_hints(attempts, tcfg, None, pool, True, G)
            hints = [h if mixed[i // G] else None for i, h in enumerate(hints)]  # only where the outcome advantage is not 0
            # every turn of every attempt with a text: (student prompt, actions), (teacher prompt, actions)
            jobs, where = [], []
            for i, (a, hint) in enumerate(zip(attempts, hints)):
                if hint is None:
                    continue
                for t, ctx in enumerate(a.contexts):
                    jobs.append((render_prompt(tok, user_message(ctx, cfg.agent), system), a.actions[t]))
                    jobs.append((render_prompt(tok, user_message(ctx, cfg.agent, hint), system), a.actions[t]))
                    where.append((i, t))
            crit = [(i, j, t) for i, j, t in pairs if hints[i] is not None]
            for i, j, t in crit:  # the winner's action from the failed episode's critical state
                ctx = attempts[i].contexts[t]
                jobs.append((render_prompt(tok, user_message(ctx, cfg.agent), system), attempts[j].actions[t]))
                jobs.append((render_prompt(tok, user_message(ctx, cfg.agent, hints[i]), system), attempts[j].actions[t]))
            scored = score_actions(policy, jobs, cfg) if jobs else []
            scores = [s.sum().item() for s in scored]  # log-prob of the whole action
            per_tok = [s.mean().item() for s in scored]  # its mean per token
            delta, total = {}, {}  # (attempt, turn) -> mean token Delta of that turn's action; (student, teacher) log-prob of all of it
            for k, key in enumerate(where):
                delta[key] = per_tok[2 * k + 1] - per_tok[2 * k]
                total[key] = (scores[2 * k], scores[2 * k + 1])
            base = 2 * len(where)
            for k, (i, j, t) in enumerate(crit):
                n_turns = len(attempts[i].contexts)
                before = [delta[(i, u)] for u in range(t)]
                after = [delta[(i, u)] for u in range(t + 1, n_turns)]
                turns[source].append({
                    "task": task, "seed": attempts[i].seed, "turn": t, "failed_action": attempts[i].texts[t], "win_action": attempts[j].texts[t],
                    "walkthrough_action": walkthrough_action(pool, attempts[i].seed, t),
                    "student_fail": total[(i, t)][0], "teacher_fail": total[(i, t)][1],
                    "student_win": scores[base + 2 * k], "teacher_win": scores[base + 2 * k + 1],
                    "delta_at": delta[(i, t)], "delta_before": _mean(before), "delta_after": _mean(after),
                })
            rewards = torch.tensor([float(a.success) for a in attempts]).view(-1, G)
            adv = (rewards - rewards.mean(dim=1, keepdim=True)).flatten().tolist()  # the group-centred outcome advantage
            for i, a in enumerate(attempts):
                if hints[i] is not None:
                    eps[source].append({"delta": _mean([delta[(i, t)] for t in range(len(a.contexts))]), "advantage": adv[i]})
    summary = {s: summarise(turns[s], eps[s]) for s in sources}
    for s in sources:
        summary[s]["turns"] = turns[s]
    return summary, games


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--warm-start", default="runs/household_sft_light", help="the SFT run whose last checkpoint is probed")
    p.add_argument("--games", type=int, default=6, help="train-split games per task type")
    p.add_argument("--group-size", type=int, default=8, help="G: episodes per game")
    p.add_argument("--sources", default="sibling,reference", help="teacher sources to score (teacher.source values without a library)")
    p.add_argument("--tiny", action="store_true", help="the tiny random model (checks the script; its episodes rarely win)")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "teacher_probe"))
    args = p.parse_args(argv)
    sources = [s for s in args.sources.split(",") if s]
    bad = [s for s in sources if s not in ("sibling", "reference")]
    if bad:
        raise SystemExit(f"--sources: {', '.join(bad)} not probed here; choose from sibling, reference")

    import torch

    from recursa.config import load_config
    from recursa.envs import make_env
    from recursa.envs.base import EnvPool, split_seed
    from recursa.models import load_policy
    from recursa.recipes.common import init_weights_dir

    torch.manual_seed(0)
    torch.set_num_threads(2)
    sets = ["model.name=tiny-random"] if args.tiny else ["model.name=smollm2-135m-instruct", f'init.from_run="{args.warm_start}"']
    sets += ['env.name="household"', "agent.history_turns=1", "sampling.temperature=1.0",
             f"sampling.max_new_tokens={5 if args.tiny else 12}", "train.micro_batch_size=16", "skills.enabled=false", 'teacher.source="sibling"']
    cfg = load_config(None, sets, recipe="rsipo")
    policy = load_policy(cfg.model, base_dir=None if args.tiny else init_weights_dir(cfg))
    max_steps = 4 if args.tiny else 12
    pools = {t: EnvPool(lambda t=t: make_env("household", rooms=1, objects_per_room=2, distractors=0, tasks=[t], max_steps=max_steps)) for t in TASKS}
    seeds = {t: [split_seed("train", FIRST_SEED + 1000 * n + k) for k in range(args.games)] for n, t in enumerate(TASKS)}
    t0 = time.perf_counter()
    summary, games = probe(policy, cfg, pools, seeds, sources, args.group_size)
    wall = round(time.perf_counter() - t0, 1)
    record = {"warm_start": None if args.tiny else args.warm_start, "model": cfg.model.name, "games_per_task": args.games,
              "group_size": args.group_size, "sources": summary, "games": games, "wall_s": wall, "torch": torch.__version__}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(record, indent=1) + "\n")

    def f(x, spec="+.3f"):
        return "-" if x is None else format(x, spec)

    won = sum(g["wins"] for g in games)
    lines = [f"# Does the self-teacher know better at the critical turn? household, from `{record['warm_start'] or cfg.model.name}`", "",
             f"Command: `python benchmarks/teacher_probe.py --games {args.games} --group-size {args.group_size} --sources {args.sources}`; "
             f"{args.games} train-split games per task type x {args.group_size} sampled episodes (T = 1), {won}/{args.group_size * len(games)} won; "
             f"{wall:.0f} s.", "",
             "| teacher source | critical turns | student prefers win | teacher prefers win | flips to win / to fail | margin shift, mean / median (nats) | "
             "where the walkthrough's action is the winner's: turns, student / teacher prefer it | "
             "Delta at critical / before / after (nats per token) | episodes with text | corr(Delta, A) |",
             "|---|---:|---:|---:|---|---|---|---|---:|---:|"]
    for s, e in summary.items():
        lines.append(f"| {s} | {e['critical_turns']} | {f(e['student_prefers_win'], '.2f')} | {f(e['teacher_prefers_win'], '.2f')} "
                     f"| {e['flips_to_win']} / {e['flips_to_fail']} | {f(e['margin_shift'])} / {f(e['margin_shift_median'])} "
                     f"| {e['walkthrough_is_win']}: {e['student_prefers_win_there']} / {e['teacher_prefers_win_there']} "
                     f"| {f(e['delta_critical'])} / {f(e['delta_before'])} / {f(e['delta_after'])} | {e['episodes_with_text']} | {f(e['corr_delta_advantage'], '+.2f')} |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
