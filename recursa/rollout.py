"""Rollouts: episodes in batches, token-in / token-out.

A rollout is a pure function of (policy weights, task seeds, sampling settings, random
generator) that returns trajectories; the trainer never reaches into it.

* `rollout` plays single-turn tasks: reset(seed) gives the user message, the prompt is
  rendered once with the model's chat template and tokenized once, the policy samples a
  completion, and step(completion_text) scores it.
* `rollout_episodes` plays multi-turn games (`AgentEnv`): all live episodes step
  together, one batched generation per turn, finished episodes drop out.

Either way the trajectory keeps the prompt ids and the sampled ids exactly as they were,
never re-tokenized text.

Both sample through a rollout engine (`recursa.engines`): `engine=None` is the native sampler
on the policy's own module, exactly as before engines existed; a recipe passes the engine it
built from `cfg.rollout` (e.g. vLLM), which must hold the policy's current weights.

Both take optional per-seed `hints` (RSIPO's `skills.in_context`: a retrieved skill shown
to the policy itself): a game's hint goes right after the task line (`render_turn`), a
single-turn task's after the question (`with_hint`), the same places as the self-teacher's
hint, so a teacher with that skill scores exactly the prompt the policy acted on. Without
hints (or with None for a seed) the prompt is exactly the one rendered without the option.

Random streams: `generator` is one generator for the whole rollout (what the recipes pass
by default), or a list of generators, one per seed (`generation.group_generators`; the
recipes' `sampling.streams = "group"`). With a list, seed i's group samples from its own
stream (for games, each of its G episodes from a stream drawn from it), so the result for a
group does not depend on which other seeds are in the same call: a step split into shards
of seeds (`recursa.distributed`) gives the unsplit call's sampled tokens, texts and rewards
(the sampler's log-probs to float rounding: a smaller batch is padded differently).

Branching (`rollout.branch`, `recursa.branching`): `rollout_episodes` takes optional per-seed
`prefixes`, lists of actions replayed right after reset, before anything is sampled. The
games are deterministic, so a replayed prefix puts every episode of that seed in the state the
source episode reached after those actions; the replayed turns are kept in the episode
(`Turn`s without tokens, so its return and transcript are the whole game's) and
`Episode.branch_turn` marks where the sampled turns begin. Without prefixes nothing changes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from recursa.agent import AgentConfig, parse_action, render_turn
from recursa.engines import NativeEngine, RolloutEngine
from recursa.envs.base import Env, EnvPool, as_pool, is_agent_env, system_prompt_of  # noqa: F401  (is_agent_env: re-exported)
from recursa.generation import GenerationStats, Generators, SamplingParams, group_generators
from recursa.models import Policy
from recursa.trajectory import Episode, EpisodeRollout, Trajectory, Turn  # noqa: F401  (EpisodeRollout re-exported: callers import it from here)


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


def with_hint(observation: str, hint: str | None) -> str:
    """A single-turn task's user message with `hint` after the question (unchanged without one)."""
    return f"{observation.rstrip()}\n\n{hint.strip()}" if hint else observation


def _hints_of(hints: list[str | None] | None, n: int) -> list[str | None]:
    if hints is None:
        return [None] * n
    if len(hints) != n:
        raise ValueError(f"expected one hint (or None) per seed: {len(hints)} hints for {n} seeds")
    return list(hints)


def _streams_of(generator: Generators, n: int) -> list[torch.Generator] | None:
    """The per-seed generators when `generator` is a list (checked against n seeds), else None."""
    if not isinstance(generator, (list, tuple)):
        return None
    if len(generator) != n:
        raise ValueError(f"expected one generator per seed: {len(generator)} generators for {n} seeds")
    return list(generator)


def _prefixes_of(prefixes: list[list[str]] | None, n: int) -> list[list[str]]:
    """The per-seed action prefixes (checked against n seeds); n empty ones when None."""
    if prefixes is None:
        return [[] for _ in range(n)]
    if len(prefixes) != n:
        raise ValueError(f"expected one action prefix per seed: {len(prefixes)} prefixes for {n} seeds")
    return [list(p) for p in prefixes]


def _completion_text(tokenizer, token_ids: list[int]) -> str:
    return tokenizer.decode(token_ids, skip_special_tokens=True)


def rollout(
    policy: Policy,
    envs: EnvPool | Callable[[], Env],
    seeds: list[int],
    group_size: int,
    sampling: SamplingParams,
    generator: Generators,
    system_prompt: str | None,
    batch_size: int | None = None,
    hints: list[str | None] | None = None,
    engine: RolloutEngine | None = None,
) -> RolloutResult:
    """Run `group_size` single-turn episodes for each seed; prompts are generated in
    batches of `batch_size` distinct seeds (all at once by default). An env's own
    `system_prompt` takes precedence over the `system_prompt` argument. `hints[i]`, when
    given, is shown after seed i's question (`with_hint`); `prompt_text` stays the question.
    `engine` samples (None: the native sampler on `policy`)."""
    tok = policy.tokenizer
    engine = engine or NativeEngine(policy)
    seed_hints = _hints_of(hints, len(seeds))
    streams = _streams_of(generator, len(seeds))
    episode_envs = as_pool(envs).take(len(seeds) * group_size)  # env i*G+k plays sample k of seed i
    episode_obs = [env.reset(seeds[j // group_size]) for j, env in enumerate(episode_envs)]
    observations = episode_obs[::group_size]  # one item per seed, the same for its whole group
    firsts = episode_envs[::group_size]
    prompts = [
        render_prompt(tok, with_hint(obs, h), system_prompt_of(env) or system_prompt) for env, obs, h in zip(firsts, observations, seed_hints)
    ]
    stats = GenerationStats()
    step = batch_size or len(prompts)
    samples = []
    for start in range(0, len(prompts), step):
        gen = generator if streams is None else streams[start : start + step]
        chunk = engine.generate(prompts[start : start + step], sampling, n=group_size, generator=gen, stats=stats)
        for s in chunk:
            s.prompt_index += start
        samples.extend(chunk)  # sample k of prompt i lands at i*G + k

    trajectories = []
    for env, s in zip(episode_envs, samples):
        i = s.prompt_index
        text = _completion_text(tok, s.token_ids)
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



def rollout_episodes(
    policy: Policy,
    envs: EnvPool | Callable[[], Env],
    seeds: list[int],
    group_size: int,
    sampling: SamplingParams,
    generator: Generators,
    system_prompt: str | None,
    agent: AgentConfig,
    hints: list[str | None] | None = None,
    engine: RolloutEngine | None = None,
    prefixes: list[list[str]] | None = None,
) -> EpisodeRollout:
    """Play `group_size` episodes of each seed's game, all live episodes stepping together.

    Each turn, every live episode's prompt is rendered (task, recent history, observation,
    admissible actions) and tokenized once, the policy samples one action per episode in
    a single batched call, and episodes that end drop out. Each `Turn` keeps the exact
    prompt ids and sampled ids, so the trainer scores what the policy saw and produced.
    `hints[i]`, when given, is shown after the task line of every turn of seed i's episodes.
    `engine` samples (None: the native sampler on `policy`).
    With one generator per seed, each of the seed's episodes samples from its own stream
    (G generators drawn from the seed's).
    `prefixes[i]`, when given, is a list of actions every episode of seed i plays right after
    reset (`_replay`, no sampling): its turns are recorded without tokens, sampling starts
    from the state they reach, and each episode's `branch_turn` is the prefix's length.
    An engine with `continuous` set (`rollout.continuous`) plays the episodes with continuous
    batching instead (`_continuous_episodes`): the same prompts, turns and episodes, scheduled
    per decode step, each episode always on its own stream.
    """
    tok = policy.tokenizer
    engine = engine or NativeEngine(policy)
    envs = as_pool(envs)
    if getattr(envs.take(1)[0], "harness", None) is not None:  # issue 48: a harness plays it through the OpenAI endpoint (recursa/serve.py)
        from recursa.serve import harness_rollout

        return harness_rollout(policy, envs, seeds, group_size, sampling, generator, system_prompt, agent, hints, engine, prefixes)
    if agent.episode == "chat":  # issue 48: one growing conversation per episode, token-exact across turns (recursa/chat.py)
        return _chat_episodes(policy, envs, seeds, group_size, sampling, generator, system_prompt, agent, hints, engine, prefixes)
    if getattr(engine, "continuous", False):
        return _continuous_episodes(policy, envs, seeds, group_size, sampling, generator, system_prompt, agent, hints, engine, prefixes=prefixes)
    n = len(seeds) * group_size
    streams = _streams_of(generator, len(seeds))
    episode_streams = None if streams is None else [e for g in streams for e in group_generators(g, group_size)]  # episode i*G+k
    episode_hints = [h for h in _hints_of(hints, len(seeds)) for _ in range(group_size)]
    envs = as_pool(envs).take(n)
    episode_seeds = [s for s in seeds for _ in range(group_size)]
    obs = [env.reset(seed) for env, seed in zip(envs, episode_seeds)]
    _no_tools(envs)  # issue 48: tools are offered in chat episodes only
    admissible = [env.admissible_actions() for env in envs]
    history: list[list[tuple[str, str]]] = [[] for _ in range(n)]
    turns: list[list[Turn]] = [[] for _ in range(n)]
    finish = [""] * n
    won = [False] * n
    stats = GenerationStats()
    calls = 0
    episode_prefixes = [p for p in _prefixes_of(prefixes, len(seeds)) for _ in range(group_size)]
    live = []
    for i in range(n):  # branching: replay each episode's action prefix (none without prefixes)
        obs[i], admissible[i], ended = _replay(envs[i], episode_prefixes[i], obs[i], admissible[i], history[i], turns[i])
        if ended is None:
            live.append(i)
        else:  # the game ended inside the prefix (only a game that is not deterministic does)
            won[i], finish[i] = _outcome(envs[i], ended.info)
    while live:
        prompts = [
            render_prompt(
                tok, render_turn(envs[i].task, obs[i], admissible[i], history[i], agent, hint=episode_hints[i]), system_prompt_of(envs[i]) or system_prompt
            )
            for i in live
        ]
        gen = generator if episode_streams is None else [episode_streams[i] for i in live]
        samples = engine.generate(prompts, sampling, n=1, generator=gen, stats=stats)
        calls += 1
        anchors = {i: (envs[i].state_key() if hasattr(envs[i], "state_key") else obs[i]) for i in live}
        still = []
        for i, prompt, s in zip(live, prompts, samples):
            turn, result = _take_turn(tok, envs[i], prompt, s, obs[i], admissible[i], anchors[i], agent)
            turns[i].append(turn)
            history[i].append((obs[i], turn.action))
            obs[i] = result.obs
            admissible[i] = result.info.get("admissible", admissible[i])
            if result.done:
                won[i], finish[i] = _outcome(envs[i], result.info)
            else:
                still.append(i)
        live = still
    episodes = [
        Episode(envs[i].name, episode_seeds[i], i // group_size, envs[i].task, turns[i], won[i], finish[i],
                branch_turn=None if prefixes is None else len(episode_prefixes[i]))
        for i in range(n)
    ]
    return EpisodeRollout(episodes, stats, calls)


def _chat_episodes(policy, envs, seeds, group_size, sampling, generator, system_prompt, agent, hints, engine, prefixes) -> EpisodeRollout:
    """`agent.episode = "chat"` (issue 48): the episodes as chats, `recursa.chat.chat_episodes`."""
    from recursa.chat import chat_episodes
    from recursa.errors import UserError

    if prefixes is not None:
        raise UserError("rollout.branch replays turn-mode prompts; it needs agent.episode = 'turn'")
    _streams_of(generator, len(seeds))  # checks a list of generators against the seeds
    pool = as_pool(envs).take(len(seeds) * group_size)
    episodes, stats, rounds = chat_episodes(policy.tokenizer, policy.causal_lm, pool, seeds, group_size, sampling, generator, system_prompt, agent,
                                            _hints_of(hints, len(seeds)), engine)
    return EpisodeRollout(episodes, stats, rounds)


def _no_tools(envs) -> None:
    """A one-line UserError when the game offers tools: the turn mode cannot show them (issue 48)."""
    if envs and getattr(envs[0], "tools", None):
        from recursa.errors import UserError

        raise UserError(f"env {envs[0].name!r} offers tools, which only chat episodes use: set agent.episode = 'chat'")


def _take_turn(tok, env, prompt: list[int], sample, obs: str, admissible, anchor, agent: AgentConfig):
    """Parse one sampled reply into an action, play it in `env`, and record the turn:
    (the Turn, the env's StepResult). Shared by the lock-step and the continuous loop."""
    reply = _completion_text(tok, sample.token_ids)
    parsed = parse_action(reply, admissible, agent)
    result = env.step(parsed.action)
    turn = Turn(
        prompt_ids=prompt,
        action_ids=list(sample.token_ids),
        action_logprobs=list(sample.logprobs),
        reply=reply,
        action=parsed.action,
        observation=obs,
        anchor=str(anchor),
        reward=float(result.reward),
        invalid=bool(result.info.get("invalid", False)),
        admissible=admissible,
    )
    return turn, result


def _replay(env, actions: list[str], obs: str, admissible, history: list, turns: list):
    """Play `actions` in `env` (just reset) without sampling, as `_take_turn` plays a parsed
    action: each becomes a token-less `Turn` in `turns` and an (observation, action) pair in
    `history`, so the prompts that follow are those the source episode saw. Returns (the
    observation, the admissible actions, the last StepResult if the game ended, else None)."""
    for action in actions:
        anchor = env.state_key() if hasattr(env, "state_key") else obs
        result = env.step(action)
        turns.append(Turn(prompt_ids=[], action_ids=[], action_logprobs=[], reply="", action=action, observation=obs, anchor=str(anchor),
                          reward=float(result.reward), invalid=bool(result.info.get("invalid", False)), admissible=admissible))
        history.append((obs, action))
        obs, admissible = result.obs, result.info.get("admissible", admissible)
        if result.done:
            return obs, admissible, result
    return obs, admissible, None


def _outcome(env, info: dict) -> tuple[bool, str]:
    """(won, finish reason) of an episode that just ended: won, the env's own failure reason
    (e.g. a supervised game's 'crashed' / 'timeout'), max_steps, or lost."""
    won = bool(info.get("won", info.get("success", False)))
    if won:
        return True, "won"
    return False, info.get("failure") or ("max_steps" if info.get("steps", 0) >= getattr(env, "max_steps", 1 << 30) else "lost")


def _continuous_episodes(
    policy: Policy,
    envs: EnvPool | Callable[[], Env],
    seeds: list[int],
    group_size: int,
    sampling: SamplingParams,
    generator: Generators,
    system_prompt: str | None,
    agent: AgentConfig,
    hints: list[str | None] | None,
    engine,
    times=None,
    prefixes: list[list[str]] | None = None,
) -> EpisodeRollout:
    """`rollout_episodes` with continuous batching (`engine.batcher`, see
    `recursa.engines.continuous`): every episode's first prompt is queued; whenever a reply is
    complete its episode steps its game at once and queues its next prompt ahead of the
    episodes still waiting, while the other rows keep decoding; a finished episode's row goes to
    the next waiting episode. Prompts, parsing, turns and episodes are those of the synchronous
    loop. Each episode samples from its own stream: G generators drawn from its seed's
    generator when `generator` is a list (as the synchronous loop), else the seeds' generators
    are first drawn from `generator` (`group_generators`, what `sampling.streams = "group"`
    does), so an episode's tokens are those of the synchronous loop under group streams, to
    float rounding of the logits. `times`: a `BatcherTimes` to add the batcher's seconds to.
    `prefixes`: per-seed actions replayed after reset, as in the synchronous loop."""
    tok = policy.tokenizer
    n = len(seeds) * group_size
    streams = _streams_of(generator, len(seeds))
    if streams is None and sampling.temperature > 0:
        streams = group_generators(generator, len(seeds))
    episode_streams = [None] * n if streams is None else [e for g in streams for e in group_generators(g, group_size)]  # episode i*G+k
    episode_hints = [h for h in _hints_of(hints, len(seeds)) for _ in range(group_size)]
    envs = as_pool(envs).take(n)
    episode_seeds = [s for s in seeds for _ in range(group_size)]
    obs = [env.reset(seed) for env, seed in zip(envs, episode_seeds)]
    _no_tools(envs)  # issue 48: tools are offered in chat episodes only
    admissible = [env.admissible_actions() for env in envs]
    history: list[list[tuple[str, str]]] = [[] for _ in range(n)]
    turns: list[list[Turn]] = [[] for _ in range(n)]
    prompts: list[list[int]] = [[] for _ in range(n)]
    finish = [""] * n
    won = [False] * n
    stats = GenerationStats()
    batcher = engine.batcher(sampling, stats, times)

    def prompt_of(i: int) -> list[int]:
        text = render_turn(envs[i].task, obs[i], admissible[i], history[i], agent, hint=episode_hints[i])
        return render_prompt(tok, text, system_prompt_of(envs[i]) or system_prompt)

    episode_prefixes = [p for p in _prefixes_of(prefixes, len(seeds)) for _ in range(group_size)]
    for i in range(n):
        obs[i], admissible[i], ended = _replay(envs[i], episode_prefixes[i], obs[i], admissible[i], history[i], turns[i])
        if ended is not None:  # the game ended inside the prefix (only a game that is not deterministic does)
            won[i], finish[i] = _outcome(envs[i], ended.info)
            continue
        prompts[i] = prompt_of(i)
        batcher.submit(i, prompts[i], episode_streams[i])
    while batcher.busy:
        for i, s in batcher.step():
            anchor = envs[i].state_key() if hasattr(envs[i], "state_key") else obs[i]
            turn, result = _take_turn(tok, envs[i], prompts[i], s, obs[i], admissible[i], anchor, agent)
            turns[i].append(turn)
            history[i].append((obs[i], turn.action))
            obs[i] = result.obs
            admissible[i] = result.info.get("admissible", admissible[i])
            if result.done:
                won[i], finish[i] = _outcome(envs[i], result.info)
            else:
                prompts[i] = prompt_of(i)
                batcher.submit(i, prompts[i], episode_streams[i], front=True)
    episodes = [
        Episode(envs[i].name, episode_seeds[i], i // group_size, envs[i].task, turns[i], won[i], finish[i],
                branch_turn=None if prefixes is None else len(episode_prefixes[i]))
        for i in range(n)
    ]
    return EpisodeRollout(episodes, stats, max((len(t) - len(p) for t, p in zip(turns, episode_prefixes)), default=0))
