"""iGRPO's draft stage as a plug-in (`algo.igrpo`): before the step's rollout, each task is
drafted `algo.igrpo_drafts` times; the drafts are scored and never trained on, and the best
draft of each task is shown in the prompt of the rollout the update trains on."""

from __future__ import annotations

import torch

from recursa.methods.base import Method
from recursa.recipes.common import check_finite
from recursa.rewards import RewardSet, score_episodes, score_trajectories


def draft_hint(draft: str, reward: float, max_chars: int) -> str:
    """iGRPO's framing of the best draft, shown after the task (a single-turn question, or a
    game's task line): the draft clipped to `max_chars` characters, and its reward."""
    text = " ".join(draft.split()) or "(empty)"
    if len(text) > max_chars:
        text = text[: max_chars - 3].rstrip() + "..."
    return f"Your best earlier attempt (reward {reward:.2f}): {text}\nImprove on it."


def draft_hints(rollouts, seeds: list[int], cfg, sampling, gen: torch.Generator, system_prompt: str | None,
                multi_turn: bool, reward_set: RewardSet | None, step: int) -> tuple[list[str], dict]:
    """iGRPO's first stage: `algo.igrpo_drafts` drafts per task, scored by the training reward
    (the env's, or the [[reward]] sum) and never trained on; the highest-rewarded draft of each
    task (the first of ties) becomes its hint (`draft_hint`: a completion, or a game's actions
    joined by ' > '). Returns the B hints and the igrpo/* metrics."""
    D = cfg.algo.igrpo_drafts
    if multi_turn:
        episodes = rollouts.episodes(seeds, D, sampling, gen, system_prompt, cfg.agent).episodes
        texts = [" > ".join(t.action for t in e.turns) for e in episodes]
        totals = score_episodes(reward_set, episodes).totals if reward_set is not None else [e.total_reward for e in episodes]
        won = [e.won for e in episodes]
    else:
        drafts = rollouts.rollout(seeds, D, sampling, gen, system_prompt).trajectories
        if reward_set is not None:
            score_trajectories(reward_set, drafts)
        texts, totals, won = [t.completion_text for t in drafts], [t.reward for t in drafts], [t.success for t in drafts]
    rewards = torch.tensor(totals, dtype=torch.float64, device="cpu").view(len(seeds), D)  # (B, D), float64 so rewards that differ below float32 resolution do not tie (issue 50)
    check_finite(step + 1, draft_rewards=rewards)
    best = rewards.argmax(dim=1).tolist()  # the first maximum of each row
    hints = [draft_hint(texts[b * D + k], float(rewards[b, k]), cfg.algo.igrpo_draft_chars) for b, k in enumerate(best)]
    metrics = {
        "igrpo/draft_reward_mean": rewards.mean().item(),
        "igrpo/best_draft_reward_mean": rewards.amax(dim=1).mean().item(),
        "igrpo/draft_success_rate": sum(won) / len(won),
    }
    return hints, metrics




class IGRPODrafts(Method):
    name = "igrpo"

    @classmethod
    def enabled(cls, cfg) -> bool:
        return bool(cfg.algo.igrpo)

    @classmethod
    def extra_episodes(cls, cfg) -> int:
        return cfg.train.prompts_per_step * cfg.algo.igrpo_drafts

    def hints(self, step, seeds, hints, sampling, generator, system_prompt):
        ctx = self.ctx  # iGRPO's first stage: the best of each task's drafts goes into its prompt
        return draft_hints(ctx.rollouts, seeds, ctx.cfg, sampling, generator, system_prompt, ctx.multi_turn, ctx.reward_set, step)
