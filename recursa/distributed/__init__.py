"""Running recursa across processes and machines.

`recursa.distributed.ddp` is the data-parallel learner (`torchrun`). `recursa.distributed.rollouts`
is the rollout backend a recipe asks for trajectories: in this process, or on Ray actors
through `recursa.distributed.ray_rollout`, imported only when `distributed.backend = "ray"`,
so Ray stays optional.
"""
