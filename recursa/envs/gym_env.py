"""Gymnasium environments as recursa games: text observations, named discrete actions.

    [env]
    name = "recursa.envs.gym_env:GymTextEnv"
    kwargs = { id = "FrozenLake-v1", is_slippery = false, max_steps = 20 }

`GymTextEnv(id, **kwargs)` builds `gymnasium.make(id, render_mode="ansi", **make_kwargs)`
(without the render mode for an env that has no text rendering, e.g. Blackjack)
and plays it as an `AgentEnv` (recursa/envs/protocol.py):

* the observation is the env's text: the observation itself when the observation space is
  `gymnasium.spaces.Text`, else the ANSI rendering with its colour codes removed (the
  toy-text envs mark the player's cell with a colour, so the adapter shows the position
  as the grid row and column when the observation is a cell index of a grid);
* a `Discrete(n)` action space is a list of admissible action names: `action_names` when
  given, the known names of the toy-text envs (FrozenLake, CliffWalking, Taxi, Blackjack),
  else "0" .. "n-1"; a `Text` action space takes the reply as written;
* an action outside the list leaves the env untouched and costs `invalid_penalty`;
* the episode ends when the env terminates or truncates, or after `max_steps` steps; it is
  won when it terminated on a positive reward (the goal of FrozenLake, a won hand of Blackjack,
  a delivered Taxi passenger);
* `reset(seed)` passes the seed to `env.reset(seed=seed)`, so an item is a pure function of the
  seed, and recursa's splits give train, gate and test disjoint seeds. Whether that makes the
  items themselves differ is the env's business: FrozenLake's map is fixed (its seed only
  drives the slipping), so its train and test items share the map; Blackjack deals each seed
  its own cards.

Needs `pip install gymnasium` (in the `envs` extra); without it the spec is a one-line error.
"""

from __future__ import annotations

import re
from typing import Any

from recursa.envs.protocol import StepResult, match_admissible
from recursa.errors import UserError

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_KNOWN_ACTIONS = {
    "FrozenLake": ["left", "down", "right", "up"],
    "CliffWalking": ["up", "right", "down", "left"],
    "Taxi": ["south", "north", "east", "west", "pickup", "dropoff"],
    "Blackjack": ["stick", "hit"],
}
_KNOWN_TASKS = {
    "FrozenLake": "Walk from S to the goal G on the frozen lake without stepping into a hole (H).",
    "CliffWalking": "Walk from the start to the goal along the cliff without falling off (C).",
    "Taxi": "Pick the passenger up and drop them off at their destination.",
    "Blackjack": "Beat the dealer at Blackjack: get closer to 21 without going over.",
}


def _family(env_id: str) -> str:
    return env_id.split("/")[-1].split("-")[0]


class GymTextEnv:
    """A gymnasium env with text observations and named actions (see the module doc)."""

    def __init__(self, id: str, max_steps: int = 50, invalid_penalty: float = 0.1, action_names: list[str] | None = None, **make_kwargs: Any):
        try:
            import gymnasium
        except ImportError:
            raise UserError("env recursa.envs.gym_env:GymTextEnv needs gymnasium: pip install gymnasium (or pip install 'recursa[envs]')") from None
        try:
            self.env = gymnasium.make(id, **make_kwargs)
            self.ansi = "ansi" in (self.env.metadata or {}).get("render_modes", [])
            if self.ansi:  # remade to render text (an env that cannot is shown by its observation alone)
                self.env.close()
                self.env = gymnasium.make(id, render_mode="ansi", **make_kwargs)
        except gymnasium.error.Error as exc:
            raise ValueError(f"gymnasium cannot make {id!r}: {' '.join(str(exc).split())[:200]}") from None
        self.spaces = gymnasium.spaces
        self.id, self.name = id, f"gym:{id}"
        self.max_steps, self.invalid_penalty = int(max_steps), float(invalid_penalty)
        space = self.env.action_space
        if isinstance(space, gymnasium.spaces.Discrete):
            names = list(action_names) if action_names else _KNOWN_ACTIONS.get(_family(id)) or [str(i) for i in range(space.n)]
            if len(names) != space.n:
                raise ValueError(f"{id} has {space.n} actions; action_names lists {len(names)}")
            self.actions: list[str] | None = names
        elif isinstance(space, gymnasium.spaces.Text):
            self.actions = None
        else:
            raise ValueError(f"{id}'s action space {space} is neither Discrete nor Text: recursa plays text actions")
        self.task = _KNOWN_TASKS.get(_family(id), f"Play {id}.")
        self.steps, self.obs, self._last = 0, "", None

    def _text(self, observation: Any) -> str:
        if isinstance(self.env.observation_space, self.spaces.Text):
            return str(observation)
        rendered = _ANSI.sub("", str(self.env.render() or "")).strip("\n") if self.ansi else ""
        where = ""
        desc = getattr(self.env.unwrapped, "desc", None)
        if isinstance(observation, (int,)) or (hasattr(observation, "item") and getattr(observation, "shape", None) == ()):
            cell = int(observation)
            if desc is not None and len(desc) and cell < len(desc) * len(desc[0]):
                where = f"You are at row {cell // len(desc[0])}, column {cell % len(desc[0])}."
            else:
                where = f"State {cell}."
        elif isinstance(observation, tuple):
            where = f"State {tuple(int(x) for x in observation)}."  # e.g. Blackjack: (your sum, the dealer's card, a usable ace)
        return "\n".join(x for x in (rendered, where) if x)

    def reset(self, seed: int) -> str:
        observation, _ = self.env.reset(seed=int(seed))
        self.steps, self._last = 0, observation
        self.obs = self._text(observation)
        return self.obs

    def admissible_actions(self) -> list[str] | None:
        return list(self.actions) if self.actions is not None else None

    def walkthrough(self) -> None:
        return None  # gymnasium envs come with no oracle

    def state_key(self) -> str:
        return f"{self.id}:{self._last!r}"

    def step(self, action_text: str) -> StepResult:
        self.steps += 1
        if self.actions is not None:
            chosen = match_admissible(action_text, self.actions)
            if chosen is None:
                done = self.steps >= self.max_steps
                info = {"won": False, "success": False, "invalid": True, "admissible": self.admissible_actions(), "steps": self.steps, "score": 0.0}
                return StepResult(self.obs, -self.invalid_penalty, done, info)
            action: Any = self.actions.index(chosen)
        else:
            action = action_text
        observation, reward, terminated, truncated, _ = self.env.step(action)
        self._last = observation
        self.obs = self._text(observation)
        won = bool(terminated) and float(reward) > 0
        done = bool(terminated or truncated) or self.steps >= self.max_steps
        info = {"won": won, "success": won, "invalid": False, "admissible": self.admissible_actions(), "steps": self.steps, "score": float(reward)}
        return StepResult(self.obs, float(reward), done, info)

    def close(self) -> None:
        self.env.close()
