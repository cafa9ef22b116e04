"""bf16 autocast and activation checkpointing on the embedded 135M model (issue 47).

On one fixed batch (seeded token ids, a 16-token prompt and `--tokens` action tokens per row):

* the log-prob gap bf16 vs fp32: |logp_bf16 - logp_fp32| over the action tokens (mean, max),
  and the gap of the per-row summed log-prob (what a sequence ratio reads);
* the cost of each setting of one forward + backward of the learner's loss (fp32, bf16,
  fp32 + checkpointing, bf16 + checkpointing): seconds (median of --repeats) and the peak
  resident memory the step adds over the loaded model, each setting in a fresh process
  (ru_maxrss only grows), reported as ratios to fp32.

    .venv/bin/python benchmarks/precision.py --out benchmarks/results/precision.json
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import statistics
import subprocess
import sys
import time

import torch

SETTINGS = {"fp32": ("fp32", False), "bf16": ("bf16", False), "fp32+ckpt": ("fp32", True), "bf16+ckpt": ("bf16", True)}


def fixed_batch(vocab: int, rows: int, tokens: int, prompt: int = 16, device: str = "cpu"):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(100, vocab - 100, (rows, prompt + tokens), generator=g)
    attn = torch.ones_like(ids)
    act = torch.zeros_like(ids)
    act[:, prompt:] = 1
    return ids.to(device), attn.to(device), act.to(device)


def _train(precision: str, checkpointing: bool):
    from types import SimpleNamespace

    return SimpleNamespace(precision=precision, activation_checkpointing=checkpointing)


def load(model: str, threads: int, device: str = "cpu"):
    from recursa.config import ModelConfig
    from recursa.models import load_policy

    torch.set_num_threads(threads)
    return load_policy(ModelConfig(name=model, device=device))


def gap(args) -> dict:
    from recursa.distributed.precision import learner_forward
    from recursa.generation import sequence_logprobs

    policy = load(args.model, args.threads, args.device)
    ids, attn, act = fixed_batch(len(policy.tokenizer), args.rows, args.tokens, device=args.device)
    with torch.no_grad():
        out = {p: learner_forward(sequence_logprobs, _train(p, False))(policy.causal_lm, ids, attn, act)[0] for p in ("fp32", "bf16")}
    mask = act.bool()
    d = (out["bf16"] - out["fp32"])[mask].abs()
    seq = ((out["bf16"] - out["fp32"]) * act).sum(dim=1).abs()
    return {"token_abs_gap_mean": d.mean().item(), "token_abs_gap_max": d.max().item(), "seq_abs_gap_mean": seq.mean().item(),
            "seq_abs_gap_max": seq.max().item(), "fp32_token_logp_mean": out["fp32"][mask].mean().item(), "tokens": int(mask.sum())}


def cost(args) -> dict:
    """One setting, in this process: seconds per forward + backward and the peak RSS it adds."""
    from recursa.distributed.precision import learner_forward
    from recursa.generation import sequence_logprobs

    precision, ckpt = SETTINGS[args.setting]
    policy = load(args.model, args.threads, args.device)
    model = policy.causal_lm
    model.train()
    ids, attn, act = fixed_batch(len(policy.tokenizer), args.rows, args.tokens, device=args.device)
    cuda = args.device.startswith("cuda")
    fn = learner_forward(sequence_logprobs, _train(precision, ckpt))
    for p in model.parameters():  # the gradient buffers exist before the baseline, as in a run after its first step
        p.grad = torch.zeros_like(p)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.max_memory_allocated() / 1024 if cuda else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB
    times = []
    for _ in range(args.repeats):
        t = time.perf_counter()
        logp, _ = fn(model, ids, attn, act, 1.0, 512)
        (-(logp * act).sum() / act.sum()).backward()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    peak = torch.cuda.max_memory_allocated() / 1024 if cuda else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"s_per_step": statistics.median(times), "peak_rss_added_mib": (peak - base) / 1024}  # on cuda: peak allocated GPU memory


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=112, help="action tokens per row")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None)
    ap.add_argument("--device", default="cpu", help="cpu or cuda (on cuda the memory figure is torch's peak allocated GPU memory)")
    ap.add_argument("--setting", choices=list(SETTINGS), help=argparse.SUPPRESS)  # internal: one cost measurement
    args = ap.parse_args()
    if args.setting:
        print(json.dumps(cost(args)))
        return
    result = {"model": args.model, "rows": args.rows, "prompt_tokens": 16, "action_tokens": args.tokens, "threads": args.threads,
              "repeats": args.repeats, "device": args.device, "torch": torch.__version__, "machine": platform.processor() or platform.machine(), "gap": gap(args), "cost": {}}
    for name in SETTINGS:
        cmd = [sys.executable, __file__, "--setting", name, "--model", args.model, "--rows", str(args.rows), "--tokens", str(args.tokens),
               "--repeats", str(args.repeats), "--threads", str(args.threads), "--device", args.device]
        print(f"measuring {name}", file=sys.stderr, flush=True)
        result["cost"][name] = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1])
    ref = result["cost"]["fp32"]
    result["ratios_to_fp32"] = {n: {"time": c["s_per_step"] / ref["s_per_step"], "peak_rss_added": c["peak_rss_added_mib"] / ref["peak_rss_added_mib"]}
                                for n, c in result["cost"].items()}
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
