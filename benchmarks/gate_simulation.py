#!/usr/bin/env python
"""Simulate the acceptance gate: false-accept rate, power at the prescribed size, spending.

    python benchmarks/gate_simulation.py                       # 2000 gates per measurement
    python benchmarks/gate_simulation.py --sims 500 --gain 0.05 --p-incumbent 0.7

Three measurements, each over --sims simulated gates (recursa.gate.binary_gate on drawn
per-item outcomes), reported with 95% Wilson intervals:

* false accept: a useless candidate. Both systems solve item i with the same probability
  p_i ~ Beta(p * kappa, (1 - p) * kappa) (mean p = --p-incumbent, kappa = --concentration),
  independently given p_i, so items are correlated across the two systems as real gate
  items are. Must be <= alpha (the exact McNemar test is conservative).
* power: incumbent solves each item with p, candidate with p + gain, independently (the
  model sample_size_for_gain assumes) on n = sample_size_for_gain(p, gain, alpha, power)
  items. Must be >= --power; the exact mcnemar_power(n) is printed beside it.
* familywise: --rounds useless candidates in a row; the rate at which at least one is
  accepted, with constant spending (grows like 1 - (1 - alpha)^rounds) and with Basel
  spending alpha_t = 6 alpha / (pi^2 t^2) (stays <= alpha).

Writes the numbers and settings to --out (JSON).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from recursa.gate import GateConfig, binary_gate, mcnemar_power, sample_size_for_gain  # noqa: E402
from recursa.stats import wilson_interval  # noqa: E402


def rate_with_ci(hits: int, sims: int) -> dict:
    """{"rate", "ci95", "hits", "sims"} for hits out of sims (Wilson interval)."""
    lo, hi = wilson_interval(hits, sims)
    return {"rate": hits / sims, "ci95": [lo, hi], "hits": hits, "sims": sims}


def null_outcomes(rng: np.random.Generator, n: int, p: float, kappa: float) -> tuple[np.ndarray, np.ndarray]:
    """(incumbent, candidate) successes, each (n,), for a useless candidate on correlated items."""
    p_item = rng.beta(p * kappa, (1.0 - p) * kappa, size=n)
    return rng.random(n) < p_item, rng.random(n) < p_item


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sims", type=int, default=2000, help="simulated gates per measurement")
    ap.add_argument("--alpha", type=float, default=0.05, help="gate error budget")
    ap.add_argument("--p-incumbent", type=float, default=0.5, help="incumbent solve rate")
    ap.add_argument("--gain", type=float, default=0.1, help="true gain of the better candidate")
    ap.add_argument("--power", type=float, default=0.8, help="target power for the sample size")
    ap.add_argument("--concentration", type=float, default=2.0,
                    help="kappa of the Beta item-difficulty model under H0 (smaller: more correlated)")
    ap.add_argument("--rounds", type=int, default=10, help="rounds for the familywise measurement")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "gate_simulation.json")
    args = ap.parse_args()
    if args.sims < 1 or args.rounds < 1 or args.concentration <= 0:
        ap.error("--sims and --rounds must be >= 1 and --concentration > 0")

    start = time.perf_counter()
    p, gain, alpha = args.p_incumbent, args.gain, args.alpha
    constant = GateConfig(alpha=alpha)
    basel = GateConfig(alpha=alpha, spending="basel")
    n = sample_size_for_gain(p, gain, alpha=alpha, power=args.power)
    p10, p01 = (p + gain) * (1.0 - p), p * (1.0 - p - gain)
    rng = np.random.default_rng(args.seed)

    false_accepts = sum(
        binary_gate(*null_outcomes(rng, n, p, args.concentration), constant).accepted
        for _ in range(args.sims)
    )
    power_hits = sum(
        binary_gate(rng.random(n) < p, rng.random(n) < p + gain, constant).accepted
        for _ in range(args.sims)
    )
    ever_constant = ever_basel = 0
    for _ in range(args.sims):
        accepted = {"constant": False, "basel": False}
        for t in range(1, args.rounds + 1):
            inc, cand = null_outcomes(rng, n, p, args.concentration)
            accepted["constant"] |= binary_gate(inc, cand, constant, t=t).accepted
            accepted["basel"] |= binary_gate(inc, cand, basel, t=t).accepted
        ever_constant += accepted["constant"]
        ever_basel += accepted["basel"]

    result = {
        "settings": {
            "sims": args.sims, "alpha": alpha, "p_incumbent": p, "gain": gain,
            "target_power": args.power, "concentration": args.concentration,
            "rounds": args.rounds, "seed": args.seed,
        },
        "sample_size": n,
        "discordance": {"p10_candidate_only": p10, "p01_incumbent_only": p01},
        "false_accept": rate_with_ci(false_accepts, args.sims),
        "power": rate_with_ci(power_hits, args.sims),
        "power_exact": mcnemar_power(n, p10, p01, alpha),
        "familywise_constant": rate_with_ci(ever_constant, args.sims),
        "familywise_basel": rate_with_ci(ever_basel, args.sims),
        "seconds": round(time.perf_counter() - start, 2),
    }

    def line(name: str, r: dict, target: str) -> str:
        lo, hi = r["ci95"]
        return f"{name:<46} {r['rate']:.4f}  [{lo:.4f}, {hi:.4f}]  {target}"

    print(f"sample size for p={p} -> {p + gain} (alpha={alpha}, power={args.power}): n = {n} items")
    print(line("false accept (useless candidate)", result["false_accept"], f"<= {alpha}"))
    exact = f">= {args.power} (exact {result['power_exact']:.4f})"
    print(line("power (candidate +gain)", result["power"], exact))
    rounds = f"ever false accept, {args.rounds} rounds"
    print(line(f"{rounds}, constant", result["familywise_constant"], "grows with rounds"))
    print(line(f"{rounds}, basel", result["familywise_basel"], f"<= {alpha}"))
    print(f"{args.sims} sims per row, seed {args.seed}, {result['seconds']} s")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
