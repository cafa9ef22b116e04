#!/usr/bin/env python
"""Side-by-side benchmark: one GRPO step of recursa against TRL's `GRPOTrainer`, and the
wall time of a whole small run of each.

Both frameworks train the same model (loaded from the same local directory) on the same
prompts, with the same reward function, group size, lengths, learning rate and seeds; each
step generates B x G completions and then takes exactly one optimizer step on them.

    python benchmarks/vs_trl.py                              # short + agent, embedded model
    python benchmarks/vs_trl.py --settings short --steps 3 --repeats 1
    python benchmarks/vs_trl.py --smoke                      # tiny random model, CI
    python benchmarks/vs_trl.py --recursa-only               # no TRL needed
    python benchmarks/vs_trl.py --device cuda                # both frameworks on the GPU
    python benchmarks/vs_trl.py --recursa-decode bfloat16    # also recursa sampling with a bf16 copy (rollout.decode_dtype)
    python benchmarks/vs_trl.py --whole-run-steps 0          # without the whole-run column

Every (setting, framework, repeat) run is its own subprocess (fresh interpreter, fresh
model), so the peak resident memory of each framework is measured on its own. Runs
alternate: within a repeat the frameworks run back to back for each setting, and the
order flips on every repeat (ABBA), so slow drift of a shared machine hits both alike.
After the step runs of a setting, each framework also plays a whole run of
--whole-run-steps steps as a user launches it (`recursa train CONFIG` on the equivalent
config; a plain TRL script), timed from process start to exit, in the same order.
The host's fp32 matmul rate is probed at the start and at the end of the invocation;
the ratios are reported per repeat and as a median with their range.
See benchmarks/README.md for what is measured and the fairness choices.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

THREADS = 2
FRAMEWORKS = ("recursa", "trl")
# recursa with a low-precision sampling copy of the weights (--recursa-decode): an entry of its
# own, run and reported beside plain recursa; the trainer stays float32 and the gap between the
# copy's and the trainer's log-probs is corrected by truncated importance sampling (TIS_CAP)
VARIANT_PREFIX = "recursa-"  # + the decode dtype: "recursa-bfloat16"
TIS_CAP = 2.0
DEFAULT_SYSTEM = "You are a helpful assistant."  # recursa's default model.system_prompt
AGENT_SYSTEM = (
    "You are an agent in a text adventure. Read the observation, think about the admissible actions, "
    "and follow the instructions of the current task exactly."
)

# One setting = the workload of one training step. Hyper-parameters common to all settings
# are in COMMON; both frameworks get every value below.
SETTINGS: dict[str, dict] = {
    "short": {"prompts_per_step": 2, "group_size": 8, "max_new_tokens": 16, "prompt_style": "plain", "system_prompt": DEFAULT_SYSTEM},
    "agent": {"prompts_per_step": 2, "group_size": 8, "max_new_tokens": 32, "prompt_style": "agent", "system_prompt": AGENT_SYSTEM},
}
SMOKE_SETTING = {"prompts_per_step": 2, "group_size": 4, "max_new_tokens": 8, "prompt_style": "plain", "system_prompt": DEFAULT_SYSTEM}
COMMON = {
    "env": "arithmetic",
    "difficulty": 0,
    "lr": 1e-5,
    "seed": 0,
    "temperature": 1.0,
    "top_p": 1.0,
    "clip_low": 0.2,
    "clip_high": 0.28,
    "max_grad_norm": 1.0,
    "weight_decay": 0.0,
    "betas": [0.9, 0.999],
    "adam_eps": 1e-8,
    "epochs": 1,
    "kl_coef": 0.0,
    "advantage": "grpo (group mean / unbiased group std)",
    "loss_agg": "token-mean over the whole batch",
    "dtype": "float32",
    "device": "cpu",  # --device cuda: both frameworks on the GPU (recursa model.device, TRL use_cpu=False)
}


# ----------------------------------------------------------------------------- prompts

_ROOMS = ["kitchen", "pantry", "laundry room", "study", "living room", "bedroom", "bathroom", "garage", "hallway", "cellar"]
_OBJECTS = [
    "apple", "mug", "kettle", "knife", "plate", "bowl", "towel", "book", "lamp", "key", "candle", "vase", "pen",
    "notebook", "spoon", "fork", "bottle", "soap", "sponge", "remote", "pillow", "blanket", "box", "jar", "hammer",
    "screwdriver", "bucket", "broom", "cloth", "glass", "pan", "pot", "cup", "watch", "phone", "map", "coin",
]
_FURNITURE = [
    "countertop", "cabinet", "drawer", "fridge", "shelf", "table", "desk", "bed", "sofa", "sink", "stove",
    "dresser", "armchair", "toolbox", "safe", "bin", "microwave", "bookcase", "chest", "workbench",
]
_VERBS = ["take", "examine", "open", "close", "put", "use", "clean", "heat", "cool", "look at"]


def agent_preamble(seed: int) -> str:
    """A long, realistic agent-style observation for `seed` (deterministic): instructions,
    a room description, about 40 admissible actions and a short history."""
    rng = random.Random(f"recursa.bench.agent:{seed}")
    room = rng.choice(_ROOMS)
    exits = rng.sample([r for r in _ROOMS if r != room], 3)
    furniture = rng.sample(_FURNITURE, 4)
    placed = {f: rng.sample(_OBJECTS, 2) for f in furniture}
    lines = [
        "INSTRUCTIONS: You are playing a household text game. Each turn you get an observation and the "
        "admissible actions. Invalid actions waste a turn. Answer questions exactly as asked.",
        "",
        f"GOAL: put a clean {rng.choice(_OBJECTS)} on the {rng.choice(furniture)} in the {room}.",
        "",
        f"OBSERVATION: You are in the {room}. You see "
        + ", ".join(f"a {f}" for f in furniture)
        + f". Exits lead to the {exits[0]}, the {exits[1]} and the {exits[2]}.",
    ]
    for f, objs in placed.items():
        lines.append(f"On the {f}, you see a {objs[0]} and a {objs[1]}.")
    actions = [f"go to {e}" for e in exits] + ["look", "inventory"]
    candidates = [f"{v} {o} from {f}" if v == "take" else f"{v} {o}" for f, objs in placed.items() for o in objs for v in _VERBS]
    actions += sorted(rng.sample(candidates, 33))
    lines += ["", "ADMISSIBLE ACTIONS: " + "; ".join(actions[:40]) + ".", "", "HISTORY:"]
    for t in range(2):
        f = rng.choice(furniture)
        lines.append(f"> examine {f}\nTurn {t + 1}: The {f} holds a {placed[f][0]} and a {placed[f][1]}. Nothing else happens.")
    return "\n".join(lines)


class AgentArithmeticEnv:
    """The arithmetic env with a long agent-style preamble before its question; the reward
    is the arithmetic env's reward on the reply."""

    name = "arithmetic-agent"
    system_prompt = None  # the rollout's system prompt applies

    def __init__(self, difficulty: int = 0) -> None:
        from recursa.envs import make_env

        self.base = make_env("arithmetic", difficulty=difficulty)

    def reset(self, seed: int) -> str:
        question = self.base.reset(seed)
        return f"{agent_preamble(seed)}\n\nCURRENT TASK: a note on the {random.Random(seed).choice(_FURNITURE)} asks a question. {question}"

    def step(self, action_text: str):
        return self.base.step(action_text)


def make_setting_env(spec: dict):
    """The env of a setting (a fresh instance)."""
    from recursa.envs import make_env

    if spec["prompt_style"] == "agent":
        return AgentArithmeticEnv(difficulty=COMMON["difficulty"])
    return make_env(COMMON["env"], difficulty=COMMON["difficulty"])


def step_seeds(spec: dict, steps: int) -> list[list[int]]:
    """The task seeds of every step, exactly as recursa's trainer draws them."""
    from recursa.recipes.grpo import train_seeds

    cfg = recursa_config(spec, "unused", steps)
    return [train_seeds(cfg, k) for k in range(steps)]


def recursa_overrides(spec: dict, model_dir: str, steps: int) -> list[str]:
    """The recursa config of a setting, as `--set KEY=VALUE` items (values in JSON / TOML)."""
    n = spec["prompts_per_step"] * spec["group_size"]
    overrides = {
        "model.name": model_dir,
        "model.dtype": "float32",
        "model.system_prompt": spec["system_prompt"],
        "env.name": COMMON["env"],
        "sampling.max_new_tokens": spec["max_new_tokens"],
        "sampling.temperature": COMMON["temperature"],
        "sampling.top_p": COMMON["top_p"],
        "algo.advantage": "grpo",
        "algo.agg": "token-mean",
        "algo.kl_coef": COMMON["kl_coef"],
        "algo.clip_low": COMMON["clip_low"],
        "algo.clip_high": COMMON["clip_high"],
        "train.steps": steps,
        "train.prompts_per_step": spec["prompts_per_step"],
        "train.group_size": spec["group_size"],
        "train.epochs": COMMON["epochs"],
        "train.mini_batches": 1,
        "train.micro_batch_size": n,  # TRL runs the whole batch in one forward/backward
        "train.lr": COMMON["lr"],
        "train.warmup_steps": 0,
        "train.weight_decay": COMMON["weight_decay"],
        "train.max_grad_norm": COMMON["max_grad_norm"],
        "train.old_logprobs": "recompute",
        "train.seed": COMMON["seed"],
        "run.threads": THREADS,
        "model.device": spec.get("device", COMMON["device"]),
    }
    items = [f"{k}={json.dumps(v)}" for k, v in overrides.items()]
    items += [f"env.kwargs={{difficulty = {COMMON['difficulty']}}}", f"train.betas={json.dumps(COMMON['betas'])}"]
    if spec.get("decode_dtype", "model") != "model":
        items += [f"rollout.decode_dtype={json.dumps(spec['decode_dtype'])}", f"rollout.tis_cap={TIS_CAP}"]
    return items


def recursa_config(spec: dict, model_dir: str, steps: int):
    from recursa.config import load_config

    return load_config(None, recursa_overrides(spec, model_dir, steps))


# the agent setting's env, as `recursa train` names a user's own env factory (benchmarks/ on PYTHONPATH)
AGENT_ENV_FACTORY = "vs_trl:AgentArithmeticEnv"


def whole_run_toml(spec: dict, model_dir: str, steps: int) -> str:
    """The config file of the whole run `recursa train` plays: the step benchmark's config, with
    the agent setting's env named as a factory, and no held-out evaluation (TRL's run has none).
    The run keeps recursa's defaults otherwise: a checkpoint at the end, samples.jsonl, report.md."""
    lines = ['recipe = "grpo"']
    for item in recursa_overrides(spec, model_dir, steps):
        key, value = item.split("=", 1)
        if key == "env.name" and spec["prompt_style"] == "agent":
            value = json.dumps(AGENT_ENV_FACTORY)
        lines.append(f"{key} = {value}")
    lines += ["eval.before = false", "eval.after = false"]
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- measuring helpers


def peak_rss_mb() -> float:
    """Peak resident set size of this process (VmHWM), in MB."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    import resource

    kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kb / (1024 * 1024) if sys.platform == "darwin" else kb / 1024


def peak_gpu_mb() -> float | None:
    """Peak GPU memory torch allocated in this process (MB), or None without CUDA in use."""
    import torch

    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return None
    return torch.cuda.max_memory_allocated() / 2**20


def param_counts(model) -> dict:
    """body = non-embedding parameters (every matmul run at each position); head = the
    vocabulary projection (tied to the embeddings here, so counted separately)."""
    emb = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    seen, total = set(), 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel()
    body = total - emb.numel() - (0 if head is emb else head.numel())
    return {"total": total, "body": body, "head": head.numel()}


def update_flops(params: dict, trained_tokens: int, completion_tokens: int) -> float:
    """6 x (body params x every trained position + lm_head x completion positions)."""
    return 6.0 * (params["body"] * trained_tokens + params["head"] * completion_tokens)


def generation_flops(params: dict, body_positions: int, head_positions: int) -> float:
    """2 x (body params x positions run through the model + lm_head x positions projected)."""
    return 2.0 * (params["body"] * body_positions + params["head"] * head_positions)


def matmul_gflops(n: int = 2048, reps: int = 5, device: str = "cpu") -> dict:
    """fp32 n x n @ n x n rate with torch on THREADS threads (or on the GPU, with torch's
    default full-fp32 matmul precision): best and median of `reps`."""
    import torch

    torch.set_num_threads(THREADS)
    if device != "cpu":
        n, reps = 8192, 10  # enough work per product to time a GPU
    a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
    a @ b  # warm-up
    _sync(device)
    rates = []
    for _ in range(reps):
        t = time.perf_counter()
        a @ b
        _sync(device)
        rates.append(2 * n**3 / (time.perf_counter() - t) / 1e9)
    return {"n": n, "reps": reps, "device": device, "best_gflops": max(rates), "median_gflops": statistics.median(rates)}


def _sync(device: str) -> None:
    """Wait for the GPU's queued work, so that wall-clock timers measure it."""
    if device != "cpu":
        import torch

        torch.cuda.synchronize()


# ----------------------------------------------------------------------------- child: recursa


def child_recursa(spec: dict, model_dir: str, steps: int) -> dict:
    import torch

    torch.set_num_threads(THREADS)
    t_start = time.perf_counter()
    from recursa.algorithms.advantages import compute_advantages
    from recursa.engines import make_engine
    from recursa.generation import SamplingParams
    from recursa.models import load_policy
    from recursa.recipes.grpo import step_generator, train_seeds, update
    from recursa.rollout import rollout
    from recursa.trajectory import collate

    cfg = recursa_config(spec, model_dir, steps)
    device = cfg.model.device
    torch.manual_seed(cfg.train.seed)
    policy = load_policy(cfg.model)
    engine = make_engine(cfg.rollout, policy)  # the native sampler; with --recursa-decode, on a low-precision copy
    params = param_counts(policy.causal_lm)
    trainable = [p for p in policy.model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=cfg.train.lr, betas=cfg.train.betas, eps=COMMON["adam_eps"], weight_decay=cfg.train.weight_decay, fused=True)
    sampling = SamplingParams(cfg.sampling.max_new_tokens, cfg.sampling.temperature, cfg.sampling.top_p, tuple(cfg.sampling.stop))
    B, G = cfg.train.prompts_per_step, cfg.train.group_size
    try:  # like the trainer: env instances created once and reset for every episode
        from recursa.envs.base import EnvPool

        envs = EnvPool(lambda: make_setting_env(spec))
    except ImportError:  # older recursa: rollout takes a factory
        envs = lambda: make_setting_env(spec)  # noqa: E731
    init_s = time.perf_counter() - t_start

    rec: dict = {k: [] for k in ("step_s", "rollout_s", "update_s", "reward", "completion_tokens", "prompt_tokens", "gen_flops", "update_flops", "threads")}
    opt_step = 0
    for step in range(steps):
        t0 = time.perf_counter()
        gen = step_generator(cfg.train.seed, step)
        seeds = train_seeds(cfg, step)
        ro = rollout(policy, envs, seeds, G, sampling, gen, cfg.model.system_prompt or None, engine=engine)
        _sync(device)
        t1 = time.perf_counter()
        trajs = ro.trajectories
        rewards = torch.tensor([t.reward for t in trajs], dtype=torch.float32).view(B, G)
        advantages = compute_advantages(cfg.algo.advantage, rewards)
        batch = collate(trajs, advantages.view(-1), policy.tokenizer.pad_token_id, policy.device)
        st = update(policy, optimizer, batch, cfg, gen, opt_step)
        opt_step += st.opt_steps
        engine.load_weights(policy)  # a low-precision copy is refreshed from the new weights (part of the step's time)
        _sync(device)
        t2 = time.perf_counter()

        completion = sum(t.num_action_tokens for t in trajs)
        prompt = sum(len(t.token_ids) - t.num_action_tokens for t in trajs)
        s = ro.stats
        rec["step_s"].append(t2 - t0)
        rec["rollout_s"].append(t1 - t0)
        rec["update_s"].append(t2 - t1)
        rec["reward"].append(rewards.mean().item())
        rec["completion_tokens"].append(completion)
        rec["prompt_tokens"].append(prompt)
        # generation: prefill positions (each distinct prompt once) + decode positions of
        # live rows; the vocabulary projection runs once per sampled token.
        rec["gen_flops"].append(generation_flops(params, s.prefill_tokens + s.decode_tokens, s.generated_tokens))
        # the work actually done: each distinct prompt runs once (shared-prefix update), so
        # count prompt tokens once per group; `update_flops_naive` counts them per row
        unique_prompt = sum(len(trajs[i * G].token_ids) - trajs[i * G].num_action_tokens for i in range(B))
        rec.setdefault("update_flops_naive", []).append(update_flops(params, prompt + completion, completion))
        rec["update_flops"].append(update_flops(params, unique_prompt + completion, completion))
        rec["threads"].append(torch.get_num_threads())
        rec.setdefault("logprob_mismatch", []).append(st.logprob_mismatch)
    rec.update(framework="recursa", n_sequences=B * G, params=params, init_s=init_s, peak_rss_mb=peak_rss_mb(), peak_gpu_mb=peak_gpu_mb())
    return rec


# ----------------------------------------------------------------------------- child: TRL


def trl_config_kwargs(spec: dict, steps: int, output_dir: str) -> dict:
    """The `trl.GRPOConfig` arguments that reproduce recursa's step (see benchmarks/README.md)."""
    n = spec["prompts_per_step"] * spec["group_size"]
    return {
        "output_dir": output_dir,
        # batch geometry: one generation of B prompts x G completions, one optimizer step on it
        "per_device_train_batch_size": n,
        "gradient_accumulation_steps": 1,
        "steps_per_generation": 1,
        "num_iterations": 1,
        "num_generations": spec["group_size"],
        "max_completion_length": spec["max_new_tokens"],
        "max_steps": steps,
        "shuffle_dataset": False,  # the dataset is already in recursa's per-step order
        # sampling
        "temperature": COMMON["temperature"],
        "top_p": COMMON["top_p"],
        "top_k": 0,
        "use_vllm": False,
        # objective
        "beta": COMMON["kl_coef"],
        "loss_type": "dapo",  # token-mean over the global batch == recursa algo.agg="token-mean"
        "scale_rewards": "group",
        "epsilon": COMMON["clip_low"],
        "epsilon_high": COMMON["clip_high"],
        "mask_truncated_completions": False,
        # optimizer
        "learning_rate": COMMON["lr"],
        "lr_scheduler_type": "constant",
        "warmup_steps": 0,
        "weight_decay": COMMON["weight_decay"],
        "adam_beta1": COMMON["betas"][0],
        "adam_beta2": COMMON["betas"][1],
        "adam_epsilon": COMMON["adam_eps"],
        "optim": "adamw_torch_fused",  # the same fused CPU AdamW kernel recursa uses
        "max_grad_norm": COMMON["max_grad_norm"],
        # precision / device / overheads
        "use_cpu": spec.get("device", COMMON["device"]) == "cpu",
        "bf16": False,
        "fp16": False,
        "gradient_checkpointing": False,
        "seed": COMMON["seed"],
        "dataloader_num_workers": 0,
        "logging_steps": 1,
        "report_to": "none",
        "save_strategy": "no",
        "disable_tqdm": True,
        "log_completions": False,
    }


def trl_rows(spec: dict, steps: int) -> list[dict]:
    """TRL's dataset: the prompts of every step in recursa's order, each with its task seed."""
    env = make_setting_env(spec)
    rows = []
    for seeds in step_seeds(spec, steps):
        for s in seeds:
            rows.append({"prompt": [{"role": "system", "content": spec["system_prompt"]}, {"role": "user", "content": env.reset(s)}], "seed": s})
    return rows


def trl_model(model_dir: str):
    """The tokenizer and fp32 model TRL trains, with the fix-ups recursa's load_policy applies
    (no-ops for the models used here)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    if tokenizer.chat_template is None:
        from recursa.models import CHATML_TEMPLATE

        tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer, model


def trl_reward(spec: dict):
    """The setting's env reward on a completion, keyed by the prompt's seed (a dataset column)."""

    def arithmetic_reward(prompts, completions, seed, **kwargs):
        out = []
        for completion, s in zip(completions, seed):
            text = completion[-1]["content"] if isinstance(completion, list) else completion
            e = make_setting_env(spec)
            e.reset(int(s))
            out.append(float(e.step(text).reward))
        return out

    return arithmetic_reward


def child_trl(spec: dict, model_dir: str, steps: int) -> dict:
    import torch

    torch.set_num_threads(THREADS)
    t_start = time.perf_counter()
    from datasets import Dataset
    from transformers import TrainerCallback
    from transformers.utils import logging as hf_logging
    from trl import GRPOConfig, GRPOTrainer

    hf_logging.set_verbosity_error()
    device = spec.get("device", COMMON["device"])
    torch.manual_seed(COMMON["seed"])
    tokenizer, model = trl_model(model_dir)
    params = param_counts(model)
    dataset = Dataset.from_list(trl_rows(spec, steps))
    arithmetic_reward = trl_reward(spec)

    class Timer(TrainerCallback):
        def __init__(self) -> None:
            self.step_s: list[float] = []
            self.threads: list[int] = []
            self.logs: list[dict] = []
            self._t0 = 0.0

        def on_step_begin(self, args, state, control, **kwargs):
            _sync(device)
            self._t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            _sync(device)
            self.step_s.append(time.perf_counter() - self._t0)
            self.threads.append(torch.get_num_threads())

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "reward" in logs:
                self.logs.append(dict(logs))

    rollout_s: list[float] = []

    class TimedGRPOTrainer(GRPOTrainer):
        """GRPOTrainer that also records how long generation + scoring takes (no other change)."""

        def _generate_and_score_completions(self, inputs):
            _sync(device)
            t = time.perf_counter()
            out = super()._generate_and_score_completions(inputs)
            _sync(device)
            rollout_s.append(time.perf_counter() - t)
            return out

    timer = Timer()
    with tempfile.TemporaryDirectory(prefix="vs_trl_") as tmp:
        args = GRPOConfig(**trl_config_kwargs(spec, steps, tmp))
        trainer = TimedGRPOTrainer(
            model=model,
            reward_funcs=arithmetic_reward,
            args=args,
            train_dataset=dataset,
            processing_class=tokenizer,
            callbacks=[timer],
        )
        torch.set_num_threads(THREADS)
        init_s = time.perf_counter() - t_start
        trainer.train()

    n = spec["prompts_per_step"] * spec["group_size"]
    if len(timer.logs) != steps or len(timer.step_s) != steps:
        raise RuntimeError(f"TRL ran {len(timer.step_s)} steps and logged {len(timer.logs)}; expected {steps}")
    rec: dict = {"step_s": timer.step_s, "threads": timer.threads}
    rec["rollout_s"] = rollout_s if len(rollout_s) == steps else None
    rec["update_s"] = [a - b for a, b in zip(timer.step_s, rec["rollout_s"])] if rec["rollout_s"] else None
    rec["reward"] = [lg["reward"] for lg in timer.logs]
    rec["completion_tokens"] = [round(lg["completions/mean_length"] * n) for lg in timer.logs]
    # `num_tokens` is TRL's running count of prompt + completion tokens over all sequences
    seen = [int(lg["num_tokens"]) for lg in timer.logs]
    totals = [b - a for a, b in zip([0] + seen[:-1], seen)]
    rec["prompt_tokens"] = [t - c for t, c in zip(totals, rec["completion_tokens"])]
    rec["gen_flops"], rec["update_flops"] = [], []
    for lg, p, c in zip(timer.logs, rec["prompt_tokens"], rec["completion_tokens"]):
        cmax = int(round(lg["completions/max_length"]))
        # transformers' generate: every row prefills its own copy of the prompt, and every row
        # keeps decoding (padding after EOS) until the longest one stops.
        rec["gen_flops"].append(generation_flops(params, p + n * max(cmax - 1, 0), n * cmax))
        rec["update_flops"].append(update_flops(params, p + c, c))
    rec.update(framework="trl", n_sequences=n, params=params, init_s=init_s, peak_rss_mb=peak_rss_mb(), peak_gpu_mb=peak_gpu_mb())
    return rec


def child_trl_run(spec: dict, model_dir: str, steps: int, rows_path: str, out_dir: str) -> dict:
    """A whole TRL run as a user's script plays it: imports, model and dataset load, `steps`
    steps of `GRPOTrainer` with the step benchmark's `GRPOConfig`, the trained model saved
    (as TRL's own example scripts end). No callbacks: the parent times the process."""
    import torch

    torch.set_num_threads(THREADS)
    from datasets import Dataset
    from transformers.utils import logging as hf_logging
    from trl import GRPOConfig, GRPOTrainer

    hf_logging.set_verbosity_error()
    torch.manual_seed(COMMON["seed"])
    tokenizer, model = trl_model(model_dir)
    dataset = Dataset.from_list(json.loads(Path(rows_path).read_text()))
    args = GRPOConfig(**trl_config_kwargs(spec, steps, out_dir))
    trainer = GRPOTrainer(model=model, reward_funcs=trl_reward(spec), args=args, train_dataset=dataset, processing_class=tokenizer)
    torch.set_num_threads(THREADS)
    trainer.train()
    trainer.save_model(str(Path(out_dir) / "final"))
    return {"steps": trainer.state.global_step, "reward": [lg["reward"] for lg in trainer.state.log_history if "reward" in lg]}


# ----------------------------------------------------------------------------- parent


def child_env() -> dict:
    """The environment of every child process: the thread count pinned, no hub access."""
    return dict(os.environ, OMP_NUM_THREADS=str(THREADS), MKL_NUM_THREADS=str(THREADS), TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1",
                TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1", PYTHONWARNINGS="ignore")


def with_variant(framework: str, spec: dict) -> tuple[str, dict]:
    """The child that plays `framework` and its spec: a decode variant is recursa with its decode dtype."""
    if framework.startswith(VARIANT_PREFIX):
        return "recursa", {**spec, "decode_dtype": framework.removeprefix(VARIANT_PREFIX)}
    return framework, spec


def run_child(framework: str, spec: dict, model_dir: str, steps: int, timeout: float) -> dict:
    """One run in its own interpreter; `framework` is recursa, trl or a decode variant of recursa."""
    child, spec = with_variant(framework, spec)
    with tempfile.TemporaryDirectory(prefix="vs_trl_child_") as tmp:
        result = Path(tmp) / "result.json"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--_child", child, "--_spec", json.dumps(spec), "--_model-dir", model_dir, "--steps", str(steps), "--_result", str(result)]
        env = child_env()
        t = time.perf_counter()
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
        wall = time.perf_counter() - t
        if proc.returncode != 0 or not result.exists():
            tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-25:])
            raise RuntimeError(f"{framework} run failed (exit {proc.returncode}):\n{tail}")
        rec = json.loads(result.read_text())
    rec["wall_s"] = wall
    return rec


def recursa_command() -> list[str]:
    """How a user launches recursa: the `recursa` console script beside this interpreter (else `python -m recursa.cli`)."""
    script = Path(sys.executable).parent / "recursa"
    return [str(script)] if script.exists() else [sys.executable, "-m", "recursa.cli"]


def count_recursa_steps(run_dir: Path) -> int:
    """Training steps a `recursa train` run logged (its metrics.jsonl rows with a step reward)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return len({r["step"] for r in rows if "reward/mean" in r})


def run_whole(framework: str, spec: dict, model_dir: str, steps: int, timeout: float) -> dict:
    """A whole run of `steps` steps as a user launches it, timed from process start to exit
    (interpreter start, imports, model load, the steps, saving the trained weights):
    recursa: `recursa train CONFIG --out DIR` on whole_run_toml(); TRL: child_trl_run."""
    child, spec = with_variant(framework, spec)
    with tempfile.TemporaryDirectory(prefix="vs_trl_run_") as tmp:
        tmp = Path(tmp)
        env = child_env()
        env["PYTHONPATH"] = os.pathsep.join(x for x in (str(REPO / "benchmarks"), env.get("PYTHONPATH")) if x)  # the agent env's factory
        if child == "recursa":
            config = tmp / "run.toml"
            config.write_text(whole_run_toml(spec, model_dir, steps))
            cmd = [*recursa_command(), "train", str(config), "--out", str(tmp / "run")]
        else:
            rows = tmp / "rows.json"
            rows.write_text(json.dumps(trl_rows(spec, steps)))
            cmd = [sys.executable, str(Path(__file__).resolve()), "--_child", "trl-run", "--_spec", json.dumps(spec), "--_model-dir", model_dir,
                   "--steps", str(steps), "--_rows", str(rows), "--_out-dir", str(tmp / "trl"), "--_result", str(tmp / "result.json")]
        t = time.perf_counter()
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
        wall = time.perf_counter() - t
        if proc.returncode != 0:
            tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-25:])
            raise RuntimeError(f"{framework} whole run failed (exit {proc.returncode}):\n{tail}")
        done = count_recursa_steps(tmp / "run") if child == "recursa" else json.loads((tmp / "result.json").read_text())["steps"]
    if done != steps:
        raise RuntimeError(f"{framework} whole run trained {done} steps; expected {steps}")
    return {"wall_s": wall, "steps": done}


def spread(values: list) -> dict | None:
    """A ratio over repeats: each repeat's value, their median and their range (None: nothing measured)."""
    vals = [v for v in values if v is not None]
    if not vals:
        return None
    return {"by_repeat": values, "median": statistics.median(vals), "min": min(vals), "max": max(vals), "n": len(vals)}


def ratio_by_repeat(baseline: list, entry: list) -> list:
    """baseline time / entry time, repeat by repeat (> 1: the entry is faster); None where either is missing."""
    return [b / e if (b and e) else None for b, e in zip(baseline, entry)]


def _median(xs):
    return statistics.median(xs) if xs else None


def summarise(runs: list[dict], peak_gflops: float) -> dict:
    """Pool the repeats of one framework in one setting."""
    warm = [r["step_s"][0] for r in runs]
    rest = [x for r in runs for x in r["step_s"][1:]]
    n_seq = runs[0]["n_sequences"]
    out: dict = {
        "warmup_s_per_step": _median(warm),
        "warmup_s_per_step_all": warm,
        "median_s_per_step": _median(rest),
        "s_per_step_all": [r["step_s"] for r in runs],
        "median_s_per_step_by_repeat": [_median(r["step_s"][1:]) for r in runs],
        "steps_timed": len(rest),
        "init_s": _median([r["init_s"] for r in runs]),
        "peak_rss_mb": max(r["peak_rss_mb"] for r in runs),
        "peak_rss_mb_all": [r["peak_rss_mb"] for r in runs],
        "peak_gpu_mb": max((r["peak_gpu_mb"] for r in runs if r.get("peak_gpu_mb") is not None), default=None),
        "threads": sorted({t for r in runs for t in r["threads"]}),
        "params": runs[0]["params"],
        "mean_prompt_tokens": statistics.mean(p / n_seq for r in runs for p in r["prompt_tokens"]),
        "mean_completion_tokens": statistics.mean(c / n_seq for r in runs for c in r["completion_tokens"]),
        "reward_curve": [statistics.mean(v) for v in zip(*[r["reward"] for r in runs])],
        "reward_curve_all": [r["reward"] for r in runs],
    }
    # throughput and FLOP rates over the non-warm-up steps (per-step ratios, then the median)
    def per_step(key_num, key_den, scale=1.0):
        vals = [r[key_num][i] * scale / r[key_den][i] for r in runs if r.get(key_num) and r.get(key_den) for i in range(1, len(r["step_s"]))]
        return _median(vals)

    for r in runs:
        r["trained_tokens"] = [p + c for p, c in zip(r["prompt_tokens"], r["completion_tokens"])]
    out["gen_tokens_per_s"] = per_step("completion_tokens", "step_s")
    out["trained_tokens_per_s"] = per_step("trained_tokens", "step_s")
    out["median_rollout_s"] = _median([x for r in runs if r.get("rollout_s") for x in r["rollout_s"][1:]])
    out["median_update_s"] = _median([x for r in runs if r.get("update_s") for x in r["update_s"][1:]])
    gen = per_step("gen_flops", "rollout_s", 1e-9)
    upd = per_step("update_flops", "update_s", 1e-9)
    out["gen_model_gflops"] = gen
    out["update_model_gflops"] = upd
    out["mfu_gen"] = gen / peak_gflops if gen is not None else None
    out["mfu_update"] = upd / peak_gflops if upd is not None else None
    gaps = [x for r in runs for x in r.get("logprob_mismatch", [])[1:] if x == x]  # the sampler's log-prob gap to the trainer's (NaN: none measured)
    out["logprob_mismatch"] = statistics.mean(gaps) if gaps else None
    return out


def frameworks_of(res: dict) -> list[str]:
    """The frameworks measured in one setting's result, in table order: recursa, its decode variants, TRL."""
    variants = sorted(k for k in res if k.startswith(VARIANT_PREFIX) and isinstance(res[k], dict))
    return [fw for fw in ("recursa", *variants, "trl") if res.get(fw)]


def _fmt(x, spec="{:.2f}"):
    return "n/a" if x is None else spec.format(x)


def _spread_text(sp: dict | None) -> tuple[str, str]:
    """(each repeat's ratio, 'median [min-max]') of a spread, or n/a."""
    if sp is None:
        return "n/a", "n/a"
    each = ", ".join(_fmt(x) for x in sp["by_repeat"])
    return each, f"**{sp['median']:.2f}x** [{sp['min']:.2f}-{sp['max']:.2f}]"


def run_orders(schedule: list[dict]) -> list[list[str]]:
    """The order the entries' step runs took in each repeat (the first setting's), read from the schedule."""
    first = schedule[0]["setting"] if schedule else None
    orders: dict[int, list[str]] = {}
    for e in schedule:
        if e["setting"] == first and e["run"] == "steps":
            orders.setdefault(e["repeat"], []).append(e["framework"])
    return [orders[k] for k in sorted(orders)]


def markdown(results: dict) -> str:
    m = results["machine"]
    w = results.get("whole_run_steps", 0)
    mm0, mm1 = m["matmul_start"]["best_gflops"], m["matmul_end"]["best_gflops"]
    drift = m.get("matmul_drift", mm1 / mm0 - 1)
    lines = [
        "# recursa vs TRL: one GRPO step" + (" and a whole run" if w else ""),
        "",
        f"Run {results.get('started_utc', '?')} to {results.get('ended_utc', '?')}; torch {m['torch']}, transformers {m['transformers']}, "
        f"trl {m['trl'] or 'not installed'}, {m['threads']} threads, device {m.get('device', 'cpu')}{' (' + m['gpu'] + ')' if m.get('gpu') else ''}, "
        f"model `{results['model']}`, {results['steps']} steps x {results['repeats']} repeat(s)" + (f"; whole runs of {w} steps." if w else "."),
        "",
        f"Host fp32 matmul ({m['matmul_start']['n']}^3, best of {m['matmul_start']['reps']}): **{mm0:.1f} GFLOP/s at the start, {mm1:.1f} at the end** "
        f"({drift:+.0%}); MFU is against the higher of the two."
        + (" The rate moved by more than 10% during the run: another job shared the host, read the timings with care." if abs(drift) > 0.10 else ""),
        "",
        "Order (each entry its own process, back to back per setting, flipped every repeat): "
        + "; ".join(f"repeat {i + 1}: {', '.join(o)}" for i, o in enumerate(run_orders(results.get("schedule", [])))) + "."
        + (" The whole runs follow the step runs of their setting in the same order." if w else ""),
        "",
        "| setting | framework | prompt tok | warm-up s | median s/step | rollout s | update s | gen tok/s | trained tok/s | peak RSS MB | MFU gen | MFU update | mean reward |"
        + (f" whole run s ({w} steps) |" if w else ""),
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|" + ("---|" if w else ""),
    ]
    for name, res in results["settings"].items():
        for fw in frameworks_of(res):
            r = res[fw]
            lines.append(
                f"| {name} | {fw} | {r['mean_prompt_tokens']:.1f} | {_fmt(r['warmup_s_per_step'])} | {_fmt(r['median_s_per_step'], '{:.3f}')} | "
                f"{_fmt(r['median_rollout_s'])} | {_fmt(r['median_update_s'])} | {_fmt(r['gen_tokens_per_s'], '{:.1f}')} | "
                f"{_fmt(r['trained_tokens_per_s'], '{:.0f}')} | {r['peak_rss_mb']:.0f} | {_fmt(r['mfu_gen'], '{:.1%}')} | "
                f"{_fmt(r['mfu_update'], '{:.1%}')} | {statistics.mean(r['reward_curve']):.3f} |"
                + (f" {_fmt(r.get('whole_run_s'), '{:.1f}')} |" if w else "")
            )
    if any(res.get("ratios") for res in results["settings"].values()):
        lines += [
            "",
            ("Ratios, repeat by repeat (the baseline's time / the entry's time, > 1: the entry is faster; s/step: each run's median over its non-warm-up steps), "
             "then the median over repeats with its range:"),
            "",
            "| setting | entry vs baseline | s/step ratio per repeat | s/step ratio | whole-run ratio per repeat | whole-run ratio |",
            "|---|---|---|---|---|---|",
        ]
        for name, res in results["settings"].items():
            for pair, r in res.get("ratios", {}).items():
                step_each, step_mid = _spread_text(r["s_per_step"])
                whole_each, whole_mid = _spread_text(r["whole_run"])
                lines.append(f"| {name} | {pair} | {step_each} | {step_mid} | {whole_each} | {whole_mid} |")
    lines.append("")
    for name, res in results["settings"].items():
        if res.get("speedup") is not None:
            lines.append(f"- **{name}**: speedup {res['speedup']:.2f}x (TRL median s/step / recursa median s/step over all repeats' steps pooled, warm-up step excluded; > 1 means recursa is faster).")
        for fw, x in res.get("speedup_variants", {}).items():
            if x is not None:
                gap = res[fw]["logprob_mismatch"]
                lines.append(f"- **{name}**, {fw}: speedup {x:.2f}x over TRL ({res['speedup_vs_recursa'][fw]:.2f}x over float32 recursa; "
                             f"mean |log-prob gap| to the float32 trainer {_fmt(gap, '{:.4f}')} nats/token, corrected by TIS at cap {TIS_CAP}).")
    lines += ["", "MFU = model FLOP/s / measured fp32 matmul rate; see benchmarks/README.md for the FLOP formulas"
              + (" and for what the whole run includes (process start to exit: imports, model load, the steps, saving the weights)." if w else "."), ""]
    return "\n".join(lines)


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    names = list(results["settings"])
    fig, axes = plt.subplots(len(names), 2, figsize=(11, 3.6 * len(names)), squeeze=False)
    colors = {"recursa": "tab:blue", "trl": "tab:orange"}
    extra = iter(("tab:green", "tab:purple", "tab:brown"))
    for row, name in enumerate(names):
        res = results["settings"][name]
        ax = axes[row][0]
        for fw in frameworks_of(res):
            colors.setdefault(fw, next(extra, "tab:gray"))
            curve = res[fw]["reward_curve"]
            ax.plot(range(1, len(curve) + 1), curve, marker="o", label=fw, color=colors[fw])
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_title(f"{name}: mean reward per step")
        ax.set_xlabel("step")
        ax.set_ylabel("reward")
        ax.legend()
        ax = axes[row][1]
        fws = [fw for fw in frameworks_of(res) if res[fw]["median_s_per_step"] is not None]
        vals = [res[fw]["median_s_per_step"] for fw in fws]
        ax.bar(fws, vals, color=[colors[fw] for fw in fws])
        for i, v in enumerate(vals):
            ax.text(i, v, f"{v:.2f}s", ha="center", va="bottom")
        if vals:
            ax.set_ylim(0, max(vals) * 1.15)
        ax.set_title(f"{name}: median seconds per step (lower is better)")
        ax.set_ylabel("s/step")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def prepare_model_dir(name: str, tmp: Path) -> str:
    """A local HF directory both frameworks load: the embedded model's cache directory, or
    the tiny random model saved with save_pretrained (+ its tokenizer)."""
    from recursa.models import EMBEDDED_NAME, TINY_NAME, embedded_model_dir, load_policy

    if name == EMBEDDED_NAME:
        return str(embedded_model_dir())
    if name == TINY_NAME:
        import torch

        from recursa.config import ModelConfig

        torch.set_num_threads(THREADS)
        policy = load_policy(ModelConfig(name=TINY_NAME))
        out = tmp / "tiny-random"
        policy.model.save_pretrained(out)
        policy.tokenizer.save_pretrained(out)
        return str(out)
    return name


def versions() -> dict:
    import torch
    import transformers

    trl_version = None
    if importlib.util.find_spec("trl") is not None:
        from importlib.metadata import version

        trl_version = version("trl")
    return {"torch": torch.__version__, "transformers": transformers.__version__, "trl": trl_version}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--settings", default="short,agent", help="comma-separated: " + ",".join(SETTINGS))
    ap.add_argument("--steps", type=int, default=None, help="training steps per run (the first is reported as warm-up); default 10, smoke 2")
    ap.add_argument("--repeats", type=int, default=None, help="runs per framework and setting, alternating order; default 3, smoke 1")
    ap.add_argument("--model", default=None, help="smollm2-135m-instruct (default), tiny-random, or a local HF directory")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results"), help="output directory")
    ap.add_argument("--smoke", action="store_true", help="tiny random model, 2 steps, short setting, tiny lengths (CI)")
    ap.add_argument("--recursa-only", action="store_true", help="measure only recursa (TRL not needed)")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds allowed for one run")
    ap.add_argument("--recursa-decode", choices=("bfloat16", "int8"), help="also run recursa sampling with this low-precision copy of the weights "
                    "(rollout.decode_dtype; the trainer stays float32, TIS corrects the gap), reported as its own entry")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where both frameworks train (default cpu; cuda: recursa model.device, TRL use_cpu=False)")
    ap.add_argument("--whole-run-steps", type=int, default=None, help="steps of the whole-run column: each framework also plays a run of this many "
                    "steps as a user launches it (recursa train / a TRL script), timed from process start to exit; 0 = no column; default 3, smoke 2")
    ap.add_argument("--_child", choices=(*FRAMEWORKS, "trl-run"), help=argparse.SUPPRESS)
    ap.add_argument("--_spec", help=argparse.SUPPRESS)
    ap.add_argument("--_model-dir", dest="model_dir", help=argparse.SUPPRESS)
    ap.add_argument("--_result", help=argparse.SUPPRESS)
    ap.add_argument("--_rows", help=argparse.SUPPRESS)
    ap.add_argument("--_out-dir", dest="out_dir", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)

    if a._child:
        spec = json.loads(a._spec)
        if a._child == "trl-run":
            rec = child_trl_run(spec, a.model_dir, a.steps, a._rows, a.out_dir)
        else:
            rec = (child_recursa if a._child == "recursa" else child_trl)(spec, a.model_dir, a.steps)
        Path(a._result).write_text(json.dumps(rec))
        return 0

    with_trl = not a.recursa_only
    if with_trl and importlib.util.find_spec("trl") is None:
        print("TRL is not installed: `pip install -e .[bench]` (trl==1.16.0), or pass --recursa-only.", file=sys.stderr)
        return 2
    if a.smoke:
        settings = {"short": dict(SMOKE_SETTING, device=a.device)}
        steps, repeats, model = a.steps or 2, a.repeats or 1, a.model or "tiny-random"
        whole_steps = 2 if a.whole_run_steps is None else a.whole_run_steps
    else:
        names = [s.strip() for s in a.settings.split(",") if s.strip()]
        unknown = [s for s in names if s not in SETTINGS]
        if unknown or not names:
            ap.error(f"unknown setting(s) {unknown}; choose from {list(SETTINGS)}")
        settings = {s: dict(SETTINGS[s], device=a.device) for s in names}
        steps, repeats, model = a.steps or 10, a.repeats or 3, a.model or "smollm2-135m-instruct"
        whole_steps = 3 if a.whole_run_steps is None else a.whole_run_steps
    if steps < 2:
        ap.error("--steps must be >= 2 (the first step is reported separately as warm-up)")
    if repeats < 1:
        ap.error("--repeats must be >= 1")
    if whole_steps < 0:
        ap.error("--whole-run-steps must be >= 0 (0: no whole-run column)")
    frameworks = list(FRAMEWORKS) if with_trl else ["recursa"]
    if a.recursa_decode:
        frameworks.insert(1, VARIANT_PREFIX + a.recursa_decode)
    out_dir = Path(a.out)
    out_dir.mkdir(parents=True, exist_ok=True)

    import torch

    torch.set_num_threads(THREADS)
    if a.device == "cuda" and not torch.cuda.is_available():
        print(f"--device cuda: torch {torch.__version__} sees no CUDA GPU", file=sys.stderr)
        return 2
    started = datetime.now(UTC)
    mm_start = matmul_gflops(device=a.device)
    print(f"fp32 matmul at start: {mm_start['best_gflops']:.1f} GFLOP/s on {a.device if a.device != 'cpu' else f'{THREADS} threads'}", flush=True)
    runs: dict[str, dict[str, list]] = {s: {fw: [] for fw in frameworks} for s in settings}
    whole: dict[str, dict[str, list]] = {s: {fw: [] for fw in frameworks} for s in settings}
    schedule: list[dict] = []  # every child process in the order it ran
    with tempfile.TemporaryDirectory(prefix="vs_trl_model_") as tmp:
        model_dir = prepare_model_dir(model, Path(tmp))
        for rep in range(repeats):
            order = frameworks if rep % 2 == 0 else frameworks[::-1]
            for name, spec in settings.items():
                for fw in order:
                    at = datetime.now(UTC).isoformat(timespec="seconds")
                    rec = run_child(fw, spec, model_dir, steps, a.timeout)
                    runs[name][fw].append(rec)
                    schedule.append({"repeat": rep, "setting": name, "framework": fw, "run": "steps", "start_utc": at, "wall_s": rec["wall_s"]})
                    times = ", ".join(f"{x:.2f}" for x in rec["step_s"])
                    print(f"[repeat {rep + 1}/{repeats}] {name:5s} {fw:7s} s/step: {times}  reward: {', '.join(f'{x:.2f}' for x in rec['reward'])}  peak RSS {rec['peak_rss_mb']:.0f} MB"
                          + (f", peak GPU {rec['peak_gpu_mb']:.0f} MB" if rec.get("peak_gpu_mb") is not None else ""), flush=True)
                for fw in order if whole_steps else ():
                    at = datetime.now(UTC).isoformat(timespec="seconds")
                    w = run_whole(fw, spec, model_dir, whole_steps, a.timeout)
                    whole[name][fw].append(w["wall_s"])
                    schedule.append({"repeat": rep, "setting": name, "framework": fw, "run": "whole", "start_utc": at, "wall_s": w["wall_s"]})
                    print(f"[repeat {rep + 1}/{repeats}] {name:5s} {fw:7s} whole run of {whole_steps} steps: {w['wall_s']:.1f} s", flush=True)
    mm_end = matmul_gflops(device=a.device)
    ended = datetime.now(UTC)
    print(f"fp32 matmul at end: {mm_end['best_gflops']:.1f} GFLOP/s", flush=True)
    peak = max(mm_start["best_gflops"], mm_end["best_gflops"])

    results: dict = {
        "model": model,
        "steps": steps,
        "repeats": repeats,
        "whole_run_steps": whole_steps,
        "smoke": a.smoke,
        "started_utc": started.isoformat(timespec="seconds"),
        "ended_utc": ended.isoformat(timespec="seconds"),
        "frameworks": frameworks,
        "schedule": schedule,
        "settings": {},
        "machine": {
            "matmul_gflops": peak,
            "matmul_start": mm_start,
            "matmul_end": mm_end,
            "matmul_drift": mm_end["best_gflops"] / mm_start["best_gflops"] - 1,
            "threads": THREADS,
            "device": a.device,
            "gpu": torch.cuda.get_device_name(0) if a.device == "cuda" else None,
            "cpu_count": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            **versions(),
        },
    }
    for name, spec in settings.items():
        res: dict = {"settings": {**COMMON, **spec, "steps": steps, "repeats": repeats, "model": model, "trl_config": trl_config_kwargs(spec, steps, "<tmp>") if with_trl else None,
                                  "whole_run_steps": whole_steps, "whole_run_config": whole_run_toml(spec, "<model dir>", whole_steps) if whole_steps else None}}
        for fw in frameworks:
            res[fw] = summarise(runs[name][fw], peak)
            res[fw]["whole_run_s_all"] = whole[name][fw]
            res[fw]["whole_run_s"] = _median(whole[name][fw])
        if not with_trl:
            res["trl"] = None
        res["mean_prompt_tokens"] = res["recursa"]["mean_prompt_tokens"]
        rs = res["recursa"]["median_s_per_step"]
        ts = res["trl"]["median_s_per_step"] if with_trl else None
        res["speedup"] = ts / rs if (rs and ts) else None
        variants = [fw for fw in frameworks if fw.startswith(VARIANT_PREFIX)]
        if variants:
            vs = {fw: res[fw]["median_s_per_step"] for fw in variants}
            res["speedup_variants"] = {fw: ts / v if (v and ts) else None for fw, v in vs.items()}
            res["speedup_vs_recursa"] = {fw: rs / v if (v and rs) else None for fw, v in vs.items()}
        # the ratios repeat by repeat (the two runs of a pair ran back to back), with their median and range
        pairs = [(fw, "trl") for fw in frameworks if fw != "trl" and with_trl] + [(fw, "recursa") for fw in variants]
        res["ratios"] = {
            f"{fw} vs {base}": {
                "s_per_step": spread(ratio_by_repeat(res[base]["median_s_per_step_by_repeat"], res[fw]["median_s_per_step_by_repeat"])),
                "whole_run": spread(ratio_by_repeat(whole[name][base], whole[name][fw])) if whole_steps else None,
            }
            for fw, base in pairs
        }
        results["settings"][name] = res
    # the requested top-level shape: {"<setting>": {...}, "machine": {...}}
    meta = ("model", "steps", "repeats", "whole_run_steps", "smoke", "started_utc", "ended_utc", "frameworks", "schedule")
    flat = {**results["settings"], "machine": results["machine"], "meta": {k: results[k] for k in meta}}
    (out_dir / "vs_trl.json").write_text(json.dumps(flat, indent=2))
    md = markdown(results)
    (out_dir / "vs_trl.md").write_text(md)
    plot(results, out_dir / "vs_trl.png")
    print()
    print(md)
    print(f"wrote {out_dir / 'vs_trl.json'}, {out_dir / 'vs_trl.md'}, {out_dir / 'vs_trl.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
