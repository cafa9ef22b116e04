"""The verifiers adapter (recursa/envs/verifiers_env.py) on three small verifiers environments
written here, offline: a single-turn taskset with two weighted rewards, a multi-turn guessing
env whose run() answers each reply, and a taskset with a Toolset. Scores against hand
computations, disjoint splits, tool calls on the trace, failures as one line, and GRPO two
steps on the tiny model in turn and chat episodes."""

from __future__ import annotations

import json
import sys
import textwrap

import pytest

pytest.importorskip("verifiers.v1")

from recursa.envs import make_env  # noqa: E402
from recursa.envs.protocol import split_seed  # noqa: E402
from recursa.errors import UserError  # noqa: E402

SUM = '''
import verifiers.v1 as vf

class SumData(vf.TaskData):
    answer: str

class SumTask(vf.Task[SumData, vf.State, vf.TaskConfig]):
    @vf.reward(weight=2.0)
    async def correct(self, task, trace) -> float:
        return float(trace.last_reply == task.answer)

    @vf.reward(weight=0.5)
    async def short(self, trace) -> float:
        return float(len(trace.last_reply) <= 2)

class SumConfig(vf.TasksetConfig):
    n: int = 30
    strict: bool = False

class StrictTask(SumTask):
    @vf.reward
    async def numeric(self, trace) -> float:
        if not trace.last_reply.isdigit():
            raise ValueError("the reply is not a number")
        return 0.0

class SumTaskset(vf.Taskset[SumTask, SumConfig]):
    def load(self):
        cls = StrictTask if self.config.strict else SumTask
        for i in range(self.config.n):
            yield cls(SumData(prompt=f"What is {i} + {i}?", answer=str(2 * i), system_prompt="Reply with the number only."), self.config.task)

__all__ = ["SumTaskset"]
'''

GUESS = '''
import re
import verifiers.v1 as vf

class GuessData(vf.TaskData):
    target: int

class GuessTask(vf.Task[GuessData, vf.State, vf.TaskConfig]):
    @vf.reward(weight=0.5)
    async def quick(self, trace) -> float:
        return float(trace.num_turns <= 3)

class GuessTaskset(vf.Taskset[GuessTask, vf.TasksetConfig]):
    def load(self):
        for i in range(40):
            yield GuessTask(GuessData(prompt="Guess my number between 1 and 16.", target=(7 * i) % 16 + 1), self.config.task)

class GuessEnvConfig(vf.EnvConfig):
    player: vf.AgentConfig = vf.AgentConfig()

class GuessEnv(vf.Env[GuessEnvConfig]):
    async def run(self, task, agents):
        won = False
        async with agents.player.interaction(task) as chat:
            segment = await chat.turn()
            for _ in range(6):
                found = re.findall(r"\\d+", segment.last_reply)
                guess = int(found[0]) if found else 0
                if guess == task.data.target:
                    won = True
                    break
                segment = await chat.turn("higher" if guess < task.data.target else "lower")
        chat.trace.record_reward("solved", float(won), 1.0)

__all__ = ["GuessEnv", "GuessTaskset"]
'''

LOOKUP = '''
import verifiers.v1 as vf

WORDS = {"tarn": "a small mountain lake", "fell": "a high moor"}

class Glossary(vf.Toolset):
    @vf.tool
    async def define(self, word: str) -> str:
        """Look a word up in the glossary."""
        return WORDS.get(word.lower(), "not in the glossary")

class LookupData(vf.TaskData):
    answer: str

class LookupTask(vf.Task[LookupData, vf.State, vf.TaskConfig]):
    @classmethod
    def toolsets(cls, config):
        return [Glossary(vf.ToolsetConfig())]

    @vf.reward
    async def correct(self, task, trace) -> float:
        return float(task.answer in trace.last_reply)

    @vf.reward(weight=0.25)
    async def looked_up(self, trace) -> float:
        return float(any("lake" in str(m.content) for m in trace.tool_messages))

class LookupTaskset(vf.Taskset[LookupTask, vf.TasksetConfig]):
    def load(self):
        for i in range(20):
            yield LookupTask(LookupData(prompt=f"Item {i}: what is a tarn? Use the glossary.", answer="lake"), self.config.task)

__all__ = ["LookupTaskset"]
'''


@pytest.fixture(scope="module", autouse=True)
def toy_modules(tmp_path_factory):
    root = tmp_path_factory.mktemp("vf_toys")
    for name, source in {"vf_toy_sum": SUM, "vf_toy_guess": GUESS, "vf_toy_lookup": LOOKUP, "vf_toy_empty": "X = 1\n"}.items():
        (root / f"{name}.py").write_text(textwrap.dedent(source))
    sys.path.insert(0, str(root))
    yield root
    sys.path.remove(str(root))


def test_a_single_turn_taskset_scores_the_reply_with_its_weighted_rewards():
    env = make_env("vf:vf_toy_sum")
    try:
        assert type(env).__name__ == "VerifiersEnv" and not hasattr(env, "admissible_actions")  # single-turn: the whole reply is scored
        obs = env.reset(split_seed("train", 0))
        answer = env.current.data.answer
        assert obs == f"What is {int(answer) // 2} + {int(answer) // 2}?" and env.system_prompt == "Reply with the number only."
        right = env.step(answer)
        assert right.done and right.reward == (2.0 * 1 + 0.5 * (len(answer) <= 2)) and right.info["won"] == (right.reward >= 1.0)
        assert right.info["rewards"] == {"correct": 1.0, "short": float(len(answer) <= 2)}
        assert [m.role for m in env.trace.messages] == ["system", "user", "assistant"] and env.trace.last_reply == answer
        env.reset(split_seed("train", 0))
        wrong = env.step("a long wrong answer")
        assert wrong.reward == 0.0 and not wrong.info["won"] and wrong.info["answer"] == answer
    finally:
        env.close()


def test_train_gate_and_test_seeds_reach_disjoint_tasks():
    env = make_env("vf:vf_toy_sum", gate_frac=0.2, test_frac=0.2)
    counts = {s: env.num_items(s) for s in ("train", "gate", "test")}
    prompts = {s: {env.item(split_seed(s, i)).data.prompt for i in range(counts[s])} for s in counts}
    assert sum(counts.values()) == 30 and all(counts.values())
    assert len(set.union(*prompts.values())) == 30  # each task in exactly one split
    assert env.item(split_seed("test", counts["test"])).data.prompt == env.item(split_seed("test", 0)).data.prompt  # an index wraps
    env.close()


def test_a_multi_turn_env_is_played_through_its_run_and_scored_at_the_end():
    env = make_env("vf:vf_toy_guess", max_steps=8)
    try:
        assert type(env).__name__ == "VerifiersGameEnv" and env.admissible_actions() is None
        assert env.reset(split_seed("train", 0)) == "Guess my number between 1 and 16."
        target, lo, hi, results = env.current.data.target, 1, 16, []
        while True:
            guess = (lo + hi) // 2
            results.append(env.step(str(guess)))
            if results[-1].done:
                break
            assert results[-1].obs in ("higher", "lower") and results[-1].reward == 0.0
            lo, hi = (guess + 1, hi) if results[-1].obs == "higher" else (lo, guess - 1)
        assert guess == target and results[-1].info["won"]
        assert results[-1].reward == 1.0 + 0.5 * (len(results) <= 3)  # run()'s own reward plus the task's weighted one
        roles = [m.role for m in env.trace.messages]
        assert roles == ["user"] + ["assistant", "user"] * (len(results) - 1) + ["assistant"]
        env2 = make_env("vf:vf_toy_guess", max_steps=2)
        env2.reset(split_seed("train", 0))
        ended = [env2.step("0") for _ in range(2)]
        assert [r.done for r in ended] == [False, True] and ended[-1].info["note"] == "max_steps" and not ended[-1].info["won"]
        env2.close()
    finally:
        env.close()


def test_a_toolset_becomes_recursa_tools_and_its_calls_land_on_the_trace():
    from recursa.envs.tools import ToolBudget, parse_tool_calls, run_calls

    env = make_env("vf:vf_toy_lookup")
    try:
        assert type(env).__name__ == "VerifiersGameEnv"  # tools are offered in chat episodes of games
        env.reset(split_seed("train", 0))
        (tool,) = env.tools
        assert tool.name == "glossary_define" and tool.description == "Look a word up in the glossary."
        assert tool.parameters == {"type": "object", "properties": {"word": {"title": "Word", "type": "string"}}, "required": ["word"]}
        calls = parse_tool_calls('<tool_call>{"name": "glossary_define", "arguments": {"word": "Tarn"}}</tool_call><tool_call>{"name": "glossary_define"}</tool_call>')
        results = run_calls(calls, env.tools, ToolBudget(4, 30.0))
        assert results[0].ok and results[0].content == "a small mountain lake"
        assert not results[1].ok and results[1].fault == "call"  # a missing argument is the policy's error, never the tool's
        end = env.step("A mountain lake.")
        assert end.reward == 1.0 + 0.25 and end.info["rewards"] == {"correct": 1.0, "looked_up": 1.0}
        assert [m.role for m in env.trace.messages] == ["user", "assistant", "tool", "assistant"]
        env.reset(split_seed("train", 1))
        assert env.step("no idea").reward == 0.0  # a fresh trace: the last episode's tool call is not counted
    finally:
        env.close()


def test_failures_are_one_line(monkeypatch):
    with pytest.raises(UserError, match="taskset 'vf_no_such_module' not found"):
        make_env("vf:vf_no_such_module")
    with pytest.raises(UserError, match="defines no `__all__`"):
        make_env("vf:vf_toy_empty")
    with pytest.raises(UserError, match=r"cannot be built with kwargs \{'bogus': 1\}.*bogus"):
        make_env("vf:vf_toy_sum", bogus=1)
    env = make_env("vf:vf_toy_sum", strict=True)
    env.reset(0)
    broken = env.step("many")  # a reward function that raises ends the episode unwon, saying why
    assert broken.done and broken.reward == 0.0 and broken.info["failure"] == "env_error" and "the reply is not a number" in broken.info["note"]
    env.close()
    monkeypatch.setitem(sys.modules, "verifiers.v1", None)
    with pytest.raises(UserError, match="needs verifiers: pip install verifiers"):
        make_env("vf:vf_toy_sum")


@pytest.mark.parametrize("spec,episode", [("vf_toy_sum", "turn"), ("vf_toy_guess", "chat"), ("vf_toy_lookup", "chat")])
def test_grpo_trains_two_steps_on_a_verifiers_env(tmp_path, spec, episode):
    from recursa.config import load_config
    from recursa.recipes.grpo import train

    cfg = load_config(None, [
        "model.name=tiny-random", f"env.name=vf:{spec}", "env.kwargs.max_steps=3", f"agent.episode={episode}",
        "sampling.max_new_tokens=5", "train.steps=2", "train.prompts_per_step=2", "train.group_size=2", "eval.n=2",
    ])
    run = train(cfg, tmp_path / spec, log=lambda *_: None)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if "reward/mean" in r]
    assert len(train_rows) == 2
    if spec == "vf_toy_sum":
        assert all(0.0 <= r["reward/mean"] <= 2.5 for r in train_rows)  # single-turn: the weighted rewards' range
    else:
        assert train_rows[0]["batch/rows"] == 2 * 2 * train_rows[0]["episode/turns_mean"]
    env = make_env(f"vf:{spec}")
    assert json.loads((run / "eval" / "after.json").read_text())["n"] == min(2, env.num_items("test"))  # at most the split's tasks
    env.close()


def test_the_family_is_listed():
    from recursa.envs import list_envs

    assert any(name == "vf:<taskset>" and "not installed" not in text for name, text in list_envs())
