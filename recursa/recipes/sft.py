"""Supervised fine-tuning on demonstrations, written out.

    demos      <- oracle walkthroughs of training games | reference answers of training
                  items | a JSONL file of chat transcripts          (recursa/demos.py)
    evaluate   <- before training (eval/before.json)
    for epoch in range(epochs):
        for batch in seeded shuffle of demos, `batch_size` rows each:
            loss = token-mean NLL of the target (assistant) tokens; AdamW step
        evaluate   <- every `eval.every` epochs
        checkpoint <- every `run.checkpoint_every` epochs and at the end
    evaluate   <- after training (eval/after.json)

Metrics are logged per optimizer step (`sft/loss`, `sft/entropy`, ...); evaluations and
checkpoints carry the optimizer step they were taken at. The shuffle of epoch e comes from
a generator seeded by (train.seed, e), so a run resumed from an epoch checkpoint replays
exactly what an uninterrupted run would have done.

The result is a run directory like any other: `recursa eval --run`, `recursa report`, and
`init.from_run` in a GRPO or expert-iteration config (the warm start) all read it.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Callable

import torch

from recursa.config import SFTConfig
from recursa.demos import build_demos
from recursa.engines import make_engine
from recursa.errors import UserError
from recursa.recipes.common import (
    check_finite,
    eval_before,
    open_run,
    Progress,
    batch_order,
    lr_at,
    run_eval,
    step_generator,
    supervised_step,
)
from recursa.runio import atomic_write_text
from recursa.trajectory import collate


def train(cfg: SFTConfig, out: Path, resume: bool = False, progress: Progress | None = None, log: Callable[[str], None] = print) -> Path:
    """Run supervised fine-tuning into `out` (continuing from its last checkpoint when `resume`)."""
    run = open_run(cfg, out, resume, log)
    pool, store, policy, optimizer = run.pool, run.store, run.policy, run.optimizer

    t0 = time.perf_counter()
    demos = build_demos(cfg, pool, policy.tokenizer)
    if not demos.rows:
        raise UserError(f"no demonstrations to learn from: {demos.summary()}")
    log(f"demonstrations: {demos.summary()} ({time.perf_counter() - t0:.1f}s)")
    atomic_write_text(out / "demos.json", json.dumps({
        "source": demos.source, "rows": len(demos.rows), "items": demos.items, "target_tokens": demos.target_tokens,
        "tokens": sum(len(r.token_ids) for r in demos.rows), "dropped": dict(demos.dropped),
        "seeds": sorted({r.seed for r in demos.rows}),
    }, indent=1) + "\n")
    rows = demos.rows
    per_epoch = math.ceil(len(rows) / cfg.train.batch_size)

    start_epoch, opt_step = int(run.state.get("epoch", 0)), run.opt_steps
    engine = make_engine(cfg.rollout, policy)  # decodes the evaluations
    eval_before(run, cfg, progress, log, engine=engine)

    pad = policy.tokenizer.pad_token_id
    for epoch in range(start_epoch, cfg.train.epochs):
        gen = step_generator(cfg.train.seed, epoch)
        losses = []
        for b, idx in enumerate(batch_order(len(rows), cfg.train.batch_size, gen)):
            t1 = time.perf_counter()
            chosen = [rows[int(i)] for i in idx]
            batch = collate(chosen, torch.zeros(len(chosen), device="cpu"), pad, policy.device)
            st = supervised_step(policy, optimizer, batch, cfg, opt_step, learner=run.learner)
            opt_step += 1
            check_finite(opt_step, loss=st.loss, grad_norm=st.grad_norm)
            dt = time.perf_counter() - t1
            losses.append(st.loss)
            tokens = int(batch.attention_mask.sum())
            store.log_metrics(opt_step, {
                "sft/loss": st.loss, "sft/entropy": st.entropy, "sft/target_tokens": st.tokens, "sft/rows": st.rows,
                "sft/epoch": epoch + (b + 1) / per_epoch, "policy/grad_norm": st.grad_norm, "policy/lr": lr_at(cfg, opt_step - 1),
                "time/update_s": dt, "throughput/tokens_per_s": tokens / max(dt, 1e-9),
            })
            if progress:
                progress(f"epoch {epoch + 1}", b + 1, per_epoch)
        log(f"epoch {epoch + 1}/{cfg.train.epochs}  loss {sum(losses) / len(losses):.4f} (last batch {losses[-1]:.4f})  {opt_step} optimizer steps")
        engine.load_weights(policy)
        done = epoch + 1
        if cfg.eval.every and done % cfg.eval.every == 0 and done < cfg.train.epochs and cfg.eval.n > 0:
            r = run_eval(policy, cfg, pool, store, opt_step, f"epoch_{done:03d}", progress, engine=engine)
            log(f"eval @ epoch {done}: success {r.success_rate:.3f} [{r.ci95[0]:.3f}, {r.ci95[1]:.3f}]")
        if (cfg.run.checkpoint_every and done % cfg.run.checkpoint_every == 0) or done == cfg.train.epochs:
            store.save_checkpoint(opt_step, policy, optimizer, {"epoch": done, "opt_steps": opt_step})

    if cfg.eval.after and cfg.eval.n > 0 and not (out / "eval" / "after.json").exists():
        r = run_eval(policy, cfg, pool, store, opt_step, "after", progress, engine=engine)
        log(f"after: success {r.success_rate:.3f} [{r.ci95[0]:.3f}, {r.ci95[1]:.3f}] on {r.n} {cfg.eval.split} items")
    engine.close()
    store.close()
    pool.close()
    return out

