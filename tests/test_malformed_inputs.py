"""A table-driven malformed-input campaign: configs, --set overrides, CLI flags, run
directories, checkpoints, ledgers and evaluation files, each run through the CLI in this
process. Every case must exit 2 with ONE line on stderr that starts with "error: ", with no
traceback (docs/reliability.md, "One error path")."""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
from pathlib import Path

import pytest

from recursa.cli import main

ROOT = Path(__file__).resolve().parents[1]
SMOKE = str(ROOT / "examples" / "smoke.toml")
SMALL = ["--set", "train.steps=2", "--set", "eval.n=4", "--set", "eval.batch_size=4", "--set", "train.group_size=2"]


def _one_line_exit_2(argv, capsys) -> str:
    code = main(argv)
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert code == 2, f"{argv}: exit {code}, stderr {err!r}"
    assert err.startswith("error: "), err
    assert "\n" not in err, err
    assert "Traceback" not in err + captured.out
    return err


# ----------------------------------------------------------------------------- --set overrides

NUMERIC_KEYS = [
    "train.steps", "train.lr", "train.group_size", "train.prompts_per_step", "train.micro_batch_size", "train.epochs",
    "train.mini_batches", "train.max_grad_norm", "train.warmup_steps", "train.weight_decay", "sampling.temperature", "sampling.top_p",
    "sampling.max_new_tokens", "eval.n", "eval.batch_size", "eval.max_new_tokens", "run.threads", "run.checkpoint_every",
    "algo.clip_low", "algo.clip_high", "algo.kl_coef", "model.tiny.hidden_size", "env.step_timeout", "env.max_restarts",
]
BAD_NUMBERS = ["true", "false", "'12'", "nan", "inf", "-inf", "-1", "[1]", "{a = 1}"]
# keys where the value below is out of range (0, too large, or a fraction where an integer is due)
OUT_OF_RANGE = [
    ("train.steps", "1e12"), ("train.group_size", "1e9"), ("train.group_size", "1"), ("train.group_size", "0"), ("train.prompts_per_step", "0"),
    ("train.lr", "0"), ("train.lr", "5.0"), ("train.micro_batch_size", "0"), ("train.epochs", "2.5"), ("sampling.top_p", "0"),
    ("sampling.top_p", "1.5"), ("sampling.max_new_tokens", "0"), ("sampling.max_new_tokens", "99999999"), ("eval.batch_size", "0"),
    ("eval.max_new_tokens", "0"), ("run.threads", "0"), ("run.threads", "100000"), ("algo.clip_low", "1.0"), ("algo.clip_high", "0"),
    ("algo.dual_clip", "0.5"), ("model.lora.r", "0"), ("model.tiny.num_layers", "0"), ("env.step_timeout", "0"), ("env.step_timeout", "1e9"),
]
BAD_SETS = [
    "train.stepz=3", "nosection.key=1", "train=3", "train.steps.deep=1", "noequals", "=5", ".=3", "algo.advantage='nope'",
    "sampling.stop=5", "sampling.streams='sometimes'", "model.dtype='float64'", "model.device='tpu'", "recipe='nope'", "recipe=[1]",
    "env.name=5", "env.name='nosuchtask'", "env.kwargs=3", "env.kwargs.difficulty=99", "env.kwargs.bogus=1", "model.name='/no/such/model'",
    "init.from_run='/no/such/run'", "init.checkpoint='latest'", "rollout.engine='turbo'", "rollout.tis_cap=-1", "train.betas=[0.9]",
    "train.old_logprobs='cached'", "eval.split='train'", "run.out=5", "gate.mode='strict'", "gate.alpha=0.9",
    "eval.n=0", "algo.kl_coef=0.1",  # with the rule below: a memory-free rule of the recipe
]
SET_CASES = (
    [f"{k}={v}" for k in NUMERIC_KEYS for v in BAD_NUMBERS]
    + [f"{k}={v}" for k, v in OUT_OF_RANGE]
    + [s for s in BAD_SETS if s not in ("eval.n=0", "algo.kl_coef=0.1")]
    + ["sampling.temperature=0"]  # group_size > 1 with greedy sampling: every sample identical
)


@pytest.mark.parametrize("item", SET_CASES)
def test_bad_override(tmp_path, capsys, item):
    err = _one_line_exit_2(["train", SMOKE, "--out", str(tmp_path / "r"), "--set", item], capsys)
    assert len(err) < 600
    assert not (tmp_path / "r" / "metrics.jsonl").exists()  # refused before anything ran


# ----------------------------------------------------------------------------- config files

def _config_cases(tmp: Path):
    cases = {}
    (tmp / "bad.toml").write_text("recipe = \n")
    cases["invalid TOML"] = tmp / "bad.toml"
    (tmp / "bin.toml").write_bytes(b"\x80\x81\xfe\xff" * 10)
    cases["binary"] = tmp / "bin.toml"
    (tmp / "dir.toml").mkdir()
    cases["directory"] = tmp / "dir.toml"
    cases["missing"] = tmp / "missing.toml"
    (tmp / "recipe.toml").write_text('recipe = "ppo"\n')
    cases["unknown recipe"] = tmp / "recipe.toml"
    (tmp / "types.toml").write_text('recipe = "grpo"\n[train]\nsteps = "ten"\n')
    cases["string for int"] = tmp / "types.toml"
    (tmp / "section.toml").write_text('recipe = "grpo"\ntrain = 5\n')
    cases["section not a table"] = tmp / "section.toml"
    (tmp / "unknown.toml").write_text('recipe = "grpo"\n[trainer]\nsteps = 1\n')
    cases["unknown section"] = tmp / "unknown.toml"
    (tmp / "dup.toml").write_text('recipe = "grpo"\n[train]\nsteps = 1\nsteps = 2\n')
    cases["duplicate key"] = tmp / "dup.toml"
    (tmp / "nul.toml").write_text('recipe = "grpo\x00"\n')
    cases["NUL byte"] = tmp / "nul.toml"
    (tmp / "sft.toml").write_text('recipe = "sft"\n[model]\nname = "tiny-random"\n[data]\nsource = "jsonl"\n')
    cases["jsonl source without path"] = tmp / "sft.toml"
    (tmp / "rsipo.toml").write_text('recipe = "rsipo"\n[model]\nname = "tiny-random"\n[skills]\nenabled = false\nin_context = true\n')
    cases["rsipo rule"] = tmp / "rsipo.toml"
    return cases


CONFIG_CASES = ["invalid TOML", "binary", "directory", "missing", "unknown recipe", "string for int", "section not a table",
                "unknown section", "duplicate key", "NUL byte", "jsonl source without path", "rsipo rule"]


@pytest.mark.parametrize("case", CONFIG_CASES)
def test_bad_config_file(tmp_path, capsys, case):
    path = _config_cases(tmp_path)[case]
    _one_line_exit_2(["train", str(path), "--out", str(tmp_path / "r")], capsys)


# ----------------------------------------------------------------------------- CLI flags

FLAG_CASES = [
    ["eval", "--model", "tiny-random", "--n", "0"],
    ["eval", "--model", "tiny-random", "--n", "-3"],
    ["eval", "--model", "tiny-random", "--n", "abc"],
    ["eval", "--model", "tiny-random", "--n", "1e99"],
    ["eval", "--model", "tiny-random", "--max-new-tokens", "0"],
    ["eval", "--model", "tiny-random", "--max-new-tokens", "-5"],
    ["eval", "--model", "tiny-random", "--checkpoint", "newest"],
    ["eval", "--model", "tiny-random", "--split", "train"],
    ["eval", "--model", "tiny-random", "--policy", "human"],
    ["eval", "--model", "tiny-random", "--env", "nosuchenv"],
    ["eval", "--model", "tiny-random", "--env", "rg:no_such_dataset"],
    ["eval", "--model", "tiny-random", "--env-arg", "noequals"],
    ["eval", "--model", "tiny-random", "--env-arg", "bogus=1"],
    ["eval", "--model", "/no/such/model/dir"],
    ["eval", "--model", "tiny-random", "--set", "eval.n=-1"],
    ["eval", "--model", "tiny-random", "--skills", "on"],
    ["eval", "--model", "tiny-random", "--skills", "/no/such/run"],
    ["eval", "--run", "/no/such/run"],
    ["eval", "--config", "/no/such.toml"],
    ["eval", "--config", SMOKE, "--run", "/x"],
    ["eval", "--model", "tiny-random", "--policy", "random", "--skills", "on"],
    ["train"],
    ["train", "--resume", "/no/such/run"],
    ["train", SMOKE, "--set"],
    ["train", SMOKE, "--recipe", "ppo"],
    ["train", SMOKE, "--bogus-flag"],
    ["export", "/no/such/run", "--out", "/tmp/x"],
    ["export", "/tmp", "--out", "/tmp/x", "--dtype", "int3"],
    ["export", "/no/such/run"],
    ["report", "/no/such/run"],
    ["report"],
    ["lineage", "/no/such/run"],
    ["nosuchcommand"],
    [],
    ["envs", "--bogus"],
]


@pytest.mark.parametrize("argv", FLAG_CASES, ids=[" ".join(a) or "(none)" for a in FLAG_CASES])
def test_bad_flags(tmp_path, capsys, argv):
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse exits on its own errors
        code = exc.code
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert code == 2, (argv, code, err)
    assert err.startswith("error: ") and "\n" not in err, err
    assert "Traceback" not in err + captured.out


# ----------------------------------------------------------------------------- eval files for --compare and --json

def _compare_cases(tmp: Path) -> dict[str, list[str]]:
    good_items = [{"seed": 1, "reward": 0.0, "success": False}]
    files = {
        "missing": None,
        "empty": "",
        "garbage": "not json {",
        "list": "[1, 2]",
        "no items": json.dumps({"env": "arithmetic"}),
        "items not a list": json.dumps({"items": 5}),
        "item not an object": json.dumps({"env": "a", "split": "test", "n": 1, "mean_reward": 0, "success_rate": 0, "ci95": [0, 1],
                                          "mean_reward_ci95": [0, 1], "items": [5]}),
        "seed is a string": json.dumps({"env": "a", "split": "test", "n": 1, "mean_reward": 0, "success_rate": 0, "ci95": [0, 1],
                                        "mean_reward_ci95": [0, 1], "items": [{"seed": "x", "reward": 0, "success": True}]}),
        "success is a number": json.dumps({"env": "a", "split": "test", "n": 1, "mean_reward": 0, "success_rate": 0, "ci95": [0, 1],
                                           "mean_reward_ci95": [0, 1], "items": [{"seed": 1, "reward": 0, "success": 3}]}),
        "missing fields": json.dumps({"items": good_items}),
        "binary": None,
        "directory": None,
    }
    out = {}
    for name, text in files.items():
        path = tmp / f"{name.replace(' ', '_')}.json"
        if name == "binary":
            path.write_bytes(b"\xff\xfe\x00\x81" * 8)
        elif name == "directory":
            path.mkdir()
        elif text is not None:
            path.write_text(text)
        out[name] = ["--compare", str(path)]
    out["--json is a directory"] = ["--json", str(tmp)]
    out["--json in a missing directory"] = ["--json", str(tmp / "nope" / "e.json")]
    return out


COMPARE_CASES = ["missing", "empty", "garbage", "list", "no items", "items not a list", "item not an object", "seed is a string",
                 "success is a number", "missing fields", "binary", "directory", "--json is a directory", "--json in a missing directory"]


@pytest.mark.parametrize("case", COMPARE_CASES)
def test_bad_eval_files_refused_before_evaluating(tmp_path, capsys, case, monkeypatch):
    import recursa.evaluate

    def no_eval(*a, **k):  # the file must be refused before any evaluation starts
        raise AssertionError("evaluated before checking --compare / --json")

    monkeypatch.setattr(recursa.evaluate, "evaluate", no_eval)
    monkeypatch.setattr(recursa.evaluate, "evaluate_scripted", no_eval)
    flags = _compare_cases(tmp_path)[case]
    _one_line_exit_2(["eval", "--model", "tiny-random", "--n", "2", *flags], capsys)


# ----------------------------------------------------------------------------- run directories, checkpoints, ledgers

@pytest.fixture(scope="module")
def base_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("base") / "run"
    assert main(["train", SMOKE, "--out", str(run), *SMALL, "--set", "run.checkpoint_every=1"]) == 0
    return run


def _ckpt(run: Path, step: int = 2) -> Path:
    return run / "checkpoints" / f"step_{step:06d}"


class _Boom:
    """Unpickling this runs a shell command: what a hostile run directory could carry."""

    def __reduce__(self):
        return (os.system, ("echo pwned > /dev/null",))


def _malicious_pickle(path: Path) -> None:
    import torch

    torch.save({"torch_rng": _Boom()}, path)  # a well-formed torch file that needs code to load


def _truncate(path: Path, keep: int = 100) -> None:
    data = path.read_bytes()
    path.write_bytes(data[:keep])


def _corrupt_every_checkpoint(run: Path, how) -> None:
    for c in (run / "checkpoints").glob("step_*"):
        how(c)


RUN_CASES = {
    # name: (how to damage the copy, argv given the copy)
    "resume: config.toml deleted": (lambda r: (r / "config.toml").unlink(), lambda r: ["train", "--resume", str(r)]),
    "resume: config.toml garbage": (lambda r: (r / "config.toml").write_text("[[[["), lambda r: ["train", "--resume", str(r)]),
    "resume: config.toml bad value": (lambda r: (r / "config.toml").write_text((r / "config.toml").read_text().replace("steps = 2", "steps = true")),
                                      lambda r: ["train", "--resume", str(r)]),
    "resume: ledger not sqlite": (lambda r: (r / "ledger.sqlite").write_bytes(b"garbage" * 100), lambda r: ["train", "--resume", str(r)]),
    "resume: metrics corrupt line": (lambda r: (r / "metrics.jsonl").write_text('{"step": 1}\nnot json\n{"step": 2}\n'),
                                     lambda r: ["train", "--resume", str(r)]),
    "resume: a file, not a run": (lambda r: None, lambda r: ["train", "--resume", str(r / "config.toml")]),
    "report: metrics corrupt line": (lambda r: (r / "metrics.jsonl").write_text('{"step": 1}\nnot json\n{"step": 2}\n'), lambda r: ["report", str(r)]),
    "report: eval file garbage": (lambda r: (r / "eval" / "after.json").write_text("{{{"), lambda r: ["report", str(r)]),
    "report: a file": (lambda r: None, lambda r: ["report", str(r / "config.toml")]),
    "lineage: no ledger": (lambda r: (r / "ledger.sqlite").unlink(), lambda r: ["lineage", str(r)]),
    "lineage: ledger garbage": (lambda r: (r / "ledger.sqlite").write_bytes(b"x" * 4096), lambda r: ["lineage", str(r)]),
    "eval: no checkpoints": (lambda r: shutil.rmtree(r / "checkpoints"), lambda r: ["eval", "--run", str(r), "--n", "1"]),
    "eval: checkpoint step missing": (lambda r: None, lambda r: ["eval", "--run", str(r), "--checkpoint", "99", "--n", "1"]),
    "eval: weights truncated": (lambda r: _truncate(_ckpt(r) / "model.safetensors"), lambda r: ["eval", "--run", str(r), "--n", "1"]),
    "eval: weights deleted": (lambda r: (_ckpt(r) / "model.safetensors").unlink(), lambda r: ["eval", "--run", str(r), "--n", "1"]),
    "eval: weights garbage": (lambda r: (_ckpt(r) / "model.safetensors").write_bytes(b"\x10" * 64), lambda r: ["eval", "--run", str(r), "--n", "1"]),
    "eval: config.toml garbage": (lambda r: (r / "config.toml").write_text("x = = 1"), lambda r: ["eval", "--run", str(r), "--n", "1"]),
    "export: weights truncated": (lambda r: _truncate(_ckpt(r) / "model.safetensors"), lambda r: ["export", str(r), "--out", str(r.parent / "exp")]),
    "export: no checkpoint": (lambda r: shutil.rmtree(r / "checkpoints"), lambda r: ["export", str(r), "--out", str(r.parent / "exp")]),
    "export: bad checkpoint flag": (lambda r: None, lambda r: ["export", str(r), "--out", str(r.parent / "exp"), "--checkpoint", "x"]),
    "export: out is a file": (lambda r: (r.parent / "f").write_text("x"), lambda r: ["export", str(r), "--out", str(r.parent / "f")]),
    "resume: every checkpoint's rng.pt is a code-running pickle": (
        lambda r: _corrupt_every_checkpoint(r, lambda c: _malicious_pickle(c / "rng.pt")), lambda r: ["train", "--resume", str(r)]),
    "train: --out is a file": (lambda r: None, lambda r: ["train", SMOKE, "--out", str(r / "config.toml")]),
    "train: existing run without --overwrite": (lambda r: None, lambda r: ["train", SMOKE, "--out", str(r)]),
    "train: --overwrite of a directory that is not a run": (
        lambda r: [p.unlink() if p.is_file() else shutil.rmtree(p) for p in list(r.iterdir())] and (r / "notes.txt").write_text("mine"),
        lambda r: ["train", SMOKE, "--out", str(r), "--overwrite"]),
    "eval --skills: not an rsipo run": (lambda r: None, lambda r: ["eval", "--run", str(r), "--skills", "on", "--n", "1"]),
    "eval --skills: state.json garbage": (lambda r: (_ckpt(r) / "state.json").write_text("{"), lambda r: ["eval", "--model", "tiny-random", "--skills", str(r)]),
}


@pytest.mark.parametrize("case", list(RUN_CASES))
def test_bad_run_directory(base_run, tmp_path, capsys, case):
    run = tmp_path / "run"
    shutil.copytree(base_run, run)
    damage, argv = RUN_CASES[case]
    damage(run)
    err = _one_line_exit_2(argv(run), capsys)
    if "pickle" in case:
        assert "refusing to unpickle" in err or "corrupt" in err
    if "not a run" in case and "--overwrite" in case:
        assert (run / "notes.txt").read_text() == "mine"  # nothing deleted


def test_campaign_size():
    n = len(SET_CASES) + len(CONFIG_CASES) + len(FLAG_CASES) + len(COMPARE_CASES) + len(RUN_CASES)
    assert n >= 150, n
