"""The search-agent testbed (recursa/envs/search.py): BM25 by hand, worlds from the seed,
an oracle chat that searches and wins, a GRPO run in chat mode on the tiny model."""

from __future__ import annotations

import json
import math

import pytest

from recursa.agent import AgentConfig
from recursa.chat import chat_episodes
from recursa.envs import make_env, split_seed
from recursa.envs.search import BM25, SearchEnv, normalise
from recursa.generation import SamplingParams
from test_chat import Scripted


def test_bm25_by_hand():
    index = BM25(["a b", "a c c", "d"])  # N = 3, avgdl = 2
    idf_a, idf_c = math.log(1 + 1.5 / 2.5), math.log(1 + 2.5 / 1.5)
    assert index.idf["a"] == pytest.approx(idf_a) and index.idf["c"] == pytest.approx(idf_c)
    # tf (k1 + 1) / (tf + k1 (1 - b + b dl / avgdl)), k1 = 1.5, b = 0.75
    assert index.scores("c") == pytest.approx([0.0, idf_c * 2 * 2.5 / (2 + 1.5 * (0.25 + 0.75 * 1.5)), 0.0])
    assert index.scores("a") == pytest.approx([idf_a * 1.0, idf_a * 2.5 / (1 + 1.5 * (0.25 + 0.75 * 1.5)), 0.0])
    assert index.scores("A, a!") == index.scores("a")  # case, punctuation and repeats do not count
    assert [i for i, _ in index.top_k("a c", 2)] == [1, 0] and index.top_k("zzz", 3) == []


def test_a_world_is_a_pure_function_of_the_seed_and_needs_a_search():
    env, twin = SearchEnv(), SearchEnv()
    assert env.reset(5) == twin.reset(5) and env.articles == twin.articles and env.task == twin.task and env.answer == twin.answer
    other = SearchEnv()
    other.reset(split_seed("test", 5))
    assert other.articles != env.articles  # a held-out seed is another world
    assert env.answer not in env.task and env.answer.lower() not in env.reset(5).lower()
    # two hops: the person's article names the town, the town's article the province
    first, second = env.oracle_queries()
    assert env.town in env.search(first).split("\n")[0] and env.answer in env.search(second).split("\n")[0]
    assert env.searches == 2 and "no article matches" in env.search("qqqq")


def test_answers_are_exact_match_on_the_name():
    env = SearchEnv(hops=1)
    env.reset(3)
    assert env.step(f"<answer>{env.answer.upper()}.</answer>").reward == 1.0
    assert env.step(env.answer).info["success"] and env.step(env.walkthrough()[0]).reward == 1.0
    assert env.step(f"<answer>{env.answer} town</answer>").reward == 0.0 and env.step("").reward == 0.0
    assert normalise("  Ka-Dor  ") == "ka dor"


def test_registered_with_kwargs_and_bad_kwargs_are_one_line():
    from recursa.envs import list_envs
    from recursa.errors import UserError

    assert make_env("search", hops=1, people=4).n_people == 4
    assert any(name == "search" for name, _ in list_envs())
    with pytest.raises(UserError, match="hops must be 1 or 2"):
        make_env("search", hops=3)


def test_an_oracle_chat_searches_and_wins():
    from recursa.models import tiny_tokenizer

    tok = tiny_tokenizer()
    env, twin = SearchEnv(), SearchEnv()
    seed = split_seed("test", 7)
    twin.reset(seed)
    calls = [f'<tool_call>{{"name": "search", "arguments": {{"query": "{q}"}}}}</tool_call>' for q in twin.oracle_queries()]
    engine = Scripted(tok, calls + [twin.walkthrough()[0]])
    (episode,), _, _ = chat_episodes(tok, None, [env], [seed], 1, SamplingParams(max_new_tokens=64), None, None, AgentConfig(episode="chat"), [None], engine)
    assert episode.won and len(episode.turns) == 3 and episode.total_reward == 1.0
    assert twin.town in episode.turns[1].observation and twin.answer in episode.turns[2].observation
    wrong = Scripted(tok, ["<answer>Nowhere</answer>"])
    (lost,), _, _ = chat_episodes(tok, None, [SearchEnv()], [seed], 1, SamplingParams(max_new_tokens=64), None, None, AgentConfig(episode="chat"), [None], wrong)
    assert not lost.won and lost.total_reward == 0.0


def test_grpo_in_chat_mode_on_the_search_env(tmp_path):
    from recursa.config import load_config
    from recursa.recipes.grpo import train

    cfg = load_config(None, [
        "model.name=tiny-random", "env.name=search", "env.kwargs.hops=1", "agent.episode=chat", "agent.max_tool_calls=2",
        "sampling.max_new_tokens=12", "train.steps=2", "train.prompts_per_step=2", "train.group_size=2", "eval.n=2",
    ])
    run = train(cfg, tmp_path / "search", log=lambda *_: None)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len([r for r in rows if "reward/mean" in r]) == 2
    after = json.loads((run / "eval" / "after.json").read_text())
    assert after["n"] == 2 and after["success_rate"] == 0.0  # a random tiny model finds no invented name


@pytest.mark.parametrize("hops", [1, 2])
def test_the_oracle_searches_find_the_answer_first_in_every_world(hops):
    for seed in range(60):
        env = SearchEnv(hops=hops)
        env.reset(seed)
        results = [env.search(q).split("\n")[0] for q in env.oracle_queries()]
        assert env.town in results[0] and env.answer in results[-1]


@pytest.mark.parametrize("family", ["tiny-chatml", "smollm2"])
def test_an_oracle_transcript_is_the_tokens_of_the_oracle_chat(family):
    """SFT on a transcript (recursa.demos.transcript_row) trains the very tokens a chat episode
    with the same replies holds, its assistant replies and nothing else as targets."""
    from recursa.chat import oracle_transcript
    from recursa.demos import transcript_row
    from recursa.models import tiny_tokenizer
    from test_chat import _embedded_tokenizer

    tok = _embedded_tokenizer() if family == "smollm2" else tiny_tokenizer()
    agent = AgentConfig(episode="chat")
    messages = oracle_transcript(SearchEnv(), 11, tok, agent)
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user", "assistant", "user", "assistant"]
    row = transcript_row(messages, tok, None, seed=11)
    replies = [m["content"] for m in messages if m["role"] == "assistant"]
    engine = Scripted(tok, replies)
    (episode,), _, _ = chat_episodes(tok, None, [SearchEnv()], [11], 1, SamplingParams(max_new_tokens=64), None, None, agent, [None], engine)
    last = episode.rows()[-1]
    assert episode.won and row.token_ids[: len(last.token_ids)] == last.token_ids
    targets = [t for t, m in zip(row.token_ids, row.action_mask) if m]
    assert targets == [t for turn in episode.turns for t in turn.action_ids]


@pytest.mark.parametrize("family", ["tiny-chatml", "smollm2"])
def test_a_chat_walkthrough_of_a_game_is_the_tokens_of_its_chat_episode(family):
    """data.source = 'walkthrough' with agent.episode = 'chat' on a multi-turn game: one row per
    game, the oracle's actions with the observations between them, whose tokens are those of a
    chat episode that plays the same replies and whose targets are exactly its replies."""
    from recursa.demos import chat_walkthrough_demos
    from recursa.models import tiny_tokenizer
    from test_chat import _embedded_tokenizer

    tok = _embedded_tokenizer() if family == "smollm2" else tiny_tokenizer()
    agent = AgentConfig(episode="chat")
    kwargs = {"rooms": 1, "objects_per_room": 2, "distractors": 0, "tasks": "heat_then_place", "max_steps": 12}
    seed = 3
    demos = chat_walkthrough_demos(make_env("household", **kwargs), [seed], tok, None, agent)
    (row,) = demos.rows
    env = make_env("household", **kwargs)
    env.reset(seed)
    actions = env.walkthrough()
    assert len(actions) > 2 and demos.items == 1 and not demos.dropped
    (episode,), _, _ = chat_episodes(tok, None, [make_env("household", **kwargs)], [seed], 1, SamplingParams(max_new_tokens=64), None, None,
                                     agent, [None], Scripted(tok, actions))
    assert episode.won and [t.action for t in episode.turns] == actions
    last = episode.rows()[-1]
    assert row.token_ids[: len(last.token_ids)] == last.token_ids  # (the template may close with a newline, never a target)
    assert not any(row.action_mask[len(last.token_ids):]) and len(row.token_ids) - len(last.token_ids) <= 1
    targets = [t for t, m in zip(row.token_ids, row.action_mask) if m]
    assert targets == [t for turn in episode.turns for t in turn.action_ids]


def test_a_chat_walkthrough_that_does_not_win_is_dropped_and_turn_mode_options_are_refused(tmp_path):
    from recursa.config import load_config
    from recursa.demos import chat_walkthrough_demos
    from recursa.errors import UserError
    from recursa.models import tiny_tokenizer
    from recursa.recipes.sft import train

    class Lost(SearchEnv):
        def walkthrough(self):
            return ["<answer>Nowhere</answer>"]

    demos = chat_walkthrough_demos(Lost(hops=1), [0, 1], tiny_tokenizer(), None, AgentConfig(episode="chat"))
    assert demos.rows == [] and demos.dropped == {"walkthrough does not win": 2}
    base = ["recipe=sft", "model.name=tiny-random", "env.name=search", "env.kwargs.hops=1", "agent.episode=chat", "data.n=2", "train.epochs=1",
            "train.batch_size=2", "eval.before=false", "eval.n=1"]
    with pytest.raises(UserError, match="write turn-mode rows; with agent.episode = 'chat' drop them"):
        train(load_config(None, [*base, "data.win_hints=0.5"], recipe="sft"), tmp_path / "hinted", log=lambda *_: None)


def test_sft_in_chat_mode_from_the_oracle_then_grpo_from_it(tmp_path):
    """The search testbed's warm start in one command (examples/search_sft.toml's shape): SFT
    on the oracle's chats of training questions, then GRPO in chat mode from that run."""
    from recursa.config import load_config
    from recursa.recipes import grpo, sft

    sets = ["model.name=tiny-random", "env.name=search", "env.kwargs.hops=1", "agent.episode=chat", "agent.max_tool_calls=2",
            "sampling.max_new_tokens=12", "eval.n=2", "eval.batch_size=2"]
    warm = sft.train(load_config(None, [*sets, "recipe=sft", "data.n=4", "train.epochs=2", "train.batch_size=2", "train.micro_batch_size=2",
                                        "train.lr=1e-3", "eval.before=false"], recipe="sft"), tmp_path / "sft", log=lambda *_: None)
    demos = json.loads((warm / "demos.json").read_text())
    assert demos["source"] == "walkthrough" and demos["rows"] == 4 and demos["items"] == 4 and demos["seeds"] == [0, 1, 2, 3]
    losses = [json.loads(line)["sft/loss"] for line in (warm / "metrics.jsonl").read_text().splitlines() if "sft/loss" in line]
    assert len(losses) == 4 and losses[-1] < losses[0]  # lr 1e-3 on the same four chats: the loss falls
    run = grpo.train(load_config(None, [*sets, f"init.from_run={warm}", "train.steps=1", "train.prompts_per_step=2", "train.group_size=2"]),
                     tmp_path / "grpo", log=lambda *_: None)
    assert json.loads((run / "eval" / "after.json").read_text())["n"] == 2
