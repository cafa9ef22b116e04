"""The FSDP2 learner's sharded checkpoint (`torch.distributed.checkpoint`, DCP), issue 47.

With `learner.backend = "fsdp"` every checkpoint directory also holds `dcp/`: the training copy's
parameters and its sharded AdamW state, as `get_state_dict` names them (the Hugging Face parameter
names; `model.*` and `optim.*` keys), one `__R_0.distcp` file written by each rank R and a
`.metadata` file that says which bytes of which file hold which slice of which tensor:

    step_000010/
      model.safetensors, optimizer.pt, ...   rank 0's gathered state, as for every backend
      dcp/.metadata, dcp/__0_0.distcp, dcp/__1_0.distcp, ...

The shards are written into the checkpoint's temporary directory before it is renamed
(`recursa.store.write_weights`), so they appear with the rest of the checkpoint or not at all.
A resume loads each rank's shard back into its training copy (`load_sharded`); `recursa export`
consolidates them into one plain model in one process (`load_into_plain`).

DCP's `.metadata` is a pickle, and PyTorch's reader unpickles it with no restriction. A run
directory is data (docs/reliability.md), so before any DCP call reads a checkpoint,
`shards_problem` unpickles the metadata itself with an allow-list of the few classes DCP
writes (anything else is refused) and checks that every byte range it names exists on disk:
a missing or truncated shard is found before a collective starts, and named in one line.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import torch

from recursa.errors import UserError

DCP_DIR = "dcp"  # the shards' folder inside a checkpoint directory
METADATA = ".metadata"

# (module, name) pairs DCP's metadata pickle may name; everything else is refused unread
_ALLOWED = {
    ("torch.distributed.checkpoint.metadata", n) for n in (
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata", "ChunkStorageMetadata",
        "BytesStorageMetadata", "_MEM_FORMAT_ENCODING")
} | {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"), ("torch.serialization", "_get_layout"),
     ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PurePosixPath"), ("collections", "OrderedDict")}


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's metadata, resolving only the allow-listed classes and torch's dtypes."""

    def find_class(self, module: str, name: str):
        if (module, name) in _ALLOWED or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not something DCP's metadata holds")


def has_shards(ckpt: Path) -> bool:
    """Whether the checkpoint directory `ckpt` carries the FSDP2 learner's DCP shards."""
    return (Path(ckpt) / DCP_DIR).exists()


def read_metadata(directory: Path):
    """DCP's Metadata of the shards in `directory`, unpickled with the allow-list (module doc);
    a one-line UserError when it is missing, unreadable or names anything else."""
    path = Path(directory) / METADATA
    try:
        with open(path, "rb") as f:
            meta = _MetadataUnpickler(f).load()
    except FileNotFoundError:
        raise UserError(f"{path} is missing: the sharded checkpoint is incomplete") from None
    except (pickle.UnpicklingError, EOFError, OSError, ValueError, TypeError, AttributeError, IndexError) as exc:
        raise UserError(f"{path} is not DCP metadata recursa wrote ({type(exc).__name__}: {exc}); refusing to read the shards") from None
    if type(meta).__name__ != "Metadata" or not isinstance(getattr(meta, "storage_data", None), dict):
        raise UserError(f"{path} is not DCP metadata recursa wrote (no storage table)")
    return meta


def shards_problem(directory: Path) -> str | None:
    """Why the shards in `directory` cannot be read back (unreadable metadata, a shard file
    missing or shorter than the bytes the metadata places in it), or None."""
    directory = Path(directory)
    try:
        meta = read_metadata(directory)
    except UserError as exc:
        return str(exc)
    ends: dict[str, int] = {}
    for info in meta.storage_data.values():
        name = str(getattr(info, "relative_path", ""))
        if not name or "/" in name or name.startswith("."):
            return f"{directory / METADATA} names a shard file {name!r} outside its folder"
        ends[name] = max(ends.get(name, 0), int(info.offset) + int(info.length))
    for name, end in sorted(ends.items()):
        f = directory / name
        if not f.is_file():
            return f"shard {f} is missing"
        if f.stat().st_size < end:
            return f"shard {f} is truncated ({f.stat().st_size} of {end} bytes)"
    return None


def check_shards(directory: Path) -> None:
    """`shards_problem` as a one-line UserError (resume from an earlier checkpoint, or start again)."""
    problem = shards_problem(directory)
    if problem is not None:
        raise UserError(f"{problem}: the checkpoint {Path(directory).parent.name} is corrupt; pick another checkpoint")


def save_sharded(directory: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Every rank, collectively: write its shard of `model` (fully_shard-ed) and `optimizer` to
    `directory` (rank 0 also writes the metadata). Each rank's file is synced by DCP's writer."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(directory))


def load_sharded(directory: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
    """Every rank, collectively: read its own shard of the model (and of AdamW's state, unless
    `optimizer` is None) from `directory` into `model` / `optimizer`. Every rank checks the
    files first, so a damaged checkpoint stops every rank with the same one line."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict, set_model_state_dict, set_state_dict

    check_shards(directory)
    if optimizer is None:
        state = {"model": get_model_state_dict(model)}
        dcp.load(state, checkpoint_id=str(directory))
        set_model_state_dict(model, state["model"])
        return
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=str(directory))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])


def load_into_plain(directory: Path, model: torch.nn.Module) -> None:
    """One process, no process group: consolidate the shards' model weights into the plain
    (unsharded) `model` in place, e.g. for `recursa export`. AdamW's shards are not read."""
    import torch.distributed.checkpoint as dcp

    check_shards(directory)
    state = {"model": model.state_dict()}
    dcp.load(state, checkpoint_id=str(directory))
    missing, unexpected = model.load_state_dict(state["model"], strict=False)
    if missing or unexpected:
        raise UserError(f"{directory} does not hold this model's weights (missing {missing[:3]}, unexpected {unexpected[:3]}): same model.name as the run?")
