"""Text environments: the `Env` protocol, seed splits and the `make_env` registry.

    from recursa.envs import make_env, split_seeds
    env = make_env("arithmetic", difficulty=1)
    for seed in split_seeds("train", 8):
        prompt = env.reset(seed)
        result = env.step(model_reply(prompt))
"""

from recursa.envs.base import (
    SPLITS,
    AgentEnv,
    Env,
    EnvPool,
    StepResult,
    env_factory,
    extract_answer,
    last_number,
    list_envs,
    list_reasoning_gym_datasets,
    make_env,
    register_env,
    split_of,
    split_seed,
    split_seeds,
    system_prompt_of,
)

__all__ = [
    "SPLITS",
    "AgentEnv",
    "Env",
    "EnvPool",
    "StepResult",
    "env_factory",
    "extract_answer",
    "last_number",
    "list_envs",
    "list_reasoning_gym_datasets",
    "make_env",
    "register_env",
    "split_of",
    "split_seed",
    "split_seeds",
    "system_prompt_of",
]
