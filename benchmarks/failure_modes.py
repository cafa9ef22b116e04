#!/usr/bin/env python
"""Why does a policy lose household games? Each held-out game of an evaluation is classified
from its action transcript and the game's goal.

    python benchmarks/failure_modes.py runs/bench/household/warm_start_seed0/eval/after.json \\
        --out benchmarks/results/failure_modes_household_warm_start

The evaluation JSON is what `recursa eval` and every run write (`eval/<label>.json`: per item
its seed, success and the actions joined by ' | '). The env settings are the benchmark's
household (`benchmarks/rsipo_vs_grpo.py`'s HOUSEHOLD) unless --env-kwargs says otherwise. Each
lost game gets the first mode that fits, in this order:

* `never_took`: no `take` action at all (the object was never found or never picked up);
* `wrong_object`: took only objects of another kind than the task's;
* `no_verb` / `other_verb`: took the right object, but the task's appliance step (heat, cool,
  clean) never happened, or another appliance verb was used instead;
* `not_placed`: right object (and appliance step), but not put in the target in time.

Besides the mode, a game is flagged `repeats` when one action was taken at least three times
in a row (with one turn of history the policy cannot see that it is searching in circles).
"""
from __future__ import annotations

import argparse
import collections
import json
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

HOUSEHOLD_KWARGS = {"rooms": 1, "objects_per_room": 2, "distractors": 0,
                    "tasks": ["pick_and_place", "heat_then_place", "cool_then_place", "clean_then_place"], "max_steps": 12}
MODES = ("won", "never_took", "wrong_object", "no_verb", "other_verb", "not_placed")
_TAKE = re.compile(r"^take (.+?) \d+ from ")
_VERB = re.compile(r"^(heat|cool|clean) (.+?) \d+ with ")
_PUT = re.compile(r"^put (.+?) \d+ (?:in|on) (.+?) \d+$")


def classify(actions: list[str], won: bool, obj_kind: str, rec_kind: str, verb: str | None) -> tuple[str, bool]:
    """(mode, repeats) of one game from its actions and goal (object kind, target receptacle kind,
    appliance verb or None)."""
    repeats = any(actions[i] == actions[i + 1] == actions[i + 2] for i in range(len(actions) - 2))
    if won:
        return "won", repeats
    taken = [m.group(1) for a in actions if (m := _TAKE.match(a))]
    if not taken:
        return "never_took", repeats
    if obj_kind not in taken:
        return "wrong_object", repeats
    if verb is not None:
        verbs = [(m.group(1), m.group(2)) for a in actions if (m := _VERB.match(a))]
        if (verb, obj_kind) not in verbs:
            return ("other_verb" if any(o == obj_kind for _, o in verbs) else "no_verb"), repeats
    return "not_placed", repeats


def analyse(eval_json: Path, env_kwargs: dict) -> dict:
    from recursa.envs import make_env

    data = json.loads(eval_json.read_text())
    items = data["heldout"]["items"] if "heldout" in data else data["items"]  # a benchmark result file, or an eval JSON
    env = make_env("household", **env_kwargs)
    rows = []
    for item in items:
        env.reset(item["seed"])
        goal = env.goal  # the game's own goal: object kind, target receptacle kind, verb
        actions = [a.strip() for a in str(item.get("completion", "")).split("|") if a.strip()]
        mode, repeats = classify(actions, bool(item["success"]), goal["obj_kind"], goal["rec_kind"], goal["verb"])
        rows.append({"seed": item["seed"], "task_type": goal["task_type"], "mode": mode, "repeats": repeats, "steps": len(actions)})
    table = collections.defaultdict(collections.Counter)
    for r in rows:
        table[r["task_type"]][r["mode"]] += 1
        table[r["task_type"]]["repeats"] += r["repeats"] and r["mode"] != "won"
    return {"eval": str(eval_json), "env_kwargs": env_kwargs, "n": len(rows), "items": rows,
            "by_task_type": {k: dict(v) for k, v in sorted(table.items())}}


def markdown(result: dict, title: str) -> str:
    lines = [f"# Failure modes: {title}", "",
             f"From `{result['eval']}` ({result['n']} held-out games); how each lost game was lost "
             "(`benchmarks/failure_modes.py`, the modes are defined in its docstring). "
             "`repeats`: lost games with one action taken three times in a row.", "",
             "| task type | games | " + " | ".join(MODES) + " | repeats |",
             "|---|---:|" + "---:|" * (len(MODES) + 1)]
    totals = collections.Counter()
    for task, counts in result["by_task_type"].items():
        n = sum(counts.get(m, 0) for m in MODES)
        totals.update({m: counts.get(m, 0) for m in MODES})
        totals["repeats"] += counts.get("repeats", 0)
        lines.append(f"| {task} | {n} | " + " | ".join(str(counts.get(m, 0)) for m in MODES) + f" | {counts.get('repeats', 0)} |")
    lines.append(f"| all | {result['n']} | " + " | ".join(str(totals[m]) for m in MODES) + f" | {totals['repeats']} |")
    lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("eval_json", type=Path, help="an evaluation JSON with per-item completions (a run's eval/<label>.json, or a benchmark "
                   "result file, benchmarks/results/self_improve/.../<recipe>_seed<N>.json: its final evaluation)")
    p.add_argument("--env-kwargs", default=json.dumps(HOUSEHOLD_KWARGS), help="household options as JSON (default: the benchmark's)")
    p.add_argument("--out", type=Path, help="write <out>.json and <out>.md")
    p.add_argument("--title", default=None, help="the table's title (default: the evaluation's path)")
    args = p.parse_args(argv)
    if not args.eval_json.exists():
        raise SystemExit(f"no such evaluation file: {args.eval_json}")
    result = analyse(args.eval_json, json.loads(args.env_kwargs))
    md = markdown(result, args.title or str(args.eval_json))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_name(args.out.name + ".json").write_text(json.dumps(result, indent=1) + "\n")
        args.out.with_name(args.out.name + ".md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
