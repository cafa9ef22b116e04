"""recursa.hardware: which devices multiply bfloat16 in hardware, and what
`rollout.decode_dtype = "auto"` makes of it."""

from __future__ import annotations

import pytest

from recursa import hardware
from recursa.config import TIS_CAP_AUTO, load_config, resolve_auto
from recursa.errors import UserError

AVX2_ONLY = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC
flags\t\t: fpu vme sse sse2 avx avx2 fma bmi2
processor\t: 1
flags\t\t: fpu vme sse sse2 avx avx2 fma bmi2 avx512_bf16
"""
SAPPHIRE = "processor\t: 0\nflags\t\t: avx2 avx512f avx512_bf16 amx_bf16 amx_tile\n"


def test_cpu_flags_reads_the_first_processors_line():
    assert hardware.cpu_flags(AVX2_ONLY) == {"fpu", "vme", "sse", "sse2", "avx", "avx2", "fma", "bmi2"}
    assert hardware.cpu_flags(SAPPHIRE) & hardware.CPU_BF16_FLAGS == {"avx512_bf16", "amx_bf16"}
    assert hardware.cpu_flags("processor : 0\n") == set()
    assert hardware.cpu_flags("Features\t: fp asimd bf16\n") == {"fp", "asimd", "bf16"}  # arm's key; its bf16 is not an x86 flag we count


def test_the_environment_pins_the_answer_and_a_bad_value_is_one_line(monkeypatch):
    monkeypatch.setenv(hardware.NATIVE_BF16_ENV, "0")
    assert hardware.native_bf16("cpu") is False and hardware.native_bf16("auto") is False
    monkeypatch.setenv(hardware.NATIVE_BF16_ENV, "1")
    assert hardware.native_bf16("cpu") is True
    monkeypatch.setenv(hardware.NATIVE_BF16_ENV, "yes")
    with pytest.raises(UserError, match="use 1"):
        hardware.native_bf16("cpu")


def test_detection_follows_the_cpu_flags(monkeypatch):
    monkeypatch.delenv(hardware.NATIVE_BF16_ENV, raising=False)
    for text, want in ((AVX2_ONLY, False), (SAPPHIRE, True)):
        hardware._cpu_has_bf16.cache_clear()
        monkeypatch.setattr(hardware.Path, "read_text", lambda self, errors=None, text=text: text)
        assert hardware.native_bf16("cpu") is want
    hardware._cpu_has_bf16.cache_clear()

    def unreadable(self, errors=None):
        raise OSError("no /proc")

    monkeypatch.setattr(hardware.Path, "read_text", unreadable)
    assert hardware.native_bf16("cpu") is False
    hardware._cpu_has_bf16.cache_clear()


def test_auto_decode_dtype_samples_in_float32_without_hardware_bfloat16(monkeypatch):
    """A game on the native engine: the bfloat16 copy and TIS at 2.0 where bfloat16 is native,
    the trainer's own float32 weights and no TIS where it is not; a single-turn task never
    takes the copy."""
    sets = ["model.name=tiny-random", "env.name=toy-corridor"]
    for pinned, want in (("1", ("bfloat16", TIS_CAP_AUTO)), ("0", ("model", None))):
        monkeypatch.setenv(hardware.NATIVE_BF16_ENV, pinned)
        cfg = load_config(None, sets)
        resolve_auto(cfg, multi_turn=True)
        assert (cfg.rollout.decode_dtype, cfg.rollout.tis_cap) == want
        single = load_config(None, ["model.name=tiny-random", "env.name=arithmetic"])
        resolve_auto(single, multi_turn=False)
        assert (single.rollout.decode_dtype, single.rollout.tis_cap) == ("model", None)
    explicit = load_config(None, [*sets, 'rollout.decode_dtype="bfloat16"'])  # an explicit choice is kept on any machine
    resolve_auto(explicit, multi_turn=True)
    assert explicit.rollout.decode_dtype == "bfloat16"
