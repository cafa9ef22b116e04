"""The installable package: the wheel carries the example configs and the metadata users
install by (extras, the `recursa` command), and `recursa examples` copies the examples out.
(.ci/wheel_check.sh installs the built wheel into a fresh venv and trains from it.)"""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from recursa.cli import main

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted(p.relative_to(ROOT / "examples") for p in (ROOT / "examples").rglob("*.toml"))


def test_examples_command_copies_every_example(tmp_path, capsys):
    dest = tmp_path / "ex"
    assert main(["examples", str(dest)]) == 0
    copied = sorted(p.relative_to(dest) for p in dest.rglob("*.toml"))
    assert copied == EXAMPLES and Path("smoke.toml") in copied and Path("rsipo_ablations/opid.toml") in copied
    for rel in EXAMPLES:
        assert (dest / rel).read_bytes() == (ROOT / "examples" / rel).read_bytes()
    assert f"copied {len(EXAMPLES)} example configs" in capsys.readouterr().out
    assert main(["examples", str(dest)]) == 0  # identical copies: nothing to refuse

    (dest / "smoke.toml").write_text("# my edits\n")
    assert main(["examples", str(dest)]) == 2  # a changed file is never overwritten silently
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "smoke.toml exists and differs" in err and "--overwrite" in err and len(err.splitlines()) == 1
    assert (dest / "smoke.toml").read_text() == "# my edits\n"
    assert main(["examples", str(dest), "--overwrite"]) == 0
    assert (dest / "smoke.toml").read_bytes() == (ROOT / "examples" / "smoke.toml").read_bytes()

    capsys.readouterr()
    assert main(["examples", "--list"]) == 0
    assert capsys.readouterr().out.split() == [p.as_posix() for p in EXAMPLES]
    (tmp_path / "afile").write_text("x")
    assert main(["examples", str(tmp_path / "afile")]) == 2


def test_copied_smoke_example_trains(tmp_path):
    dest = tmp_path / "ex"
    assert main(["examples", str(dest)]) == 0
    run = tmp_path / "run"
    assert main(["train", str(dest / "smoke.toml"), "--out", str(run), "--set", "train.steps=1", "--set", "eval.n=2"]) == 0
    assert (run / "metrics.jsonl").exists() and (run / "eval" / "after.json").exists()


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel, built from a copy of the sources (nothing written into the checkout) with
    the setuptools already installed (no network)."""
    pytest.importorskip("setuptools", minversion="77")  # pyproject.toml's SPDX `license` string needs 77+
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for name in ("recursa", "examples"):
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path_factory.mktemp("dist")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(src)],
                   check=True, capture_output=True, text=True)
    (whl,) = out.glob("recursa-*.whl")
    return whl


def test_wheel_carries_the_examples_and_the_metadata(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    for rel in EXAMPLES:
        assert f"recursa/examples/{rel.as_posix()}" in names, rel
    assert "recursa/cli.py" in names and "recursa/docs_gen.py" in names and "recursa/recipes/rsipo.py" in names
    assert not any(n.startswith(("tests/", "benchmarks/", "docs/")) for n in names)
    meta = next(n for n in names if n.endswith(".dist-info/METADATA"))
    metadata = zipfile.ZipFile(wheel).read(meta).decode()
    extras = {line.split(":", 1)[1].strip() for line in metadata.splitlines() if line.startswith("Provides-Extra:")}
    assert {"envs", "vllm", "vllm-cpu", "ray", "track", "bench", "docs", "test"} <= extras
    assert not any(line.startswith("Requires-Dist: torch") for line in metadata.splitlines())  # the torch build is the user's choice
    entry = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert "recursa = recursa.cli:main" in entry
