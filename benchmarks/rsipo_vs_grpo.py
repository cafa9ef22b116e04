#!/usr/bin/env python
"""RSIPO against GRPO (and RSIPO's ablations) at the same rollout budget, several seeds.

Every recipe trains from the same starting weights with the same tasks per step, group size,
steps, learning rate and sampling, so each run plays exactly steps x B x G training episodes;
held-out (test split) success is measured greedily on the same games at the same points.
What differs is what a recipe does with its episodes: GRPO learns from outcomes alone; RSIPO
also writes skills (extra generation, not extra episodes), scores them by replay and teaches
the policy with a retrieved skill in context. RSIPO's extra compute is reported (wall time),
not equalised: the budget compared is the number of environment episodes.

    python benchmarks/rsipo_vs_grpo.py                         # twx:twc from the SFT warm start runs/twx_twc_sft
    python benchmarks/rsipo_vs_grpo.py --recipes all --reuse   # + every ablation (examples/rsipo_ablations/*.toml), keeping finished runs
    python benchmarks/rsipo_vs_grpo.py --recipes grpo,rsipo,opid --seeds 0,1,2,3 --ablation-seeds 0,1
    python benchmarks/rsipo_vs_grpo.py --gpu                   # the GPU setting: 1600 episodes per run, 200 test games
    python benchmarks/rsipo_vs_grpo.py --tiny --out /tmp/bench  # tiny random model on toy-corridor: checks the script, seconds per run

Default setting (twx:twc, 1 location, 1 item to put away, 10 steps per game; the embedded
SmolLM2-135M warm-started from `recursa train examples/twx_twc_sft.toml`): 6 steps x 2 games
x 4 episodes = 48 training episodes per run, held-out success on 20 test games after 0, 24
and 48 episodes, recipes grpo and rsipo, seeds 0, 1, 2. Measured: 64 min on 2 CPU cores, one
run of which shared the machine with a test suite; ~46 min idle (benchmarks/README.md).

Each run is its own subprocess (fresh interpreter and model); its run directory (metrics,
evaluations, written skills) is kept under --runs-dir, its checkpoints are deleted unless
--keep-checkpoints (two per run of ~1.6 GB each for the 135M model). Outputs in --out:
rsipo_vs_grpo.json, rsipo_vs_grpo.md (the table, also printed), rsipo_vs_grpo.png
(held-out success vs training episodes: mean over seeds with a 95% t-interval, and each seed).
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import subprocess
import sys
import time
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

ABLATIONS_DIR = REPO / "examples" / "rsipo_ablations"
ABLATIONS = ("opsd", "opsd_centered", "sdpo", "opid", "seed", "srpo", "scsdpo", "no_replay")
RSIPO_SECTIONS = ("teacher", "trust", "skills")  # what an ablation config switches

# The shared settings of every run, as --set overrides (recipe-specific ones below).
AGENT = {
    "env": "twx:twc",
    "sets": [
        "model.name=smollm2-135m-instruct",
        'env.name="twx:twc"',
        "env.kwargs={numLocations = 1, numItemsToPutAway = 1, includeDoors = 0, max_steps = 10}",
        "init.from_run=runs/twx_twc_sft",
        "agent.history_turns=1",  # the SFT run's prompt format
        "sampling.temperature=1.0",
        "sampling.max_new_tokens=12",
        "algo.step_advantage=gigpo",
        "train.prompts_per_step=2",
        "train.group_size=4",
        "train.micro_batch_size=16",
        "train.lr=1e-5",
        "run.threads=2",
    ],
    "rsipo": ["skills.write_per_group=1", "skills.candidates=4", "skills.max_new_tokens=24", "skills.replay_size=2", "skills.replay_turns=2"],
    "steps": 6,
    "eval_n": 20,
    "eval_every": 3,
}
# The GPU setting: the same game and warm start at a budget a CUDA GPU makes affordable,
# 25 steps x 8 games x 8 episodes = 1600 episodes per run, 200 test games per evaluation.
# Not yet run (no GPU was lent to the session that wrote it): an estimate of ~10-15 min per
# run on one H200 from the CPU profile, so ~2 h for grpo, rsipo, opsd and opid x 3 seeds.
GPU = {
    "env": "twx:twc",
    "sets": [
        *(s for s in AGENT["sets"] if not s.startswith(("train.prompts_per_step=", "train.group_size=", "train.micro_batch_size=", "run.threads="))),
        "model.device=cuda",
        "train.prompts_per_step=8",
        "train.group_size=8",
        "train.micro_batch_size=64",
    ],
    "rsipo": ["skills.write_per_group=2", "skills.candidates=4", "skills.max_new_tokens=32", "skills.replay_size=4", "skills.replay_turns=2"],
    "steps": 25,
    "eval_n": 200,
    "eval_every": 5,
}
TINY = {
    "env": "toy-corridor",
    "sets": [
        "model.name=tiny-random",
        "env.name=toy-corridor",
        "env.kwargs={max_steps = 4}",
        "agent.history_turns=1",
        "sampling.max_new_tokens=5",
        "train.prompts_per_step=2",
        "train.group_size=4",
        "train.micro_batch_size=16",
        "train.lr=1e-3",
        "run.threads=1",
    ],
    "rsipo": ["skills.write_per_group=1", "skills.candidates=2", "skills.max_new_tokens=8", "skills.replay_size=2", "skills.replay_turns=2"],
    "steps": 4,
    "eval_n": 8,
    "eval_every": 2,
}


def _toml_value(value) -> str:
    """A TOML literal for --set (strings quoted, tables inline)."""
    import tomli_w

    return tomli_w.dumps({"v": value}).split("=", 1)[1].strip()


def ablation_sets(name: str) -> list[str]:
    """The switches of examples/rsipo_ablations/<name>.toml as --set overrides: the teacher /
    trust / skills keys whose value differs from examples/rsipo_smoke.toml (the example
    configs are the single source of truth for what each ablation changes)."""
    data = tomllib.loads((ABLATIONS_DIR / f"{name}.toml").read_text())
    full = tomllib.loads((REPO / "examples" / "rsipo_smoke.toml").read_text())
    sets = []
    for section in RSIPO_SECTIONS:
        for key, value in data.get(section, {}).items():
            if full.get(section, {}).get(key) != value:
                sets.append(f"{section}.{key}={_toml_value(value)}")
    return sets


def recipe_spec(name: str, setting: dict) -> tuple[str, list[str]]:
    """(recipe, --set overrides) of a benchmark entry."""
    if name == "grpo":
        return "grpo", []
    if name == "rsipo":
        return "rsipo", list(setting["rsipo"])
    if name in ABLATIONS:
        sets = ablation_sets(name)
        return "rsipo", (list(setting["rsipo"]) if not any(s == "skills.enabled=false" for s in sets) else []) + sets
    raise SystemExit(f"unknown recipe {name!r}; choose from grpo, rsipo, {', '.join(ABLATIONS)} (or all)")


# ----------------------------------------------------------------------------- one run (subprocess)


def worker(spec: dict) -> None:
    """Train one (recipe, seed) run into spec['out']; called in a fresh interpreter."""
    if spec["tiny"]:
        import importlib.util

        # toy-corridor is registered by the test suite's conftest (the toy envs live there)
        s = importlib.util.spec_from_file_location("recursa_test_envs", REPO / "tests" / "conftest.py")
        s.loader.exec_module(importlib.util.module_from_spec(s))
    import importlib

    from recursa.config import load_config

    cfg = load_config(None, spec["sets"], recipe=spec["recipe"])
    importlib.import_module(f"recursa.recipes.{spec['recipe']}").train(cfg, Path(spec["out"]), log=lambda m: print(m, flush=True))


def run_one(name: str, seed: int, args, setting: dict, before: bool) -> dict:
    recipe, extra = recipe_spec(name, setting)
    out = Path(args.runs_dir) / f"{name}_seed{seed}"
    steps = args.steps or setting["steps"]
    eval_n = args.eval_n or setting["eval_n"]
    sets = [
        *setting["sets"], *extra,
        f"train.steps={steps}", f"train.seed={seed}",
        f"eval.n={eval_n}", f"eval.batch_size={eval_n}", f"eval.every={args.eval_every or setting['eval_every']}", "eval.split=test",
        f"eval.before={'true' if before else 'false'}", "eval.after=true", "run.checkpoint_every=0",
    ]
    spec = {"recipe": recipe, "sets": sets, "out": str(out), "tiny": args.tiny}
    done_file = out / "bench.json"  # written last: its presence means the run finished
    done = json.loads(done_file.read_text()) if args.reuse and done_file.exists() else None
    if done is not None and done["spec"] == spec:
        wall = done["wall_s"]
        print(f"{name:>10} seed {seed}: reusing the finished run in {out}", flush=True)
    else:
        if out.exists():
            shutil.rmtree(out)
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, __file__, "--worker", json.dumps(spec)], cwd=REPO, capture_output=True, text=True)
        wall = time.perf_counter() - t0
        (Path(args.runs_dir) / f"{name}_seed{seed}.log").write_text(proc.stdout + proc.stderr)
        if proc.returncode != 0:
            raise SystemExit(f"{name} seed {seed} failed (exit {proc.returncode}); log: {args.runs_dir}/{name}_seed{seed}.log\n{proc.stderr[-2000:]}")
        if not args.keep_checkpoints:
            shutil.rmtree(out / "checkpoints", ignore_errors=True)
            shutil.rmtree(out / "incumbents", ignore_errors=True)
        done_file.write_text(json.dumps({"spec": spec, "wall_s": wall}) + "\n")
    B, G = _setting_value(setting, "train.prompts_per_step"), _setting_value(setting, "train.group_size")
    curve = []
    for path in sorted((out / "eval").glob("*.json")):
        data = json.loads(path.read_text())
        done = 0 if path.stem == "before" else steps if path.stem == "after" else int(path.stem.split("_")[1])
        curve.append([done * B * G, data["success_rate"]])
    after = json.loads((out / "eval" / "after.json").read_text())
    print(f"{name:>10} seed {seed}: held-out success {after['success_rate']:.3f} after {steps * B * G} episodes ({wall:.0f} s)", flush=True)
    return {"seed": seed, "heldout": after, "curve": sorted(curve), "wall_s": wall, "run_dir": str(out), "diagnostics": diagnostics(out)}


# what the teacher and the skills did in a run: the step means of these metrics (NaN steps skipped)
DIAGNOSTICS = (
    "reward/mean", "teacher/share", "teacher/corr_delta_adv", "teacher/delta_abs_mean", "teacher/trust_applied_mean",
    "trust/mean", "trust/agreement", "trust/trials", "skills/admitted", "skills/replay_reward_mean", "skills/len_words_mean",
)


def diagnostics(run_dir: Path) -> dict:
    """Step means of DIAGNOSTICS from a run's metrics.jsonl, its final library size and a few of
    the skills it wrote (newest first), read from its ledger."""
    import sqlite3

    from recursa.report import load_metrics

    rows = load_metrics(run_dir / "metrics.jsonl")
    out: dict = {}
    for key in DIAGNOSTICS:
        values = [r[key] for r in rows if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]
        if values:
            out[key] = sum(values) / len(values)
    sizes = [r["skills/library_size"] for r in rows if "skills/library_size" in r]
    if sizes:
        out["skills/library_size_final"] = sizes[-1]
    ledger = run_dir / "ledger.sqlite"
    if ledger.exists():
        con = sqlite3.connect(ledger)
        try:
            out["skills_sample"] = [
                {"text": t, "outcome": o, "step": st, "replay_reward": r}
                for t, o, st, r in con.execute("SELECT text, source_outcome, created_step, replay_reward FROM skills ORDER BY id DESC LIMIT 5")
            ]
        except sqlite3.OperationalError:  # a run without a skills table
            pass
        finally:
            con.close()
    return out


def _setting_value(setting: dict, key: str) -> int:
    return int(next(s.split("=", 1)[1] for s in setting["sets"] if s.startswith(key + "=")))


# ----------------------------------------------------------------------------- summary


def t_interval(values: list[float]) -> tuple[float, float, float]:
    """(mean, lo, hi): 95% Student-t interval over seeds (lo = hi = mean for one seed)."""
    from scipy import stats

    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return mean, mean, mean
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    half = stats.t.ppf(0.975, n - 1) * sd / math.sqrt(n)
    return mean, mean - half, mean + half


def summarise(result: dict) -> str:
    from recursa.stats import paired_compare, wilson_interval

    lines = [
        f"# RSIPO vs GRPO on {result['env']}",
        "",
        f"Budget per run: {result['budget']['episodes']} training episodes ({result['budget']['steps']} steps x "
        f"{result['budget']['prompts_per_step']} tasks x {result['budget']['group_size']} episodes); held-out success on "
        f"{result['budget']['eval_n']} test games (greedy); training seeds {result['seeds']}"
        + (f" (ablations: {result['ablation_seeds']})" if result.get("ablation_seeds", result["seeds"]) != result["seeds"] else "") + ".",
        "",
        "| recipe | final held-out success, mean over seeds [95% t-interval] | per seed | pooled k/n [Wilson 95%] | vs grpo, paired over pooled items | s per run |",
        "|---|---|---|---|---|---:|",
    ]
    base = result["recipes"].get("grpo")
    for name, entry in result["recipes"].items():
        finals = [s["heldout"]["success_rate"] for s in entry["seeds"]]
        mean, lo, hi = t_interval(finals)
        items = [i["success"] for s in entry["seeds"] for i in s["heldout"]["items"]]
        k, n = sum(items), len(items)
        wl, wh = wilson_interval(k, n)
        versus = "-"
        if base is not None and name != "grpo":
            a = {(s["seed"], i["seed"]): i["success"] for s in base["seeds"] for i in s["heldout"]["items"]}
            b = {(s["seed"], i["seed"]): i["success"] for s in entry["seeds"] for i in s["heldout"]["items"]}
            common = sorted(set(a) & set(b))
            if common:
                cmp = paired_compare([a[c] for c in common], [b[c] for c in common])
                versus = f"{cmp['diff']:+.3f} [{cmp['diff_ci95'][0]:+.3f}, {cmp['diff_ci95'][1]:+.3f}], McNemar p = {cmp['p_two_sided']:.3g}"
        wall = sum(s["wall_s"] for s in entry["seeds"]) / len(entry["seeds"])
        per_seed = ", ".join(f"{v:.3f}" for v in finals)
        lines.append(f"| {name} | {mean:.3f} [{lo:.3f}, {hi:.3f}] | {per_seed} | {k}/{n} [{wl:.3f}, {wh:.3f}] | {versus} | {wall:.0f} |")
    lines += ["", "Pooled items treat the seeds' test games as independent (the same games are replayed by every seed); "
              "the t-interval over seeds is the honest one with few seeds.", ""]
    shown = [k for k in DIAGNOSTICS if any(k in s.get("diagnostics", {}) for e in result["recipes"].values() for s in e["seeds"])]
    if shown:
        lines += ["What the teacher and the skills did (mean over steps, then over seeds):", "",
                  "| recipe | " + " | ".join(shown) + " |", "|---|" + "---:|" * len(shown)]
        for name, entry in result["recipes"].items():
            cells = []
            for key in shown:
                values = [s["diagnostics"][key] for s in entry["seeds"] if key in s.get("diagnostics", {})]
                cells.append(f"{sum(values) / len(values):.3f}" if values else "-")
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7.5, 4.5), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    for c, (name, entry) in enumerate(result["recipes"].items()):
        color = f"C{c}"
        points = sorted({x for s in entry["seeds"] for x, _ in s["curve"]})
        means, los, his = [], [], []
        for x in points:
            ys = [y for s in entry["seeds"] for px, y in s["curve"] if px == x]
            m, lo, hi = t_interval(ys)
            means.append(m)
            los.append(max(0.0, lo))
            his.append(min(1.0, hi))
        ax.plot(points, means, marker="o", color=color, label=f"{name} (mean of {len(entry['seeds'])} seeds)")
        ax.fill_between(points, los, his, color=color, alpha=0.15)
        for s in entry["seeds"]:
            ax.plot([x for x, _ in s["curve"]], [y for _, y in s["curve"]], color=color, alpha=0.3, linewidth=0.8)
    ax.set_xlabel("training episodes (rollouts)")
    ax.set_ylabel("held-out success (test split, greedy)")
    ax.set_title(f"{result['env']}: held-out success vs rollouts (95% t-interval over seeds)")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(True, alpha=0.3)
    ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, format="png")


# ----------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="tiny random model on toy-corridor (checks the script; seconds per run)")
    p.add_argument("--gpu", action="store_true", help="the GPU setting: the same game at 1600 episodes per run, 200 test games (needs a CUDA GPU)")
    p.add_argument("--recipes", default="grpo,rsipo", help=f"comma-separated: grpo, rsipo, {', '.join(ABLATIONS)}, or all")
    p.add_argument("--seeds", default="0,1,2", help="training seeds (>= 3 for an interval worth reading)")
    p.add_argument("--ablation-seeds", help="training seeds of the recipes other than grpo and rsipo (default: --seeds)")
    p.add_argument("--steps", type=int, help="training steps per run (default: the setting's)")
    p.add_argument("--eval-n", type=int, help="held-out games per evaluation (default: the setting's)")
    p.add_argument("--eval-every", type=int, help="evaluate every N steps, besides before and after (default: the setting's)")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results"), help="where the JSON, table and plot go")
    p.add_argument("--runs-dir", help="run directories (default: runs/rsipo_vs_grpo[_tiny])")
    p.add_argument("--keep-checkpoints", action="store_true", help="keep each run's checkpoints (large for the 135M model)")
    p.add_argument("--reuse", action="store_true", help="reuse a finished run whose settings are identical (add recipes or seeds to a finished benchmark)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(json.loads(args.worker))
        return 0

    setting = TINY if args.tiny else GPU if args.gpu else AGENT
    names = ["grpo", "rsipo", *ABLATIONS] if args.recipes == "all" else [r.strip() for r in args.recipes.split(",") if r.strip()]
    for name in names:
        recipe_spec(name, setting)  # fail fast on an unknown name
    seeds = [int(s) for s in args.seeds.split(",")]
    ablation_seeds = [int(s) for s in args.ablation_seeds.split(",")] if args.ablation_seeds else seeds
    if not args.tiny and not (REPO / "runs" / "twx_twc_sft" / "config.toml").exists():
        print("error: the warm start runs/twx_twc_sft is missing: train it first, recursa train examples/twx_twc_sft.toml", file=sys.stderr)
        return 2
    args.runs_dir = args.runs_dir or str(REPO / "runs" / ("rsipo_vs_grpo_tiny" if args.tiny else "rsipo_vs_grpo_gpu" if args.gpu else "rsipo_vs_grpo"))
    Path(args.runs_dir).mkdir(parents=True, exist_ok=True)
    steps = args.steps or setting["steps"]
    B, G = _setting_value(setting, "train.prompts_per_step"), _setting_value(setting, "train.group_size")
    result = {
        "env": setting["env"],
        "budget": {"steps": steps, "prompts_per_step": B, "group_size": G, "episodes": steps * B * G, "eval_n": args.eval_n or setting["eval_n"],
                   "eval_every": args.eval_every or setting["eval_every"], "model": next(s.split("=", 1)[1] for s in setting["sets"] if s.startswith("model.name="))},
        "seeds": seeds,
        "ablation_seeds": ablation_seeds,
        "settings": setting["sets"],
        "recipes": {},
    }
    before = None  # the starting point is the same for every run: evaluate it once
    for seed in seeds:  # seeds outermost, recipes alternating: slow drift of a shared machine hits all alike
        for name in names:
            if name not in ("grpo", "rsipo") and seed not in ablation_seeds:
                continue
            entry = run_one(name, seed, args, setting, before is None)
            if before is None:
                before = next(y for x, y in entry["curve"] if x == 0)
            elif not any(x == 0 for x, _ in entry["curve"]):
                entry["curve"].insert(0, [0, before])
            result["recipes"].setdefault(name, {"recipe": recipe_spec(name, setting)[0], "sets": recipe_spec(name, setting)[1], "seeds": []})["seeds"].append(entry)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "rsipo_vs_grpo.json").write_text(json.dumps(result, indent=1) + "\n")
    table = summarise(result)
    (out / "rsipo_vs_grpo.md").write_text(table)
    plot(result, out / "rsipo_vs_grpo.png")
    print(table)
    print(f"wrote {out / 'rsipo_vs_grpo.json'}, .md and .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
