"""Which signal each attempt learns from: routing by group pass rate, and the critical step.

Routing by pass rate (DRIFT; the sample routing of SRPO, Li et al. 2026,
arXiv:2604.02288, made group-level).  A group of G attempts at one task is

    all_fail  no attempt succeeded   -> the outcome advantage is 0; learn from the teacher
                                        (and from hinted re-rolls, `recursa.algorithms.hinted`)
    mixed     some did, some did not -> the outcome advantage (plus the teacher)
    all_win   every attempt did      -> the outcome advantage is 0; learn from stored
                                        successes (a supervised term on winning episodes)

`group_routes` classifies the groups and `route_gate` turns a per-route on/off choice for
the teacher term into a per-group factor (1 or 0) that multiplies the teacher's trust.

The critical step (OPID-like teaching where it matters).  In a deterministic game, a
failed attempt and a winning attempt of the same game (same seed) see the same
observations as long as they take the same actions; the first turn where the failed
attempt's action differs is where it left the winning path:

    k = min { t : o_f[t] = o_w[t], a_f[t] != a_w[t], and o_f[s] = o_w[s], a_f[s] = a_w[s] for s < t }

`divergence_turn` returns k, or None when there is no verdict: the observations differ
before any action does (the game was not deterministic for these two attempts) or one
attempt ends while still on the other's path. `critical_weights` then weights the
teacher term of the failed attempt's turns: 1 at (mode "at") or from (mode "from") turn
k, `before` on the turns before it.
"""

from __future__ import annotations

from typing import Sequence

import torch

__all__ = ["ROUTES", "ALL_FAIL", "MIXED", "ALL_WIN", "group_routes", "route_counts", "route_gate", "divergence_turn", "critical_weights"]

ROUTES: tuple[str, ...] = ("all_fail", "mixed", "all_win")
ALL_FAIL, MIXED, ALL_WIN = 0, 1, 2


def _shape(x: object) -> object:
    return tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__


def group_routes(success: torch.Tensor) -> torch.Tensor:
    """Route of each group: 0 all_fail, 1 mixed, 2 all_win.  (B, G) bool -> (B,) long"""
    if not isinstance(success, torch.Tensor) or success.dim() != 2 or success.shape[1] == 0:
        raise ValueError(f"success must be a tensor of shape (B, G) with G >= 1, got {_shape(success)}")
    passed = success.bool()
    routes = torch.full((success.shape[0],), MIXED, dtype=torch.long, device=success.device)
    routes[~passed.any(dim=1)] = ALL_FAIL
    routes[passed.all(dim=1)] = ALL_WIN
    return routes


def route_counts(routes: torch.Tensor) -> dict[str, float]:
    """{"route/all_fail": ..., "route/mixed": ..., "route/all_win": ...}: groups per route."""
    return {f"route/{name}": float((routes == code).sum()) for code, name in enumerate(ROUTES)}


def route_gate(routes: torch.Tensor, all_fail: bool, mixed: bool, all_win: bool) -> torch.Tensor:
    """Per group, 1.0 where the teacher term is on for its route, else 0.0.  (B,) -> (B,) float"""
    if not isinstance(routes, torch.Tensor) or routes.dim() != 1:
        raise ValueError(f"routes must be a tensor of shape (B,), got {_shape(routes)}")
    on = torch.tensor([float(all_fail), float(mixed), float(all_win)], device=routes.device)
    return on[routes]


def divergence_turn(failed: Sequence[tuple[str, str]], won: Sequence[tuple[str, str]]) -> int | None:
    """The turn where `failed` left the path of `won` (see the module doc), or None.

    failed, won: the (observation, action) of each turn of a failed and a winning attempt
    of the same game, in order."""
    for t in range(min(len(failed), len(won))):
        (obs_f, act_f), (obs_w, act_w) = failed[t], won[t]
        if obs_f != obs_w:
            return None  # same actions so far, different observations: no verdict
        if act_f != act_w:
            return t
    return None


def critical_weights(n_turns: int, turn: int | None, mode: str = "from", before: float = 0.0, unmatched: float = 1.0) -> list[float]:
    """Weight of the teacher term on each of a failed attempt's `n_turns` turns.

    turn None (no divergence found): `unmatched` on every turn.  Otherwise `before` on turns
    < turn, 1 on turn `turn`, and on later turns 1 (mode "from") or `before` (mode "at")."""
    if mode not in ("from", "at"):
        raise ValueError(f"unknown mode {mode!r}; valid choices are 'from' and 'at'")
    if n_turns < 0 or (turn is not None and not 0 <= turn < max(n_turns, 1)):
        raise ValueError(f"turn must lie in [0, n_turns) = [0, {n_turns}), got {turn}")
    if not (before >= 0 and unmatched >= 0):
        raise ValueError(f"before and unmatched must be >= 0, got {before} and {unmatched}")
    if turn is None:
        return [float(unmatched)] * n_turns
    after = 1.0 if mode == "from" else float(before)
    return [float(before) if t < turn else (1.0 if t == turn else after) for t in range(n_turns)]
