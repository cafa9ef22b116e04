"""RSIPO's record of one attempt (a single-turn reply or a multi-turn episode): each turn's
context, the action taken and its reward, as the skill writer, the replay rewards, the teacher
and the hinted re-rolls read it.

`play` samples and scores an RSIPO step (the recipe's sampler); `ReplayMethod` ("replay") keeps
the replay buffer the other RSIPO methods read (replay.jsonl, restored on resume)."""

from __future__ import annotations

from collections import deque
from dataclasses import asdict, dataclass, field

import torch

from recursa.agent import AgentConfig, render_turn
from recursa.algorithms.advantages import compute_advantages
from recursa.algorithms.routing import group_routes
from recursa.config import RSIPOConfig
from recursa.envs import EnvPool
from recursa.generation import GenerationStats, SamplingParams, sequence_logprobs, shared_prefix_logprobs
from recursa.models import Policy
from recursa.distributed.rollouts import LocalRollouts, RolloutBackend
from recursa.recipes.common import check_finite
from recursa.rewards import RewardSet, score_episodes, score_trajectories
from recursa.recipes.grpo import episode_rows
from recursa.methods.base import Method
from recursa.rollout import with_hint
from recursa.trajectory import Trajectory

# ----------------------------------------------------------------------------- attempts and contexts



@dataclass
class Context:
    """What one turn's user message was rendered from, so it can be rendered again with a hint."""

    task: str | None  # a game's task line; None for single-turn tasks (the message is the observation)
    observation: str
    admissible: list[str] | None = None
    history: list[tuple[str, str]] = field(default_factory=list)  # the (observation, action) pairs shown
    hint: str | None = None  # the skill hint the policy itself was shown (skills.in_context), None otherwise


def user_message(ctx: Context, agent: AgentConfig, hint: str | None = None) -> str:
    """The turn's user message with `hint` after the task line (games) or after the question,
    and no other hint: `user_message(ctx, agent, ctx.hint)` is the message the policy acted
    on, `user_message(ctx, agent)` the bare one."""
    if ctx.task is None:
        return with_hint(ctx.observation, hint)
    return render_turn(ctx.task, ctx.observation, ctx.admissible, ctx.history, agent, hint=hint)


@dataclass
class Attempt:
    """One trajectory of a step (a completion or a whole episode), as the teacher, the skill
    writer and the replay buffer see it. Its rows are its turns, in order."""

    env: str
    seed: int
    step: int  # completed-step number of the step that played it (1 = the first)
    group: int
    success: bool
    task: str  # a game's task line, or the single-turn prompt
    contexts: list[Context]
    actions: list[list[int]]  # sampled token ids per turn
    texts: list[str]  # per turn: the action sent to the game, or the reply

    def to_json(self) -> dict:
        d = asdict(self)
        for c in d["contexts"]:  # no hint key without skills.in_context: replay.jsonl as before the option
            if c["hint"] is None:
                del c["hint"]
        return d

    @classmethod
    def from_json(cls, d: dict) -> "Attempt":
        contexts = [Context(c["task"], c["observation"], c["admissible"], [tuple(h) for h in c["history"]], c.get("hint")) for c in d["contexts"]]
        return cls(d["env"], d["seed"], d["step"], d["group"], d["success"], d["task"], contexts, d["actions"], d["texts"])


def episode_attempts(episodes, step: int, agent: AgentConfig, hints: list[str | None] | None = None) -> list[Attempt]:
    """One attempt per episode; `hints[g]`: the hint shown to group g's episodes (in_context)."""
    out = []
    for e in episodes:
        keep = agent.history_turns
        hint = hints[e.group] if hints is not None else None
        contexts = [
            Context(e.task, t.observation, t.admissible, [(u.observation, u.action) for u in e.turns[max(0, k - keep) : k]] if keep else [], hint)
            for k, t in enumerate(e.turns)
        ]
        out.append(Attempt(e.env, e.seed, step, e.group, e.won, e.task, contexts, [t.action_ids for t in e.turns], [t.action for t in e.turns]))
    return out


def failure_of(a: Attempt) -> tuple[str, str]:
    """A failed attempt as the prompt gate's proposals read it (as GRPO's): a game's task and
    last observation with its last three actions, or a single-turn prompt with its reply."""
    if a.contexts[-1].task is None:
        return a.task, a.texts[-1]
    return f"{a.task} {a.contexts[-1].observation}", " | ".join(a.texts[-3:])


def completion_attempts(trajs: list[Trajectory], step: int, hints: list[str | None] | None = None) -> list[Attempt]:
    """One attempt per completion; `hints[g]`: the hint shown to group g (in_context)."""
    out = []
    for t in trajs:
        first = t.action_mask.index(1)
        ctx = Context(None, t.prompt_text, hint=hints[t.group] if hints is not None else None)
        out.append(Attempt(t.env, t.seed, step, t.group, t.success, t.prompt_text, [ctx], [t.token_ids[first:]], [t.completion_text]))
    return out


# ----------------------------------------------------------------------------- scoring


@torch.no_grad()
def score_actions(policy: Policy, pairs: list[tuple[list[int], list[int]]], cfg: RSIPOConfig, topk: int = 0,
                  at_ids: list[torch.Tensor] | None = None):
    """log pi(a_t | prompt, a_<t) of every (prompt_ids, action_ids) pair under the current
    weights, no gradient: one (len(action_ids),) tensor per pair. Micro-batched, pairs with
    equal prompts side by side (so the shared-prefix path computes each prompt once). With
    `topk = k` also the k most likely tokens at each action position: (scores, tops), tops[i]
    = (ids, log-probs), each (len(action_ids), k). With `at_ids` (one (len(action_ids), k) long
    tensor per pair) instead the log-probs at those ids: (scores, tops) with tops[i] = (at_ids[i],
    their log-probs)."""
    model = policy.causal_lm
    was_training = model.training
    model.eval()
    logprobs = shared_prefix_logprobs if cfg.train.shared_prefix else sequence_logprobs
    pad = policy.tokenizer.pad_token_id
    device, host = policy.device, torch.device("cpu")
    order = sorted(range(len(pairs)), key=lambda i: pairs[i][0])
    out: list[torch.Tensor] = [torch.zeros(0, device=device)] * len(pairs)
    tops: list[tuple[torch.Tensor, torch.Tensor]] = [(torch.zeros((0, topk), dtype=torch.long, device=device), torch.zeros((0, topk), device=device))] * len(pairs)
    for lo in range(0, len(order), cfg.train.micro_batch_size):
        idx = order[lo : lo + cfg.train.micro_batch_size]
        width = max(len(pairs[i][0]) + len(pairs[i][1]) for i in idx)
        ids = torch.full((len(idx), width), pad, dtype=torch.long, device=host)  # padded on the host, moved once
        attn = torch.zeros((len(idx), width), dtype=torch.long, device=host)
        act = torch.zeros((len(idx), width), dtype=torch.float32, device=host)
        for j, i in enumerate(idx):
            p, a = pairs[i]
            ids[j, : len(p) + len(a)] = torch.tensor(p + a, dtype=torch.long, device=host)
            attn[j, : len(p) + len(a)] = 1
            act[j, len(p) : len(p) + len(a)] = 1
        ids, attn, act = ids.to(device), attn.to(device), act.to(device)
        at = None
        if at_ids is not None:  # (n, width, k): each pair's ids at its action positions
            at = torch.zeros((len(idx), width, at_ids[idx[0]].shape[-1]), dtype=torch.long, device=device)
            for j, i in enumerate(idx):
                at[j, len(pairs[i][0]) : len(pairs[i][0]) + len(pairs[i][1])] = at_ids[i].to(device)
        logp, _, *top = logprobs(model, ids, attn, act, cfg.sampling.temperature, cfg.train.logit_chunk, topk=topk, at_ids=at)  # (n, width) [, third value]
        for j, i in enumerate(idx):
            p, a = pairs[i]
            out[i] = logp[j, len(p) : len(p) + len(a)].clone()
            if topk:
                tops[i] = (top[0][0][j, len(p) : len(p) + len(a)].clone(), top[0][1][j, len(p) : len(p) + len(a)].clone())
            elif at is not None:
                tops[i] = (at_ids[i], top[0][j, len(p) : len(p) + len(a)].clone())
    if was_training:
        model.train()
    return (out, tops) if topk or at_ids is not None else out


@dataclass
class Played:
    """One step's rollout as every later phase reads it."""

    attempts: list[Attempt]  # B x G, grouped
    rows: list[Trajectory]  # the training rows: one per completion, or one per turn of a game
    row_adv: torch.Tensor  # (rows,) outcome advantage of each row (+ GiGPO's step term), host
    rewards: torch.Tensor  # (B, G) host
    advantages: torch.Tensor  # (B, G) outcome advantages, host
    success: torch.Tensor  # (B, G) bool, host
    row_attempt: list[int]  # (rows,) the attempt of each row
    row_context: list[Context]  # (rows,) what each row's user message was rendered from
    metrics: dict  # episode/* metrics (games)
    gen_stats: GenerationStats
    parts: dict = field(default_factory=dict)  # what each method made of the step for the later ones: "buffer", "skills", "hatch", "wins"

    # ---- what the shared step loop (recipes/loop.py) and GRPO's methods read of a step
    @property
    def trajs(self) -> list[Trajectory]:
        return self.rows

    @property
    def row_advantages(self) -> torch.Tensor:
        return self.row_adv

    @property
    def episodes(self) -> int:
        return len(self.attempts)

    @property
    def wins(self) -> list[list[bool]]:
        """(B, G): each group's verdicts, for the curriculum."""
        return self.success.tolist()

    @property
    def failures(self) -> list[tuple[str, str]]:
        """The failed attempts as the prompt gate's proposals read them."""
        return [failure_of(a) for a in self.attempts if not a.success]

    @property
    def routes(self) -> torch.Tensor:
        """(B,) each group's route: all_fail, mixed or all_win."""
        return group_routes(self.success)


def play(policy: Policy, pool: EnvPool, seeds: list[int], shown: list[str | None] | None, sampling: SamplingParams, gen: torch.Generator,
         system: str | None, cfg: RSIPOConfig, multi_turn: bool, step: int, rollouts: RolloutBackend | None = None,
         reward_set: RewardSet | None = None) -> Played:
    """B x G attempts of the step's tasks (`shown`: the in-context skill of each task, or None)
    and their outcome advantages, as GRPO computes them; `rollouts` plays them (None: this
    process, the native sampler); `reward_set`: the [[reward]] functions (None: the env's reward)."""
    rollouts = rollouts or LocalRollouts(policy, pool)
    B, G = cfg.train.prompts_per_step, cfg.train.group_size
    metrics = {}
    if multi_turn:
        ero = rollouts.episodes(seeds, G, sampling, gen, system, cfg.agent, hints=shown)
        gen_stats = ero.stats
        totals = [e.total_reward for e in ero.episodes]
        if reward_set is not None:
            scored = score_episodes(reward_set, ero.episodes)
            totals = scored.totals
            metrics.update(scored.metrics)
        rewards = torch.tensor(totals, dtype=torch.float32, device="cpu").view(B, G)  # (B, G)
        check_finite(step, rewards=rewards)  # an env's NaN reward is named, never trained on
        advantages = compute_advantages(cfg.algo.advantage, rewards)  # (B, G)
        rows, row_adv, episode_metrics = episode_rows(ero.episodes, advantages, cfg)  # one row per turn
        metrics.update(episode_metrics)
        attempts = episode_attempts(ero.episodes, step, cfg.agent, shown)
    else:
        ro = rollouts.rollout(seeds, G, sampling, gen, system, hints=shown)
        gen_stats = ro.stats
        rows = ro.trajectories
        if reward_set is not None:
            metrics.update(score_trajectories(reward_set, rows).metrics)
        rewards = torch.tensor([t.reward for t in rows], dtype=torch.float32, device="cpu").view(B, G)  # (B, G)
        check_finite(step, rewards=rewards)  # an env's NaN reward is named, never trained on
        advantages = compute_advantages(cfg.algo.advantage, rewards)  # (B, G)
        row_adv = advantages.view(-1)
        attempts = completion_attempts(rows, step, shown)
    row_attempt = [a for a, att in enumerate(attempts) for _ in att.contexts]
    row_context = [c for att in attempts for c in att.contexts]
    success = torch.tensor([a.success for a in attempts], device="cpu").view(B, G)  # (B, G)
    return Played(attempts, rows, row_adv, rewards, advantages, success, row_attempt, row_context, metrics, gen_stats)


# ----------------------------------------------------------------------------- hinted re-rolls (hatch)


class ReplayMethod(Method):
    """RSIPO's replay buffer: every step's attempts join it (and replay.jsonl, so a resumed run
    rebuilds it); the skills' replay rewards, the hinted re-rolls, the stored wins and the
    teacher read it as `played.parts["buffer"]`."""

    name = "replay"

    @classmethod
    def enabled(cls, cfg) -> bool:
        return hasattr(cfg, "skills")  # an RSIPO config

    def open(self) -> None:
        ctx = self.ctx
        self.buffer: deque[Attempt] = deque(maxlen=ctx.cfg.skills.buffer_size)
        self.before: list[Attempt] = []  # every attempt of the steps before a resume
        if ctx.run.state:
            self.before = [Attempt.from_json(r) for r in ctx.store.read_jsonl("replay")]
            self.buffer.extend(self.before)
            ctx.log(f"restored {len(self.buffer)} replayable attempts (step {ctx.start_step}/{ctx.cfg.train.steps})")

    def failures_before(self) -> list[tuple[str, str]]:
        """The failed attempts of the steps before a resume (what a resumed prompt gate reads first)."""
        return [failure_of(a) for a in self.before if not a.success]

    def after_sample(self, step: int, played) -> dict:
        self.buffer.extend(played.attempts)
        self.ctx.store.append_jsonl("replay", step + 1, [a.to_json() for a in played.attempts])
        played.parts["buffer"] = list(self.buffer)
        return {}

