from __future__ import annotations

import tomllib

import pytest

from recursa.config import GRPOConfig, describe, dump_config, load_config, parse_override
from recursa.errors import UserError


def _write(tmp_path, text):
    p = tmp_path / "c.toml"
    p.write_text(text)
    return p


def test_defaults_and_overrides(tmp_path):
    p = _write(tmp_path, '[train]\nsteps = 3\n[model]\nname = "tiny-random"\n')
    cfg = load_config(p, ["train.lr=3e-4", "sampling.stop=[\"\\n\"]", "env.kwargs.difficulty=2", "model.system_prompt=Be brief."])
    assert cfg.train.steps == 3 and cfg.train.lr == 3e-4
    assert cfg.sampling.stop == ["\n"]
    assert cfg.env.kwargs == {"difficulty": 2}
    assert cfg.model.system_prompt == "Be brief."  # not TOML: kept as a string


def test_parse_override_types():
    assert parse_override("a.b=1") == (["a", "b"], 1)
    assert parse_override("a=true") == (["a"], True)
    assert parse_override("a.b=hello") == (["a", "b"], "hello")
    with pytest.raises(UserError, match="section.key=value"):
        parse_override("novalue")


def test_unknown_key_is_an_error(tmp_path):
    p = _write(tmp_path, "[train]\nstepz = 3\n")
    with pytest.raises(UserError, match="unknown key 'train.stepz'"):
        load_config(p)
    with pytest.raises(UserError, match="unknown key"):
        load_config(None, ["algo.clip=0.1"])


def test_wrong_type_and_range(tmp_path):
    with pytest.raises(UserError, match=r"train\.lr.*--set train\.lr="):
        load_config(None, ["train.lr=fast"])
    with pytest.raises(UserError, match="algo.advantage"):
        load_config(None, ["algo.advantage=ppo"])
    with pytest.raises(UserError, match="group_size"):
        load_config(None, ["train.group_size=1"])
    with pytest.raises(UserError, match="mini_batches"):
        load_config(None, ["train.prompts_per_step=3", "train.group_size=3", "train.mini_batches=2"])


def test_missing_and_invalid_files(tmp_path):
    with pytest.raises(UserError, match="not found"):
        load_config(tmp_path / "nope.toml")
    with pytest.raises(UserError, match="not valid TOML"):
        load_config(_write(tmp_path, "[train\n"))


def test_dump_roundtrip(tmp_path):
    cfg = load_config(None, ["train.steps=7", "model.lora.r=4", "algo.dual_clip=3.0"])
    text = dump_config(cfg)
    again = GRPOConfig.model_validate(tomllib.loads(text))
    assert again == cfg


def test_describe_lists_every_leaf():
    lines = describe()
    assert any(line.startswith("train.lr = ") for line in lines)
    assert any(line.startswith("model.tiny.hidden_size = ") for line in lines)
