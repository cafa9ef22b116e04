"""A*-PO's stage 1 (`algo.apo_values = "reference"`): V*(x) from a stored sample of the reference policy.

A*-PO (Brantley et al. 2025) first samples k responses per prompt from pi_ref offline and
estimates V*(x) = beta_1 log mean_j exp(r_j / beta_1) from their rewards; stage 2 regresses
beta_2 log(pi / pi_ref) onto r - V*(x) with the on-policy samples. Here stage 1 runs lazily:
the first time a training step meets a task seed, `ReferenceSample.values` samples
`algo.apo_reference_k` replies to that task's prompt from the frozen reference (the initial
weights, or the base model with LoRA adapters off: `Policy.reference_context`), scores them
with the run's reward (the env's, or the [[reward]] sum) and appends one JSON line

    {"seed": <task seed>, "k": <k>, "rewards": [r_1, ..., r_k]}

to `<run dir>/apo_reference.jsonl`, flushed and fsynced before the step trains. A resumed run
reads the file back and samples only the seeds it lacks, so nothing is sampled twice and a
killed run loses at most the line it was writing (a partial last line is dropped on open).
The lines carry no step: a resume's truncation of the logs after the checkpoint keeps them (a
sample of pi_ref is valid at any step), and `--overwrite` deletes the file with the run's own.

The sample of a task is a pure function of (train.seed, the task seed, pi_ref): each task's k
replies come from their own generator, seeded from those two, never from the step generator,
so the training samples and a resumed run's replay are those of a run with `apo_values =
"group"`'s random streams. Prompts are the bare task with the model's system prompt (no hints).
Single-turn tasks only; a multi-turn game is refused (a game's V* would need k reference
games per seed, not built).
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from typing import Callable, Sequence

import torch

from recursa.algorithms.objectives import reference_values
from recursa.errors import UserError
from recursa.generation import SamplingParams, generate, generators_from
from recursa.runio import append_line

FILE = "apo_reference.jsonl"


class ReferenceEngine:
    """A rollout engine that samples with the frozen reference policy, never the trainer's weights."""

    name = "reference"

    def __init__(self, policy):
        self.policy = policy

    def generate(self, prompts, params, n=1, generator=None, stats=None):
        with self.policy.reference_context() as ref:
            return generate(ref, self.policy.tokenizer, prompts, params, n=n, generator=generator, stats=stats)

    def load_weights(self, policy) -> None:
        pass  # the reference never changes

    def close(self) -> None:
        pass


def task_stream_seed(train_seed: int, task_seed: int) -> int:
    """The 63-bit seed of a task's stage-1 generator: a hash of (train.seed, task seed)."""
    digest = hashlib.sha256(f"apo-reference:{int(train_seed)}:{int(task_seed)}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def read_sample(path: Path, k: int | None = None) -> dict[int, list[float]]:
    """The stored sample, task seed -> rewards. A last line without its newline (a write cut off
    by a kill) is dropped from the file. `k`: refuse a file sampled with another k."""
    if not path.exists():
        return {}
    data = path.read_bytes()
    end = data.rfind(b"\n") + 1
    if end < len(data):  # the partial line of a killed write
        with open(path, "r+b") as f:
            f.truncate(end)
    out: dict[int, list[float]] = {}
    for n, line in enumerate(data[:end].splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            seed, rewards = int(row["seed"]), [float(r) for r in row["rewards"]]
        except (ValueError, KeyError, TypeError) as e:
            raise UserError(f"{path}:{n}: not a stage-1 line {{\"seed\", \"k\", \"rewards\"}} ({e}): delete the file to resample") from None
        if k is not None and len(rewards) != k:
            raise UserError(f"{path} holds {len(rewards)} reference samples of task {seed}, algo.apo_reference_k = {k}: "
                            f"set algo.apo_reference_k = {len(rewards)}, or delete the file to resample")
        out[seed] = rewards
    return out


class ReferenceSample:
    """Stage 1, sampled lazily per new task seed and cached in `path` (see the module docstring)."""

    def __init__(self, path: Path, policy, pool, k: int, sampling: SamplingParams, system_prompt: str | None,
                 reward_set=None, train_seed: int = 0, log: Callable[[str], None] = print):
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        self.path, self.policy, self.pool, self.k = Path(path), policy, pool, k
        self.sampling, self.system_prompt, self.reward_set, self.train_seed, self.log = sampling, system_prompt, reward_set, train_seed, log
        self.rewards = read_sample(self.path, k)
        self.sampled = 0  # tasks sampled by this process (the rest were read back)

    def values(self, seeds: Sequence[int], beta: float) -> torch.Tensor:
        """V*(x) of each task seed (B,), float64, sampling the seeds the file lacks first."""
        missing = list(dict.fromkeys(int(s) for s in seeds if int(s) not in self.rewards))
        if missing:
            self.sample(missing)
        return reference_values(self.rewards, [int(s) for s in seeds], beta)

    def sample(self, seeds: list[int]) -> None:
        """k replies of pi_ref to each task, scored, appended to the file (one line per task)."""
        from recursa.rewards import score_trajectories
        from recursa.rollout import rollout

        gens = generators_from([task_stream_seed(self.train_seed, s) for s in seeds])
        trajs = rollout(self.policy, self.pool, seeds, self.k, self.sampling, gens, self.system_prompt,
                        engine=ReferenceEngine(self.policy)).trajectories
        if self.reward_set is not None:
            score_trajectories(self.reward_set, trajs)
        lines = []
        for i, seed in enumerate(seeds):
            rewards = [float(t.reward) for t in trajs[i * self.k : (i + 1) * self.k]]
            if not all(math.isfinite(r) for r in rewards):
                raise ValueError(f"task {seed}: a reference sample's reward is not finite ({rewards}); not stored")
            lines.append(json.dumps({"seed": seed, "k": self.k, "rewards": rewards}) + "\n")
            self.rewards[seed] = rewards
        self.path.parent.mkdir(parents=True, exist_ok=True)
        append_line(self.path, "".join(lines), point="apo_reference")  # one synced write (RECURSA_FAULT_AT=apo_reference.torn tears it)
        self.sampled += len(seeds)


def open_reference_sample(cfg, out: Path, run, reward_set, system_prompt: str | None,
                          log: Callable[[str], None] = print) -> ReferenceSample | None:
    """The run's stage-1 sample when `algo.apo_values = "reference"`, else None; it samples with the
    run's sampling settings. A multi-turn game is refused with a one-line error (the run's store
    and envs are closed first)."""
    algo = getattr(cfg, "algo", None)
    if getattr(algo, "apo_values", "group") != "reference":
        return None
    if run.multi_turn:
        run.store.close()
        run.pool.close()
        raise UserError("algo.apo_values = 'reference' samples single-turn replies of the reference policy; this task is a multi-turn game: "
                        "set algo.apo_values = 'group'")
    sc = cfg.sampling
    sampling = SamplingParams(sc.max_new_tokens, sc.temperature, sc.top_p, tuple(sc.stop))
    sample = ReferenceSample(Path(out) / FILE, run.policy, run.pool, algo.apo_reference_k, sampling, system_prompt, reward_set, cfg.train.seed, log)
    if sample.rewards:
        log(f"apo: {len(sample.rewards)} tasks' reference samples read back from {sample.path.name}")
    return sample
