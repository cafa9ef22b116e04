"""The policy's weights as an engine loads them: Hugging Face parameter names (LoRA merged
into its base layers) and buckets of a bounded size, for publishing weights after an update
(the vLLM engine, `recursa.engines.vllm_engine`)."""

from __future__ import annotations

from typing import Iterable, Iterator

import torch

from recursa.models import Policy


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

