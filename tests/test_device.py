"""recursa runs where the policy is: every tensor it makes for the model is on the model's device.

CI has no GPU, so the CPU runs make a wrong device visible instead (`device_guard`):

* every recipe runs inside `torch.device("meta")`, so a tensor factory called without a
  device (torch.zeros, torch.tensor, torch.arange, torch.randperm, ...) makes a meta tensor:
  it has no values, and mixing it with the model's real tensors raises;
* on top of that, `ImplicitDeviceAudit` (a TorchFunctionMode) records each such call made
  from recursa's own source files, with its file and line, also where the meta tensor never
  met a model tensor (a statistic, say). Such a call is a bug on a GPU: it makes a CPU tensor.

`test_the_guard_fails_on_one_device_less_tensor` checks that the guard catches a single
`device=` removed from `collate`. With a GPU (`torch.cuda.is_available()`), the same recipe
runs also happen on `cuda`, plus checks that need one: CPU and GPU log-probabilities agree,
GPU sampling is seeded, and a checkpoint written on the GPU resumes on the CPU.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import os
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch.overrides import TorchFunctionMode

import recursa
import recursa.recipes.grpo as grpo
import recursa.recipes.loop as loop
import recursa.recipes.rft as rft
import recursa.recipes.rsipo as rsipo
import recursa.recipes.sft as sft
import recursa.trajectory as trajectory
from recursa.config import ModelConfig, load_config
from recursa.envs import StepResult, register_env
from recursa.errors import UserError
from recursa.generation import left_pad, sequence_logprobs, uniform_source
from recursa.models import load_policy, resolve_device
from recursa.skills import ParsedSkill
from recursa.trajectory import Trajectory, collate

from _rsipo_runs import patch_rsipo

REPO = Path(__file__).resolve().parent.parent
RECURSA_DIR = str(Path(recursa.__file__).resolve().parent) + os.sep
TORCH_DIR = str(Path(torch.__file__).resolve().parent) + os.sep
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# The factories whose result lands on torch's default device unless given device=
# (`*_like` and `Tensor.new_*` take their input's device, so they are always right).
FACTORIES = {
    torch.tensor, torch.as_tensor, torch.asarray, torch.scalar_tensor, torch.zeros, torch.ones, torch.full, torch.empty,
    torch.empty_strided, torch.arange, torch.linspace, torch.logspace, torch.eye, torch.rand, torch.randn, torch.randint,
    torch.randperm,
}


class ImplicitDeviceAudit(TorchFunctionMode):
    """Records every call of a tensor factory without device= made from recursa's own code."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in FACTORIES and kwargs.get("device") is None:
            frame = sys._getframe(1)
            while frame is not None and frame.f_code.co_filename.startswith(TORCH_DIR):
                frame = frame.f_back
            if frame is not None and frame.f_code.co_filename.startswith(RECURSA_DIR):
                where = f"recursa/{frame.f_code.co_filename[len(RECURSA_DIR):]}:{frame.f_lineno} in {frame.f_code.co_name}"
                self.calls.append(f"{where}: torch.{func.__name__}(...) without device=")
        return func(*args, **kwargs)

    def report(self) -> str:
        return "tensors made without a device (they land on CPU when the model is on a GPU):\n" + "\n".join(sorted(set(self.calls)))


@contextlib.contextmanager
def device_guard():
    """Run recursa with meta as torch's default device, auditing its factory calls; fails
    with the audit's file:line list when there is one (even if the run itself failed)."""
    audit = ImplicitDeviceAudit()
    try:
        with torch.device("meta"), audit:
            yield audit
    except Exception as exc:
        if audit.calls:
            raise AssertionError(audit.report()) from exc
        raise
    if audit.calls:
        raise AssertionError(audit.report())


class CoinEnv:
    """Single-turn toy task: a reply succeeds when the sum of its character codes is even. About
    half the tiny model's replies do, so groups have advantages, siblings succeed and expert
    iteration keeps rows: every branch of the recipes that needs a success runs."""

    name = "toy-coin"
    system_prompt = None

    def reset(self, seed: int) -> str:
        return f"Flip a coin. Item {seed % 10}."

    def step(self, action_text: str) -> StepResult:
        ok = sum(map(ord, action_text or "")) % 2 == 0
        return StepResult("", float(ok), True, {"success": ok})


register_env("toy-coin", CoinEnv, "toy: reward = parity of the reply's character codes (tests)")

SKILL = "Take the object, go to the receptacle and put the object in it."  # household words, so BM25 retrieves it


def _valid_skill(reply, max_words, max_chars):
    """Every written skill parses (the tiny random model writes junk), so skills are replayed,
    admitted, retrieved, shown in context and taught from."""
    return ParsedSkill(SKILL, True, "ok", len(SKILL.split()), 0)


FAST = ["model.name=tiny-random", "run.threads=1", "sampling.max_new_tokens=4", "train.lr=1e-3", "eval.batch_size=4"]
SMALL = ["train.prompts_per_step=2", "train.group_size=2", "train.micro_batch_size=2"]

# recipe -> (module, config file or None, overrides): together they reach every tensor
# recursa makes (rollouts, multi-turn games, the update with several epochs and mini-batches,
# the KL reference with and without LoRA, GiGPO, the self-teacher and skill replay, trust,
# imitation, every gate, SFT, expert iteration, evaluation, checkpoints and resume).
RUNS = {
    "grpo": (grpo, None, [
        "env.name=toy-coin", *SMALL, "train.steps=2", "train.epochs=2", "train.mini_batches=2", "algo.kl_coef=0.05",
        "eval.n=2", "gate.mode=gate", "gate.every=1", "gate.n=2", "gate.prompt_every=1", "gate.prompt_candidates=1",
        "gate.prompt_select_n=2", "run.checkpoint_every=1",
    ]),
    "grpo_lora_game": (grpo, None, [
        "env.name=toy-corridor", *SMALL, "train.steps=1", "algo.kl_coef=0.05", "algo.step_advantage=gigpo", "sampling.top_p=0.9",
        'model.lora={r = 2, target_modules = ["q_proj", "v_proj"]}', "eval.n=2", "sampling.streams=group",  # per-episode streams
    ]),
    "rsipo_skills_game": (rsipo, REPO / "examples" / "rsipo_smoke.toml", [
        *SMALL, "train.steps=2", "skills.candidates=2", "skills.replay_size=2", "skills.in_context=true", "teacher.weighting=pass_rate",
        "gate.mode=gate", "gate.every=2", "gate.n=2", "eval.n=2", "run.checkpoint_every=0",
    ]),
    "rsipo_sibling_imitation": (rsipo, None, [
        "env.name=toy-coin", *SMALL, "train.steps=2", "teacher.source=sibling", "teacher.mode=imitation", "teacher.route=failed",
        "skills.candidates=2", "skills.replay_size=2", "skills.in_context=true", "gate.mode=gate", "gate.every=2", "gate.n=2",
        "gate.skills_every=1", "eval.n=2",
    ]),
    "rsipo_signals": (rsipo, None, [
        "env.name=toy-coin", *SMALL, "train.steps=2", "skills.candidates=2", "skills.replay_size=2", "hatch.enabled=true", "route.mode=pass_rate",
        "teacher.critical=from", "skills.contrastive=true", "skills.curate=true", "skills.eval_both=true", "eval.n=2",
    ]),
    "rsipo_signals_game": (rsipo, REPO / "examples" / "rsipo_smoke.toml", [
        *SMALL, "train.steps=1", "skills.candidates=2", "skills.replay_size=2", "hatch.enabled=true", "hatch.hint=oracle_walkthrough",
        "teacher.critical=from", "route.mode=pass_rate", "eval.n=2", "run.checkpoint_every=0",
    ]),
    "sft": (sft, None, ["env.name=arithmetic", "data.n=4", "train.epochs=1", "train.batch_size=2", "train.micro_batch_size=2", "eval.n=2"]),
    "rft": (rft, None, [
        "env.name=toy-coin", "rft.rounds=1", "rft.tasks_per_round=2", "rft.group_size=2", "train.batch_size=2", "train.micro_batch_size=2",
        "eval.n=2", "gate.mode=gate", "gate.every=1", "gate.n=2", "sampling.streams=group",  # per-group streams
    ]),
}
RECIPE_OF = {grpo: "grpo", rsipo: "rsipo", sft: "sft", rft: "rft"}


def _config(name: str, device: str, *extra: str):
    module, path, sets = RUNS[name]
    return load_config(path, [*FAST, *sets, f"model.device={device}", *extra], recipe=RECIPE_OF[module])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", sorted(RUNS))
def test_every_tensor_is_made_on_the_policy_device(name, device, tmp_path, monkeypatch):
    module = RUNS[name][0]
    patch_rsipo(monkeypatch, "parse_skill", _valid_skill)
    out = tmp_path / name
    with device_guard():
        module.train(_config(name, device), out, log=lambda *_: None)
        if name == "grpo":  # resume from the step-2 checkpoint: optimizer, RNG and the KL reference reloaded
            module.train(_config(name, device, "train.steps=3"), out, resume=True, log=lambda *_: None)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows and (out / "eval" / "after.json").exists()


def test_the_guard_fails_on_one_device_less_tensor(tmp_path, monkeypatch):
    """The mutation the guard exists for: `collate` with one `device=host` removed, compiled as
    recursa/trajectory.py so that the audit attributes it to recursa."""
    source = textwrap.dedent(inspect.getsource(trajectory.collate))
    good = "rewards = torch.tensor([t.reward for t in trajectories], dtype=torch.float32, device=host)"
    assert good in source
    namespace = dict(vars(trajectory))
    exec(compile(source.replace(good, good.replace(", device=host", "")), trajectory.__file__, "exec"), namespace)
    monkeypatch.setattr(loop, "collate", namespace["collate"])  # the shared step loop (recipes/loop.py) collates
    with pytest.raises(AssertionError, match=r"recursa/trajectory\.py:\d+ in collate: torch\.tensor\(\.\.\.\) without device="):
        with device_guard():
            grpo.train(_config("grpo", "cpu", "train.steps=1", "gate.mode=off", "gate.prompt_every=0"), tmp_path / "run", log=lambda *_: None)


def test_meta_alone_catches_a_device_less_tensor_that_meets_the_model(tiny_policy):
    """Without the audit, a device-less tensor fed to the model fails under torch.device("meta")."""
    with torch.device("meta"):
        ids = torch.tensor([[1, 2, 3]])  # no device: meta
        mask = torch.ones_like(ids)
        with pytest.raises((RuntimeError, NotImplementedError)):
            sequence_logprobs(tiny_policy.causal_lm, ids, mask, mask.float())


def _rows(n: int = 3) -> list[Trajectory]:
    return [Trajectory("t", i, i, [1] * (2 + i) + [2, 3], [0] * (2 + i) + [1, 1], [0.0] * (2 + i) + [-0.5, -0.25], float(i), False) for i in range(n)]


def test_collate_and_left_pad_build_on_the_host_and_move_to_the_device():
    batch = collate(_rows(), torch.zeros(3, device="cpu"), 0, "meta")
    fields = [batch.input_ids, batch.attention_mask, batch.action_mask, batch.sample_logprobs, batch.advantages, batch.rewards]
    assert all(t.device.type == "meta" for t in fields)
    assert batch.input_ids.shape == (3, 6) and batch.advantages.dtype == torch.float32
    host = collate(_rows(), torch.zeros(3, device="cpu"), 0)
    assert host.device == torch.device("cpu") and host.to("cpu") is host and host.to("meta").rewards.device.type == "meta"
    ids, mask = left_pad([[5, 6], [7]], 0, "meta")
    assert ids.device.type == mask.device.type == "meta"


def test_sampling_on_the_cpu_draws_the_callers_stream_unchanged():
    """CPU sampling uses the step generator itself: the same draws as before devices existed."""
    a, b = torch.Generator(device="cpu").manual_seed(7), torch.Generator(device="cpu").manual_seed(7)
    draw = uniform_source(a, torch.device("cpu"))
    assert torch.equal(draw((3, 5)), torch.rand((3, 5), generator=b))
    assert torch.equal(draw((2, 2)), torch.rand((2, 2), generator=b))


def test_resolve_device(monkeypatch):
    monkeypatch.setenv("RECURSA_DEVICE", "cpu")
    assert resolve_device("auto") == torch.device("cpu")
    assert resolve_device("cpu") == torch.device("cpu")
    monkeypatch.delenv("RECURSA_DEVICE")
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    if not torch.cuda.is_available():
        with pytest.raises(UserError, match="sees no CUDA GPU.*model.device = 'cpu'"):
            resolve_device("cuda:0")
    with pytest.raises(UserError, match="GPU"):
        resolve_device(f"cuda:{torch.cuda.device_count() + 3}")


def test_device_config_is_validated():
    assert load_config(None, ["model.device=cuda:1"]).model.device == "cuda:1"
    assert ModelConfig().device == "auto" and ModelConfig().dtype == "float32"
    with pytest.raises(UserError, match=r"model\.device.*--set model\.device="):
        load_config(None, ["model.device=gpu"])


def test_policy_reports_its_device(tiny_policy):
    assert tiny_policy.device == torch.device("cpu")
    assert all(p.device == tiny_policy.device for p in tiny_policy.model.parameters())


def test_cli_trains_on_the_requested_device(tmp_path, capsys):
    from recursa.cli import main

    smoke = str(REPO / "examples" / "smoke.toml")
    sets = ["--set", "train.steps=1", "--set", "eval.n=0", "--set", "run.threads=1"]
    assert main(["train", smoke, "--out", str(tmp_path / "cpu"), "--set", "model.device=cpu", *sets]) == 0
    assert "float32 on cpu; task arithmetic" in capsys.readouterr().out
    code = main(["train", smoke, "--out", str(tmp_path / "gpu"), "--set", "model.device=cuda", *sets])
    out, err = capsys.readouterr()
    if torch.cuda.is_available():
        assert code == 0 and "float32 on cuda:0" in out
    else:
        assert code == 2 and "sees no CUDA GPU" in err and "\n" not in err.strip()
        assert not (tmp_path / "gpu").exists()  # failed before the run directory was made


# ----------------------------------------------------------------------------- with a GPU


@needs_cuda
def test_cuda_logprobs_match_the_cpu():
    cpu = load_policy(ModelConfig(name="tiny-random", device="cpu"))
    gpu = load_policy(ModelConfig(name="tiny-random", device="cuda"))
    assert gpu.device.type == "cuda"
    batch = collate(_rows(4), torch.zeros(4, device="cpu"), 0)
    want, _ = sequence_logprobs(cpu.causal_lm, batch.input_ids, batch.attention_mask, batch.action_mask)
    g = batch.to(gpu.device)
    got, _ = sequence_logprobs(gpu.causal_lm, g.input_ids, g.attention_mask, g.action_mask)
    assert got.device == gpu.device
    torch.testing.assert_close(got.cpu(), want, atol=1e-4, rtol=1e-4)


@needs_cuda
def test_cuda_sampling_is_seeded():
    from recursa.generation import SamplingParams, generate

    policy = load_policy(ModelConfig(name="tiny-random", device="cuda"))
    prompts = [[1, 5, 9, 12], [1, 7]]
    params = SamplingParams(max_new_tokens=6, temperature=1.0)

    def run(seed):
        samples = generate(policy.causal_lm, policy.tokenizer, prompts, params, n=3, generator=torch.Generator(device="cpu").manual_seed(seed))
        return [s.token_ids for s in samples]

    assert run(3) == run(3)
    assert run(3) != run(4)


@needs_cuda
def test_a_gpu_checkpoint_resumes_on_the_cpu(tmp_path):
    out = tmp_path / "run"
    grpo.train(_config("grpo", "cuda", "train.steps=1", "gate.mode=off", "gate.prompt_every=0"), out, log=lambda *_: None)
    ckpt = out / "checkpoints" / "step_000001"
    state = torch.load(ckpt / "optimizer.pt", weights_only=True)  # no map_location: the file holds CPU tensors
    assert all(t.device.type == "cpu" for s in state["state"].values() for t in s.values() if isinstance(t, torch.Tensor))
    cpu = load_policy(ModelConfig(name="tiny-random", device="cpu"), weights_dir=ckpt)
    assert cpu.device == torch.device("cpu")
    grpo.train(_config("grpo", "cpu", "train.steps=2", "gate.mode=off", "gate.prompt_every=0"), out, resume=True, log=lambda *_: None)
