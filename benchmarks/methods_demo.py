#!/usr/bin/env python
"""One switch at a time on the demo task (the issue-17 methods, low-precision decoding), each against plain GRPO on the same held-out items.

Every method is the demo run (`examples/demo.toml`: the embedded SmolLM2-135M-Instruct,
single-digit addition, 16 steps x 8 prompts x 8 samples, lr 2e-5) with one switch changed,
so the only difference between a method's run and the `grpo` run is that switch. Each run is
evaluated greedily on the same first 200 test items before and after training, and the
comparison with `grpo` is paired on those items (exact McNemar, Newcombe interval).

    python benchmarks/methods_demo.py                    # every method; reuses committed results
    python benchmarks/methods_demo.py --methods grpo,spo # some of them
    python benchmarks/methods_demo.py --methods arith_grpo,arith_progress,arith_schedule,arith_tail,arith_rft,arith_bstar,arith_rft_equal
    python benchmarks/methods_demo.py --report           # tables from committed results alone
    python benchmarks/methods_demo.py --tiny --out /tmp/m  # tiny random model: checks the script

Issue 17's curricula and B-STaR need a task with levels, so their runs (`arith_*`) play
two-digit arithmetic (`examples/curriculum/arithmetic.toml`, difficulty 1 held out; expert
iteration: `examples/curriculum/arithmetic_rft.toml`) from `arithmetic_sft`, one part at a
time, each paired with its own baseline on that task (`BASELINE_OF`): `arith_grpo` (no
curriculum) for the learning-progress and schedule arms and the tail; for B-STaR both
`arith_rft` (no B-STaR, the same 8 rounds) and `arith_rft_equal` (no B-STaR, 26 rounds: as
many sampled episodes as B-STaR's rounds and probes together).

Each finished run writes one small file, `benchmarks/results/methods_demo/<method>.json`
(settings, before/after success with intervals, per-item successes, the last training row
and the wall time); a later invocation skips a method whose committed file has the same
settings, so the table can be completed over several sittings. Methods that need a start of
their own name it (`self_reward` starts from `arithmetic_sft`, the supervised run whose
weights are its pi_SFT), and the start runs first.
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from recursa.runio import atomic_write_json, read_jsonl  # noqa: E402

RESULTS = REPO / "benchmarks" / "results" / "methods_demo"
DEMO = "examples/demo.toml"
ARITH = "examples/curriculum/arithmetic.toml"
ARITH_RFT = "examples/curriculum/arithmetic_rft.toml"
# Bump when a change to recursa alters what an existing method's configuration computes.
CODE_VERSION = 1

# name -> (config, --set overrides, the run this one starts from or None, the switch in words)
METHODS: dict[str, tuple[str, list[str], str | None, str]] = {
    "grpo": (DEMO, [], None, "the demo run (algo.advantage = grpo, PPO-clip)"),
    "gopo": ("examples/gopo_demo.toml", [], None, 'algo.advantage = "gopo"'),
    "spo": (DEMO, ['algo.objective="spo"', "algo.spo_eps=0.2"], None, 'algo.objective = "spo"'),
    "gpg": (DEMO, ['algo.advantage="gpg"', 'algo.objective="gpg"'], None, 'algo.advantage = algo.objective = "gpg"'),
    "rebel": (DEMO, ['algo.objective="rebel"', "algo.rebel_eta=1.0"], None, 'algo.objective = "rebel"'),
    "nft": (DEMO, ['algo.objective="nft"', "algo.nft_neg_clamp=1.0"], None, 'algo.objective = "nft"'),
    "apo": (DEMO, ['algo.objective="apo"', "algo.apo_beta=1e-3", "algo.apo_value_beta=0.5"], None, 'algo.objective = "apo" (apo_beta 1e-3, the default)'),
    "apo_beta0.5": (DEMO, ['algo.objective="apo"', "algo.apo_beta=0.5", "algo.apo_value_beta=0.5"], None, 'algo.objective = "apo", algo.apo_beta = 0.5'),
    "igrpo": (DEMO, ["algo.igrpo=true", "algo.igrpo_drafts=4"], None, "algo.igrpo = true"),
    "self_consistency": ("examples/rewards/self_consistency.toml", [], None, '[[reward]] kind = "self_consistency" (verifier weight 0)'),
    "self_judge": ("examples/rewards/self_judge.toml", [], None, '[[reward]] kind = "self_judge" (verifier weight 0)'),
    "arithmetic_sft": ("examples/rewards/arithmetic_sft.toml", [], None, "recipe = sft on 64 reference answers (the start of self_reward and the arith_ runs)"),
    "self_reward": ("examples/rewards/self_reward.toml", [], "arithmetic_sft", '[[reward]] kind = "self_reward" (verifier weight 0), from arithmetic_sft'),
    # issue 15: sampling with a low-precision copy of the weights (the trainer keeps fp32; TIS corrects the mismatch)
    "decode_bf16": (DEMO, ['rollout.decode_dtype="bfloat16"', "rollout.tis_cap=2.0"], None, 'rollout.decode_dtype = "bfloat16", rollout.tis_cap = 2'),
    "decode_int8": (DEMO, ['rollout.decode_dtype="int8"', "rollout.tis_cap=2.0"], None, 'rollout.decode_dtype = "int8", rollout.tis_cap = 2'),
    # issue 17, curricula: two-digit arithmetic (difficulty 1 held out) from arithmetic_sft, one part at a time
    "arith_grpo": (ARITH, ['curriculum.mode="off"', "curriculum.arms=[]", "curriculum.tail.enabled=false"], "arithmetic_sft",
                   "GRPO on difficulty 1 from arithmetic_sft, no curriculum (the baseline of the arith_ runs)"),
    "arith_progress": (ARITH, ["curriculum.tail.enabled=false"], "arithmetic_sft", 'curriculum.mode = "progress" over difficulty 0, 1, 2'),
    "arith_schedule": (ARITH, ['curriculum.mode="schedule"', "curriculum.schedule_steps=[5, 10]", "curriculum.advance_at=0.8", "curriculum.tail.enabled=false"],
                       "arithmetic_sft", 'curriculum.mode = "schedule": difficulty 0, then 1 (step 5), then 2 (step 10; earlier at a pass rate of 0.8)'),
    "arith_tail": (ARITH, ['curriculum.mode="off"', "curriculum.arms=[]"], "arithmetic_sft",
                   'curriculum.tail: never-solved tasks re-offered with the answer\'s form (PRIVILEGED), no arms'),
    # issue 17, B-STaR: expert iteration on the same task, with and without it
    "arith_rft": (ARITH_RFT, ["curriculum.bstar.enabled=false"], "arithmetic_sft", "expert iteration on difficulty 1, 8 rounds, T = 1, G = 4 (the baseline of arith_bstar)"),
    "arith_bstar": (ARITH_RFT, [], "arithmetic_sft", "curriculum.bstar: each round's temperature and G by the balance score on a probe batch"),
    "arith_rft_equal": (ARITH_RFT, ["curriculum.bstar.enabled=false", "rft.rounds=26"], "arithmetic_sft",
                        "expert iteration as arith_rft for 26 rounds: 3328 sampled episodes, arith_bstar's count with its probes (the equal-episode baseline of arith_bstar)"),
}
BASELINE = "grpo"
# methods compared with another method than BASELINE: the runs of another task or recipe
# (a tuple: one comparison with each, in order)
BASELINE_OF = {"arith_progress": "arith_grpo", "arith_schedule": "arith_grpo", "arith_tail": "arith_grpo", "arith_bstar": ("arith_rft", "arith_rft_equal")}


def baselines_of(name: str) -> tuple[str, ...]:
    """The runs `name` is compared with: its BASELINE_OF entry (one or a tuple), else BASELINE."""
    b = BASELINE_OF.get(name, BASELINE)
    return b if isinstance(b, tuple) else (b,)


def baseline_users(name: str) -> list[str]:
    """The methods whose BASELINE_OF names `name`."""
    return [m for m in BASELINE_OF if m != name and name in baselines_of(m)]
TINY_COMMON = ['model.name="tiny-random"', "train.micro_batch_size=8", "eval.n=8", "eval.batch_size=8", "sampling.max_new_tokens=6", "run.threads=1"]
TINY_RL = ["train.steps=2", "train.prompts_per_step=2", "train.group_size=4", "curriculum.tail.min_attempts=4"]
TINY_SFT = ["data.n=8", "train.batch_size=4"]
TINY_RFT = ["rft.rounds=2", "rft.tasks_per_round=2", "rft.group_size=2", "curriculum.bstar.probe_tasks=2", "curriculum.bstar.samples=[2]"]


def settings(name: str, tiny: bool) -> dict:
    config, sets, start, _ = METHODS[name]
    spec = {"method": name, "config": config, "sets": list(sets), "start": start, "code_version": CODE_VERSION, "tiny": tiny}
    if start is not None:
        spec["start_settings"] = settings(start, tiny)
    return spec


def started_from(name: str) -> list[str]:
    """The methods whose runs start from `name`'s weights (empty for a method no run starts from)."""
    return [m for m in METHODS if METHODS[m][2] == name]


def _load(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _training_rows(run_dir: Path) -> list[dict]:
    """The run's training rows of metrics.jsonl (not its evaluation rows), numbers only."""
    return [{k: v for k, v in rec.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
            for rec in read_jsonl(run_dir / "metrics.jsonl") if "time/step_s" in rec and not any(k.startswith("eval/") for k in rec)]


def run_method(name: str, args, done: dict, rerun: bool = False) -> dict:
    """Run one method (its start first) unless a result with the same settings exists (or rerun:
    a start whose weights are gone is trained again)."""
    spec = settings(name, args.tiny)
    out = args.results / f"{name}.json"
    old = _load(out)
    if old is not None and old.get("settings") == spec and not rerun:
        print(f"{name:18s} committed result ({out})", flush=True)
        done[name] = old
        return old
    config, sets, start, _ = METHODS[name]
    run_dir = args.runs_dir / name
    extra = list(sets)
    if start is not None:
        start_dir = args.runs_dir / start
        if start not in done or not (start_dir / "checkpoints").exists():
            # a committed result of the start is not enough: this run needs its weights
            run_method(start, args, done, rerun=not (start_dir / "checkpoints").exists())
        extra.append(f'init.from_run="{start_dir}"')
    if args.tiny:
        recipe = tomllib.loads((REPO / config).read_text()).get("recipe", "grpo")
        extra += TINY_COMMON + {"sft": TINY_SFT, "rft": TINY_RFT}.get(recipe, TINY_RL)
    cmd = [sys.executable, "-m", "recursa.cli", "train", config, "--out", str(run_dir), "--overwrite"]
    for s in extra:
        cmd += ["--set", s]
    args.runs_dir.mkdir(parents=True, exist_ok=True)
    log = args.runs_dir / f"{name}.log"
    print(f"{name:18s} running: {' '.join(cmd[2:])}  (log {log})", flush=True)
    t0 = time.time()
    with open(log, "w") as fh:
        rc = subprocess.call(cmd, cwd=REPO, stdout=fh, stderr=subprocess.STDOUT)
    wall = time.time() - t0
    if rc != 0:
        tail = log.read_text().strip().splitlines()[-1:] if log.exists() else []
        raise SystemExit(f"{name}: recursa train exited {rc}: {tail[0] if tail else '(no output)'} (log {log})")
    before = _load(run_dir / "eval" / "before.json")
    after = _load(run_dir / "eval" / "after.json")
    if after is None:
        raise SystemExit(f"{name}: the run wrote no eval/after.json ({run_dir})")

    def summary(ev):
        if ev is None:
            return None
        return {"success": ev["success_rate"], "ci95": ev["ci95"], "n": ev["n"], "step": ev.get("step"),
                "items": [[it["seed"], bool(it["success"])] for it in ev["items"]]}

    rows = _training_rows(run_dir)
    result = {
        "settings": spec,
        "switch": METHODS[name][3],
        "command": "recursa train " + " ".join(cmd[4:]).replace(str(REPO) + "/", ""),
        "before": summary(before),
        "after": summary(after),
        "train_reward": [round(r.get("reward/mean", float("nan")), 4) for r in rows],  # per step, the training reward
        "last_train_row": rows[-1] if rows else {},
        "wall_s": round(wall, 1),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    args.results.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out, result)
    print(f"{name:18s} after {result['after']['success']:.3f}  ({wall:.0f} s) -> {out}", flush=True)
    done[name] = result
    return result


def _paired(a: dict, b: dict) -> dict | None:
    """Paired comparison of run b against run a on the items both evaluated (by seed)."""
    from recursa.stats import paired_compare

    sa = dict((s, ok) for s, ok in a["items"])
    sb = dict((s, ok) for s, ok in b["items"])
    seeds = [s for s in sa if s in sb]
    if not seeds:
        return None
    return paired_compare([sa[s] for s in seeds], [sb[s] for s in seeds])


def report(results_dir: Path) -> str:
    rows = {p.stem: _load(p) for p in sorted(results_dir.glob("*.json"))}
    rows = {k: v for k, v in rows.items() if v and v.get("after")}
    lines = [
        "# One switch at a time on the demo task: the issue-17 methods and low-precision decoding",
        "",
        "Each run is `examples/demo.toml` (embedded SmolLM2-135M-Instruct, single-digit addition, 16 steps x 8 prompts x 8 samples) "
        "with one switch changed; held-out: the same first 200 test items, greedy, before and after. "
        "`vs grpo` pairs each run's after-training successes with the `grpo` run's on the same items: "
        "items won / lost against GRPO, the difference with its 95% interval (Newcombe) and the two-sided exact McNemar p. "
        "The `arith_` runs (issue 17's curricula and B-STaR) play two-digit arithmetic (difficulty 1, its first 200 test items) "
        "from `arithmetic_sft` instead, and are compared with their own baseline, named in the column. "
        "`vs own start` does the same against the run's own evaluation before training. "
        "Produced by `python benchmarks/methods_demo.py`; one file per method in `methods_demo/`.",
        "",
        "| method | switch | before | after [95%] | vs own start: won/lost, p | vs grpo (or the baseline named): won/lost, diff [95%], p | s |",
        "|---|---|---:|---|---|---|---:|",
    ]
    order = [m for m in METHODS if m in rows] + [m for m in rows if m not in METHODS]
    for name in order:
        r = rows[name]
        after = r["after"]
        before = r.get("before")
        lo, hi = after["ci95"]
        own = "-"
        if before is not None:
            pc = _paired(before, after)
            if pc:
                own = f"+{pc['b']}/-{pc['c']}, p = {pc['p_two_sided']:.2g}"
        vs = "-"
        users = started_from(name)
        if users:  # a starting point, not a method: comparing it with GRPO says nothing
            vs = f"(the start of {', '.join(users)})"
        elif baseline_users(name):  # a baseline of other runs, on another task than grpo's
            vs = f"(the baseline of {', '.join(baseline_users(name))})"
        elif name != BASELINE:
            parts = []
            for against in baselines_of(name):
                pc = _paired(rows[against]["after"], after) if rows.get(against) is not None else None
                if pc:
                    dlo, dhi = pc["diff_ci95"]
                    parts.append(f"{'' if against == BASELINE else f'vs {against}: '}+{pc['b']}/-{pc['c']}, {pc['diff']:+.3f} [{dlo:+.3f}, {dhi:+.3f}], "
                                 f"p = {pc['p_two_sided']:.2g}")
            vs = "; ".join(parts) or "-"
        b = f"{before['success']:.3f}" if before else "-"
        switch = r.get("switch", "").replace("|", "\\|")
        lines.append(f"| {name} | {switch} | {b} | {after['success']:.3f} [{lo:.3f}, {hi:.3f}] | {own} | {vs} | {r.get('wall_s', 0):.0f} |")
    lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated: {', '.join(METHODS)}")
    p.add_argument("--results", "--out", type=Path, default=RESULTS, help="per-method result files and the table (default: benchmarks/results/methods_demo)")
    p.add_argument("--runs-dir", type=Path, default=REPO / "runs" / "methods_demo", help="run directories")
    p.add_argument("--tiny", action="store_true", help="tiny random model, 2 steps, 8 items: checks the script in seconds")
    p.add_argument("--keep-runs", action="store_true", help="keep each run's directory (checkpoints are 0.5 GB at 135M)")
    p.add_argument("--report", action="store_true", help="run nothing: the table from the result files present")
    args = p.parse_args(argv)
    names = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in names if m not in METHODS]
    if unknown:
        raise SystemExit(f"unknown method(s) {', '.join(unknown)}; choose from {', '.join(METHODS)}")
    if not args.report:
        done: dict = {}
        for name in names:
            run_method(name, args, done)
        if not args.keep_runs:
            for name in done:
                if not started_from(name):  # a start's weights are what its users train from
                    shutil.rmtree(args.runs_dir / name / "checkpoints", ignore_errors=True)
    args.results.mkdir(parents=True, exist_ok=True)
    table = report(args.results)
    (args.results.parent / f"{args.results.name}.md").write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
