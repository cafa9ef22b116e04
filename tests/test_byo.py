"""Bring your own environment, reward and data: a package outside recursa (tests/byo_pkg)
registers an env through the `recursa.envs` entry point, ships reward functions and a
JSONL dataset, and the recipes train on them on the tiny model."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from recursa.cli import main
from recursa.config import load_config
from recursa.envs import make_env, split_seed
from recursa.envs.base import entry_point_envs, env_factory, split_of
from recursa.envs.dataset import DatasetEnv, hash_unit, split_by_hash, task_factory
from recursa.errors import UserError
from recursa.rewards import RewardSet, call_reward

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "tests" / "byo_pkg"
DATA = PKG / "byo_tasks" / "data" / "qa.jsonl"


def install_dist_info(site: Path) -> Path:
    """What `pip install` leaves for importlib.metadata: a dist-info directory with the
    package's entry points (read from its pyproject.toml)."""
    meta = tomllib.loads((PKG / "pyproject.toml").read_text())["project"]
    info = site / f"byo_tasks-{meta['version']}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {meta['name']}\nVersion: {meta['version']}\n")
    lines = [line for group, eps in meta["entry-points"].items() for line in [f"[{group}]", *(f"{k} = {v}" for k, v in eps.items())]]
    (info / "entry_points.txt").write_text("\n".join(lines) + "\n")
    return site


@pytest.fixture
def byo(tmp_path_factory, monkeypatch):
    """The byo-tasks package importable with its entry point, here and in subprocesses."""
    site = install_dist_info(tmp_path_factory.mktemp("site"))
    monkeypatch.syspath_prepend(str(PKG))
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(site), str(PKG), str(ROOT), os.environ.get("PYTHONPATH", "")]))
    return site


def _metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


TINY = """
[model]
name = "tiny-random"

[sampling]
max_new_tokens = 6

[train]
steps = 2
prompts_per_step = 2
group_size = 4
micro_batch_size = 8
lr = 1e-3

[eval]
n = 4
batch_size = 4

[run]
log_samples = 8
"""


# ------------------------------------------------------------------------------ environments


def test_entry_point_env_is_listed_built_and_rebuilt_in_another_process(byo, capsys):
    assert entry_point_envs()["byo-qa"] == "byo_tasks.envs:make_qa_env"
    assert main(["envs"]) == 0
    out = capsys.readouterr().out
    assert "byo-qa" in out and "byo_tasks.envs:make_qa_env" in out
    env = make_env("byo-qa")
    prompt = env.reset(split_seed("train", 0))
    assert prompt.startswith("What is") and env.step(env.answer).reward == 1.0
    # what a Ray worker or env pool receives: a picklable factory that re-imports by name
    for spec in ("byo-qa", "byo_tasks.envs:make_qa_env"):
        again = pickle.loads(pickle.dumps(env_factory(spec)))()
        assert again.reset(split_seed("train", 0)) == prompt
    # a fresh interpreter finds the entry point from the installed metadata alone
    code = "from recursa.envs import make_env, split_seed; e = make_env('byo-qa'); print(e.reset(split_seed('train', 0)))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=os.environ.copy())
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == prompt


@pytest.mark.parametrize(
    "spec, message",
    [
        ("byo_tasks.nosuch:make_env", "cannot import module 'byo_tasks.nosuch'"),
        ("byo_tasks.envs:make_nothing", "has no attribute 'make_nothing'"),
        ("byo_tasks.envs:NotAnEnv", "lacks step()"),
        ("byo_tasks.envs:DATA", "not a function or class"),
    ],
)
def test_a_bad_env_factory_is_one_line_at_config_load(byo, tmp_path, capsys, spec, message):
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_config(None, [f"env.name={spec!r}"])
    assert main(["train", "--set", "model.name='tiny-random'", "--set", f"env.name={spec!r}", "--out", str(tmp_path / "r"), str(_write(tmp_path / "c.toml", TINY))]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and message in err and "\n" not in err
    assert not (tmp_path / "r").exists()  # refused before the run directory was touched


def test_factory_kwargs_mismatch_is_named(byo):
    with pytest.raises(UserError, match=r"does not accept env.kwargs \['colour'\]"):
        load_config(None, ["env.name='byo-qa'", "env.kwargs={colour = 1}"])


# ------------------------------------------------------------------------------ rewards


def test_weighted_sum_of_rewards_by_hand(byo):
    entries = load_config(None, [
        "reward=[{func = 'byo_tasks.rewards:brevity', weight = 0.5}, {func = 'byo_tasks.rewards:digits_only', weight = 2.0, name = 'digits'}, "
        "{func = 'env', weight = 3.0}]",
    ]).reward
    rs = RewardSet.from_config(entries)
    assert [t.name for t in rs.terms] == ["brevity", "digits", "env"]
    completions = ["12", "twelve and more words here", "7"]
    scored = rs.score(["p"] * 3, completions, [1.0, 0.0, 0.0], {"answer": ["12", "12", "n/a"]})
    # brevity: 1 - len/40 -> 0.95, 0.35, 0.975; digits_only: 1, 0, None (answer not numeric)
    assert scored.totals == pytest.approx([0.5 * 0.95 + 2 * 1 + 3 * 1, 0.5 * 0.35 + 0 + 0, 0.5 * 0.975 + 0 + 0])
    assert scored.metrics["reward/brevity/mean"] == pytest.approx((0.95 + 0.35 + 0.975) / 3)
    assert scored.metrics["reward/digits/mean"] == pytest.approx(0.5)  # over the 2 items it applied to
    assert scored.metrics["reward/digits/applied"] == pytest.approx(2 / 3)
    assert scored.metrics["reward/env/mean"] == pytest.approx(1 / 3)
    # without an `env` entry the env's reward is there with weight 1
    rs = RewardSet.from_config(load_config(None, ["reward=[{func = 'byo_tasks.rewards:brevity'}]"]).reward)
    assert [(t.name, t.weight) for t in rs.terms] == [("env", 1.0), ("brevity", 1.0)]
    assert rs.score(["p"], ["ab"], [1.0], {}).totals == pytest.approx([1.0 + 0.95])
    assert RewardSet.from_config([]) is None


@pytest.mark.parametrize(
    "func, message",
    [
        ("broken", "reward function 'broken' raised RuntimeError: this reward is broken"),
        ("one_short", "reward function 'one_short' returned 1 values for 2 completions"),
        ("says_yes", "reward function 'says_yes' returned 'yes'"),
    ],
)
def test_a_bad_reward_function_is_a_one_line_error_naming_it(byo, func, message):
    from byo_tasks import rewards

    with pytest.raises(UserError, match=message) as info:
        call_reward(getattr(rewards, func), func, ["p", "q"], ["a", "b"], {})
    assert "\n" not in str(info.value)


def test_bad_reward_entries_fail_at_config_load(byo):
    with pytest.raises(UserError, match="has no attribute 'nope'"):
        load_config(None, ["reward=[{func = 'byo_tasks.rewards:nope'}]"])
    with pytest.raises(UserError, match="reward.0.func"):
        load_config(None, ["reward=[{func = 'not a path'}]"])
    with pytest.raises(UserError, match="named 'brevity'"):
        load_config(None, ["reward=[{func = 'byo_tasks.rewards:brevity'}, {func = 'byo_tasks.rewards:digits_only', name = 'brevity'}]"])


def test_grpo_run_with_a_broken_reward_stops_with_one_line(byo, tmp_path, capsys):
    cfg = _write(tmp_path / "c.toml", TINY + '\n[[reward]]\nfunc = "byo_tasks.rewards:broken"\n')
    assert main(["train", str(cfg), "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err.strip()
    assert "reward function 'broken' raised RuntimeError" in err and "\n" not in err


# ------------------------------------------------------------------------------ datasets


def test_dataset_rows_split_by_prompt_hash_and_item_i_is_row_i(tmp_path):
    rows = [{"q": f"question {i % 50}", "a": str(i)} for i in range(120)]  # prompts 0..19 appear 3 times, 20..49 twice
    path = _write(tmp_path / "d.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
    env = DatasetEnv(str(path), prompt_key="q", answer_key="a", scorer="exact", gate_frac=0.2, test_frac=0.2)
    by_split = {s: [r for r in rows if split_by_hash(r["q"], 0.2, 0.2) == s] for s in ("train", "gate", "test")}
    assert {s: env.num_items(s) for s in by_split} == {s: len(v) for s, v in by_split.items()}
    assert all(n > 0 for n in map(len, by_split.values()))
    for s, expected in by_split.items():  # item i of a split is its i-th row in file order
        assert [env.row(split_seed(s, i)) for i in range(len(expected))] == expected
    # duplicated prompts share a split, so no held-out prompt is ever a training prompt
    train_prompts = {r["q"] for r in by_split["train"]}
    assert not train_prompts & {r["q"] for s in ("gate", "test") for r in by_split[s]}
    # a train seed, however large, only reaches train rows (indices wrap)
    reached = {env.reset(split_seed("train", i)) for i in list(range(300)) + [9_999_999, 123_456_789]}
    assert reached == train_prompts
    assert hash_unit("question 0") == hash_unit("question 0") and 0 <= hash_unit("x") < 1


def test_split_column_and_scorers(tmp_path):
    rows = [{"p": "a", "y": "7", "split": "train"}, {"p": "b", "y": "1,000", "split": "validation"}, {"p": "c", "y": "x y", "split": "test"}]
    path = _write(tmp_path / "d.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
    env = DatasetEnv(str(path), prompt_key="p", answer_key="y", scorer="last_number", split_key="split")
    assert [env.num_items(s) for s in ("train", "gate", "test")] == [1, 1, 1]
    assert env.reset(split_seed("gate", 0)) == "b" and env.step("it is 1000.").info["success"]
    env.reset(split_seed("train", 5))
    r = env.step("maybe 6 or 7")
    assert r.reward == 1.0 and r.info["fields"] == {"y": "7", "split": "train"}
    exact = DatasetEnv(str(path), prompt_key="p", answer_key="y", scorer="exact", split_key="split")
    exact.reset(split_seed("test", 0))
    assert exact.step("<answer> x   y </answer>").info["success"]
    exact.reset(split_seed("test", 0))
    assert not exact.step("x").info["success"]
    bad = _write(tmp_path / "bad.jsonl", json.dumps({"p": "a", "y": "1", "split": "holdout"}) + "\n")
    with pytest.raises(UserError, match="'holdout', not one of"):
        DatasetEnv(str(bad), prompt_key="p", answer_key="y", split_key="split")
    with pytest.raises(UserError, match="has no column 'question'"):
        DatasetEnv(str(path), prompt_key="question")


def test_a_reward_function_as_the_dataset_scorer(byo, tmp_path):
    env = DatasetEnv(str(DATA), prompt_key="question", scorer="byo_tasks.rewards:brevity", success_at=0.9)
    env.reset(split_seed("train", 0))
    r = env.step("abcd")  # 1 - 4/40
    assert r.reward == pytest.approx(0.9) and r.info["success"]


def _train_prompts() -> tuple[set[str], set[str]]:
    env = DatasetEnv(str(DATA), prompt_key="question")
    train = {r["question"] for r in env.splits["train"]}
    held = {r["question"] for s in ("gate", "test") for r in env.splits[s]}
    return train, held


DATA_TOML = TINY + f"""
[data]
source = "jsonl"
path = "{DATA}"
prompt_key = "question"
answer_key = "answer"
scorer = "last_number"
"""


def test_grpo_on_a_jsonl_dataset_never_trains_on_held_out_rows(tmp_path):
    run = tmp_path / "r"
    cfg = _write(tmp_path / "c.toml", DATA_TOML + "\n[gate]\nmode = 'log'\nevery = 1\nn = 4\n")
    assert main(["train", str(cfg), "--out", str(run), "--set", "train.steps=3"]) == 0
    train, held = _train_prompts()
    assert train and held and not train & held
    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 3 * 8  # every trajectory of every step
    assert all(s["prompt"] in train and split_of(s["seed"]) == "train" for s in samples)
    env = task_factory(load_config(cfg))()
    after = json.loads((run / "eval" / "after.json").read_text())
    assert after["n"] == 4 and all(split_of(i["seed"]) == "test" for i in after["items"])
    assert all(env.reset(i["seed"]) in held for i in after["items"])
    # eval.n larger than the test rows: each test row once, never a repeat
    n_test = env.num_items("test")
    assert main(["eval", "--config", str(cfg), "--n", "500", "--json", str(tmp_path / "e.json")]) == 0
    assert json.loads((tmp_path / "e.json").read_text())["n"] == n_test


def test_rsipo_and_sft_on_the_dataset(tmp_path):
    rsipo = _write(tmp_path / "rsipo.toml", 'recipe = "rsipo"\n' + DATA_TOML + "\n[skills]\ncandidates = 2\nreplay_size = 2\n")
    assert main(["train", str(rsipo), "--out", str(tmp_path / "rsipo"), "--set", "train.steps=1"]) == 0
    train, _ = _train_prompts()
    samples = [json.loads(line) for line in (tmp_path / "rsipo" / "samples.jsonl").read_text().splitlines()]
    assert samples and all(s["prompt"] in train for s in samples)

    sft = _write(tmp_path / "sft.toml", f"""recipe = "sft"
[model]
name = "tiny-random"
[data]
source = "jsonl"
path = "{DATA}"
prompt_key = "question"
[train]
epochs = 1
batch_size = 16
[eval]
n = 4
batch_size = 4
""")
    assert main(["train", str(sft), "--out", str(tmp_path / "sft")]) == 0
    demos = json.loads((tmp_path / "sft" / "demos.json").read_text())
    env = DatasetEnv(str(DATA), prompt_key="question")
    assert demos["rows"] == demos["items"] == env.num_items("train")  # every train row, each its answer
    assert all(split_of(s) == "train" for s in demos["seeds"])


def test_parquet_and_hf_sources_read_the_same_rows(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet", reason="parquet needs pyarrow (pip install 'recursa[data]')")
    import pyarrow as pa

    rows = [json.loads(line) for line in DATA.read_text().splitlines()]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "qa.parquet")
    jsonl = DatasetEnv(str(DATA), prompt_key="question")
    parquet = DatasetEnv(str(tmp_path / "qa.parquet"), source="parquet", prompt_key="question")
    assert parquet.splits == jsonl.splits
    datasets = pytest.importorskip("datasets", reason="data.source = 'hf' needs datasets (pip install 'recursa[data]')")
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "hf"))
    hf = DatasetEnv(str(tmp_path / "hf"), source="hf", prompt_key="question")
    assert hf.splits == jsonl.splits
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_list(rows[:60]), "test": datasets.Dataset.from_list(rows[60:])})
    dd.save_to_disk(str(tmp_path / "hfdict"))
    split = DatasetEnv(str(tmp_path / "hfdict"), source="hf", prompt_key="question")
    assert (split.num_items("train"), split.num_items("gate"), split.num_items("test")) == (60, 0, 20)


def test_data_and_env_name_together_are_refused():
    with pytest.raises(UserError, match="both name the task"):
        load_config(None, ["env.name='arithmetic'", "data.source='jsonl'", f"data.path='{DATA}'"])


# ------------------------------------------------------------------------------ all three


def test_grpo_uses_the_packages_env_reward_and_dataset(byo, tmp_path):
    """The package's env (through its entry point) over the package's JSONL dataset, with the
    package's reward function: the weighted sum is what GRPO trains on."""
    cfg = _write(tmp_path / "c.toml", TINY + f"""
[env]
name = "byo-qa"
kwargs = {{ path = "{DATA}" }}

[[reward]]
func = "byo_tasks.rewards:brevity"
weight = 0.5
""")
    run = tmp_path / "r"
    proc = subprocess.run([sys.executable, "-m", "recursa.cli", "train", str(cfg), "--out", str(run)], capture_output=True, text=True,
                          env=os.environ.copy(), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [r for r in _metrics(run) if "reward/mean" in r]
    assert len(rows) == 2
    for r in rows:  # every term applies to every item, so the means add up like the rewards
        assert r["reward/mean"] == pytest.approx(r["reward/env/mean"] + 0.5 * r["reward/brevity/mean"], abs=1e-6)
        assert 0 < r["reward/brevity/mean"] <= 1
    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    train, _ = _train_prompts()
    assert all(s["prompt"].removesuffix(" Reply with the number only.") in train for s in samples)
    env = make_env("byo-qa", path=str(DATA))
    for s in samples:  # each trajectory's reward is its env reward + 0.5 x brevity, by hand
        env.reset(s["seed"])
        assert s["reward"] == pytest.approx(env.step(s["completion"]).reward + 0.5 * max(0.0, 1 - len(s["completion"]) / 40), abs=1e-6)
    after = json.loads((run / "eval" / "after.json").read_text())
    assert after["env"] == "byo-qa" and after["n"] == 4


def test_a_gate_larger_than_the_gate_rows_is_refused(tmp_path, capsys):
    cfg = _write(tmp_path / "c.toml", DATA_TOML + "\n[gate]\nmode = 'gate'\nn = 500\n")
    assert main(["train", str(cfg), "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err.strip()
    assert "gate.n = 500, but the task has" in err and "\n" not in err
