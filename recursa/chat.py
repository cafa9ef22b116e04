"""Chat episodes (`agent.episode = "chat"`): a game played as one growing conversation.

The turn mode (`recursa.rollout.rollout_episodes`' own loop) renders every turn's prompt
afresh from the task, the recent history and the observation. Here the episode is a chat
under the policy's chat template instead,

    system (the env's system prompt, plus the tools when it has any)
    user (the task, the first observation, the admissible actions)
    assistant (sampled) -> tool results (when it called tools) or the next observation -> assistant ...

and the template renders the conversation once, at the start. Every later prompt is the
previous prompt, the tokens the policy sampled, the end-of-turn token when the reply did not
end with one (cut at `max_new_tokens` or at a stop string), and the tokens of the new
messages: never a re-rendering. So each turn's training row holds exactly the tokens the
policy read and sampled, earlier replies included, as they were sampled.

The new messages' tokens (`ChatTemplate.delta`) are the template's rendering of them after a
fixed stand-in conversation, cut right after the stand-in's end-of-turn token: what the
template writes between one assistant message and the next generation prompt. That is
right for a template that only appends (rendering messages[:k] is a token prefix of
rendering messages[:k+1], at every assistant turn), and `check_prefix_preserving` says so,
or stops the run with one line, before the first episode.

Training rows: one per sampled turn, as in the turn mode (`Episode.rows()`), turn k's row
holding the whole conversation up to its reply with only that reply's tokens masked in.
The recipes' per-turn machinery (GiGPO's step term, expert iteration's invalid-turn filter,
the row-to-episode index) then works unchanged. A causal model gives each reply's tokens the
same log-probabilities in its own row as it would in one row of the whole conversation with
every reply masked in, so the gradient is the same up to how the loss averages tokens over
rows; the price is that the update reads turn k's context again in row k, so tokens grow
with the square of the turns (`agent.max_context_tokens` bounds an episode).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from recursa.agent import AgentConfig, _clip, parse_action, render_turn
from recursa.envs.protocol import system_prompt_of
from recursa.envs.tools import Tool, ToolBudget, has_tool_call, parse_tool_calls, run_calls, tools_of, tools_system_text
from recursa.errors import UserError
from recursa.generation import GenerationStats, eos_token_ids, group_generators
from recursa.trajectory import Episode, Turn

# a stand-in conversation for the probe and the deltas: assistant replies with a think block
# and a tool call, so templates that strip or rewrite either in earlier turns are caught
_PROBE = [
    {"role": "user", "content": "Where is the key?"},
    {"role": "assistant", "content": "<think>look first</think>look"},
    {"role": "user", "content": "You see a box."},
    {"role": "assistant", "content": '<tool_call>{"name": "search", "arguments": {"query": "box"}}</tool_call>'},
    {"role": "tool", "content": "The key is in the box."},
    {"role": "tool", "content": "The box is red."},
    {"role": "assistant", "content": "open box"},
    {"role": "user", "content": "You win."},
    {"role": "assistant", "content": "done"},
]


def template_text(spec: str | None) -> str | None:
    """`agent.chat_template` as Jinja text: the file it names when it is the path of one, else the text itself."""
    if not spec:
        return None
    if "{" not in spec and len(spec) < 4096:
        path = Path(spec).expanduser()
        if not path.is_file():
            raise UserError(f"agent.chat_template = {spec!r} is neither a Jinja template nor the path of a file")
        return path.read_text()
    return spec


def _first_difference(a: list[int], b: list[int]) -> int:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


class ChatTemplate:
    """The policy's chat template for one kind of conversation (a system text and tools):
    the first prompt (`start`), the tokens of new messages after a reply (`delta`), and the
    end-of-turn token to add after a reply that lacks it (`close`)."""

    def __init__(self, tokenizer, template: str | None = None, tools: list[Tool] | None = None, stop_ids: set[int] | None = None):
        self.tok = tokenizer
        self.template = template
        self.source = template or getattr(tokenizer, "chat_template", None) or ""
        if not self.source:
            raise UserError("agent.episode = 'chat' needs a chat template: the tokenizer has none; set agent.chat_template")
        self.tools = list(tools or [])
        self.renders_tools = bool(self.tools) and re.search(r"\btools\b", self.source) is not None
        # a template that knows the 'tool' role renders tool results itself; else they are a user message of <tool_response> blocks
        self.tool_role = "tool" if re.search(r"""['"]tool['"]""", self.source) else "user"
        self.stop_ids = stop_ids or ({int(tokenizer.eos_token_id)} if tokenizer.eos_token_id is not None else set())
        self._bases: dict[str | None, tuple[list[int], int]] = {}

    # ------------------------------------------------------------------ rendering
    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> list[int]:
        kwargs: dict[str, Any] = {}
        if self.template:
            kwargs["chat_template"] = self.template
        if self.renders_tools:
            kwargs["tools"] = [t.schema() for t in self.tools]
        messages = self.adapt(messages)
        try:
            ids = self.tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True, **kwargs)
        except Exception as exc:  # a Jinja error in the user's template
            raise UserError(f"agent.episode = 'chat': the chat template failed to render ({type(exc).__name__}: {' '.join(str(exc).split())[:200]})") from None
        if not isinstance(ids, list):  # BatchEncoding in newer transformers
            ids = ids["input_ids"]
        return [int(i) for i in ids]

    def adapt(self, messages: list[dict]) -> list[dict]:
        """`messages` as this template takes them: runs of tool messages become one user
        message of <tool_response> blocks where the template has no 'tool' role."""
        if self.tool_role == "tool":
            return messages
        out: list[dict] = []
        for m in messages:
            if m["role"] != "tool":
                out.append(m)
                continue
            block = f"<tool_response>\n{m['content']}\n</tool_response>"
            if out and out[-1].get("_tools"):
                out[-1] = {"role": "user", "content": out[-1]["content"] + "\n" + block, "_tools": True}
            else:
                out.append({"role": "user", "content": block, "_tools": True})
        return [{k: v for k, v in m.items() if k != "_tools"} for m in out]

    def system_text(self, system: str | None) -> str | None:
        """The system message: `system`, then the tools' description when the template does not render tools."""
        if self.tools and not self.renders_tools:
            return f"{system.rstrip()}\n\n{tools_system_text(self.tools)}" if system else tools_system_text(self.tools)
        return system

    def head(self, system: str | None) -> list[dict]:
        text = self.system_text(system)
        return [{"role": "system", "content": text}] if text else []

    def start(self, system: str | None, user: str) -> list[int]:
        """The first prompt: the system message (when any) and the first user message, with the generation prompt."""
        return self.render(self.head(system) + [{"role": "user", "content": user}], add_generation_prompt=True)

    # ------------------------------------------------------------------ deltas
    def _base(self, system: str | None) -> tuple[list[int], int]:
        if system not in self._bases:
            base = self.render(self.head(system) + _PROBE[:2])
            ends = [k for k, t in enumerate(base) if t in self.stop_ids]
            if not ends:
                raise UserError("agent.episode = 'chat': the chat template ends an assistant message with no end-of-turn token the sampler stops on "
                                f"(stop ids {sorted(self.stop_ids)}); set agent.chat_template to one that does")
            self._bases[system] = (base, ends[-1] + 1)
        return self._bases[system]

    def delta(self, system: str | None, new: list[dict]) -> list[int]:
        """The tokens of `new` messages after an assistant reply's end-of-turn token, through the next generation prompt."""
        base, cut = self._base(system)
        full = self.render(self.head(system) + _PROBE[:2] + new, add_generation_prompt=True)
        if full[: len(base)] != base:
            at = _first_difference(base, full)
            raise UserError(f"agent.episode = 'chat': the chat template rewrites history (the conversation so far is not a token prefix of it "
                            f"with the new {', '.join(m['role'] for m in new)} message(s); first difference at token {at}); "
                            "set agent.chat_template to a template that only appends, or use agent.episode = 'turn'")
        return full[cut:]

    def close(self, sampled: list[int]) -> list[int]:
        """The end-of-turn token to add after a reply that does not end with a stop token ([] when it does)."""
        if sampled and sampled[-1] in self.stop_ids:
            return []
        base, cut = self._base(None)
        return [base[cut - 1]]


def check_prefix_preserving(chat: ChatTemplate, system: str | None = "You are a test.") -> None:
    """Check on a stand-in conversation (think blocks, a tool call, two tool results) that the
    template only appends at assistant turns: for every assistant message j, rendering
    messages[:j] with the generation prompt is a token prefix of rendering messages[:j+1], and
    that is a prefix of rendering up to the next assistant message with the generation prompt.
    A one-line UserError names the first place where it is not."""
    conv = chat.head(system) + _PROBE
    turns = [j for j, m in enumerate(conv) if m["role"] == "assistant"]
    checks = []
    for n, j in enumerate(turns):
        checks.append((j, True, j + 1, False))
        if n + 1 < len(turns):
            checks.append((j + 1, False, turns[n + 1], True))
    for k, gen_k, k2, gen_k2 in checks:
        a, b = chat.render(conv[:k], add_generation_prompt=gen_k), chat.render(conv[:k2], add_generation_prompt=gen_k2)
        if b[: len(a)] != a:
            at = _first_difference(a, b)
            shown = chat.tok.decode(a[at : at + 8]), chat.tok.decode(b[at : at + 8])
            raise UserError(
                f"agent.episode = 'chat': the chat template is not prefix-preserving: rendering messages[:{k}] is not a token prefix of "
                f"rendering messages[:{k2}] (first difference at token {at}: {shown[0]!r} vs {shown[1]!r}); set agent.chat_template to a "
                "template that only appends (docs/chat.md), or use agent.episode = 'turn'"
            )


def observation_message(observation: str, admissible: list[str] | None, agent: AgentConfig) -> str:
    """A later turn's user message: the observation, the admissible actions, the instruction."""
    lines = [_clip(observation, agent.max_obs_chars)]
    if admissible:
        shown = admissible[: agent.max_actions_shown]
        lines += ["", "Admissible actions:"] + [f"- {a}" for a in shown]
        if len(admissible) > len(shown):
            lines.append(f"- ... ({len(admissible) - len(shown)} more)")
    lines += ["", agent.instruction]
    return "\n".join(lines)


# ---------------------------------------------------------------------------- the loop


@dataclass
class _Live:
    """One chat episode in flight."""

    env: Any
    seed: int
    chat: ChatTemplate
    system: str | None
    tools: list[Tool]
    budget: ToolBudget
    ids: list[int]  # the next prompt: the whole conversation so far, with the generation prompt
    obs: str
    admissible: list[str] | None
    messages: list[dict] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)
    won: bool = False
    finish: str = ""


class _LockStep:
    """`engine.generate` behind the batcher's interface: every pending prompt in one call, in
    episode order (the turn mode's lock-step schedule and random streams)."""

    def __init__(self, engine, sampling, stats, generator, streams):
        self.engine, self.sampling, self.stats, self.generator, self.streams = engine, sampling, stats, generator, streams
        self.pending: dict[int, list[int]] = {}
        self.calls = 0

    def submit(self, i: int, prompt: list[int], stream=None, front: bool = False) -> None:
        self.pending[i] = prompt

    @property
    def busy(self) -> bool:
        return bool(self.pending)

    def step(self):
        order = sorted(self.pending)
        prompts = [self.pending.pop(i) for i in order]
        gen = self.generator if self.streams is None else [self.streams[i] for i in order]
        samples = self.engine.generate(prompts, self.sampling, n=1, generator=gen, stats=self.stats)
        self.calls += 1
        return list(zip(order, samples))


def _outcome(env, info: dict) -> tuple[bool, str]:
    won = bool(info.get("won", info.get("success", False)))
    if won:
        return True, "won"
    return False, info.get("failure") or ("max_steps" if info.get("steps", 0) >= getattr(env, "max_steps", 1 << 30) else "lost")


def chat_episodes(tokenizer, causal_lm, envs: list, seeds: list[int], group_size: int, sampling, generator, system_prompt: str | None,
                  agent: AgentConfig, hints: list[str | None], engine) -> tuple[list[Episode], GenerationStats, int]:
    """Play `group_size` chat episodes of each seed's game (`envs`: one instance per episode,
    episode i*G+k plays seed i); returns (episodes, generation stats, sampling rounds).
    `hints[i]` goes into the first user message of seed i's episodes. Random streams follow
    the turn mode: one generator for the whole rollout, or one per seed (each of its G
    episodes then draws from a stream drawn from it); with continuous batching
    (`engine.continuous`) each episode always samples from its own stream."""
    n = len(seeds) * group_size
    streams = list(generator) if isinstance(generator, (list, tuple)) else None
    continuous = bool(getattr(engine, "continuous", False))
    if streams is None and continuous and sampling.temperature > 0:
        streams = group_generators(generator, len(seeds))
    episode_streams = None if streams is None else [e for g in streams for e in group_generators(g, group_size)]
    stats = GenerationStats()
    batcher = engine.batcher(sampling, stats, None) if continuous else _LockStep(engine, sampling, stats, generator, episode_streams)
    stop_ids = eos_token_ids(tokenizer, causal_lm)
    template = template_text(agent.chat_template)
    checked: set = set()
    live: list[_Live] = []
    for i in range(n):
        env, seed = envs[i], seeds[i // group_size]
        obs = env.reset(seed)
        admissible = env.admissible_actions() if hasattr(env, "admissible_actions") else None
        tools = tools_of(env)
        key = tuple(t.name for t in tools)
        chat = ChatTemplate(tokenizer, template, tools, stop_ids)
        if key not in checked:  # once per kind of conversation
            check_prefix_preserving(chat)
            checked.add(key)
        system = system_prompt_of(env) or system_prompt
        user = render_turn(getattr(env, "task", ""), obs, admissible, [], agent, hint=hints[i // group_size])
        ep = _Live(env, seed, chat, system, tools, ToolBudget(agent.max_tool_calls, agent.tool_seconds), chat.start(system, user), obs, admissible)
        ep.messages = chat.head(system) + [{"role": "user", "content": user}]
        live.append(ep)
        batcher.submit(i, ep.ids, None if episode_streams is None else episode_streams[i])
    rounds = 0
    while batcher.busy:
        rounds += 1
        for i, sample in batcher.step():
            ep = live[i]
            new = _play(tokenizer, ep, sample, agent)
            if ep.finish:
                continue
            ids = ep.ids + list(sample.token_ids) + ep.chat.close(list(sample.token_ids)) + ep.chat.delta(ep.system, new)
            ep.messages += new  # (the reply itself is in ep.messages already)
            if len(ids) + sampling.max_new_tokens > agent.max_context_tokens:
                ep.finish = "context"
                continue
            ep.ids = ids
            batcher.submit(i, ids, None if episode_streams is None else episode_streams[i], front=True)
    episodes = [Episode(ep.env.name, ep.seed, i // group_size, getattr(ep.env, "task", ""), ep.turns, ep.won, ep.finish) for i, ep in enumerate(live)]
    if continuous:
        rounds = max((len(ep.turns) for ep in live), default=0)
    return episodes, stats, rounds


def _play(tokenizer, ep: _Live, sample, agent: AgentConfig) -> list[dict]:
    """Record the sampled reply as a turn (and an assistant message) and act on it: run its tool
    calls, or send its action to the game. Returns the messages that follow the reply (tool
    results, or the next observation); sets `ep.finish` when the episode ends."""
    reply = tokenizer.decode(sample.token_ids, skip_special_tokens=True)
    anchor = ep.env.state_key() if hasattr(ep.env, "state_key") else ep.obs
    ep.messages.append({"role": "assistant", "content": reply})
    common = dict(prompt_ids=list(ep.ids), action_ids=list(sample.token_ids), action_logprobs=list(sample.logprobs), reply=reply,
                  observation=ep.obs, anchor=str(anchor), admissible=ep.admissible)
    if ep.tools and has_tool_call(reply):
        calls = parse_tool_calls(reply, agent.max_tool_call_chars)
        exhausted = ep.budget.exhausted
        results = run_calls(calls, ep.tools, ep.budget, agent.max_tool_result_chars)
        bad = any(r.fault == "call" for r in results)  # the policy's call was wrong (a tool's own failure is not the policy's)
        ep.turns.append(Turn(action="; ".join(c.describe() for c in calls), reward=0.0, invalid=bad, **common))
        if exhausted:  # asked again after being told the limits are reached
            ep.budget.refused += 1
            if ep.budget.refused > 1:
                ep.finish = "tool_limit"
                return []
        ep.obs = "\n".join(r.content for r in results)
        return [{"role": "tool", "name": r.call.name or "unknown", "content": r.content} for r in results]
    parsed = parse_action(reply, ep.admissible, agent)
    result = ep.env.step(parsed.action)
    ep.turns.append(Turn(action=parsed.action, reward=float(result.reward), invalid=bool(result.info.get("invalid", False)), **common))
    if result.done:
        ep.won, ep.finish = _outcome(ep.env, result.info)
        return []
    ep.obs = result.obs
    ep.admissible = result.info.get("admissible", ep.admissible)
    return [{"role": "user", "content": observation_message(ep.obs, ep.admissible, agent)}]


# ---------------------------------------------------------------------------- demonstrations


def oracle_chat(env, seed: int, tokenizer, agent: AgentConfig, system_prompt: str | None = None) -> tuple[list[dict], bool]:
    """The chat an oracle plays on `env`'s item `seed`, as the messages chat mode shows the
    policy, and whether it won: the system text (with the tools where the template does not
    render them), the first user message, one assistant tool call per query of the env's
    `oracle_queries()` (when it has them) with the tool's real result, then the walkthrough's
    actions, each followed by the next observation as chat mode words it, until the game ends.
    Tool calls are written in the form the template's family reads (a JSON list in one block
    where the template does not render tools, the embedded SmolLM2's; one object per block
    otherwise). For a prefix-preserving template, SFT on these messages
    (`recursa.demos.transcript_row`) trains on the very tokens a chat episode with these replies
    would hold."""
    import json as _json

    obs = env.reset(seed)
    tools = tools_of(env)
    chat = ChatTemplate(tokenizer, template_text(agent.chat_template), tools)
    by_name = {t.name: t for t in tools}
    system = system_prompt_of(env) or system_prompt
    admissible = env.admissible_actions() if hasattr(env, "admissible_actions") else None
    messages = chat.head(system) + [{"role": "user", "content": render_turn(getattr(env, "task", ""), obs, admissible, [], agent)}]
    queries = env.oracle_queries() if callable(getattr(env, "oracle_queries", None)) else []
    if queries and "search" not in by_name:
        raise UserError(f"{env.name}'s oracle_queries() are searches, but it has no 'search' tool")
    for query in queries:
        call = {"name": "search", "arguments": {"query": query}}
        body = _json.dumps(call) if chat.renders_tools else _json.dumps([call])
        messages.append({"role": "assistant", "content": f"<tool_call>{body}</tool_call>"})
        messages.append({"role": "tool", "name": "search", "content": str(by_name["search"].fn(query=query))})
    won = False
    for action in env.walkthrough() or []:
        messages.append({"role": "assistant", "content": action})
        result = env.step(action)
        if result.done:
            won = _outcome(env, result.info)[0]
            break
        admissible = result.info.get("admissible", admissible)
        messages.append({"role": "user", "content": observation_message(result.obs, admissible, agent)})
    return chat.adapt(messages), won


def oracle_transcript(env, seed: int, tokenizer, agent: AgentConfig, system_prompt: str | None = None) -> list[dict]:
    """The messages of `oracle_chat` (won or not)."""
    return oracle_chat(env, seed, tokenizer, agent, system_prompt)[0]
