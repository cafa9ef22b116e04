"""Curating the skill library (SkillOS-like rules): reject, merge, retire.

A 135M policy writing skills from its own episodes mostly restates one action of the
episode ("take makeup kit") or writes fragments ("and nothing else"); a library of those
teaches nothing and crowds out the rules that would (docs/rsipo.md). The curator
applies three tested rules, each a pure function of texts and library rows:

reject   before replay, a candidate that is a single action of its source episode
         (`single_action`) or junk the parser lets through (`junk_reason`): a fragment
         that starts with a conjunction, or fewer than MIN_CONTENT_WORDS content words.
         The recipe counts it as invalid, so the writer's tokens get the invalid reward.
merge    at admission, a candidate whose token set overlaps an active skill's by Jaccard
         similarity >= threshold (`near_duplicate`) is a near-duplicate: it replaces that
         skill as its next version when its replay reward is higher, else it is dropped.
retire   each step, an active skill whose measured utility is <= 0 is removed
         (`retire_reason`).  Utility is the skill's own teacher agreement, 2 a/n - 1 over
         its decayed agreement counts (a agreements in n trials, the trust of the skill
         before shrinkage), once n >= min_trials; before that, once the skill is
         `grace_steps` old, its replay reward at admission.  A skill younger than that
         with too few trials is kept: there is no measurement yet.

`rule_form` says whether a rule reads "when ..., do ..., not ..." (contrastive writing
asks for that form; it is logged, never enforced).
"""

from __future__ import annotations

import re
from typing import Iterable, Sequence

from recursa.skills.library import Skill
from recursa.skills.retrieval import tokenize

__all__ = ["FILLERS", "MIN_CONTENT_WORDS", "action_words", "single_action", "junk_reason", "similarity", "near_duplicate", "utility",
           "retire_reason", "rule_form"]

# words that do not change which action a rule names ("Always take the key first.")
FILLERS = frozenset("always first then just simply you should must to please the a an now next finally".split())
FRAGMENT_STARTS = frozenset("and or but nor nothing else etc also".split())
MIN_CONTENT_WORDS = 2
_WORD_RE = re.compile(r"[a-z0-9']+")


def action_words(text: str) -> tuple[str, ...]:
    """The words of an action or rule, lowercased, punctuation and FILLERS dropped."""
    return tuple(w for w in _WORD_RE.findall(text.lower()) if w not in FILLERS)


def single_action(text: str, actions: Iterable[str]) -> bool:
    """True when the rule says no more than one of `actions` (the source episode's actions
    taken and admissible, or a single-turn reply): the same words once FILLERS are dropped."""
    words = action_words(text)
    return bool(words) and any(words == action_words(a) for a in actions if a)


def junk_reason(text: str) -> str | None:
    """Why a parsed rule is junk the parser let through, or None: "fragment" (starts with
    a conjunction or "nothing"/"else"), "no_content" (fewer than MIN_CONTENT_WORDS words
    outside the retrieval stopwords and FILLERS)."""
    words = _WORD_RE.findall(text.lower())
    if not words:
        return "no_content"
    if words[0] in FRAGMENT_STARTS:
        return "fragment"
    if len([w for w in tokenize(text) if w not in FILLERS]) < MIN_CONTENT_WORDS:
        return "no_content"
    return None


def similarity(a: str, b: str) -> float:
    """Jaccard similarity of the two texts' retrieval token sets (0 when both are empty)."""
    x, y = set(tokenize(a)), set(tokenize(b))
    return len(x & y) / len(x | y) if x | y else 0.0


def near_duplicate(text: str, skills: Sequence[Skill], threshold: float) -> Skill | None:
    """The most similar of `skills` with similarity >= threshold (the oldest on a tie), or None."""
    if not 0 < threshold <= 1:
        raise ValueError(f"threshold must lie in (0, 1], got {threshold}")
    best, best_sim = None, -1.0
    for s in skills:
        sim = similarity(text, s.text)
        if sim >= threshold and sim > best_sim:
            best, best_sim = s, sim
    return best


def utility(skill: Skill, step: int, min_trials: float, grace_steps: int) -> float | None:
    """The skill's measured utility at `step` (see the module doc), or None when unmeasured."""
    if skill.trust_trials >= min_trials and skill.trust_trials > 0:
        return 2.0 * skill.trust_successes / skill.trust_trials - 1.0
    age = step - (skill.created_step if skill.created_step is not None else step)
    if age >= grace_steps and skill.replay_reward is not None:
        return float(skill.replay_reward)
    return None


def retire_reason(skill: Skill, step: int, min_trials: float, grace_steps: int) -> str | None:
    """"agreement" or "replay" when the skill's utility (measured that way) is <= 0, else None."""
    u = utility(skill, step, min_trials, grace_steps)
    if u is None or u > 0:
        return None
    return "agreement" if skill.trust_trials >= min_trials and skill.trust_trials > 0 else "replay"


def rule_form(text: str) -> bool:
    """The rule reads "when/if ..., ... not/never/instead/avoid ..." (a contrastive rule)."""
    words = _WORD_RE.findall(text.lower())
    return bool(words) and words[0] in ("when", "if") and any(w in ("not", "never", "instead", "avoid", "don't", "dont") for w in words[1:])
