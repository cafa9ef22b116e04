"""Trajectories and training batches.

A `Trajectory` is one episode as the trainer sees it: the exact token ids the model read
and wrote (never re-tokenized text), a mask of the policy's own action tokens, and the
sampler's log-probability of each action token. Single-turn tasks are the special case
of one prompt span followed by one action span; multi-turn episodes interleave them.

Per-token lists are aligned to `token_ids`: position t holds information about token t
(its log-probability given tokens < t). Position 0 is never an action.

Trajectories are plain Python (host) data; `collate` turns them into a `TrainBatch` on the
model's device, padding on the host and copying each tensor over once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Trajectory:
    env: str
    seed: int
    group: int  # index of the advantage group (same task seed) within the step
    token_ids: list[int]
    action_mask: list[int]  # 1 where the policy produced the token
    sample_logprobs: list[float]  # sampler log-prob of each action token, 0.0 elsewhere
    reward: float
    success: bool
    completion_text: str = ""
    prompt_text: str = ""
    finish_reason: str = ""
    info: dict = field(default_factory=dict)

    @property
    def num_action_tokens(self) -> int:
        return int(sum(self.action_mask))

    def __post_init__(self) -> None:
        n = len(self.token_ids)
        if len(self.action_mask) != n or len(self.sample_logprobs) != n:
            raise ValueError("token_ids, action_mask and sample_logprobs must have the same length")
        if n and self.action_mask[0]:
            raise ValueError("the first token cannot be an action (it has no context)")


@dataclass
class TrainBatch:
    """Right-padded tensors for the update; N sequences of length L."""

    input_ids: torch.Tensor  # (N, L) long
    attention_mask: torch.Tensor  # (N, L) long, 1 on real tokens
    action_mask: torch.Tensor  # (N, L) float, 1 on action tokens
    sample_logprobs: torch.Tensor  # (N, L) float, sampler log-probs on action tokens
    advantages: torch.Tensor  # (N,) float, per sequence, or (N, L) per token (RSIPO's token advantages)
    rewards: torch.Tensor  # (N,) float

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    @property
    def device(self) -> torch.device:
        return self.input_ids.device

    def to(self, device: torch.device | str) -> "TrainBatch":
        """The same batch on `device` (self when it is already there)."""
        if torch.device(device) == self.device:
            return self
        return TrainBatch(*(t.to(device) for t in (self.input_ids, self.attention_mask, self.action_mask, self.sample_logprobs, self.advantages, self.rewards)))

    def select(self, idx: torch.Tensor | list[int]) -> "TrainBatch":
        """Rows `idx`, trimmed to the longest selected sequence."""
        idx = torch.as_tensor(idx, dtype=torch.long, device=self.device)
        length = int(self.attention_mask[idx].sum(dim=1).max().item())
        return TrainBatch(
            input_ids=self.input_ids[idx, :length],
            attention_mask=self.attention_mask[idx, :length],
            action_mask=self.action_mask[idx, :length],
            sample_logprobs=self.sample_logprobs[idx, :length],
            advantages=self.advantages[idx, :length] if self.advantages.dim() == 2 else self.advantages[idx],
            rewards=self.rewards[idx],
        )


def collate(trajectories: list[Trajectory], advantages: torch.Tensor, pad_id: int, device: torch.device | str = "cpu") -> TrainBatch:
    """Stack trajectories into right-padded tensors on `device` (the policy's);
    `advantages  # (N,)` in the same order, on any device."""
    n = len(trajectories)
    length = max(len(t.token_ids) for t in trajectories)
    host = torch.device("cpu")  # padded row by row on the host, then copied over once per tensor
    input_ids = torch.full((n, length), pad_id, dtype=torch.long, device=host)
    attention = torch.zeros((n, length), dtype=torch.long, device=host)
    action = torch.zeros((n, length), dtype=torch.float32, device=host)
    logp = torch.zeros((n, length), dtype=torch.float32, device=host)
    for i, t in enumerate(trajectories):
        k = len(t.token_ids)
        input_ids[i, :k] = torch.tensor(t.token_ids, dtype=torch.long, device=host)
        attention[i, :k] = 1
        action[i, :k] = torch.tensor(t.action_mask, dtype=torch.float32, device=host)
        logp[i, :k] = torch.tensor(t.sample_logprobs, dtype=torch.float32, device=host)
    rewards = torch.tensor([t.reward for t in trajectories], dtype=torch.float32, device=host)
    return TrainBatch(
        input_ids.to(device), attention.to(device), action.to(device), logp.to(device),
        advantages.reshape(-1).to(device=device, dtype=torch.float32), rewards.to(device),
    )


@dataclass
class Turn:
    """One decision of a multi-turn episode: the exact prompt ids the policy read and the
    exact ids it sampled (never re-tokenized), with what the game made of them."""

    prompt_ids: list[int]
    action_ids: list[int]
    action_logprobs: list[float]
    reply: str  # decoded action tokens
    action: str  # what was sent to the game (parsed from the reply)
    observation: str  # the observation the policy acted on
    anchor: str  # state key for step-level grouping (GiGPO)
    reward: float
    invalid: bool
    admissible: list[str] | None = None  # the actions listed in the prompt (to render it again, e.g. with a skill)


@dataclass
class Episode:
    env: str
    seed: int
    group: int
    task: str
    turns: list[Turn]
    won: bool
    finish_reason: str  # "won" | "lost" | "max_steps" | "crashed" | "timeout" (the game failed: recursa.envs.supervise)
    # A branch continuation (rollout.branch, recursa/branching.py): its first `branch_turn` turns were
    # replayed from a source episode (token-less turns, no rows), the rest were sampled. None: an ordinary episode.
    branch_turn: int | None = None

    @property
    def total_reward(self) -> float:
        return float(sum(t.reward for t in self.turns))

    @property
    def invalid_rate(self) -> float:
        return sum(t.invalid for t in self.turns) / max(len(self.turns), 1)

    def rows(self) -> list[Trajectory]:
        """One training row per sampled turn: the turn's prompt ids followed by its action ids
        (a branch continuation's replayed turns, before `branch_turn`, make none)."""
        out = []
        for k, t in enumerate(self.turns):
            if k < (self.branch_turn or 0):
                continue
            out.append(
                Trajectory(
                    env=self.env,
                    seed=self.seed,
                    group=self.group,
                    token_ids=t.prompt_ids + t.action_ids,
                    action_mask=[0] * len(t.prompt_ids) + [1] * len(t.action_ids),
                    sample_logprobs=[0.0] * len(t.prompt_ids) + t.action_logprobs,
                    reward=self.total_reward,
                    success=self.won,
                    completion_text=t.reply,
                    prompt_text=t.observation,
                    finish_reason=self.finish_reason,
                    info={"turn": k, "action": t.action, "invalid": t.invalid},
                )
            )
        return out


@dataclass
class EpisodeRollout:
    """What a game rollout returns (`recursa.rollout.rollout_episodes`, the harness endpoint's `recursa.serve.harness_rollout`)."""

    episodes: list[Episode]  # grouped: group i holds indices [i*G, (i+1)*G)
    stats: object  # a recursa.generation.GenerationStats (not imported: this module stays free of the sampler)
    turns: int = 0  # batched generation calls
