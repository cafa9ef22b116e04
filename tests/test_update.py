"""The update step on the tiny model: accumulation, clipping, KL reference, LoRA."""

from __future__ import annotations

import copy

import pytest
import torch

from recursa.config import ModelConfig, load_config
from recursa.generation import SamplingParams, generate
from recursa.models import load_policy
from recursa.recipes.grpo import update
from recursa.rollout import render_prompt
from recursa.trajectory import Trajectory, collate


def _batch(policy, n_prompts=2, g=4, seed=0):
    tok = policy.tokenizer
    prompts = [render_prompt(tok, f"question {i} " * (i + 1), None) for i in range(n_prompts)]
    samples = generate(policy.causal_lm, tok, prompts, SamplingParams(max_new_tokens=6), n=g, generator=torch.Generator().manual_seed(seed))
    trajs = []
    for s in samples:
        p = prompts[s.prompt_index]
        trajs.append(Trajectory("t", 0, s.prompt_index, p + s.token_ids, [0] * len(p) + [1] * len(s.token_ids), [0.0] * len(p) + s.logprobs, 0.0, False))
    adv = torch.linspace(-1.0, 1.0, len(trajs))
    return collate(trajs, adv, tok.pad_token_id)


def _grads_after(policy, batch, cfg):
    model = policy.causal_lm
    saved = copy.deepcopy(model.state_dict())  # update() sets the lr itself: restore after
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    captured = {}

    def capture(*_a, **_k):
        captured.update({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})

    opt.register_step_pre_hook(lambda *a, **k: capture())
    update(policy, opt, batch, cfg, torch.Generator().manual_seed(0), 0)
    model.load_state_dict(saved)
    return captured


def _cfg(*sets):
    return load_config(None, ["model.name=tiny-random", "train.max_grad_norm=1e9", *sets])


def test_micro_batching_gives_the_full_batch_gradient():
    policy = load_policy(ModelConfig(name="tiny-random"))
    batch = _batch(policy)
    for agg in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
        full = _grads_after(policy, batch, _cfg(f"algo.agg={agg}", "train.micro_batch_size=8"))
        micro = _grads_after(policy, batch, _cfg(f"algo.agg={agg}", "train.micro_batch_size=3"))
        assert full.keys() == micro.keys() and full
        for k in full:  # equal up to float32 summation order
            assert (full[k] - micro[k]).norm() <= 1e-5 * full[k].norm() + 1e-8, (agg, k)


def test_zero_advantage_gives_zero_gradient():
    policy = load_policy(ModelConfig(name="tiny-random"))
    batch = _batch(policy)
    batch.advantages.zero_()
    grads = _grads_after(policy, batch, _cfg())
    assert all(g.abs().max() == 0 for g in grads.values())


def test_update_moves_logprobs_in_the_direction_of_the_advantage():
    policy = load_policy(ModelConfig(name="tiny-random"))
    batch = _batch(policy)
    from recursa.generation import sequence_logprobs

    before, _ = sequence_logprobs(policy.causal_lm, batch.input_ids, batch.attention_mask, batch.action_mask)
    cfg = _cfg("train.lr=1e-2")
    opt = torch.optim.AdamW(policy.causal_lm.parameters(), lr=1e-2)
    update(policy, opt, batch, cfg, torch.Generator().manual_seed(0), 0)
    after, _ = sequence_logprobs(policy.causal_lm, batch.input_ids, batch.attention_mask, batch.action_mask)
    seq_delta = ((after - before) * batch.action_mask).sum(1)
    pos, neg = batch.advantages > 0, batch.advantages < 0
    assert seq_delta[pos].mean() > 0 > seq_delta[neg].mean()


def test_multi_epoch_uses_old_logprobs_and_clips():
    policy = load_policy(ModelConfig(name="tiny-random"))
    batch = _batch(policy)
    cfg = _cfg("train.lr=5e-2", "train.epochs=4", "train.mini_batches=2", "train.micro_batch_size=2")
    opt = torch.optim.AdamW(policy.causal_lm.parameters(), lr=5e-2)
    st = update(policy, opt, batch, cfg, torch.Generator().manual_seed(0), 0)
    assert st.opt_steps == 8
    assert st.clip_frac > 0  # later epochs move outside the trust region and get clipped
    assert st.approx_kl_old > 0


def test_kl_reference_full_and_lora():
    # full fine-tuning: the reference is a frozen copy of the initial weights
    policy = load_policy(ModelConfig(name="tiny-random"))
    policy.enable_reference()
    batch = _batch(policy)
    cfg = _cfg("algo.kl_coef=0.1", "train.lr=1e-2", "train.epochs=3")
    opt = torch.optim.AdamW(policy.causal_lm.parameters(), lr=1e-2)
    st = update(policy, opt, batch, cfg, torch.Generator().manual_seed(0), 0)
    assert st.kl > 0  # the policy moved away from the reference within the update
    ref_w = next(policy.reference.parameters())
    assert not ref_w.requires_grad

    # LoRA: the reference is the base model with adapters off; at init they agree exactly
    lora = load_policy(ModelConfig(name="tiny-random", lora={"r": 4, "alpha": 8}))
    assert lora.is_lora
    lb = _batch(lora)
    cfg = _cfg("algo.kl_coef=0.1", "model.lora.r=4")
    first = copy.deepcopy(lb)
    st0 = update(lora, torch.optim.AdamW([p for p in lora.model.parameters() if p.requires_grad], lr=0.0), first, cfg, torch.Generator().manual_seed(0), 0)
    assert st0.kl == 0.0
    trainable = [n for n, p in lora.model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)


def test_shared_prefix_update_equals_naive_update():
    policy = load_policy(ModelConfig(name="tiny-random"))
    batch = _batch(policy, n_prompts=3, g=4)
    shared = _grads_after(policy, batch, _cfg("train.shared_prefix=true", "train.micro_batch_size=5"))
    naive = _grads_after(policy, batch, _cfg("train.shared_prefix=false", "train.micro_batch_size=5"))
    assert shared.keys() == naive.keys() and shared
    for k in shared:
        assert (shared[k] - naive[k]).norm() <= 1e-4 * naive[k].norm() + 1e-7, k


def test_skipping_zero_advantage_rows_keeps_the_gradient():
    policy = load_policy(ModelConfig(name="tiny-random"))
    batch = _batch(policy, n_prompts=3, g=4)
    batch.advantages[4:8] = 0.0  # one zero-variance group
    batch.advantages[1] = 0.0
    for agg in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
        skip = _grads_after(policy, batch, _cfg(f"algo.agg={agg}", "train.skip_zero_advantage=true", "train.micro_batch_size=5"))
        full = _grads_after(policy, batch, _cfg(f"algo.agg={agg}", "train.skip_zero_advantage=false", "train.micro_batch_size=5"))
        assert skip.keys() == full.keys() and skip
        for k in skip:
            assert (skip[k] - full[k]).norm() <= 1e-5 * full[k].norm() + 1e-8, (agg, k)
    st = update(policy, torch.optim.AdamW(policy.causal_lm.parameters(), lr=1e-3), batch, _cfg(), torch.Generator().manual_seed(0), 0)
    assert st.rows_run == 12 - 5


def test_all_zero_advantages_still_step_without_running_rows():
    policy = load_policy(ModelConfig(name="tiny-random"))
    batch = _batch(policy)
    batch.advantages.zero_()
    st = update(policy, torch.optim.AdamW(policy.causal_lm.parameters(), lr=1e-3), batch, _cfg(), torch.Generator().manual_seed(0), 0)
    assert st.rows_run == 0 and st.opt_steps == 1 and st.grad_norm == 0.0


def test_an_empty_step_moves_adamw_on_momentum_unless_skipped():
    """After one real step, a step whose every advantage is 0 has a zero gradient: by default AdamW
    still moves every weight (by about 0.67 lr, its momentum; hand computation: m2 / (1 - b1^2) =
    0.47 g, sqrt(v2 / (1 - b2^2)) = 0.707 |g|), and with train.skip_empty_steps the weights and the
    optimizer state stay exactly as they were."""
    for skip in (False, True):
        policy = load_policy(ModelConfig(name="tiny-random"))
        model = policy.causal_lm
        cfg = _cfg("train.lr=1e-3", f"train.skip_empty_steps={str(skip).lower()}")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
        batch = _batch(policy)
        first = update(policy, opt, batch, cfg, torch.Generator().manual_seed(0), 0)
        assert first.opt_steps == 1 and first.skipped_steps == 0 and first.grad_norm > 0
        w1 = {n: p.detach().clone() for n, p in model.named_parameters()}
        state1 = {n: opt.state[p]["exp_avg"].clone() for n, p in model.named_parameters() if p in opt.state}
        batch.advantages.zero_()
        second = update(policy, opt, batch, cfg, torch.Generator().manual_seed(0), 1)
        moved = max((p.detach() - w1[n]).abs().max().item() for n, p in model.named_parameters())
        if skip:
            assert second.opt_steps == 0 and second.skipped_steps == 1 and moved == 0.0
            assert all(torch.equal(opt.state[p]["exp_avg"], state1[n]) for n, p in model.named_parameters() if p in opt.state)
            assert all(int(opt.state[p]["step"]) == 1 for p in model.parameters() if p in opt.state)
        else:
            assert second.opt_steps == 1 and second.skipped_steps == 0
            assert 0.6e-3 < moved < 0.75e-3  # ~0.67 lr on the weights whose first gradient was large against eps


# ----------------------------------------------------------------------------- entropy bonus


def test_entropy_bonus_by_hand():
    from recursa.algorithms.losses import entropy_bonus

    ent = torch.tensor([[0.5, 1.0, 9.0], [2.0, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    # token-mean: -0.1 x (0.5 + 1 + 2) / 3; seq-mean-token-mean: -0.1 x (1.5 / 2 + 2 / 1) / 2; sum-norm at L = 4: -0.1 x (1.5 / 4 + 2 / 4) / 2
    assert entropy_bonus(ent, mask, 0.1, "token-mean").item() == pytest.approx(-0.1 * 3.5 / 3)
    assert entropy_bonus(ent, mask, 0.1, "seq-mean-token-mean").item() == pytest.approx(-0.1 * (0.75 + 2.0) / 2)
    assert entropy_bonus(ent, mask, 0.1, "seq-mean-token-sum-norm", norm_len=4).item() == pytest.approx(-0.1 * (1.5 / 4 + 2 / 4) / 2)
    halves = entropy_bonus(ent[:1], mask[:1], 0.1, "token-mean", num_tokens=3) + entropy_bonus(ent[1:], mask[1:], 0.1, "token-mean", num_tokens=3)
    assert halves.item() == pytest.approx(entropy_bonus(ent, mask, 0.1, "token-mean").item())  # micro-batches add up


def test_entropy_with_gradient_equals_the_logged_entropy_and_its_gradient_is_the_full_logits_one():
    """`entropy_grad` gives the same values as the logged (detached) entropy, attached to the
    graph; its gradient equals the gradient of entropy_from_logits on the full logits, in the
    plain and in the shared-prefix forward."""
    from recursa.algorithms.losses import entropy_from_logits
    from recursa.generation import sequence_logprobs, shared_prefix_logprobs

    policy = load_policy(ModelConfig(name="tiny-random"))
    model = policy.causal_lm
    batch = _batch(policy)
    _, logged = sequence_logprobs(model, batch.input_ids, batch.attention_mask, batch.action_mask, temperature=0.8, with_entropy=True)
    assert not logged.requires_grad
    grads = {}
    for name, fn in (("plain", sequence_logprobs), ("shared", shared_prefix_logprobs)):
        model.zero_grad(set_to_none=True)
        _, ent = fn(model, batch.input_ids, batch.attention_mask, batch.action_mask, temperature=0.8, with_entropy=True, entropy_grad=True)
        assert ent.requires_grad
        torch.testing.assert_close(ent.detach(), logged, atol=1e-5, rtol=1e-5)
        (ent * batch.action_mask).sum().backward()
        grads[name] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1].float() / 0.8  # position t-1 predicts token t
    direct = (entropy_from_logits(logits) * batch.action_mask[:, 1:]).sum()
    direct.backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    for name in grads:
        assert grads[name].keys() == ref.keys()
        for k in ref:
            assert (grads[name][k] - ref[k]).norm() <= 1e-4 * ref[k].norm() + 1e-7, (name, k)


def test_entropy_bonus_runs_zero_advantage_rows_and_raises_the_entropy():
    """With every advantage 0 the policy gradient is 0; the bonus alone runs every row and its
    steps raise the entropy at the action tokens. Off, the update runs no row."""
    from recursa.generation import sequence_logprobs

    policy = load_policy(ModelConfig(name="tiny-random"))
    batch = _batch(policy)
    batch.advantages.zero_()
    st = update(policy, torch.optim.AdamW(policy.causal_lm.parameters(), lr=1e-3), batch, _cfg(), torch.Generator().manual_seed(0), 0)
    assert st.rows_run == 0

    def entropy():
        with torch.no_grad():
            _, e = sequence_logprobs(policy.causal_lm, batch.input_ids, batch.attention_mask, batch.action_mask, with_entropy=True)
        return ((e * batch.action_mask).sum() / batch.action_mask.sum()).item()

    before = entropy()
    cfg = _cfg("algo.entropy_coef=1.0", "train.lr=1e-2")
    opt = torch.optim.AdamW(policy.causal_lm.parameters(), lr=1e-2)
    for step in range(3):
        st = update(policy, opt, batch, cfg, torch.Generator().manual_seed(step), step)
        assert st.rows_run == len(batch.advantages)
    assert entropy() > before + 1e-3
    # the bonus adds -coef x token-mean entropy to the loss: with zero advantages the logged loss is that term
    assert st.loss == pytest.approx(-st.entropy, rel=1e-4)


def test_entropy_bonus_micro_batches_add_up():
    policy = load_policy(ModelConfig(name="tiny-random"))
    batch = _batch(policy)
    for agg in ("token-mean", "seq-mean-token-mean"):
        full = _grads_after(policy, batch, _cfg(f"algo.agg={agg}", "algo.entropy_coef=0.05", "train.micro_batch_size=8"))
        micro = _grads_after(policy, batch, _cfg(f"algo.agg={agg}", "algo.entropy_coef=0.05", "train.micro_batch_size=3"))
        plain = _grads_after(policy, batch, _cfg(f"algo.agg={agg}", "train.micro_batch_size=8"))
        assert full.keys() == micro.keys() and full
        assert any((full[k] - plain[k]).norm() > 1e-6 for k in full)  # the bonus changes the gradient
        for k in full:
            assert (full[k] - micro[k]).norm() <= 1e-5 * full[k].norm() + 1e-8, (agg, k)
