"""The learner's forward: bf16 autocast over fp32 master weights, and activation checkpointing.

Two switches of every recipe's optimizer settings (`train.precision`, `train.activation_checkpointing`),
both off by default, where a run is exactly what it was without them:

* `precision = "bf16"`: every forward the update runs (the old and reference log-probs, the
  training forward, the supervised step's) runs under `torch.autocast(device, bfloat16)`. The
  parameters, their gradients and AdamW's state stay float32 (the *master weights*): autocast
  casts a weight to bfloat16 for each matmul and the backward returns float32 gradients to the
  float32 parameters. Log-softmax and everything after it (the ratio, the loss) stay float32:
  `generation._project` casts the logits up before the softmax. The log-probs themselves move by
  bfloat16's rounding of the hidden states and logits (benchmarks/precision.py measures the gap
  on the embedded model); old and new log-probs are computed the same way, so the ratio of an
  unchanged policy is still 1. The rollout's sampler is not affected: its log-probs differ from
  the trainer's by the mismatch `rollout/logprob_mismatch` reports and `rollout.tis_cap` corrects.
* `activation_checkpointing = true`: each decoder layer keeps only its input for the backward and
  recomputes the rest then (transformers' gradient checkpointing, non-reentrant), trading about
  one more forward for the activation memory of all but one layer. Same gradients up to float
  rounding. Transformers drops the KV cache of a checkpointed layer, which the shared-prefix
  forward needs, so the config asks for `train.shared_prefix = false` with it.

`learner_forward(fn, train)` wraps a log-prob function of `recursa.generation` with both; the
update and the supervised step call their log-prob function through it.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Callable

import torch

PRECISIONS = ("fp32", "bf16")


def autocast(precision: str, device: torch.device | str):
    """The context a learner forward runs in: bf16 autocast on `device`'s type, or nothing (fp32)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if precision == "fp32":
        return contextlib.nullcontext()
    device_type = torch.device(device).type
    return torch.autocast(device_type=device_type, dtype=torch.bfloat16)


def set_checkpointing(causal_lm: torch.nn.Module, on: bool) -> None:
    """Turn transformers' activation checkpointing of `causal_lm`'s layers on or off (non-reentrant,
    so frozen inputs and LoRA need no extra hooks). It acts only in training mode with gradients on:
    a scoring pass under no_grad and the sampler run the layers as they are."""
    new = hasattr(causal_lm, "activation_checkpointing_enable")  # the name since transformers 5.2x; gradient_checkpointing_* before
    if bool(getattr(causal_lm, "is_activation_checkpointing" if new else "is_gradient_checkpointing", False)) == on:
        return
    if on and new:
        causal_lm.activation_checkpointing_enable({"use_reentrant": False})
    elif on:
        causal_lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        (causal_lm.activation_checkpointing_disable if new else causal_lm.gradient_checkpointing_disable)()


def learner_forward(fn: Callable, train) -> Callable:
    """`fn` (a log-prob function taking the causal LM first) run with `train`'s precision and
    activation checkpointing; `fn` itself when both are off, so a default run is unchanged."""
    precision = getattr(train, "precision", "fp32")
    checkpointing = bool(getattr(train, "activation_checkpointing", False))
    if precision == "fp32" and not checkpointing:
        return fn

    @functools.wraps(fn)
    def run(causal_lm, *args, **kwargs):
        set_checkpointing(causal_lm, checkpointing)
        with autocast(precision, next(causal_lm.parameters()).device):
            return fn(causal_lm, *args, **kwargs)

    return run
