"""Rollout engines: what samples completions for rollouts and evaluations.

An engine takes prompts as token ids and returns the sampled ids with their log-probabilities
(`recursa.generation.Sample`), token-in / token-out, so the trainer scores exactly what was
sampled. Two engines:

* `NativeEngine` (`rollout.engine = "native"`, the default): recursa's own batched sampler
  (`recursa.generation.generate`) run on the trainer's module itself, so it always has the
  current weights and `load_weights` has nothing to do.
* `VLLMEngine` (`rollout.engine = "vllm"`, `recursa/engines/vllm_engine.py`): an in-process
  `vllm.LLM` holding its own copy of the weights; `load_weights(policy)` publishes the
  trainer's weights to it in bounded-size buckets, without writing them to disk.

Recipes build one engine per run (`make_engine(cfg.rollout, policy)`) and call
`engine.load_weights(policy)` whenever the trainer's weights change (after each update, after
a gate rollback). Whatever the engine, the trainer recomputes the log-probs it trains with;
the engine's log-probs feed `rollout/logprob_mismatch` and the optional truncated
importance-sampling correction (`rollout.tis_cap`).
"""

from __future__ import annotations

import copy
from typing import Protocol, runtime_checkable

import torch

from recursa.generation import GenerationStats, Sample, SamplingParams, generate
from recursa.engines.weights import hf_named_weights, weight_buckets  # noqa: F401  (re-exported)
from recursa.models import Policy


@runtime_checkable
class RolloutEngine(Protocol):
    """Samples completions of tokenized prompts with some version of the policy's weights."""

    name: str

    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        n: int = 1,
        generator: torch.Generator | None = None,
        stats: GenerationStats | None = None,
    ) -> list[Sample]:
        """`n` completions per prompt, grouped by prompt (sample k of prompt i at index i * n + k)."""
        ...

    def load_weights(self, policy: Policy) -> None:
        """Publish the trainer's current weights to the engine (bounded buckets)."""
        ...

    def close(self) -> None:
        """Release what the engine holds (memory, worker state)."""
        ...


class NativeEngine:
    """recursa's own sampler on the trainer's module: the weights are shared, never copied.

    Options (all off in the constructor, which is the sampler exactly as before they existed;
    `make_engine` turns `continuous` on by default, `rollout.continuous = "auto"`):

    * `decode_dtype = "bfloat16"` or `"int8"`: sample with a copy of the weights in bfloat16,
      or with dynamically quantised int8 linear layers (`torch.ao.quantization.quantize_dynamic`,
      CPU); `load_weights` refreshes the copy from the trainer's weights. The trainer keeps its
      own dtype and recomputes the log-probs it trains with.
    * `continuous = True`: multi-turn rollouts use `batcher()` (continuous batching with
      prompt-prefix reuse, `recursa.engines.continuous`) instead of one `generate` per turn,
      with at most `max_rows` rows and `prefix_cache_mb` MiB of reusable prompt keys/values.
    """

    name = "native"

    def __init__(self, policy: Policy, decode_dtype: str = "model", continuous: bool = False, max_rows: int = 32, prefix_cache_mb: int = 256,
                 prefill_rows: int | None = None):
        if decode_dtype not in ("model", "bfloat16", "int8"):
            raise ValueError(f"decode_dtype must be 'model', 'bfloat16' or 'int8', got {decode_dtype!r}")
        self.policy = policy
        self.decode_dtype, self.continuous, self.max_rows, self.prefix_cache_mb = decode_dtype, continuous, max_rows, prefix_cache_mb
        self.prefill_rows = prefill_rows  # the batcher's prompts per prefill forward (None: max_rows; 1: one at a time)
        self._copy = low_precision_copy(policy, decode_dtype) if decode_dtype != "model" else None

    @property
    def module(self) -> torch.nn.Module:
        """The causal LM that samples: the trainer's own, or the low-precision copy."""
        return self._copy if self._copy is not None else self.policy.causal_lm

    def generate(self, prompts, params, n=1, generator=None, stats=None) -> list[Sample]:
        return generate(self.module, self.policy.tokenizer, prompts, params, n=n, generator=generator, stats=stats)

    def batcher(self, params: SamplingParams, stats: GenerationStats | None = None, times=None):
        """A `ContinuousBatcher` on the sampling module (used by `rollout_episodes` when `continuous`)."""
        from recursa.engines.continuous import ContinuousBatcher

        return ContinuousBatcher(self.module, self.policy.tokenizer, params, max_rows=self.max_rows,
                                 prefix_cache_bytes=self.prefix_cache_mb << 20, stats=stats, times=times, prefill_rows=self.prefill_rows)

    def load_weights(self, policy: Policy) -> None:
        if policy is not self.policy:  # a recipe swaps policies only by loading weights into the same one
            self.policy = policy
        if self._copy is not None:
            self._copy = low_precision_copy(policy, self.decode_dtype, into=self._copy)

    def close(self) -> None:
        self._copy = None


def low_precision_copy(policy: Policy, decode_dtype: str, into: torch.nn.Module | None = None) -> torch.nn.Module:
    """A sampling copy of the policy's causal LM (LoRA adapters merged): bfloat16 weights, or
    float32 weights with int8 dynamically quantised linear layers. `into`: an earlier bfloat16
    copy, refreshed in place (an int8 copy is rebuilt: its packed weights are not writable)."""
    src = policy.causal_lm
    if decode_dtype == "bfloat16" and into is not None:
        params = dict(into.named_parameters())
        with torch.no_grad():
            for name, tensor in hf_named_weights(policy):
                params[name].copy_(tensor)
        return into
    from transformers import AutoModelForCausalLM

    dtype = torch.bfloat16 if decode_dtype == "bfloat16" else torch.float32
    # built on the policy's device (not torch's default one, which a caller may have set) and
    # without touching torch's global random state (the initialisation is thrown away)
    with torch.random.fork_rng(devices=[]), torch.device(policy.device):
        model = AutoModelForCausalLM.from_config(copy.deepcopy(src.config), torch_dtype=dtype, attn_implementation=src.config._attn_implementation)
    missing, unexpected = model.load_state_dict(dict(hf_named_weights(policy)), strict=False)
    tied = {"lm_head.weight"} if getattr(model.config, "tie_word_embeddings", False) else set()
    if unexpected or set(missing) - tied:
        raise RuntimeError(f"low-precision copy: weights do not match the model ({sorted(unexpected)[:3]} unexpected, {sorted(set(missing) - tied)[:3]} missing)")
    model.generation_config = copy.deepcopy(getattr(src, "generation_config", model.generation_config))
    model.to(policy.device).eval().requires_grad_(False)
    if decode_dtype == "int8":
        if policy.device.type != "cpu":
            raise ValueError("rollout.decode_dtype = 'int8' quantises for the CPU: use 'bfloat16' on a GPU")
        from torch.ao.quantization import quantize_dynamic

        model = quantize_dynamic(model, {torch.nn.Linear}, dtype=torch.qint8)
    return model


def make_engine(cfg_rollout, policy: Policy) -> RolloutEngine:
    """The engine `cfg_rollout.engine` names (a `RolloutConfig`), holding `policy`'s current weights."""
    if cfg_rollout.engine == "native":
        decode = "model" if cfg_rollout.decode_dtype == "auto" else cfg_rollout.decode_dtype  # 'auto' not resolved for a task (config.resolve_auto): the trainer's weights
        return NativeEngine(policy, decode, cfg_rollout.continuous_on, cfg_rollout.max_rows, cfg_rollout.prefix_cache_mb)
    if cfg_rollout.engine == "vllm":
        from recursa.engines.vllm_engine import VLLMEngine

        return VLLMEngine(policy, cfg_rollout.vllm)
    raise ValueError(f"unknown rollout engine {cfg_rollout.engine!r}: choose 'native' or 'vllm'")


# ------------------------------------------------------------------------------ weights


__all__ = ["RolloutEngine", "NativeEngine", "make_engine", "hf_named_weights", "weight_buckets"]
