"""Each stage of a household GRPO step against its hardware bound, measured on this machine in one run.

    python benchmarks/limits.py                       # the embedded SmolLM2-135M, 2 threads (~4 min)
    python benchmarks/limits.py --model tiny-random   # checks the script in seconds

The bounds come from two probes of the machine, run at the start and again at the end (a shared
host moves both; the report shows both readings, the bounds use the better one):

* copy bandwidth: `dst.copy_(src)` of a --copy-mb MiB float32 tensor, best of 5, counted as bytes
  read plus bytes written over the seconds (STREAM's convention); a read-only probe (`src.sum()`)
  is reported beside it for reference;
* matmul rate: a --matmul-n square matmul, float32 and bfloat16, best of 5, 2 n^3 FLOPs.

Prompts are the `household` game's as a GRPO step of `examples/household.toml` plays them (B = 2
games x G = 4 episodes, at most 10 turns, `agent.history_turns = 2`): `recursa.rollout.rollout_episodes`
renders every turn's prompt as in training, with a random agent choosing among the admissible
actions each prompt lists (a model's rollout would cost minutes here and only the prompts'
shapes matter; the replies are the actions themselves, a few tokens and EOS). Then, on those prompts:

* decode: one-token forwards (decoder + vocabulary projection, what the engine's `decode_s`
  times) of `--decode-rows` rows whose static KV slots (`engines.continuous.SlotKV`) hold a
  prompt of the median turn-prompt length, float32 and with a bfloat16 copy of the weights.
  Bound: a forward reads every weight once (the tied embedding counted once, as the vocabulary
  projection) and every row's keys and values, so it takes at least (weight bytes + KV bytes) /
  copy bandwidth; it also does 2 x (non-embedding params + V x H) FLOPs per row plus attention,
  which take FLOPs / matmul rate. The bound is the slower of the two (a roofline); the table says
  which one binds.
* prefill: the distinct turn prompts, --prefill-rows per forward, each row padded at its end to
  the forward's longest (the engine's batched prefill into `SlotKV`). Bound: 2 x non-embedding
  params per real token plus the causal attention's 4 x layers x heads x head_dim x position,
  over the matmul rate (the engine does not project the prompt's positions onto the vocabulary).
* update: forward + backward of the update's first micro-batch (`train.micro_batch_size` rows in
  the update's own length order, `recipes.grpo._length_order`) through
  `generation.shared_prefix_logprobs`, as `recipes.grpo.update` runs it (each distinct prompt once),
  at `train.precision = "fp32"` and `"bf16"` (autocast, `distributed.precision.learner_forward`).
  Bound: 3 x the forward's FLOPs (the backward does twice the forward's matmuls) over the float32
  or bfloat16 matmul rate; the forward's FLOPs count every token actually run (each prompt once,
  every completion), 2 x non-embedding params per token, 2 x V x H per projected action position,
  and the attention. The naive 6 x params x tokens is reported beside it.

Rates are tokens per second: decode rows per second, real (unpadded) prompt tokens per second,
tokens run per second in the update. Writes limits.json and limits.md to --out (default
benchmarks/results/).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import math
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from recursa.config import load_config  # noqa: E402
from recursa.distributed.precision import learner_forward  # noqa: E402
from recursa.engines.continuous import SlotKV, _kv_shape  # noqa: E402
from recursa.envs import EnvPool, make_env  # noqa: E402
from recursa.generation import Sample, SamplingParams, _cache_kwarg, prefix_lengths, shared_prefix_logprobs  # noqa: E402
from recursa.models import load_policy  # noqa: E402
from recursa.recipes.common import step_generator  # noqa: E402
from recursa.recipes.grpo import _length_order, episode_rows, prompt_groups, train_seeds  # noqa: E402
from recursa.rollout import rollout_episodes  # noqa: E402
from recursa.trajectory import collate  # noqa: E402

CONFIG = REPO / "examples" / "household.toml"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


# ---------------------------------------------------------------- machine probes


def copy_bandwidth(mib: int, reps: int = 5) -> dict:
    """Best-of-`reps` GB/s of a float32 tensor copy (read + write bytes) and of a read-only sum."""
    src = torch.rand(mib * (1 << 20) // 4)
    dst = torch.empty_like(src)
    nbytes = src.numel() * 4
    dst.copy_(src)
    copy_s, read_s = [], []
    for _ in range(reps):
        t = time.perf_counter()
        dst.copy_(src)
        copy_s.append(time.perf_counter() - t)
        t = time.perf_counter()
        float(src.sum())
        read_s.append(time.perf_counter() - t)
    return {"mib": mib, "copy_gbs": 2 * nbytes / min(copy_s) / 1e9, "read_gbs": nbytes / min(read_s) / 1e9}


def matmul_rate(n: int, dtype: torch.dtype, reps: int = 5) -> float:
    """Best-of-`reps` GFLOP/s of an n x n by n x n matmul (2 n^3 FLOPs)."""
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    a @ b
    best = math.inf
    for _ in range(reps):
        t = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best / 1e9


def quick_rate() -> float:
    """The float32 matmul rate (n = 512) just before a stage: shows a stage that ran while the host was busier."""
    return matmul_rate(512, torch.float32, reps=5)


def probe(args) -> dict:
    bw = copy_bandwidth(args.copy_mb)
    return {"copy_gbs": bw["copy_gbs"], "read_gbs": bw["read_gbs"],
            "matmul_gflops": {name: matmul_rate(args.matmul_n, dt) for name, dt in DTYPES.items()}}


# ---------------------------------------------------------------- the model's shape and work


@dataclasses.dataclass
class Shape:
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    vocab: int
    params: int  # unique parameters (a tied embedding once)
    body: int  # parameters outside the input embedding and the vocabulary projection

    @classmethod
    def of(cls, causal_lm) -> Shape:
        cfg = causal_lm.config
        layers, kv_heads, head_dim = _kv_shape(cfg)
        emb, head = causal_lm.get_input_embeddings().weight, causal_lm.get_output_embeddings().weight
        params = sum(p.numel() for p in causal_lm.parameters())
        body = params - emb.numel() - (0 if head is emb else head.numel())
        return cls(layers, cfg.num_attention_heads, kv_heads, head_dim, cfg.hidden_size, head.shape[0], params, body)

    def attn(self, contexts: float) -> float:
        """Forward FLOPs of attention summed over queries attending `contexts` positions in all:
        scores and weighted values, 2 x 2 x heads x head_dim per (query, key) pair, every layer."""
        return 4.0 * self.layers * self.heads * self.head_dim * contexts

    def kv_bytes(self, positions: int, elt: int) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * positions * elt

    def weight_bytes(self, elt: int) -> int:
        """Bytes a forward reads of the weights: everything but the input embedding's rows it does
        not look up (with a tied embedding the projection reads the whole matrix anyway)."""
        return (self.body + self.vocab * self.hidden) * elt


def roofline(tokens: float, seconds: float, flops: float, rate_gflops: float, nbytes: float = 0.0, bw_gbs: float = 0.0) -> dict:
    """A stage's measured rate against the slower of its compute time and its memory time."""
    t_compute = flops / (rate_gflops * 1e9)
    t_memory = nbytes / (bw_gbs * 1e9) if nbytes else 0.0
    t_bound = max(t_compute, t_memory)
    measured, bound = tokens / seconds, tokens / t_bound
    return {"tokens": tokens, "seconds": seconds, "flops": flops, "bytes": nbytes, "matmul_gflops": rate_gflops, "bw_gbs": bw_gbs,
            "t_compute": t_compute, "t_memory": t_memory, "measured": measured, "bound": bound, "fraction": measured / bound,
            "limit": "memory" if t_memory > t_compute else "compute", "achieved_gflops": flops / seconds / 1e9,
            "achieved_gbs": nbytes / seconds / 1e9 if nbytes else None}


# ---------------------------------------------------------------- the household prompts


class RandomAdmissible:
    """A rollout engine that replies to each turn's prompt with one of the admissible actions the
    prompt lists, drawn at random (a random agent): the game plays out and every turn's prompt is
    rendered exactly as in training (`recursa.rollout.rollout_episodes`), without running the model."""

    name = "random-admissible"

    def __init__(self, tokenizer, seed: int = 0):
        self.tok, self.rng = tokenizer, random.Random(seed)
        self.eos = tokenizer.eos_token_id

    def generate(self, prompts, params, n=1, generator=None, stats=None):
        out = []
        for prompt in prompts:
            text = self.tok.decode(prompt)
            listed = text.rsplit("Admissible actions:", 1)[-1].splitlines() if "Admissible actions:" in text else []
            actions = [line[2:].strip() for line in listed if line.startswith("- ") and not line.startswith("- ...")] or ["look"]
            for _ in range(n):
                ids = self.tok.encode(self.rng.choice(actions), add_special_tokens=False)[: params.max_new_tokens - 1] + [self.eos]
                out.append(Sample(len(out), ids, [-1.0] * len(ids), "eos"))
        return out

    def load_weights(self, policy) -> None:
        pass

    def close(self) -> None:
        pass


def household_episodes(cfg, policy):
    """The episodes of one GRPO step of the household game (B x G, the config's seeds of step 0),
    played by a random agent through the training rollout's prompt rendering; and the seconds."""
    pool = EnvPool(lambda: make_env(cfg.env.name, **cfg.env.kwargs))
    sampling = SamplingParams(cfg.sampling.max_new_tokens, cfg.sampling.temperature, cfg.sampling.top_p, tuple(cfg.sampling.stop))
    t = time.perf_counter()
    ero = rollout_episodes(policy, pool, train_seeds(cfg, 0), cfg.train.group_size, sampling, step_generator(cfg.train.seed, 0), cfg.model.system_prompt,
                           cfg.agent, engine=RandomAdmissible(policy.tokenizer, cfg.train.seed))
    dt = time.perf_counter() - t
    pool.close()
    return ero.episodes, dt


# ---------------------------------------------------------------- the stages


def _forward(base, slots: SlotKV, ids: torch.Tensor, starts: torch.Tensor, cache_kw: str):
    """The engine's forward of `ids  # (n, s)` into slots 0..n-1 at columns starts..starts+s-1."""
    s = ids.shape[1]
    slots.begin_prefill(0, starts, s)
    positions = starts[:, None] + torch.arange(s)  # (n, s)
    mask = (torch.arange(slots.width)[None, None, :] <= positions[:, :, None])[:, None]  # (n, 1, s, W) causal
    return base(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, **{cache_kw: slots})


def measure_prefill(lm, shape: Shape, prompts: list[list[int]], rows: int, rate: float) -> dict:
    base = lm.get_decoder()
    cache_kw = _cache_kwarg(base)
    waves = [prompts[i : i + rows] for i in range(0, len(prompts), rows)]
    seconds, real, padded, flops = 0.0, 0, 0, 0.0
    before = quick_rate()
    with torch.no_grad():
        warm = torch.tensor([prompts[0][:32]])
        _forward(base, SlotKV(lm.config, 1, 64, torch.float32, torch.device("cpu")), warm, torch.zeros(1, dtype=torch.long), cache_kw)
        for wave in waves:
            width = max(len(p) for p in wave)
            ids = torch.tensor([p + [0] * (width - len(p)) for p in wave])
            slots = SlotKV(lm.config, len(wave), width + 1, torch.float32, torch.device("cpu"))
            t = time.perf_counter()
            _forward(base, slots, ids, torch.zeros(len(wave), dtype=torch.long), cache_kw)
            seconds += time.perf_counter() - t
            real += sum(len(p) for p in wave)
            padded += len(wave) * width
            flops += sum(2.0 * shape.body * len(p) + shape.attn(len(p) * (len(p) + 1) / 2) for p in wave)
    out = roofline(real, seconds, flops, rate)
    out.update(forwards=len(waves), rows_per_forward=rows, padded_tokens=padded, prompts=len(prompts), matmul_before=before)
    return out


def measure_decode(lm, shape: Shape, prompts: list[list[int]], length: int, rows_list: list[int], steps: int, dtype: torch.dtype,
                   bw: float, rate: float) -> list[dict]:
    """One-token forwards of `rows` rows over KV slots holding `length` prompt positions each."""
    base, head = lm.get_decoder(), lm.get_output_embeddings()
    cache_kw = _cache_kwarg(base)
    elt = torch.finfo(dtype).bits // 8
    src_prompts = [p[:length] for p in prompts if len(p) >= length][:8]
    src = SlotKV(lm.config, len(src_prompts), length + 1, dtype, torch.device("cpu"))
    with torch.no_grad():
        _forward(base, src, torch.tensor(src_prompts), torch.zeros(len(src_prompts), dtype=torch.long), cache_kw)  # the prompts' own KV
    out = []
    for rows in rows_list:
        slots = SlotKV(lm.config, rows, length + steps + 2, dtype, torch.device("cpu"))
        pick = torch.arange(rows) % len(src_prompts)
        for layer in range(shape.layers):
            slots.keys[layer][:, :, :length] = src.keys[layer][pick, :, :length]
            slots.values[layer][:, :, :length] = src.values[layer][pick, :, :length]
        token = torch.tensor([src_prompts[int(i)][-1] for i in pick])[:, None]
        times, flops, nbytes = [], 0.0, 0.0
        before = quick_rate()
        with torch.no_grad():
            for step in range(steps + 1):  # the first is a warm-up
                positions = torch.full((rows,), length + step, dtype=torch.long)
                t = time.perf_counter()
                slots.begin_step(positions)
                mask = (torch.arange(slots.width)[None, :] <= positions[:, None])[:, None, None]  # (n, 1, 1, W)
                h = base(input_ids=token, attention_mask=mask, position_ids=positions[:, None], use_cache=True, **{cache_kw: slots})
                logits = head(h.last_hidden_state[:, -1])  # (rows, V)
                dt = time.perf_counter() - t
                token = logits.argmax(-1)[:, None]
                if step:
                    ctx = length + step + 1  # positions each row attends (its new one included)
                    times.append(dt)
                    flops += rows * (2.0 * (shape.body + shape.vocab * shape.hidden) + shape.attn(ctx))
                    nbytes += shape.weight_bytes(elt) + rows * shape.kv_bytes(ctx, elt)
        sec = statistics.median(times) * steps  # median step, so one slow step does not decide
        rec = roofline(rows * steps, sec, flops, rate, nbytes, bw)
        rec.update(matmul_before=before, rows=rows, context=length, steps=steps, step_s=[round(x, 4) for x in times],
                   weight_mb=shape.weight_bytes(elt) / 1e6, kv_mb_per_step=rows * shape.kv_bytes(length + 1, elt) / 1e6)
        out.append(rec)
    return out


def update_work(shape: Shape, mb) -> tuple[int, int, float, int]:
    """(tokens run, action positions, forward FLOPs, padded positions run) of shared_prefix_logprobs on micro-batch `mb`."""
    first = prefix_lengths(mb.action_mask).tolist()
    real = mb.attention_mask.sum(dim=1).tolist()
    ids = mb.input_ids.tolist()
    prefixes = {tuple(ids[i][: first[i]]) for i in range(len(first))}
    actions = int(mb.action_mask.sum())
    tokens, flops = 0, 2.0 * shape.vocab * shape.hidden * actions
    for p in prefixes:
        tokens += len(p)
        flops += 2.0 * shape.body * len(p) + shape.attn(len(p) * (len(p) + 1) / 2)
    for f, r in zip(first, real):
        s = r - f
        tokens += s
        flops += 2.0 * shape.body * s + shape.attn(s * f + s * (s + 1) / 2)
    padded = len(prefixes) * max(len(p) for p in prefixes) + len(first) * max(r - f for f, r in zip(first, real))
    return tokens, actions, flops, padded


def measure_update(policy, cfg, batch, idx: torch.Tensor, precision: str, rate: float, shape: Shape) -> dict:
    lm = policy.causal_lm
    train = cfg.train.model_copy(update={"precision": precision}) if hasattr(cfg.train, "model_copy") else dataclasses.replace(cfg.train, precision=precision)
    logprobs = learner_forward(shared_prefix_logprobs, train)
    lm.train()

    def run(mb) -> float:
        t = time.perf_counter()
        logp, _ = logprobs(lm, mb.input_ids, mb.attention_mask, mb.action_mask, cfg.sampling.temperature, train.logit_chunk, with_entropy=True)
        loss = -(logp * mb.action_mask).sum() / mb.action_mask.sum()
        loss.backward()
        dt = time.perf_counter() - t
        lm.zero_grad(set_to_none=True)
        return dt

    run(batch.select(idx[:2]))  # warm-up: the backward's first call, and autocast's
    mb = batch.select(idx)
    before = quick_rate()
    seconds = run(mb)
    tokens, actions, fwd, padded = update_work(shape, mb)
    out = roofline(tokens, seconds, 3.0 * fwd, rate)
    out.update(matmul_before=before, precision=precision, rows=len(idx), action_tokens=actions, padded_tokens=padded,
               flops_6n=6.0 * shape.params * tokens)
    lm.eval()
    return out


# ---------------------------------------------------------------- report


def table_rows(res: dict) -> list[dict]:
    """The report's rows: stage, precision, shape, measured, bound, fraction and the bound's formula."""
    rows = []
    for rec in res["decode"]:
        rows.append({"stage": "decode", "dtype": rec["dtype"], "shape": f"{rec['rows']} rows x {rec['context']} ctx", "rec": rec,
                     "how": f"min(rows / ((W {rec['weight_mb']:.3g} MB + KV {rec['kv_mb_per_step']:.3g} MB) / {rec['bw_gbs']:.1f} GB/s), "
                            f"rows / (FLOPs / {rec['matmul_gflops']:.0f} GFLOP/s))"})
    p = res["prefill"]
    rows.append({"stage": "prefill", "dtype": "float32", "shape": f"{p['prompts']} prompts, {p['rows_per_forward']} per forward", "rec": p,
                 "how": f"tokens / ((2 x body params + attn) x tokens / {p['matmul_gflops']:.0f} GFLOP/s)"})
    for rec in res["update"]:
        rows.append({"stage": "update", "dtype": rec["precision"], "shape": f"{rec['rows']} rows, {int(rec['tokens'])} tokens run", "rec": rec,
                     "how": f"tokens / (3 x forward FLOPs / {rec['matmul_gflops']:.0f} GFLOP/s)"})
    return rows


def write_md(res: dict, path: Path) -> None:
    m0, m1 = res["machine_start"], res["machine_end"]
    lines = ["# Each stage against its bound", "", f"`{res['command']}` ({res['date']}, {res['machine']}).", "",
             f"Machine probes, start -> end: copy bandwidth {m0['copy_gbs']:.1f} -> {m1['copy_gbs']:.1f} GB/s "
             f"(read-only {m0['read_gbs']:.1f} -> {m1['read_gbs']:.1f}), matmul float32 {m0['matmul_gflops']['float32']:.0f} -> "
             f"{m1['matmul_gflops']['float32']:.0f} GFLOP/s, bfloat16 {m0['matmul_gflops']['bfloat16']:.0f} -> "
             f"{m1['matmul_gflops']['bfloat16']:.0f} GFLOP/s; the bounds use the better reading.", "",
             f"Model {res['model']}: {res['shape']['params'] / 1e6:.1f}M params ({res['shape']['body'] / 1e6:.1f}M outside the embedding), "
             f"{res['shape']['layers']} layers, {res['shape']['kv_heads']} KV heads x {res['shape']['head_dim']}. Household prompts: "
             f"{res['prompts']['turns']} turns, prompt length median {res['prompts']['median']} (min {res['prompts']['min']}, max {res['prompts']['max']}).", "",
             "| stage | dtype | shape | measured tok/s | bound tok/s | fraction of bound | binding limit | achieved | fp32 matmul just before | bound computed as |",
             "|---|---|---|---:|---:|---:|---|---|---:|---|"]
    for r in table_rows(res):
        rec = r["rec"]
        achieved = f"{rec['achieved_gflops']:.0f} GFLOP/s" + (f", {rec['achieved_gbs']:.1f} GB/s" if rec.get("achieved_gbs") else "")
        lines.append(f"| {r['stage']} | {r['dtype']} | {r['shape']} | {rec['measured']:.1f} | {rec['bound']:.1f} | {rec['fraction']:.2f} | "
                     f"{rec['limit']} | {achieved} | {rec['matmul_before']:.0f} GFLOP/s | {r['how']} |")
    lines += ["", "The last-but-one column is a small float32 matmul (n = 512) timed right before the stage: a stage that ran while the "
              "host was busier shows a lower figure there than the probes above.", "", "Update against the naive 6 x params x tokens: " + ", ".join(
        f"{u['precision']} {u['fraction_6n']:.2f}" for u in res["update"]) + " of that bound.", ""]
    path.write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="", help="override model.name (e.g. tiny-random); default the example config's embedded model")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--decode-rows", default="8,32,100", help="rows per decode step")
    ap.add_argument("--decode-steps", type=int, default=4, help="timed one-token steps per row count (after one warm-up)")
    ap.add_argument("--decode-dtypes", default="float32,bfloat16", help="float32 and/or bfloat16 (a bfloat16 copy of the weights, as rollout.decode_dtype)")
    ap.add_argument("--prefill-rows", type=int, default=8, help="prompts per prefill forward")
    ap.add_argument("--prefill-prompts", type=int, default=24, help="distinct turn prompts prefilled")
    ap.add_argument("--update-rows", type=int, default=0, help="rows of the timed update micro-batch (default train.micro_batch_size)")
    ap.add_argument("--precisions", default="fp32,bf16", help="train.precision values of the update")
    ap.add_argument("--copy-mb", type=int, default=256)
    ap.add_argument("--matmul-n", type=int, default=2048)
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    os.environ.setdefault("RECURSA_DEVICE", "cpu")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t_all = time.perf_counter()

    start = probe(args)
    print(f"start: copy {start['copy_gbs']:.1f} GB/s, matmul {start['matmul_gflops']}", flush=True)
    cfg = load_config(CONFIG, [f"model.name={args.model}"] if args.model else [])
    policy = load_policy(cfg.model)
    lm = policy.causal_lm.eval()
    shape = Shape.of(lm)
    episodes, rollout_s = household_episodes(cfg, policy)
    turn_prompts = [t.prompt_ids for e in episodes for t in e.turns]
    lengths = sorted(len(p) for p in turn_prompts)
    median = lengths[len(lengths) // 2]
    print(f"household prompts ({rollout_s:.1f} s): {len(episodes)} episodes, {len(turn_prompts)} turns, prompt lengths {lengths[0]}..{lengths[-1]} (median {median})", flush=True)
    distinct = list(dict.fromkeys(tuple(p) for p in turn_prompts))

    prefill = measure_prefill(lm, shape, [list(p) for p in distinct[: args.prefill_prompts]], args.prefill_rows, start["matmul_gflops"]["float32"])
    print(f"prefill: {prefill['measured']:.0f} tok/s, {prefill['fraction']:.2f} of bound", flush=True)

    decode = []
    for name in args.decode_dtypes.split(","):
        dtype = DTYPES[name]
        model = lm if dtype == torch.float32 else copy.deepcopy(lm).to(dtype)
        for rec in measure_decode(model, shape, [list(p) for p in distinct], median, [int(r) for r in args.decode_rows.split(",")], args.decode_steps,
                                  dtype, start["copy_gbs"], start["matmul_gflops"][name]):
            rec["dtype"] = name
            decode.append(rec)
            print(f"decode {name} {rec['rows']} rows: {rec['measured']:.1f} tok/s, {rec['fraction']:.2f} of the {rec['limit']} bound", flush=True)
        del model

    rows, adv, _ = episode_rows(episodes, torch.zeros(len(episodes)), cfg)
    batch = collate(rows, adv, policy.tokenizer.pad_token_id, policy.device)
    order = _length_order(batch, prompt_groups(batch))
    idx = order[: args.update_rows or cfg.train.micro_batch_size]
    update = []
    for precision in args.precisions.split(","):
        rate = start["matmul_gflops"]["float32" if precision == "fp32" else "bfloat16"]
        rec = measure_update(policy, cfg, batch, idx, precision, rate, shape)
        update.append(rec)
        print(f"update {precision}: {rec['measured']:.0f} tok/s, {rec['fraction']:.2f} of bound", flush=True)

    end = probe(args)
    print(f"end: copy {end['copy_gbs']:.1f} GB/s, matmul {end['matmul_gflops']}", flush=True)
    # the bounds use the better reading of each probe (start or end)
    best_bw = max(start["copy_gbs"], end["copy_gbs"])
    best_rate = {k: max(start["matmul_gflops"][k], end["matmul_gflops"][k]) for k in DTYPES}
    for rec in decode:
        rec.update(roofline(rec["tokens"], rec["seconds"], rec["flops"], best_rate[rec["dtype"]], rec["bytes"], best_bw))
    prefill.update(roofline(prefill["tokens"], prefill["seconds"], prefill["flops"], best_rate["float32"]))
    for rec in update:
        rate = best_rate["float32" if rec["precision"] == "fp32" else "bfloat16"]
        rec.update(roofline(rec["tokens"], rec["seconds"], rec["flops"], rate))
        rec["fraction_6n"] = rec["measured"] * rec["flops_6n"] / rec["tokens"] / (rate * 1e9)

    res = {
        "command": "python " + " ".join([sys.argv[0]] + (sys.argv[1:] if argv is None else argv)),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{platform.processor() or platform.machine()}, {args.threads} threads, torch {torch.__version__}",
        "load_avg_end": os.getloadavg(),
        "seconds": time.perf_counter() - t_all,
        "model": cfg.model.name,
        "shape": dataclasses.asdict(shape),
        "machine_start": start, "machine_end": end, "bw_gbs": best_bw, "matmul_gflops": best_rate,
        "prompts": {"turns": len(turn_prompts), "distinct": len(distinct), "median": median, "min": lengths[0], "max": lengths[-1], "rollout_s": rollout_s},
        "decode": decode, "prefill": prefill, "update": update,
    }
    res["table"] = [{"stage": r["stage"], "dtype": r["dtype"], "shape": r["shape"], "measured": r["rec"]["measured"], "bound": r["rec"]["bound"],
                     "fraction": r["rec"]["fraction"], "limit": r["rec"]["limit"], "how": r["how"]} for r in table_rows(res)]
    (out / "limits.json").write_text(json.dumps(res, indent=1, default=str))
    write_md(res, out / "limits.md")
    print(f"wrote {out / 'limits.md'} ({res['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
