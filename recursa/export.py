"""`recursa export`: a run's checkpoint as a standalone Hugging Face model directory.

    run_dir/config.toml  -> the model the run trained (model.name, LoRA settings, warm start)
    checkpoint           -> its weights: full weights, or LoRA adapters over the base
    load                 -> the policy exactly as `recursa eval --run` and a resumed run see it
    merge                -> LoRA adapters merged into the base weights (W + scale * B A)
    interpolate          -> optionally, the weights moved back toward the run's warm start:
                            theta_0 + alpha (theta - theta_0) (WiSE-FT), `--interpolate ALPHA`
    write                -> config.json, generation_config.json, model.safetensors, tokenizer
                            files with the chat template, written through a temporary
                            directory (complete or absent)

The result is what `AutoModelForCausalLM.from_pretrained(DIR)` and vLLM's `LLM(model=DIR)`
read: a plain `*ForCausalLM` with no recursa or peft code needed. A full-weight checkpoint
already is such a directory; exporting it still helps when the checkpoint predates the
format, or to change the dtype (`--dtype bfloat16` halves the files for serving).

Weight interpolation (`interpolate`, `--interpolate ALPHA` of `recursa export` and `recursa
eval`) evaluates or writes theta_0 + alpha (theta - theta_0): theta the run's checkpoint,
theta_0 the weights the run started from (its `init.from_run` checkpoint, else the base
model). alpha = 1 is the checkpoint, 0 the warm start. Fine-tuning that wins one kind of
task while forgetting another often keeps much of both at an alpha in between (WiSE-FT,
Wortsman et al. 2022); RL from a warm start forgets the same way (docs/curriculum.md).

config.json also carries `rope_theta` (and `torch_dtype`) at the top level, beside
transformers 5's `rope_parameters` (and `dtype`), so readers built on transformers 4, as
some vLLM releases are, get the same rotary base instead of their default.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from recursa.errors import UserError

DTYPES = ("auto", "float32", "bfloat16", "float16")
MARKER = "recursa_export.json"  # written into every export: `--overwrite` replaces only a directory that holds it


def check_export_target(run_dir: Path, out: Path, overwrite: bool) -> None:
    """Refuse (one-line UserError), before anything is loaded or written, an --out that is
    not ours to fill: a non-empty directory without --overwrite, and with --overwrite a
    directory that is not an earlier recursa export (no recursa_export.json), `.`, a parent
    of the working directory, the home directory, the run itself, a directory inside the
    run (its checkpoints) or one that holds the run."""
    from recursa.runio import refuse_deleting

    if out.is_symlink():
        raise UserError(f"--out {out} is a symbolic link: pass the real directory for the model")
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} is a file: pass a directory for the model")
    run, target = Path(run_dir).resolve(), out.resolve()
    if target == run or run in target.parents or target in run.parents:
        raise UserError(f"--out {out} is {'the run directory' if target == run else 'inside the run directory' if run in target.parents else 'a parent of the run directory'} {run_dir}: "
                        "export to a directory outside the run")
    if not out.exists() or not any(out.iterdir()):
        return
    if not overwrite:
        raise UserError(f"{out} exists and is not empty: choose another --out or pass --overwrite")
    refuse_deleting(out)
    if out.is_symlink() or not (out / MARKER).is_file():
        raise UserError(f"--overwrite {out}: it is not a model directory recursa exported (no {MARKER} in it); refusing to delete it: choose a new or empty --out")


def run_checkpoint(run_dir: Path, checkpoint: str = "last") -> Path:
    """The finished checkpoint `checkpoint` ('last' or a step number) of the run in `run_dir`;
    a one-line UserError when the run, its checkpoints or the asked step are missing."""
    from recursa.store import finished_checkpoints

    run_dir = Path(run_dir)
    if not (run_dir / "config.toml").exists():
        raise UserError(f"{run_dir}: no config.toml there; pass a run directory written by `recursa train`")
    done = finished_checkpoints(run_dir)
    if checkpoint == "last":
        if not done:
            raise UserError(f"{run_dir} has no finished checkpoint yet: let the run reach one (run.checkpoint_every) or resume it")
        return _readable(done[-1], done)
    if not str(checkpoint).isdigit():
        raise UserError(f"--checkpoint {checkpoint!r}: give 'last' or a step number, one of {[int(c.name[5:]) for c in done]}")
    want = run_dir / "checkpoints" / f"step_{int(checkpoint):06d}"
    if want not in done:
        raise UserError(f"no finished checkpoint {want.name} in {run_dir}; available steps: {[int(c.name[5:]) for c in done]}")
    return _readable(want, done)


def _readable(ckpt: Path, done: list[Path]) -> Path:
    """`ckpt` when its weights files read back whole; else a UserError naming the damage and
    the other checkpoints to choose from."""
    from recursa.store import _safetensors_problem

    for w in sorted(ckpt.glob("*.safetensors")):
        problem = _safetensors_problem(w)
        if problem:
            others = [int(c.name[5:]) for c in done if c != ckpt]
            raise UserError(f"checkpoint {ckpt} is corrupt ({w.name}: {problem}): pick another with --checkpoint (steps {others})")
    return ckpt


def run_base_dir(cfg) -> Path | None:
    """The warm start a LoRA run's adapters sit on (`init.from_run`), else None: a full-weight
    checkpoint replaces every weight, so its warm start is not needed to load it."""
    if cfg.model.lora is None or not cfg.init.from_run:
        return None
    from recursa.recipes.common import init_weights_dir

    return init_weights_dir(cfg)


def load_run_policy(run_dir: Path, checkpoint: str = "last", device: str = "cpu", interpolate: float | None = None):
    """(config, checkpoint dir, policy) of a run's checkpoint, loaded on `device`; with
    `interpolate` = alpha, the weights theta_0 + alpha (theta - theta_0) toward the run's
    warm start theta_0 (see the module doc), as a full-weight policy (LoRA merged)."""
    from recursa.config import load_config
    from recursa.models import load_policy

    if interpolate is not None:
        check_alpha(interpolate)  # before anything is loaded
    ckpt = run_checkpoint(run_dir, checkpoint)
    cfg = load_config(Path(run_dir) / "config.toml", check=False)
    model_cfg = cfg.model.model_copy(update={"device": device})
    policy = load_policy(model_cfg, weights_dir=ckpt, base_dir=run_base_dir(cfg))
    if interpolate is None:
        return cfg, ckpt, policy
    return cfg, ckpt, interpolated_policy(policy, warm_start_policy(cfg, device), interpolate)


def check_alpha(alpha: float) -> None:
    """A one-line UserError unless 0 <= alpha <= 1 (outside, the weights are extrapolated)."""
    if not (isinstance(alpha, (int, float)) and 0.0 <= alpha <= 1.0):
        raise UserError(f"--interpolate {alpha!r}: give a weight between 0 (the warm start) and 1 (the checkpoint)")


def warm_start_policy(cfg, device: str = "cpu"):
    """The weights a run started from: its `init.from_run` checkpoint (LoRA adapters of that
    run merged), else the base model's own; no LoRA of this run (its adapters start at zero)."""
    from recursa.models import load_policy
    from recursa.recipes.common import init_weights_dir

    model_cfg = cfg.model.model_copy(update={"device": device, "lora": None})
    return load_policy(model_cfg, base_dir=init_weights_dir(cfg))


def interpolate_weights(model: torch.nn.Module, start: torch.nn.Module, alpha: float) -> torch.nn.Module:
    """`model` moved in place to start + alpha (model - start), parameter by parameter and
    buffer by buffer (floating ones), computed in float32 as (1 - alpha) start + alpha model
    (so alpha = 0 and 1 give the endpoints exactly) and stored in the model's dtype.
    The two must have the same parameter names and shapes (the same architecture)."""
    mine = dict(model.named_parameters()) | {k: v for k, v in model.named_buffers() if v.is_floating_point()}
    theirs = dict(start.named_parameters()) | {k: v for k, v in start.named_buffers() if v.is_floating_point()}
    if mine.keys() != theirs.keys():
        missing = sorted(mine.keys() ^ theirs.keys())
        raise UserError(f"cannot interpolate: the run and its warm start have different weights ({missing[:3]} ...); they must be the same architecture")
    with torch.no_grad():
        for name, p in mine.items():
            q = theirs[name]
            if p.shape != q.shape:
                raise UserError(f"cannot interpolate: {name} has shape {tuple(p.shape)} in the run, {tuple(q.shape)} in its warm start")
            # (1 - alpha) theta_0 + alpha theta: exactly an endpoint at alpha = 0 or 1
            mixed = (1.0 - alpha) * q.detach().to(device=p.device, dtype=torch.float32) + alpha * p.detach().float()
            p.copy_(mixed.to(p.dtype))
    return model


def interpolated_policy(policy, start, alpha: float):
    """The run's `policy` (LoRA merged) interpolated toward `start` (a policy of the warm
    start, only read), as a full-weight Policy."""
    from recursa.models import Policy

    model = policy.model.merge_and_unload() if policy.is_lora else policy.model
    interpolate_weights(model, start.causal_lm, alpha)
    return Policy(model=model, tokenizer=policy.tokenizer, name=policy.name, is_lora=False)


def export_run(run_dir: Path, out: Path, checkpoint: str = "last", dtype: str = "auto", overwrite: bool = False,
               interpolate: float | None = None) -> Path:
    """Write the run's checkpoint to `out` as a standalone Hugging Face model directory
    (LoRA merged); `dtype` 'auto' keeps the run's `model.dtype`; `interpolate` = alpha
    writes theta_0 + alpha (theta - theta_0) toward the run's warm start instead."""
    import tempfile

    out = Path(out)
    if dtype not in DTYPES:
        raise UserError(f"--dtype {dtype!r}: choose one of {list(DTYPES)}")
    run_checkpoint(run_dir, checkpoint)  # a run with that checkpoint, before the target is judged
    check_export_target(run_dir, out, overwrite)
    cfg, ckpt, policy = load_run_policy(run_dir, checkpoint, interpolate=interpolate)
    model = policy.model.merge_and_unload() if policy.is_lora else policy.model
    if dtype != "auto":
        model = model.to(getattr(torch, dtype))
    model.config.use_cache = True
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))  # a fresh directory of ours: no other is ever removed
    os.chmod(tmp, 0o755)  # mkdtemp's 0o700 would make the export private
    try:
        _write_export(tmp, run_dir, cfg, ckpt, policy, model, interpolate)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if out.exists():
        check_export_target(run_dir, out, overwrite)  # again, just before the delete
        shutil.rmtree(out) if any(out.iterdir()) else out.rmdir()
    tmp.rename(out)
    return out


def _write_export(tmp: Path, run_dir: Path, cfg, ckpt: Path, policy, model, interpolate: float | None) -> None:
    model.save_pretrained(str(tmp), safe_serialization=True)
    policy.tokenizer.save_pretrained(str(tmp))
    _add_legacy_keys(tmp / "config.json")
    _chat_template_in_tokenizer_config(tmp / "tokenizer_config.json", policy.tokenizer.chat_template)
    (tmp / MARKER).write_text(json.dumps({
        "run": str(Path(run_dir).resolve()), "checkpoint": ckpt.name, "model": cfg.model.name,
        "lora_merged": cfg.model.lora is not None, "dtype": str(model.dtype).removeprefix("torch."),
        **({"interpolate": interpolate, "warm_start": cfg.init.from_run or cfg.model.name} if interpolate is not None else {}),
    }, indent=1) + "\n")


def _add_legacy_keys(path: Path) -> None:
    """Top-level `rope_theta` / `rope_scaling` and `torch_dtype` beside transformers 5's
    `rope_parameters` and `dtype`, for readers on transformers 4 (see the module doc)."""
    config = json.loads(path.read_text())
    rope = config.get("rope_parameters")
    if isinstance(rope, dict) and "rope_theta" in rope and "rope_theta" not in config:
        config["rope_theta"] = rope["rope_theta"]
        if rope.get("rope_type", "default") != "default" and "rope_scaling" not in config:
            config["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    if "dtype" in config and "torch_dtype" not in config:
        config["torch_dtype"] = config["dtype"]
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _chat_template_in_tokenizer_config(path: Path, template: str | None) -> None:
    """The chat template also inside tokenizer_config.json (older tokenizer readers look
    there; transformers 5 writes it to chat_template.jinja)."""
    if not template or not path.exists():
        return
    config = json.loads(path.read_text())
    config.setdefault("chat_template", template)
    path.write_text(json.dumps(config, indent=2) + "\n")
