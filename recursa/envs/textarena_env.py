"""Single-player TextArena games as recursa games.

    [env]
    name = "recursa.envs.textarena_env:TextArenaEnv"
    kwargs = { game = "GuessTheNumber-v0", max_steps = 12 }

`TextArenaEnv(game)` builds `textarena.make(game)` and plays it with one player as an
`AgentEnv` (recursa/envs/protocol.py):

* `reset(seed)` calls `env.reset(num_players=1, seed=seed)`: the game's item is a pure
  function of the seed, so recursa's train, gate and test seeds give disjoint items (as far
  as the game draws its item from the seed: GuessTheNumber draws its number from it);
* the first observation is the game's opening text; each later one is only what the game
  added since the policy's last move (TextArena's observation repeats the whole history,
  which the turn mode's history window or the chat already holds);
* the reply is sent as written (TextArena games read their own move syntax, e.g. `[5]`),
  so `admissible_actions()` is None; there is no walkthrough;
* a move the game refuses ("You attempted an invalid move", which TextArena games allow a
  few times before they end the game) is counted invalid;
* when the game ends, `env.close()` gives the player's reward; the episode is won when it
  is positive. After `max_steps` moves the episode ends unwon (the game is closed).

Needs `pip install textarena` (the `textarena` extra); without it the spec is a one-line error.
"""

from __future__ import annotations

from recursa.envs.protocol import StepResult
from recursa.errors import UserError


class TextArenaEnv:
    """A single-player TextArena game (see the module doc)."""

    invalid_penalty = 0.0

    def __init__(self, game: str, max_steps: int = 20):
        try:
            import textarena
        except ImportError:
            raise UserError("env recursa.envs.textarena_env:TextArenaEnv needs textarena: pip install textarena (or pip install 'recursa[textarena]')") from None
        try:
            self.env = textarena.make(game)
        except Exception as exc:  # textarena raises plain exceptions for unknown ids
            raise ValueError(f"textarena cannot make {game!r}: {' '.join(str(exc).split())[:200]}") from None
        self.game, self.name = game, f"ta:{game}"
        self.max_steps = int(max_steps)
        self.task = f"Play the TextArena game {game.split('-')[0]}; the game's messages say how to move."
        self.steps, self.seen, self.open = 0, "", False

    def _new_text(self) -> str:
        _, full = self.env.get_observation()
        full = full if isinstance(full, str) else str(full)
        new = full[len(self.seen):] if full.startswith(self.seen) else full
        self.seen = full
        return new.strip()

    def reset(self, seed: int) -> str:
        if self.open:
            self.env.close()
        self.env.reset(num_players=1, seed=int(seed))
        self.steps, self.seen, self.open = 0, "", True
        return self._new_text()

    def admissible_actions(self) -> None:
        return None

    def walkthrough(self) -> None:
        return None

    def _end(self, out_of_steps: bool) -> tuple[float, bool, dict]:
        rewards, game_info = self.env.close()
        self.open = False
        reward = 0.0 if out_of_steps else float((rewards or {}).get(0, 0.0))
        info = (game_info or {}).get(0, {}) or {}
        return reward, reward > 0, info

    def step(self, action_text: str) -> StepResult:
        self.steps += 1
        done, _ = self.env.step(action=action_text or "")
        out_of_steps = not done and self.steps >= self.max_steps
        base = {"invalid": False, "admissible": None, "steps": self.steps}
        if done or out_of_steps:
            reward, won, info = self._end(out_of_steps)
            note = "" if done else "max_steps"
            return StepResult(str(info.get("reason", "")), reward, True,
                              {**base, "won": won, "success": won, "score": reward, "invalid": bool(info.get("invalid_move", False)), "note": note})
        text = self._new_text()
        base["invalid"] = "attempted an invalid move" in text  # TextArena's own words; a game may allow a few before it ends
        return StepResult(text, 0.0, False, {**base, "won": False, "success": False, "score": 0.0})

    def close(self) -> None:
        if self.open:
            self.env.close()
            self.open = False
