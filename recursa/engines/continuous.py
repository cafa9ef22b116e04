"""Continuous batching with prompt-prefix reuse, for multi-turn rollouts on the native engine.

A multi-turn rollout (`recursa.rollout.rollout_episodes`) played the synchronous way runs one
batched `generate` call per turn: every live episode waits for the slowest reply of the turn,
finished episodes leave their row empty, and each turn's prompt is prefilled from its first
token although the system prompt, the task line, and often the whole prompt (the G episodes
of a group see the same first observation) were computed moments before. `ContinuousBatcher`
schedules per decode step instead (iteration-level scheduling, as vLLM and Orca do):

* **Slots.** At most `max_rows` requests decode together, one per slot of a static KV
  buffer (`SlotKV`: per layer a preallocated (rows, kv_heads, capacity, head_dim) tensor;
  each step writes one column per row in place, no per-token `torch.cat`). When a request
  finishes (EOS, a stop string or `max_new_tokens`) the caller gets its `Sample` at once and
  may submit the episode's next prompt, which is prefilled into a free slot before the next
  decode step; the other rows keep decoding. A step's wall time then follows the total
  number of generated tokens and prompts, not the slowest row of every turn.
* **Prefix reuse.** `PrefixCache` keeps the KV of prompts prefilled earlier in the same
  rollout (least recently used first out, within `budget_bytes`). A new prompt takes the
  longest prefix it shares with any of them and prefills only the rest. A row's tokens sit
  at columns 0..L-1 with positions 0..L-1, so a reused prefix's keys are the ones a full
  prefill would compute (to float rounding: the matmuls have other shapes). The cache lives
  for one rollout call, i.e. one version of the weights.
* **Batched prefill.** The requests admitted together (a wave) compute their uncached parts
  in one forward, straight into their slots, each row padded at its end to the wave's
  longest part (the padding's columns are masked and then overwritten by the row's own
  tokens). A request that would share at least half of what it computes with another of the
  wave (the G identical first prompts of a group) waits for the next wave and reuses it.
* **The last prompt token** is not prefilled: it is the row's first decode input, so a
  prompt that was seen before in full costs one decode row, and every step is one forward
  of all busy rows.

Random streams: each request carries its own generator and draws (1, V) uniforms from it for
each token it samples, which is exactly what `generation.generate` draws for a prompt with its
own generator and n = 1 (`sampling.streams = "group"` episodes). So what a request samples
depends only on its prompt, its generator and the weights, never on which other requests
share a step: a request played here samples the tokens it samples when played alone, and
the synchronous path's tokens under per-episode streams, to float rounding of the logits.

Log-probabilities are those of `generation._sample_next` (log softmax of the
temperature-scaled logits over the full vocabulary), as in `generate`.
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass, field
from typing import Hashable

import torch

from recursa.generation import GenerationStats, Sample, SamplingParams, _cache_kwarg, _hits_stop, _sample_next, check_context, model_device, uniform_source


def _kv_shape(config) -> tuple[int, int, int]:
    """(layers, kv_heads, head_dim) of a decoder config."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return config.num_hidden_layers, kv_heads, head_dim


def _common_prefix(a: torch.Tensor, b: torch.Tensor) -> int:
    """How many leading tokens two id tensors share."""
    m = min(len(a), len(b))
    diff = (a[:m] != b[:m]).nonzero()
    return m if len(diff) == 0 else int(diff[0])


class SlotKV:
    """Static KV buffer of the decoding rows: per layer (rows, kv_heads, capacity, head_dim)
    keys and values. Slot r holds its row's tokens at columns 0..len-1; a decode step writes
    each row's new key/value at its own column (`positions`) in place and attends over the
    first `width` columns, with a mask that hides each row's unused ones."""

    def __init__(self, config, rows: int, capacity: int, dtype: torch.dtype, device: torch.device):
        n_layers, kv_heads, head_dim = _kv_shape(config)
        shape = (rows, kv_heads, capacity, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.n = 0  # rows in the current step (slots 0..n-1)
        self.width = 0
        self._rows = self._pos = None
        self._first = 0  # a prefill forward's first slot (its rows are first..first+n-1)

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[2]

    def grow(self, capacity: int) -> None:
        """Reallocate to at least `capacity` columns, keeping the contents."""
        if capacity <= self.capacity:
            return
        for store in (self.keys, self.values):
            for i, t in enumerate(store):
                bigger = t.new_zeros((t.shape[0], t.shape[1], capacity, t.shape[3]))
                bigger[:, :, : t.shape[2]] = t
                store[i] = bigger

    def place(self, slot: int, kv: list[tuple[torch.Tensor, torch.Tensor]], length: int) -> None:
        """Copy a prefilled row's keys/values (per layer (1, kv_heads, >= length, head_dim)) into `slot`."""
        self.grow(length + 1)
        for layer, (k, v) in enumerate(kv):
            self.keys[layer][slot, :, :length] = k[0, :, :length]
            self.values[layer][slot, :, :length] = v[0, :, :length]

    def move(self, src: int, dst: int, length: int) -> None:
        """Copy slot `src`'s first `length` columns to slot `dst` (keeps busy rows contiguous)."""
        for store in (self.keys, self.values):
            for t in store:
                t[dst, :, :length] = t[src, :, :length]

    def begin_step(self, positions: torch.Tensor) -> None:
        """The next forward writes row r (r < len(positions)) at column positions[r]."""
        self.begin_prefill(0, positions, 1)

    def begin_prefill(self, first: int, starts: torch.Tensor, length: int) -> None:
        """The next forward feeds `length` tokens to each of slots first..first+n-1 (n =
        len(starts)) and writes slot first+r's at columns starts[r]..starts[r]+length-1. A row
        with fewer real tokens writes padding past its end; those columns are masked out and
        overwritten by the row's next tokens."""
        self.n, self._first = int(starts.shape[0]), first
        self.width = int(starts.max()) + length
        self.grow(self.width)
        self._rows = torch.arange(first, first + self.n, device=starts.device)[:, None]  # (n, 1)
        self._pos = starts[:, None] + torch.arange(length, device=starts.device)  # (n, length)

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        k_buf, v_buf = self.keys[layer_idx], self.values[layer_idx]
        k_buf[self._rows, :, self._pos] = key_states.transpose(1, 2)  # (n, length, kv_heads, head_dim)
        v_buf[self._rows, :, self._pos] = value_states.transpose(1, 2)
        rows = slice(self._first, self._first + self.n)
        return k_buf[rows, :, : self.width], v_buf[rows, :, : self.width]


@dataclass
class _Entry:
    ids: torch.Tensor  # (L,) on the host
    kv: list[tuple[torch.Tensor, torch.Tensor]]  # per layer (1, kv_heads, L, head_dim)
    nbytes: int


class PrefixCache:
    """KV of earlier prompts of one rollout (same weights), for reuse by prompts that share a
    prefix with them; least recently used entries leave first once `budget_bytes` is full."""

    def __init__(self, budget_bytes: int):
        self.budget = budget_bytes
        self.entries: collections.OrderedDict[int, _Entry] = collections.OrderedDict()
        self.bytes = 0
        self._next = 0

    def longest(self, ids: torch.Tensor) -> tuple[_Entry | None, int]:
        """The entry sharing the longest prefix with `ids` (L,), and that prefix's length."""
        best, best_len = None, 0
        for key, e in self.entries.items():
            if min(len(e.ids), len(ids)) <= best_len:
                continue
            common = _common_prefix(e.ids, ids)
            if common > best_len:
                best, best_len, best_key = e, common, key
        if best is not None:
            self.entries.move_to_end(best_key)
        return best, best_len

    def add(self, ids: torch.Tensor, kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        nbytes = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in kv)
        if nbytes > self.budget:
            return
        while self.entries and self.bytes + nbytes > self.budget:
            _, old = self.entries.popitem(last=False)
            self.bytes -= old.nbytes
        self.entries[self._next] = _Entry(ids, kv, nbytes)
        self._next += 1
        self.bytes += nbytes


@dataclass
class _Request:
    key: Hashable
    prompt: list[int]
    draw: object  # shape -> uniforms, or None (greedy)
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)


@dataclass
class BatcherTimes:
    """Seconds spent in each part of the batcher (the rollout benchmark's profile)."""

    prefill_s: float = 0.0  # prefix lookup + prefill forwards + copying into slots
    decode_s: float = 0.0  # decode forwards (all busy rows, one token each) incl. the vocabulary projection
    sample_s: float = 0.0  # uniforms, sampling, stop checks
    prefill_calls: int = 0  # prefill forwards: one per admitted wave with anything to compute
    decode_steps: int = 0


class ContinuousBatcher:
    """Iteration-level scheduling of token-in / token-out requests on one causal LM (see the
    module doc). Use:

        batcher = ContinuousBatcher(causal_lm, tokenizer, params, max_rows=32)
        batcher.submit(key, prompt_ids, generator)        # any number; they wait for a slot
        while batcher.busy:
            for key, sample in batcher.step():             # one decode step of every busy row
                ...                                          # may submit(key2, next_prompt, gen, front=True)

    `generator` is the request's own CPU generator (None: torch's default one; unused when
    greedy). `front=True` puts a request ahead of the waiting ones (an episode's next turn
    keeps its slot instead of queueing behind episodes not yet started). `prefill_rows`: at most
    that many requests' prompts per prefill forward (default `max_rows`; 1 computes each
    prompt in a forward of its own, the batcher before batched prefill).
    """

    def __init__(
        self,
        causal_lm: torch.nn.Module,
        tokenizer,
        params: SamplingParams,
        max_rows: int = 32,
        prefix_cache_bytes: int = 256 << 20,
        eos_ids: set[int] | None = None,
        stats: GenerationStats | None = None,
        times: BatcherTimes | None = None,
        prefill_rows: int | None = None,
    ):
        from recursa.generation import eos_token_ids

        if max_rows < 1:
            raise ValueError(f"max_rows must be >= 1, got {max_rows}")
        if prefill_rows is not None and prefill_rows < 1:
            raise ValueError(f"prefill_rows must be >= 1, got {prefill_rows}")
        self.prefill_rows = prefill_rows or max_rows  # requests computed per prefill forward (1: one at a time)
        self.lm, self.tok, self.params = causal_lm, tokenizer, params
        self.base, self.head = causal_lm.get_decoder(), causal_lm.get_output_embeddings()
        self.cache_kw = _cache_kwarg(self.base)
        self.device = model_device(causal_lm)
        self.dtype = next(causal_lm.parameters()).dtype
        if not self.dtype.is_floating_point:  # int8-quantised linear layers keep float activations
            self.dtype = torch.float32
        self.eos = eos_ids if eos_ids is not None else eos_token_ids(tokenizer, causal_lm)
        self.max_rows = max_rows
        self.stats = stats if stats is not None else GenerationStats()
        self.times = times if times is not None else BatcherTimes()
        self.prefix = PrefixCache(prefix_cache_bytes) if prefix_cache_bytes > 0 else None
        self.waiting: collections.deque[_Request] = collections.deque()
        self.rows: list[_Request] = []  # slot r -> its request
        self.pos: list[int] = []  # slot r -> the column its next input token goes to
        self.feed: list[int] = []  # slot r -> its next input token
        self.slots: SlotKV | None = None
        self.n_layers = _kv_shape(causal_lm.config)[0]
        self.stop_window = max((len(s) for s in params.stop), default=0)

    @property
    def busy(self) -> bool:
        return bool(self.rows or self.waiting)

    def submit(self, key: Hashable, prompt: list[int], generator: torch.Generator | None = None, front: bool = False) -> None:
        if not prompt:
            raise ValueError("a prompt needs at least one token")
        check_context(self.lm, len(prompt), self.params.max_new_tokens)
        draw = uniform_source(generator, self.device) if self.params.temperature > 0 else None
        req = _Request(key, list(prompt), draw)
        (self.waiting.appendleft if front else self.waiting.append)(req)

    # ------------------------------------------------------------------ prefill
    def _plan(self, req: _Request, wave: list[tuple[_Request, torch.Tensor, _Entry | None, int]]):
        """(host ids, cache entry, reused length) of a request's prompt without its last token,
        or None when it should wait for the current wave: a request of the wave that will be
        computed shares at least half of what this one would compute (the G first prompts of
        a group, two episodes that saw the same turn), so the next wave reuses it instead."""
        host = torch.tensor(req.prompt[:-1], dtype=torch.long, device="cpu")  # host ids: compared and cached on the CPU
        entry, reuse = self.prefix.longest(host) if self.prefix is not None and len(host) else (None, 0)
        todo = len(host) - reuse
        if todo > 0 and self.prefix is not None:
            for _, other, _, _ in wave:
                if _common_prefix(other, host) - reuse >= max(1, (todo + 1) // 2):
                    return None
        return host, entry, reuse

    def _admit(self) -> None:
        """Prefill waiting requests into free slots: each wave of admitted requests computes the
        parts of their prompts not in the prefix cache in one forward (rows padded to the
        longest part), straight into their slots."""
        while self.waiting and len(self.rows) < self.max_rows:
            t = time.perf_counter()
            wave, ready, later = [], [], []
            while self.waiting and len(self.rows) + len(wave) + len(ready) < self.max_rows:
                req = self.waiting.popleft()
                plan = self._plan(req, wave)
                if plan is None:
                    later.append(req)
                elif len(plan[0]) == plan[2]:  # all of it cached
                    ready.append((req, *plan))
                elif len(wave) < self.prefill_rows:
                    wave.append((req, *plan))
                else:
                    later.append(req)
            self.waiting.extendleft(reversed(later))
            if not wave and not ready:
                return
            longest = max(len(r.prompt) for r, *_ in wave + ready)
            if self.slots is None:
                self.slots = SlotKV(self.lm.config, self.max_rows, max(64, longest + self.params.max_new_tokens), self.dtype, self.device)
            first = len(self.rows)
            for slot, (req, host, entry, reuse) in enumerate(wave + ready, start=first):
                if reuse:
                    self.slots.place(slot, entry.kv, reuse)
                self.stats.prefix_reused_tokens += reuse
                self.rows.append(req)
                self.pos.append(len(req.prompt) - 1)
                self.feed.append(req.prompt[-1])
            if wave:
                self._prefill(first, wave)
                self.times.prefill_calls += 1
            self.times.prefill_s += time.perf_counter() - t

    def _prefill(self, first: int, wave: list[tuple[_Request, torch.Tensor, _Entry | None, int]]) -> None:
        """One forward of the wave's uncached prompt tokens into slots first..first+len(wave)-1."""
        starts = torch.tensor([reuse for *_, reuse in wave], device=self.device)
        todo = [host[reuse:] for _, host, _, reuse in wave]
        s = max(len(x) for x in todo)
        ids = torch.zeros((len(wave), s), dtype=torch.long, device="cpu")  # filled on the host, copied once
        for r, x in enumerate(todo):
            ids[r, : len(x)] = x
        positions = starts[:, None] + torch.arange(s, device=self.device)  # (n, s)
        self.slots.begin_prefill(first, starts, s)
        mask = (torch.arange(self.slots.width, device=self.device)[None, None, :] <= positions[:, :, None])[:, None]  # (n, 1, s, W) causal
        self.base(input_ids=ids.to(self.device), attention_mask=mask, position_ids=positions, use_cache=True, **{self.cache_kw: self.slots})
        self.stats.prefill_tokens += sum(len(x) for x in todo)
        if self.prefix is not None:
            for slot, (_, host, _, _) in enumerate(wave, start=first):
                n = len(host)
                self.prefix.add(host, [(k[slot : slot + 1, :, :n].clone(), v[slot : slot + 1, :, :n].clone()) for k, v in zip(self.slots.keys, self.slots.values)])

    # ------------------------------------------------------------------ one step
    @torch.no_grad()
    def step(self) -> list[tuple[Hashable, Sample]]:
        """Admit waiting requests, run one decode step of every busy row, sample; returns the
        (key, Sample) of the requests that finished (their slots are free again)."""
        was_training = self.lm.training
        self.lm.eval()
        try:
            return self._step()
        finally:
            if was_training:
                self.lm.train()

    def _step(self) -> list[tuple[Hashable, Sample]]:
        self._admit()
        if not self.rows:
            return []
        t = time.perf_counter()
        n = len(self.rows)
        positions = torch.tensor(self.pos, dtype=torch.long, device=self.device)  # (n,)
        self.slots.begin_step(positions)
        mask = (torch.arange(self.slots.width, device=self.device)[None, :] <= positions[:, None])[:, None, None]  # (n, 1, 1, W)
        inputs = torch.tensor(self.feed, dtype=torch.long, device=self.device)[:, None]  # (n, 1)
        out = self.base(input_ids=inputs, attention_mask=mask, position_ids=positions[:, None], use_cache=True, **{self.cache_kw: self.slots})
        logits = self.head(out.last_hidden_state[:, -1])  # (n, V)
        self.stats.decode_tokens += n
        t2 = time.perf_counter()
        self.times.decode_s += t2 - t
        self.times.decode_steps += 1

        uniforms = None
        if self.params.temperature > 0:
            uniforms = torch.cat([r.draw((1, logits.shape[-1])) for r in self.rows])  # (n, V), one row per request's own stream
        token, logp = _sample_next(logits, self.params, uniforms)
        finished: list[tuple[Hashable, Sample]] = []
        done_slots = []
        for slot, (req, tk, lp) in enumerate(zip(self.rows, token.tolist(), logp.tolist())):
            req.tokens.append(tk)
            req.logprobs.append(lp)
            reason = None
            if tk in self.eos:
                reason = "eos"
            elif self.params.stop and _hits_stop(self.tok, req.tokens, self.params.stop, self.stop_window):
                reason = "stop"
            elif len(req.tokens) >= self.params.max_new_tokens:
                reason = "length"
            if reason is None:
                self.feed[slot] = tk
                self.pos[slot] += 1
            else:
                finished.append((req.key, Sample(0, req.tokens, req.logprobs, reason)))
                done_slots.append(slot)
        self.stats.generated_tokens += n
        for slot in reversed(done_slots):  # fill each freed slot with the last busy row
            last = len(self.rows) - 1
            if slot != last:
                self.slots.move(last, slot, self.pos[last])
                self.rows[slot], self.pos[slot], self.feed[slot] = self.rows[last], self.pos[last], self.feed[last]
            self.rows.pop()
            self.pos.pop()
            self.feed.pop()
        self.times.sample_s += time.perf_counter() - t2
        return finished


__all__ = ["ContinuousBatcher", "PrefixCache", "SlotKV", "BatcherTimes"]
