"""Where the work of a training step runs: in the trainer's process or spread over workers.

`recursa.distributed.rollouts` is the rollout backend a recipe asks for trajectories (in
this process, or on Ray actors through `recursa.distributed.ray_rollout`, imported only
when `distributed.backend = "ray"`, so Ray stays optional).
"""
