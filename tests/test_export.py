"""Checkpoints as Hugging Face model directories, `recursa export`, and old run directories."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from recursa.cli import main
from recursa.config import load_config
from recursa.errors import UserError
from recursa.export import load_run_policy
from recursa.models import load_policy
from recursa.recipes import grpo
from recursa.store import RunStore

DIGITS = ["model.name=tiny-random", "env.name=toy-digits", "sampling.max_new_tokens=6", "train.prompts_per_step=2",
          "train.group_size=4", "train.micro_batch_size=8", "train.lr=1e-2", "eval.n=0"]
LORA = ["model.lora.r=4", "model.lora.alpha=8.0"]
IDS = torch.tensor([[1, 5, 9, 30, 2, 7, 11, 3]])  # any ids of the tiny vocabulary


def _train(out: Path, *sets: str) -> Path:
    grpo.train(load_config(None, [*DIGITS, *sets]), out, log=lambda *_: None)
    return out


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


def _hf(directory: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(str(directory)), AutoTokenizer.from_pretrained(str(directory))


def _chat(tokenizer) -> list[int]:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "What is 7 + 5?"}], add_generation_prompt=True)
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


def test_a_checkpoint_is_a_hugging_face_model_directory(tmp_path):
    run = _train(tmp_path / "run", "train.steps=1")
    ckpt = run / "checkpoints" / "step_000001"
    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "optimizer.pt", "rng.pt", "state.json"):
        assert (ckpt / name).exists(), name
    policy = load_policy(load_config(run / "config.toml").model, weights_dir=ckpt)
    initial = load_policy(load_config(run / "config.toml").model)
    model, tokenizer = _hf(ckpt)
    assert torch.equal(_logits(model), _logits(policy.causal_lm))
    assert not torch.allclose(_logits(model), _logits(initial.causal_lm), atol=1e-4)  # the step moved the weights
    assert _chat(tokenizer) == _chat(policy.tokenizer)  # the chat template travels with the weights
    from safetensors import safe_open

    with safe_open(str(ckpt / "model.safetensors"), "pt") as f:  # HF names; the tied head is stored once
        assert "model.embed_tokens.weight" in f.keys() and "lm_head.weight" not in f.keys()


def test_export_loads_with_from_pretrained_and_gives_the_runs_logits(tmp_path, capsys):
    run = _train(tmp_path / "run", "train.steps=2", "run.checkpoint_every=1")
    out = tmp_path / "export"
    assert main(["export", str(run), "--out", str(out), "--checkpoint", "1"]) == 0
    assert "from_pretrained" in capsys.readouterr().out
    _, _, policy = load_run_policy(run, "1")
    model, tokenizer = _hf(out)
    assert torch.equal(_logits(model), _logits(policy.causal_lm))
    _, _, last = load_run_policy(run)
    assert not torch.equal(_logits(model), _logits(last.causal_lm))  # --checkpoint 1, not the last
    assert _chat(tokenizer) == _chat(policy.tokenizer)
    config = json.loads((out / "config.json").read_text())
    assert config["rope_theta"] == config["rope_parameters"]["rope_theta"] and config["torch_dtype"] == "float32"
    assert json.loads((out / "tokenizer_config.json").read_text())["chat_template"] == policy.tokenizer.chat_template
    meta = json.loads((out / "recursa_export.json").read_text())
    assert meta["checkpoint"] == "step_000001" and meta["lora_merged"] is False

    half = tmp_path / "bf16"
    assert main(["export", str(run), "--out", str(half), "--dtype", "bfloat16"]) == 0
    model16, _ = _hf(half)
    assert model16.dtype == torch.bfloat16
    ours = last.causal_lm.state_dict()
    assert all(torch.equal(v, ours[k].to(torch.bfloat16)) for k, v in model16.state_dict().items())  # the weights, rounded once
    torch.testing.assert_close(_logits(model16).float(), _logits(last.causal_lm), rtol=0, atol=0.05)


def test_export_of_a_lora_run_gives_the_merged_models_logits(tmp_path):
    run = _train(tmp_path / "run", "train.steps=1", *LORA)
    ckpt = run / "checkpoints" / "step_000001"
    assert (ckpt / "adapter_model.safetensors").exists() and (ckpt / "tokenizer.json").exists()
    assert not (ckpt / "model.safetensors").exists()  # a LoRA checkpoint stores the adapters, export merges them
    out = tmp_path / "merged"
    assert main(["export", str(run), "--out", str(out)]) == 0
    _, _, policy = load_run_policy(run)
    assert policy.is_lora
    model, _ = _hf(out)
    assert type(model).__name__ == "LlamaForCausalLM" and not any("lora" in k for k in model.state_dict())
    want = _logits(policy.model)  # the PeftModel: base + adapters
    torch.testing.assert_close(_logits(model), want, rtol=1e-5, atol=1e-5)
    base = _logits(load_policy(load_config(run / "config.toml").model).causal_lm)
    assert (base - want).abs().max() > 1e-3  # the adapters moved the logits, so the merge is what matched
    assert json.loads((out / "recursa_export.json").read_text())["lora_merged"] is True


def test_export_errors_are_one_line(tmp_path, capsys):
    run = _train(tmp_path / "run", "train.steps=1")
    empty = tmp_path / "empty"
    empty.mkdir()
    shutil.copy(run / "config.toml", empty / "config.toml")
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "x").write_text("")
    cases = [
        (["export", str(tmp_path / "nope"), "--out", str(tmp_path / "o")], "not a directory"),
        (["export", str(tmp_path), "--out", str(tmp_path / "o")], "no config.toml"),
        (["export", str(empty), "--out", str(tmp_path / "o")], "no finished checkpoint"),
        (["export", str(run), "--out", str(tmp_path / "o"), "--checkpoint", "9"], "available steps: [1]"),
        (["export", str(run), "--out", str(tmp_path / "o"), "--checkpoint", "best"], "'last' or a step number"),
        (["export", str(run), "--out", str(taken)], "--overwrite"),
    ]
    for argv, message in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: ") and message in err and "\n" not in err, (argv, err)
    assert not (tmp_path / "o").exists() and not (tmp_path / "o.tmp").exists()
    # --overwrite replaces only an earlier export (issue 49): a directory of the user's stays as it is
    assert main(["export", str(run), "--out", str(taken), "--overwrite"]) == 2 and "not a model directory recursa exported" in capsys.readouterr().err
    assert sorted(p.name for p in taken.iterdir()) == ["x"]
    assert main(["export", str(run), "--out", str(tmp_path / "o")]) == 0
    assert main(["export", str(run), "--out", str(tmp_path / "o"), "--overwrite"]) == 0 and (tmp_path / "o" / "config.json").exists()


def _to_bare_format(ckpt: Path) -> None:
    """Rewrite a checkpoint as recursa wrote them before they were HF directories: only a
    metadata-less model.safetensors (tied head dropped), optimizer.pt, rng.pt, state.json."""
    from safetensors.torch import load_file, save_file

    state = load_file(str(ckpt / "model.safetensors"))
    for p in list(ckpt.iterdir()):
        if p.name not in ("optimizer.pt", "rng.pt", "state.json"):
            p.unlink()
    save_file(state, str(ckpt / "model.safetensors"))


def test_bare_checkpoints_of_old_runs_still_resume_evaluate_and_export(tmp_path):
    sets = ["train.steps=2", "run.checkpoint_every=1", "eval.n=4", "eval.before=false"]
    full = _train(tmp_path / "full", *sets)
    part = tmp_path / "part"
    shutil.copytree(full, part)
    shutil.rmtree(part / "checkpoints" / "step_000002")
    _to_bare_format(part / "checkpoints" / "step_000001")
    assert sorted(p.name for p in (part / "checkpoints" / "step_000001").iterdir()) == ["model.safetensors", "optimizer.pt", "rng.pt", "state.json"]
    (part / "eval" / "after.json").unlink()
    grpo.train(load_config(part / "config.toml"), part, resume=True, log=lambda *_: None)

    def lines(run):
        return [{k: v for k, v in json.loads(s).items() if not k.startswith(("time/", "throughput/"))} for s in (run / "metrics.jsonl").read_text().splitlines()]

    assert lines(part) == lines(full)  # the resume from the bare checkpoint replays the uninterrupted run
    _to_bare_format(part / "checkpoints" / "step_000002")
    assert main(["eval", "--run", str(part), "--n", "4", "--json", str(tmp_path / "e.json")]) == 0
    out = tmp_path / "export"
    assert main(["export", str(part), "--out", str(out)]) == 0
    _, _, policy = load_run_policy(full)
    model, _ = _hf(out)
    assert torch.equal(_logits(model), _logits(policy.causal_lm))


def test_a_checkpoint_file_that_would_run_code_is_refused(tmp_path, capsys):
    import fractions

    run = _train(tmp_path / "run", "train.steps=1")
    ckpt = run / "checkpoints" / "step_000001"
    torch.save({"torch_rng": torch.get_rng_state(), "payload": fractions.Fraction(1, 3)}, ckpt / "rng.pt")
    with pytest.raises(UserError, match="refusing to unpickle"):
        RunStore.load_state(ckpt, None)
    assert main(["train", "--resume", str(run), "--set", "train.steps=2"]) == 2
    err = capsys.readouterr().err.strip()
    assert "fractions.Fraction" in err and "\n" not in err


@pytest.mark.slow
def test_export_of_the_embedded_model(tmp_path):
    """The embedded SmolLM2-135M-Instruct, untrained (step 0): the export loads with
    from_pretrained and gives the run's logits; its rotary base survives for transformers 4."""
    run = tmp_path / "run"
    grpo.train(load_config(None, ["train.steps=0", "eval.n=0", "env.name=arithmetic"]), run, log=lambda *_: None)
    out = tmp_path / "smollm2"
    assert main(["export", str(run), "--out", str(out)]) == 0
    _, _, policy = load_run_policy(run)
    model, tokenizer = _hf(out)
    ids = torch.tensor([_chat(tokenizer)])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, policy.causal_lm(ids).logits)
    assert _chat(tokenizer) == _chat(policy.tokenizer)
    config = json.loads((out / "config.json").read_text())
    assert config["rope_theta"] == config["rope_parameters"]["rope_theta"] == policy.causal_lm.config.rope_parameters["rope_theta"]


def _params(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def test_interpolation_is_the_weighted_mean_of_the_checkpoint_and_its_warm_start(tmp_path):
    """theta_0 + alpha (theta - theta_0), parameter by parameter, against the two endpoints:
    a run warm-started from another run's checkpoint, so theta_0 is that checkpoint."""
    first = _train(tmp_path / "first", "train.steps=1")
    second = _train(tmp_path / "second", "train.steps=2", f"init.from_run={first}")
    start = _params(load_run_policy(first)[2].causal_lm)
    end = _params(load_run_policy(second)[2].causal_lm)
    assert max((end[k] - start[k]).abs().max().item() for k in end) > 1e-4  # the second run moved the weights
    for alpha in (0.0, 0.25, 1.0):
        _, _, policy = load_run_policy(second, interpolate=alpha)
        got = _params(policy.causal_lm)
        for k in end:
            torch.testing.assert_close(got[k], start[k] + alpha * (end[k] - start[k]), rtol=0, atol=1e-6)
    _, _, whole = load_run_policy(second)
    assert torch.equal(_logits(load_run_policy(second, interpolate=1.0)[2].causal_lm), _logits(whole.causal_lm))


def test_interpolating_a_lora_run_scales_its_adapters(tmp_path):
    """Under LoRA the warm start is the base with the adapters at zero, so alpha scales the
    merged update: W + alpha * scale * B A."""
    run = _train(tmp_path / "run", "train.steps=2", *LORA)
    _, _, lora = load_run_policy(run)
    base = _params(load_policy(load_config(run / "config.toml").model.model_copy(update={"lora": None})).causal_lm)
    merged = _params(lora.model.merge_and_unload())
    _, _, half = load_run_policy(run, interpolate=0.5)
    assert not half.is_lora
    got = _params(half.causal_lm)
    assert got.keys() == merged.keys()
    moved = [k for k in got if not torch.equal(merged[k], base[k])]
    assert moved  # the adapters changed some weights
    for k in got:
        torch.testing.assert_close(got[k], base[k] + 0.5 * (merged[k] - base[k]), rtol=0, atol=1e-6)


def test_eval_and_export_interpolate_and_refuse_bad_weights(tmp_path, capsys):
    run = _train(tmp_path / "run", "train.steps=1")
    out = tmp_path / "half"
    assert main(["export", str(run), "--out", str(out), "--interpolate", "0.5"]) == 0
    model, _ = _hf(out)
    _, _, half = load_run_policy(run, interpolate=0.5)
    assert torch.equal(_logits(model), _logits(half.causal_lm))
    meta = json.loads((out / "recursa_export.json").read_text())
    assert meta["interpolate"] == 0.5 and meta["warm_start"] == "tiny-random"
    capsys.readouterr()
    js = tmp_path / "eval.json"
    assert main(["eval", "--run", str(run), "--interpolate", "0.5", "--n", "4", "--json", str(js)]) == 0
    assert json.loads(js.read_text())["label"] == "step_000001@0.5"
    for argv, message in [
        (["eval", "--run", str(run), "--interpolate", "1.5", "--n", "4"], "between 0"),
        (["eval", "--config", str(run / "config.toml"), "--interpolate", "0.5", "--n", "4"], "pass --run"),
        (["eval", "--run", str(run), "--interpolate", "0.5", "--model", "tiny-random", "--n", "4"], "without --model"),
        (["export", str(run), "--out", str(tmp_path / "o"), "--interpolate", "-0.1"], "between 0"),
    ]:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: ") and message in err and "\n" not in err, (argv, err)
