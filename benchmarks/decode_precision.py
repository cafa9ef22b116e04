"""How far a low-precision decoding copy's policy is from the float32 trainer's, layer by layer.

    python benchmarks/decode_precision.py                       # embedded SmolLM2-135M, a few seconds per variant
    python benchmarks/decode_precision.py --model tiny-random   # checks the script

`rollout.decode_dtype` samples with a bfloat16 copy of the weights or with int8 dynamically
quantised linear layers (`recursa.engines.low_precision_copy`), while the trainer keeps float32.
This script scores fixed texts (the demo task's prompts with answers, and household
observations with actions: the two prompt styles the project trains on) with the float32 model
and with each variant, and reports, over every token position:

* KL(p_fp32 || p_variant) of the next-token distributions, in nats per position;
* mean |log p_fp32(x_t) - log p_variant(x_t)| of the tokens actually in the text, the quantity
  training logs as `rollout/logprob_mismatch` (there over sampled tokens).

Variants: bfloat16 and int8 as `decode_dtype` builds them, then int8 applied to one kind of
linear layer at a time (q/k/v/o projections, gate/up/down of the MLP), which shows where the
error comes from. Writes decode_precision.json and .md to --out (default benchmarks/results/).
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import sys
import warnings
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

TEXTS = [
    "What is 7 + 5? Reply with the number only.\n12",
    "What is 3 + 9? Reply with the number only.\n12",
    "What is 8 + 6? Reply with the number only.\n14",
    "You are in the middle of the kitchen. Looking around, you see a cabinet 1, a countertop 1, a fridge 1, "
    "a microwave 1, a sink 1, and a stove 1.\n\nYour task is to: put a cool bottle on the countertop.\n"
    "Admissible actions: go to cabinet 1, go to countertop 1, go to fridge 1, go to microwave 1, go to sink 1, go to stove 1\n"
    "go to cabinet 1",
    "You arrive at the fridge 1. The fridge 1 is closed. You are carrying a bottle 1.\n"
    "Admissible actions: cool bottle 1 with fridge 1, open fridge 1, go to countertop 1, inventory, look\n"
    "cool bottle 1 with fridge 1",
]
LAYER_KINDS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def gap(ref_logp: torch.Tensor, model: torch.nn.Module, batch: dict) -> dict:
    """KL per position and mean |delta log p| of the text's tokens, `model` against `ref_logp`."""
    with torch.no_grad():
        logp = torch.log_softmax(model(**batch).logits.float(), dim=-1)
    mask = batch["attention_mask"].bool()
    kl = (ref_logp.exp() * (ref_logp - logp)).sum(-1)[mask]
    target = batch["input_ids"][:, 1:, None]
    a = ref_logp[:, :-1].gather(-1, target)[..., 0]
    b = logp[:, :-1].gather(-1, target)[..., 0]
    m = batch["attention_mask"][:, 1:].bool() & mask[:, :-1]
    return {"kl_mean": float(kl.mean()), "kl_max": float(kl.max()), "abs_dlogp_mean": float((a - b).abs()[m].mean()), "positions": int(mask.sum())}


def int8_only(model: torch.nn.Module, kind: str) -> torch.nn.Module:
    """A copy of `model` with int8 dynamic quantisation of the linear layers named `*kind` only."""
    from torch.ao.quantization import default_dynamic_qconfig, quantize_dynamic

    spec = {n: default_dynamic_qconfig for n, mod in model.named_modules() if isinstance(mod, torch.nn.Linear) and n.endswith(kind)}
    return quantize_dynamic(copy.deepcopy(model), spec, dtype=torch.qint8)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    warnings.filterwarnings("ignore", message=".*torch.ao.quantization.*")
    from recursa.config import ModelConfig
    from recursa.engines import low_precision_copy
    from recursa.models import load_policy

    policy = load_policy(ModelConfig(name=a.model))
    model = policy.causal_lm.eval()
    batch = dict(policy.tokenizer(TEXTS, return_tensors="pt", padding=True))
    with torch.no_grad():
        ref = torch.log_softmax(model(**batch).logits.float(), dim=-1)
    rows = {}
    for dtype in ("bfloat16", "int8"):
        rows[f"decode_dtype = {dtype}"] = gap(ref, low_precision_copy(policy, dtype), batch)
    for kind in LAYER_KINDS:
        if any(n.endswith(kind) for n, _ in model.named_modules()):
            rows[f"int8 on {kind} only"] = gap(ref, int8_only(model, kind), batch)
    result = {"model": a.model, "torch": torch.__version__, "machine": platform.machine(), "texts": TEXTS, "rows": rows}
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "decode_precision.json").write_text(json.dumps(result, indent=1) + "\n")
    lines = [
        f"# Low-precision decoding copies against float32 (`{a.model}`)",
        "",
        f"torch {torch.__version__}; {len(TEXTS)} texts (demo prompts with answers, household observations with actions), "
        f"{next(iter(rows.values()))['positions']} token positions. Produced by `python benchmarks/decode_precision.py`.",
        "",
        "| variant | KL(fp32 \\|\\| variant) per position, mean | max | mean \\|delta log p\\| of the text's tokens |",
        "|---|---:|---:|---:|",
    ]
    lines += [f"| {k} | {v['kl_mean']:.4f} | {v['kl_max']:.3f} | {v['abs_dlogp_mean']:.4f} |" for k, v in rows.items()]
    (a.out / "decode_precision.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
