#!/usr/bin/env python
"""Whole-run speed of the new defaults against the old ones (issue 46): the self-improvement
benchmark's 256-episode `household_light` GRPO + curriculum run, trained twice from the same warm
start with the same seed and evaluated on the same 100 held-out games, once by this checkout
(the new defaults) and once by the code of an older commit (the old defaults), in one invocation.

    python benchmarks/speed_run.py                         # old code = 9c19f06 (the last commit before the new defaults)
    python benchmarks/speed_run.py --old 9c19f06 --order new,old
    python benchmarks/speed_run.py --report                # the table from the committed result files
    python benchmarks/speed_run.py --tiny --out /tmp/sr    # the tiny model on toy-corridor: checks the script

Each arm is one run of `benchmarks/rsipo_vs_grpo.py` (its `grpo@progress+epochs2` settings: 8
steps x 4 games x 8 episodes, two epochs, learning-progress curriculum over the four task types,
held-out evaluations at steps 4 and 8 on the first 100 test games), each in its own process:
the new arm from this checkout, the old arm from a `git worktree` of `--old` (its run
directories and warm start are this checkout's `runs/`, linked). The arms run one after the
other in `--order`, so a change of the machine's load between them moves the ratio; the
host's fp32 matmul rate is probed before and after each arm and reported with it. Each arm's
result file (the benchmark's own record: wall time, held-out items, diagnostics) lands in
`--out/<arm>/`; an arm whose file exists is not run again, so the pair can be finished over two
sittings. The table (`--out/speed_run.md`, `.json`): each arm's wall time, per-step rollout and
update seconds and evaluation seconds (from the run's metrics), held-out success, the wall-time
ratio old / new and the paired exact McNemar test on the 100 games.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

OLD_COMMIT = "9c19f06"  # the last commit with the old defaults (synchronous rollouts, float32 sampling, no TIS, a scoring pass)
PILOT = [  # the committed grpo@progress+epochs2 runs' settings (benchmarks/results/self_improve/household_light.md)
    "train.lr=1e-5", "train.warmup_steps=2", "train.skip_empty_steps=true", "train.micro_batch_size=8", 'curriculum.mode="progress"',
    'curriculum.arms=[{name = "pick", kwargs = {tasks = ["pick_and_place"]}}, {name = "heat", kwargs = {tasks = ["heat_then_place"]}}, '
    '{name = "cool", kwargs = {tasks = ["cool_then_place"]}}, {name = "clean", kwargs = {tasks = ["clean_then_place"]}}]',
    "train.epochs=2",
]
TAG = "@progress+epochs2"


def matmul_gflops() -> float:
    """The host's fp32 matmul rate right now (vs_trl's probe: 2048^3, best of 5, 2 threads), GFLOP/s."""
    import vs_trl

    return vs_trl.matmul_gflops()["best_gflops"]


def bf16_host() -> dict:
    """What decides the new defaults' sampling dtype on this host: whether recursa counts its
    bfloat16 as native (`recursa.hardware.native_bf16`, which picks rollout.decode_dtype = "auto"),
    and the measured bf16 and fp32 matmul rates (`limits.matmul_rate`, 1024^3, 2 threads). An arm
    run on a host whose bf16 is fast is not comparable with one run where it is emulated."""
    import limits
    import torch

    from recursa.hardware import native_bf16

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        return {"native_bf16": native_bf16("cpu"), "bf16_gflops": limits.matmul_rate(1024, torch.bfloat16),
                "fp32_gflops_1024": limits.matmul_rate(1024, torch.float32)}
    finally:
        torch.set_num_threads(threads)


def old_tree(commit: str) -> Path:
    """A worktree of `commit` under /tmp whose runs/ is this checkout's (the warm start and run directories)."""
    path = Path(f"/tmp/recursa_old_{commit}")
    if not path.exists():
        subprocess.run(["git", "worktree", "add", "--detach", str(path), commit], cwd=REPO, check=True, capture_output=True)
    runs = path / "runs"
    if not runs.exists():
        (REPO / "runs").mkdir(exist_ok=True)
        runs.symlink_to(REPO / "runs")
    return path


def arm_command(tree: Path, out: Path, runs: Path, tiny: bool) -> list[str]:
    if tiny:
        return [sys.executable, str(tree / "benchmarks" / "rsipo_vs_grpo.py"), "--tiny", "--recipes", "grpo", "--seeds", "0", "--out", str(out),
                "--runs-dir", str(runs), "--set", "train.epochs=2", "--tag", TAG]
    cmd = [sys.executable, str(tree / "benchmarks" / "rsipo_vs_grpo.py"), "--games", "household_light", "--recipes", "grpo", "--seeds", "0",
           "--steps", "8", "--eval-n", "100", "--eval-every", "4", "--results", str(out), "--runs-dir", str(runs)]
    for s in PILOT:
        cmd += ["--set", s]
    return cmd + ["--tag", TAG]


def result_file(out: Path) -> Path | None:
    found = sorted(p for p in out.glob(f"*/grpo{TAG}_seed0.json"))
    return found[0] if found else None


def stage_seconds(run_dir: Path) -> dict:
    """Median rollout / update seconds per step and the evaluations' seconds, from the run's metrics.jsonl."""
    import statistics

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()] if (run_dir / "metrics.jsonl").exists() else []
    roll = [r["time/rollout_s"] for r in rows if "time/rollout_s" in r]
    upd = [r["time/update_s"] for r in rows if "time/update_s" in r]
    evals = [v for r in rows for k, v in r.items() if k.startswith("time/eval") and k.endswith("_s")]
    return {"rollout_s_median": statistics.median(roll) if roll else None, "update_s_median": statistics.median(upd) if upd else None,
            "rollout_s_total": sum(roll), "update_s_total": sum(upd), "eval_s_total": sum(evals), "steps": len(roll)}


def table(out: Path) -> dict | None:
    from recursa.stats import paired_compare

    arms = {}
    for arm in ("old", "new"):
        path = result_file(out / arm)
        if path is None:
            continue
        rec = json.loads(path.read_text())
        meta_path = out / arm / "arm.json"
        meta = json.loads(meta_path.read_text()) if meta_path.exists() else {}
        arms[arm] = {"record": rec, "meta": meta}
    if len(arms) < 2:
        return None
    items = {a: {i["seed"]: bool(i["success"]) for i in arms[a]["record"]["heldout"]["items"]} for a in arms}
    games = sorted(items["old"])
    if sorted(items["new"]) != games:
        raise SystemExit("the two arms were evaluated on different held-out games")
    old_s, new_s = [items["old"][g] for g in games], [items["new"][g] for g in games]
    cmp = paired_compare(old_s, new_s)  # before = old, after = new
    summary = {
        "wall_s": {a: arms[a]["record"]["wall_s"] for a in arms},
        "ratio_old_over_new": arms["old"]["record"]["wall_s"] / arms["new"]["record"]["wall_s"],
        "success": {a: sum(items[a].values()) / len(games) for a in arms},
        "n_games": len(games), "paired": cmp,
        "stages": {a: arms[a]["meta"].get("stages") for a in arms},
        "matmul_gflops": {a: arms[a]["meta"].get("matmul_gflops") for a in arms},
        "host": {a: arms[a]["meta"].get("host") for a in arms},
        "commits": {a: arms[a]["meta"].get("commit") for a in arms},
        "order": [a for a, _ in sorted(((a, arms[a]["meta"].get("started", 0)) for a in arms), key=lambda x: x[1])],
    }
    (out / "speed_run.json").write_text(json.dumps(summary, indent=1) + "\n")
    lines = ["# Whole-run speed: new defaults against old (household_light, 256 episodes)", "",
             "`python benchmarks/speed_run.py` (arms in the order " + ", ".join(summary["order"]) + ")", "",
             "| arm | code | wall | rollout s/step (median) | update s/step (median) | evaluations s | held-out success | matmul GFLOP/s before / after | bf16 / fp32 GFLOP/s (1024), native bf16 |",
             "|---|---|---:|---:|---:|---:|---:|---|---|"]
    for a in ("old", "new"):
        st, mm = summary["stages"][a] or {}, summary["matmul_gflops"][a] or {}
        fmt = lambda v: "-" if v is None else f"{v:.0f}"  # noqa: E731
        lines.append(f"| {a} | {summary['commits'][a]} | {summary['wall_s'][a] / 60:.1f} min | {fmt(st.get('rollout_s_median'))} | "
                     f"{fmt(st.get('update_s_median'))} | {fmt(st.get('eval_s_total'))} | {summary['success'][a]:.2f} | "
                     f"{fmt(mm.get('before'))} / {fmt(mm.get('after'))} | {host_cell(summary['host'][a])} |")
    hosts = {a: (summary["host"][a] or {}).get("native_bf16") for a in arms}
    if None not in hosts.values() and len(set(hosts.values())) > 1:
        lines += ["", "**The arms ran on hosts of different bfloat16 support: the ratio compares hosts, not code.**"]
    lo, hi = cmp["diff_ci95"]
    lines += ["", f"Wall-time ratio old / new: **{summary['ratio_old_over_new']:.2f}x**.",
              f"Held-out success on the same {len(games)} games: new - old = {cmp['diff']:+.3f} [{lo:+.3f}, {hi:+.3f}] (Newcombe 95%), "
              f"{cmp['b']} games only the new arm won, {cmp['c']} only the old; exact McNemar p = {cmp['p_two_sided']:.3g} (two-sided)."]
    (out / "speed_run.md").write_text("\n".join(lines) + "\n")
    return summary


def host_cell(host: dict | None) -> str:
    if not host:
        return "- (not probed)"
    return f"{host['bf16_gflops']:.1f} / {host['fp32_gflops_1024']:.0f}, {'yes' if host['native_bf16'] else 'no'}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", default=OLD_COMMIT, help="the commit whose code is the old arm")
    ap.add_argument("--order", default="new,old", help="the arms' order")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "speed_run"))
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--report", action="store_true")
    args = ap.parse_args(argv)
    out = Path(args.out)
    if not args.report:
        for arm in args.order.split(","):
            dest = out / arm
            if result_file(dest) is not None:
                print(f"{arm}: committed result {result_file(dest)}", flush=True)
                continue
            tree = REPO if arm == "new" else old_tree(args.old)
            commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=tree, capture_output=True, text=True).stdout.strip()
            dest.mkdir(parents=True, exist_ok=True)
            meta = {"arm": arm, "commit": commit + ("" if arm == "old" else " (+ working tree)" if subprocess.run(
                ["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO, capture_output=True, text=True).stdout.strip() else ""),
                    "started": time.time(), "matmul_gflops": {"before": matmul_gflops()}, "host": bf16_host()}
            print(f"{arm}: code {meta['commit']}, matmul {meta['matmul_gflops']['before']:.0f} GFLOP/s", flush=True)
            env = {**os.environ, "PYTHONPATH": str(tree)}
            runs = (Path(args.out) / "runs") if args.tiny else REPO / "runs" / "speed_run" / arm  # run directories never under results/
            subprocess.run(arm_command(tree, dest, runs, args.tiny), cwd=tree, env=env, check=True)
            meta["matmul_gflops"]["after"] = matmul_gflops()
            path = result_file(dest)
            rec = json.loads(path.read_text())
            meta["stages"] = stage_seconds(REPO / rec["run_dir"] if not Path(rec["run_dir"]).is_absolute() else Path(rec["run_dir"]))
            (dest / "arm.json").write_text(json.dumps(meta, indent=1) + "\n")
            print(f"{arm}: {rec['wall_s'] / 60:.1f} min, held-out {rec['heldout']['success_rate']:.2f}", flush=True)
    summary = table(out)
    if summary is None:
        print("not both arms yet")
        return 0
    print((out / "speed_run.md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
