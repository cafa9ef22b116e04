"""Shared fixtures: the tiny random model (built once per session) and a toy env."""

from __future__ import annotations

import random

import pytest
import torch

from recursa.envs import StepResult, register_env

torch.set_num_threads(2)


class DigitsEnv:
    """Toy task for learning tests: the reward is the fraction of the reply's characters
    that are digits. A random tiny model starts near 2% and can be pushed far higher."""

    name = "toy-digits"
    system_prompt = None

    def reset(self, seed: int) -> str:
        return f"Write digits. Item {random.Random(seed).randint(0, 9)}."

    def step(self, action_text: str) -> StepResult:
        text = action_text or ""
        frac = sum(c.isdigit() for c in text) / max(len(text), 1)
        return StepResult("", float(frac), True, {"success": frac >= 0.5})


register_env("toy-digits", DigitsEnv, "toy: reward = fraction of digit characters (tests)")


@pytest.fixture(scope="session")
def tiny_policy():
    from recursa.config import ModelConfig
    from recursa.models import load_policy

    return load_policy(ModelConfig(name="tiny-random"))


@pytest.fixture
def fresh_tiny_policy():
    from recursa.config import ModelConfig
    from recursa.models import load_policy

    return load_policy(ModelConfig(name="tiny-random"))
