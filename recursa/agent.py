"""Agent prompting for multi-turn games: render a turn's prompt, parse the reply.

A turn's prompt is one user message (rendered with the model's chat template):

    <task line>
    <hint block, when the caller gives one: a skill, a walkthrough (RSIPO's teacher contexts)>
    Recent history (last k turns): observation / action pairs
    Current observation
    Admissible actions, one per line
    an instruction to answer with one action

The task line comes first and is never truncated, nor is a hint; history is limited to the last
`history_turns` turns, and long texts are clipped at `max_obs_chars` characters, so the
prompt stays bounded however long the episode runs.

Parsing maps the reply to an admissible action: the first non-empty line, stripped of
quotes, a leading "Action:" / "> " and a trailing period, matched case-insensitively;
with `fuzzy` on, the closest admissible action above `fuzzy_cutoff` (difflib ratio)
is taken when nothing matches exactly. A reply that matches nothing is sent to the game
as written, where it counts as an invalid action.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class AgentConfig(BaseModel):
    """How multi-turn games are presented to the policy."""

    model_config = ConfigDict(extra="forbid")

    history_turns: int = Field(2, ge=0, description="previous (observation, action) pairs shown in each prompt")
    max_obs_chars: int = Field(1200, gt=0, description="clip each observation to this many characters (keeps the tail)")
    max_actions_shown: int = Field(60, gt=0, description="admissible actions listed in the prompt at most")
    fuzzy: bool = Field(True, description="map a near-miss reply to the closest admissible action")
    fuzzy_cutoff: float = Field(0.8, gt=0, le=1, description="difflib similarity needed for a fuzzy match")
    instruction: str = Field(
        "Reply with exactly one action from the list and nothing else.",
        description="the last line of every prompt",
    )
    # --- chat episodes and tool calls (issue 48; recursa/chat.py, recursa/envs/tools.py, docs/chat.md) ---
    episode: Literal["turn", "chat"] = Field(
        "turn", description="turn: each turn's prompt rendered afresh (task, recent history, observation); chat: one growing conversation, "
        "each turn's prompt the previous turn's tokens plus the new messages' tokens, never re-rendered (docs/chat.md)")
    chat_template: str | None = Field(None, description="chat episodes: a Jinja chat template (text, or the path of a .jinja file) used in place of the tokenizer's")
    max_context_tokens: int = Field(4096, gt=0, description="chat episodes: an episode whose next prompt plus sampling.max_new_tokens would pass this ends (finish reason 'context')")
    max_tool_calls: int = Field(8, ge=0, description="chat episodes: tool calls per episode at most; later calls are answered with a limit message")
    tool_seconds: float = Field(20.0, gt=0, description="chat episodes: seconds of tool time per episode in all; a call past it is abandoned as timed out")
    max_tool_result_chars: int = Field(2000, gt=0, description="chat episodes: a tool result longer than this is cut")
    max_tool_call_chars: int = Field(4000, gt=0, description="chat episodes: a <tool_call> block longer than this is refused unread")


@dataclass
class ParsedAction:
    action: str  # what is sent to the game
    matched: bool  # an admissible action (exact or fuzzy)
    fuzzy: bool  # matched only by the fuzzy fallback


def _clip(text: str, limit: int) -> str:
    text = text.strip()
    return text if len(text) <= limit else "..." + text[-limit:]


def clip_hint(text: str, limit: int) -> str:
    """A hint's text with its whitespace collapsed, cut to `limit` characters ending in '...'."""
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def win_hint(task: str, actions: list[str], limit: int) -> str:
    """The hint that shows a won game's actions: "Actions that won a similar game (<its task
    line>): a1, a2, ...", whitespace collapsed, clipped to `limit` characters. RSIPO's
    hatch.hint = 'win' re-rolls with it (the policy's own wins) and SFT's data.win_hints
    teaches the policy to read it (other demonstration games' walkthroughs), so both show
    the policy the same form."""
    return clip_hint(f"Actions that won a similar game ({task}): {', '.join(actions)}", limit)


def render_turn(
    task: str,
    observation: str,
    admissible: list[str] | None,
    history: list[tuple[str, str]],
    cfg: AgentConfig,
    hint: str | None = None,
) -> str:
    """The user message for one turn; `history` holds earlier (observation, action) pairs.
    A `hint` (e.g. a retrieved skill) goes right after the task line, never clipped."""
    lines = [task.strip() or "Play the game.", ""]
    if hint:
        lines.extend([hint.strip(), ""])
    recent = history[-cfg.history_turns :] if cfg.history_turns else []
    if recent:
        lines.append(f"Recent history (last {len(recent)} turns):")
        for obs, act in recent:
            lines.append(f"Observation: {_clip(obs, cfg.max_obs_chars // 2)}")
            lines.append(f"Action: {act}")
        lines.append("")
    lines.append(f"Current observation: {_clip(observation, cfg.max_obs_chars)}")
    if admissible:
        shown = admissible[: cfg.max_actions_shown]
        lines.append("")
        lines.append("Admissible actions:")
        lines.extend(f"- {a}" for a in shown)
        if len(admissible) > len(shown):
            lines.append(f"- ... ({len(admissible) - len(shown)} more)")
    lines.append("")
    lines.append(cfg.instruction)
    return "\n".join(lines)


def _clean(reply: str) -> str:
    for line in reply.strip().splitlines():
        line = line.strip()
        if line:
            break
    else:
        return ""
    for prefix in ("action:", "> ", ">", "- "):
        if line.lower().startswith(prefix):
            line = line[len(prefix) :].strip()
    line = line.strip("`\"' ")
    if line.endswith(".") and not line.endswith(".."):
        line = line[:-1]
    return line.strip()


def parse_action(reply: str, admissible: list[str] | None, cfg: AgentConfig) -> ParsedAction:
    """Map a model reply to the action sent to the game."""
    text = _clean(reply)
    if not admissible:
        return ParsedAction(text, bool(text), False)
    lowered = {a.lower(): a for a in admissible}
    if text.lower() in lowered:
        return ParsedAction(lowered[text.lower()], True, False)
    if cfg.fuzzy and text:
        close = difflib.get_close_matches(text.lower(), list(lowered), n=1, cutoff=cfg.fuzzy_cutoff)
        if close:
            return ParsedAction(lowered[close[0]], True, True)
    return ParsedAction(text, False, False)
