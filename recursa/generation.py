"""Batched sampling with a KV cache, and the trainer's log-probabilities.

`generate` takes tokenized prompts (token-in) and returns the sampled token ids with the
sampler's log-probabilities (token-out), so the trainer scores exactly what was sampled.

How it does less work than a generic `model.generate`:

* each distinct prompt is prefilled once; its KV cache is then repeated for the
  `n` samples of the group (the G samples of GRPO share the whole prompt);
* the vocabulary projection runs only at the last position of each step;
* sequences that finish (EOS or a stop string) leave the batch: their rows are dropped
  from the cache, so later steps compute only live sequences.

Prompts are left-padded; position ids count real tokens only, so a padded prompt sees
the same positions as an unpadded one.

Log-probabilities are those of the temperature-scaled policy, log softmax(z / T), over
the full vocabulary (top-p truncation is a sampling device, not part of the policy); the
trainer divides logits by the same T, as verl does. Greedy decoding (T = 0) reports
log softmax(z).

Devices: every tensor the model reads is made on the model's device (prompts are padded on
the host and moved in one copy). The caller's generator (a recipe's seeded step generator)
lives on the CPU; on the CPU the sampling uniforms come from it directly, on a GPU from a
generator on the GPU seeded by one draw of it (`uniform_source`), so a GPU run is as seeded
as a CPU run and the (N, V) uniforms never cross the bus. The two devices draw different
streams: runs reproduce on the same device, not across devices.

Random streams: `generator` is one generator for the whole call (each decode step draws
(N, V) uniforms for every sample of the call), or a list of generators, one per prompt
(`group_generators`): prompt i's n samples then draw (n, V) uniforms from generator i at
each step while any of them is still running, so what a group samples depends only on its
own stream, not on which other prompts share the call. That is what lets a step's groups
be split across processes (`recursa.distributed`) and still draw the same numbers.
"""

from __future__ import annotations

import inspect
import itertools
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 16
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    stop: tuple[str, ...] = ()


@dataclass
class Sample:
    prompt_index: int
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "eos" | "stop" | "length"


@dataclass
class GenerationStats:
    prefill_tokens: int = 0
    decode_tokens: int = 0  # token positions run through the model while decoding
    generated_tokens: int = 0
    prefix_reused_tokens: int = 0  # prompt tokens whose keys/values were reused, not computed (continuous batching's prefix cache)


def _cache_kwarg(module: torch.nn.Module) -> str:
    params = inspect.signature(module.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _new_cache(config):
    from transformers import DynamicCache

    try:
        return DynamicCache(config=config)
    except TypeError:  # older transformers
        return DynamicCache()


def model_device(module: torch.nn.Module) -> torch.device:
    """The device of a module's weights."""
    return next(module.parameters()).device


def left_pad(prompts: list[list[int]], pad_id: int, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask), both (B, P), padded on the left, on `device` (built on the
    host, then moved in one copy)."""
    length = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), length), pad_id, dtype=torch.long, device="cpu")
    mask = torch.zeros((len(prompts), length), dtype=torch.long, device="cpu")
    for i, p in enumerate(prompts):
        ids[i, length - len(p) :] = torch.tensor(p, dtype=torch.long, device="cpu")
        mask[i, length - len(p) :] = 1
    return ids.to(device), mask.to(device)


def uniform_source(generator: torch.Generator | None, device: torch.device):
    """shape -> uniforms in [0, 1) on `device`, drawn from `generator` when it lives there (or
    from torch's default generator of `device` when None), else from a generator on `device`
    seeded by one 63-bit draw of `generator`: seeded either way, and never a host-to-device
    copy of the draws."""
    source = generator
    if generator is not None and generator.device != device:
        seed = int(torch.randint(0, 2**63 - 1, (1,), generator=generator, device=generator.device))
        source = torch.Generator(device=device).manual_seed(seed)
    return lambda shape: torch.rand(shape, generator=source, device=device)


def group_seeds(generator: torch.Generator | None, n: int) -> list[int]:
    """n 63-bit seeds drawn from `generator` (a CPU generator, e.g. a recipe's step generator;
    torch's default CPU generator when None): one random stream per task group of a step."""
    return [int(s) for s in torch.randint(0, 2**63 - 1, (n,), generator=generator, device="cpu").tolist()]


def generators_from(seeds: Sequence[int]) -> list[torch.Generator]:
    """One CPU generator per seed (what `group_seeds` drew; picklable ints cross processes)."""
    return [torch.Generator(device="cpu").manual_seed(int(s)) for s in seeds]


def group_generators(generator: torch.Generator | None, n: int) -> list[torch.Generator]:
    """n independent generators seeded by n draws of `generator`: per-group streams."""
    return generators_from(group_seeds(generator, n))


Generators = torch.Generator | Sequence[torch.Generator] | None  # one stream for the call, one per prompt, or torch's default


def _prompt_uniforms(draws: list, live: list[int], n: int, vocab: int) -> torch.Tensor:
    """(len(live), V) uniforms for the live rows (sorted sample indices, sample k of prompt
    i = i * n + k): every prompt with a live row draws (n, V) from its own stream, and the
    rows of its live samples are kept."""
    pieces = []
    for p, rows in itertools.groupby(live, key=lambda i: i // n):
        u = draws[p]((n, vocab))  # (n, V)
        keep = [i - p * n for i in rows]
        pieces.append(u if len(keep) == n else u[torch.tensor(keep, dtype=torch.long, device=u.device)])
    return torch.cat(pieces)


def _sample_next(logits: torch.Tensor, params: SamplingParams, uniforms: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits (N, V), uniforms (N, V) in [0, 1) -> (token (N,), logprob (N,)).

    Sampling is the Gumbel-max trick on the (top-p truncated) distribution, driven by
    uniforms drawn for every sample of the batch at every step, so what one sample draws
    never depends on which other samples are still running.
    """
    logp = F.log_softmax(logits.float() / (params.temperature or 1.0), dim=-1)
    if params.temperature == 0:
        token = logp.argmax(dim=-1)
        return token, logp.gather(-1, token[:, None]).squeeze(-1)
    scores = logp
    if params.top_p < 1.0:
        sorted_logp, order = logp.sort(dim=-1, descending=True)
        sorted_p = sorted_logp.exp()
        drop_sorted = sorted_p.cumsum(-1) - sorted_p >= params.top_p  # never drops the top token
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        scores = logp.masked_fill(drop, float("-inf"))
    gumbel = -torch.log(-torch.log(uniforms.clamp_min(1e-20)))
    token = (scores + gumbel).argmax(dim=-1)
    return token, logp.gather(-1, token[:, None]).squeeze(-1)


@torch.no_grad()
def check_context(causal_lm: torch.nn.Module, prompt_len: int, max_new_tokens: int) -> None:
    """A prompt that with its completion cap does not fit the model's positions
    (`config.max_position_embeddings`, e.g. `model.tiny.max_positions`) is a one-line error,
    not a silent run past the positions the model was built for."""
    limit = getattr(getattr(causal_lm, "config", None), "max_position_embeddings", None)
    if isinstance(limit, int) and prompt_len + max_new_tokens > limit:
        from recursa.errors import UserError

        raise UserError(f"a prompt of {prompt_len} tokens plus sampling.max_new_tokens = {max_new_tokens} passes the model's {limit} positions "
                        "(max_position_embeddings; model.tiny.max_positions for the tiny model): shorten the prompt (agent.history_turns, "
                        "agent.max_obs_chars) or lower sampling.max_new_tokens")


def generate(
    causal_lm: torch.nn.Module,
    tokenizer,
    prompts: list[list[int]],
    params: SamplingParams,
    n: int = 1,
    generator: Generators = None,
    stats: GenerationStats | None = None,
) -> list[Sample]:
    """Sample `n` completions for each prompt; returns len(prompts) * n samples, grouped
    by prompt (sample k of prompt i is at index i * n + k). `generator`: one stream for the
    call, or a list with one generator per prompt (see the module doc)."""
    per_prompt = isinstance(generator, (list, tuple))
    if per_prompt and len(generator) != len(prompts):
        raise ValueError(f"expected one generator per prompt: {len(generator)} generators for {len(prompts)} prompts")
    was_training = causal_lm.training
    causal_lm.eval()
    base, lm_head = causal_lm.get_decoder(), causal_lm.get_output_embeddings()
    cache_kw = _cache_kwarg(base)
    eos_ids = eos_token_ids(tokenizer, causal_lm)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else next(iter(eos_ids))

    check_context(causal_lm, max(len(p) for p in prompts), params.max_new_tokens)
    device = model_device(causal_lm)
    ids, mask = left_pad(prompts, pad_id, device)  # (B, P)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = _new_cache(causal_lm.config)
    out = base(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, **{cache_kw: cache})  # fills `cache` in place
    last = lm_head(out.last_hidden_state[:, -1])  # (B, V)
    if stats is not None:
        stats.prefill_tokens += int(mask.sum())

    if n > 1:  # share the prefill across the group
        cache.batch_repeat_interleave(n)
        last = last.repeat_interleave(n, dim=0)
        mask = mask.repeat_interleave(n, dim=0)
        positions = positions.repeat_interleave(n, dim=0)
    total = len(prompts) * n
    next_pos = positions[:, -1] + 1  # (N,)
    tokens: list[list[int]] = [[] for _ in range(total)]
    logps: list[list[float]] = [[] for _ in range(total)]
    finish = ["length"] * total
    live = torch.arange(total, device=device)  # rows of the cache -> sample index
    stop_window = max((len(s) for s in params.stop), default=0)

    vocab = last.shape[-1]
    draw = draws = None
    if params.temperature > 0 and per_prompt:
        draws = [uniform_source(g, device) for g in generator]
    elif params.temperature > 0:
        draw = uniform_source(generator, device)
    for step in range(params.max_new_tokens):
        live_ids = live.tolist()  # one copy to the host per step
        uniforms = None
        if draw is not None:  # one row per sample, live or not: draws stay aligned
            uniforms = draw((total, vocab))[live]
        elif draws is not None:  # per-prompt streams: a prompt draws while any of its samples runs
            uniforms = _prompt_uniforms(draws, live_ids, n, vocab)
        token, logp = _sample_next(last, params, uniforms)
        keep = []
        for row, (i, t, lp) in enumerate(zip(live_ids, token.tolist(), logp.tolist())):
            tokens[i].append(t)
            logps[i].append(lp)
            if t in eos_ids:
                finish[i] = "eos"
            elif params.stop and _hits_stop(tokenizer, tokens[i], params.stop, stop_window):
                finish[i] = "stop"
            else:
                keep.append(row)
        if stats is not None:
            stats.generated_tokens += len(live)
        if not keep or step == params.max_new_tokens - 1:
            break
        if len(keep) < len(live):
            sel = torch.tensor(keep, dtype=torch.long, device=device)
            cache.batch_select_indices(sel)
            live, token, mask, next_pos = live[sel], token[sel], mask[sel], next_pos[sel]
        mask = torch.cat([mask, torch.ones((len(live), 1), dtype=mask.dtype, device=device)], dim=1)
        out = base(
            input_ids=token[:, None],
            attention_mask=mask,
            position_ids=next_pos[:, None],
            use_cache=True,
            **{cache_kw: cache},
        )
        last = lm_head(out.last_hidden_state[:, -1])
        next_pos = next_pos + 1
        if stats is not None:
            stats.decode_tokens += len(live)

    if was_training:
        causal_lm.train()
    return [Sample(i // n, tokens[i], logps[i], finish[i]) for i in range(total)]


def eos_token_ids(tokenizer, causal_lm=None) -> set[int]:
    """The token ids that end a sampled reply: the tokenizer's EOS and the model's generation-config EOS ids."""
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    cfg_eos = getattr(getattr(causal_lm, "generation_config", None), "eos_token_id", None)
    if isinstance(cfg_eos, int):
        ids.add(cfg_eos)
    elif isinstance(cfg_eos, (list, tuple)):
        ids.update(int(x) for x in cfg_eos)
    return ids


def _hits_stop(tokenizer, token_ids: list[int], stops: tuple[str, ...], window: int) -> bool:
    # Decode only a short tail: a stop string of k characters spans at most k tokens.
    tail = tokenizer.decode(token_ids[-(window + 1) :], skip_special_tokens=False)
    return any(s in tail for s in stops)


def sequence_logprobs(
    causal_lm: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    action_mask: torch.Tensor,
    temperature: float = 1.0,
    chunk: int = 512,
    with_entropy: bool = False,
    entropy_grad: bool = False,
    topk: int = 0,
    at_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None] | tuple[torch.Tensor, torch.Tensor | None, object]:
    """Log-probabilities of the action tokens under the (temperature-scaled) policy.

    input_ids, attention_mask, action_mask: (N, L), right-padded. Returns
    `logp  # (N, L)` with log pi(token_t | tokens_<t) at action positions and 0 elsewhere,
    and optionally the policy entropy at the same positions (detached, for logging; with
    `entropy_grad` attached to the graph, for an entropy bonus in the loss).
    The vocabulary projection and log-softmax run only at the positions that predict an
    action token, `chunk` positions at a time: never an (N, L, V) tensor.

    Full-distribution self-distillation (`distill.distribution_loss`) reads more of each
    position's distribution, as a third value: with `topk = k` the k most likely tokens,
    `(ids  # (N, L, k) long, logp  # (N, L, k))` (detached; a teacher's), and with `at_ids  #
    (N, L, k)` the log-probs of those ids, `(N, L, k)` with the gradient (a student's); 0 off
    the action positions.
    """
    base, lm_head = causal_lm.get_decoder(), causal_lm.get_output_embeddings()
    hidden = base(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state  # (N, L, H)
    targets = action_mask[:, 1:].bool()  # (N, L-1): position t-1 predicts token t
    rows, cols = targets.nonzero(as_tuple=True)
    h = hidden[:, :-1][rows, cols]  # (K, H)
    next_tokens = input_ids[:, 1:][rows, cols]  # (K,)
    return _project(lm_head, h, next_tokens, (rows, cols + 1), input_ids.shape, temperature, chunk, with_entropy, entropy_grad, topk, at_ids)


def _project(lm_head, h, targets, where, shape, temperature, chunk, with_entropy, entropy_grad=False, topk=0, at_ids=None):
    """log pi(target | h) for K hidden states `h  # (K, H)`, `chunk` rows of the vocabulary
    projection at a time, scattered into an (N, L) tensor at `where` (and the entropy,
    detached unless `entropy_grad`; and, with `topk` or `at_ids`, the third value that
    `sequence_logprobs` describes)."""
    if topk and at_ids is not None:
        raise ValueError("ask for the top-k tokens (a teacher) or the log-probs at given ids (a student), not both")
    scale = 1.0 / temperature if temperature > 0 else 1.0
    ids_at = None if at_ids is None else at_ids[where]  # (K, k)
    pieces, ents, top_ids, top_logp = [], [], [], []
    for s in range(0, h.shape[0], chunk):
        logp_all = F.log_softmax(lm_head(h[s : s + chunk]).float() * scale, dim=-1)  # (k, V)
        pieces.append(logp_all.gather(-1, targets[s : s + chunk, None]).squeeze(-1))
        if with_entropy:
            with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
                ents.append(-(logp_all.exp() * logp_all).sum(-1))
        if topk:
            values, indices = logp_all.detach().topk(topk, dim=-1)
            top_ids.append(indices)
            top_logp.append(values)
        elif ids_at is not None:
            top_logp.append(logp_all.gather(-1, ids_at[s : s + chunk]))
    flat = torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.float32, device=h.device)
    logp = torch.zeros(shape, dtype=torch.float32, device=h.device).index_put(where, flat)
    entropy = None
    if with_entropy:
        flat_ent = torch.cat(ents) if ents else torch.zeros(0, dtype=torch.float32, device=h.device)
        entropy = torch.zeros(shape, dtype=torch.float32, device=h.device).index_put(where, flat_ent)
    if not topk and ids_at is None:
        return logp, entropy
    k = topk or ids_at.shape[-1]

    def spread(pieces: list[torch.Tensor], dtype) -> torch.Tensor:  # (K, k) pieces -> (N, L, k), 0 off the positions
        flat = torch.cat(pieces) if pieces else torch.zeros((0, k), dtype=dtype, device=h.device)
        return torch.zeros((*shape, k), dtype=dtype, device=h.device).index_put(where, flat)

    extra = (spread(top_ids, torch.long), spread(top_logp, torch.float32)) if topk else spread(top_logp, torch.float32)
    return logp, entropy, extra


def prefix_lengths(action_mask: torch.Tensor) -> torch.Tensor:
    """(N,) index of each row's first action token: the prompt the row shares with its group."""
    has = action_mask.bool().any(dim=1)
    if not bool(has.all()):
        raise ValueError("every row needs at least one action token")
    return action_mask.bool().float().argmax(dim=1)


def shared_prefix_logprobs(
    causal_lm: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    action_mask: torch.Tensor,
    temperature: float = 1.0,
    chunk: int = 512,
    with_entropy: bool = False,
    entropy_grad: bool = False,
    topk: int = 0,
    at_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None] | tuple[torch.Tensor, torch.Tensor | None, object]:
    """`sequence_logprobs`, computing each distinct prompt once.

    Rows whose tokens before the first action token are identical (the G samples of a
    group) share one forward pass over that prompt: the prompt runs once per distinct
    prompt, left-padded, with a KV cache; the cache is gathered to the rows (a
    differentiable index) and the completions run on top of it. Gradients reach the
    prompt's computation once, summed over its rows: the same gradient as running every
    row in full, with a fraction of the work when prompts are long. Same inputs and
    outputs as `sequence_logprobs`.
    """
    base, lm_head = causal_lm.get_decoder(), causal_lm.get_output_embeddings()
    cache_kw = _cache_kwarg(base)
    n, length = input_ids.shape
    device = input_ids.device
    first = prefix_lengths(action_mask)  # (N,)
    real = attention_mask.sum(dim=1)  # (N,)
    host_ids, host_first = input_ids.tolist(), first.tolist()  # one copy to the host to find the distinct prompts
    keys = [tuple(host_ids[i][: host_first[i]]) for i in range(n)]
    unique: dict[tuple, int] = {}
    row_to_prefix = torch.tensor([unique.setdefault(k, len(unique)) for k in keys], dtype=torch.long, device=device)  # (N,)
    prefixes = [list(k) for k in unique]
    pad_id = 0  # any id: padded positions are masked out
    p_ids, p_mask = left_pad(prefixes, pad_id, device)  # (U, P)
    p_pos = (p_mask.cumsum(-1) - 1).clamp(min=0)
    cache = _new_cache(causal_lm.config)
    p_out = base(input_ids=p_ids, attention_mask=p_mask, position_ids=p_pos, use_cache=True, **{cache_kw: cache})
    h_last = p_out.last_hidden_state[:, -1][row_to_prefix]  # (N, H): predicts each row's first action token
    cache.batch_select_indices(row_to_prefix)  # (U, ...) -> (N, ...), differentiable gather

    s_len = real - first  # (N,) suffix lengths
    width = int(s_len.max())
    offsets = torch.arange(width, device=device)
    src = (first[:, None] + offsets[None, :]).clamp(max=length - 1)  # (N, S) positions in the full rows
    s_valid = offsets[None, :] < s_len[:, None]  # (N, S)
    s_ids = torch.where(s_valid, input_ids.gather(1, src), torch.full_like(src, pad_id))
    s_act = action_mask.gather(1, src) * s_valid  # (N, S)
    full_mask = torch.cat([p_mask[row_to_prefix], s_valid.long()], dim=1)  # (N, P + S)
    s_pos = p_mask.sum(dim=1)[row_to_prefix][:, None] + offsets[None, :]  # (N, S)
    s_out = base(input_ids=s_ids, attention_mask=full_mask, position_ids=s_pos, use_cache=True, **{cache_kw: cache})
    # hidden state that predicts suffix token j: the prompt's last state for j = 0, else suffix state j - 1
    pred = torch.cat([h_last[:, None], s_out.last_hidden_state[:, :-1]], dim=1)  # (N, S, H)

    rows, cols = s_act.bool().nonzero(as_tuple=True)
    h = pred[rows, cols]  # (K, H)
    targets = s_ids[rows, cols]  # (K,)
    return _project(lm_head, h, targets, (rows, first[rows] + cols), (n, length), temperature, chunk, with_entropy, entropy_grad, topk, at_ids)
