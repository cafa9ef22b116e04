"""Rollout backends: what a recipe asks for a step's trajectories.

    rollouts = make_rollouts(cfg, policy, pool)          # once per run
    ro  = rollouts.rollout(seeds, G, sampling, gen, system_prompt)            # single-turn
    ero = rollouts.episodes(seeds, G, sampling, gen, system_prompt, agent)    # games
    rollouts.close()

A call is a pure function of (the policy's current weights, the task seeds, the group size,
the sampling settings, the step generator's state), with the same signature and result as
`recursa.rollout.rollout` / `rollout_episodes` minus the policy and envs the backend holds:

* `LocalRollouts` (`distributed.backend = "none"`) runs them in this process on the
  recipe's policy and env pool;
* `RayRollouts` (`distributed.backend = "ray"`, `recursa.distributed.ray_rollout`) splits
  the step's task groups into contiguous shards, one per Ray actor, each actor holding a
  copy of the policy (new weights every call, through the object store) and its own envs,
  and concatenates the shards' results in order.

Random streams (`sampling.streams`, resolved by `config.rollout_streams`): with "step" the
whole step samples from the step generator itself (the single-process default; what every
run before this module did). With "group" the backend first draws one 63-bit seed per task
group from the step generator (`generation.group_seeds`) and each group samples from its
own generator; then a group's trajectories depend only on its seed, its task and the
weights, so a split across workers, a worker's share redone after it died, and the
single-process call all give the same trajectories (the same sampled tokens, texts and
rewards; the sampler's log-probs agree to float rounding, since a shard is a smaller batch
with other padding), and the step generator is left in the same state for the rest of the
step (the update's shuffles, skill writing). The Ray backend always uses "group" streams.

`play` is the one place a backend calls the rollout functions (a rollout engine is passed
there, once engines exist). A request may carry per-seed action prefixes (`rollout.branch`):
they are split with their seeds, so branch continuations shard across workers like any
episodes.
"""

from __future__ import annotations

from typing import Callable

from recursa.distributed.local import LocalRollouts, Result, RolloutBackend, RolloutRequest, merge, play, shard_bounds  # noqa: F401  (re-exported)
from recursa.envs import EnvPool
from recursa.models import Policy


def make_rollouts(cfg, policy: Policy, pool: EnvPool, log: Callable[[str], None] = print, engine=None) -> RolloutBackend:
    """The rollout backend `cfg.distributed` asks for; the local one samples with `engine` (None:
    native). Ray is imported only for `backend = "ray"` (its workers run the native sampler);
    without it installed that is a one-line error."""
    from recursa.config import rollout_streams

    if cfg.distributed.backend == "none":
        return LocalRollouts(policy, pool, rollout_streams(cfg), engine)
    from recursa.errors import UserError

    try:
        import ray  # noqa: F401
    except ImportError:
        raise UserError("distributed.backend = 'ray' needs Ray: pip install 'recursa[ray]' (or set distributed.backend = 'none')") from None
    from recursa.distributed.ray_rollout import RayRollouts

    return RayRollouts(cfg, policy, log)
