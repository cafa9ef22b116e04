"""A run directory is data, not code (issue 49; docs/reliability.md, "A run directory is data").

* Every run reloads its own config: the config.toml a run writes loads back, for every example
  config and every [data] source, and a dataset-task run resumes after a kill at every write
  point exactly as the uninterrupted run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from recursa.cli import main
from recursa.config import RECIPES, dump_config, load_config

ROOT = Path(__file__).resolve().parents[1]
SMOKE = str(ROOT / "examples" / "smoke.toml")
EXAMPLES = sorted(p.relative_to(ROOT / "examples").as_posix() for p in (ROOT / "examples").rglob("*.toml"))
TIME_KEYS = ("time/", "throughput/")


def _metrics(run: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(TIME_KEYS)} for r in rows]


def _runner(jobs: list[dict], timeout: int = 900) -> list[dict]:
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("RECURSA_FAULT_AT", None)
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "_fault_runner.py"), json.dumps(jobs)], capture_output=True, text=True,
                          env=env, timeout=timeout, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


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
             {"argv": ["train", "--resume", str(chain)], "fault": "truncate.jsonl@1"}]
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
    assert main(["train", "--resume", str(run)]) == 0
    assert _metrics(run) == _metrics(ref)
    for label in ("before", "after"):
        a = json.loads((ref / "eval" / f"{label}.json").read_text())
        b = json.loads((run / "eval" / f"{label}.json").read_text())
        assert a["items"] == b["items"], label
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_000001", "step_000002"]
    assert main(["eval", "--run", str(run), "--n", "2"]) == 0  # and the finished run evaluates from its stored config


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
