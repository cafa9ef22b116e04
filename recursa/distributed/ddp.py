"""The data-parallel learner: one update's rows split across processes, same gradient.

Launch (every recipe; the update of grpo / rsipo and the supervised step of sft / rft
are shared):

    torchrun --nproc_per_node 2 -m recursa.cli train examples/smoke.toml --out runs/smoke_ddp

`learner.backend = "auto"` (the default) means data-parallel when torchrun set
WORLD_SIZE > 1, one process otherwise. Rank 0, the *driver*, runs the recipe exactly as a
one-process run does: rollouts, rewards, skills, evaluations, the gate, logs and
checkpoints; it alone touches the run directory. Every other rank is a *worker* (`recursa.distributed.worker.serve`)
that holds a copy of the model and joins each update:

    driver  announce    -> the batch, the step's generator state, the optimizer step count
                           (and RSIPO's imitation weights or distillation targets, the
                           outcomes REBEL, NFT and A*-PO read): every rank now holds the same
                           inputs, so every rank draws the same shuffles and picks the same rows
    all     share       <- rank 0's current weights (all of them, and the KL reference, the
                           first time; the trainable ones after that), so a gate rollback, a
                           resume or a warm start on rank 0 reaches the workers with no extra step
    all     score       -> old / reference log-probs when the update needs them: each rank
                           scores its share of the rows, an all-reduce assembles the table
    per optimizer step:
    all     rows        -> the mini-batch's rows to run (zero-advantage rows skipped as before),
                           in the order one process runs them, are cut into the micro-batches
                           one process would run, and rank r takes the r-th contiguous run of
                           whole micro-batches (`shard`): every micro-batch is exactly one of
                           the one-process run's, and a prompt group stays together, so its
                           shared prompt is still run once
    all     backward       with the loss normalised by the *whole* mini-batch's token and
                           sequence counts (`num_tokens`, `num_seqs`), as in one process, so the
                           per-rank gradients are partial sums of the one-process gradient
    all     reduce      -> the gradients summed onto rank 0 (parameters no rank touched keep no
                           gradient, as in one process)
    driver  step           clip the global norm, AdamW: only rank 0 holds optimizer state
    all     share       <- the new weights, before the next mini-batch's forward
    all     stats       -> loss / clip / KL / entropy sums and the largest ratio, reduced

Each micro-batch's gradient is computed once, by one rank, exactly as one process computes
it, so the summed gradient equals the one-process gradient up to the order of the float
additions across micro-batches; with two ranks and one micro-batch each it is the same
sum bit for bit (float addition commutes). Tested on two CPU processes over gloo
(tests/test_ddp.py): bit-identical gradients and weights after the step in that case;
otherwise gradients within rtol 1e-5 / atol 1e-7, and the weights too when AdamW's eps is
large enough not to amplify rounding in near-zero gradient entries (the test's doc says why).

A rank gets no rows when a mini-batch has fewer micro-batches to run than there are ranks:
keep `train.micro_batch_size` at most (rows per mini-batch) / world_size for every rank
to work.

What this is not: DDP's overlap of communication with the backward pass, or sharded
parameters / optimizer state (FSDP, ZeRO). Every rank holds the whole model and its
gradients, and rank 0 also the AdamW state, so a model must fit one device; see
docs/scale.md for what a 7B run needs. Workers keep no optimizer state (PyTorch's AdamW
creates it at the first step, which workers never take).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Callable, Iterable

import torch

from recursa.errors import UserError

_ACTIVE: "DataParallel | None" = None
_BUCKET_BYTES = 64 << 20  # tensors are flattened into buffers of at most this size per collective


def shard_bounds(n: int, rank: int, world_size: int) -> tuple[int, int]:
    """[lo, hi) of rank's contiguous slice of n items: slices differ in size by at most one,
    the larger ones last (n = 10, world 3: [0, 3), [3, 6), [6, 10))."""
    return rank * n // world_size, (rank + 1) * n // world_size


class SingleProcess:
    """The learner of a one-process run: every row is here and nothing is exchanged. The
    update calls it exactly where it calls a `DataParallel`, so there is one update loop."""

    rank = 0
    world_size = 1
    is_driver = True

    def announce(self, kind: str, **payload) -> None:
        pass

    def model(self, policy) -> torch.nn.Module:
        """The module the update's forwards run on: the policy's causal LM."""
        return policy.causal_lm

    def share_weights(self, policy) -> None:
        pass

    def shard(self, rows: torch.Tensor, block: int = 1) -> torch.Tensor:
        return rows

    def sum_rows(self, table: torch.Tensor) -> torch.Tensor:
        return table

    def step(self, optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter], max_norm: float) -> float:
        """Clip the gradient's global norm and take the optimizer step; returns the norm."""
        grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        optimizer.step()
        return float(grad_norm)

    def sum_stats(self, values: list[float]) -> list[float]:
        return values

    def max_stat(self, value: float) -> float:
        return value


SINGLE = SingleProcess()


@dataclass
class DataParallel:
    """One rank of a data-parallel learner over the default torch.distributed process group."""

    rank: int
    world_size: int
    device: torch.device
    _full_share_due: bool = field(default=True, repr=False)  # the next share sends every tensor (after a hello)

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    # ---- driver -> workers ----------------------------------------------------------
    def announce(self, kind: str, **payload) -> None:
        """Driver: tell the workers what to join next (`receive` on their side); no-op on a
        worker, which is already in the call it was told to join. Tensors travel via the CPU."""
        if not self.is_driver:
            return
        message = [(kind, {k: _to_host(v) for k, v in payload.items()})]
        torch.distributed.broadcast_object_list(message, src=0, device=self._object_device)

    def receive(self) -> tuple[str, dict]:
        """Worker: wait for the driver's next announcement."""
        message: list = [None]
        torch.distributed.broadcast_object_list(message, src=0, device=self._object_device)
        kind, payload = message[0]
        if kind == "hello":
            self._full_share_due = True  # as on the driver: a new model gets every tensor next
        return kind, payload

    def hello(self, cfg, policy) -> None:
        """Driver: the run's config and the shape of its model; workers build the same model
        (`serve`) and get every weight at the next `share_weights`."""
        self.announce("hello", config=cfg.model_dump(mode="json"), recipe=cfg.recipe, reference=policy.reference is not None,
                      tensors=_signature(policy))
        self._full_share_due = True

    def stop(self) -> None:
        """Driver: release the workers (they return from `serve`)."""
        self.announce("stop")

    def close(self) -> None:
        global _ACTIVE
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        _ACTIVE = None

    # ---- the update's collectives ---------------------------------------------------
    def model(self, policy) -> torch.nn.Module:
        """The module the update's forwards run on: every rank's copy of the causal LM
        (the FSDP2 learner, `recursa.distributed.fsdp`, answers its sharded training copy)."""
        return policy.causal_lm

    def share_weights(self, policy) -> None:
        """Every rank gets rank 0's current weights: after a hello every tensor of the model
        (frozen base, buffers) and of the KL reference, afterwards the trainable parameters."""
        if self._full_share_due:
            tensors = list(policy.model.state_dict(keep_vars=True).values())
            if policy.reference is not None:
                tensors += list(policy.reference.state_dict(keep_vars=True).values())
            self._full_share_due = False
        else:
            tensors = [p for p in policy.model.parameters() if p.requires_grad]
        with torch.no_grad():
            _bucketed([t.data for t in _unique(tensors)], lambda flat: torch.distributed.broadcast(flat, src=0), copy_back=True)

    def shard(self, rows: torch.Tensor, block: int = 1) -> torch.Tensor:
        """This rank's rows: `rows` is cut into blocks of `block` (the micro-batches one
        process would run, the last one shorter) and the rank takes a contiguous run of
        whole blocks (`shard_bounds` over the blocks)."""
        lo, hi = shard_bounds(math.ceil(len(rows) / block), self.rank, self.world_size)
        return rows[lo * block : hi * block]

    def sum_rows(self, table: torch.Tensor) -> torch.Tensor:
        """A per-row table each rank filled on its own rows (zeros elsewhere), summed across
        ranks: every rank gets the whole table (each entry is one rank's value plus zeros)."""
        torch.distributed.all_reduce(table, op=torch.distributed.ReduceOp.SUM)
        return table

    def step(self, optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter], max_norm: float) -> float:
        """Sum every rank's gradients onto rank 0, which clips and steps; returns the global
        gradient norm on rank 0 (nan on workers, whose gradients are partial)."""
        had = torch.tensor([float(p.grad is not None) for p in params], device=self.device)
        torch.distributed.all_reduce(had, op=torch.distributed.ReduceOp.MAX)
        live = [p for p, h in zip(params, had.tolist()) if h]
        for p in live:
            if p.grad is None:  # this rank ran no row that reaches p, another did
                p.grad = torch.zeros_like(p)
        _bucketed([p.grad for p in live], lambda flat: torch.distributed.reduce(flat, dst=0, op=torch.distributed.ReduceOp.SUM),
                  copy_back=self.is_driver)
        if not self.is_driver:
            return math.nan
        grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        optimizer.step()
        return float(grad_norm)

    def sum_stats(self, values: list[float]) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.SUM)
        return t.tolist()

    def max_stat(self, value: float) -> float:
        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
        return float(t.item())

    @property
    def _object_device(self) -> torch.device | None:
        return self.device if self.device.type == "cuda" else None


def active() -> DataParallel | None:
    """The process's data-parallel learner, set up by `setup`, or None (one process)."""
    return _ACTIVE


def setup(cfg) -> DataParallel | None:
    """Join the process group torchrun described (WORLD_SIZE, RANK, LOCAL_RANK,
    MASTER_ADDR / MASTER_PORT) when `cfg.learner` asks for data parallelism; None for a
    one-process run. On GPUs each rank takes cuda:LOCAL_RANK."""
    global _ACTIVE
    from recursa.models import resolve_device

    lc = cfg.learner
    world = int(os.environ.get("WORLD_SIZE", "1"))
    backend = lc.backend if lc.backend != "auto" else ("ddp" if world > 1 else "single")  # 'fsdp': recursa.distributed.fsdp
    if backend == "single":
        if world > 1:
            raise UserError(f"learner.backend = 'single' but WORLD_SIZE = {world}: every process would train its own copy into the same run; "
                            "set learner.backend = 'ddp' (or 'auto'), or launch one process")
        return None
    if world < 2:
        raise UserError(f"learner.backend = {backend!r} needs several processes: launch with "
                        "`torchrun --nproc_per_node N -m recursa.cli train CONFIG`, or set learner.backend = 'auto'")
    rank = int(os.environ["RANK"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    if cfg.model.device.startswith("cuda:"):
        raise UserError(f"model.device = {cfg.model.device!r} under torchrun: each rank takes cuda:LOCAL_RANK; set model.device = 'cuda' or 'auto'")
    if torch.cuda.is_available():
        if local_rank >= torch.cuda.device_count():
            raise UserError(f"LOCAL_RANK {local_rank} but torch sees {torch.cuda.device_count()} GPU(s): launch at most that many processes per node")
        torch.cuda.set_device(local_rank)
    device = resolve_device(cfg.model.device)
    dist_backend = lc.dist_backend if lc.dist_backend != "auto" else ("nccl" if device.type == "cuda" else "gloo")
    if dist_backend == "nccl" and device.type != "cuda":
        raise UserError("learner.dist_backend = 'nccl' needs the model on a GPU: use 'gloo' (or 'auto') for CPU processes")
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group(dist_backend, timeout=timedelta(minutes=lc.timeout_minutes))
    _ACTIVE = _learner_class(backend)(rank, world, device)
    return _ACTIVE


# ------------------------------------------------------------------------------ helpers

# learner.backend -> the learner class, as an import path: the FSDP2 learner builds on this module
LEARNERS = {"ddp": "recursa.distributed.ddp:DataParallel", "fsdp": "recursa.distributed.fsdp:FullyShardedDataParallel"}


def _learner_class(backend: str) -> type:
    import importlib

    module, name = LEARNERS[backend].split(":")
    return getattr(importlib.import_module(module), name)



def _signature(policy) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, shape, dtype) of every tensor `share_weights` sends on a full share, in order."""
    out = [(f"model.{k}", tuple(v.shape), str(v.dtype)) for k, v in policy.model.state_dict().items()]
    if policy.reference is not None:
        out += [(f"reference.{k}", tuple(v.shape), str(v.dtype)) for k, v in policy.reference.state_dict().items()]
    return out


def _unique(tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """Tensors without repeats of the same storage (tied embeddings appear twice in a state dict)."""
    seen, out = set(), []
    for t in tensors:
        key = (t.data_ptr(), t.dtype, tuple(t.shape))
        if key not in seen:
            seen.add(key)
            out.append(t)
    return out


def _bucketed(tensors: list[torch.Tensor], collective: Callable[[torch.Tensor], object], copy_back: bool) -> None:
    """Run `collective` on flat buffers of consecutive same-dtype, same-device tensors (at
    most _BUCKET_BYTES each, one tensor at least), copying the result back when asked."""
    bucket: list[torch.Tensor] = []

    def flush() -> None:
        if not bucket:
            return
        flat = torch.cat([t.reshape(-1) for t in bucket])
        collective(flat)
        if copy_back:
            offset = 0
            for t in bucket:
                t.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()
        bucket.clear()

    size = 0
    for t in tensors:
        if bucket and (t.dtype != bucket[0].dtype or t.device != bucket[0].device or size + t.numel() * t.element_size() > _BUCKET_BYTES):
            flush()
            size = 0
        bucket.append(t)
        size += t.numel() * t.element_size()
    flush()


def _to_host(value):
    """Tensors, and the objects of tensors an update is announced with (a TrainBatch, the
    recipes' extra loss terms: anything with a `to(device)`), moved to the CPU for pickling."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if callable(getattr(value, "to", None)):
        return value.to("cpu")
    return value
