"""Generation and the trainer's log-probs on the tiny random model."""

from __future__ import annotations

import torch

from recursa.generation import SamplingParams, generate, sequence_logprobs
from recursa.rollout import render_prompt
from recursa.trajectory import Trajectory, collate


def _prompts(tok, texts):
    return [render_prompt(tok, t, "You are a helpful assistant.") for t in texts]


def _trajs(prompts, samples):
    out = []
    for s in samples:
        p = prompts[s.prompt_index]
        out.append(Trajectory("t", 0, s.prompt_index, p + s.token_ids, [0] * len(p) + [1] * len(s.token_ids), [0.0] * len(p) + s.logprobs, 0.0, False))
    return out


def test_greedy_matches_transformers_generate(tiny_policy):
    tok, model = tiny_policy.tokenizer, tiny_policy.causal_lm
    prompts = _prompts(tok, ["What is 2 + 2?", "Go north, take the key and open the door please."])
    assert len(prompts[0]) != len(prompts[1])  # left padding is exercised
    samples = generate(model, tok, prompts, SamplingParams(max_new_tokens=10, temperature=0.0))
    for s, p in zip(samples, prompts):
        ref = model.generate(torch.tensor([p]), max_new_tokens=10, do_sample=False, pad_token_id=tok.pad_token_id)
        ref_ids = ref[0, len(p):].tolist()
        eos = tok.eos_token_id
        if eos in ref_ids:
            ref_ids = ref_ids[: ref_ids.index(eos) + 1]
        assert s.token_ids == ref_ids


def test_sampling_logprobs_equal_trainer_logprobs(tiny_policy):
    tok, model = tiny_policy.tokenizer, tiny_policy.causal_lm
    prompts = _prompts(tok, ["short", "a much longer prompt with many more words in it"])
    gen = torch.Generator().manual_seed(1)
    params = SamplingParams(max_new_tokens=12, temperature=0.7)
    samples = generate(model, tok, prompts, params, n=3, generator=gen)
    assert len(samples) == 6 and [s.prompt_index for s in samples] == [0, 0, 0, 1, 1, 1]
    batch = collate(_trajs(prompts, samples), torch.zeros(6), tok.pad_token_id)
    logp, ent = sequence_logprobs(model, batch.input_ids, batch.attention_mask, batch.action_mask, temperature=0.7, with_entropy=True)
    diff = ((logp - batch.sample_logprobs) * batch.action_mask).abs().max().item()
    assert diff < 1e-4
    assert (logp * (1 - batch.action_mask)).abs().sum() == 0
    assert (ent * batch.action_mask).sum() > 0


def test_chunked_projection_is_exact(tiny_policy):
    tok, model = tiny_policy.tokenizer, tiny_policy.causal_lm
    prompts = _prompts(tok, ["one", "two three"])
    samples = generate(model, tok, prompts, SamplingParams(max_new_tokens=9), n=2, generator=torch.Generator().manual_seed(0))
    batch = collate(_trajs(prompts, samples), torch.zeros(4), tok.pad_token_id)
    a, _ = sequence_logprobs(model, batch.input_ids, batch.attention_mask, batch.action_mask, chunk=3)
    b, _ = sequence_logprobs(model, batch.input_ids, batch.attention_mask, batch.action_mask, chunk=10_000)
    torch.testing.assert_close(a, b)


def test_shared_prefill_equals_repeated_prompts(tiny_policy):
    """n samples from one prefill == the same prompt repeated n times (same draws)."""
    tok, model = tiny_policy.tokenizer, tiny_policy.causal_lm
    prompts = _prompts(tok, ["alpha", "beta gamma delta"])
    params = SamplingParams(max_new_tokens=8, temperature=1.0)
    shared = generate(model, tok, prompts, params, n=3, generator=torch.Generator().manual_seed(5))
    repeated = generate(model, tok, [p for p in prompts for _ in range(3)], params, n=1, generator=torch.Generator().manual_seed(5))
    assert [s.token_ids for s in shared] == [s.token_ids for s in repeated]
    for a, b in zip(shared, repeated):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)


def test_sampling_is_deterministic_given_seed(tiny_policy):
    tok, model = tiny_policy.tokenizer, tiny_policy.causal_lm
    prompts = _prompts(tok, ["x"])
    params = SamplingParams(max_new_tokens=8, temperature=1.0, top_p=0.9)
    a = generate(model, tok, prompts, params, n=4, generator=torch.Generator().manual_seed(3))
    b = generate(model, tok, prompts, params, n=4, generator=torch.Generator().manual_seed(3))
    c = generate(model, tok, prompts, params, n=4, generator=torch.Generator().manual_seed(4))
    assert [s.token_ids for s in a] == [s.token_ids for s in b]
    assert [s.token_ids for s in a] != [s.token_ids for s in c]


def test_stop_strings_and_finished_rows(tiny_policy):
    tok, model = tiny_policy.tokenizer, tiny_policy.causal_lm
    prompts = _prompts(tok, ["x", "y"])
    params = SamplingParams(max_new_tokens=20, temperature=1.0)
    free = generate(model, tok, prompts, params, n=4, generator=torch.Generator().manual_seed(0))
    # Pick a stop string that a free run produces, then check the run stops right there.
    text = tok.decode(free[0].token_ids[:3])
    stop = text[-1] if text else "e"
    stopped = generate(model, tok, prompts, SamplingParams(20, 1.0, 1.0, (stop,)), n=4, generator=torch.Generator().manual_seed(0))
    assert stopped[0].finish_reason == "stop"
    assert len(stopped[0].token_ids) <= 3
    assert stop in tok.decode(stopped[0].token_ids)
    assert stopped[0].token_ids == free[0].token_ids[: len(stopped[0].token_ids)]
    for s in stopped:
        if s.finish_reason == "stop":
            assert stop in tok.decode(s.token_ids) and stop not in tok.decode(s.token_ids[:-1])
        assert len(s.token_ids) == len(s.logprobs) <= 20


def test_top_p_restricts_support(tiny_policy):
    tok, model = tiny_policy.tokenizer, tiny_policy.causal_lm
    prompts = _prompts(tok, ["z"])
    greedy = generate(model, tok, prompts, SamplingParams(max_new_tokens=1, temperature=0.0))[0].token_ids
    tiny_p = generate(model, tok, prompts, SamplingParams(max_new_tokens=1, temperature=1.0, top_p=1e-6), n=8, generator=torch.Generator().manual_seed(0))
    assert all(s.token_ids == greedy for s in tiny_p)
