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

from typing import Iterable, Iterator, Protocol, runtime_checkable

import torch

from recursa.generation import GenerationStats, Sample, SamplingParams, generate
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
    """recursa's own sampler on the trainer's module: the weights are shared, never copied."""

    name = "native"

    def __init__(self, policy: Policy):
        self.policy = policy

    def generate(self, prompts, params, n=1, generator=None, stats=None) -> list[Sample]:
        return generate(self.policy.causal_lm, self.policy.tokenizer, prompts, params, n=n, generator=generator, stats=stats)

    def load_weights(self, policy: Policy) -> None:
        if policy is not self.policy:  # a recipe swaps policies only by loading weights into the same one
            self.policy = policy

    def close(self) -> None:
        pass


def make_engine(cfg_rollout, policy: Policy) -> RolloutEngine:
    """The engine `cfg_rollout.engine` names (a `RolloutConfig`), holding `policy`'s current weights."""
    if cfg_rollout.engine == "native":
        return NativeEngine(policy)
    if cfg_rollout.engine == "vllm":
        from recursa.engines.vllm_engine import VLLMEngine

        return VLLMEngine(policy, cfg_rollout.vllm)
    raise ValueError(f"unknown rollout engine {cfg_rollout.engine!r}: choose 'native' or 'vllm'")


# ------------------------------------------------------------------------------ weights


def hf_named_weights(policy: Policy) -> Iterator[tuple[str, torch.Tensor]]:
    """The policy's weights under the names of its plain Hugging Face checkpoint
    (`model.layers.0.self_attn.q_proj.weight`, ...), detached, as an engine loads them.

    Under LoRA, each adapted layer yields its merged weight W + scale * B @ A (computed
    here, one layer at a time; the trainer's module is not modified) and the adapter tensors
    themselves are not yielded. A tied output projection is yielded once, as the input
    embedding (`named_parameters` drops the alias)."""
    model = policy.causal_lm
    if not policy.is_lora:
        for name, param in model.named_parameters():
            yield name, param.detach()
        return
    from peft.tuners.lora import LoraLayer

    adapted = {name: module for name, module in model.named_modules() if isinstance(module, LoraLayer)}
    for name, param in model.named_parameters():
        owner = next((m for m in adapted if name.startswith(m + ".")), None)
        if owner is None:
            yield name, param.detach()
            continue
        rest = name[len(owner) + 1 :]
        if rest == "base_layer.weight":
            yield f"{owner}.weight", _merged_weight(adapted[owner])
        elif rest.startswith("base_layer."):  # e.g. a bias of the adapted layer
            yield f"{owner}.{rest[len('base_layer.'):]}", param.detach()
        # lora_A / lora_B / ... : folded into the merged weight


@torch.no_grad()
def _merged_weight(layer) -> torch.Tensor:
    """W + sum over the active, unmerged adapters of their delta (peft's own `get_delta_weight`)."""
    weight = layer.get_base_layer().weight.detach()
    if getattr(layer, "merged", False):  # adapters already folded into W
        return weight
    merged = weight.clone()
    for adapter in layer.active_adapters:
        if adapter in layer.lora_A:
            merged += layer.get_delta_weight(adapter).to(merged.dtype)
    return merged


def weight_buckets(named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group (name, tensor) pairs, in order, into lists of at most `bucket_bytes` bytes; a
    tensor larger than that is a bucket of its own."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


__all__ = ["RolloutEngine", "NativeEngine", "make_engine", "hf_named_weights", "weight_buckets"]
