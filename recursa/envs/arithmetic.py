"""A built-in, dependency-free, verifiable arithmetic environment.

Each seed gives one single-turn question whose answer is an integer. Difficulty levels:

    0  a + b, single digits                                  "7 + 5"
    1  a + b or a - b, two-digit operands (a - b never < 0)  "63 - 28"
    2  a * b with a one- and a two-digit operand,
       or three two-digit terms joined by + / -              "7 * 48", "35 + 12 - 60"
    3  three operands (1..20) mixing + - * with parentheses  "(4 + 9) * 3"
    4  like 3 with larger numbers: 100..9999 for + / -,
       10..99 next to *                                      "(4821 - 77) * 12"

The item is a pure function of (seed, difficulty). Answer formats:

    last_number  (default) the last number in the reply, like GSM8K-style graders
    tag          the content of the last <answer>...</answer> tag must be the number
    exact        the whole stripped reply must be exactly the number
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from recursa.answers import extract_answer, last_number, normalise_number
from recursa.envs.protocol import StepResult
from recursa.errors import UserError

__all__ = ["ANSWER_FORMATS", "MAX_DIFFICULTY", "ArithmeticEnv", "ArithmeticItem", "make_item"]

MAX_DIFFICULTY = 4
ANSWER_FORMATS = ("last_number", "tag", "exact")

_DEFAULT_TEMPLATES = {
    "last_number": "What is {question}? Reply with only the number.",
    "exact": "What is {question}? Reply with only the number.",
    "tag": "What is {question}? Put the final answer (only the number) inside <answer></answer> tags.",
}


@dataclass(frozen=True)
class ArithmeticItem:
    """One question: the expression as shown to the model and its integer value."""

    question: str
    answer: int


def _apply(op: str, a: int, b: int) -> int:
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    return a * b


def _three_operands(rng: random.Random, small: tuple[int, int], big: tuple[int, int]) -> ArithmeticItem:
    """(a op b) op c or a op (b op c); operands next to '*' come from `small`, others from `big`."""
    op1, op2 = rng.choice("+-*"), rng.choice("+-*")
    left_group = rng.random() < 0.5
    # Operand i touches op1 if i in (0, 1) and op2 if i in (1, 2).
    touches_mul = [op1 == "*", op1 == "*" or op2 == "*", op2 == "*"]
    a, b, c = (rng.randint(*(small if mul else big)) for mul in touches_mul)
    if left_group:
        return ArithmeticItem(f"({a} {op1} {b}) {op2} {c}", _apply(op2, _apply(op1, a, b), c))
    return ArithmeticItem(f"{a} {op1} ({b} {op2} {c})", _apply(op1, a, _apply(op2, b, c)))


def make_item(seed: int, difficulty: int) -> ArithmeticItem:
    """The question for (seed, difficulty); deterministic across runs and platforms."""
    rng = random.Random(f"recursa.arithmetic:{difficulty}:{seed}")
    if difficulty == 0:
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        return ArithmeticItem(f"{a} + {b}", a + b)
    if difficulty == 1:
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        if rng.random() < 0.5:
            return ArithmeticItem(f"{a} + {b}", a + b)
        a, b = max(a, b), min(a, b)
        return ArithmeticItem(f"{a} - {b}", a - b)
    if difficulty == 2:
        if rng.random() < 0.5:
            a, b = rng.randint(2, 9), rng.randint(10, 99)
            if rng.random() < 0.5:
                a, b = b, a
            return ArithmeticItem(f"{a} * {b}", a * b)
        a, b, c = (rng.randint(10, 99) for _ in range(3))
        op1, op2 = rng.choice("+-"), rng.choice("+-")
        return ArithmeticItem(f"{a} {op1} {b} {op2} {c}", _apply(op2, _apply(op1, a, b), c))
    if difficulty == 3:
        return _three_operands(rng, small=(1, 20), big=(1, 20))
    if difficulty == 4:
        return _three_operands(rng, small=(10, 99), big=(100, 9999))
    raise UserError(f"arithmetic difficulty must be an int in 0..{MAX_DIFFICULTY}, got {difficulty!r}")


class ArithmeticEnv:
    """Single-turn arithmetic questions with reward 1.0 for the right integer, else 0.0."""

    name = "arithmetic"

    def __init__(
        self,
        difficulty: int = 0,
        answer_format: str = "last_number",
        prompt_template: str | None = None,
        system_prompt: str | None = None,
    ) -> None:
        if isinstance(difficulty, bool) or not isinstance(difficulty, int) or not 0 <= difficulty <= MAX_DIFFICULTY:
            raise UserError(f"arithmetic difficulty must be an int in 0..{MAX_DIFFICULTY}, got {difficulty!r}")
        if answer_format not in ANSWER_FORMATS:
            raise UserError(f"unknown answer_format {answer_format!r}; choose one of: {', '.join(ANSWER_FORMATS)}")
        template = _DEFAULT_TEMPLATES[answer_format] if prompt_template is None else prompt_template
        if not isinstance(template, str) or "{question}" not in template:
            raise UserError("prompt_template must be a string containing '{question}', e.g. 'Compute {question}.'")
        try:
            template.format(question="1 + 1")
        except (KeyError, IndexError, ValueError) as exc:
            raise UserError(
                f"prompt_template may only use the {{question}} field (double other braces): {exc}"
            ) from None
        self.difficulty = difficulty
        self.answer_format = answer_format
        self.prompt_template = template
        self.system_prompt = system_prompt
        self._item: ArithmeticItem | None = None
        self._done = True

    def item(self, seed: int) -> ArithmeticItem:
        """The question for `seed` at this env's difficulty (does not start an episode)."""
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise UserError(f"seed must be a non-negative int, got {seed!r}")
        return make_item(seed, self.difficulty)

    def reset(self, seed: int) -> str:
        self._item = self.item(seed)
        self._done = False
        return self.prompt_template.format(question=self._item.question)

    def reference(self) -> str:
        """A reply that solves the current item, in this env's answer format (for SFT)."""
        if self._item is None:
            raise RuntimeError("call reset(seed) before reference()")
        answer = str(self._item.answer)
        return f"<answer>{answer}</answer>" if self.answer_format == "tag" else answer

    def parse(self, action_text: str) -> str | None:
        """What this env reads as the answer in a reply, per `answer_format` (None: nothing)."""
        text = action_text or ""
        if self.answer_format == "last_number":
            return last_number(text)
        if self.answer_format == "tag":
            return extract_answer(text)
        stripped = text.strip()
        return stripped or None

    def step(self, action_text: str) -> StepResult:
        if self._item is None or self._done:
            raise RuntimeError("call reset(seed) before step(); arithmetic episodes end after one step")
        self._done = True
        answer = str(self._item.answer)
        parsed = self.parse(action_text)
        note = ""
        if parsed is None:
            note = {
                "last_number": "no number in the reply",
                "tag": "no <answer></answer> tag in the reply",
                "exact": "empty reply",
            }[self.answer_format]
            success = False
        elif self.answer_format == "exact":
            success = parsed == answer
        else:
            success = normalise_number(parsed) == answer
            if not success and normalise_number(parsed) is None:
                note = "answer is not a number"
        return StepResult(
            obs="",
            reward=1.0 if success else 0.0,
            done=True,
            info={"success": success, "answer": answer, "parsed": parsed, "note": note},
        )
