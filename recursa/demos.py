"""Demonstrations for supervised fine-tuning: token rows whose targets are the reply tokens.

A demonstration is a `Trajectory` (the same row type the RL recipes train on) whose
`action_mask` marks the tokens to imitate; the prompt tokens are never targets. Sources:

* walkthrough -- multi-turn games: each training seed's oracle walkthrough, replayed in
  the game. One row per turn, rendered exactly as a rollout renders it (`render_turn`,
  then the chat template, with the same recent history), so that what is learned is
  what the policy will be asked. The target is the action's tokens followed by the
  end-of-turn token, which is where the sampler stops. A walkthrough that does not win
  is dropped and counted.
  With data.win_hints = f > 0, a share f of the won games (spread evenly over them) give
  their rows a second time with a hint after the task line: the walkthrough of the other
  demonstration game whose task line reads most alike (BM25; `recursa.agent.win_hint`, the
  form RSIPO's hatch.hint = 'win' re-rolls with). The hint is another game's plan, never
  the game's own, so the rows teach the policy to carry a similar game's procedure over,
  not to copy; a game with no alike other game (no shared word) gets no hinted copy.
  With agent.episode = 'chat' a game gives one row instead, its oracle chat (the env's
  oracle searches as tool calls with their real results, where it has them, then the
  walkthrough's actions with the observations between them, `recursa.chat.oracle_chat`),
  every reply a target: the tokens a chat episode with those replies holds.
  With data.walkthrough = 'search' the play demonstrated is the env's search_walkthrough()
  (household): it looks in one receptacle after another until it sees the object, so a
  turn's right action depends on what its observation shows, not only on the task line.
* reference -- single-turn tasks whose env offers `reference()`: the reference reply,
  kept only when the env scores it a success (some datasets' reference answers do not
  pass their own scorer) and counted otherwise.
* a dataset (data.source = 'parquet' or 'hf', or 'jsonl' with data.prompt_key; see
  recursa/envs/dataset.py) -- one row per training row: its prompt, then its answer column
  as the reply, kept when the dataset's scorer counts it a success (as for reference).
* jsonl -- chat transcripts, one JSON object per line: {"messages": [{"role", "content"},
  ...], "seed": optional int}. Every assistant message is a target (its tokens and its
  end-of-turn token); the configured system prompt is prepended when the transcript has
  none, as the rollout does.

Held-out items never become demonstrations: every seed used (the walkthrough and
reference sources draw from the train split; a transcript may name its seed) must lie in
the train split, or building stops with an error.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from recursa.agent import AgentConfig, render_turn, win_hint
from recursa.envs.base import Env, EnvPool, split_of, split_seeds, system_prompt_of
from recursa.errors import UserError
from recursa.rollout import is_agent_env, render_prompt
from recursa.skills.retrieval import BM25Index
from recursa.trajectory import Trajectory


@dataclass
class DemoSet:
    rows: list[Trajectory]
    source: str
    items: int = 0  # items (games, questions, transcripts) that gave demonstrations
    dropped: Counter = field(default_factory=Counter)  # reason -> items dropped
    hinted: int = 0  # items whose rows were added again with a hint (data.win_hints)

    @property
    def target_tokens(self) -> int:
        return sum(r.num_action_tokens for r in self.rows)

    def summary(self) -> str:
        why = ", ".join(f"{k}: {v}" for k, v in sorted(self.dropped.items())) or "none"
        hinted = f", {self.hinted} of them also with a hint" if self.hinted else ""
        return f"{len(self.rows)} rows from {self.items} items ({self.source}{hinted}), {self.target_tokens} target tokens; dropped: {why}"


def require_train_seeds(seeds: list[int], what: str) -> None:
    """Stop with an error if any seed lies outside the train split."""
    bad = [s for s in seeds if split_of(s) != "train"]
    if bad:
        raise UserError(
            f"{what}: seed {bad[0]} is in the {split_of(bad[0])} split ({len(bad)} such seeds); "
            "demonstrations may only come from training seeds, so held-out results stay honest"
        )


def _end_of_turn(tokenizer) -> int:
    if tokenizer.eos_token_id is None:
        raise UserError("the tokenizer has no end-of-turn (eos) token: demonstrations could not teach the model to stop")
    return int(tokenizer.eos_token_id)


def _row(env_name: str, seed: int, prompt: list[int], target: list[int], text: str, prompt_text: str, info: dict) -> Trajectory:
    return Trajectory(
        env=env_name,
        seed=seed,
        group=0,
        token_ids=prompt + target,
        action_mask=[0] * len(prompt) + [1] * len(target),
        sample_logprobs=[0.0] * (len(prompt) + len(target)),
        reward=1.0,
        success=True,
        completion_text=text,
        prompt_text=prompt_text,
        finish_reason="demo",
        info=info,
    )


@dataclass
class _Played:
    """One won walkthrough: its task line, actions, and what each turn was rendered from."""

    seed: int
    task: str
    actions: list[str]
    turns: list[tuple[str, list[str] | None, list[tuple[str, str]]]]  # (observation, admissible, history) per turn


def hinted_games(n: int, share: float) -> list[int]:
    """The indices of round(n x share) of n games, spread evenly: game i is chosen when
    floor((i + 1) x share) > floor(i x share) (share 0.5: games 1, 3, 5, ...; 1: all)."""
    return [i for i in range(n) if int((i + 1) * share + 1e-9) > int(i * share + 1e-9)]


def alike_game(tasks: list[str], i: int, index: BM25Index | None = None) -> int | None:
    """The index of the game other than i whose task line reads most like game i's (BM25
    over the task lines; among equal scores the first), None when none shares a word.
    `index`: BM25Index().build(tasks), when the caller asks for several games."""
    scores = (index or BM25Index().build(tasks)).scores(tasks[i])
    return max((j for j in range(len(tasks)) if j != i and scores[j] > 0), key=lambda j: (scores[j], -j), default=None)


def walkthrough_demos(envs: EnvPool | Env, seeds: list[int], tokenizer, system_prompt: str | None, agent: AgentConfig,
                      win_hints: float = 0.0, hint_chars: int = 600, search: bool = False) -> DemoSet:
    """One row per turn of each seed's winning walkthrough, and with win_hints > 0 a hinted
    copy of some games' rows (see the module docstring)."""
    require_train_seeds(seeds, "walkthrough demonstrations")
    env = envs if not isinstance(envs, EnvPool) else envs.take(1)[0]
    if not is_agent_env(env):
        raise UserError(f"{env.name} is a single-turn task: use data.source = 'reference' or 'jsonl'")
    if search and not callable(getattr(env, "search_walkthrough", None)):
        raise UserError(f"{env.name} has no searching walkthrough (search_walkthrough()): use data.walkthrough = 'shortest'")
    eot = _end_of_turn(tokenizer)
    system = system_prompt_of(env) or system_prompt
    out = DemoSet([], "walkthrough")
    games: list[_Played] = []

    def rows_of(game: _Played, hint: str | None) -> list[Trajectory]:
        rows = []
        for turn, ((obs, admissible, history), action) in enumerate(zip(game.turns, game.actions)):
            prompt = render_prompt(tokenizer, render_turn(game.task, obs, admissible, history, agent, hint=hint), system)
            target = tokenizer.encode(action, add_special_tokens=False) + [eot]
            info = {"turn": turn, "action": action} if hint is None else {"turn": turn, "action": action, "hint": hint}
            rows.append(_row(env.name, game.seed, prompt, target, action, obs, info))
        return rows

    for seed in seeds:
        obs = env.reset(seed)
        plan = env.search_walkthrough() if search else env.walkthrough()
        if not plan:
            out.dropped["no walkthrough"] += 1
            continue
        admissible = env.admissible_actions()
        history: list[tuple[str, str]] = []
        game, won = _Played(seed, env.task, [], []), False
        for action in plan:
            game.turns.append((obs, admissible, list(history)))
            game.actions.append(action)
            result = env.step(action)
            history.append((obs, action))
            obs, admissible = result.obs, result.info.get("admissible", admissible)
            if result.done:
                won = bool(result.info.get("won", result.info.get("success", False)))
                break
        if not won:
            out.dropped["walkthrough does not win"] += 1
            continue
        games.append(game)
        out.rows.extend(rows_of(game, None))
        out.items += 1
    if win_hints > 0:
        tasks = [g.task for g in games]
        index = BM25Index().build(tasks)
        for i in hinted_games(len(games), win_hints):
            j = alike_game(tasks, i, index)
            if j is None:
                out.dropped["no alike game to hint with (rows kept without a hint)"] += 1
                continue
            out.rows.extend(rows_of(games[i], win_hint(games[j].task, games[j].actions, hint_chars)))
            out.hinted += 1
    return out


def chat_walkthrough_demos(envs: EnvPool | Env, seeds: list[int], tokenizer, system_prompt: str | None, agent: AgentConfig) -> DemoSet:
    """Chat episodes (agent.episode = 'chat'): one row per seed, the oracle's chat
    (`recursa.chat.oracle_chat`: its tool calls where the env has `oracle_queries()`, then the
    walkthrough's actions with the observations between them) with every assistant message a
    target, kept when it wins. The row holds the tokens a chat episode with these replies holds."""
    from recursa.chat import oracle_chat

    require_train_seeds(seeds, "walkthrough demonstrations")
    env = envs if not isinstance(envs, EnvPool) else envs.take(1)[0]
    if not is_agent_env(env):
        raise UserError(f"{env.name} is a single-turn task: use data.source = 'reference' or 'jsonl'")
    out = DemoSet([], "walkthrough")
    for seed in seeds:
        messages, won = oracle_chat(env, seed, tokenizer, agent, system_prompt)
        if not won:
            out.dropped["walkthrough does not win" if any(m["role"] == "assistant" for m in messages) else "no walkthrough"] += 1
            continue
        out.rows.append(transcript_row(messages, tokenizer, None, seed, env.name))
        out.items += 1
    return out


def reference_demos(envs: EnvPool | Env, seeds: list[int], tokenizer, system_prompt: str | None) -> DemoSet:
    """One row per seed: the env's reference reply, kept when it scores a success."""
    require_train_seeds(seeds, "reference demonstrations")
    env = envs if not isinstance(envs, EnvPool) else envs.take(1)[0]
    if not callable(getattr(env, "reference", None)):
        raise UserError(f"{env.name} offers no reference answers: use data.source = 'jsonl' with your own transcripts")
    eot = _end_of_turn(tokenizer)
    out = DemoSet([], "reference")
    for seed in seeds:
        obs = env.reset(seed)
        reply = env.reference()
        if not reply:
            out.dropped["no reference"] += 1
            continue
        env.reset(seed)
        if not env.step(reply).info.get("success", False):
            out.dropped["reference does not score"] += 1
            continue
        prompt = render_prompt(tokenizer, obs, system_prompt_of(env) or system_prompt)
        target = tokenizer.encode(reply, add_special_tokens=False) + [eot]
        out.rows.append(_row(env.name, seed, prompt, target, reply, obs, {}))
        out.items += 1
    return out


def _template(tokenizer, messages: list[dict], generation_prompt: bool) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=True)
    if not isinstance(ids, list):
        ids = ids["input_ids"]
    return [int(i) for i in ids]


def transcript_row(messages: list[dict], tokenizer, system_prompt: str | None, seed: int = 0, name: str = "jsonl") -> Trajectory:
    """A chat transcript as one row; every assistant message (and its end-of-turn token)
    is a target. The chat template must render a conversation as the concatenation of its
    turns (true of ChatML and most templates); otherwise this raises."""
    if system_prompt and messages and messages[0].get("role") != "system":
        messages = [{"role": "system", "content": system_prompt}] + list(messages)
    eot = _end_of_turn(tokenizer)
    full = _template(tokenizer, messages, False)
    mask = [0] * len(full)
    for k, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = _template(tokenizer, messages[:k], True)
        upto = _template(tokenizer, messages[: k + 1], False)
        if full[: len(upto)] != upto or upto[: len(before)] != before:
            raise UserError("this model's chat template does not render a conversation turn by turn, so assistant tokens cannot be located")
        span = upto[len(before) :]
        end = span.index(eot) + 1 if eot in span else len(span)  # targets stop at the end-of-turn token
        for t in range(len(before), len(before) + end):
            mask[t] = 1
    if not any(mask):
        raise UserError("a transcript has no assistant message to learn from")
    reply = next(m["content"] for m in reversed(messages) if m["role"] == "assistant")
    return Trajectory(name, seed, 0, full, mask, [0.0] * len(full), 1.0, True, reply, "", "demo", {})


def jsonl_demos(path: str | Path, tokenizer, system_prompt: str | None) -> DemoSet:
    """Rows from a JSONL file of chat transcripts (see the module docstring)."""
    p = Path(path)
    if not p.exists():
        raise UserError(f"data.path = {str(p)!r} not found: point it at a JSONL file of {{\"messages\": [...]}} lines")
    out = DemoSet([], "jsonl")
    for lineno, line in enumerate(p.read_text().splitlines(), 1):
        if not line.strip():
            continue
        where = f"{p}:{lineno}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise UserError(f"{where}: not JSON ({exc.msg})") from None
        messages = record.get("messages") if isinstance(record, dict) else None
        if not isinstance(messages, list) or not all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in messages):
            raise UserError(f'{where}: expected {{"messages": [{{"role": ..., "content": ...}}, ...]}}')
        seed = record.get("seed", 0)
        if "seed" in record:
            if isinstance(seed, bool) or not isinstance(seed, int):
                raise UserError(f"{where}: seed must be an int, got {seed!r}")
            require_train_seeds([seed], where)
        try:
            out.rows.append(transcript_row(messages, tokenizer, system_prompt, seed))
        except UserError as exc:
            raise UserError(f"{where}: {exc}") from None
        out.items += 1
    if not out.rows:
        raise UserError(f"{p} holds no transcripts")
    return out


def build_demos(cfg, envs: EnvPool, tokenizer) -> DemoSet:
    """The demonstrations an SFT config asks for (`cfg.data`, `cfg.env`, `cfg.agent`)."""
    dc = cfg.data
    system_prompt = cfg.model.system_prompt or None
    source = dc.source
    env = envs.take(1)[0]
    if source == "auto":
        source = "walkthrough" if is_agent_env(env) else "reference"
    from recursa.envs.dataset import uses_dataset

    if uses_dataset(cfg):  # rows of a dataset: each training row's answer is its demonstration
        num_train = env.num_items("train")
        return reference_demos(envs, split_seeds("train", max(0, min(dc.n, num_train - dc.start)), dc.start), tokenizer, system_prompt)
    if source == "jsonl":
        return jsonl_demos(dc.path, tokenizer, system_prompt)
    if dc.win_hints > 0 and source != "walkthrough":
        raise UserError(f"data.win_hints hints with other games' walkthroughs, and {env.name} is a single-turn task: drop win_hints")
    if dc.walkthrough != "shortest" and source != "walkthrough":
        raise UserError(f"data.walkthrough = {dc.walkthrough!r} picks a game's demonstrated play, and {env.name} is a single-turn task: drop it")
    seeds = split_seeds("train", dc.n, dc.start)
    if source == "walkthrough" and cfg.agent.episode == "chat":
        if dc.win_hints > 0 or dc.walkthrough != "shortest":
            raise UserError("data.win_hints and data.walkthrough = 'search' write turn-mode rows; with agent.episode = 'chat' drop them")
        return chat_walkthrough_demos(envs, seeds, tokenizer, system_prompt, cfg.agent)
    if source == "walkthrough":
        return walkthrough_demos(envs, seeds, tokenizer, system_prompt, cfg.agent, dc.win_hints, dc.hint_chars, dc.walkthrough == "search")
    return reference_demos(envs, seeds, tokenizer, system_prompt)
