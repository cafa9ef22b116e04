"""The decisions of a gated run as one small result file: prompt rounds, weight gates, the
held-out curve, and paired comparisons on the same test items.

A run with `[gate]` (`examples/gate_prompt_demo.toml`, `examples/gate_prompt_twx.toml`) keeps
its decisions in RUN_DIR/metrics.jsonl (`prompt/*`, `gate/*`) and in its lineage
(RUN_DIR/ledger.sqlite, which holds each round's best proposal in full). Run directories are
large and do not outlive a session, so this writes what a results page quotes into a JSON
file that can be committed:

    python benchmarks/gate_rounds.py runs/gate_prompt_twx --config examples/gate_prompt_twx.toml \\
        --baseline benchmarks/results/self_improve/twx_twc/grpo_seed0.json \\
        --out benchmarks/results/loops/gate_prompt_twx.json --machine "2-core CPU, alone"

`before` / `after` are the run's own held-out evaluations (RUN_DIR/eval/{before,after}.json);
`paired` compares them item by item (exact McNemar test, Newcombe's interval), and, with
`--baseline`, compares the run's final evaluation with another run's on the items both played:
a result file of `benchmarks/rsipo_vs_grpo.py` (its `heldout`) or an `eval/*.json` file.
"""

from __future__ import annotations

import argparse
import json
import sqlite3
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from recursa.stats import paired_compare  # noqa: E402

PROMPT_KEYS = ("proposals", "malformed", "accepted", "p_value", "gain", "selection_rate", "incumbent_rate", "candidate_rate")
GATE_KEYS = ("accepted", "rolled_back", "p_value", "alpha_t", "gain", "incumbent_rate", "candidate_rate", "regressions")


def _rows(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    if not path.exists():
        raise SystemExit(f"error: {run} has no metrics.jsonl: pass the directory of a `recursa train` run")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _proposals(run: Path) -> dict[int, str]:
    """Step -> the text of that prompt round's best proposal, from the run's lineage."""
    db = run / "ledger.sqlite"
    if not db.exists():
        return {}
    from recursa.lineage import Lineage

    con = sqlite3.connect(db)
    try:
        return {c.step: c.payload["text"] for c in Lineage(con).candidates("prompt") if not c.is_root and isinstance(c.payload, dict)}
    finally:
        con.close()


def _items(data: dict) -> dict[int, bool]:
    """Seed -> success of a benchmark result file (its `heldout`) or an eval JSON."""
    items = data["heldout"]["items"] if "heldout" in data else data["items"]
    return {int(i["seed"]): bool(i["success"]) for i in items}


def _eval(path: Path) -> dict | None:
    if not path.exists():
        return None
    d = json.loads(path.read_text())
    return {"success_rate": d["success_rate"], "n": d["n"], "ci95": d["ci95"], "items": _items(d)}


def _paired(first: dict[int, bool], second: dict[int, bool], first_name: str, second_name: str) -> dict:
    seeds = sorted(set(first) & set(second))
    if not seeds:
        raise SystemExit(f"error: {first_name} and {second_name} share no held-out item")
    cmp = paired_compare([first[s] for s in seeds], [second[s] for s in seeds])
    return {"first": first_name, "second": second_name, "n": cmp["n"], "first_rate": cmp["before_rate"], "second_rate": cmp["after_rate"],
            "diff": cmp["diff"], "diff_ci95": list(cmp["diff_ci95"]), "second_only": cmp["b"], "first_only": cmp["c"],
            "p_two_sided": cmp["p_two_sided"], "p_second_better": cmp["p_greater"]}


def summarise(run: Path, config: str | None = None, baseline: Path | None = None, machine: str = "") -> dict:
    rows = _rows(run)
    texts = _proposals(run)
    prompt_rounds, weight_gates, curve = [], [], []
    for r in rows:
        step = int(r.get("step", 0))
        if "prompt/proposals" in r:
            rnd = {"step": step, **{k: r[f"prompt/{k}"] for k in PROMPT_KEYS if f"prompt/{k}" in r}}
            if step in texts:
                rnd["proposal"] = texts[step]
            prompt_rounds.append(rnd)
        if "gate/accepted" in r:
            weight_gates.append({"step": step, **{k: r[f"gate/{k}"] for k in GATE_KEYS if f"gate/{k}" in r}})
        if "eval/success_rate" in r:
            curve.append({"step": step, "success_rate": r["eval/success_rate"], "n": r.get("eval/n"),
                          "ci95": [r.get("eval/ci95_lo"), r.get("eval/ci95_hi")]})
    before, after = _eval(run / "eval" / "before.json"), _eval(run / "eval" / "after.json")
    if after is None:
        raise SystemExit(f"error: {run} has no eval/after.json: the run has not finished (resume it with the same command)")
    out = {"config": config, "command": f"recursa train {config}" if config else None, "date": time.strftime("%Y-%m-%d"), "machine": machine}
    if before is not None:
        out["before"] = {k: before[k] for k in ("success_rate", "n", "ci95")}
    out["after"] = {k: after[k] for k in ("success_rate", "n", "ci95")}
    out["curve"] = curve
    out["prompt_rounds"] = prompt_rounds
    out["weight_gates"] = weight_gates
    paired = []
    if before is not None:
        paired.append(_paired(before["items"], after["items"], "before", "after"))
    if baseline is not None:
        paired.append(_paired(_items(json.loads(baseline.read_text())), after["items"], str(baseline.relative_to(ROOT) if baseline.is_relative_to(ROOT) else baseline), "after"))
    out["paired"] = paired
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", type=Path, help="the run directory")
    ap.add_argument("--config", help="the config the run was trained with (recorded with its command)")
    ap.add_argument("--baseline", type=Path, help="another run's held-out result to compare with on the same items")
    ap.add_argument("--machine", default="", help="where and how it ran (recorded as given)")
    ap.add_argument("--out", type=Path, help="the JSON file to write (default: print)")
    args = ap.parse_args(argv)
    if args.baseline is not None:
        args.baseline = args.baseline.resolve()
        if not args.baseline.exists():
            raise SystemExit(f"error: no baseline file {args.baseline}")
    result = summarise(args.run, args.config, args.baseline, args.machine)
    text = json.dumps(result, indent=1)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
        print(f"wrote {args.out}")
    else:
        print(text)
    for p in result["paired"]:
        print(f"{p['second']} vs {p['first']} on {p['n']} items: {p['second_rate']:.3f} vs {p['first_rate']:.3f}, "
              f"diff {p['diff']:+.3f} [{p['diff_ci95'][0]:+.3f}, {p['diff_ci95'][1]:+.3f}], {p['second_only']} won / {p['first_only']} lost, "
              f"p(two-sided) {p['p_two_sided']:.3g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
