"""Text the policy wrote (skills, proposed prompts) made safe for a library, a prompt and a terminal.

A skill or a proposed system prompt is model output that is stored, shown to the policy in
later prompts and printed by `recursa lineage`. It is never executed, and all SQL that
stores it is parameterised; two things still need care:

* control characters and escape sequences (ANSI CSI / OSC, C0 and C1 controls, Unicode
  bidirectional overrides) would reach a terminal or a file as commands: they are removed
  (:func:`strip_controls`);
* a chat special token written as text (``<|im_end|>``, ``</s>``, ``[INST]``) is parsed back
  into the real token when the prompt is tokenized, so a skill could end the system turn
  and forge a new one: :func:`has_special_token` finds them (parsers refuse such a text)
  and :func:`escape_special_tokens` defuses them (``<|im_end|>`` -> ``(im_end)``) where a
  text must be kept, e.g. a library restored from another run's checkpoint.

:func:`sanitize` does both; pass a tokenizer's own special tokens in `extra` to cover
tokens the generic patterns miss.
"""

from __future__ import annotations

import re
from typing import Iterable

__all__ = ["escape_special_tokens", "has_special_token", "sanitize", "strip_controls"]

# ESC [ ... final byte (CSI), ESC ] ... BEL or ESC \ (OSC), ESC P/X/^/_ ... ESC \ (DCS, SOS, PM, APC),
# then any other two-character escape.
_ESCAPES = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)?|\x1b[PX^_][^\x1b]*(?:\x1b\\)?|\x1b.?|\x9b[0-?]*[ -/]*[@-~]", re.S)
# C0 controls (tab, newline and carriage return become spaces first), DEL, C1 controls,
# bidirectional overrides and isolates, zero-width joiners/spaces and the BOM.
_WHITESPACE_CONTROLS = str.maketrans({"\t": " ", "\n": " ", "\r": " ", "\v": " ", "\f": " "})
_CONTROLS = re.compile("[\x00-\x1f\x7f-\x9f\u200b-\u200f\u202a-\u202e\u2066-\u2069\ufeff]")
# Chat-template special tokens of common model families, written as text.
_SPECIAL = re.compile(
    r"<\|[^|<>\s]{1,64}\|>|</?s>|<unk>|<pad>|<mask>|\[/?INST\]|<</?SYS>>|<(?:start|end)_of_turn>|<\|?(?:bos|eos)\|?>|<think>|</think>",
    re.I,
)


def strip_controls(text: str, one_line: bool = True) -> str:
    """`text` without escape sequences and control characters; with `one_line`, line breaks
    and tabs become spaces (a skill is one line), else they are kept."""
    text = _ESCAPES.sub("", text)
    if one_line:
        text = text.translate(_WHITESPACE_CONTROLS)
        return _CONTROLS.sub("", text)
    return re.sub("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\u200b-\u200f\u202a-\u202e\u2066-\u2069\ufeff]", "", text)


def has_special_token(text: str, extra: Iterable[str] = ()) -> bool:
    """Whether `text` holds a chat special token (the generic patterns, or one of `extra`)."""
    return bool(_SPECIAL.search(text)) or any(t and t in text for t in extra)


def _defuse(token: str) -> str:
    inner = token.strip("<>|[]/ ")
    return f"({inner})" if inner else "()"


def escape_special_tokens(text: str, extra: Iterable[str] = ()) -> str:
    """Each special token in `text` replaced by its bare name in parentheses, which no
    tokenizer reads as a special token: ``<|im_end|>`` -> ``(im_end)``, ``</s>`` -> ``(s)``."""
    for token in sorted((t for t in extra if t), key=len, reverse=True):
        text = text.replace(token, _defuse(token))
    return _SPECIAL.sub(lambda m: _defuse(m.group(0)), text)


def sanitize(text: str, extra: Iterable[str] = (), one_line: bool = True) -> str:
    """Controls and escapes removed, special tokens defused, whitespace collapsed (one line)."""
    text = escape_special_tokens(strip_controls(text, one_line), extra)
    return " ".join(text.split()) if one_line else text
