"""Rollouts: episodes in batches, token-in / token-out.

A rollout is a pure function of (policy weights, task seeds, sampling settings, random
generator) that returns trajectories; the trainer never reaches into it. For the
single-turn tasks of the core, an episode is: reset(seed) gives the user message, the
prompt is rendered once with the model's chat template and tokenized once, the policy
samples a completion, and step(completion_text) scores it. The trajectory keeps the
prompt ids and the sampled ids exactly as they were, never re-tokenized text.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from recursa.envs.base import Env, system_prompt_of
from recursa.generation import GenerationStats, SamplingParams, generate
from recursa.models import Policy
from recursa.trajectory import Trajectory


@dataclass
class RolloutResult:
    trajectories: list[Trajectory]  # grouped: group i holds indices [i*G, (i+1)*G)
    stats: GenerationStats


def render_prompt(tokenizer, observation: str, system_prompt: str | None) -> list[int]:
    """Chat-template the observation as one user turn and return its token ids."""
    messages = []
    if system_prompt:
        messages.append({"role": "system", "content": system_prompt})
    messages.append({"role": "user", "content": observation})
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if not isinstance(ids, list):  # BatchEncoding in newer transformers
        ids = ids["input_ids"]
    return [int(i) for i in ids]


def _completion_text(tokenizer, token_ids: list[int]) -> str:
    return tokenizer.decode(token_ids, skip_special_tokens=True)


def rollout(
    policy: Policy,
    make_env: Callable[[], Env],
    seeds: list[int],
    group_size: int,
    sampling: SamplingParams,
    generator: torch.Generator | None,
    system_prompt: str | None,
    batch_size: int | None = None,
) -> RolloutResult:
    """Run `group_size` single-turn episodes for each seed; prompts are generated in
    batches of `batch_size` distinct seeds (all at once by default). An env's own
    `system_prompt` takes precedence over the `system_prompt` argument."""
    tok = policy.tokenizer
    envs = [make_env() for _ in seeds]
    observations = [env.reset(seed) for env, seed in zip(envs, seeds)]
    prompts = [render_prompt(tok, obs, system_prompt_of(env) or system_prompt) for env, obs in zip(envs, observations)]
    stats = GenerationStats()
    step = batch_size or len(prompts)
    samples = []
    for start in range(0, len(prompts), step):
        chunk = generate(policy.causal_lm, tok, prompts[start : start + step], sampling, n=group_size, generator=generator, stats=stats)
        for s in chunk:
            s.prompt_index += start
        samples.extend(chunk)

    trajectories = []
    for s in samples:
        i = s.prompt_index
        env = envs[i]
        text = _completion_text(tok, s.token_ids)
        env.reset(seeds[i])  # single-turn: every sample of the group answers the same item
        result = env.step(text)
        prompt = prompts[i]
        trajectories.append(
            Trajectory(
                env=env.name,
                seed=seeds[i],
                group=i,
                token_ids=prompt + s.token_ids,
                action_mask=[0] * len(prompt) + [1] * len(s.token_ids),
                sample_logprobs=[0.0] * len(prompt) + s.logprobs,
                reward=float(result.reward),
                success=bool(result.info.get("success", result.reward >= 1.0)),
                completion_text=text,
                prompt_text=observations[i],
                finish_reason=s.finish_reason,
                info=result.info,
            )
        )
    return RolloutResult(trajectories, stats)
