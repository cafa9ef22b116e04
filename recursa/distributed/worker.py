"""A data-parallel worker's loop (every rank but 0 under torchrun): it builds the model the
driver describes, then joins each update or supervised step the driver announces, running
the recipes' own update functions on its slice of the rows (`recursa.distributed.ddp`). It
sits above the recipes, beside the command line that starts it: the learner primitives in
`ddp` know nothing of the recipes."""

from __future__ import annotations

from typing import Callable

import torch

from recursa.distributed.ddp import DataParallel, _signature
from recursa.errors import UserError


def serve(learner: DataParallel, log: Callable[[str], None] = print) -> None:
    """A worker's loop: build the model the driver describes (hello), join each update or
    supervised step it announces, return at stop."""
    from recursa.config import RECIPES
    from recursa.models import load_policy
    from recursa.recipes.common import make_optimizer, supervised_step
    from recursa.recipes.grpo import Imitation, update

    cfg = policy = optimizer = None
    while True:
        kind, payload = learner.receive()
        if kind == "stop":
            return
        if kind == "hello":
            cfg = RECIPES[payload["recipe"]].model_validate(payload["config"])
            torch.set_num_threads(cfg.run.threads)
            policy = load_policy(cfg.model)  # the weights come from rank 0 at the first share
            if payload["reference"]:
                policy.enable_reference()
            mine = _signature(policy)
            if mine != payload["tensors"]:
                diff = next((a, b) for a, b in zip(mine + [None], payload["tensors"] + [None]) if a != b)
                raise UserError(f"rank {learner.rank} built a different model from rank 0's (first difference: {diff}): same config, same recursa on every node?")
            optimizer = make_optimizer([p for p in policy.model.parameters() if p.requires_grad], cfg)
            if hasattr(learner, "prepare"):  # the FSDP2 learner shards its training copy (recursa.distributed.fsdp)
                learner.prepare(cfg, policy)
            log(f"rank {learner.rank}/{learner.world_size}: learner worker for {cfg.model.name} on {policy.device}")
            continue
        if policy is None:
            raise RuntimeError(f"rank {learner.rank} was sent {kind!r} before the run's hello")
        batch = payload["batch"].to(policy.device)
        if kind == "update":
            generator = torch.Generator(device="cpu")
            generator.set_state(payload["generator"])
            imitation = payload["imitation"]
            if imitation is not None:
                imitation = Imitation(imitation.weights.to(policy.device), imitation.coef)
            update(policy, optimizer, batch, cfg, generator, payload["opt_step"], imitation, learner=learner, outcomes=payload.get("outcomes"),
                   distillation=payload.get("distillation"))
        elif kind == "supervised":
            supervised_step(policy, optimizer, batch, cfg, payload["opt_step"], learner=learner)
        else:
            raise RuntimeError(f"rank {learner.rank}: unknown announcement {kind!r}")
