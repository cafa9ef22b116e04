"""GOPO's tie rule on a softmax bandit (issue 50): the release's sort-order ties
(`algo.advantage = "gopo"`: a constant group of 4 gets 2, 2/3, -2/3, -2 by rollout index)
against ties sharing their average rank (`"gopo_avg"`: a constant group gets 0), same scale.

B independent K-armed bandits (one right arm, reward 1, else 0), each a prompt with its own
logits; G samples per prompt and step; the loss -mean(A log pi(a)); Adam. The right arm
starts at logit `init` (the others 0), so a low `init` makes most groups all-fail constant
groups, as on a hard task. Prints the mean probability of the right arm after `--steps`
steps, over `--seeds` seeds, with its standard error.

    python benchmarks/gopo_ties.py                 # 3 starts x 2 rules x 20 seeds, ~3 min on 2 CPU cores
    python benchmarks/gopo_ties.py --seeds 5 --steps 50
    python benchmarks/gopo_ties.py --optimizer sgd --lr 8 --inits -2 --seeds 10   # plain SGD (the loss is a mean over B x G = 64 terms)
"""

from __future__ import annotations

import argparse
import math

import torch

from recursa.algorithms.advantages import gopo, gopo_avg

RULES = {"order": gopo, "average": gopo_avg}


def run(rule: str, seed: int, init: float, K: int = 8, G: int = 4, B: int = 16, steps: int = 150, lr: float = 0.05,
        optimizer: str = "adam") -> float:
    """The mean over the B bandits of pi(right arm) after `steps` optimizer steps (Adam or SGD)."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.zeros(B, K)
    logits[:, 0] = init
    logits.requires_grad_(True)
    opt = torch.optim.Adam([logits], lr=lr) if optimizer == "adam" else torch.optim.SGD([logits], lr=lr)
    for _ in range(steps):
        probs = torch.softmax(logits, -1).detach()
        arms = torch.multinomial(probs, G, replacement=True, generator=gen)  # (B, G)
        adv = RULES[rule]((arms == 0).float())  # (B, G)
        loss = -(adv * torch.log_softmax(logits, -1).gather(1, arms)).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        return torch.softmax(logits, -1)[:, 0].mean().item()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=20)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--inits", type=float, nargs="+", default=[-2.0, 0.0, 3.0])
    ap.add_argument("--optimizer", choices=["adam", "sgd"], default="adam")
    ap.add_argument("--lr", type=float, default=0.05)
    args = ap.parse_args()
    for init in args.inits:
        p0 = math.exp(init) / (math.exp(init) + 7)
        for rule in RULES:
            vals = [run(rule, s, init, steps=args.steps, lr=args.lr, optimizer=args.optimizer) for s in range(args.seeds)]
            mean = sum(vals) / len(vals)
            se = (sum((v - mean) ** 2 for v in vals) / max(len(vals) - 1, 1)) ** 0.5 / len(vals) ** 0.5
            print(f"{args.optimizer} lr {args.lr:g}, start pi(right) {p0:.3f}, ties by {rule:7s}: pi(right) after {args.steps} steps "
                  f"{mean:.3f} +- {se:.3f} ({args.seeds} seeds)")


if __name__ == "__main__":
    main()
