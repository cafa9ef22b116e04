"""The OpenAI-compatible endpoint (recursa/serve.py, docs/serve.md): a harness written only
against the `openai` client is served by recursa's engine, every completion recorded as
tokens; the training rows are exactly what the server sampled, across turns and a tool call;
GRPO trains through it; bad requests are OpenAI-shaped errors that lose nothing."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import openai  # the test extra installs it (pyproject: [project.optional-dependencies] test)
import pytest
import torch

from recursa.agent import AgentConfig
from recursa.errors import UserError
from recursa.generation import Sample, SamplingParams, sequence_logprobs
from recursa.serve import HarnessEnv, PolicyServer, harness_rollout

TOOLS = [{"type": "function", "function": {"name": "open_box", "description": "Open a box and read its code.",
                                            "parameters": {"type": "object", "properties": {"box": {"type": "integer"}}, "required": ["box"]}}}]
SEEN: list[str] = []  # what the harnesses read back, in no particular order


def _client(base_url):
    return openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)


def box_harness(base_url, seed):
    """An agent as one writes it against the OpenAI client: ask, run the tool calls the model
    makes, ask again; the reward is the share of digits in its replies (1 for the right code)."""
    client = _client(base_url)
    messages = [{"role": "system", "content": "Find the code."}, {"role": "user", "content": f"What is the code in box {seed % 5}?"}]
    replies = []
    for _ in range(3):
        message = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS, max_tokens=8).choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        SEEN.append(message.content or "")
        if message.tool_calls:
            for call in message.tool_calls:
                box = json.loads(call.function.arguments)["box"]
                messages.append({"role": "tool", "tool_call_id": call.id, "content": f"box {box} holds code {100 + box}"})
            continue
        if (message.content or "").strip() == str(100 + seed % 5):
            return 1.0
        replies.append(message.content or "")
        messages.append({"role": "user", "content": "That is not the code. Try again."})
    text = "".join(replies)
    return sum(c.isdigit() for c in text) / max(len(text), 1)


def digits_harness(base_url, seed):
    """Two turns, no tools; reward: the share of digits in the replies (what GRPO can push)."""
    client = _client(base_url)
    messages = [{"role": "user", "content": f"Write digits. Item {seed % 7}."}]
    text = ""
    for _ in range(2):
        message = client.chat.completions.create(model="policy", messages=messages).choices[0].message
        messages += [{"role": "assistant", "content": message.content}, {"role": "user", "content": "More digits."}]
        text += message.content or ""
    return sum(c.isdigit() for c in text) / max(len(text), 1)


class Recording:
    """The tiny model's own sampler, recording every (prompt, sample) it returns; a prompt that
    holds no tool result yet is answered with a tool call, teacher-forced under the model's
    log-probs (a random model would not write one)."""

    continuous = False

    def __init__(self, policy, engine):
        self.policy, self.engine, self.served = policy, engine, []

    def _forced(self, prompt, box):
        tok = self.policy.tokenizer
        ids = tok.encode(f'<tool_call>[{{"name": "open_box", "arguments": {{"box": {box}}}}}]</tool_call>', add_special_tokens=False) + [tok.eos_token_id]
        return Sample(0, ids, _logps(self.policy, prompt, ids), "eos")

    def generate(self, prompts, params, n=1, generator=None, stats=None):
        tok = self.policy.tokenizer
        out = self.engine.generate(prompts, params, n=n, generator=generator, stats=stats)
        for k, p in enumerate(prompts):
            text = tok.decode(p)
            if "holds code" not in text and "What is the code in box" in text:
                out[k] = self._forced(list(p), int(text.split("What is the code in box ")[1][0]))
            out[k].prompt_index = k
            self.served.append((list(p), list(out[k].token_ids), list(out[k].logprobs)))
        return out


def _logps(policy, prompt, ids, temperature=1.0):
    x = torch.tensor([prompt + ids])
    mask = torch.tensor([[0] * len(prompt) + [1] * len(ids)], dtype=torch.float32)
    with torch.no_grad():
        lp = sequence_logprobs(policy.causal_lm, x, torch.ones_like(x), mask, temperature)[0][0]
    return lp[len(prompt):].tolist()


# ------------------------------------------------------------------------- token exactness


def test_a_harness_episode_trains_on_exactly_what_the_server_sampled(tiny_policy):
    """2 items x 2 episodes of a tool-using harness (a tool call, its result, two sampled
    replies): the GRPO rows are the prompts and samples the engine returned, with its
    log-probs, each turn's prompt extends the previous one token for token, and the trainer
    scores the sampled tokens at the sampler's log-probs."""
    from recursa.algorithms.advantages import compute_advantages
    from recursa.config import load_config
    from recursa.engines import NativeEngine
    from recursa.recipes.grpo import episode_rows

    engine = Recording(tiny_policy, NativeEngine(tiny_policy))
    agent = AgentConfig(episode="chat")
    SEEN.clear()
    ro = harness_rollout(tiny_policy, lambda: HarnessEnv(box_harness), [3, 6], 2, SamplingParams(max_new_tokens=8), torch.Generator().manual_seed(0),
                         None, agent, None, engine)
    assert len(ro.episodes) == 4 and [e.group for e in ro.episodes] == [0, 0, 1, 1]
    tok = tiny_policy.tokenizer
    for e in ro.episodes:
        assert e.turns[0].action.startswith("open_box(") and e.turns[1].observation.startswith(f"box {e.seed % 5} holds code")
        assert f"box {e.seed % 5} holds code {100 + e.seed % 5}" in tok.decode(e.turns[1].prompt_ids)  # the tool result, under the template
        for prev, turn in zip(e.turns, e.turns[1:]):
            assert turn.prompt_ids[: len(prev.prompt_ids) + len(prev.action_ids)] == prev.prompt_ids + prev.action_ids  # never re-rendered
    assert ro.episodes[0].turns[1].action_ids != ro.episodes[1].turns[1].action_ids  # each episode samples from its own stream

    cfg = load_config(None, ["model.name=tiny-random", "agent.episode=chat", "train.group_size=2"])
    rewards = torch.tensor([[e.total_reward for e in ro.episodes[:2]], [e.total_reward for e in ro.episodes[2:]]])
    rows, _, _ = episode_rows(ro.episodes, compute_advantages("grpo", rewards), cfg)
    served = sorted((tuple(p + s), tuple(lp)) for p, s, lp in engine.served)
    trained = sorted((tuple(r.token_ids), tuple(lp for lp, m in zip(r.sample_logprobs, r.action_mask) if m)) for r in rows)
    assert len(rows) == len(engine.served) == sum(len(e.turns) for e in ro.episodes) and trained == served
    for r in rows:
        start = r.action_mask.index(1)
        rescored = _logps(tiny_policy, r.token_ids[:start], r.token_ids[start:])
        assert max(abs(a - b) for a, b in zip(rescored, r.sample_logprobs[start:])) < 1e-4
    sampled_texts = {tok.decode(t.action_ids, skip_special_tokens=True) for e in ro.episodes for t in e.turns[1:]}
    assert sampled_texts <= set(SEEN)  # what the client read is the decoding of the ids trained on


def test_grpo_trains_two_steps_through_the_endpoint(tmp_path):
    """`env.name = "harness:test_serve:digits_harness"`: the recipe runs the harness, two GRPO
    steps update the tiny model on the served rows, and the evaluation plays it greedily."""
    from recursa.config import load_config
    from recursa.recipes.grpo import train

    cfg = load_config(None, [
        "model.name=tiny-random", "env.name=harness:test_serve:digits_harness", "agent.episode=chat", "sampling.max_new_tokens=6",
        "train.steps=2", "train.prompts_per_step=2", "train.group_size=2", "eval.n=2", "train.lr=1e-3",
    ])
    run = train(cfg, tmp_path / "harness", log=lambda *_: None)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward/mean" in r]
    assert len(steps) == 2 and all(r["batch/rows"] == 2 * 2 * 2 for r in steps)
    assert all(r["policy/grad_norm"] > 0 for r in steps)
    after = json.loads((run / "eval" / "after.json").read_text())
    assert after["n"] == 2 and after["mean_steps"] == 2.0


# ------------------------------------------------------------------------- bad input


class Scripted:
    """Replies with given texts (ids + EOS, log-prob -0.5 each)."""

    def __init__(self, tok, replies=()):
        self.tok, self.replies = tok, list(replies)

    def generate(self, prompts, params, n=1, generator=None, stats=None):
        out = []
        for k, _ in enumerate(prompts):
            text = self.replies.pop(0) if self.replies else "ok"
            ids = self.tok.encode(text, add_special_tokens=False) + [self.tok.eos_token_id]
            out.append(Sample(k, ids, [-0.5] * len(ids), "eos"))
        return out


@pytest.fixture
def server():
    from recursa.models import tiny_tokenizer

    tok = tiny_tokenizer()
    replies = ['<tool_call>[{"name": "open_box", "arguments": {"box": 2}}]</tool_call>', "102", "101", "again"]
    with PolicyServer(tok, Scripted(tok, replies), SamplingParams(max_new_tokens=16), max_context_tokens=1000) as s:
        yield s


def _post(url, data: bytes):
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(request) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_unknown_model_and_malformed_requests_are_openai_errors_that_lose_nothing(server):
    ep = server.open_episode(0)
    client = _client(ep.base_url)
    assert [m.id for m in client.models.list().data] == ["policy"]
    user = [{"role": "user", "content": "What is in box 2?"}]
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-4o", messages=user)
    assert info.value.status_code == 404 and info.value.code == "model_not_found" and "'gpt-4o' does not exist" in info.value.message
    status, body = _post(f"{ep.base_url}/chat/completions", b'{"model": "policy", "messages": [')
    assert status == 400 and body["error"]["code"] == "invalid_json" and body["error"]["type"] == "invalid_request_error"
    for bad, param in [({"messages": user}, "model"), ({"model": "policy", "messages": []}, "messages"),
                       ({"model": "policy", "messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role"),
                       ({"model": "policy", "messages": user, "n": 2}, "n"), ({"model": "policy", "messages": user, "max_tokens": 0}, "max_tokens"),
                       ({"model": "policy", "messages": user, "tools": [{"type": "function", "function": {"name": "no spaces"}}]}, "tools")]:
        status, body = _post(f"{ep.base_url}/chat/completions", json.dumps(bad).encode())
        assert status == 400 and body["error"]["param"] == param and "\n" not in body["error"]["message"], (bad, body)
    assert _post(f"{server.url}/v1/chat/completions", json.dumps({"model": "policy", "messages": user}).encode())[0] == 404  # no episode
    assert _post(f"{server.url}/e/nope/v1/chat/completions", json.dumps({"model": "policy", "messages": user}).encode())[1]["error"]["code"] == "episode_not_found"
    assert ep.turns == []  # nothing was sampled for a refused request ...
    reply = client.chat.completions.create(model="policy", messages=user, tools=TOOLS)  # ... and the episode goes on
    call = reply.choices[0].message.tool_calls[0]
    assert reply.choices[0].finish_reason == "tool_calls" and call.function.name == "open_box" and json.loads(call.function.arguments) == {"box": 2}
    assert reply.choices[0].message.content is None and reply.usage.completion_tokens == len(ep.turns[0].action_ids) and len(ep.turns) == 1


def test_a_rewritten_history_is_refused_and_the_true_one_goes_on(server):
    ep = server.open_episode(0)
    client = _client(ep.base_url)
    messages = [{"role": "user", "content": "What is in box 2?"}]
    first = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS).choices[0].message
    call = first.tool_calls[0]
    tool = {"role": "tool", "tool_call_id": call.id, "content": "box 2 holds code 102"}
    edited = {"role": "assistant", "content": None, "tool_calls": [{"id": call.id, "type": "function", "function": {"name": "open_box", "arguments": '{"box": 3}'}}]}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="policy", messages=messages + [edited, tool], tools=TOOLS)
    assert info.value.code == "history_rewritten" and "messages[1] (assistant) differs from the assistant message the episode holds there" in info.value.message
    with pytest.raises(openai.BadRequestError, match="its tools differ"):
        client.chat.completions.create(model="policy", messages=messages + [first.model_dump(exclude_none=True), tool])
    second = client.chat.completions.create(model="policy", messages=messages + [first.model_dump(exclude_none=True), tool], tools=TOOLS)
    assert second.choices[0].message.content == "102" and len(ep.turns) == 2
    a, b = ep.turns
    assert b.prompt_ids[: len(a.prompt_ids) + len(a.action_ids)] == a.prompt_ids + a.action_ids
    # a request without assistant messages is a conversation of its own (a harness's second agent)
    client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "Summarise."}])
    assert len(ep.turns) == 3 and len(ep.conversations) == 2


def test_context_streaming_logprobs_and_a_posted_reward(server):
    ep = server.open_episode(0)
    client = _client(ep.base_url)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "word " * 1500}])
    assert info.value.code == "context_length_exceeded"
    chunks = list(client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "Hi"}], stream=True, logprobs=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == ep.turns[0].reply and chunks[-1].choices[0].finish_reason == "stop"
    assert [t.logprob for t in chunks[0].choices[0].logprobs.content] == ep.turns[0].action_logprobs
    assert _post(f"{ep.base_url}/reward", b'{"reward": "high"}')[0] == 400
    assert _post(f"{ep.base_url}/reward", b'{"reward": 0.75, "success": true}') == (200, {"ok": True})
    assert ep.reward == {"reward": 0.75, "success": True}


def _raises(base_url, seed):
    _client(base_url).chat.completions.create(model="policy", messages=[{"role": "user", "content": "Hi"}])
    raise ValueError("the harness lost its way\nin two lines")


def _posts(base_url, seed):
    _client(base_url).chat.completions.create(model="policy", messages=[{"role": "user", "content": "Hi"}])
    _post(f"{base_url}/reward", json.dumps({"reward": 0.25}).encode())


def _rewrites(base_url, seed):
    client = _client(base_url)
    first = client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "Hi"}]).choices[0].message
    client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "Hi"}, {"role": "assistant", "content": first.content + "!"},
                                                             {"role": "user", "content": "Again"}])
    return 0.0


def _play(tok, harness, **kwargs):
    return harness_rollout(_Policy(tok), lambda: HarnessEnv(harness, **kwargs), [5], 1, SamplingParams(max_new_tokens=8, temperature=0.0), None, None,
                           AgentConfig(episode="chat"), None, Scripted(tok))


class _Policy:
    def __init__(self, tok):
        self.tokenizer, self.causal_lm = tok, None


def test_a_harness_that_raises_or_rewrites_is_one_line_and_a_posted_reward_counts():
    from recursa.models import tiny_tokenizer

    tok = tiny_tokenizer()
    with pytest.raises(UserError) as info:
        _play(tok, _raises)
    message = str(info.value)
    assert "\n" not in message and "(item 5, episode 0) raised ValueError: the harness lost its way in two lines" in message
    lost = _play(tok, _raises, errors="lose").episodes[0]
    assert lost.finish_reason == "crashed" and lost.total_reward == 0.0 and len(lost.turns) == 1
    with pytest.raises(UserError, match="raised BadRequestError: .*rewrite this episode's history") as info:
        _play(tok, _rewrites)
    assert "\n" not in str(info.value)
    rendered = _play(tok, _rewrites, history="render").episodes[0]  # rendered afresh: a conversation of its own
    assert len(rendered.turns) == 2 and rendered.turns[1].prompt_ids[: len(rendered.turns[0].prompt_ids)] == rendered.turns[0].prompt_ids
    posted = _play(tok, _posts).episodes[0]
    assert posted.total_reward == 0.25 and not posted.won
    with pytest.raises(UserError, match="returned None and POSTed no reward"):
        _play(tok, lambda base_url, seed: _client(base_url).chat.completions.create(model="policy", messages=[{"role": "user", "content": "Hi"}]) and None)
    with pytest.raises(UserError, match="made no chat completion request"):
        _play(tok, lambda base_url, seed: 1.0)
    with pytest.raises(UserError, match="set agent.episode = 'chat'"):
        harness_rollout(_Policy(tok), lambda: HarnessEnv(_posts), [5], 1, SamplingParams(), None, None, AgentConfig(), None, Scripted(tok))


def test_the_harness_spec_and_a_missing_harness():
    from recursa.envs import make_env
    from recursa.envs.base import list_envs

    env = make_env("harness:test_serve:digits_harness", model="mine", concurrency=2)
    assert isinstance(env, HarnessEnv) and env.harness is digits_harness and env.model == "mine" and env.name == "harness:test_serve:digits_harness"
    with pytest.raises(UserError, match="cannot import module 'no_such_module'"):
        make_env("harness:no_such_module:run")
    with pytest.raises(UserError, match="fix env.kwargs"):
        make_env("harness:test_serve:digits_harness", errors="ignore")
    assert any(name.startswith("harness:") for name, _ in list_envs())


def test_a_harness_env_in_turn_mode_is_a_config_error():
    """env.name = 'harness:...' needs chat episodes; the config says so before any run directory exists."""
    from recursa.config import load_config
    from recursa.errors import UserError

    with pytest.raises(UserError, match="set agent.episode = 'chat'"):
        load_config(None, ["model.name=tiny-random", 'env.name="harness:test_serve:digits_harness"', 'agent.episode="turn"'])
