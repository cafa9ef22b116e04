"""Rollout seconds of the native sampler and the vLLM engine on the same batch.

    python benchmarks/engine_speed.py                                   # embedded SmolLM2-135M, CPU, setting agent (2 x 8 x 32)
    python benchmarks/engine_speed.py --setting short --repeats 5
    python benchmarks/engine_speed.py --model tiny-random --tiny-heads 2 --repeats 2     # quick look (vLLM's CPU attention needs head size >= 32)
    python benchmarks/engine_speed.py --device cuda --train-step        # GPU: also one GRPO update + weight publish per repeat
    python benchmarks/engine_speed.py --device cuda --model random-1b --engines vllm --train-step --dtype bfloat16

Each engine plays the same recursa rollouts (`recursa.rollout.rollout`: B prompts x G samples
of the setting, env scoring included; the settings are `vs_trl.py`'s) with the task seeds of
steps 0, 1, ..., `--repeats` times after one warm-up round; in every round the engines take
turns on the same rollout, so a change in the machine's load hits them alike. Reported per
engine: start seconds (vLLM: engine start plus the first weight publish), the warm-up rollout,
the median rollout, generated tokens per second, the weight publish (`load_weights`) seconds,
and the mean |logp_engine - logp_trainer| of the sampled tokens (the trainer's own scoring,
as `rollout/logprob_mismatch`). With `--train-step`, each engine's rollout is followed by one
GRPO `update()` and the publish of the new weights to every engine.

`random-1b` is a Llama of TinyLlama-1.1B's shape (22 layers, width 2048, 32 heads, 4 KV heads)
with random weights built from its config (nothing downloaded), with the embedded model's
tokenizer when it is installed, else the tiny one.

Needs the vLLM extra for `--engines vllm` (`make setup-vllm`, then run with .venv-vllm/bin/python).
Writes engine_speed.json and engine_speed.md to --out (default benchmarks/results/). The
numbers are wall-clock seconds on whatever else the machine is running: compare engines
within one invocation (the ratio), not across invocations.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import vs_trl  # noqa: E402  (settings and prompts)

from recursa.algorithms.advantages import compute_advantages  # noqa: E402
from recursa.config import ModelConfig, VLLMSettings  # noqa: E402
from recursa.engines import NativeEngine  # noqa: E402
from recursa.envs.base import EnvPool  # noqa: E402
from recursa.generation import SamplingParams, shared_prefix_logprobs  # noqa: E402
from recursa.models import Policy, load_policy  # noqa: E402
from recursa.recipes.common import make_optimizer, step_generator  # noqa: E402
from recursa.recipes.grpo import train_seeds, update  # noqa: E402
from recursa.rollout import rollout  # noqa: E402
from recursa.trajectory import collate  # noqa: E402


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def random_1b(dtype: torch.dtype, device: str) -> Policy:
    """A ~1.1B-parameter Llama with random weights (TinyLlama-1.1B's shape), built from a config."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from recursa.models import embedded_model_dir, resolve_device, tiny_tokenizer

    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(embedded_model_dir())
    except Exception:  # the embedded model is not installed here
        tokenizer = tiny_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
        num_key_value_heads=4, max_position_embeddings=2048, tie_word_embeddings=False, rms_norm_eps=1e-5,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    dev = resolve_device(device)
    torch.manual_seed(0)
    with torch.device(dev):
        model = LlamaForCausalLM(config).to(dtype)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return Policy(model=model, tokenizer=tokenizer, name="random-1b")


def trainer_mismatch(policy: Policy, trajectories, temperature: float) -> float:
    """Mean |logp_engine - logp_trainer| over the sampled tokens (the trainer's own scoring)."""
    batch = collate(trajectories, torch.zeros(len(trajectories)), policy.tokenizer.pad_token_id, policy.device)
    with torch.no_grad():
        logp, _ = shared_prefix_logprobs(policy.causal_lm, batch.input_ids, batch.attention_mask, batch.action_mask, temperature)
    mask = batch.action_mask
    return float(((logp - batch.sample_logprobs).abs() * mask).sum() / mask.sum().clamp_min(1))


def start_engine(name: str, policy: Policy, args):
    if name == "native":
        return NativeEngine(policy)
    from recursa.engines.vllm_engine import VLLMEngine

    return VLLMEngine(policy, VLLMSettings(gpu_memory_utilization=args.gpu_memory_utilization, enforce_eager=not args.compile))


def run(names: list[str], policy: Policy, cfg, spec: dict, args) -> dict:
    """Start every engine, then `repeats + 1` rounds (the first is the warm-up); in each round
    every engine plays the same rollout, one after the other, so that a change in the
    machine's load hits all engines alike. With --train-step, each engine's rollout is followed
    by one `update()` and the publish of the new weights."""
    envs = EnvPool(lambda: vs_trl.make_setting_env(spec))
    sampling = SamplingParams(spec["max_new_tokens"], cfg.sampling.temperature, cfg.sampling.top_p, ())
    optimizer = make_optimizer([p for p in policy.model.parameters() if p.requires_grad], cfg) if args.train_step else None
    B, G = spec["prompts_per_step"], spec["group_size"]
    recs: dict[str, dict] = {}
    engines = {}
    for name in names:
        t = time.perf_counter()
        engines[name] = start_engine(name, policy, args)  # vLLM: start + the first publish of the weights
        recs[name] = {"engine": name, "start_s": time.perf_counter() - t, "rollout_s": [], "gen_tokens": [], "mismatch": [], "update_s": [], "publish_s": []}
    for step in range(args.repeats + 1):
        for name, engine in engines.items():
            rec = recs[name]
            gen = step_generator(cfg.train.seed, step)
            _sync(policy.device)
            t = time.perf_counter()
            ro = rollout(policy, envs, train_seeds(cfg, step), G, sampling, gen, spec["system_prompt"], engine=engine)
            _sync(policy.device)
            rec["rollout_s"].append(time.perf_counter() - t)
            rec["gen_tokens"].append(ro.stats.generated_tokens)
            rec["mismatch"].append(trainer_mismatch(policy, ro.trajectories, cfg.sampling.temperature))
            if args.train_step:
                rewards = torch.tensor([tr.reward for tr in ro.trajectories], dtype=torch.float32).view(B, G)
                batch = collate(ro.trajectories, compute_advantages("grpo", rewards).view(-1), policy.tokenizer.pad_token_id, policy.device)
                t = time.perf_counter()
                update(policy, optimizer, batch, cfg, gen, step)
                _sync(policy.device)
                rec["update_s"].append(time.perf_counter() - t)
                for other in engines.values():  # every engine must hold the new weights
                    t = time.perf_counter()
                    other.load_weights(policy)
                    _sync(policy.device)
                    if other is engine:
                        rec["publish_s"].append(time.perf_counter() - t)
            print(f"{name} rollout {step}{' (warm-up)' if step == 0 else ''}: {rec['rollout_s'][-1]:.2f} s, {rec['gen_tokens'][-1]} tokens, "
                  f"mismatch {rec['mismatch'][-1]:.2e}" + (f", update {rec['update_s'][-1]:.2f} s, publish {rec['publish_s'][-1]:.3f} s" if args.train_step else ""),
                  flush=True)
    for name, engine in engines.items():
        rec = recs[name]
        if name == "vllm" and not rec["publish_s"]:
            t = time.perf_counter()
            engine.load_weights(policy)
            _sync(policy.device)
            rec["publish_once_s"] = time.perf_counter() - t
        engine.close()
        timed = rec["rollout_s"][1:]
        rec["warmup_rollout_s"] = rec["rollout_s"][0]
        rec["median_rollout_s"] = statistics.median(timed)
        rec["gen_tokens_per_s"] = sum(rec["gen_tokens"][1:]) / sum(timed)
    return recs


def markdown(results: dict) -> str:
    r = results["engines"]
    lines = [
        f"model {results['model']} ({results['params_m']:.1f}M parameters, {results['dtype']}) on {results['device']}, setting "
        f"{results['setting']} (B={results['B']} x G={results['G']}, up to {results['max_new_tokens']} new tokens), {results['repeats']} timed rollouts per engine, "
        f"{results['threads']} torch threads; load average {results['load_avg_start'][0]:.1f} at the start, {results['load_avg_end'][0]:.1f} at the end",
        "",
        "| engine | start s | warm-up rollout s | median rollout s | gen tokens/s | mean abs logprob mismatch | publish s | update s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, e in r.items():
        pub = f"{statistics.median(e['publish_s']):.3f}" if e["publish_s"] else (f"{e['publish_once_s']:.3f}" if "publish_once_s" in e else "-")
        upd = f"{statistics.median(e['update_s']):.2f}" if e["update_s"] else "-"
        lines.append(f"| {name} | {e['start_s']:.1f} | {e['warmup_rollout_s']:.2f} | {e['median_rollout_s']:.2f} | {e['gen_tokens_per_s']:.1f} | "
                     f"{statistics.mean(e['mismatch'][1:]):.1e} | {pub} | {upd} |")
    if "native" in r and "vllm" in r:
        lines += ["", f"vLLM / native median rollout seconds: {r['vllm']['median_rollout_s'] / r['native']['median_rollout_s']:.2f}"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct", help="smollm2-135m-instruct, tiny-random, random-1b or a local HF directory")
    ap.add_argument("--tiny-heads", type=int, default=2, help="attention heads of tiny-random (2: head size 32, which vLLM's CPU attention supports)")
    ap.add_argument("--setting", choices=sorted(vs_trl.SETTINGS), default="agent")
    ap.add_argument("--engines", default="native,vllm")
    ap.add_argument("--repeats", type=int, default=3, help="timed rollouts per engine (after one warm-up)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--train-step", action="store_true", help="each repeat is a GRPO step: rollout, update, publish the weights")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    ap.add_argument("--compile", action="store_true", help="let vLLM compile / capture CUDA graphs (rollout.vllm.enforce_eager = false)")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    spec = dict(vs_trl.SETTINGS[args.setting], device=args.device)
    cfg = vs_trl.recursa_config(spec, "unused", args.repeats + 1)
    dtype = getattr(torch, args.dtype)
    if args.model == "random-1b":
        policy = random_1b(dtype, args.device)
    else:
        tiny = {"num_heads": args.tiny_heads} if args.model == "tiny-random" else {}
        policy = load_policy(ModelConfig(name=args.model, device=args.device, dtype=args.dtype, tiny=tiny))
    params = sum(p.numel() for p in policy.model.parameters())
    results = {
        "model": args.model, "params_m": params / 1e6, "dtype": args.dtype, "device": str(policy.device), "setting": args.setting,
        "B": spec["prompts_per_step"], "G": spec["group_size"], "max_new_tokens": spec["max_new_tokens"], "repeats": args.repeats,
        "threads": args.threads, "machine": platform.processor() or platform.machine(), "torch": torch.__version__, "engines": {},
    }
    if policy.device.type == "cuda":
        results["gpu"] = torch.cuda.get_device_name(policy.device)
    results["load_avg_start"] = list(os.getloadavg())
    results["engines"] = run([e.strip() for e in args.engines.split(",") if e.strip()], policy, cfg, spec, args)
    results["load_avg_end"] = list(os.getloadavg())
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "engine_speed.json").write_text(json.dumps(results, indent=1) + "\n")
    table = markdown(results)
    (out / "engine_speed.md").write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
