"""An OpenAI-compatible endpoint served by the policy during rollouts, so that an agent
harness written against the `openai` client is trained on exactly the tokens it was served
(issue 48; docs/serve.md).

A *harness* is a Python callable `harness(base_url, seed) -> reward` that plays one episode
of item `seed` by calling `OpenAI(base_url=base_url, api_key=...)` as it would call any
OpenAI-compatible server (`/chat/completions` with `messages` and `tools`, `/models`), and
returns the episode's reward. `HarnessEnv` makes it an environment (`env.name =
"harness:pkg.module:function"`, or a factory of yours that returns one), which rollouts play
through `harness_rollout` rather than step by step:

    for each episode of the step (B seeds x G):
        the server hands the harness a base URL of its own, http://127.0.0.1:<port>/e/<key>/v1
        the harness runs in a thread of its own, G x B of them at once (`concurrency`)
        each completion it asks for is rendered, sampled by the run's rollout engine, and
        recorded: the prompt ids, the sampled ids and their log-probs, one `Turn` each
        its return value (or what it POSTed to <base_url>/reward) is the episode's reward

and the episode is a chat `Episode` whose rows (one per completion served, as in chat mode,
`Episode.rows()`) hold exactly the tokens the harness was served, and exactly the sampler's
log-probs of them. GRPO trains on them like any other episode.

Token exactness across turns. A harness sends the whole conversation with every request, the
policy's earlier replies included, as the decoded text (and tool calls) it was sent back. Re-
rendering that would put a re-tokenisation of the replies into the next context, not what the
policy sampled. So the server keeps each conversation of an episode as tokens, as chat
episodes do (recursa/chat.py): a request whose messages are an earlier request's messages plus
the reply served to it plus new messages continues that conversation, and its prompt is

    the earlier prompt + the sampled tokens + [end-of-turn token, if the reply lacks one] + the new messages' tokens

(`ChatTemplate.delta`), never a re-rendering. A request with no assistant message starts a new
conversation (a harness may hold several: a planner and a summariser). A request that carries
an assistant message the server never served, or an earlier reply changed, rewrites history:
by default (`history = "strict"`) that is a 400 error naming the first message that differs;
with `history = "render"` the request is rendered afresh as a new conversation (its row is
still what the policy was served, but its context holds re-tokenised replies).

What a request may set: `model` (the served name, `MODEL` unless the env names another; any
other is a 404 `model_not_found`), `messages` (text content, or lists of text parts), `tools`
(function tools; the template renders them, or their description joins the system message, as
in chat mode), `tool_choice` ("auto" or "none"), `max_tokens` / `max_completion_tokens` (at
most `sampling.max_new_tokens`), `stop` (added to `sampling.stop`), `logprobs`, `stream`, and
`n` = 1. `temperature` and `top_p` are the run's (`sampling.*`) whatever the request says: the
trainer's log-probs are those of the run's temperature, so a sample drawn at another would be
trained as if it were not. Other fields are ignored. Every malformed request is an
OpenAI-shaped error (`{"error": {"message", "type", "param", "code"}}`) with a 4xx status,
and nothing of the episode is lost: the next good request goes on from where it was.

The server binds 127.0.0.1 by default: it samples from the policy for anyone who can reach it.
"""

from __future__ import annotations

import json
import math
import queue
import secrets
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable

from recursa.chat import ChatTemplate, check_prefix_preserving, template_text
from recursa.envs.tools import _BLOCK, Tool, has_tool_call, parse_tool_calls
from recursa.errors import UserError
from recursa.generation import GenerationStats, SamplingParams, eos_token_ids, group_generators
from recursa.registry import import_object, one_line
from recursa.trajectory import Episode, EpisodeRollout, Turn

__all__ = ["MODEL", "HarnessEnv", "PolicyServer", "RequestError", "ServedEpisode", "harness_env", "harness_rollout"]

MODEL = "policy"  # the model name the endpoint serves unless the env names another
_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}


class RequestError(Exception):
    """A request the endpoint refuses: an HTTP status and an OpenAI-shaped error body."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.param, self.code, self.kind = status, param, code, kind

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": self.code}}


# ---------------------------------------------------------------------------- requests


def _text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for k, part in enumerate(content):
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise RequestError(400, f"{where}[{k}]: only text content parts are served, got {kind!r}", where)
            parts.append(part["text"])
        return "".join(parts)
    raise RequestError(400, f"{where} must be a string or a list of text parts, got {type(content).__name__}", where)


def _canonical(arguments: Any) -> str:
    """A tool call's arguments as compared across requests: parsed JSON, dumped with sorted keys."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            return arguments
    return json.dumps(arguments, sort_keys=True, ensure_ascii=False)


def _calls_of(raw: Any, where: str) -> list[dict]:
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise RequestError(400, f"{where}.tool_calls must be a list", f"{where}.tool_calls")
    out = []
    for j, call in enumerate(raw):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise RequestError(400, f'{where}.tool_calls[{j}] must be {{"type": "function", "function": {{"name": ..., "arguments": ...}}}}',
                               f"{where}.tool_calls")
        out.append({"id": str(call.get("id") or ""), "name": fn["name"], "arguments": _canonical(fn.get("arguments", "{}"))})
    return out


def _messages(raw: Any) -> list[dict]:
    """The request's messages, normalised: role (developer read as system), content text,
    an assistant's tool calls, a tool message's tool_call_id and name."""
    if not isinstance(raw, list) or not raw:
        raise RequestError(400, "'messages' must be a non-empty list of messages", "messages")
    out = []
    for k, m in enumerate(raw):
        where = f"messages[{k}]"
        if not isinstance(m, dict):
            raise RequestError(400, f"{where} must be an object with a role and content", where)
        role = _ROLES.get(m.get("role"))
        if role is None:
            raise RequestError(400, f"{where}.role must be one of {', '.join(_ROLES)}, got {m.get('role')!r}", f"{where}.role")
        msg = {"role": role, "content": _text(m.get("content"), f"{where}.content")}
        if role == "assistant":
            msg["tool_calls"] = _calls_of(m.get("tool_calls"), where)
        elif role == "tool":
            msg["tool_call_id"], msg["name"] = str(m.get("tool_call_id") or ""), str(m.get("name") or "")
        out.append(msg)
    return out


def _key(m: dict) -> tuple:
    """What must match for a message to be the one sent before: role and text; an
    assistant's tool calls (names and arguments); a tool result's call id."""
    if m["role"] == "assistant":
        return ("assistant", m["content"].strip(), tuple((c["name"], c["arguments"]) for c in m["tool_calls"]))
    if m["role"] == "tool":
        return ("tool", m["content"], m["tool_call_id"])
    return (m["role"], m["content"])


def _harness_side(**_: Any) -> str:  # a served tool runs in the harness, never here
    raise RuntimeError("a tool of a served request is run by the harness")


def _tools(raw: Any) -> list[Tool]:
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise RequestError(400, "'tools' must be a list of function tools", "tools")
    tools = []
    for k, t in enumerate(raw):
        fn = t.get("function") if isinstance(t, dict) and t.get("type", "function") == "function" else None
        if not isinstance(fn, dict):
            raise RequestError(400, f'tools[{k}] must be {{"type": "function", "function": {{"name": ..., "parameters": ...}}}}', "tools")
        try:
            tools.append(Tool(fn.get("name"), str(fn.get("description") or ""), fn.get("parameters") or {"type": "object", "properties": {}}, _harness_side))
        except ValueError as exc:
            raise RequestError(400, f"tools[{k}]: {exc}", "tools") from None
    return tools


@dataclass
class _Request:
    messages: list[dict]
    tools: list[Tool]
    tools_key: str
    params: SamplingParams
    parse_calls: bool  # tool_choice is not "none"
    logprobs: bool
    stream: bool
    usage_in_stream: bool


def _int_field(body: dict, name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise RequestError(400, f"'{name}' must be a positive integer, got {value!r}", name)
    return value


# ---------------------------------------------------------------------------- episodes


@dataclass
class _Conversation:
    keys: list[tuple]  # every message so far (the replies served included), as `_key` compares them
    ids: list[int]  # its tokens: the last prompt, the reply sampled, the end-of-turn token
    system: str | None
    tools_key: str
    chat: ChatTemplate


@dataclass
class ServedEpisode:
    """One episode's record on the server: the turns served (exact prompt and sampled ids,
    the sampler's log-probs), the responses sent, a reward the harness POSTed, and the first
    error that is the run's rather than the request's (`fatal`)."""

    key: str
    seed: int | None
    stream: Any  # the episode's torch.Generator (None: greedy, or the engine's default stream)
    base_url: str
    turns: list[Turn] = field(default_factory=list)
    responses: list[dict] = field(default_factory=list)
    conversations: list[_Conversation] = field(default_factory=list)
    reward: Any = None  # what the harness POSTed to <base_url>/reward
    fatal: BaseException | None = None
    closed: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)


# ---------------------------------------------------------------------------- the server


class PolicyServer:
    """The endpoint: an HTTP server (stdlib, one thread per connection) that renders each
    request with the policy's chat template, samples it with `engine` (pending requests of the
    same sampling settings in one `generate` call, each from its episode's own stream) and
    records it in its episode. `with PolicyServer(...) as server:` starts and stops it;
    `server.open_episode(seed, stream)` hands out an episode and its base URL."""

    def __init__(self, tokenizer, engine, sampling: SamplingParams, *, stop_ids: set[int] | None = None, model: str = MODEL,
                 host: str = "127.0.0.1", port: int = 0, chat_template: str | None = None, max_context_tokens: int = 4096,
                 max_tool_call_chars: int = 4000, history: str = "strict", batch_wait: float = 0.005, stats: GenerationStats | None = None):
        if history not in ("strict", "render"):
            raise UserError(f"history = {history!r}: choose 'strict' (a request must extend what was served) or 'render'")
        self.tok, self.engine, self.sampling, self.model = tokenizer, engine, sampling, model
        self.stop_ids = stop_ids if stop_ids is not None else eos_token_ids(tokenizer)
        self.template, self.max_context_tokens, self.max_tool_call_chars = chat_template, max_context_tokens, max_tool_call_chars
        self.history, self.batch_wait = history, batch_wait
        self.stats = stats if stats is not None else GenerationStats()
        self.episodes: dict[str, ServedEpisode] = {}
        self._chats: dict[str, ChatTemplate] = {}
        self._checked: dict[str, BaseException | None] = {}
        self._lock = threading.Lock()
        self._work = threading.Lock()
        self._queue: queue.Queue = queue.Queue()
        try:
            self.httpd = ThreadingHTTPServer((host, port), _Handler)
        except OSError as exc:
            raise UserError(f"the OpenAI endpoint cannot listen on {host}:{port} ({one_line(exc)}); choose another port, or 0 for a free one") from None
        self.httpd.daemon_threads = True
        self.httpd.recursa = self  # the handler's way back to the server
        self.host, self.port = host, int(self.httpd.server_address[1])
        self._threads: list[threading.Thread] = []

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> "PolicyServer":
        for target, name in ((self.httpd.serve_forever, "recursa-serve-http"), (self._sampler, "recursa-serve-sampler")):
            t = threading.Thread(target=target, name=name, daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self._queue.put(None)
        for t in self._threads:
            t.join(timeout=5)
        self._threads = []

    def __enter__(self) -> "PolicyServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def open_episode(self, seed: int | None = None, stream=None) -> ServedEpisode:
        """A new episode, with its own base URL (`<url>/e/<key>/v1`) for the harness."""
        with self._lock:
            key = f"{len(self.episodes)}-{secrets.token_hex(4)}"
            ep = ServedEpisode(key, seed, stream, f"{self.url}/e/{key}/v1")
            self.episodes[key] = ep
        return ep

    def end_episode(self, ep: ServedEpisode) -> None:
        """No more requests for `ep` (a late one gets a 404)."""
        with ep.lock:
            ep.closed = True

    # ------------------------------------------------------------------ requests
    def episode(self, key: str) -> ServedEpisode:
        ep = self.episodes.get(key)
        if ep is None:
            raise RequestError(404, f"unknown episode {key!r}: use the base_url recursa handed the harness", code="episode_not_found")
        return ep

    def models(self) -> dict:
        return {"object": "list", "data": [{"id": self.model, "object": "model", "created": 0, "owned_by": "recursa"}]}

    def parse(self, body: Any) -> _Request:
        if not isinstance(body, dict):
            raise RequestError(400, "the request body must be a JSON object")
        model = body.get("model")
        if not isinstance(model, str):
            raise RequestError(400, "'model' is required: the name of the model to sample", "model")
        if model != self.model:
            raise RequestError(404, f"The model {model!r} does not exist: this endpoint serves {self.model!r} (GET /v1/models)", "model", "model_not_found")
        n = body.get("n", 1)
        if n not in (None, 1):
            raise RequestError(400, f"'n' must be 1 (one completion per request), got {n!r}", "n")
        messages = _messages(body.get("messages"))
        if messages[-1]["role"] == "assistant":
            raise RequestError(400, "the last message is an assistant message: continuing one is not served; end with a user or tool message", "messages")
        choice = body.get("tool_choice")
        if choice not in (None, "auto", "none"):
            raise RequestError(400, f"tool_choice {choice!r} is not served: the policy chooses ('auto'), or 'none'", "tool_choice")
        tools = _tools(body.get("tools"))
        max_tokens = _int_field(body, "max_completion_tokens") or _int_field(body, "max_tokens") or self.sampling.max_new_tokens
        stop = body.get("stop")
        stop = [stop] if isinstance(stop, str) else (stop or [])
        if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
            raise RequestError(400, "'stop' must be a string or a list of strings", "stop")
        params = SamplingParams(min(max_tokens, self.sampling.max_new_tokens), self.sampling.temperature, self.sampling.top_p,
                                tuple(dict.fromkeys(tuple(self.sampling.stop) + tuple(stop))))
        options = body.get("stream_options") or {}
        return _Request(messages, tools, json.dumps([t.schema() for t in tools], sort_keys=True), params, choice != "none",
                        bool(body.get("logprobs")), bool(body.get("stream")), bool(isinstance(options, dict) and options.get("include_usage")))

    def complete(self, ep: ServedEpisode, req: _Request) -> dict:
        """Serve one chat completion of `ep`: the prompt (continuing a conversation, or a new
        one), the sample, the turn recorded, the OpenAI-shaped response."""
        with ep.lock:
            if ep.closed:
                raise RequestError(404, f"episode {ep.key!r} is over", code="episode_closed")
            if ep.fatal is not None:
                raise RequestError(500, one_line(ep.fatal), kind="server_error")
            try:
                with self._work:  # the tokenizer, one request at a time
                    chat = self._chat(req)
                    conv, ids, new_conv = self._prompt(ep, chat, req)
            except UserError as exc:  # the run's template: the run stops with this line
                ep.fatal = exc
                raise RequestError(500, str(exc), kind="server_error") from None
            if len(ids) + req.params.max_new_tokens > self.max_context_tokens:
                raise RequestError(400, f"the prompt is {len(ids)} tokens; with max_tokens {req.params.max_new_tokens} it passes the context of "
                                   f"{self.max_context_tokens} tokens (agent.max_context_tokens)", "messages", "context_length_exceeded")
            try:
                sample = self._sample(ids, req.params, ep.stream)
            except BaseException as exc:  # the engine failed: a bug, kept with its traceback for the rollout to raise
                ep.fatal = exc
                raise RequestError(500, f"sampling failed: {type(exc).__name__}: {one_line(exc)}", kind="server_error") from None
            with self._work:
                return self._record(ep, req, chat, conv, new_conv, ids, sample)

    def _chat(self, req: _Request) -> ChatTemplate:
        """The template for this request's tools, checked to be prefix-preserving once."""
        with self._lock:
            chat = self._chats.get(req.tools_key)
            if chat is None:
                chat = self._chats[req.tools_key] = ChatTemplate(self.tok, template_text(self.template), req.tools, self.stop_ids)
                try:
                    check_prefix_preserving(chat)
                    self._checked[req.tools_key] = None
                except UserError as exc:
                    self._checked[req.tools_key] = exc
        if self._checked[req.tools_key] is not None:
            raise self._checked[req.tools_key]
        return chat

    def _render(self, chat: ChatTemplate, m: dict) -> dict:
        """A message as the template takes it (an assistant's tool calls as <tool_call> text in the family's form)."""
        if m["role"] == "assistant" and m["tool_calls"]:
            calls = [{"name": c["name"], "arguments": json.loads(c["arguments"]) if _is_json(c["arguments"]) else c["arguments"]} for c in m["tool_calls"]]
            blocks = [f"<tool_call>{json.dumps(c, ensure_ascii=False)}</tool_call>" for c in calls] if chat.renders_tools \
                else [f"<tool_call>{json.dumps(calls, ensure_ascii=False)}</tool_call>"]
            return {"role": "assistant", "content": "\n".join(([m["content"]] if m["content"] else []) + blocks)}
        if m["role"] == "tool":
            return {"role": "tool", "name": m["name"] or "tool", "content": m["content"]}
        return {"role": m["role"], "content": m["content"]}

    def _prompt(self, ep: ServedEpisode, chat: ChatTemplate, req: _Request) -> tuple[_Conversation | None, list[int], dict]:
        """(the conversation this request continues or None, the prompt ids, what a new conversation would hold)."""
        keys = [_key(m) for m in req.messages]
        best, agree = None, -1
        for conv in reversed(ep.conversations):
            n = len(conv.keys)
            same = next((k for k, (a, b) in enumerate(zip(conv.keys, keys)) if a != b), min(n, len(keys)))
            if conv.tools_key == req.tools_key and same == n < len(keys):
                new = [self._render(chat, m) for m in req.messages[n:]]
                return conv, conv.ids + chat.delta(conv.system, new), {"keys": keys}
            if same > agree:
                best, agree = conv, same
        if best is not None and any(m["role"] == "assistant" for m in req.messages) and self.history == "strict":
            if best.tools_key != req.tools_key and agree == len(best.keys):
                why = "its tools differ from the ones the conversation was served with"
            elif agree < len(keys):
                why = f"messages[{agree}] ({req.messages[agree]['role']}) differs from the {best.keys[agree][0]} message the episode holds there"
            else:
                why = "it stops inside the conversation, before the reply served"
            raise RequestError(400, f"the messages rewrite this episode's history: {why}; recursa trains on the tokens it served, so send the "
                               "conversation back as it was, the replies unchanged (or set history = 'render'; docs/serve.md)", "messages", "history_rewritten")
        system = req.messages[0]["content"] if req.messages[0]["role"] == "system" else None
        rest = req.messages[1:] if system is not None else req.messages
        ids = chat.render(chat.head(system) + [self._render(chat, m) for m in rest], add_generation_prompt=True)
        return None, ids, {"keys": keys, "system": system}

    def _sample(self, ids: list[int], params: SamplingParams, stream):
        fut: Future = Future()
        self._queue.put((ids, params, stream, fut))
        return fut.result()

    def _sampler(self) -> None:
        """Drain the queue: what arrives within `batch_wait` of the first request is sampled
        together, one `generate` call per distinct sampling setting."""
        try:
            self._drain()
        finally:  # requests left when the server closes get an error, not a wait for ever
            while True:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is not None:
                    item[3].set_exception(RuntimeError("the endpoint closed"))

    def _drain(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            batch, stop = [item], False
            deadline = time.monotonic() + self.batch_wait
            while True:
                try:
                    nxt = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    break
                if nxt is None:
                    stop = True
                    break
                batch.append(nxt)
            groups: dict[SamplingParams, list] = {}
            for it in batch:
                groups.setdefault(it[1], []).append(it)
            for params, items in groups.items():
                streams = [it[2] for it in items]
                gen = streams if all(s is not None for s in streams) else None
                try:
                    samples = self.engine.generate([it[0] for it in items], params, n=1, generator=gen, stats=self.stats)
                except BaseException as exc:  # noqa: BLE001 - handed to each waiting request
                    for it in items:
                        it[3].set_exception(exc)
                    continue
                for it, s in zip(items, samples):
                    it[3].set_result(s)
            if stop:
                return

    def _record(self, ep: ServedEpisode, req: _Request, chat: ChatTemplate, conv, new_conv: dict, ids: list[int], sample) -> dict:
        sampled = list(sample.token_ids)
        text = self.tok.decode(sampled, skip_special_tokens=True)
        for s in req.params.stop:  # OpenAI leaves the stop string out of the content (the tokens keep it)
            if s in text:
                text = text[: text.index(s)]
        calls = parse_tool_calls(text, self.max_tool_call_chars) if req.tools and req.parse_calls and has_tool_call(text) else []
        turn_no = len(ep.turns)
        tool_calls = [{"id": f"call_{turn_no}_{j}", "type": "function", "function": {"name": c.name, "arguments": json.dumps(c.arguments, ensure_ascii=False)}}
                      for j, c in enumerate(calls) if not c.error]
        malformed = any(c.error for c in calls)
        content: str | None = text if malformed or not tool_calls else (_BLOCK.sub("", text).strip() or None)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if tool_calls:
            message["tool_calls"] = tool_calls
        finish = "tool_calls" if tool_calls else ("length" if sample.finish_reason == "length" else "stop")
        served = {"role": "assistant", "content": content or "", "tool_calls": _calls_of(tool_calls, "served")}
        last = req.messages[-1]
        ep.turns.append(Turn(prompt_ids=list(ids), action_ids=sampled, action_logprobs=list(sample.logprobs), reply=text,
                             action="; ".join(c.describe() for c in calls) if calls else text, observation=last["content"],
                             anchor=f"{last['role']}: {last['content']}", reward=0.0, invalid=malformed))
        tokens = list(ids) + sampled + chat.close(sampled)
        if conv is None:
            ep.conversations.append(_Conversation(new_conv["keys"] + [_key(served)], tokens, new_conv.get("system"), req.tools_key, chat))
        else:
            conv.keys, conv.ids = new_conv["keys"] + [_key(served)], tokens
        choice: dict[str, Any] = {"index": 0, "message": message, "finish_reason": finish, "logprobs": None}
        if req.logprobs:
            choice["logprobs"] = {"content": [{"token": self.tok.decode([t]), "logprob": float(lp), "bytes": list(self.tok.decode([t]).encode()), "top_logprobs": []}
                                              for t, lp in zip(sampled, sample.logprobs)], "refusal": None}
        response = {"id": f"chatcmpl-{ep.key}-{turn_no}", "object": "chat.completion", "created": int(time.time()), "model": self.model,
                    "choices": [choice], "usage": {"prompt_tokens": len(ids), "completion_tokens": len(sampled), "total_tokens": len(ids) + len(sampled)}}
        ep.responses.append(response)
        return response

    def post_reward(self, ep: ServedEpisode, body: Any) -> dict:
        if not isinstance(body, dict) or isinstance(body.get("reward"), bool) or not isinstance(body.get("reward"), (int, float)):
            raise RequestError(400, 'the body must be {"reward": <number>} (and optionally "success": <bool>)', "reward")
        if "success" in body and not isinstance(body["success"], bool):
            raise RequestError(400, "'success' must be true or false", "success")
        with ep.lock:
            if ep.closed:
                raise RequestError(404, f"episode {ep.key!r} is over", code="episode_closed")
            ep.reward = {"reward": float(body["reward"]), **({"success": body["success"]} if "success" in body else {})}
        return {"ok": True}


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return False
    return True


class _Handler(BaseHTTPRequestHandler):
    """Routes: GET [/e/<key>]/v1/models; POST /e/<key>/v1/chat/completions; POST /e/<key>/v1/reward."""

    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # headers and body go out as two writes: without this, a keep-alive client waits on a delayed ACK (~40 ms)

    def log_message(self, format, *args):  # noqa: A002 - quiet: the run's log is the metrics
        pass

    def _route(self) -> tuple[str | None, str]:
        path = self.path.split("?", 1)[0].rstrip("/")
        parts = path.split("/")
        if len(parts) > 2 and parts[1] == "e":  # /e/<key>/v1/...
            return parts[2], "/" + "/".join(parts[3:])
        return None, path

    def _send(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _error(self, exc: RequestError) -> None:
        self._send(exc.status, exc.body())

    def do_GET(self) -> None:  # noqa: N802
        server: PolicyServer = self.server.recursa
        try:
            key, path = self._route()
            if key is not None:
                server.episode(key)
            if path != "/v1/models":
                raise RequestError(404, f"no route GET {self.path}: this endpoint serves GET /v1/models and POST /v1/chat/completions", code="not_found")
            self._send(200, server.models())
        except RequestError as exc:
            self._error(exc)
        except Exception as exc:  # noqa: BLE001 - a bug of the server: one line to the client, not a dropped connection
            self._error(RequestError(500, f"the server failed: {type(exc).__name__}: {one_line(exc)}", kind="server_error"))

    def do_POST(self) -> None:  # noqa: N802
        server: PolicyServer = self.server.recursa
        try:
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            key, path = self._route()
            if path not in ("/v1/chat/completions", "/v1/reward"):
                raise RequestError(404, f"no route POST {self.path}: this endpoint serves POST <base_url>/chat/completions and <base_url>/reward", code="not_found")
            if key is None:
                raise RequestError(404, f"POST {path} needs an episode: use the base_url recursa handed the harness (<url>/e/<episode>/v1)", code="episode_not_found")
            ep = server.episode(key)
            try:
                body = json.loads(raw.decode("utf-8") if raw else "")
            except (UnicodeDecodeError, json.JSONDecodeError) as exc:
                raise RequestError(400, f"the request body is not JSON ({getattr(exc, 'msg', type(exc).__name__)})", code="invalid_json") from None
            if path == "/v1/reward":
                self._send(200, server.post_reward(ep, body))
                return
            req = server.parse(body)
            response = server.complete(ep, req)
            if req.stream:
                self._stream(response, req.usage_in_stream)
            else:
                self._send(200, response)
        except RequestError as exc:
            self._error(exc)
        except Exception as exc:  # noqa: BLE001 - a bug of the server: one line to the client, not a dropped connection
            self._error(RequestError(500, f"the server failed: {type(exc).__name__}: {one_line(exc)}", kind="server_error"))

    def _stream(self, response: dict, usage: bool) -> None:
        """The whole completion as server-sent events: one chunk with the message, one with the finish reason."""
        choice = response["choices"][0]
        base = {k: response[k] for k in ("id", "created", "model")} | {"object": "chat.completion.chunk"}
        delta: dict[str, Any] = {"role": "assistant", "content": choice["message"]["content"]}
        if "tool_calls" in choice["message"]:
            delta["tool_calls"] = [dict(c, index=j) for j, c in enumerate(choice["message"]["tool_calls"])]
        chunks = [base | {"choices": [{"index": 0, "delta": delta, "finish_reason": None, "logprobs": choice["logprobs"]}]},
                  base | {"choices": [{"index": 0, "delta": {}, "finish_reason": choice["finish_reason"]}]}]
        if usage:
            chunks.append(base | {"choices": [], "usage": response["usage"]})
        data = b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


# ---------------------------------------------------------------------------- the harness env


class HarnessEnv:
    """An environment played by a harness: `harness(base_url, seed)` plays item `seed` through
    the OpenAI endpoint at `base_url` and returns the reward (a number, a bool, or
    {"reward": ..., "success": ...}; None: what it POSTed to `<base_url>/reward`). Success is
    `reward >= 1` unless given.

    Options: `model` (the name served, `MODEL`), `timeout` (seconds an episode may run; past
    them it fails as the harness's error), `concurrency` (episodes run at once; None: all of the
    call), `errors` ("raise": a harness that raises stops the run with one line; "lose": the
    episode is lost, reward 0, finish reason "crashed"), `history` ("strict" or "render", see the
    module doc), `host` and `port` (127.0.0.1 and a free port)."""

    system_prompt = None

    def __init__(self, harness: Callable[[str, int], Any], name: str | None = None, model: str = MODEL, timeout: float = 600.0,
                 concurrency: int | None = None, errors: str = "raise", history: str = "strict", host: str = "127.0.0.1", port: int = 0):
        if not callable(harness):
            raise ValueError(f"harness must be a callable harness(base_url, seed) -> reward, got {type(harness).__name__}")
        if errors not in ("raise", "lose"):
            raise ValueError(f"errors must be 'raise' or 'lose', got {errors!r}")
        if history not in ("strict", "render"):
            raise ValueError(f"history must be 'strict' or 'render', got {history!r}")
        if not (timeout > 0) or (concurrency is not None and concurrency < 1):
            raise ValueError("timeout must be > 0 and concurrency >= 1")
        self.harness = harness
        self.name = name or f"harness:{getattr(harness, '__module__', '?')}:{getattr(harness, '__qualname__', type(harness).__name__)}"
        self.model, self.timeout, self.concurrency, self.errors, self.history, self.host, self.port = model, timeout, concurrency, errors, history, host, port
        self.task = ""

    def reset(self, seed: int) -> str:
        self.task = f"harness episode of item {seed}"
        return self.task

    def step(self, action_text: str):
        raise UserError(f"env {self.name!r} is played by its harness through the OpenAI endpoint (recursa.serve), not step by step")

    def admissible_actions(self) -> None:
        return None

    def walkthrough(self) -> None:
        return None


def harness_env(target: str, **kwargs: Any) -> HarnessEnv:
    """`env.name = "harness:pkg.module:function"`: the harness that path names, `env.kwargs` its `HarnessEnv` options."""
    return HarnessEnv(import_object(target, "env.name = 'harness:...'"), name=f"harness:{target}", **kwargs)


def _outcome(value: Any, ep: ServedEpisode, where: str) -> tuple[float, bool]:
    if value is None:
        value = ep.reward
    if value is None:
        raise UserError(f"{where} returned None and POSTed no reward to <base_url>/reward: return the episode's reward")
    if isinstance(value, dict):
        if "reward" not in value or isinstance(value["reward"], bool) or not isinstance(value["reward"], (int, float)):
            raise UserError(f'{where} returned {one_line(value)[:120]}: a dict needs a number under "reward"')
        reward = float(value["reward"])
        return reward, bool(value.get("success", reward >= 1.0))
    if isinstance(value, bool):
        return float(value), value
    if isinstance(value, (int, float)):
        return float(value), float(value) >= 1.0
    raise UserError(f'{where} returned a {type(value).__name__}: return a number, a bool, or {{"reward": ..., "success": ...}}')


def harness_rollout(policy, envs, seeds: list[int], group_size: int, sampling: SamplingParams, generator, system_prompt, agent, hints, engine,
                    prefixes=None):
    """`group_size` episodes of each seed played by the envs' harness through a `PolicyServer`
    on `engine`; an `EpisodeRollout` of chat episodes whose turns are the completions served.
    Random streams as chat episodes: one per episode, drawn from the seed's (or from the one
    generator); greedy sampling uses none. `system_prompt` is the harness's business, not used."""
    from recursa.envs.base import as_pool

    n = len(seeds) * group_size
    pool = as_pool(envs).take(n)
    first = pool[0]
    if agent.episode != "chat":
        raise UserError(f"env {first.name!r} is played by its harness as a chat through the OpenAI endpoint: set agent.episode = 'chat' (docs/serve.md)")
    if prefixes is not None:
        raise UserError("rollout.branch replays turn-mode prompts; a harness env cannot replay its episodes")
    if hints is not None and any(hints):
        raise UserError(f"env {first.name!r}: a harness writes its own messages, so it cannot show a method's hints; turn off the method that sets them")
    streams = list(generator) if isinstance(generator, (list, tuple)) else None
    if streams is not None and len(streams) != len(seeds):
        raise ValueError(f"expected one generator per seed: {len(streams)} generators for {len(seeds)} seeds")
    if streams is None and sampling.temperature > 0:
        streams = group_generators(generator, len(seeds))
    episode_streams = [None] * n if streams is None else [e for g in streams for e in group_generators(g, group_size)]
    stats = GenerationStats()
    server = PolicyServer(policy.tokenizer, engine, sampling, stop_ids=eos_token_ids(policy.tokenizer, policy.causal_lm), model=first.model,
                          host=first.host, port=first.port, chat_template=agent.chat_template, max_context_tokens=agent.max_context_tokens,
                          max_tool_call_chars=agent.max_tool_call_chars, history=first.history, stats=stats)
    served = [server.open_episode(seeds[i // group_size], episode_streams[i]) for i in range(n)]
    results: list[dict] = [{} for _ in range(n)]

    def play(i: int) -> None:
        env = pool[i]
        try:
            env.reset(served[i].seed)
            results[i]["value"] = env.harness(served[i].base_url, served[i].seed)
        except BaseException as exc:  # noqa: BLE001 - reported below, in one line
            results[i]["error"] = exc

    with server:
        running: dict[int, tuple[threading.Thread, float]] = {}
        ended: set[int] = set()
        todo = list(range(n))
        limit = first.concurrency or n
        while todo or running:
            while todo and len(running) < limit:
                i = todo.pop(0)
                t = threading.Thread(target=play, args=(i,), name=f"recursa-harness-{i}", daemon=True)
                t.start()
                running[i] = (t, time.monotonic() + pool[i].timeout)
            for i, (t, deadline) in list(running.items()):
                t.join(timeout=0.002)
                if not t.is_alive():
                    del running[i]
                elif time.monotonic() > deadline:  # abandoned: its thread is left to finish, its late requests refused
                    results[i].setdefault("error", TimeoutError(f"the episode ran past its {pool[i].timeout:g} s (timeout)"))
                    del running[i]
            for i in set(range(n)) - ended - set(running) - set(todo):  # finished: a late request of its harness is refused
                server.end_episode(served[i])
                ended.add(i)
    episodes = []
    for i, ep in enumerate(served):
        env = pool[i]
        where = f"harness {env.name!r} (item {ep.seed}, episode {i})"
        if ep.fatal is not None:
            raise ep.fatal
        if "error" in results[i]:
            exc = results[i]["error"]
            if isinstance(exc, UserError) and env.errors == "raise":
                raise UserError(f"{where}: {exc}") from None
            if env.errors == "raise":
                raise UserError(f"{where} raised {type(exc).__name__}: {one_line(exc)[:300]}") from None
            reward, won, finish = 0.0, False, "crashed"
        else:
            reward, won = _outcome(results[i].get("value"), ep, where)
            finish = "won" if won else "lost"
            if not math.isfinite(reward):
                raise UserError(f"{where} returned the reward {reward}: a reward must be a finite number")
        if not ep.turns and finish != "crashed":
            raise UserError(f"{where} made no chat completion request to its base_url: there is nothing to train on")
        if ep.turns:
            ep.turns[-1].reward = reward  # the episode's return is its turns' sum
        episodes.append(Episode(env.name, ep.seed, i // group_size, env.task, ep.turns, won, finish))
    return EpisodeRollout(episodes, stats, max((len(e.turns) for e in episodes), default=0))
