"""OpenEnv environments as recursa games: a running env server by URL, or an env class in process.

    [env]
    name = "openenv:http://127.0.0.1:8000"      # a running OpenEnv server
    # name = "openenv:my_pkg.envs:EchoEnvironment" # or an openenv Environment subclass, in process
    kwargs = { max_steps = 10 }

OpenEnv (`openenv-core`, `import openenv`) serves an `Environment` (reset / step / state over
pydantic `Action` and `Observation` models) with `openenv.core.env_server.create_app`: a
FastAPI app whose `/ws` WebSocket holds one session (one env instance) per connection, while
its plain HTTP `/reset` and `/step` build a fresh env per request (so an episode needs the
WebSocket). The adapter plays it as an `AgentEnv` (recursa/envs/protocol.py):

* a URL is played through `openenv.GenericEnvClient(base_url=url).sync()` (one WebSocket
  session per adapter instance), with the action's JSON schema read from the server's
  `/schema`; a `pkg.module:Class` is built in process (`Class(**env_kwargs)`) with its action
  class taken from its `step` signature, and observations are serialised as the server would
  (`serialize_observation`), so both paths see the same dicts;
* `reset(seed)` sends `reset(seed=seed, episode_id=...)`: an item is a pure function of the seed
  as far as the env draws it from the seed, and recursa's train, gate and test seeds are
  disjoint;
* the reply becomes the action: with `action_field` (or when the action has one field the
  reply can fill, a string, besides OpenEnv's `metadata`) the reply is that field; otherwise
  the reply must be the action as a JSON object. A reply that is not an action (bad JSON, a
  value the server's validation refuses) leaves the env untouched, is counted invalid and
  costs `invalid_penalty`. A string field with an `enum` lists the admissible actions;
* the observation's text is its `observation_field`, else its one field, else its fields as
  `name: value` lines; the reward is the observation's `reward` (None is 0); the episode ends
  when the observation says `done` (won when its reward is positive) or after `max_steps`.

Needs `pip install openenv-core` (the `openenv` extra); without it the spec is a one-line error.
"""

from __future__ import annotations

import json
import urllib.parse
import urllib.request
from typing import Any, get_type_hints

from recursa.envs.protocol import StepResult, match_admissible, one_line
from recursa.errors import UserError
from recursa.registry import import_object


def _openenv():
    try:
        import openenv
        from openenv.core.env_server import serialization
    except ImportError:
        raise UserError("env openenv:<url-or-class> needs openenv-core: pip install openenv-core (or pip install 'recursa[openenv]')") from None
    return openenv, serialization


def _is_url(spec: str) -> bool:
    return spec.split("://", 1)[0] in ("http", "https", "ws", "wss") and "://" in spec


def _http(spec: str) -> str:
    scheme, rest = spec.split("://", 1)
    return f"{ {'ws': 'http', 'wss': 'https'}.get(scheme, scheme)}://{rest}".rstrip("/")


def _route(base: str, name: str) -> str:
    """The URL of the server's route `name` (OpenEnv's `/schema`, `/metadata`)."""
    return urllib.parse.urljoin(base + "/", name)


def _get_json(url: str, timeout: float) -> dict:
    with urllib.request.urlopen(url, timeout=timeout) as response:  # noqa: S310 - the user's own env server
        return json.loads(response.read().decode("utf-8"))


class _Local:
    """An Environment subclass in process, behind the client's reset/step (dicts in and out)."""

    def __init__(self, spec: str, env_kwargs: dict, serialization):
        cls = import_object(spec, "env.name")
        from openenv.core.env_server.interfaces import Environment

        if not (isinstance(cls, type) and issubclass(cls, Environment)):
            raise UserError(f"env openenv:{spec} names {cls!r}, not an openenv Environment subclass")
        self.action_cls = get_type_hints(cls.step).get("action")
        if not (isinstance(self.action_cls, type) and hasattr(self.action_cls, "model_json_schema")):
            raise UserError(f"env openenv:{spec}: {cls.__name__}.step does not annotate its action with an openenv Action class")
        self.env = cls(**env_kwargs)
        self.ser = serialization
        self.schema = self.action_cls.model_json_schema()
        meta = self.env.get_metadata()
        self.description = getattr(meta, "description", "") or ""

    def reset(self, **kwargs: Any) -> dict:
        return self.ser.serialize_observation(self.env.reset(**kwargs))

    def step(self, action: dict) -> dict:
        return self.ser.serialize_observation(self.env.step(self.ser.deserialize_action(action, self.action_cls)))

    def close(self) -> None:
        self.env.close()


class _Remote:
    """A running OpenEnv server: one WebSocket session through the package's own client."""

    def __init__(self, url: str, timeout: float, openenv):
        base = _http(url)
        try:
            schemas = _get_json(_route(base, "schema"), timeout)
            meta = _get_json(_route(base, "metadata"), timeout)
        except Exception as exc:  # refused, unreachable, not an OpenEnv server
            raise UserError(f"env openenv:{url}: no OpenEnv server answers at {_route(base, 'schema')} ({type(exc).__name__}: {one_line(exc)})") from None
        self.schema = schemas.get("action") or {}
        self.description = str(meta.get("description") or "")
        self.client = openenv.GenericEnvClient(base_url=base, connect_timeout_s=timeout, message_timeout_s=max(timeout, 60.0)).sync()
        try:
            self.client.connect()
        except Exception as exc:
            raise UserError(f"env openenv:{url}: cannot open a session ({one_line(exc)})") from None

    @staticmethod
    def _dict(result) -> dict:
        return {"observation": dict(result.observation or {}), "reward": result.reward, "done": bool(result.done)}

    def reset(self, **kwargs: Any) -> dict:
        return self._dict(self.client.reset(**kwargs))

    def step(self, action: dict) -> dict:
        return self._dict(self.client.step(action))

    def close(self) -> None:
        self.client.close()


class OpenEnvEnv:
    """An OpenEnv environment by URL or class (see the module doc)."""

    def __init__(self, spec: str, max_steps: int = 20, invalid_penalty: float = 0.1, action_field: str | None = None,
                 observation_field: str | None = None, task: str | None = None, timeout: float = 10.0, env_kwargs: dict | None = None):
        openenv, serialization = _openenv()
        spec = spec.strip()
        if _is_url(spec):
            self.backend: Any = _Remote(spec, float(timeout), openenv)
        elif ":" in spec:
            self.backend = _Local(spec, dict(env_kwargs or {}), serialization)
        else:
            raise UserError(f"env openenv:{spec}: give a server URL (openenv:http://host:port) or an Environment class (openenv:pkg.module:Class)")
        self.spec, self.name = spec, f"openenv:{spec}"
        self.max_steps, self.invalid_penalty = int(max_steps), float(invalid_penalty)
        props = {k: v for k, v in (self.backend.schema.get("properties") or {}).items() if k != "metadata"}
        if action_field is not None and action_field not in props:
            raise ValueError(f"action_field {action_field!r} is not a field of the env's action ({', '.join(props) or 'none'})")
        strings = [k for k, v in props.items() if v.get("type") == "string"]
        self.field = action_field or (strings[0] if len(props) == 1 and strings else None)
        spec_of = props.get(self.field, {}) if self.field else {}
        self.actions: list[str] | None = [str(x) for x in spec_of["enum"]] if spec_of.get("enum") else None
        self.observation_field = observation_field
        self.task = task or self.backend.description or f"Act in the OpenEnv environment {spec}."
        self.steps, self.obs, self.total = 0, "", 0.0

    def _text(self, observation: dict) -> str:
        if self.observation_field is not None:
            if self.observation_field not in observation:
                raise UserError(f"env {self.name}: the observation has no field {self.observation_field!r} (it has {', '.join(observation) or 'none'})")
            return str(observation[self.observation_field])
        if len(observation) == 1:
            return str(next(iter(observation.values())))
        return "\n".join(f"{k}: {v if isinstance(v, str) else json.dumps(v, default=str)}" for k, v in observation.items())

    def reset(self, seed: int) -> str:
        out = self.backend.reset(seed=int(seed), episode_id=f"recursa-{int(seed)}")
        self.steps, self.total = 0, 0.0
        self.obs = self._text(out["observation"])
        return self.obs

    def admissible_actions(self) -> list[str] | None:
        return list(self.actions) if self.actions is not None else None

    def walkthrough(self) -> None:
        return None  # OpenEnv envs carry no oracle

    def _action(self, text: str) -> tuple[dict | None, str]:
        if self.field is not None:
            if self.actions is not None:
                chosen = match_admissible(text, self.actions)
                return (None, "not one of the admissible actions") if chosen is None else ({self.field: chosen}, "")
            return {self.field: text}, ""
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            return None, f"the action must be a JSON object of the env's action fields ({exc.msg})"
        return (value, "") if isinstance(value, dict) else (None, "the action must be a JSON object")

    def _invalid(self, note: str) -> StepResult:
        done = self.steps >= self.max_steps
        info = {"won": False, "success": False, "invalid": True, "admissible": self.admissible_actions(), "steps": self.steps, "score": self.total, "note": note}
        return StepResult(self.obs, -self.invalid_penalty, done, info)

    def step(self, action_text: str) -> StepResult:
        self.steps += 1
        action, why = self._action(action_text or "")
        if action is None:
            return self._invalid(why)
        try:
            out = self.backend.step(action)
        except UserError:
            raise
        except Exception as exc:  # the server's (or the Action model's) validation refused it
            return self._invalid(f"the env refused the action: {one_line(exc)}")
        reward = float(out.get("reward") or 0.0)
        self.total += reward
        self.obs = self._text(out["observation"])
        ended = bool(out.get("done"))
        won = ended and reward > 0
        done = ended or self.steps >= self.max_steps
        info = {"won": won, "success": won, "invalid": False, "admissible": self.admissible_actions(), "steps": self.steps, "score": self.total,
                "note": "" if ended or not done else "max_steps"}
        return StepResult(self.obs, reward, done, info)

    def close(self) -> None:
        self.backend.close()
