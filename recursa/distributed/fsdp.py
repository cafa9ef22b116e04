"""The data-parallel learner on FSDP2 (`torch.distributed.fsdp.fully_shard`): sharded gradients and AdamW state.

`learner.backend = "fsdp"` under torchrun. The driver / worker protocol, the row slicing and the
loss normalisation are `recursa.distributed.ddp`'s (this class is a `DataParallel`): rank 0 runs
the recipe, every rank runs a contiguous run of whole micro-batches of the one-process run, each
normalised by the whole mini-batch's token and sequence counts, and the reduction is a *sum*
(`set_gradient_divide_factor(1.0)`), so the summed gradient is the one-process gradient up to the
order of float additions. What changes is where the training state lives:

    every rank  a *training copy* of the causal LM, fully_shard-ed per decoder layer and at the root
                (embeddings, final norm and the tied head): each rank keeps 1/world of every
                parameter, of its gradient and of AdamW's two moments (its own AdamW over the shards)
    rank 0      also keeps the plain model the recipe samples, evaluates, gates and checkpoints with,
                and the plain AdamW whose state the run's checkpoints save: after every optimizer step
                the shards' new weights and moments are gathered into them, so a checkpoint is still
                one Hugging Face directory and `recursa export` reads it as before; at the start of
                every update rank 0's plain weights and moments are scattered into the shards, so a gate
                rollback, a resume or a warm start on rank 0 reaches the training copy
    workers     shard their own model in place: between updates they hold only their shards

One optimizer step, on every rank, with the same collectives in the same order whatever each rank's
number of micro-batches (a rank may run none):

    share_weights   (first of an update: scatter rank 0's weights into the shards), then all-gather
                    the parameters once (`unshard`); forwards and backwards then run locally
    micro-batches   backwards accumulate the unsharded gradient locally (gradient sync off)
    step            one zero-loss forward/backward of a single token with gradient sync on: FSDP2
                    reduce-scatters the accumulated gradients (summed; the zero pass adds exactly 0),
                    reshard, clip the global norm over the sharded gradients, AdamW on the shards,
                    gather weights and moments into rank 0's plain model and optimizer

What this is not yet: a learner whose parameters stay sharded through the forward (ZeRO-3 style:
here each rank all-gathers the whole model once per optimizer step and holds it until the step),
sharded checkpoints through `torch.distributed.checkpoint` (the moments are gathered to rank 0 every
step instead, which costs one all-gather of three model sizes per step), LoRA, or a KL reference that
is sharded (every rank keeps a plain copy, as with `ddp`). Tested on two CPU processes over gloo
(tests/test_fsdp.py); GPU runs: benchmarks/gpu_check.sh.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch

from recursa.distributed.ddp import DataParallel, _bucketed, _unique
from recursa.errors import UserError


@dataclass
class FullyShardedDataParallel(DataParallel):
    """One rank of the FSDP2 learner over the default process group (see the module doc)."""

    _train: torch.nn.Module | None = field(default=None, repr=False)  # the sharded training copy
    _optim: torch.optim.Optimizer | None = field(default=None, repr=False)  # AdamW over the shards
    _stale: bool = field(default=True, repr=False)  # rank 0's plain weights and moments are ahead of the shards
    _reference_due: bool = field(default=True, repr=False)

    # ---- building --------------------------------------------------------------------
    def hello(self, cfg, policy) -> None:
        super().hello(cfg, policy)
        self.prepare(cfg, policy)

    def receive(self) -> tuple[str, dict]:
        kind, payload = super().receive()
        self._stale = True  # a new update or supervised step starts from rank 0's plain state
        return kind, payload

    def announce(self, kind: str, **payload) -> None:
        super().announce(kind, **payload)
        self._stale = True

    def prepare(self, cfg, policy) -> None:
        """Shard the training copy (rank 0: a copy of its plain model; a worker: its model in place)
        and make its AdamW with the run's settings; every rank calls it after the hello."""
        from torch.distributed.fsdp import fully_shard

        if policy.is_lora:
            raise UserError("learner.backend = 'fsdp' trains full weights: use learner.backend = 'ddp' for LoRA")
        model = copy.deepcopy(policy.causal_lm) if self.is_driver else policy.causal_lm
        for layer in model.get_decoder().layers:
            fully_shard(layer, reshard_after_forward=False)
        fully_shard(model, reshard_after_forward=False)
        self._train = model
        for group in self._groups():  # each setting is per FSDP module (the root's does not reach the layers)
            group.set_gradient_divide_factor(1.0)  # a sum, as in one process: each rank's loss is already a share of the whole
            group.set_force_sum_reduction_for_comms(True)  # a plain SUM reduce-scatter (then / 1.0): gloo has no PREMUL_SUM
        model.set_requires_gradient_sync(False)  # recursive
        model.set_reshard_after_backward(False)
        tc = cfg.train
        self._optim = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=tc.lr, betas=tc.betas, weight_decay=tc.weight_decay)
        self._pad = int(policy.tokenizer.pad_token_id or 0)
        self._stale = self._reference_due = True
        with torch.no_grad():  # FSDP2 sets itself up at the root's first forward; the update then calls the decoder and head directly
            model(input_ids=self._probe(), use_cache=False)
        self._reshard()

    def _groups(self) -> list:
        from torch.distributed.fsdp import FSDPModule

        return [m for m in self._train.modules() if isinstance(m, FSDPModule)]

    def _unshard(self) -> None:
        """All-gather every parameter group (the root's and each layer's), in the same order on every rank."""
        handles = [m.unshard(async_op=True) for m in self._groups()]
        for h in handles:
            h.wait()

    def _reshard(self) -> None:
        for m in self._groups():
            m.reshard()

    def _probe(self) -> torch.Tensor:
        return torch.full((1, 1), self._pad, dtype=torch.long, device=self.device)

    def model(self, policy) -> torch.nn.Module:
        """The module the update's forwards run on: the sharded training copy."""
        return self._train

    # ---- the update's collectives ----------------------------------------------------
    def share_weights(self, policy) -> None:
        """First call of an update: rank 0's plain weights into the shards (and, once, the KL
        reference to every rank). Every call: gather the whole parameters for the forwards."""
        from torch.distributed.tensor import distribute_tensor

        if self._reference_due and policy.reference is not None:
            tensors = _unique(list(policy.reference.state_dict(keep_vars=True).values()))
            with torch.no_grad():
                _bucketed([t.data for t in tensors], lambda flat: torch.distributed.broadcast(flat, src=0), copy_back=True)
        self._reference_due = False
        if self._stale:
            self._reshard()
            plain = dict(policy.causal_lm.named_parameters()) if self.is_driver else {}
            with torch.no_grad():
                for name, p in self._train.named_parameters():
                    full = plain[name].detach() if self.is_driver else torch.empty(p.shape, dtype=p.dtype, device=self.device)
                    p.copy_(distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=0))
        self._unshard()

    def step(self, optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter], max_norm: float) -> float:
        """Reduce-scatter the summed gradients, clip their global norm, AdamW on the shards, and
        gather the new weights and moments into rank 0's plain model and `optimizer`; returns the
        global gradient norm (on every rank)."""
        model = self._train
        model.set_requires_gradient_sync(True)
        was_training = model.training
        model.train()
        (model(input_ids=self._probe(), use_cache=False).logits.sum() * 0.0).backward()  # every rank's one reduce-scatter
        model.train(was_training)
        model.set_requires_gradient_sync(False)
        self._reshard()
        sharded = [p for p in model.parameters() if p.requires_grad]
        norm = torch.nn.utils.clip_grad_norm_(sharded, max_norm)
        norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
        # AdamW's settings from rank 0's optimizer, where the update set the schedule's lr (a worker's own may differ)
        g = optimizer.param_groups[0]
        hyper = torch.tensor([g["lr"], g["betas"][0], g["betas"][1], g["eps"], g["weight_decay"]], dtype=torch.float64, device=self.device)
        torch.distributed.broadcast(hyper, src=0)
        lr, b1, b2, eps, wd = hyper.tolist()
        for mine in self._optim.param_groups:
            mine.update(lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd)
        plain_params = [p for p in optimizer.param_groups[0]["params"]] if self.is_driver else []
        if self._stale:  # the update's first step: AdamW's moments from rank 0's optimizer (resume, rollback)
            self._load_moments(optimizer, plain_params, sharded)
            self._stale = False
        self._optim.step()
        self._optim.zero_grad(set_to_none=True)
        self._gather(optimizer, plain_params, sharded)
        return norm

    # ---- rank 0's plain state <-> the shards -----------------------------------------
    def _load_moments(self, optimizer, plain_params, sharded) -> None:
        from torch.distributed.tensor import distribute_tensor

        has = torch.tensor([float(self.is_driver and len(optimizer.state) > 0)], device=self.device)
        torch.distributed.broadcast(has, src=0)
        self._optim.state.clear()
        if not has.item():
            return
        for i, p in enumerate(sharded):
            state = optimizer.state[plain_params[i]] if self.is_driver else {}
            step = torch.tensor([float(state["step"]) if self.is_driver else 0.0], device=self.device)
            torch.distributed.broadcast(step, src=0)
            moments = {}
            for key in ("exp_avg", "exp_avg_sq"):
                full = state[key].detach().to(p.dtype) if self.is_driver else torch.empty(p.shape, dtype=p.dtype, device=self.device)
                moments[key] = distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=0)
            self._optim.state[p] = {"step": torch.tensor(step.item(), dtype=torch.float32), **moments}

    def _gather(self, optimizer, plain_params, sharded) -> None:
        with torch.no_grad():
            for i, p in enumerate(sharded):
                full = p.full_tensor()
                state = self._optim.state[p]
                moments = {k: state[k].full_tensor() for k in ("exp_avg", "exp_avg_sq")}
                if self.is_driver:
                    target = plain_params[i]
                    target.copy_(full)
                    old = optimizer.state.get(target, {})
                    step = state["step"].clone().to(old["step"].device) if "step" in old else state["step"].clone()
                    optimizer.state[target] = {"step": step, **{k: v.to(target.device) for k, v in moments.items()}}
