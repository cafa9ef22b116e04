"""Rollout backends without Ray: per-group random streams make a step splittable (a split
into shards gives the unsplit call's trajectories), the default path is unchanged, and the
distributed settings are validated with one-line errors. The Ray backend itself is tested
in tests/test_ray_rollout.py."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from recursa.agent import AgentConfig
from recursa.cli import main
from recursa.config import load_config, rollout_streams
from recursa.distributed.rollouts import LocalRollouts, RolloutRequest, make_rollouts, merge, play, shard_bounds
from recursa.envs import EnvPool, env_factory, make_env
from recursa.errors import UserError
from recursa.generation import SamplingParams, generate, generators_from, group_generators, group_seeds
from recursa.rollout import rollout, rollout_episodes

ROOT = Path(__file__).resolve().parents[1]
SMOKE = str(ROOT / "examples" / "smoke.toml")
PARAMS = SamplingParams(max_new_tokens=6, temperature=1.0)


def assert_same_trajectories(a, b):
    """Equal in everything; the sampler's log-probs to 1e-5 (a different batch makes
    different padding, which moves float rounding, not the sampled tokens)."""
    assert len(a) == len(b)
    for x, y in zip(a, b):
        torch.testing.assert_close(torch.tensor(x.sample_logprobs), torch.tensor(y.sample_logprobs), atol=1e-5, rtol=0)
        assert {**vars(x), "sample_logprobs": None} == {**vars(y), "sample_logprobs": None}


def assert_same_episodes(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert (x.env, x.seed, x.group, x.task, x.won, x.finish_reason) == (y.env, y.seed, y.group, y.task, y.won, y.finish_reason)
        assert_same_trajectories(x.rows(), y.rows())


def test_shard_bounds_by_hand():
    assert shard_bounds(5, 2) == [(0, 2), (2, 5)]
    assert shard_bounds(8, 3) == [(0, 2), (2, 5), (5, 8)]
    assert shard_bounds(2, 4) == [(0, 1), (1, 2)]  # never an empty shard
    assert shard_bounds(1, 1) == [(0, 1)]


def test_group_seeds_are_draws_of_the_step_generator():
    g = torch.Generator().manual_seed(7)
    expected = torch.randint(0, 2**63 - 1, (3,), generator=torch.Generator().manual_seed(7)).tolist()
    assert group_seeds(g, 3) == expected
    a, b = group_generators(torch.Generator().manual_seed(7), 3), generators_from(expected)
    assert [torch.rand(2, generator=x).tolist() for x in a] == [torch.rand(2, generator=x).tolist() for x in b]


def test_per_prompt_streams_do_not_depend_on_batch_mates(tiny_policy):
    """With one generator per prompt, a prompt's samples are the same alone or batched with
    others of other lengths, while samples finish at different steps (a stop string)."""
    tok, model = tiny_policy.tokenizer, tiny_policy.causal_lm
    prompts = [tok.encode(t) for t in ("alpha", "beta gamma delta epsilon", "z")]
    params = SamplingParams(max_new_tokens=10, temperature=1.0, stop=("e",))
    together = generate(model, tok, prompts, params, n=3, generator=generators_from([11, 12, 13]))
    assert {s.finish_reason for s in together} == {"stop", "length"}
    assert len({len(s.token_ids) for s in together}) > 2  # rows leave the batch at several steps
    for i, p in enumerate(prompts):
        alone = generate(model, tok, [p], params, n=3, generator=generators_from([11 + i]))
        assert [s.token_ids for s in alone] == [s.token_ids for s in together[3 * i : 3 * i + 3]]
    different = generate(model, tok, prompts, params, n=3, generator=generators_from([11, 99, 13]))
    assert [s.token_ids for s in different[3:6]] != [s.token_ids for s in together[3:6]]
    assert [s.token_ids for s in different[:3]] == [s.token_ids for s in together[:3]]
    with pytest.raises(ValueError, match="one generator per prompt"):
        generate(model, tok, prompts, params, n=1, generator=generators_from([1]))


@pytest.mark.parametrize("game", [False, True])
def test_a_step_split_into_shards_equals_the_whole_step(tiny_policy, game):
    """LocalRollouts with group streams == the same request played as shards (as Ray workers
    play it) and merged; the step generator ends in the same state either way."""
    env, agent = ("toy-corridor", AgentConfig()) if game else ("toy-digits", None)
    request = RolloutRequest([5, 9, 5, 11, 3], 3, PARAMS, None, agent)
    gen = torch.Generator().manual_seed(0)
    whole = LocalRollouts(tiny_policy, EnvPool(lambda: make_env(env)), "group")._call(request, gen)
    gen_after_whole = torch.rand(4, generator=gen)

    gen = torch.Generator().manual_seed(0)
    streams = group_seeds(gen, 5)
    assert torch.equal(torch.rand(4, generator=gen), gen_after_whole)
    bounds = shard_bounds(5, 2)
    parts = [play(tiny_policy, EnvPool(lambda: make_env(env)), request.shard(lo, hi), generators_from(streams[lo:hi])) for lo, hi in bounds]
    merged = merge(parts, [lo for lo, _ in bounds])
    assert merged.stats == whole.stats
    if game:
        assert merged.turns == whole.turns
        assert [e.group for e in merged.episodes] == [i // 3 for i in range(15)]
        assert_same_episodes(merged.episodes, whole.episodes)
    else:
        assert [t.group for t in merged.trajectories] == [i // 3 for i in range(15)]
        assert_same_trajectories(merged.trajectories, whole.trajectories)
    # a shard redone (a replacement worker) draws the same numbers as its first try
    again = play(tiny_policy, EnvPool(lambda: make_env(env)), request.shard(*bounds[1]), generators_from(streams[2:5]))
    if game:
        assert_same_episodes(again.episodes, parts[1].episodes)
    else:
        assert_same_trajectories(again.trajectories, parts[1].trajectories)


def test_step_streams_are_the_rollout_functions_unchanged(tiny_policy):
    """The default backend (streams 'step') is exactly the rollout functions on the step
    generator: runs from before the backends existed reproduce bit for bit."""
    envs = EnvPool(lambda: make_env("toy-digits"))
    local = LocalRollouts(tiny_policy, envs, "step")
    a = local.rollout([1, 2, 3], 2, PARAMS, torch.Generator().manual_seed(4), None)
    b = rollout(tiny_policy, envs, [1, 2, 3], 2, PARAMS, torch.Generator().manual_seed(4), None)
    assert a.trajectories == b.trajectories
    games = EnvPool(lambda: make_env("toy-corridor"))
    agent = AgentConfig()
    c = LocalRollouts(tiny_policy, games, "step").episodes([1, 2], 2, PARAMS, torch.Generator().manual_seed(4), None, agent)
    d = rollout_episodes(tiny_policy, games, [1, 2], 2, PARAMS, torch.Generator().manual_seed(4), None, agent)
    assert c.episodes == d.episodes
    # group streams draw other numbers (one stream per group, seeded from the step generator)
    e = LocalRollouts(tiny_policy, envs, "group").rollout([1, 2, 3], 2, PARAMS, torch.Generator().manual_seed(4), None)
    assert [t.token_ids for t in e.trajectories] != [t.token_ids for t in a.trajectories]


def test_hints_are_sharded_with_their_seeds(tiny_policy):
    request = RolloutRequest([1, 2, 3, 4], 2, PARAMS, None, None, ["h1", None, "h3", "h4"])
    assert request.shard(1, 3).seeds == [2, 3] and request.shard(1, 3).hints == [None, "h3"]
    gen = torch.Generator().manual_seed(2)
    streams = group_seeds(gen, 4)
    pool = EnvPool(lambda: make_env("toy-digits"))
    whole = play(tiny_policy, pool, request, generators_from(streams))
    parts = [play(tiny_policy, pool, request.shard(lo, hi), generators_from(streams[lo:hi])) for lo, hi in shard_bounds(4, 3)]
    assert_same_trajectories(merge(parts, [0, 1, 2]).trajectories, whole.trajectories)


def test_streams_setting_resolves_and_validates():
    assert rollout_streams(load_config(SMOKE)) == "step"
    assert rollout_streams(load_config(SMOKE, ["distributed.backend=ray"])) == "group"
    assert rollout_streams(load_config(SMOKE, ["sampling.streams=group"])) == "group"
    cfg = load_config(SMOKE, ["distributed.backend=ray", "distributed.workers=3", "distributed.address=auto"])
    assert (cfg.distributed.workers, cfg.distributed.address) == (3, "auto")
    assert load_config(SMOKE, ["distributed.address=ray://head.example:10001"]).distributed.address == "ray://head.example:10001"
    assert load_config(None, ["distributed.backend=ray"], recipe="rft").distributed.backend == "ray"
    assert load_config(None, ["distributed.backend=ray"], recipe="rsipo").distributed.backend == "ray"


@pytest.mark.parametrize(
    "sets, message",
    [
        (["distributed.backend=spark"], "distributed.backend"),
        (["distributed.workers=0"], "distributed.workers"),
        (["distributed.address=http://head:8265"], "distributed.address"),
        (["distributed.worker_cpus=0"], "distributed.worker_cpus"),
        (["distributed.backend=ray", "sampling.streams=step"], "set sampling.streams = 'group'"),
    ],
)
def test_bad_distributed_settings_exit_2_with_one_line(tmp_path, capsys, sets, message):
    argv = ["train", SMOKE, "--out", str(tmp_path / "r")]
    for s in sets:
        argv += ["--set", s]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and message in err
    assert "\n" not in err and "Traceback" not in err


def test_ray_missing_is_a_one_line_error(tiny_policy, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    cfg = load_config(SMOKE, ["distributed.backend=ray"])
    with pytest.raises(UserError, match=r"needs Ray: pip install 'recursa\[ray\]'"):
        make_rollouts(cfg, tiny_policy, EnvPool(lambda: make_env("toy-digits")))
    assert isinstance(make_rollouts(load_config(SMOKE), tiny_policy, EnvPool(lambda: make_env("toy-digits"))), LocalRollouts)


def test_env_factory_builds_registered_and_builtin_envs():
    digits = env_factory("toy-digits")()
    assert digits.name == "toy-digits"
    corridor = env_factory("toy-corridor", length=5)()
    assert corridor.length == 5
    assert env_factory("arithmetic", difficulty=1)().reset(3) == make_env("arithmetic", difficulty=1).reset(3)


def test_group_streams_run_resumes_like_an_uninterrupted_one(tmp_path):
    sets = ["--set", "train.steps=3", "--set", "run.checkpoint_every=1", "--set", "eval.n=4", "--set", "sampling.streams=group"]
    full, part = tmp_path / "full", tmp_path / "part"
    assert main(["train", SMOKE, "--out", str(full), *sets]) == 0
    assert main(["train", SMOKE, "--out", str(part), *sets, "--set", "train.steps=1", "--set", "eval.after=false"]) == 0
    assert main(["train", "--resume", str(part), "--set", "train.steps=3", "--set", "eval.after=true"]) == 0

    def rows(run):
        return [{k: v for k, v in json.loads(line).items() if not k.startswith(("time/", "throughput/"))} for line in (run / "metrics.jsonl").read_text().splitlines()]

    assert rows(part) == rows(full)
