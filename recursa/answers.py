"""Verifying a reply, the pure part: answer parsing (the <answer> tag, the last number of a
reply, a canonical form of number strings) and the checked call of a reward function. The
bottom layer: the envs, the dataset tasks, the [[reward]] entries and the rewards without a
verifier all read answers and scores through these."""

from __future__ import annotations

import math
import re
from decimal import Decimal, InvalidOperation
from typing import Callable

from recursa.errors import UserError


_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)
# A number: optional minus (not when glued to a preceding word/digit, so "5-3" reads 3),
# then thousands-grouped digits or plain digits, then an optional decimal part.
_NUMBER = re.compile(r"(?:(?<![\w.])-)?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?![\d])|(?:(?<![\w.])-)?\.\d+")


def extract_answer(text: str) -> str | None:
    """The stripped content of the last <answer>...</answer> tag in `text`, or None."""
    matches = _ANSWER_TAG.findall(text or "")
    return matches[-1].strip() if matches else None


def normalise_number(text: str) -> str | None:
    """Canonical form of a number string ("1,000" -> "1000", "-0" -> "0", "2.50" -> "2.5")."""
    cleaned = text.strip().replace(",", "")
    if cleaned.startswith("+"):
        cleaned = cleaned[1:]
    try:
        value = Decimal(cleaned)
    except InvalidOperation:
        return None
    if not value.is_finite():
        return None
    if value == 0:
        return "0"
    if value == value.to_integral_value():
        return str(int(value))
    return format(value.normalize(), "f")


def last_number(text: str) -> str | None:
    """The last integer or decimal in `text`, normalised (see `normalise_number`), or None."""
    matches = _NUMBER.findall(text or "")
    for match in reversed(matches):
        value = normalise_number(match)
        if value is not None:
            return value
    return None


def call_reward(fn: Callable, name: str, prompts: list[str], completions: list[str], fields: dict[str, list]) -> list[float | None]:
    """`fn(prompts, completions, **fields)` checked: a list of len(completions) floats or
    None; anything else (or an exception) is a one-line `UserError` naming the function."""
    try:
        out = fn(prompts, completions, **fields)
    except UserError:
        raise
    except Exception as exc:
        raise UserError(f"reward function {name!r} raised {type(exc).__name__}: {' '.join(str(exc).split())[:200]}") from None
    try:
        out = list(out)
    except TypeError:
        raise UserError(f"reward function {name!r} returned {type(out).__name__}, expected a list of float | None, one per completion") from None
    if len(out) != len(completions):
        raise UserError(f"reward function {name!r} returned {len(out)} values for {len(completions)} completions: return one float (or None) per completion")
    values: list[float | None] = []
    for i, v in enumerate(out):
        if v is None:
            values.append(None)
            continue
        if not isinstance(v, (int, float)) and not hasattr(v, "__float__"):
            raise UserError(f"reward function {name!r} returned {v!r} (a {type(v).__name__}) for completion {i}: return a float or None")
        f = float(v)
        if not math.isfinite(f):
            raise UserError(f"reward function {name!r} returned {f} for completion {i}: rewards must be finite (None means 'does not apply')")
        values.append(f)
    return values


def reward_function(func: str) -> Callable:
    """The function a `[[reward]] func` names: 'pkg.module:function', or a name in
    `recursa.plugins.REWARDS` (a 'recursa.rewards' entry point, or `REWARDS.register`); a
    one-line UserError when it does not import or is not a function."""
    from recursa.plugins import REWARDS
    from recursa.registry import import_object, is_import_path

    fn = import_object(func, "reward.func") if is_import_path(func) or func not in REWARDS else REWARDS.get(func)
    if not callable(fn):
        raise UserError(f"reward.func = {func!r} is not a function")
    return fn
