"""Pieces every recipe uses: seeded generators, the optimizer and its schedule, warm starts,
held-out evaluation into the run store, and the supervised (imitation) update.

Each recipe still writes its own loop out; these are the primitives it calls.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from recursa.config import dump_config, resolve_auto, step_episodes
from recursa.distributed import ddp
from recursa.distributed.ddp import SINGLE, DataParallel, SingleProcess
from recursa.distributed.precision import learner_forward  # issue 47: train.precision / activation_checkpointing
from recursa.envs import EnvPool
from recursa.envs.dataset import task_factory
from recursa.envs.base import split_seeds
from recursa.errors import UserError
from recursa.evaluate import EvalResult, evaluate
from recursa.generation import sequence_logprobs
from recursa.models import Policy, count_parameters, load_policy, resolve_device
from recursa.rollout import is_agent_env
from recursa.runio import atomic_write_text, fault_point
from recursa.store import RunStore, finished_checkpoints, run_checkpoint  # noqa: F401  (run_checkpoint: re-exported)
from recursa.tracking import open_trackers
from recursa.trajectory import TrainBatch

Progress = Callable[[str, int, int], None]  # (phase, done, total)


def supervision_of(cfg):
    """How the run's env pool supervises its games (env.step_timeout, env.max_restarts)."""
    from recursa.envs.supervise import Supervision

    return Supervision(step_timeout=cfg.env.step_timeout, max_restarts=cfg.env.max_restarts)


def memory_estimate(cfg, policy: Policy) -> tuple[int, str]:
    """A lower bound of the bytes a run needs at once, and what it counts: the weights, their
    gradients and AdamW's two moments (16 bytes per trainable float32 parameter, the
    dtype's size for frozen ones), plus the KV cache and float32 logits of the largest
    generation batch (a step's B x G rollouts or an evaluation batch), each row counted at
    sampling.max_new_tokens + 256 prompt tokens. Prompts are often longer, so a run under
    the bound can still run out of memory; one over it cannot fit."""
    mc = policy.model.config
    layers = int(getattr(mc, "num_hidden_layers", 0) or 0)
    heads = int(getattr(mc, "num_attention_heads", 1) or 1)
    kv_heads = int(getattr(mc, "num_key_value_heads", heads) or heads)
    head_dim = int(getattr(mc, "head_dim", 0) or (getattr(mc, "hidden_size", 0) // heads))
    vocab = int(getattr(mc, "vocab_size", 0) or 0)
    elem = torch.finfo(getattr(torch, cfg.model.dtype)).bits // 8
    total, trainable = count_parameters(policy.model)
    weights = trainable * 16 + (total - trainable) * elem
    b = getattr(cfg.train, "prompts_per_step", None) or getattr(getattr(cfg, "rft", None), "tasks_per_round", 0) or 0
    g = getattr(cfg.train, "group_size", None) or getattr(getattr(cfg, "rft", None), "group_size", 1) or 1
    rows = max(b * g, cfg.eval.batch_size if cfg.eval.n else 0)
    tokens = cfg.sampling.max_new_tokens + 256
    kv = rows * tokens * 2 * layers * kv_heads * head_dim * elem
    logits = rows * vocab * 4
    need = weights + kv + logits
    what = (f"{rows} rows x {tokens} tokens of KV cache ({kv / 2**30:.1f} GiB) + logits ({logits / 2**30:.1f} GiB) + weights, "
            f"gradients and optimizer state ({weights / 2**30:.1f} GiB)")
    return need, what


def check_memory(cfg, policy: Policy) -> None:
    """Refuse (UserError) a run whose `memory_estimate` exceeds the device's whole memory
    (a GPU's, or the machine's RAM on the CPU)."""
    import os

    need, what = memory_estimate(cfg, policy)
    if policy.device.type == "cuda":
        have = torch.cuda.get_device_properties(policy.device).total_memory
        where = f"{policy.device}'s memory"
    else:
        try:
            have = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            return
        where = "this machine's RAM"
    if need > have:
        raise UserError(
            f"this run needs at least {need / 2**30:.1f} GiB ({what}), more than {where} ({have / 2**30:.1f} GiB): lower "
            "train.prompts_per_step x train.group_size, eval.batch_size or sampling.max_new_tokens"
        )


def check_finite(step: int, **values) -> None:
    """Stop the run with a one-line UserError naming the step when a value (a tensor or a
    number: advantages, a teacher's scale, the loss, the gradient norm) is NaN or infinite,
    before it reaches the weights of a checkpoint. Costs one host sync per value."""
    import math

    for name, value in values.items():
        ok = bool(torch.isfinite(value).all()) if isinstance(value, torch.Tensor) else math.isfinite(float(value))
        if not ok:
            raise UserError(
                f"step {step}: {name} is NaN or infinite, so training stopped before writing it into any checkpoint: lower train.lr "
                "(or raise train.max_grad_norm's strictness), check the env's rewards, then resume from the last checkpoint with --resume"
            )


def step_generator(seed: int, step: int) -> torch.Generator:
    """The generator for every random draw of step (or round, or epoch) `step`. It lives on
    the CPU whatever the policy's device: shuffles and choices are drawn on the host, and
    sampling on a GPU seeds a GPU generator from it (`generation.uniform_source`)."""
    return torch.Generator(device="cpu").manual_seed(seed * 1_000_003 + step)


def device_name(device: torch.device) -> str:
    """'cpu', or 'cuda:0 (NVIDIA H200)': what the model line of a run's log says."""
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    return str(device)


def lr_at(cfg, opt_step: int) -> float:
    """Constant learning rate after a linear warm-up over `train.warmup_steps` optimizer steps."""
    if cfg.train.warmup_steps and opt_step < cfg.train.warmup_steps:
        return cfg.train.lr * (opt_step + 1) / cfg.train.warmup_steps
    return cfg.train.lr


def make_optimizer(params: list[torch.nn.Parameter], cfg) -> torch.optim.Optimizer:
    """AdamW, with the fused kernel where this torch build has one (same update, one pass)."""
    kwargs = dict(lr=cfg.train.lr, betas=cfg.train.betas, weight_decay=cfg.train.weight_decay)
    try:
        return torch.optim.AdamW(params, fused=True, **kwargs)
    except (RuntimeError, TypeError, ValueError):
        return torch.optim.AdamW(params, **kwargs)


def init_weights_dir(cfg) -> Path | None:
    """The checkpoint named by `init.from_run` / `init.checkpoint`, or None (the model's own
    weights). The run must have trained the same base model and have that checkpoint."""
    if not cfg.init.from_run:
        return None
    return run_checkpoint(cfg.init.from_run, cfg.init.checkpoint, cfg.model.name, "init.from_run", "init.checkpoint")


@dataclass
class OpenedRun:
    """What every recipe starts from: envs, the run store, the policy and its optimizer,
    restored from the last checkpoint when resuming."""

    pool: EnvPool  # env instances, reused all run (a TextWorldExpress env owns a JVM)
    store: RunStore
    policy: Policy
    optimizer: torch.optim.Optimizer
    multi_turn: bool  # the task is a multi-turn game (AgentEnv)
    init_dir: Path | None  # the warm start's checkpoint (init.from_run), or None
    state: dict  # the resumed checkpoint's state.json ({} for a new run)
    learner: DataParallel | SingleProcess = SINGLE  # where updates run: this process, or every rank under torchrun (rank 0 drives)

    @property
    def start_step(self) -> int:
        return int(self.state.get("step", 0))

    @property
    def opt_steps(self) -> int:
        return int(self.state.get("opt_steps", 0))

    @property
    def origin(self) -> str:
        return f" from {self.init_dir}" if self.init_dir is not None else ""


def open_run(cfg, out: Path, resume: bool, log: Callable[[str], None], kl_reference: bool = False, detail: str = "",
             single_turn_error: str | None = None) -> OpenedRun:
    """Set threads and seeds, make the envs (failing fast on a bad task spec), open the
    run store, write the resolved config (new runs), load the policy (warm start, then the
    run's own last checkpoint when resuming) and its optimizer, restore the optimizer and
    RNG state, and drop every log line after the checkpoint. With `kl_reference`, the
    frozen reference is the initial policy (the warm start, if any), never a checkpoint.
    `single_turn_error`: a setting that needs a multi-turn game refuses a single-turn task with
    this one-line message, before the run directory is touched."""
    resolve_device(cfg.model.device)  # a GPU asked for and missing fails here, before the run directory is touched
    torch.set_num_threads(cfg.run.threads)
    torch.manual_seed(cfg.train.seed)
    pool = EnvPool(task_factory(cfg), supervision=supervision_of(cfg))  # env.name or the [data] rows; crashed / hung games are restarted
    multi_turn = is_agent_env(pool.take(1)[0])
    resolve_auto(cfg, multi_turn)  # rollout settings left at 'auto': the fast path for games (issue 46), written to config.toml resolved
    if single_turn_error is not None and not multi_turn:
        pool.close()
        raise UserError(single_turn_error)
    init_dir = init_weights_dir(cfg)
    store = RunStore(out, keep_last=cfg.run.keep_last)  # takes the run directory's lock
    try:
        store.trackers = open_trackers(cfg, out)  # opened once the directory is ours
        return _open_store(cfg, out, resume, log, kl_reference, detail, pool, multi_turn, init_dir, store)
    except BaseException:
        store.close()  # the run directory's lock is released; nothing half-opened stays behind
        pool.close()
        raise


def _open_store(cfg, out: Path, resume: bool, log: Callable[[str], None], kl_reference: bool, detail: str, pool: EnvPool, multi_turn: bool,
                init_dir: Path | None, store: RunStore) -> OpenedRun:
    """The rest of `open_run`, once the run store is open (and locked)."""
    if store.lock.stale:
        log(f"took over the lock of {out} from pid {store.lock.stale.get('pid')}, which is no longer running")
    ckpt = None
    if resume:
        store.reconcile(log)  # ledger, checkpoints and evaluations agree again after any crash
        ckpt = store.resume_checkpoint(log)  # a corrupt latest checkpoint falls back to the previous good one
    else:
        atomic_write_text(out / "config.toml", dump_config(cfg))
        fault_point("config.written")
    policy = load_policy(cfg.model, weights_dir=ckpt, base_dir=init_dir)
    check_memory(cfg, policy)  # refuse what cannot fit before the first step, not hours into it
    if kl_reference:
        if ckpt is not None and not policy.is_lora:
            init = load_policy(cfg.model, base_dir=init_dir)
            init.enable_reference()
            policy.reference = init.reference
        else:
            policy.enable_reference()
    optimizer = make_optimizer([p for p in policy.model.parameters() if p.requires_grad], cfg)
    state: dict = {}
    if ckpt is not None:
        state = store.load_state(ckpt, optimizer)
        store.truncate_after(state["step"])
        log(f"resumed {out} from {ckpt.name}")
    elif resume:
        store.truncate_after(0)
        log(f"no checkpoint in {out}: starting from the beginning")
    learner = ddp.active() or SINGLE
    if isinstance(learner, DataParallel):
        learner.hello(cfg, policy)  # the workers build the same model; the first update sends them these weights
    run = OpenedRun(pool, store, policy, optimizer, multi_turn, init_dir, state, learner)
    total, trainable = count_parameters(policy.model)
    log(
        f"model {cfg.model.name}{run.origin}: {total / 1e6:.1f}M parameters, {trainable / 1e6:.1f}M trainable, "
        f"{cfg.model.dtype} on {device_name(policy.device)}; task {cfg.env.name}{detail}"
        + (f"; data-parallel learner on {learner.world_size} processes" if learner.world_size > 1 else "")
    )
    return run


Hints = Callable[[list[int]], list[str | None]]  # seeds -> the hint shown with each (RSIPO's skills.in_context)


def eval_before(run: OpenedRun, cfg, progress: Progress | None, log: Callable[[str], None], hints: Hints | None = None, engine=None) -> None:
    """The held-out evaluation before training (eval/before.json), once per run."""
    if run.start_step == 0 and cfg.eval.before and cfg.eval.n > 0 and not (run.store.path / "eval" / "before.json").exists():
        r = run_eval(run.policy, cfg, run.pool, run.store, 0, "before", progress, hints=hints, engine=engine)
        log(f"before: success {r.success_rate:.3f} [{r.ci95[0]:.3f}, {r.ci95[1]:.3f}] on {r.n} {cfg.eval.split} items")


def budget_left(cfg, sampled: int) -> bool:
    """Whether another step (up to `config.step_episodes` episodes before RSIPO's capped
    re-rolls) fits under `train.max_episodes` after the `sampled` episodes so far (always,
    without a cap)."""
    cap = cfg.train.max_episodes
    return cap is None or sampled + step_episodes(cfg) <= cap


def ends_run(cfg, done: int, sampled: int, log: Callable[[str], None]) -> bool:
    """Whether step `done` is the run's last: train.steps reached, or no further step fits
    under train.max_episodes (logged, since the run then ends before train.steps)."""
    if done == cfg.train.steps:
        return True
    if budget_left(cfg, sampled):
        return False
    log(f"train.max_episodes = {cfg.train.max_episodes}: {sampled} episodes sampled, another step would pass the cap; the run ends at step {done}")
    return True


def mid_eval_due(cfg, done: int, total: int) -> bool:
    """Whether the held-out evaluation every `eval.every` steps (rounds) falls after step `done`
    of `total` (the last step's is the `after` evaluation)."""
    return bool(cfg.eval.every) and 0 < done < total and done % cfg.eval.every == 0 and cfg.eval.n > 0


def mid_eval(policy: Policy, cfg, pool: EnvPool, store: RunStore, done: int, progress: Progress | None, gate, log: Callable[[str], None],
             hints: Hints | None = None, engine=None, unit: str = "") -> None:
    """The evaluation every `eval.every` steps (eval/step_<done>.json), logged as `eval @ <unit><done>`.
    The recipes run it after that step's checkpoint, and again on resume when it is missing."""
    r = run_eval(policy, cfg, pool, store, done, f"step_{done:04d}", progress, gate, hints=hints, engine=engine)
    log(f"eval @ {unit}{done}: success {r.success_rate:.3f} [{r.ci95[0]:.3f}, {r.ci95[1]:.3f}]")


def mid_eval_missing(cfg, store: RunStore, start: int, total: int) -> bool:
    """A run resumed at step `start` whose evaluation there was due but is not in metrics.jsonl:
    the recipes checkpoint before that evaluation, so a kill during it loses no training and the
    resumed run evaluates first."""
    if not mid_eval_due(cfg, start, total):
        return False
    return not any(r.get("step") == start and "eval/success_rate" in r for r in store.read_jsonl("metrics"))


def eval_items(pool: EnvPool, split: str, n: int) -> int:
    """n, or fewer when the task has fewer items in `split` (a dataset's rows, `num_items`):
    an evaluation never scores the same row twice."""
    num_items = getattr(pool.take(1)[0], "num_items", None)
    return min(n, num_items(split)) if callable(num_items) else n


def run_eval(policy: Policy, cfg, pool: EnvPool, store: RunStore, step: int, label: str, progress: Progress | None, gate=None,
             hints: Hints | None = None, prefix: str = "eval", engine=None) -> EvalResult:
    """Greedy held-out evaluation; writes eval/<label>.json, the ledger row and <prefix>/* metrics
    (a second evaluation of the same step, e.g. RSIPO's with and without skills, logs under its
    own prefix). With a `WeightsGate`, an evaluation after training started is recorded as a
    test look. With `hints`, each item is shown the hint it gives for the item's seed. `engine`
    decodes (None: native), holding `policy`'s current weights."""
    ec = cfg.eval
    n = eval_items(pool, ec.split, ec.n)
    seeds = split_seeds(ec.split, n)
    result = evaluate(
        policy,
        pool,
        cfg.env.name,
        ec.split,
        n,
        ec.max_new_tokens or cfg.sampling.max_new_tokens,
        cfg.model.system_prompt or None,
        batch_size=ec.batch_size,
        stop=tuple(cfg.sampling.stop),
        label=label,
        progress=(lambda d, t: progress(f"eval {label}", d, t)) if progress else None,
        agent=cfg.agent,
        seeds=seeds,
        hints=hints(seeds) if hints is not None else None,
        engine=engine,
    )
    path = store.path / "eval" / f"{label}.json"
    before = store.path / "eval" / "before.json"
    look = None
    if gate is not None and label != "before" and before.exists():
        look = lambda: gate.look(step, label, EvalResult.load(before), result)  # noqa: E731
    lo, hi = result.ci95
    p = prefix
    metrics = {
        f"{p}/success_rate": result.success_rate, f"{p}/ci95_lo": lo, f"{p}/ci95_hi": hi, f"{p}/mean_reward": result.mean_reward,
        f"{p}/mean_steps": result.mean_steps, f"{p}/invalid_rate": result.invalid_rate, f"{p}/n": result.n, f"time/{p}_s": result.seconds,
    }
    store.save_eval(step, label, result, path, metrics, before_commit=look)  # file, ledger row, look and metrics, crash-safe
    return result


# ----------------------------------------------------------------------------- imitation


@dataclass
class SupervisedStats:
    loss: float  # mean negative log-likelihood per target token
    tokens: int  # target tokens in the batch
    rows: int
    grad_norm: float
    entropy: float  # mean policy entropy at target positions (detached)


def supervised_step(policy: Policy, optimizer: torch.optim.Optimizer, batch: TrainBatch, cfg, opt_step: int,
                    learner: DataParallel | SingleProcess = SINGLE) -> SupervisedStats:
    """One optimizer step of maximum likelihood on the batch's target tokens.

    loss = -sum_{i,t} mask_it log pi(x_it | x_i<t) / sum_{i,t} mask_it   (token mean over
    the whole batch, whatever the micro-batching). `batch.action_mask` marks the targets:
    the assistant's tokens only, never the prompt. Rows are micro-batched in order of
    length so that padding is small; the gradient does not depend on the grouping. With a
    `DataParallel` learner each rank runs a contiguous run of those micro-batches, still
    divided by the whole batch's token count, and rank 0 steps on the summed gradient.
    """
    tc = cfg.train
    num_tokens = int(batch.action_mask.sum().item())
    if num_tokens == 0:
        raise ValueError("a supervised batch needs at least one target token")
    learner.announce("supervised", batch=batch, opt_step=opt_step)
    learner.share_weights(policy)
    model = learner.model(policy)  # issue 47: the FSDP2 learner runs the forwards on its sharded copy
    model.train()
    for g in optimizer.param_groups:
        g["lr"] = lr_at(cfg, opt_step)
    optimizer.zero_grad(set_to_none=True)
    order = learner.shard(torch.argsort(batch.attention_mask.sum(dim=1), descending=True), tc.micro_batch_size)
    loss_sum, ent_sum = 0.0, 0.0
    for lo in range(0, len(order), tc.micro_batch_size):
        mb = batch.select(order[lo : lo + tc.micro_batch_size])
        logp, ent = learner_forward(sequence_logprobs, tc)(model, mb.input_ids, mb.attention_mask, mb.action_mask, 1.0, tc.logit_chunk, with_entropy=True)  # (n, L)
        nll = -(logp * mb.action_mask).sum()
        (nll / num_tokens).backward()
        loss_sum += float(nll.item())
        ent_sum += float((ent * mb.action_mask).sum().item())
    params = [p for p in model.parameters() if p.requires_grad]
    grad_norm = learner.step(optimizer, params, tc.max_grad_norm)
    loss_sum, ent_sum = learner.sum_stats([loss_sum, ent_sum])
    return SupervisedStats(loss_sum / num_tokens, num_tokens, len(batch), grad_norm, ent_sum / num_tokens)


def batch_order(n: int, batch_size: int, generator: torch.Generator) -> list[torch.Tensor]:
    """A seeded shuffle of n rows cut into optimizer batches (the last may be smaller)."""
    perm = torch.randperm(n, generator=generator, device="cpu")
    return [perm[i : i + batch_size] for i in range(0, n, batch_size)]
