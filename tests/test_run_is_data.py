"""A run directory is data, not code (issue 49; docs/reliability.md, "A run directory is data").

* Every run reloads its own config: the config.toml a run writes loads back, for every example
  config and every [data] source, and a dataset-task run resumes after a kill at every write
  point exactly as the uninterrupted run.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from recursa.cli import main
from recursa.config import RECIPES, dump_config, load_config
from test_faults import _assert_resumes_to, _metrics, _runner  # the fault-injection runner and the metrics without wall times

ROOT = Path(__file__).resolve().parents[1]
SMOKE = str(ROOT / "examples" / "smoke.toml")
EXAMPLES = sorted(p.relative_to(ROOT / "examples").as_posix() for p in (ROOT / "examples").rglob("*.toml"))


def _rows_file(tmp_path: Path, n: int = 40) -> Path:
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"Row {i}: add {i} and {i % 7}.", "answer": str(i + i % 7)}) + "\n" for i in range(n)))
    return path


# ----------------------------------------------------------------------------- every run reloads its own config


def _roundtrip(cfg, tmp_path: Path):
    stored = tmp_path / "config.toml"
    stored.write_text(dump_config(cfg))
    again = load_config(stored, check=False)
    assert again == cfg
    assert dump_config(again) == dump_config(cfg)  # and it is written the same way again


def test_examples_are_all_covered():
    assert len(EXAMPLES) >= 20 and "smoke.toml" in EXAMPLES


@pytest.mark.parametrize("name", EXAMPLES)
def test_stored_config_of_every_example_reloads(tmp_path, name):
    _roundtrip(load_config(ROOT / "examples" / name, check=False), tmp_path)


@pytest.mark.parametrize("recipe", sorted(RECIPES))
@pytest.mark.parametrize("source", ["jsonl", "parquet", "hf"])
def test_stored_config_of_every_data_source_reloads(tmp_path, recipe, source):
    """A run whose tasks are [data] rows once wrote env.name beside data.source, which its own
    loader refused ('both name the task'): such a run could not be resumed, evaluated or exported."""
    sets = [f"data.source='{source}'", f"data.path='{tmp_path / 'rows.jsonl'}'", "data.prompt_key='prompt'"]
    cfg = load_config(None, sets, recipe=recipe, check=False)
    assert "name" not in tomllib_loads(dump_config(cfg)).get("env", {})
    _roundtrip(cfg, tmp_path)


def test_sft_transcripts_keep_env_name(tmp_path):
    """SFT's data.source = 'jsonl' without prompt_key reads chat transcripts of env.name's task: env.name stays."""
    cfg = load_config(None, ["data.source='jsonl'", f"data.path='{tmp_path / 't.jsonl'}'", "env.name='household'"], recipe="sft", check=False)
    assert tomllib_loads(dump_config(cfg))["env"]["name"] == "household"
    _roundtrip(cfg, tmp_path)


def tomllib_loads(text: str) -> dict:
    import tomllib

    return tomllib.loads(text)


# kills of a dataset-task run: (RECURSA_FAULT_AT spec), one per write point of recursa.runio.FAULT_POINTS
DATA_KILLS = ["config.written", "metrics.torn@2", "metrics.appended@3", "eval.tmp@1", "eval.recorded@2", "eval.renamed@2",
              "checkpoint.tmp@2", "checkpoint.renamed@1", "checkpoint.recorded@2"]


@pytest.fixture(scope="module")
def killed_data_runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("datakills")
    rows = _rows_file(base)
    sets = ["--set", "data.source='jsonl'", "--set", f"data.path='{rows}'", "--set", "train.steps=2", "--set", "eval.n=4",
            "--set", "eval.batch_size=4", "--set", "train.group_size=2", "--set", "run.checkpoint_every=1", "--set", "sampling.max_new_tokens=4"]
    config = base / "data.toml"  # smoke.toml without its [env] table: the rows name the task
    config.write_text((ROOT / "examples" / "smoke.toml").read_text().replace('[env]\nname = "arithmetic"\nkwargs = { difficulty = 0 }\n', ""))
    assert "arithmetic" not in config.read_text()
    ref = base / "ref"
    assert main(["train", str(config), "--out", str(ref), *sets]) == 0
    jobs = [{"argv": ["train", str(config), "--out", str(base / f"k{i}"), *sets], "fault": spec} for i, spec in enumerate(DATA_KILLS)]
    chain = base / "chain"
    jobs += [{"argv": ["train", str(config), "--out", str(chain), *sets], "fault": "checkpoint.tmp@2"},
             {"argv": ["train", "--resume", str(chain), "--trust-run-code"], "fault": "truncate.jsonl@1"}]  # the rows lie outside the run
    prompts = [json.loads(line)["prompt"] for line in (ref / "samples.jsonl").read_text().splitlines()]
    assert prompts and all(p.startswith("Row ") for p in prompts)  # the rows are the task
    return base, ref, _runner(jobs)


def test_data_kills_cover_every_write_point():
    from recursa.runio import FAULT_POINTS

    assert {k.split("@")[0] for k in DATA_KILLS} | {"truncate.jsonl"} >= set(FAULT_POINTS)


@pytest.mark.parametrize("i", range(len(DATA_KILLS) + 1), ids=DATA_KILLS + ["truncate.jsonl (during a resume)"])
def test_dataset_run_resumes_after_a_kill_at_every_write_point(killed_data_runs, i):
    base, ref, outcomes = killed_data_runs
    if i < len(DATA_KILLS):
        run = base / f"k{i}"
        assert outcomes[i]["killed"], (DATA_KILLS[i], outcomes[i])
    else:
        run = base / "chain"
        assert outcomes[-2]["killed"] and outcomes[-1]["killed"], outcomes[-2:]
    rows = str(base / "rows.jsonl")  # outside the run: reading it again is the user's consent (--trust-run-code, or data.path typed again)
    _assert_resumes_to(run, ref, ["--trust-run-code"])
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_000001", "step_000002"]
    assert main(["eval", "--run", str(run), "--n", "2", "--set", f"data.path='{rows}'"]) == 0  # and the finished run evaluates from its stored config


# ----------------------------------------------------------------------------- the trust boundary


def _hostile_run(tmp_path: Path, sets: list[str], name: str = "hostile") -> tuple[Path, Path]:
    """A run directory whose stored config names code (os.system, which would create `marker`)."""
    run = tmp_path / name
    run.mkdir()
    marker = tmp_path / f"{name}.ran"
    cfg = load_config(None, [s.replace("MARKER", str(marker)) for s in sets], check=False)
    (run / "config.toml").write_text(dump_config(cfg))
    return run, marker


HOSTILE_ENV = ["env.name='os:system'", "env.kwargs={command='touch MARKER'}"]


def _refused(capsys, argv: list[str], spec: str) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert spec in err and "--trust-run-code" in err and "refusing to import" in err, err
    return err


@pytest.mark.parametrize("argv", [["eval", "--run", "RUN"], ["eval", "--run", "RUN", "--interpolate", "0.5"], ["eval", "--run", "RUN", "--policy", "random"],
                                  ["train", "--resume", "RUN"]])
def test_a_run_naming_an_env_factory_is_refused(tmp_path, capsys, argv):
    run, marker = _hostile_run(tmp_path, HOSTILE_ENV)
    _refused(capsys, [a.replace("RUN", str(run)) for a in argv], "env.name = 'os:system'")
    assert not marker.exists()


def test_a_run_naming_a_reward_function_is_refused(tmp_path, capsys):
    run, marker = _hostile_run(tmp_path, ["reward=[{func='os:system'}]"])
    _refused(capsys, ["train", "--resume", str(run)], "reward.func = 'os:system'")


def test_a_run_naming_a_data_scorer_is_refused(tmp_path, capsys):
    rows = _rows_file(tmp_path)
    run, _ = _hostile_run(tmp_path, ["data.source='jsonl'", f"data.path='{rows}'", "data.prompt_key='prompt'", "data.scorer='os:system'"])
    _refused(capsys, ["eval", "--run", str(run)], "data.scorer = 'os:system'")
    _refused(capsys, ["train", "--resume", str(run)], "data.scorer = 'os:system'")


# ----------------------------------------------------------------------------- ... and no file of the reader's machine read for it


def _data_run(tmp_path: Path, path: str, recipe: str = "grpo", name: str = "datarun") -> Path:
    """A run directory whose stored config reads its task rows (or SFT's demonstrations) from `path`."""
    run = tmp_path / name
    run.mkdir()
    cfg = load_config(None, ["data.source='jsonl'", f"data.path='{path}'", "data.prompt_key='prompt'"], recipe=recipe, check=False)
    (run / "config.toml").write_text(dump_config(cfg))
    return run


def _secret(tmp_path: Path) -> Path:
    """A file of the reader's that is no dataset: reading it would fail with 'not JSON', so the
    trust refusal shows it was never opened."""
    secret = tmp_path / "id_key"
    secret.write_text("-----BEGIN PRIVATE KEY-----\n")
    return secret


@pytest.mark.parametrize("argv", [["eval", "--run", "RUN"], ["eval", "--run", "RUN", "--interpolate", "0.5"], ["train", "--resume", "RUN"]])
def test_a_run_naming_a_data_file_outside_it_is_refused(tmp_path, capsys, argv):
    secret = _secret(tmp_path)
    run = _data_run(tmp_path, str(secret))
    assert main([a.replace("RUN", str(run)) for a in argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"data.path = '{secret}'" in err and "refusing to read it" in err and "--trust-run-code" in err, err


def test_a_relative_data_path_leading_out_of_the_run_is_refused(tmp_path, capsys, monkeypatch):
    _secret(tmp_path)
    monkeypatch.chdir(tmp_path)
    run = _data_run(tmp_path, "datarun/../id_key")
    assert main(["train", "--resume", str(run)]) == 2
    assert "data.path = 'datarun/../id_key'" in capsys.readouterr().err


def test_an_sft_runs_demonstrations_outside_it_are_refused_on_resume(tmp_path, capsys):
    secret = _secret(tmp_path)
    run = _data_run(tmp_path, str(secret), recipe="sft")
    assert main(["train", "--resume", str(run)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "refusing to read it" in err, err


def test_consent_to_read_a_data_file_outside_the_run(tmp_path, capsys):
    """--trust-run-code, or the same data.path given again, reads it (here the reader then finds it is not JSON)."""
    secret = _secret(tmp_path)
    run = _data_run(tmp_path, str(secret))
    for extra in (["--trust-run-code"], ["--set", f"data.path='{secret}'"]):
        assert main(["train", "--resume", str(run), *extra]) == 2
        assert f"{secret}:1: not JSON" in capsys.readouterr().err
    assert main(["eval", "--run", str(run), "--env", "arithmetic"]) == 2  # --env replaces the run's task: its rows are not read
    assert "no checkpoint yet" in capsys.readouterr().err


def test_a_run_carrying_its_rows_inside_it_needs_no_consent(tmp_path, capsys):
    import shutil

    ref = tmp_path / "ref"
    assert main(["train", str(_noenv_config(tmp_path)), "--out", str(ref), "--set", "data.source='jsonl'", "--set", f"data.path='{_rows_file(tmp_path)}'",
                 "--set", "data.prompt_key='prompt'", "--set", "train.steps=1", "--set", "eval.n=2", "--set", "sampling.max_new_tokens=4"]) == 0
    run = tmp_path / "carried"
    shutil.copytree(ref, run)
    shutil.copy(tmp_path / "rows.jsonl", run / "rows.jsonl")
    (run / "config.toml").write_text((run / "config.toml").read_text().replace(str(tmp_path / "rows.jsonl"), str(run / "rows.jsonl")))
    assert str(run / "rows.jsonl") in (run / "config.toml").read_text()
    assert main(["eval", "--run", str(run), "--n", "2"]) == 0
    assert main(["eval", "--run", str(ref), "--n", "2"]) == 2  # the same run reading its rows from outside it
    assert "refusing to read it" in capsys.readouterr().err


def test_trust_run_code_imports_it(tmp_path, capsys):
    """The flag lets the stored config's code run (here: os.system creates the marker, then
    the env check fails, since os.system builds no env)."""
    run, marker = _hostile_run(tmp_path, HOSTILE_ENV)
    assert main(["train", "--resume", str(run), "--trust-run-code"]) == 2
    assert marker.exists()


def test_the_same_spec_given_again_on_the_command_line_is_the_users(tmp_path, capsys):
    run, marker = _hostile_run(tmp_path, HOSTILE_ENV)
    assert main(["train", "--resume", str(run), "--set", "env.name='os:system'"]) == 2
    assert marker.exists()


def test_a_config_the_user_passes_may_name_code(tmp_path, capsys):
    run, marker = _hostile_run(tmp_path, HOSTILE_ENV)
    assert main(["train", "--resume", str(run), str(run / "config.toml")]) == 2  # the user's own config file: imported as always
    assert marker.exists()


def test_built_in_names_and_a_replaced_task_are_not_refused(tmp_path, capsys):
    run, _ = _hostile_run(tmp_path, ["env.name='arithmetic'"], "builtin")
    assert main(["eval", "--run", str(run)]) == 2
    assert "no checkpoint yet" in capsys.readouterr().err  # past the trust boundary
    run, marker = _hostile_run(tmp_path, HOSTILE_ENV)
    assert main(["eval", "--run", str(run), "--env", "arithmetic"]) == 2  # --env replaces the run's task: nothing of it is built
    assert "no checkpoint yet" in capsys.readouterr().err and not marker.exists()


@pytest.mark.parametrize("argv", [["eval", "--config", SMOKE, "--skills", "RUN"], ["export", "RUN", "--out", "OUT"], ["report", "RUN"], ["lineage", "RUN"]])
def test_commands_that_read_a_run_import_nothing_it_names(tmp_path, capsys, argv):
    run, marker = _hostile_run(tmp_path, HOSTILE_ENV)
    main([a.replace("RUN", str(run)).replace("OUT", str(tmp_path / "out")) for a in argv])
    assert not marker.exists()


# ----------------------------------------------------------------------------- containment: nothing points out of a run


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    run = tmp_path_factory.mktemp("trained") / "run"
    assert main(["train", SMOKE, "--out", str(run), "--set", "train.steps=1", "--set", "eval.n=2", "--set", "run.checkpoint_every=1",
                 "--set", "sampling.max_new_tokens=4", "--set", "train.group_size=2"]) == 0
    return run


def _copy(trained: Path, tmp_path: Path) -> Path:
    import shutil

    run = tmp_path / "run"
    shutil.copytree(trained, run, symlinks=True)
    return run


def _outside(tmp_path: Path) -> Path:
    victim = tmp_path / "outside.txt"
    victim.write_text("the user's file\n")
    return victim


def _contained(capsys, argv: list[str]) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "points outside" in err, err


@pytest.mark.parametrize("name", [".recursa.lock", "metrics.jsonl", "samples.jsonl"])
def test_a_log_or_lock_linked_out_of_the_run_is_refused_by_train(trained, tmp_path, capsys, name):
    run, victim = _copy(trained, tmp_path), _outside(tmp_path)
    (run / name).unlink(missing_ok=True)
    (run / name).symlink_to(victim)
    _contained(capsys, ["train", "--resume", str(run)])
    assert victim.read_text() == "the user's file\n"


def test_report_refuses_metrics_eval_and_plots_linked_out(trained, tmp_path, capsys):
    import shutil

    run, victim = _copy(trained, tmp_path), _outside(tmp_path)
    (run / "metrics.jsonl").rename(tmp_path / "m.jsonl")
    (run / "metrics.jsonl").symlink_to(tmp_path / "m.jsonl")
    _contained(capsys, ["report", str(run)])
    (run / "metrics.jsonl").unlink()
    (tmp_path / "m.jsonl").rename(run / "metrics.jsonl")
    before = run / "eval" / "before.json"
    before.rename(tmp_path / "before.json")
    before.symlink_to(tmp_path / "before.json")
    _contained(capsys, ["report", str(run)])
    before.unlink()
    (tmp_path / "before.json").rename(before)
    assert main(["report", str(run)]) == 0  # whole again: it reports
    (run / "plots" / "reward.png").unlink()
    (run / "plots" / "reward.png").symlink_to(victim)  # a plot file linked out
    _contained(capsys, ["report", str(run)])
    assert victim.read_text() == "the user's file\n"
    shutil.rmtree(run / "plots")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (run / "plots").symlink_to(elsewhere, target_is_directory=True)  # the plots directory linked out
    _contained(capsys, ["report", str(run)])
    _contained(capsys, ["lineage", str(run)])
    _contained(capsys, ["train", "--resume", str(run)])
    assert list(elsewhere.iterdir()) == []


def _shard_index(ckpt: Path, shard: str) -> None:
    (ckpt / "model.safetensors").rename(ckpt / "model-00001-of-00001.safetensors")
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": {"model.embed_tokens.weight": shard}}))


def test_a_shard_index_naming_files_outside_the_checkpoint_is_refused(trained, tmp_path, capsys):
    run = _copy(trained, tmp_path)
    ckpt = run / "checkpoints" / "step_000001"
    _shard_index(ckpt, "../../../outside.safetensors")
    (tmp_path / "outside.safetensors").write_bytes((ckpt / "model-00001-of-00001.safetensors").read_bytes())
    for argv in (["eval", "--run", str(run), "--n", "1"], ["export", str(run), "--out", str(tmp_path / "x")], ["train", "--resume", str(run)]):
        _contained(capsys, argv)
    assert not (tmp_path / "x").exists()


def test_a_sharded_checkpoint_inside_the_run_still_loads(trained, tmp_path):
    run = _copy(trained, tmp_path)
    ckpt = run / "checkpoints" / "step_000001"
    from safetensors.torch import load_file, save_file

    state = load_file(str(ckpt / "model.safetensors"))
    (ckpt / "model.safetensors").unlink()
    names = sorted(state)
    half = len(names) // 2
    save_file({k: state[k] for k in names[:half]}, str(ckpt / "a.safetensors"))
    save_file({k: state[k] for k in names[half:]}, str(ckpt / "b.safetensors"))
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {k: ("a" if i < half else "b") + ".safetensors" for i, k in enumerate(names)}}))
    assert main(["eval", "--run", str(run), "--n", "1"]) == 0


def test_a_checkpoint_linked_out_of_the_run_is_refused(trained, tmp_path, capsys):
    run = _copy(trained, tmp_path)
    ckpt = run / "checkpoints" / "step_000001"
    ckpt.rename(tmp_path / "step_000001")
    ckpt.symlink_to(tmp_path / "step_000001", target_is_directory=True)
    _contained(capsys, ["eval", "--run", str(run), "--n", "1"])
    _contained(capsys, ["export", str(run), "--out", str(tmp_path / "x")])


def _nested_file_linked_out(ckpt: Path, victim: Path) -> None:
    (ckpt / "extra").mkdir()
    (ckpt / "extra" / "notes.txt").symlink_to(victim)


def _nested_dir_linked_out(ckpt: Path, victim: Path) -> None:
    (ckpt / "extra").symlink_to(victim.parent, target_is_directory=True)


def _tokenizer_linked_out(ckpt: Path, victim: Path) -> None:
    victim.write_bytes((ckpt / "tokenizer.json").read_bytes())
    (ckpt / "tokenizer.json").unlink()
    (ckpt / "tokenizer.json").symlink_to(victim)


def _shard_in_a_folder_linked_out(ckpt: Path, victim: Path) -> None:
    """The index names shards/model.safetensors, and shards/ is a link to a folder of the reader's."""
    (victim.parent / "model.safetensors").write_bytes((ckpt / "model.safetensors").read_bytes())
    (ckpt / "model.safetensors").unlink()
    (ckpt / "shards").symlink_to(victim.parent, target_is_directory=True)
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"model.embed_tokens.weight": "shards/model.safetensors"}}))


def _shard_linked_out_from_a_real_folder(ckpt: Path, victim: Path) -> None:
    """shards/ is a real folder of the checkpoint; the shard in it is a link to a file of the reader's."""
    (ckpt / "shards").mkdir()
    victim.write_bytes((ckpt / "model.safetensors").read_bytes())
    (ckpt / "model.safetensors").unlink()
    (ckpt / "shards" / "model.safetensors").symlink_to(victim)
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"model.embed_tokens.weight": "shards/model.safetensors"}}))


DEEP_LINKS = {"a file in a nested folder": _nested_file_linked_out, "a nested folder": _nested_dir_linked_out,
              "the tokenizer": _tokenizer_linked_out, "a shard's folder": _shard_in_a_folder_linked_out,
              "a shard in a real folder": _shard_linked_out_from_a_real_folder}


@pytest.mark.parametrize("reader", ["eval", "export", "resume"])
@pytest.mark.parametrize("case", list(DEEP_LINKS))
def test_a_link_deep_inside_a_checkpoint_is_refused_by_every_reader(trained, tmp_path, capsys, case, reader):
    """Before, only a checkpoint's top-level names were checked: a folder inside it (or a shard
    the index names in one) could lead anywhere, and the libraries that load a checkpoint
    directory open what it holds."""
    run = _copy(trained, tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    victim = elsewhere / "the_users_file"
    victim.write_text("the user's file\n")
    DEEP_LINKS[case](run / "checkpoints" / "step_000001", victim)
    before = {p.name: p.read_bytes() for p in elsewhere.iterdir()}
    argv = {"eval": ["eval", "--run", str(run), "--n", "1"], "export": ["export", str(run), "--out", str(tmp_path / "x")],
            "resume": ["train", "--resume", str(run), "--set", "train.steps=2"]}[reader]
    _contained(capsys, argv)
    assert {p.name: p.read_bytes() for p in elsewhere.iterdir()} == before and not (tmp_path / "x").exists()
    assert not (run / "checkpoints" / "step_000002").exists()


def test_links_that_stay_inside_a_checkpoint_still_load(trained, tmp_path):
    """A shard in a nested folder, a folder linked to another inside the run, even a link loop: all inside, all read."""
    from safetensors.torch import load_file, save_file

    run = _copy(trained, tmp_path)
    ckpt = run / "checkpoints" / "step_000001"
    state = load_file(str(ckpt / "model.safetensors"))
    (ckpt / "model.safetensors").unlink()
    (ckpt / "shards").mkdir()
    save_file(state, str(ckpt / "shards" / "all.safetensors"))
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {k: "shards/all.safetensors" for k in state}}))
    (ckpt / "same").symlink_to(ckpt / "shards", target_is_directory=True)
    (ckpt / "shards" / "loop").symlink_to(ckpt, target_is_directory=True)
    assert main(["eval", "--run", str(run), "--n", "1"]) == 0


def test_a_planted_temporary_checkpoint_link_is_never_written_through(trained, tmp_path, capsys):
    """checkpoints/step_K.tmp linked to a folder of the reader's: the next checkpoint write refuses it
    (before: recursa deleted what it led to, or wrote the checkpoint there)."""
    run = _copy(trained, tmp_path)
    elsewhere = _user_dir(tmp_path / "elsewhere")
    (run / "checkpoints" / "step_000002.tmp").symlink_to(elsewhere, target_is_directory=True)
    assert main(["train", "--resume", str(run), "--set", "train.steps=2"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "points outside the checkpoints directory" in err, err
    assert sorted(p.name for p in elsewhere.iterdir()) == ["notes.txt"]


def test_inside_tree_walks_every_depth_and_each_real_folder_once(tmp_path):
    """The one check of a checkpoint's tree (also of gate incumbents and RLoop's phase weights)."""
    from recursa.errors import UserError
    from recursa.runio import inside_tree

    root = tmp_path / "run"
    (root / "a" / "b" / "c").mkdir(parents=True)
    (root / "a" / "b" / "c" / "w.safetensors").write_text("x")
    (root / "a" / "loop").symlink_to(root / "a", target_is_directory=True)
    (root / "a" / "b" / "up").symlink_to(root, target_is_directory=True)
    assert inside_tree(root, root / "a") == root / "a"  # loops and links within: fine, and the walk ends
    (tmp_path / "out").mkdir()
    (root / "a" / "b" / "c" / "d").symlink_to(tmp_path / "out" / "missing")  # a dangling link out counts too
    with pytest.raises(UserError, match="points outside"):
        inside_tree(root, root / "a")


# ----------------------------------------------------------------------------- --overwrite deletes only what recursa wrote


def _user_dir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "notes.txt").write_text("mine\n")
    return path


def _kept(capsys, argv: list[str], *dirs: Path, says: str = "refusing") -> None:
    before = {d: sorted(p.name for p in d.iterdir()) for d in dirs}
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and says in err, err
    assert {d: sorted(p.name for p in d.iterdir()) for d in dirs} == before


def test_export_overwrite_refuses_what_is_not_an_export(trained, tmp_path, capsys, monkeypatch):
    user = _user_dir(tmp_path / "mine")
    _kept(capsys, ["export", str(trained), "--out", str(user), "--overwrite"], user)
    (user / "recursa_export.json").write_text("{}")  # even with the marker: not the working directory ...
    monkeypatch.chdir(user)
    _kept(capsys, ["export", str(trained), "--out", ".", "--overwrite"], user)
    _kept(capsys, ["export", str(trained), "--out", "..", "--overwrite"], user)
    home = _user_dir(tmp_path / "home")
    (home / "recursa_export.json").write_text("{}")
    monkeypatch.setenv("HOME", str(home))  # ... nor the home directory
    monkeypatch.chdir(tmp_path)
    _kept(capsys, ["export", str(trained), "--out", str(home), "--overwrite"], home)
    for target in (trained, trained / "checkpoints", trained / "checkpoints" / "step_000001", trained.parent):
        _kept(capsys, ["export", str(trained), "--out", str(target), "--overwrite"], target, says="run directory")


def test_export_overwrite_replaces_an_earlier_export(trained, tmp_path, capsys):
    out = tmp_path / "model"
    assert main(["export", str(trained), "--out", str(out)]) == 0
    (out / "stale.bin").write_text("x")
    assert main(["export", str(trained), "--out", str(out), "--overwrite"]) == 0
    assert (out / "recursa_export.json").is_file() and not (out / "stale.bin").exists()
    assert not [p for p in tmp_path.iterdir() if ".tmp" in p.name]  # no temporary directory left behind


def test_train_overwrite_refuses_a_project_directory(tmp_path, capsys, monkeypatch):
    project = _user_dir(tmp_path / "project")
    (project / "config.toml").write_text((ROOT / "examples" / "smoke.toml").read_text())  # the user's own config, naming a recipe
    (project / "data.jsonl").write_text('{"step": 1}\n')
    _kept(capsys, ["train", SMOKE, "--out", str(project), "--overwrite"], project)
    monkeypatch.chdir(project)
    _kept(capsys, ["train", SMOKE, "--out", ".", "--overwrite"], project)


def test_train_overwrite_refuses_the_working_directory_even_when_it_is_a_run(trained, tmp_path, capsys, monkeypatch):
    run = _copy(trained, tmp_path)
    monkeypatch.chdir(run)
    _kept(capsys, ["train", SMOKE, "--out", ".", "--overwrite"], run, says="working directory")


def test_examples_overwrite_never_writes_through_a_link_out(tmp_path, capsys):
    dest = tmp_path / "ex"
    assert main(["examples", str(dest)]) == 0
    victim = _outside(tmp_path)
    (dest / "smoke.toml").unlink()
    (dest / "smoke.toml").symlink_to(victim)
    _contained(capsys, ["examples", str(dest), "--overwrite"])
    assert victim.read_text() == "the user's file\n"
    (dest / "smoke.toml").unlink()
    sub = next(p for p in dest.iterdir() if p.is_dir())
    import shutil

    shutil.rmtree(sub)
    (tmp_path / "elsewhere").mkdir()
    sub.symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    _contained(capsys, ["examples", str(dest), "--overwrite"])
    assert list((tmp_path / "elsewhere").iterdir()) == []


# ----------------------------------------------------------------------------- bad inputs: one line, exit 2, nothing written


def _noenv_config(tmp_path: Path) -> Path:
    config = tmp_path / "noenv.toml"
    config.write_text((ROOT / "examples" / "smoke.toml").read_text().replace('[env]\nname = "arithmetic"\nkwargs = { difficulty = 0 }\n', ""))
    return config


def _fifo(tmp_path: Path) -> Path:
    path = tmp_path / "rows.fifo"
    os.mkfifo(path)
    return path


def _exiting_module(tmp_path: Path, monkeypatch) -> str:
    (tmp_path / "exits_on_import.py").write_text("import sys\nsys.exit(3)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return "exits_on_import:make_env"


BAD_INPUTS = {
    "empty --out": (lambda t, m: ["train", SMOKE, "--out", ""], "--out ''"),
    "empty export --out": (lambda t, m: ["export", str(t), "--out", " "], "--out ''"),
    "train.seed beyond 64 bits": (lambda t, m: ["train", SMOKE, "--out", str(t / "run"), "--set", "train.seed=100000000000000000000"], "train.seed"),
    "negative train.seed": (lambda t, m: ["train", SMOKE, "--out", str(t / "run"), "--set", "train.seed=-1"], "train.seed"),
    "model.tiny.seed beyond 64 bits": (lambda t, m: ["train", SMOKE, "--out", str(t / "run"), "--set", "model.tiny.seed=18446744073709551616"], "model.tiny.seed"),
    "a FIFO as data.path": (lambda t, m: ["train", str(_noenv_config(t)), "--out", str(t / "run"), "--set", "data.source='jsonl'",
                                         "--set", f"data.path='{_fifo(t)}'", "--set", "data.prompt_key='prompt'"], "not a regular file"),
    "a module that calls sys.exit": (lambda t, m: ["train", SMOKE, "--out", str(t / "run"), "--set", f"env.name='{_exiting_module(t, m)}'"], "sys.exit(3)"),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_is_one_line_exit_2_and_writes_nothing(tmp_path, capsys, monkeypatch, case):
    argv_of, says = BAD_INPUTS[case]
    work = tmp_path / "cwd"
    work.mkdir()
    monkeypatch.chdir(work)
    argv = argv_of(tmp_path, monkeypatch)
    before = sorted(p.name for p in tmp_path.iterdir())
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: ") and says in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == before and list(work.iterdir()) == []


def _non_utf8(tmp_path: Path) -> Path:
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b'{"prompt": "Row 0", "answer": "1"}\n{"prompt": "caf\xe9", "answer": "2"}\n')
    return path


MORE_BAD_INPUTS = {
    "tiny hidden_size not divisible by num_heads": (["--set", "model.tiny.num_heads=3"], "not a multiple of model.tiny.num_heads"),
    "tiny num_heads not divisible by num_kv_heads": (["--set", "model.tiny.num_heads=4", "--set", "model.tiny.num_kv_heads=3"], "num_kv_heads = 3"),
    "tiny odd head dimension": (["--set", "model.tiny.hidden_size=36", "--set", "model.tiny.num_heads=4", "--set", "model.tiny.num_kv_heads=2"], "is odd"),
    "a non-UTF-8 data file": (["--set", "data.source='jsonl'", "--set", "data.path='NONUTF8'", "--set", "data.prompt_key='prompt'"], ":2: not UTF-8 text (byte 0xe9)"),
}


@pytest.mark.parametrize("case", sorted(MORE_BAD_INPUTS))
def test_more_bad_inputs_are_one_line_exit_2_and_write_nothing(tmp_path, capsys, case):
    sets, says = MORE_BAD_INPUTS[case]
    data = any("data." in s for s in sets)
    config = _noenv_config(tmp_path) if data else Path(SMOKE)
    sets = [s.replace("NONUTF8", str(_non_utf8(tmp_path))) for s in sets]
    assert main(["train", str(config), "--out", str(tmp_path / "run"), *sets]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and says in err, err
    assert not (tmp_path / "run").exists()


def _good_rows() -> list[dict]:
    return [{"prompt": f"Row {i}: add {i} and {i % 7}.", "answer": str(i + i % 7)} for i in range(40)]


def _parquet_bytes(tmp_path: Path) -> bytes:
    pa = pytest.importorskip("pyarrow", reason="parquet needs pyarrow (pip install 'recursa[data]')")
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(_good_rows()), tmp_path / "whole.parquet")
    data = (tmp_path / "whole.parquet").read_bytes()
    (tmp_path / "whole.parquet").unlink()
    return data


def _jsonl_bytes() -> bytes:
    return "".join(json.dumps(r) + "\n" for r in _good_rows()).encode()


def _csv_bytes() -> bytes:
    return ("prompt,answer\n" + "".join(f'"{r["prompt"]}",{r["answer"]}\n' for r in _good_rows())).encode()


def _saved_dir(tmp_path: Path, cut: bool) -> Path:
    """A `save_to_disk` directory, its table file cut in half when `cut`."""
    datasets = pytest.importorskip("datasets", reason="data.source = 'hf' needs datasets (pip install 'recursa[data]')")
    path = tmp_path / "saved"
    datasets.Dataset.from_list(_good_rows()).save_to_disk(str(path))
    if cut:
        (table,) = path.glob("*.arrow")
        table.write_bytes(table.read_bytes()[: table.stat().st_size // 2])
    return path


def _needs(source: str) -> None:
    """Skip where the source's reader is not installed (CI installs recursa[data]; a bare
    `make test` setup does not): without it the error is the install hint, not the file's."""
    if source == "parquet":
        pytest.importorskip("pyarrow", reason="data.source = 'parquet' needs pyarrow (pip install 'recursa[data]')")
    if source == "hf":
        pytest.importorskip("datasets", reason="data.source = 'hf' needs datasets (pip install 'recursa[data]')")


def _half(data: bytes) -> bytes:
    return data[: len(data) // 2]


# source, file name, its bytes (from tmp_path), what the one line says. Before: pyarrow's or datasets' traceback
# ("internal error: ArrowInvalid ..."), and for `hf` the library's own log lines and progress bars beside it.
BAD_DATA_FILES = {
    "parquet cut in half": ("parquet", "rows.parquet", lambda t: _half(_parquet_bytes(t)), "not a readable Parquet file (Could not open Parquet"),
    "parquet missing its last bytes": ("parquet", "rows.parquet", lambda t: _parquet_bytes(t)[:-3], "not a readable Parquet file"),
    "empty parquet": ("parquet", "rows.parquet", lambda t: b"", "Parquet file size is 0 bytes"),
    "text named .parquet": ("parquet", "rows.parquet", lambda t: _jsonl_bytes(), "magic bytes not found"),
    "jsonl cut in half": ("jsonl", "rows.jsonl", lambda t: _half(_jsonl_bytes()), ":21: not JSON (Unterminated string"),
    "hf parquet cut in half": ("hf", "rows.parquet", lambda t: _half(_parquet_bytes(t)), "not a readable Parquet file (Parquet magic bytes not found"),
    "hf jsonl cut in half": ("hf", "rows.jsonl", lambda t: _half(_jsonl_bytes()), "not a readable JSON file (JSON parse error"),
    "hf jsonl not UTF-8": ("hf", "rows.jsonl", lambda t: _jsonl_bytes() + b'{"prompt": "caf\xe9", "answer": "1"}\n', "not UTF-8 text (byte 0xe9): save the JSON file"),
    "hf csv not UTF-8": ("hf", "rows.csv", lambda t: _csv_bytes() + b"caf\xe9,1\n", "not UTF-8 text (byte 0xe9): save the CSV file"),
    "hf save_to_disk table cut in half": ("hf", None, lambda t: _saved_dir(t, cut=True), "not a readable datasets directory (Expected to be able to read"),
}


@pytest.mark.parametrize("case", sorted(BAD_DATA_FILES))
def test_a_truncated_or_undecodable_data_file_is_one_line_exit_2(tmp_path, capsys, monkeypatch, case):
    source, name, content, says = BAD_DATA_FILES[case]
    _needs(source)
    data = content(tmp_path)
    if isinstance(data, bytes):
        path = tmp_path / name
        path.write_bytes(data)
    else:
        path = data
    config = _noenv_config(tmp_path)
    work = tmp_path / "cwd"
    work.mkdir()
    monkeypatch.chdir(work)
    before = sorted(p.name for p in tmp_path.iterdir())
    capsys.readouterr()
    assert main(["train", str(config), "--out", str(tmp_path / "run"), "--set", f"data.source='{source}'", "--set", f"data.path='{path}'",
                 "--set", "data.prompt_key='prompt'"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: ") and says in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == before and list(work.iterdir()) == []


@pytest.mark.parametrize("source, name, content", [("parquet", "rows.parquet", _parquet_bytes), ("hf", "rows.csv", lambda t: _csv_bytes()),
                                                   ("hf", None, lambda t: _saved_dir(t, cut=False))])
def test_whole_data_files_of_each_source_still_load(tmp_path, source, name, content):
    """The other side of the refusals above: the same files, whole, give the 40 rows."""
    from recursa.envs.dataset import DatasetEnv

    _needs(source)
    data = content(tmp_path)
    path = data if not isinstance(data, bytes) else tmp_path / name
    if isinstance(data, bytes):
        path.write_bytes(data)
    env = DatasetEnv(str(path), source=source)
    assert sum(env.num_items(s) for s in ("train", "gate", "test")) == 40


def test_max_positions_shorter_than_the_prompts_is_one_line_exit_2(tmp_path, capsys):
    """model.tiny.max_positions below prompt + completion: the first sampling call says so in one
    line (before: the tiny model's rotary positions ran past it silently)."""
    assert main(["train", SMOKE, "--out", str(tmp_path / "run"), "--set", "model.tiny.max_positions=8"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "passes the model's 8 positions" in err and "sampling.max_new_tokens" in err, err


BROKEN_ENVS = '''
class NumberReset:
    name = "number_reset"
    def reset(self, seed):
        return 5
    def step(self, action_text):
        raise AssertionError("never reached")


class AlwaysRaises:
    name = "always_raises"
    def reset(self, seed):
        return "What is 1 + 1?"
    def step(self, action_text):
        raise RuntimeError("boom")
'''


@pytest.mark.parametrize("factory, says", [("NumberReset", "returned a int, not the first observation"),
                                           ("AlwaysRaises", "step failed on each of its first 8 calls")])
def test_a_broken_env_stops_the_run_in_one_line(tmp_path, capsys, monkeypatch, factory, says):
    """An env whose reset returns a non-string, or whose step always raises, is a bug of the env:
    before, the first was an internal error and the second a 'successful' run of failed episodes."""
    (tmp_path / "broken_envs_49.py").write_text(BROKEN_ENVS)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["train", SMOKE, "--out", str(tmp_path / "run"), "--set", f"env.name='broken_envs_49:{factory}'", "--set", "env.kwargs={}"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and says in err, err


def test_an_env_that_fails_now_and_then_still_trains(tmp_path, capsys, monkeypatch):
    """Only a game that never once steps is refused: one crash in a few is restarted as before."""
    (tmp_path / "flaky_env_49.py").write_text('''
from recursa.envs.arithmetic import ArithmeticEnv


class Flaky(ArithmeticEnv):
    calls = 0

    def step(self, action_text):
        Flaky.calls += 1
        if Flaky.calls % 3 == 1:
            raise RuntimeError("flaky")
        return super().step(action_text)
''')
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["train", SMOKE, "--out", str(tmp_path / "run"), "--set", "env.name='flaky_env_49:Flaky'", "--set", "train.steps=1", "--set", "eval.n=4"]) == 0
    assert any(r.get("env/restarts", 0) > 0 for r in _metrics(tmp_path / "run"))


def test_init_checkpoint_may_be_a_toml_integer(tmp_path):
    as_int = load_config(None, ["init.checkpoint=5"], check=False)
    assert as_int.init.checkpoint == "5" and as_int == load_config(None, ["init.checkpoint='5'"], check=False)
    _roundtrip(as_int, tmp_path)
    with pytest.raises(Exception, match="init.checkpoint"):
        load_config(None, ["init.checkpoint=-1"], check=False)


# ----------------------------------------------------------------------------- an env that breaks mid-run

BREAKS_MID_RUN = '''
import os
from recursa.envs.arithmetic import ArithmeticEnv

CALLS = {"reset": 0, "step": 0}


class Breaks(ArithmeticEnv):
    """Arithmetic whose reset or step raises from its N-th call on, while RECURSA_TEST_BREAK is
    "reset:N" or "step:N" (a game server that went away); unset, it is the env fixed."""

    def _broken(self, call):
        CALLS[call] += 1
        kind, _, n = os.environ.get("RECURSA_TEST_BREAK", "").partition(":")
        if kind == call and CALLS[call] >= int(n):
            raise ConnectionError("the game server went away")

    def reset(self, seed):
        self._broken("reset")
        return super().reset(seed)

    def step(self, action_text):
        self._broken("step")
        return super().step(action_text)
'''

# smoke.toml, 4 steps of 2 x 4 episodes, a checkpoint every 2 steps, 4 test items before and after: the env's calls
# are 4 (before), 8 per step, then 4 (after). Each case: when it breaks, what the run then holds (its checkpoints
# and the steps of its metrics lines), and what the one line says.
MID_RUN_SETS = ["--set", "env.name='breaks_mid_run_49:Breaks'", "--set", "env.kwargs={difficulty=0}", "--set", "train.steps=4",
                "--set", "run.checkpoint_every=2", "--set", "eval.n=4", "--set", "eval.batch_size=4"]
MID_RUN_BREAKS = {
    "reset fails from step 2": ("reset:13", [], [0, 1], "failed twice in a row on reset"),
    "step raises from step 3": ("step:21", ["step_000002"], [0, 1, 2], "every game of training step 3 failed (8 crashed or hung"),
    "step raises from step 4": ("step:29", ["step_000002"], [0, 1, 2, 3], "every game of training step 4 failed"),
    "step raises in the after evaluation": ("step:37", ["step_000002", "step_000004"], [0, 1, 2, 3, 4], "every game of the evaluation 'after' failed"),
}


@pytest.fixture()
def breaking_env(tmp_path, monkeypatch):
    import importlib
    import sys

    (tmp_path / "breaks_mid_run_49.py").write_text(BREAKS_MID_RUN)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("breaks_mid_run_49", None)
    return importlib.import_module("breaks_mid_run_49")


@pytest.fixture(scope="module")
def unbroken_run(tmp_path_factory):
    import importlib
    import sys

    base = tmp_path_factory.mktemp("unbroken")
    (base / "breaks_mid_run_49.py").write_text(BREAKS_MID_RUN)
    sys.path.insert(0, str(base))
    try:
        sys.modules.pop("breaks_mid_run_49", None)
        importlib.import_module("breaks_mid_run_49")
        assert main(["train", SMOKE, "--out", str(base / "ref"), *MID_RUN_SETS]) == 0
    finally:
        sys.path.remove(str(base))
        sys.modules.pop("breaks_mid_run_49", None)
    return base / "ref"


@pytest.mark.parametrize("case", list(MID_RUN_BREAKS))
def test_an_env_that_breaks_mid_run_leaves_a_resumable_run(tmp_path, capsys, monkeypatch, breaking_env, unbroken_run, case):
    """Before, a step that raised from some call on left the run going: every later episode
    'crashed' with reward 0, was trained on (Adam's momentum moving the weights on no signal)
    and checkpointed, and eval/after.json recorded a success rate of games never played. Now
    the run stops before the first step (or evaluation) none of whose games returned: it
    keeps its last good checkpoint and the metrics of the steps it finished, releases its
    lock, says so in one line, and once the env works `--resume` ends where an unbroken run
    ends."""
    from recursa.runio import RunLock

    brk, checkpoints, steps, says = MID_RUN_BREAKS[case]
    run = tmp_path / "run"
    monkeypatch.setenv("RECURSA_TEST_BREAK", brk)
    capsys.readouterr()
    assert main(["train", SMOKE, "--out", str(run), *MID_RUN_SETS]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: ") and says in err, err
    assert sorted(p.name for p in (run / "checkpoints").glob("*")) == checkpoints  # nothing half-written beside them
    assert sorted({r["step"] for r in _metrics(run)}) == steps
    assert _metrics(run) == [r for r in _metrics(unbroken_run) if r["step"] in steps and (r["step"] < 4 or "eval/success_rate" not in r)]
    assert sorted(p.name for p in (run / "eval").iterdir()) == ["before.json"]  # no evaluation of games never played
    lock = RunLock(run).acquire()  # released: another process (here: another open file) may take it
    lock.release()

    monkeypatch.delenv("RECURSA_TEST_BREAK")  # the env fixed
    assert main(["train", "--resume", str(run), "--trust-run-code"]) == 0
    assert _metrics(run) == _metrics(unbroken_run)
    for label in ("before", "after"):
        assert json.loads((run / "eval" / f"{label}.json").read_text())["items"] == json.loads((unbroken_run / "eval" / f"{label}.json").read_text())["items"]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_000002", "step_000004"]
