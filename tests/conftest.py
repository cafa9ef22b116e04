"""Shared fixtures: the tiny random model (built once per session) and a toy env."""

from __future__ import annotations

import os
import random

import pytest
import torch

from recursa.envs import StepResult, register_env

torch.set_num_threads(2)
# model.device = "auto" means the GPU where there is one; the suite's exact numbers are the
# CPU's, so it pins the CPU (RECURSA_DEVICE=cuda runs it on a GPU; tests/test_device.py runs
# its own recipes on every device present either way).
os.environ.setdefault("RECURSA_DEVICE", "cpu")
# rollout.decode_dtype = "auto" picks a bfloat16 sampling copy only where the CPU multiplies
# bfloat16 in hardware (recursa/hardware.py); the suite's recorded outputs are those of the
# bfloat16 path, so it pins the answer (tests/test_hardware.py checks the detection itself).
os.environ.setdefault("RECURSA_NATIVE_BF16", "1")


@pytest.fixture(autouse=True)
def _torch_threads():
    """Every test starts at the suite's 2 threads: a recipe run sets torch's thread count to its
    run.threads and leaves it there, and results that are exact at one count need not be at
    another (tests/test_ddp.py)."""
    torch.set_num_threads(2)
    yield


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


class CorridorEnv:
    """Toy multi-turn game: walk east along a corridor of `length` rooms to the exit.

    Admissible actions are "go east", "go west" and "wait"; anything else is invalid (no
    state change, reward -invalid_penalty). Reward 1 on reaching the exit."""

    name = "toy-corridor"
    system_prompt = None

    def __init__(self, length: int = 3, max_steps: int = 6, invalid_penalty: float = 0.1):
        self.length, self.max_steps, self.invalid_penalty = length, max_steps, invalid_penalty
        self.task, self.pos, self.steps = "", 0, 0

    def _obs(self) -> str:
        return f"You are in room {self.pos} of {self.length}."

    def reset(self, seed: int) -> str:
        self.pos, self.steps = random.Random(seed).randint(0, 1), 0
        self.task = f"Your task is to: reach room {self.length}."
        return self._obs()

    def admissible_actions(self) -> list[str]:
        return ["go east", "go west", "wait"]

    def walkthrough(self) -> list[str]:
        return ["go east"] * (self.length - self.pos)

    def step(self, action_text: str) -> StepResult:
        self.steps += 1
        invalid = action_text not in self.admissible_actions()
        if not invalid:
            self.pos = max(0, self.pos + {"go east": 1, "go west": -1, "wait": 0}[action_text])
        won = self.pos >= self.length
        done = won or self.steps >= self.max_steps
        reward = (1.0 if won else 0.0) - (self.invalid_penalty if invalid else 0.0)
        info = {"won": won, "success": won, "invalid": invalid, "admissible": self.admissible_actions(), "steps": self.steps, "score": float(won)}
        return StepResult("Nothing happens." if invalid else self._obs(), reward, done, info)


register_env("toy-digits", DigitsEnv, "toy: reward = fraction of digit characters (tests)")
register_env("toy-corridor", CorridorEnv, "toy multi-turn game: walk east to the exit (tests)")


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
