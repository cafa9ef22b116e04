"""Reward functions of the byo-tasks package: fn(prompts, completions, **item_fields) -> list[float | None]."""


def brevity(prompts, completions, **fields):
    """1 for an empty reply, falling to 0 at 40 characters."""
    return [max(0.0, 1.0 - len(c) / 40) for c in completions]


def digits_only(prompts, completions, answer, **fields):
    """1 when the reply is only digits; None (does not apply) when the item has no numeric answer."""
    return [None if not str(a).isdigit() else float(c.strip().isdigit()) for a, c in zip(answer, completions)]


def broken(prompts, completions, **fields):
    raise RuntimeError("this reward is broken")


def one_short(prompts, completions, **fields):
    return [0.0] * (len(completions) - 1)


def says_yes(prompts, completions, **fields):
    return ["yes" for _ in completions]
