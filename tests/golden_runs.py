"""Golden outputs: the first steps of every example config, on the tiny random model.

Every example config in examples/ is run for two steps (rounds, epochs) on the tiny random
model with its own settings, shrunk only where the tiny run needs it (`overrides`): small
batches, two held-out items, games cut to three turns, and every periodic event (gates,
evaluations, RLoop phases, checkpoints) due at every step so that the code behind it runs.
What the run wrote is reduced to a record (`record`): every metric of metrics.jsonl except
wall times and throughputs, the held-out items' outcomes, and two sums over the final
weights. tests/golden/<example>.json holds the record made before a change;
tests/test_golden.py runs the example again and asserts the record is the same.

A restructuring of the code must reproduce these records; a change of behaviour on purpose
re-records them in a commit of its own that says why:

    .venv/bin/python tests/golden_runs.py --record            # every example
    .venv/bin/python tests/golden_runs.py --record demo smoke # some of them

Floats are compared to a relative 1e-6 (`same`) on the machine a record was made on (its
`machine`: CPU model and torch build): runs there repeat bit for bit with one thread, and the
tolerance only forgives the last digits of a sum. Another CPU runs other float kernels, so the
same code gives other last digits, and some metrics amplify them: `rollout/logprob_mismatch`
is itself a difference of float roundings, a policy loss of a batch near zero is a sum of
terms that cancel, and a self-judged reward normalised by a group std of 3e-5 turns 1e-6 into
5e-4 (seen between the machine of the 2026-12-07 records and an AMD EPYC). There, or for a
record without `machine`, floats are compared to a relative 1e-3 and an absolute 1e-4
(`CROSS_MACHINE`): a changed token, batch or step still moves rewards, lengths, advantages
and the weight sums by far more, and every count, flag and held-out outcome stays exact.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import math
import os
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
os.environ.setdefault("RECURSA_DEVICE", "cpu")
os.environ.setdefault("RECURSA_NATIVE_BF16", "1")  # as the suite pins it (tests/conftest.py): records of the bfloat16 path on every host

EXAMPLES = sorted((ROOT / "examples").rglob("*.toml"))
GOLDEN = ROOT / "tests" / "golden"
SKIP_PREFIXES = ("time/", "throughput/")  # wall-clock figures: never the same twice
RTOL = 1e-6
CROSS_MACHINE = dict(rtol=1e-3, atol=1e-4)  # floats against a record made on another machine (module doc)

# every example's shared shrinkage; the recipe's own follows in `overrides`
COMMON = ["model.name=tiny-random", 'init.from_run=""', "run.threads=1", "run.checkpoint_every=1", "sampling.max_new_tokens=4",
          "eval.n=2", "eval.batch_size=2"]
RL = ["train.steps=2", "train.prompts_per_step=2", "train.group_size=2", "train.micro_batch_size=4"]


def example_id(path: Path) -> str:
    """examples/objectives/nft.toml -> 'objectives/nft'."""
    return str(path.relative_to(ROOT / "examples").with_suffix(""))


def needs(path: Path) -> str | None:
    """Why this example cannot run here (a missing package or Java), or None."""
    import importlib.util
    import tomllib

    env = tomllib.loads(path.read_text()).get("env", {}).get("name", "")
    if env.startswith("twx:") and (importlib.util.find_spec("textworld_express") is None or shutil.which("java") is None):
        return "textworld-express and Java are needed for twx: games"
    if env.startswith("textworld") and importlib.util.find_spec("textworld") is None:
        return "textworld is needed for its games"
    return None


def overrides(path: Path) -> list[str]:
    """The --set list that shrinks `path`'s example to a two-step tiny run."""
    import tomllib

    raw = tomllib.loads(path.read_text())
    recipe = raw.get("recipe", "grpo")
    sets = list(COMMON)
    env = raw.get("env", {})
    game = env.get("name", "") in ("household",) or str(env.get("name", "")).startswith(("twx:", "textworld"))
    if game and recipe != "sft" and not raw.get("anchor", {}).get("coef"):  # demonstrations must still reach the goal
        sets.append("env.kwargs.max_steps=3")
    if raw.get("eval", {}).get("every"):
        sets.append("eval.every=1")
    gate = raw.get("gate", {})
    if gate.get("mode", "off") != "off":
        sets += ["gate.n=2", "gate.every=1"]
        if gate.get("prompt_every"):
            sets += ["gate.prompt_every=1", "gate.prompt_candidates=1", "gate.prompt_select_n=2"]
        if gate.get("skills_every"):
            sets += ["gate.skills_every=1", "gate.skills_screen=4"]
    if recipe in ("grpo", "rsipo"):
        sets += RL
        if raw.get("train", {}).get("max_episodes"):
            sets.append("train.max_episodes=8")
        if raw.get("rloop", {}).get("enabled"):
            sets += ["rloop.rl_steps=1", "rloop.sft_batch_size=4"]
        tail = raw.get("curriculum", {}).get("tail", {})
        if tail.get("min_attempts"):
            sets.append("curriculum.tail.min_attempts=2")
        if raw.get("algo", {}).get("igrpo"):
            sets.append("algo.igrpo_drafts=2")
        if raw.get("rollout", {}).get("branch", "off") != "off":
            sets += ["rollout.branch_k=2", "rollout.branch_sources=1"]
    if recipe == "rsipo":
        sets += ["skills.candidates=2", "skills.max_new_tokens=8"]
    if recipe == "sft":
        sets += ["data.n=4", "train.epochs=2", "train.batch_size=2", "train.micro_batch_size=2"]
    if recipe == "rft":
        sets += ["rft.rounds=2", "rft.tasks_per_round=2", "rft.group_size=2", "train.batch_size=2", "train.micro_batch_size=2"]
        tail = raw.get("curriculum", {}).get("tail", {})
        if tail.get("min_attempts"):
            sets.append("curriculum.tail.min_attempts=2")
    return sets


def warm_start(path: Path) -> Path | None:
    """The example a tiny warm start for `path` is trained from, when `path` cannot run
    without one (self_reward's pi_SFT), else None."""
    import tomllib

    if any(e.get("kind") == "self_reward" for e in tomllib.loads(path.read_text()).get("reward", [])):
        return ROOT / "examples" / "rewards" / "arithmetic_sft.toml"
    return None


def run_example(path: Path, out: Path) -> Path:
    """Train `path`'s example, shrunk by `overrides`, into `out` (after its tiny warm start,
    where it needs one, beside it); returns the run directory."""
    import torch

    from recursa.config import load_config

    sets = overrides(path)
    start = warm_start(path)
    if start is not None:
        sets.append(f"init.from_run={json.dumps(str(run_example(start, out.parent / 'warm_start')))}")
    cfg = load_config(path, sets)
    torch.set_num_threads(1)
    train = importlib.import_module(f"recursa.recipes.{cfg.recipe}").train
    return train(cfg, out, log=lambda *_: None)


def _clean(value):
    if isinstance(value, float) and math.isnan(value):
        return "nan"
    return value


def record_evals(run: Path) -> dict:
    """eval/<label>.json -> {label: {success_rate, items: [[seed, success, reward], ...]}}."""
    evals = {}
    for f in sorted((run / "eval").glob("*.json")) if (run / "eval").exists() else []:
        data = json.loads(f.read_text())
        evals[f.stem] = {"success_rate": data.get("success_rate"),
                         "items": [[it.get("seed"), bool(it.get("success")), _clean(float(it.get("reward", 0.0)))] for it in data.get("items", [])]}
    return evals


def record(run: Path) -> dict:
    """What a run wrote, reduced to what must not change: metrics (no wall times), held-out
    outcomes per item, and the final weights' sum and absolute sum."""
    from safetensors.torch import load_file

    from recursa.store import finished_checkpoints

    metrics = []
    for line in (run / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        metrics.append({k: _clean(v) for k, v in sorted(row.items()) if not k.startswith(SKIP_PREFIXES) and not k.endswith("_s")})
    evals = record_evals(run)
    weights = {}
    done = finished_checkpoints(run)
    if done:
        total, absolute = 0.0, 0.0
        for shard in sorted(done[-1].glob("*.safetensors")):
            for name, tensor in sorted(load_file(str(shard)).items()):
                t = tensor.double()
                total += float(t.sum())
                absolute += float(t.abs().sum())
        weights = {"checkpoint": done[-1].name, "sum": total, "abs_sum": absolute}
    return {"metrics": metrics, "eval": evals, "weights": weights}


@functools.cache
def machine() -> str:
    """This machine's float identity as far as the records go: the CPU model and the torch build (read once)."""
    import platform

    import torch

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu} | torch {torch.__version__}"


def tolerance(golden: dict) -> dict:
    """The float tolerance against `golden`: tight on the machine that made it, else CROSS_MACHINE."""
    return dict(rtol=RTOL, atol=1e-9) if golden.get("machine") == machine() else CROSS_MACHINE


def same(a, b, where: str = "", rtol: float = RTOL, atol: float = 1e-9) -> list[str]:
    """The places where two records differ (floats to rtol / atol); [] when they agree."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(set(a) | set(b)):
            if k not in a or k not in b:
                out.append(f"{where}/{k}: only in {'the golden record' if k in a else 'this run'}")
            else:
                out += same(a[k], b[k], f"{where}/{k}", rtol, atol)
        return out
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return [f"{where}: {len(a)} entries against {len(b)}"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in same(x, y, f"{where}[{i}]", rtol, atol)]
    if isinstance(a, bool) or isinstance(b, bool) or not isinstance(a, (int, float)) or not isinstance(b, (int, float)):
        return [] if a == b else [f"{where}: {a!r} against {b!r}"]
    if isinstance(a, int) and isinstance(b, int):  # counts, steps, token totals: exact on every machine
        return [] if a == b else [f"{where}: {a!r} against {b!r}"]
    if math.isclose(float(a), float(b), rel_tol=rtol, abs_tol=atol):
        return []
    return [f"{where}: {a!r} against {b!r}"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--record", action="store_true", help="write tests/golden/<example>.json (otherwise: compare with it)")
    ap.add_argument("--demo", metavar="RUN", help="instead: the held-out items of a real `make demo` run (runs/demo) against "
                    "tests/golden/demo_heldout.json (with --record: write that file from RUN)")
    ap.add_argument("examples", nargs="*", help="example ids (e.g. demo, objectives/nft); default all")
    args = ap.parse_args(argv)
    if args.demo:
        held = record_evals(Path(args.demo))
        target = GOLDEN / "demo_heldout.json"
        if args.record:
            target.write_text(json.dumps(held, indent=1) + "\n")
            rates = ", ".join(f"{label} {v['success_rate']}" for label, v in held.items())
            print(f"demo: recorded {rates}")
            return 0
        diff = same(json.loads(target.read_text()), held)
        print("demo: same held-out outcomes" if not diff else "demo: DIFFERS: " + "; ".join(diff[:5]))
        return 1 if diff else 0
    chosen = [p for p in EXAMPLES if not args.examples or example_id(p) in args.examples]
    bad = 0
    for path in chosen:
        name = example_id(path)
        why = needs(path)
        if why:
            print(f"{name}: skipped ({why})")
            continue
        with tempfile.TemporaryDirectory() as tmp:
            rec = record(run_example(path, Path(tmp) / "run"))
        target = GOLDEN / f"{name}.json"
        if args.record:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(json.dumps({"example": f"examples/{name}.toml", "machine": machine(), "overrides": overrides(path), **rec}, indent=1) + "\n")
            print(f"{name}: recorded {len(rec['metrics'])} metric rows")
        else:
            golden = json.loads(target.read_text())
            diff = same({k: golden.get(k) for k in ("example", "overrides", "metrics", "eval", "weights")},
                        {"example": f"examples/{name}.toml", "overrides": overrides(path), **rec}, **tolerance(golden))
            bad += bool(diff)
            print(f"{name}: {'same' if not diff else 'DIFFERS: ' + '; '.join(diff[:5])}")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
