"""Step-level advantages of GiGPO (Feng et al., 2025, "Group-in-Group Policy Optimization
for LLM Agent Training").

Within one group (the G episodes of the same game seed), every step is keyed by its
anchor state (here: the observation text the policy acted on, or a state key the game
provides). Steps that share an anchor form a step group; each step's discounted return

    R_t = sum_{k >= t} gamma^(k - t) r_k

is compared with the other steps of its step group:

    A_S(t) = (R_t - mean_{step group} R) / (std_{step group} R + eps)     (norm = "std")
    A_S(t) =  R_t - mean_{step group} R                                   (norm = "none")

and the token advantage of step t in episode i is A_E(i) + weight * A_S(t), with A_E the
episode-level advantage of any outcome estimator (grpo, rloo, ...). Step groups of one
step, or of equal returns, give A_S = 0, so the step term only acts where the same state
was met more than once and the futures from it differed. The std is the unbiased one,
as in our `grpo` estimator.
"""

from __future__ import annotations

from collections import defaultdict


def discounted_returns(rewards: list[float], gamma: float) -> list[float]:
    """R_t = r_t + gamma * R_{t+1}, from the last step backwards."""
    out = [0.0] * len(rewards)
    running = 0.0
    for t in range(len(rewards) - 1, -1, -1):
        running = rewards[t] + gamma * running
        out[t] = running
    return out


def step_advantages(
    groups: list[int],
    anchors: list[list[str]],
    rewards: list[list[float]],
    gamma: float = 0.95,
    norm: str = "std",
    eps: float = 1e-6,
) -> list[list[float]]:
    """Per-step advantages for E episodes.

    `groups[e]`: the episode's group id; `anchors[e][t]`, `rewards[e][t]`: the anchor key and
    reward of step t of episode e. Returns `A_S[e][t]`.
    """
    if norm not in ("std", "none"):
        raise ValueError(f"norm must be 'std' or 'none', got {norm!r}")
    if not (len(groups) == len(anchors) == len(rewards)):
        raise ValueError("groups, anchors and rewards must have one entry per episode")
    returns = [discounted_returns(r, gamma) for r in rewards]
    buckets: dict[tuple[int, str], list[tuple[int, int]]] = defaultdict(list)
    for e, (g, keys) in enumerate(zip(groups, anchors)):
        if len(keys) != len(rewards[e]):
            raise ValueError(f"episode {e}: {len(keys)} anchors but {len(rewards[e])} rewards")
        for t, key in enumerate(keys):
            buckets[(g, key)].append((e, t))
    out = [[0.0] * len(r) for r in rewards]
    for members in buckets.values():
        if len(members) < 2:
            continue
        values = [returns[e][t] for e, t in members]
        mean = sum(values) / len(values)
        if max(values) == min(values):
            continue
        scale = 1.0
        if norm == "std":
            var = sum((v - mean) ** 2 for v in values) / (len(values) - 1)
            scale = var**0.5 + eps
        for (e, t), v in zip(members, values):
            out[e][t] = (v - mean) / scale
    return out
