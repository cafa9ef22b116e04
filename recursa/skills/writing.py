"""Skill writing: show the policy one finished trajectory, ask for one rule, parse it.

Each training step the policy reads a completed trajectory with its outcome and writes
K candidate skills; a replay reward (``recursa.algorithms.distill.skill_rewards``)
scores them and the best enters the library.  This module owns the text on both sides
of that call.

The trajectory, as the policy reads it (`render_trajectory_for_skill`):

    Task: <task line, never truncated>
    1. Observation: <clipped observation>
       Action: <clipped action>
    2. ...
    ... (3 steps omitted) ...
    9. ...
    Outcome: SUCCESS - the task was completed.

The prompt (`skill_writing_prompt`) asks for ONE short imperative rule, a reusable
workflow after a success or an avoidance rule after a failure, answered as a single
line `SKILL: <rule>`.  A line prefix is the simplest format a 135M model follows
reliably, and the parser does not need it: a recipe may prefill "SKILL:" as the start
of the assistant turn, and a reply without the marker is read as the rule itself.

Parsing (`parse_skill`) never raises: a malformed reply becomes an invalid
`ParsedSkill` with a reason, counted by `SkillWritingStats`, so one bad sample never
stops a training step.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field

from recursa.skills.sanitize import has_special_token, strip_controls

MARKER = "SKILL:"
MIN_WORDS = 3  # "Check every drawer." is about the shortest useful rule
MAX_NON_ASCII = 0.1  # fraction of non-space characters; the games are in English
MIN_LETTERS = 0.5  # fraction of non-space characters that are letters
MIN_DISTINCT_WORDS = 0.4  # distinct / total words, checked from REPETITION_MIN_WORDS words on
REPETITION_MIN_WORDS = 6
MAX_WORD_CHARS = 40  # a longer "word" is a run of junk ("aaaa...", "----...")
MIN_OBS_CHARS = 40  # an observation is never clipped shorter than this
MAX_ACTION_CHARS = 80

_OUTCOME = {
    True: "Outcome: SUCCESS - the task was completed.",
    False: "Outcome: FAILURE - the task was not completed.",
}

_MARKER_RE = re.compile(r"\bskills?\s*\d*\s*:", re.IGNORECASE)
_BULLET_RE = re.compile(r"^(?:[-*+>\u2022]+|\d+[.)])\s*")
_TYPOGRAPHIC = str.maketrans({"\u2018": "'", "\u2019": "'", "\u201c": '"', "\u201d": '"', "\u2013": "-", "\u2014": "-"})
_EDGE_CHARS = "\"'`*_ \t"


def _clip(text: str, limit: int) -> str:
    """One line of at most `limit` characters, keeping the head (where a game's
    observation says what just happened)."""
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: max(limit - 3, 0)] + "..."


def _step_block(i: int, observation: str, action: str, obs_chars: int) -> str:
    return f"{i}. Observation: {_clip(observation, obs_chars)}\n   Action: {_clip(action, MAX_ACTION_CHARS)}"


def _fair_cap(lengths: list[int], budget: int) -> int:
    """The largest c with sum(min(l, c) for l in lengths) <= budget (water-filling):
    short observations keep their full text and leave their share to the long ones."""
    remaining, left = budget, len(lengths)
    for length in sorted(lengths):
        if length * left > remaining:
            return remaining // left
        remaining -= length
        left -= 1
    return max(lengths, default=0)


def _keep_ends(blocks: list[str], budget: int) -> list[str]:
    """`blocks` if they fit in `budget` characters (each with its newline); otherwise as
    many as fit taken alternately from the end and the start, with a marker for the gap.
    The start shows how the episode began, the end how it was decided."""
    if not blocks or sum(len(b) + 1 for b in blocks) <= budget:
        return blocks
    head: list[str] = []
    tail: list[str] = []
    used = len(f"... ({len(blocks)} steps omitted) ...") + 1
    lo, hi = 0, len(blocks) - 1
    while lo <= hi:
        take_tail = len(tail) <= len(head)
        block = blocks[hi] if take_tail else blocks[lo]
        if used + len(block) + 1 > budget:
            break
        used += len(block) + 1
        if take_tail:
            tail.insert(0, block)
            hi -= 1
        else:
            head.append(block)
            lo += 1
    gap = hi - lo + 1
    return head + [f"... ({gap} step{'s' * (gap != 1)} omitted) ..."] + tail


def render_trajectory_for_skill(task: str, steps: list[tuple[str, str]], won: bool, max_chars: int) -> str:
    """A compact text of one trajectory for the skill writer (format in the module doc).

    `steps` holds (observation, action) pairs in order: for a multi-turn episode
    `[(t.observation, t.action) for t in episode.turns]`; for a single-turn task the
    prompt and the reply.  The task and outcome lines are never cut; the whole text
    fits in `max_chars` characters unless those two lines alone nearly fill it.  To fit,
    observations are clipped to a common cap (water-filling, at least MIN_OBS_CHARS)
    and, if that is not enough, steps are dropped from the middle.
    """
    task_line = f"Task: {' '.join(task.split()) or '(not stated)'}"
    outcome = _OUTCOME[bool(won)]
    budget = max_chars - len(task_line) - len(outcome) - 1  # what the step lines may use
    fixed = sum(len(_step_block(i, "", a, 0)) + 1 for i, (_, a) in enumerate(steps, 1))
    obs_lengths = [len(" ".join(o.split())) for o, _ in steps]
    obs_chars = max(MIN_OBS_CHARS, _fair_cap(obs_lengths, budget - fixed))
    blocks = [_step_block(i, o, a, obs_chars) for i, (o, a) in enumerate(steps, 1)]
    return "\n".join([task_line, *_keep_ends(blocks, budget), outcome])


def skill_writing_prompt(trajectory_text: str, won: bool, max_words: int) -> str:
    """The user message asking for one rule learned from `trajectory_text`.

    After a success the rule is a reusable workflow; after a failure, what to avoid.
    The answer format is one line, `SKILL: <rule>`, of at most `max_words` words.
    """
    if won:
        ask = (
            "The attempt succeeded. Write one rule that repeats this success on similar tasks: "
            "the steps that worked, as a command (for example, start with Go, Take, Open or Check)."
        )
    else:
        ask = (
            "The attempt failed. Write one rule that avoids this failure on similar tasks: "
            "what to do instead, as a command (for example, start with Do not, Avoid or Always)."
        )
    return (
        f"Here is an attempt at a task.\n\n{trajectory_text}\n\n{ask}\n"
        f"Use at most {max_words} words. Reply with one line that starts with {MARKER} and nothing else."
    )


def contrastive_writing_prompt(success_text: str, failure_text: str, max_words: int) -> str:
    """The user message asking for one rule from a success and a failure of the same task
    (GRASP / SEED-like contrastive writing): what the successful attempt did that the failed
    one did not, as "When <situation>, do <what worked>, not <what failed>"."""
    return (
        "Here are two attempts at the same task. The first succeeded, the second failed.\n\n"
        f"SUCCESSFUL ATTEMPT\n{success_text}\n\nFAILED ATTEMPT\n{failure_text}\n\n"
        "Write one rule that explains the difference, in the form: When <situation>, do <what the successful attempt did>, "
        "not <what the failed attempt did>.\n"
        f"Use at most {max_words} words. Reply with one line that starts with {MARKER} and nothing else."
    )


@dataclass
class ParsedSkill:
    """One parsed reply.  `text` is the rule (None when invalid); `reason` is "ok" or
    why the reply was rejected; `words` counts the rule's words and `over_length` the
    words beyond the soft cap `max_words` (for the replay reward's length penalty)."""

    text: str | None
    valid: bool
    reason: str
    words: int = 0
    over_length: int = 0


def _rule_line(reply: str) -> str:
    """The text after the first SKILL marker (or on the next non-empty line when the
    marker ends its line); without a marker, the first non-empty line that does not end
    with ':' (a preamble such as "Here is a rule:")."""
    lines = [line.strip() for line in reply.splitlines()]
    lines = [line for line in lines if line]
    for i, line in enumerate(lines):
        found = _MARKER_RE.search(line)
        if found:
            rest = line[found.end() :].strip(_EDGE_CHARS)
            return rest or (lines[i + 1] if i + 1 < len(lines) else "")
    return next((line for line in lines if not line.endswith(":")), "")


def _clean(line: str) -> str:
    line = " ".join(line.translate(_TYPOGRAPHIC).split())
    return _BULLET_RE.sub("", line).strip(_EDGE_CHARS)


def _rejection(text: str, max_chars: int) -> str | None:
    """Why `text` is not a usable rule, or None.  Checks, in order: empty, over the hard
    cap, a template placeholder ("<rule>"), mostly non-ASCII, too few letters, too few
    words, a junk run ("aaaa...") or repetition ("go go go go go go")."""
    if not text:
        return "empty"
    if len(text) > max_chars:
        return "too_long"
    if text.startswith("<") and text.endswith(">"):
        return "placeholder"
    chars = [c for c in text if not c.isspace()]
    if sum(not c.isascii() for c in chars) > MAX_NON_ASCII * len(chars):
        return "non_ascii"
    if sum(c.isascii() and c.isalpha() for c in chars) < MIN_LETTERS * len(chars):
        return "few_letters"
    words = text.split()
    if len(words) < MIN_WORDS:
        return "too_short"
    tokens = [w.strip(".,;:!?\"'()").lower() for w in words]
    if max(len(t) for t in tokens) > MAX_WORD_CHARS:
        return "junk"
    if len(tokens) >= REPETITION_MIN_WORDS and len(set(tokens)) < MIN_DISTINCT_WORDS * len(tokens):
        return "repetitive"
    return None


def parse_skill(reply: str, max_words: int, max_chars: int) -> ParsedSkill:
    """Parse one reply to `skill_writing_prompt`; never raises.

    The rule is the text after the first `SKILL:` marker (case-insensitive, also
    "Skill 1:" or "**SKILL:**"), else the reply's first line (see `_rule_line`), with
    bullets, quotes, markdown emphasis and typographic quotes cleaned away and
    whitespace collapsed; escape sequences and control characters are removed first, and a
    rule holding a chat special token written as text (``<|im_end|>``) is rejected as
    "special_token" (see `recursa.skills.sanitize`).  It is never shortened: a rule over `max_words` words stays
    valid with `over_length` > 0 (the caller penalises it); one over `max_chars`
    characters, the hard cap, is rejected as "too_long".
    """
    line = _clean(_rule_line(strip_controls(reply if isinstance(reply, str) else "", one_line=False)))
    reason = "special_token" if has_special_token(line) else _rejection(line, max_chars)
    if reason is not None:
        return ParsedSkill(None, False, reason)
    words = len(line.split())
    return ParsedSkill(line, True, "ok", words, max(0, words - max_words))


@dataclass
class SkillWritingStats:
    """Counts of one step's written skills, logged as `skills/...` metrics."""

    written: int = 0
    valid: int = 0
    over_length: int = 0  # valid skills beyond the soft word cap
    invalid: Counter = field(default_factory=Counter)  # reason -> count

    def add(self, parsed: ParsedSkill) -> None:
        self.written += 1
        if parsed.valid:
            self.valid += 1
            self.over_length += parsed.over_length > 0
        else:
            self.invalid[parsed.reason] += 1

    def metrics(self) -> dict[str, float]:
        """{"skills/written", "skills/valid", "skills/valid_frac", "skills/over_length",
        "skills/invalid", "skills/invalid/<reason>" for each reason seen}."""
        out = {
            "skills/written": float(self.written),
            "skills/valid": float(self.valid),
            "skills/valid_frac": self.valid / self.written if self.written else 0.0,
            "skills/over_length": float(self.over_length),
            "skills/invalid": float(sum(self.invalid.values())),
        }
        out.update({f"skills/invalid/{r}": float(n) for r, n in sorted(self.invalid.items())})
        return out
