"""The example configs: every one loads with the config loader, and the configs of the loops
that are built to be run for real (issue 17: the prompt gate on twx:twc, the skill-library gate
in RSIPO, RLoop against GRPO, GOPO on the demo task) hold the settings they claim and run one
step on the tiny model."""

from __future__ import annotations

import importlib
import importlib.util
import json
import shutil
import tomllib
from pathlib import Path

import pytest

from recursa.config import load_config

from _rsipo_runs import patch_rsipo

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "examples").rglob("*.toml"))


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: str(p.relative_to(ROOT / "examples")))
def test_every_example_loads(path):
    cfg = load_config(path)
    assert cfg.recipe in ("grpo", "rsipo", "sft", "rft")


def _bench():
    spec = importlib.util.spec_from_file_location("rsipo_vs_grpo", ROOT / "benchmarks" / "rsipo_vs_grpo.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _holds(cfg, sets: list[str]) -> None:
    """`cfg` has every setting of the benchmark's --set list."""
    want = load_config(None, sets, recipe=cfg.recipe)
    for s in sets:
        section, key = s.split("=", 1)[0].split(".")
        assert getattr(getattr(cfg, section), key) == getattr(getattr(want, section), key), s


def test_the_loop_examples_hold_the_benchmark_settings():
    bench = _bench()
    prompt = load_config(ROOT / "examples" / "gate_prompt_twx.toml")
    _holds(prompt, bench.TWX_TWC["sets"])
    assert prompt.init.from_run == "runs/twx_twc_sft" and prompt.gate.mode == "gate" and prompt.gate.prompt_every > 0
    assert (prompt.train.steps, prompt.eval.n, prompt.eval.every) == (bench.TWX_TWC["steps"], bench.TWX_TWC["eval_n"], bench.TWX_TWC["eval_every"])

    skills = load_config(ROOT / "examples" / "skills_gate_household.toml")
    _holds(skills, bench.HOUSEHOLD["sets"] + bench.HOUSEHOLD["rsipo"])
    assert skills.init.from_run == "runs/household_sft" and skills.skills.in_context and skills.gate.skills_every > 0

    loop = load_config(ROOT / "examples" / "rloop_household.toml")
    _holds(loop, bench.HOUSEHOLD["sets"])
    assert loop.init.from_run == "runs/household_sft" and loop.rloop.enabled and loop.train.steps % loop.rloop.rl_steps == 0
    assert bench.recipe_spec("rloop", bench.HOUSEHOLD) == ("grpo", bench.option_sets("rloop")) and "rloop.enabled=true" in bench.option_sets("rloop")

    # GOPO differs from the demo only in its advantage estimator (and its run directory)
    demo = tomllib.loads((ROOT / "examples" / "demo.toml").read_text())
    gopo = tomllib.loads((ROOT / "examples" / "gopo_demo.toml").read_text())
    assert gopo["algo"].pop("advantage") == "gopo" and demo["algo"].pop("advantage") == "grpo"
    assert gopo["run"].pop("out") == "runs/gopo_demo" and demo["run"].pop("out") == "runs/demo"
    assert gopo == demo
    # the prompt gate on the demo task: the demo's settings plus a [gate] section with prompt rounds
    gated = tomllib.loads((ROOT / "examples" / "gate_prompt_demo.toml").read_text())
    assert gated.pop("gate")["prompt_every"] > 0 and gated["run"].pop("out") == "runs/gate_prompt_demo"
    demo["algo"]["advantage"] = "grpo"  # popped for the GOPO comparison above
    assert gated == demo


TINY = ["model.name=tiny-random", 'init.from_run=""', "run.threads=1", "run.checkpoint_every=0", "sampling.max_new_tokens=4",
        "train.steps=1", "train.prompts_per_step=2", "train.group_size=2", "train.micro_batch_size=4", "eval.n=2", "eval.batch_size=2"]
SMALL_GAME = ["env.kwargs.max_steps=3", "gate.n=2"]


def _twx_ready() -> bool:
    return importlib.util.find_spec("textworld_express") is not None and shutil.which("java") is not None


@pytest.mark.parametrize("name, sets", [
    ("gopo_demo", []),
    ("gate_prompt_demo", ["gate.n=2", "gate.prompt_every=1", "gate.prompt_candidates=1", "gate.prompt_select_n=2"]),
    ("rloop_household", [*SMALL_GAME, "rloop.rl_steps=1", "rloop.sft_batch_size=4"]),
    ("skills_gate_household", [*SMALL_GAME, "skills.candidates=2", "skills.max_new_tokens=8", "gate.skills_screen=4"]),
    pytest.param("gate_prompt_twx", [*SMALL_GAME, "gate.prompt_every=1", "gate.prompt_candidates=1", "gate.prompt_select_n=2"],
                 marks=pytest.mark.skipif(not _twx_ready(), reason="textworld-express and Java are needed for twx:twc")),
])
def test_the_loop_examples_run_a_step_on_the_tiny_model(tmp_path, monkeypatch, name, sets):
    if name == "skills_gate_household":  # the tiny model writes junk: give its writer one valid rule, so the library changes and is gated
        from recursa.recipes import rsipo

        patch_rsipo(monkeypatch, "parse_skill", lambda reply, w, c: rsipo.ParsedSkill("Take the object, then put it in the target.", True, "ok", 8, 0))
    cfg = load_config(ROOT / "examples" / f"{name}.toml", [*TINY, *sets])
    run = importlib.import_module(f"recursa.recipes.{cfg.recipe}").train(cfg, tmp_path / name, log=lambda *_: None)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    keys = {k for r in rows for k in r}
    assert "reward/mean" in keys and (run / "eval" / "after.json").exists()
    expected = {"gopo_demo": "advantage/abs_mean", "rloop_household": "rloop/sft_rows", "skills_gate_household": "skills/gate_p_value",
                "gate_prompt_twx": "prompt/proposals", "gate_prompt_demo": "prompt/proposals"}[name]
    assert expected in keys, sorted(keys)


def test_the_benchmark_runs_expert_iteration_at_grpos_episodes():
    """The rft entry: 8 GRPO steps of 4 x 8 episodes (256) are 4 rounds of 16 tasks x 4; an
    evaluation every 4 steps (128 episodes) is one every 2 rounds; the GRPO-only keys go."""
    bench = _bench()
    recipe, extra = bench.recipe_spec("rft", bench.HOUSEHOLD_LIGHT)
    assert recipe == "rft" and "rft.tasks_per_round=16" in extra and "rft.group_size=4" in extra
    sets = [*bench.HOUSEHOLD_LIGHT["sets"], *extra, "train.steps=8", "eval.every=4", "eval.n=50"]
    got = bench.rft_run_sets(sets)
    assert bench._last(got, "rft.rounds") == "4" and bench._last(got, "eval.every") == "2"
    assert not any(s.startswith(("algo.", "train.prompts_per_step=", "train.group_size=", "train.steps=")) for s in got)
    cfg = load_config(None, got, recipe="rft")
    assert (cfg.rft.rounds, cfg.eval.every, cfg.rft.tasks_per_round * cfg.rft.group_size, cfg.eval.n) == (4, 2, 64, 50)
    with pytest.raises(SystemExit, match="whole number"):
        bench.rft_run_sets([*sets, "train.steps=3"])  # 96 episodes are not whole 64-episode rounds


def test_the_household_light_curriculum_example_is_the_pilot():
    """examples/curriculum/household_light.toml plays the benchmark's household_light games with
    the pilot's overrides (docs/rsipo.md), one arm per task type."""
    bench = _bench()
    cfg = load_config(ROOT / "examples" / "curriculum" / "household_light.toml")
    pilot = ["train.lr=1e-5", "train.warmup_steps=2", "train.skip_empty_steps=true", "train.micro_batch_size=8"]
    _holds(cfg, [s for s in bench.HOUSEHOLD_LIGHT["sets"] if not s.startswith(("train.lr=", "train.micro_batch_size=", "run."))] + pilot)
    assert cfg.init.from_run == bench.HOUSEHOLD_LIGHT["warm_start"] and cfg.curriculum.mode == "progress"
    assert sorted(t for a in cfg.curriculum.arms for t in a.kwargs["tasks"]) == sorted(cfg.env.kwargs["tasks"])
    assert (cfg.train.steps, cfg.eval.n, cfg.eval.split) == (8, 50, "gate")


def test_the_search_warm_start_plays_the_chats_the_benchmark_plays(capsys):
    """examples/search_sft.toml demonstrates in the SEARCH game's chat format (env, agent,
    reply length); the game offers only the recipes that play chats, in one line otherwise."""
    bench = _bench()
    warm = load_config(ROOT / "examples" / "search_sft.toml")
    _holds(warm, [s for s in bench.SEARCH["sets"] if s.startswith(("env.", "agent.", "model.", "sampling.max_new_tokens"))])
    assert warm.data.source == "walkthrough" and warm.eval.split == "gate" and f"runs/{warm.run.out.split('/')[-1]}" == bench.SEARCH["warm_start"]
    assert bench.SEARCH["warm_start_cmd"] == "recursa train examples/search_sft.toml"
    assert bench.main(["--games", "search", "--recipes", "grpo,rsipo", "--seeds", "0"]) == 2
    assert "search offers only warm_start, grpo" in capsys.readouterr().err
