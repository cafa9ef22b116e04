"""`verifiers` environments as recursa tasks: a taskset's tasks, its rewards, its multi-turn `run()`.

    [env]
    name = "vf:my_taskset"          # a module exporting a verifiers Taskset subclass in __all__
    kwargs = { n = 100 }            # the taskset's own config fields; the adapter's keys are below

verifiers (0.4, `import verifiers.v1 as vf`) splits an environment into a `Taskset` (config in,
`Task`s out), the `Task`'s scoring (`@vf.reward` methods and rewards plugged in the task config,
each with a weight), tool servers (`vf.Toolset` classes with `@vf.tool` methods) and an `Env`
whose `run(task, agents)` decides how one task becomes one episode: `SingleAgentEnv` (the
default) runs the agent once on the task's prompt; a taskset's own `Env` subclass can hold a
conversation turn by turn through `agents.<seat>.interaction(task)` and `interaction.turn(text)`
(the caller plays the user, as TextArena's taskset does with its game engine).

The adapter loads the environment the way verifiers' own entry points do,
`vf.load_environment(vf.resolve_env_config({"taskset": {"id": module, **kwargs}}))`, and
recursa's policy takes the agent's seat: verifiers' harness, runtime and model client are not
used. `env.run(task, agents)` runs on a private event loop in a thread, with a stand-in for
the one agent seat whose `interaction(task)` / `run(task)` hand each turn to recursa:

* `reset(seed)` picks the seed's task (below), starts `run()`, and returns what the policy is
  asked first (the task's prompt, or the first user message of a prompt-less task); the
  task's `system_prompt` becomes the env's system prompt;
* `step(reply)` records the reply as the assistant's message on a verifiers `Trace`, lets
  `run()` go on, and returns its next user message, or, when `run()` has finished, the end of
  the episode: the task's `score(trace)` has run on the trace (every reward and metric that
  needs no runtime), and the reward is `trace.reward`, the weighted sum of the rewards,
  including those `run()` recorded itself (a game's outcome). It is won when that reward is at
  least `success_at`;
* tools: the `@vf.tool` methods of the task's and the taskset's `Toolset`s are called in
  process as recursa tools (named `<server>_<tool>` as verifiers names them, described by
  their docstrings, with a JSON schema from their signatures); each call and result lands
  on the trace as an assistant tool call and a tool message. recursa offers tools in chat
  episodes of multi-turn games, so a taskset with tools is played as a game
  (`VerifiersGameEnv`, `agent.episode = "chat"`), as is one whose `run()` is its own; a
  game's reply is read as recursa reads a game's (its first line). A `SingleAgentEnv`
  taskset without tools is single-turn (`VerifiersEnv`): the whole reply is scored.

Items and splits: the tasks are read once per process (the first `max_tasks` of an infinite
taskset, 1000 by default) and each belongs to one split by a hash of its identity (the task's
own `key` when its class defines one, else its data without the position), as recursa's
datasets split their rows (`recursa.envs.dataset`): train, gate and test seeds reach disjoint
tasks, item i of a split is its i-th task (wrapping around), and `num_items(split)` bounds an
evaluation. An env with one seat only: recursa trains one policy.

Needs `pip install verifiers` (the `verifiers` extra); without it the spec is a one-line error.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import json
import queue
import threading
from typing import Any

from recursa.envs.dataset import split_by_hash
from recursa.envs.protocol import SPLITS, StepResult, one_line, split_of, split_seed
from recursa.envs.tools import Tool
from recursa.errors import UserError

_WAIT = 600.0  # seconds recursa waits for run() to ask its next turn or end (a hung env is an error, not a hang)


def _vf():
    try:
        import verifiers.v1 as vf
    except ImportError:
        raise UserError("env vf:<taskset> needs verifiers: pip install verifiers (or pip install 'recursa[verifiers]')") from None
    return vf


def _text(content: Any) -> str:
    """A verifiers message content (a string or content parts) as text."""
    if isinstance(content, str):
        return content
    from verifiers.v1.types import content_text

    return content_text(content)


def _identity(task) -> str:
    """What a task's split is drawn from: its class's own `key` when it defines one (a durable
    id), else its data without `idx`, so the split does not depend on the task's position."""
    if type(task).key is not _vf().Task.key:
        return str(task.key)
    return json.dumps(task.data.model_dump(mode="json", exclude_none=True, exclude={"idx"}), sort_keys=True)


@functools.lru_cache(maxsize=8)
def _load(taskset: str, kwargs_json: str, max_tasks: int | None, gate_frac: float, test_frac: float):
    """(the loaded verifiers Env, split -> tasks), once per process per configuration."""
    vf = _vf()
    kwargs = json.loads(kwargs_json)
    try:
        config = vf.resolve_env_config({"taskset": {"id": taskset, **kwargs}})
    except Exception as exc:  # pydantic's ValidationError: a kwarg the taskset's config does not take
        raise ValueError(one_line(exc)) from None
    try:
        env = vf.load_environment(config)
    except (ImportError, AttributeError, TypeError) as exc:  # verifiers' own words: not found, no __all__, no Taskset subclass
        raise UserError(f"env vf:{taskset}: {one_line(exc)}") from None
    seats = _seats(env.config)
    if len(seats) != 1:
        raise UserError(f"env vf:{taskset}: its env {type(env).__name__} seats {len(seats)} agents ({', '.join(seats)}); recursa plays one seat")
    limit = max_tasks if max_tasks is not None else (None if env.taskset.bounded else 1000)
    tasks = env.taskset if limit is None else env.taskset.take(int(limit))
    splits: dict[str, list] = {s: [] for s in SPLITS}
    try:
        for task in tasks:
            splits[split_by_hash(_identity(task), gate_frac, test_frac)].append(task)
    except Exception as exc:  # the taskset's own load() (a missing file, a download that cannot happen offline)
        raise UserError(f"env vf:{taskset}: the taskset's load() raised {type(exc).__name__}: {one_line(exc)}") from None
    if not splits["train"]:
        raise UserError(f"env vf:{taskset} gives no training tasks ({sum(map(len, splits.values()))} in all): lower gate_frac / test_frac")
    return env, splits


def _seats(config) -> list[str]:
    from verifiers.v1.configs.agent import agent_config_fields

    return list(agent_config_fields(config))


def _schema(fn) -> dict:
    """The JSON schema of a tool method's parameters, from its signature (pydantic, as MCP does)."""
    import pydantic

    fields: dict[str, Any] = {}
    hints = inspect.get_annotations(fn, eval_str=True)
    for name, p in inspect.signature(fn).parameters.items():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        fields[name] = (hints.get(name, Any), ... if p.default is p.empty else p.default)
    schema = pydantic.create_model(f"{fn.__name__}_args", **fields).model_json_schema()
    return {"type": "object", "properties": schema.get("properties", {}), "required": schema.get("required", [])}


class _Episode:
    """One episode in flight: the trace, and the two queues between run() and recursa."""

    def __init__(self, vf, task):
        self.task = task
        self.trace = vf.Trace(task=vf.TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash),
                              agent=vf.AgentInfo(config=vf.AgentConfig()))
        self.asks: queue.Queue = queue.Queue()  # run() -> recursa: ("ask", text) | ("end", None) | ("error", message)
        self.reply: asyncio.Future | None = None  # recursa -> run(): the policy's reply to the last ask
        self.future = None  # the concurrent future of the episode's coroutine
        self.tool_id = 0

    def add(self, message, sampled: bool = False) -> None:
        """Append a message to the trace's one branch (a chain of nodes)."""
        from verifiers.v1.graph import MessageNode

        nodes = self.trace.nodes
        nodes.append(MessageNode(parent=len(nodes) - 1 if nodes else None, message=message, sampled=sampled))


class _Interaction:
    """The stand-in of `vf.Interaction` that recursa's policy answers: `turn(message)` asks the
    policy and returns its reply as a segment."""

    def __init__(self, owner: "VerifiersEnv", ep: _Episode):
        self.owner, self.ep, self.started = owner, ep, False

    @property
    def trace(self):
        return self.ep.trace

    async def turn(self, message=None):
        vf = self.owner.vf
        if message is None:
            if self.started or self.ep.task.data.prompt is None:
                raise ValueError("a bare turn() takes a prompted task's opening reply; this exchange takes its next user message")
            text = self.ep.task.data.prompt_text
        else:
            messages = [vf.UserMessage(content=message)] if isinstance(message, str) else list(message)
            for m in messages:
                self.ep.add(m if not isinstance(m, dict) else vf.UserMessage(content=m.get("content", "")))
            text = "\n\n".join(_text(m.content if not isinstance(m, dict) else m.get("content", "")) for m in messages)
        self.started = True
        self.ep.reply = asyncio.get_running_loop().create_future()
        self.ep.asks.put(("ask", text))
        reply = await self.ep.reply
        answer = vf.AssistantMessage(content=reply)
        self.ep.add(answer, sampled=True)
        from verifiers.v1.agent import Segment

        return Segment(messages=[answer])

    async def close(self):
        return self.ep.trace


class _Seat:
    """The stand-in of the env's one agent seat (`agents.<name>`), played by recursa's policy."""

    def __init__(self, owner: "VerifiersEnv", ep: _Episode):
        self.owner, self.ep = owner, ep
        self.trainable = True

    @contextlib.asynccontextmanager
    async def interaction(self, task, **_: Any):
        ep = self.ep
        vf = self.owner.vf
        if task.data.system_prompt:
            ep.add(vf.SystemMessage(content=task.data.system_prompt))
        if task.data.prompt is not None:
            for m in [vf.UserMessage(content=task.data.prompt)] if isinstance(task.data.prompt, str) else task.data.prompt:
                ep.add(m)
        yield _Interaction(self.owner, ep)
        # the exchange closed normally (a cancelled or failed one is not scored), as verifiers closes it: then scoring
        ep.trace.is_completed, ep.trace.ok = True, True
        if ep.trace.stop_condition is None:
            ep.trace.stop("user_closed")
        await task.score(ep.trace)  # no runtime: the rewards and metrics that need one are skipped (verifiers logs which)

    async def run(self, task, **_: Any):
        async with self.interaction(task) as chat:
            await chat.turn()
        return self.ep.trace


class _Agents:
    def __init__(self, name: str, seat: _Seat):
        self._seat = {name: seat}

    def __getattr__(self, name: str):
        seats = self.__dict__.get("_seat", {})
        if name not in seats:
            raise AttributeError(f"no agent {name!r}; this config declares {sorted(seats)}")
        return seats[name]


class VerifiersEnv:
    """A verifiers environment, single-turn unless its `run()` holds a conversation (see the module doc)."""

    def __init__(self, taskset: str, max_steps: int = 10, success_at: float = 1.0, gate_frac: float = 0.1, test_frac: float = 0.1,
                 max_tasks: int | None = None, **taskset_kwargs: Any):
        self.vf = _vf()
        self.spec = taskset
        self.venv, self.splits = _load(taskset, json.dumps(taskset_kwargs, sort_keys=True), max_tasks, float(gate_frac), float(test_frac))
        self.name = f"vf:{taskset}"
        self.max_steps, self.success_at, self.invalid_penalty = int(max_steps), float(success_at), 0.0
        self.seat = _seats(self.venv.config)[0]
        self.task = f"Solve the task of the verifiers environment {taskset}."
        self.system_prompt: str | None = None
        self.tools: list[Tool] = []
        self.steps, self.ep, self.current = 0, None, None
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name=f"vf-{taskset}", daemon=True)
        self.thread.start()
        self._shared = None  # the taskset's shared toolsets, set up once

    # ------------------------------------------------------------------ items
    def num_items(self, split: str) -> int:
        """Tasks in `split` (evaluations take at most this many items)."""
        return len(self.splits[split])

    def item(self, seed: int):
        """The task `seed` names: task (i mod n) of its split."""
        split = split_of(seed)
        tasks = self.splits[split]
        if not tasks:
            raise UserError(f"env {self.name} has no {split} tasks: raise env.kwargs.{split}_frac (or give the taskset more tasks)")
        return tasks[(seed - split_seed(split, 0)) % len(tasks)]

    # ------------------------------------------------------------------ tools
    def _run(self, coro, timeout: float = _WAIT):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def _toolsets(self, task) -> list:
        config = self.venv.taskset.config
        if self._shared is None:
            self._shared = list(type(self.venv.taskset).toolsets(config))
            for server in self._shared:
                await server.setup()
        own = list(type(task).toolsets(config.task))
        for server in own:
            await server.setup()
            await server.setup_task(task)
        return self._shared + own

    def _tool(self, server, fn) -> Tool:
        raw = getattr(fn, "tool_name", None) or fn.__name__
        name = f"{server.server_name}_{raw}" if server.server_name else raw

        def call(**arguments: Any) -> str:
            ep = self.ep

            async def invoke():
                value = fn(**arguments)
                return await value if inspect.isawaitable(value) else value

            value = self._run(invoke())
            text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str)
            if ep is not None:  # the call and its result on the trace, as a harness would leave them
                ep.tool_id += 1
                cid = f"call_{ep.tool_id}"
                ep.add(self.vf.AssistantMessage(content="", tool_calls=[self.vf.ToolCall(id=cid, name=name, arguments=json.dumps(arguments))]), sampled=True)
                ep.add(self.vf.ToolMessage(tool_call_id=cid, name=name, content=text))
            return text

        return Tool(name, (fn.__doc__ or "").strip().split("\n")[0] or raw, _schema(fn), call)

    # ------------------------------------------------------------------ the episode
    async def _play(self, ep: _Episode) -> None:
        try:
            agents = _Agents(self.seat, _Seat(self, ep))
            await self.venv.setup(agents)
            await self.venv.run(ep.task, agents)
            episode = self.vf.Episode(env=self.vf.EnvInfo(id=self.venv.config.env_id), task=ep.trace.task, traces=[ep.trace])
            await self.venv.finalize(ep.task, episode)
            ep.asks.put(("end", None))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the env's own failure ends its episode (unwon), said in one line
            ep.asks.put(("error", f"{type(exc).__name__}: {one_line(exc)}"))

    def _stop(self) -> None:
        if self.ep is not None and self.ep.future is not None and not self.ep.future.done():
            self.ep.future.cancel()
            with contextlib.suppress(BaseException):
                self.ep.future.result(5)
        self.ep = None

    def _next(self) -> tuple[str, Any]:
        try:
            return self.ep.asks.get(timeout=_WAIT)
        except queue.Empty:
            return "error", f"the env's run() neither asked a turn nor ended within {_WAIT:.0f} s"

    def reset(self, seed: int) -> str:
        self._stop()
        task = self.item(int(seed))
        self.current, self.steps = task, 0
        self.system_prompt = task.data.system_prompt
        self.task = task.data.description or f"Solve the task of the verifiers environment {self.spec}."
        try:
            servers = self._run(self._toolsets(task))
        except Exception as exc:  # a toolset's setup() / setup_task()
            raise UserError(f"env {self.name}: setting up the task's toolsets raised {type(exc).__name__}: {one_line(exc)}") from None
        from verifiers.v1.utils.decorators import discover_decorated  # how verifiers' Toolset finds its @vf.tool methods

        self.tools = [self._tool(s, fn) for s in servers for fn in discover_decorated(s, "tool")]
        self.ep = _Episode(self.vf, task)
        self.ep.future = asyncio.run_coroutine_threadsafe(self._play(self.ep), self.loop)
        kind, value = self._next()
        if kind != "ask":
            why = value if kind == "error" else "it ended without asking the policy anything"
            raise UserError(f"env {self.name}: the env's run() on task {task.data.idx} failed before its first turn ({why})")
        return value

    def _info(self, won: bool, score: float, note: str = "") -> dict:
        answer = getattr(self.current.data, "answer", None)
        return {"won": won, "success": won, "invalid": False, "admissible": None, "steps": self.steps, "score": score,
                "answer": "" if answer is None else str(answer), "parsed": None, "note": note}

    def step(self, action_text: str) -> StepResult:
        if self.ep is None or self.ep.reply is None:
            raise RuntimeError(f"env {self.name}: step() before reset()")
        self.steps += 1
        reply = action_text or ""
        self.loop.call_soon_threadsafe(lambda f=self.ep.reply: f.done() or f.set_result(reply))
        kind, value = self._next()
        if kind == "ask":
            if self.steps >= self.max_steps:
                self._stop()
                return StepResult(value, 0.0, True, {**self._info(False, 0.0, "max_steps"), "parsed": reply})
            return StepResult(value, 0.0, False, {**self._info(False, 0.0), "parsed": reply})
        if kind == "error":
            self.ep = None
            return StepResult("", 0.0, True, {**self._info(False, 0.0, value), "parsed": reply, "failure": "env_error"})
        trace = self.ep.trace
        reward = float(trace.reward)
        won = reward >= self.success_at
        info = {**self._info(won, reward), "parsed": reply, "rewards": {k: (None if r is None else r.score) for k, r in trace.rewards.items()}}
        self.trace, self.ep = trace, None  # the finished trace, for a look at its rewards and messages
        return StepResult("", reward, True, info)

    def close(self) -> None:
        self._stop()
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(5)


class VerifiersGameEnv(VerifiersEnv):
    """A verifiers environment whose `run()` holds a conversation: a multi-turn game (`AgentEnv`)."""

    def admissible_actions(self) -> None:
        return None  # the reply goes to run() as written

    def walkthrough(self) -> None:
        return None  # verifiers tasks carry no oracle


def verifiers_env(taskset: str, **kwargs: Any) -> VerifiersEnv:
    """`vf:<taskset>`: a single-turn `VerifiersEnv` when the environment is verifiers'
    `SingleAgentEnv` (one run on the task's prompt) without tools, so the whole reply is
    scored; else a `VerifiersGameEnv`, a multi-turn game (recursa offers tools in chat
    episodes of games only)."""
    keys = ("max_tasks", "gate_frac", "test_frac")
    own = {k: kwargs[k] for k in keys if k in kwargs}
    rest = {k: v for k, v in kwargs.items() if k not in keys + ("max_steps", "success_at")}
    venv, _ = _load(taskset, json.dumps(rest, sort_keys=True), own.get("max_tasks"), float(own.get("gate_frac", 0.1)), float(own.get("test_frac", 0.1)))
    taskset_cls, task_cls = type(venv.taskset), type(venv.taskset).task_type()
    tools = bool(taskset_cls.toolsets(venv.taskset.config)) or bool(task_cls.toolsets(venv.taskset.config.task))
    single = type(venv) is _vf().SingleAgentEnv and not tools  # tools need recursa's multi-turn (chat) episodes
    return (VerifiersEnv if single else VerifiersGameEnv)(taskset, **kwargs)
