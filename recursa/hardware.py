"""What the machine can do fast, for the settings left at 'auto'.

`native_bf16` says whether bfloat16 matrix products run in hardware on the device a run
trains on: a CUDA GPU that supports bfloat16, or an x86 CPU with AVX512-BF16 or AMX-BF16.
On a CPU without them (AVX2 only) torch converts every bfloat16 product to float32 and back,
and a bfloat16 matmul ran about 100x slower than the float32 one on this project's 2-core AVX2
machine (`docs/engines.md`), so `rollout.decode_dtype = "auto"` samples with a bfloat16 copy
only where this returns True. `$RECURSA_NATIVE_BF16` (1 or 0) overrides the detection; the test
suite pins it to 1 so that its recorded outputs do not depend on the host's CPU."""

from __future__ import annotations

import functools
import os
from pathlib import Path

import torch

from recursa.errors import UserError

DEVICE_ENV = "RECURSA_DEVICE"
NATIVE_BF16_ENV = "RECURSA_NATIVE_BF16"
CPU_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})  # /proc/cpuinfo flags of hardware bfloat16 dot products


def default_device() -> str:
    """The device 'auto' means: $RECURSA_DEVICE when set, else 'cuda' when torch sees a GPU, else 'cpu'."""
    return os.environ.get(DEVICE_ENV) or ("cuda" if torch.cuda.is_available() else "cpu")


def cpu_flags(cpuinfo: str) -> set[str]:
    """The feature flags of the first processor in a /proc/cpuinfo text (empty when it has none)."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return set(value.split())
    return set()


@functools.cache
def _cpu_has_bf16() -> bool:
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:  # not Linux: no detection, the safe answer
        return False
    return bool(cpu_flags(text) & CPU_BF16_FLAGS)


def native_bf16(device: str = "auto") -> bool:
    """Whether bfloat16 matmuls run in hardware on `device` ('auto', 'cpu', 'cuda', 'cuda:N')."""
    pinned = os.environ.get(NATIVE_BF16_ENV)
    if pinned is not None and pinned != "":
        if pinned not in ("0", "1"):
            raise UserError(f"${NATIVE_BF16_ENV} = {pinned!r}: use 1 (bfloat16 is fast here) or 0 (it is not)")
        return pinned == "1"
    kind = (default_device() if device == "auto" else device).split(":")[0]
    if kind == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    return _cpu_has_bf16()
