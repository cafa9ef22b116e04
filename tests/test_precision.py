"""bf16 autocast over fp32 master weights and activation checkpointing (recursa/distributed/precision.py, issue 47)."""

from __future__ import annotations

import json

import pytest
import torch

from recursa.config import ModelConfig, load_config
from recursa.distributed.precision import autocast, learner_forward, set_checkpointing
from recursa.generation import sequence_logprobs, shared_prefix_logprobs
from recursa.models import load_policy
from recursa.recipes import grpo, sft
from recursa.trajectory import Trajectory, collate

TINY = ["model.name=tiny-random"]


def _batch(policy):
    rows = [
        Trajectory("t", 0, 0, [5, 6, 7, 8, 9, 10], [0, 0, 1, 1, 1, 1], [0.0] * 6, 1.0, True),
        Trajectory("t", 0, 1, [5, 6, 7, 11, 12], [0, 0, 0, 1, 1], [0.0] * 5, -1.0, True),
        Trajectory("t", 1, 0, [20, 21, 22, 23], [0, 1, 1, 1], [0.0] * 4, 0.5, True),
    ]
    return collate(rows, torch.tensor([1.0, -1.0, 0.5]), policy.tokenizer.pad_token_id)


def _train(**kw):
    return load_config(None, TINY + [f"train.{k}={v}" for k, v in kw.items()]).train


def _loss_and_grads(policy, fn, batch):
    model = policy.causal_lm
    model.train()
    model.zero_grad(set_to_none=True)
    logp, _ = fn(model, batch.input_ids, batch.attention_mask, batch.action_mask, 1.0, 512)
    loss = -(logp * batch.action_mask).sum() / batch.action_mask.sum()
    loss.backward()
    return logp.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_defaults_leave_the_forward_as_it_is():
    tc = _train()
    assert tc.precision == "fp32" and tc.activation_checkpointing is False
    assert learner_forward(sequence_logprobs, tc) is sequence_logprobs  # a default run calls the same function
    assert isinstance(autocast("fp32", "cpu"), type(autocast("fp32", "cpu")))
    with pytest.raises(ValueError, match="precision"):
        autocast("fp16", "cpu")


def test_checkpointing_asks_for_whole_row_forwards():
    with pytest.raises(Exception, match="shared_prefix = false"):
        _train(activation_checkpointing="true")
    assert _train(activation_checkpointing="true", shared_prefix="false").activation_checkpointing
    sup = load_config(None, ["recipe=sft"] + TINY + ["train.precision=bf16", "train.activation_checkpointing=true"]).train
    assert sup.precision == "bf16" and sup.activation_checkpointing  # valid for every recipe


def test_bf16_runs_matmuls_in_bf16_and_keeps_fp32_gradients():
    policy = load_policy(ModelConfig(name="tiny-random"))
    batch = _batch(policy)
    seen = []
    hook = policy.causal_lm.model.layers[0].mlp.down_proj.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    logp32, g32 = _loss_and_grads(policy, learner_forward(sequence_logprobs, _train()), batch)
    logp16, g16 = _loss_and_grads(policy, learner_forward(sequence_logprobs, _train(precision="bf16")), batch)
    hook.remove()
    assert seen == [torch.float32, torch.bfloat16]
    assert logp16.dtype == torch.float32  # the log-softmax and the loss stay fp32
    assert all(p.dtype == torch.float32 for p in policy.model.parameters())  # master weights
    assert all(g.dtype == torch.float32 for g in g16.values())
    mask = batch.action_mask.bool()
    gap = (logp16 - logp32)[mask].abs()
    assert 0 < gap.max() < 0.1  # bf16 rounding moves the log-probs, a little
    cos = torch.nn.functional.cosine_similarity(g16["model.embed_tokens.weight"].flatten(), g32["model.embed_tokens.weight"].flatten(), dim=0)
    assert cos > 0.99


def test_checkpointing_recomputes_layers_and_gives_the_same_gradients():
    policy = load_policy(ModelConfig(name="tiny-random"))
    batch = _batch(policy)
    calls = []
    mlp = policy.causal_lm.model.layers[0].mlp
    forward = mlp.forward
    mlp.forward = lambda *a, **k: calls.append(1) or forward(*a, **k)  # counts the recompute too (module hooks do not see it)
    logp_a, g_a = _loss_and_grads(policy, learner_forward(sequence_logprobs, _train()), batch)
    plain_calls = len(calls)
    calls.clear()
    logp_b, g_b = _loss_and_grads(policy, learner_forward(sequence_logprobs, _train(activation_checkpointing="true", shared_prefix="false")), batch)
    del mlp.forward
    assert plain_calls == 1 and len(calls) == 2  # the layer ran again in the backward
    assert torch.equal(logp_a, logp_b)
    for name in g_a:
        torch.testing.assert_close(g_b[name], g_a[name], rtol=1e-5, atol=1e-7)
    # scoring without gradients is not checkpointed, and switching off restores the plain layers
    set_checkpointing(policy.causal_lm, False)
    assert not policy.causal_lm.model.layers[0].gradient_checkpointing


def test_bf16_shared_prefix_matches_whole_rows_in_bf16():
    """The shared-prefix forward under autocast stays the whole-row forward's equal to bf16 tolerance."""
    policy = load_policy(ModelConfig(name="tiny-random"))
    batch = _batch(policy)
    tc = _train(precision="bf16")
    with torch.no_grad():
        a, _ = learner_forward(sequence_logprobs, tc)(policy.causal_lm, batch.input_ids, batch.attention_mask, batch.action_mask)
        b, _ = learner_forward(shared_prefix_logprobs, tc)(policy.causal_lm, batch.input_ids, batch.attention_mask, batch.action_mask)
    torch.testing.assert_close(a, b, rtol=0, atol=0.05)


SMOKE = TINY + ["env.name=toy-digits", "train.steps=2", "train.prompts_per_step=2", "train.group_size=4", "train.micro_batch_size=4",
                "sampling.max_new_tokens=6", "eval.n=0", "train.lr=1e-3"]


@pytest.mark.parametrize("switch", [["train.precision=bf16"], ["train.activation_checkpointing=true", "train.shared_prefix=false"]])
def test_grpo_runs_end_to_end_with_each_switch(tmp_path, switch):
    plain = grpo.train(load_config(None, SMOKE + ["train.shared_prefix=false"]), tmp_path / "plain", log=lambda *_: None)
    run = grpo.train(load_config(None, SMOKE + switch), tmp_path / "run", log=lambda *_: None)
    m = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if "loss/policy" in line]
    p = [json.loads(line) for line in (plain / "metrics.jsonl").read_text().splitlines() if "loss/policy" in line]
    assert len(m) == len(p) == 2 and all(torch.isfinite(torch.tensor(x["policy/grad_norm"])) for x in m)
    # step 1 samples from the same initial weights, so its rollouts and the update's inputs agree
    assert m[0]["completion/len_mean"] == p[0]["completion/len_mean"]
    tol = 0.05 if "train.precision=bf16" in switch else 1e-4
    assert m[0]["policy/grad_norm"] == pytest.approx(p[0]["policy/grad_norm"], rel=tol)


def test_sft_runs_end_to_end_in_bf16_with_checkpointing(tmp_path):
    corridor = ["recipe=sft"] + TINY + ["env.name=toy-corridor", "data.n=8", "train.batch_size=8", "train.lr=1e-3", "sampling.max_new_tokens=6",
                                        "train.epochs=1", "eval.n=0"]
    plain = sft.train(load_config(None, corridor), tmp_path / "a", log=lambda *_: None)
    run = sft.train(load_config(None, corridor + ["train.precision=bf16", "train.activation_checkpointing=true"]), tmp_path / "b", log=lambda *_: None)
    la = [json.loads(x)["sft/loss"] for x in (plain / "metrics.jsonl").read_text().splitlines() if "sft/loss" in x]
    lb = [json.loads(x)["sft/loss"] for x in (run / "metrics.jsonl").read_text().splitlines() if "sft/loss" in x]
    assert len(la) == len(lb) > 0
    assert lb[0] == pytest.approx(la[0], rel=0.02) and lb[0] != la[0]  # the first step's loss, at the same weights, in bf16
