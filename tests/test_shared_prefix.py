"""The shared-prompt forward equals the naive per-row forward, values and gradients."""

from __future__ import annotations

import pytest
import torch

from recursa.generation import SamplingParams, generate, sequence_logprobs, shared_prefix_logprobs
from recursa.rollout import render_prompt
from recursa.trajectory import Trajectory, collate


def _batch(policy, g=3):
    tok = policy.tokenizer
    prompts = [render_prompt(tok, text, "You are a helpful assistant.") for text in ("short one", "a considerably longer prompt with more words")]
    samples = generate(policy.causal_lm, tok, prompts, SamplingParams(max_new_tokens=7), n=g, generator=torch.Generator().manual_seed(2))
    trajs = []
    for s in samples:
        p = prompts[s.prompt_index]
        trajs.append(Trajectory("t", 0, s.prompt_index, p + s.token_ids, [0] * len(p) + [1] * len(s.token_ids), [0.0] * len(p) + s.logprobs, 0.0, False))
    order = [0, 3, 1, 4, 2, 5]  # interleave groups: sharing must not depend on row order
    return collate([trajs[i] for i in order], torch.zeros(len(trajs)), tok.pad_token_id)


def _grads(model, fn, batch, weights):
    model.zero_grad(set_to_none=True)
    logp, ent = fn(model, batch.input_ids, batch.attention_mask, batch.action_mask, 0.9, 4, True)
    (logp * weights).sum().backward()
    return logp.detach(), ent, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_shared_prefix_equals_naive(tiny_policy):
    model = tiny_policy.causal_lm
    batch = _batch(tiny_policy)
    weights = torch.randn(batch.input_ids.shape, generator=torch.Generator().manual_seed(0)) * batch.action_mask
    naive_lp, naive_ent, naive_g = _grads(model, sequence_logprobs, batch, weights)
    shared_lp, shared_ent, shared_g = _grads(model, shared_prefix_logprobs, batch, weights)
    torch.testing.assert_close(shared_lp, naive_lp, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(shared_ent, naive_ent, atol=2e-5, rtol=1e-5)
    assert naive_g.keys() == shared_g.keys() and naive_g
    for k in naive_g:
        assert (shared_g[k] - naive_g[k]).norm() <= 1e-4 * naive_g[k].norm() + 1e-7, k
    model.zero_grad(set_to_none=True)


def test_topk_and_at_ids_agree_on_both_paths(tiny_policy):
    """The teacher's top-k (ids, log-probs) and the student's log-probs at given ids: the same
    from the naive and the shared-prompt forward; the top-1 id's log-prob is at least the
    sampled token's; log-probs at the top-k ids are the top-k log-probs; gradients flow."""
    model = tiny_policy.causal_lm
    batch = _batch(tiny_policy)
    act = batch.action_mask.bool()
    outs = {}
    for fn in (sequence_logprobs, shared_prefix_logprobs):
        with torch.no_grad():
            logp, _, (ids, top) = fn(model, batch.input_ids, batch.attention_mask, batch.action_mask, 0.9, 4, topk=5)
        assert ids.shape == top.shape == (*batch.input_ids.shape, 5) and ids.dtype == torch.long
        assert (top[~act] == 0).all() and (ids[~act] == 0).all()
        assert (top[act][:, 0] >= logp[act] - 1e-6).all()  # the most likely token is at least as likely as the sampled one
        assert (top[act][:, :-1] >= top[act][:, 1:]).all()  # sorted, most likely first
        # aligned with the sampled tokens: where a position's own token is among its top-k, the
        # log-prob there is that token's log-prob (a top-k taken one position off would fail)
        hit = (ids == batch.input_ids[..., None]) & act[..., None]
        assert hit.any()
        torch.testing.assert_close(top[hit], logp[..., None].expand_as(top)[hit], atol=2e-5, rtol=1e-5)
        model.zero_grad(set_to_none=True)
        logp2, _, at = fn(model, batch.input_ids, batch.attention_mask, batch.action_mask, 0.9, 4, at_ids=ids)
        torch.testing.assert_close(at.detach()[act], top[act], atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(logp2.detach(), logp, atol=2e-5, rtol=1e-5)
        (at * batch.action_mask[..., None]).sum().backward()
        assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())
        outs[fn.__name__] = (ids, top)
    (a_ids, a_top), (b_ids, b_top) = outs.values()
    torch.testing.assert_close(b_top, a_top, atol=2e-5, rtol=1e-5)
    assert (a_ids[act] == b_ids[act]).float().mean() > 0.99  # near-ties may swap order within rounding
    model.zero_grad(set_to_none=True)
    with pytest.raises(ValueError, match="not both"):
        sequence_logprobs(model, batch.input_ids, batch.attention_mask, batch.action_mask, topk=2, at_ids=a_ids[..., :2])
