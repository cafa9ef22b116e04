#!/usr/bin/env python
"""Does the teacher know better? The entry test of a single-turn testbed (issue 44, part 1).

RSIPO's teacher is the policy itself with privileged text in its context. It can only teach
if, with that text, it puts more probability on what is correct than the bare policy does.
This probe measures that on fixed train-split items of a single-turn task, without training:
it samples G attempts per item from the policy (as RL would), scores them with the task's
verifier, and for every teacher context (below) scores, with the same weights, the teacher
(the policy with the context after the question, `recursa.rollout.with_hint`, as
`recursa.methods.teacher.teacher_logprobs` renders it) against the student (the bare prompt
the attempts were sampled from). Per context:

(a) `gain`: per item, the mean over the reference continuation's tokens (the env's
    `reference()` reply, tokenised, plus the end-of-turn token) of
    log pi(y_t | prompt + context, y_<t) - log pi(y_t | prompt, y_<t); its mean over the
    items that have the context, with a 95% percentile-bootstrap interval over items
    (`recursa.stats.bootstrap_mean_ci`). The context PASSES when the interval's lower end
    is above 0.
(b) `rank at divergence`: for every failed attempt s, k = the first token position where s
    leaves the reference continuation y (s_<k = y_<k, s_k != y_k; attempts that are a prefix
    of y or that y is a prefix of have no such k and are not counted). Both y_k and s_k are
    then scored from the same prefix, so the teacher "ranks a correct token above the
    sampled wrong one" when log pi(y_k | prompt + context, y_<k) > log pi(s_k | prompt +
    context, s_<k); the share of counted failed attempts where it does (Wilson interval),
    next to the same share for the student (the bare policy), and the flips between them.
    Only the first divergent token is scored: after it the attempt's prefix is no longer a
    prefix of a correct reply, and "the correct token" is not defined. Note the reference
    is one correct reply: a failed attempt that diverges on format ("The answer is ...")
    diverges at its first token.
(c) `corr(Delta, A)`: per attempt, Delta = its mean token log-prob gain teacher - student
    on its own sampled tokens (`distill.teacher_shift`, `distill.trajectory_shift`), and A
    its outcome advantage (`advantages.compute_advantages` with the recipe's
    `algo.advantage`, GRPO's by default); the Pearson correlation over the attempts that
    have the context, in groups that both won and failed (elsewhere A = 0), with a 95%
    bootstrap interval over those groups (`sibling` gives a group's only winner no context:
    that winner is left out). Also with Delta centred on its group's attempts with the
    context (`teacher.center = "group"`).
(d) `trust`: how RSIPO's empirical-Bayes trust would weight this teacher: the items are fed,
    `train.prompts_per_step` at a time, as steps of a run with `teacher.source` = this
    context (one trust group), to `recursa.methods.teacher.make_trust`'s estimator with
    `trust.agreement_trials` (sign of Delta vs sign of A) exactly as `teacher.teach` does:
    the trust applied at each step is read before that step's trials update it. Reported:
    the mean applied trust over the attempts with the context, the trust after the last
    step, and agreements / trials.

Teacher contexts (`--contexts`):

* `reference`: the library's `teacher.source = "reference"` text, "A correct answer: <ref>"
  (`methods.teacher.teacher_hints`);
* `worked`: a worked solution ending in the answer, where the task has one (built here from
  the item: place-value steps for a + b and a - b; animals x legs for rg:leg_counting; the
  binary digits for rg:count_bits; the letters in reverse for rg:spell_backward);
* `wrong`: "A previous attempt at this task was wrong: <attempt>", the item's first failed
  attempt of its group (a weak context: it says what not to answer, not what to answer);
* `sibling`: the library's `teacher.source = "sibling"` text, a successful sibling's reply
  (only items whose group both won and failed).

For (a) and (b) an item's context is one text; for (c) and (d) `reference`, `worked` and
`wrong` give every attempt of the item the same text, `sibling` what the library gives
(another successful attempt of the group).

    python benchmarks/teacher_knows.py --task arithmetic --level 1 --items 100 --group-size 8
    python benchmarks/teacher_knows.py --task add3 --items 100          # a preset, see TESTBEDS
    python benchmarks/teacher_knows.py --task rg:leg_counting --items 100
    python benchmarks/teacher_knows.py --table                          # the committed results as markdown

Writes one JSON per run under benchmarks/results/teacher_knows/ (`--out`); `--table` renders
every JSON there to benchmarks/results/teacher_knows.md.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

RESULTS = REPO / "benchmarks" / "results" / "teacher_knows"
FIRST_SEED = 4_400_000  # train-split items, far from the seeds other probes use
CONTEXTS = ("reference", "worked", "wrong", "sibling")

# named testbeds: (env spec, env kwargs, description)
TESTBEDS = {
    "arith2": ("arithmetic", {"difficulty": 1}, "two-digit addition and subtraction (arithmetic, difficulty 1)"),
    "add3": ("rg:basic_arithmetic", {"min_terms": 2, "max_terms": 2, "min_digits": 3, "max_digits": 3, "operators": ["+"],
                                     "allow_parentheses": False, "allow_negation": False}, "three-digit addition (reasoning-gym basic_arithmetic, a + b)"),
    "leg_counting": ("rg:leg_counting", {}, "reasoning-gym leg_counting"),
    "count_bits": ("rg:count_bits", {}, "reasoning-gym count_bits"),
    "spell_backward": ("rg:spell_backward", {}, "reasoning-gym spell_backward"),
}


# ----------------------------------------------------------------------------- contexts


def _place_value(question: str) -> str | None:
    """Worked steps for 'a + b' or 'a - b' (non-negative integers), else None."""
    m = re.fullmatch(r"\s*(?:Calculate\s+)?(\d+)\s*([+-])\s*(\d+)\s*\.?\s*", question)
    if not m:
        return None
    a, op, b = int(m.group(1)), m.group(2), int(m.group(3))
    sign = 1 if op == "+" else -1
    digits = str(b)
    parts = [int(d) * 10 ** (len(digits) - 1 - i) for i, d in enumerate(digits) if d != "0"]  # b by place value
    if len(parts) <= 1:
        return f"{a} {op} {b} = {a + sign * b}."
    steps, run = [], a
    while parts:
        steps.append(f"{run} {op} " + f" {op} ".join(map(str, parts)))
        run, parts = run + sign * parts[0], parts[1:]
    return f"{a} {op} {b} = " + " = ".join([*steps, str(run)]) + "."


def worked_solution(env, seed: int) -> str | None:
    """A worked solution of the item, ending in its answer (None where the task has none here)."""
    name = getattr(env, "name", "")
    if name == "arithmetic":
        steps = _place_value(env.item(seed).question)
        return None if steps is None else f"A worked solution: {steps} The answer is {env.item(seed).answer}."
    if not name.startswith("rg:"):
        return None
    entry = env.entry(seed)
    meta, answer = entry["metadata"], entry["answer"]
    if name == "rg:basic_arithmetic":
        steps = _place_value(str(meta.get("expression", "")))
        return None if steps is None else f"A worked solution: {steps} The answer is {answer}."
    if name == "rg:leg_counting":
        from reasoning_gym.arithmetic.leg_counting import ANIMALS

        parts = [f"{n} {a} x {ANIMALS[a]} legs = {n * ANIMALS[a]}" for a, n in meta["animals"].items()]
        total = " + ".join(str(n * ANIMALS[a]) for a, n in meta["animals"].items())
        return f"A worked solution: {'; '.join(parts)}. Total: {total} = {answer}. The answer is {answer}."
    if name == "rg:count_bits":
        return f"A worked solution: {meta['number']} in binary is {meta['binary']}, which has {meta['binary'].count('1')} ones. The answer is {answer}."
    if name == "rg:spell_backward":
        word = meta["word"]
        return f"A worked solution: the letters of {word} are {', '.join(word)}; from last to first: {', '.join(reversed(word))}. The answer is {answer}."
    return None


def item_contexts(name: str, env, seeds: list[int], attempts: list, cfg, pool, G: int) -> tuple[list[str | None], list[str | None]]:
    """Context `name` for every item (None: the item has none) and for every attempt."""
    from recursa.methods.teacher import teacher_hints

    B = len(seeds)
    if name in ("reference", "sibling"):
        tcfg = cfg.model_copy(update={"teacher": cfg.teacher.model_copy(update={"source": name})})
        per_attempt, _ = teacher_hints(attempts, tcfg, None, pool, False, G)
        per_item = []
        for b in range(B):  # the text a failed attempt of the group gets (the group's first, for reference)
            failed = [i for i in range(b * G, (b + 1) * G) if not attempts[i].success]
            per_item.append(per_attempt[failed[0]] if failed else per_attempt[b * G] if name == "reference" else None)
        return per_item, per_attempt
    if name == "worked":
        per_item = [worked_solution(env, s) for s in seeds]
    elif name == "wrong":
        per_item = []
        for b in range(B):
            failed = [i for i in range(b * G, (b + 1) * G) if not attempts[i].success]
            per_item.append(f"A previous attempt at this task was wrong: {attempts[failed[0]].texts[0].strip()[: cfg.teacher.max_hint_chars]}" if failed else None)
    else:
        raise ValueError(f"unknown context {name!r}; choose from {', '.join(CONTEXTS)}")
    return per_item, [per_item[i // G] for i in range(B * G)]


# ----------------------------------------------------------------------------- metrics


def first_divergence(attempt: list[int], reference: list[int]) -> int | None:
    """The first position k with attempt[k] != reference[k] (both have a token there); None
    when one is a prefix of the other."""
    for k, (a, r) in enumerate(zip(attempt, reference)):
        if a != r:
            return k
    return None


def reference_gains(teacher: list, student: list) -> list[float]:
    """Per item: mean over the reference tokens of log pi_teacher - log pi_student."""
    return [float((t - s).mean()) for t, s in zip(teacher, student)]


def divergence_ranks(attempt_ids: list[list[int]], ref_ids: list[int], ref_teacher, ref_student, att_teacher, att_student) -> list[dict]:
    """For each failed attempt (its token ids and per-token log-probs under teacher and
    student) against the item's reference (ids and log-probs): where it first diverges and
    whether teacher / student score the reference token there above the sampled one. Attempts
    without a divergence are left out."""
    out = []
    for ids, t, s in zip(attempt_ids, att_teacher, att_student):
        k = first_divergence(ids, ref_ids)
        if k is None:
            continue
        out.append({"k": k, "teacher": bool(ref_teacher[k] > t[k]), "student": bool(ref_student[k] > s[k])})
    return out


def pearson(x, y) -> float | None:
    """Pearson correlation (`recursa.algorithms.distill.correlation`); None where undefined."""
    from recursa.algorithms.distill import correlation

    r = correlation(x, y)
    return None if math.isnan(r) else r


def grouped_corr(delta: list[float], adv: list[float], G: int, mask: list[bool] | None = None, n_boot: int = 2000, seed: int = 0) -> dict:
    """corr(Delta, A) over the attempts in `mask` (default: all) of the groups (G in order)
    whose masked attempts' A are not all 0, with a 95% percentile-bootstrap interval
    resampling those groups. An attempt outside `mask` had no teacher signal (the library's
    `sibling` gives none to a group's only winner) and is left out, not counted as (0, 0)."""
    import numpy as np

    keep = [True] * len(delta) if mask is None else list(mask)
    d_all, a_all = np.asarray(delta, dtype=np.float64), np.asarray(adv, dtype=np.float64)
    groups = [(d_all[g * G : (g + 1) * G][keep[g * G : (g + 1) * G]], a_all[g * G : (g + 1) * G][keep[g * G : (g + 1) * G]])
              for g in range(len(delta) // G)]
    groups = [(d, a) for d, a in groups if np.any(a != 0)]

    def corr_of(picked):
        return pearson(np.concatenate([d for d, _ in picked]), np.concatenate([a for _, a in picked]))

    r = corr_of(groups) if groups else None
    lo = hi = None
    if r is not None and len(groups) >= 3:
        rng = np.random.default_rng(seed)
        rs = []
        for _ in range(n_boot):
            v = corr_of([groups[j] for j in rng.integers(0, len(groups), len(groups))])
            if v is not None:
                rs.append(v)
        if rs:
            lo, hi = (float(q) for q in np.quantile(rs, [0.025, 0.975]))
    return {"r": r, "lo": lo, "hi": hi, "groups": len(groups), "attempts": int(sum(len(d) for d, _ in groups))}


def simulate_trust(mean_delta: list[float], adv: list[float], hinted: list[bool], group: str, G: int, items_per_step: int, cfg) -> dict:
    """Feed the attempts, `items_per_step` items (x G attempts) a step, to the trust estimator
    of `recursa.methods.teacher.make_trust(cfg)` with `agreement_trials`, as `teacher.teach`
    does (one trust group; trust applied before the step's trials update it)."""
    from recursa.algorithms.trust import agreement_trials
    from recursa.methods.teacher import make_trust

    trust = make_trust(cfg)
    applied, agree, trials = [], 0, 0
    step = items_per_step * G
    for lo in range(0, len(mean_delta), step):
        idx = range(lo, min(lo + step, len(mean_delta)))
        t = trust.trust(group)
        applied += [t for i in idx if hinted[i]]
        got = agreement_trials([group if hinted[i] else None for i in idx], [mean_delta[i] for i in idx], [adv[i] for i in idx],
                               [False] * len(idx), cfg.trust.threshold)
        trust.update(got)
        a_g, n_g = got.get(group, (0, 0))
        agree, trials = agree + a_g, trials + n_g
    return {"applied_mean": sum(applied) / len(applied) if applied else None, "final": trust.trust(group), "posterior": trust.posterior(group),
            "agreements": agree, "trials": trials, "steps": trust.steps}


MIN_VERDICT_ITEMS = 10  # fewer items with the context than this: no pass/fail verdict (a 1-item bootstrap interval is a point)


VERDICT_CELL = {"pass": "**yes**", "fail": "no"}  # the table's cell per verdict ('too few items' as written)


def verdict(e: dict) -> str:
    """'pass' / 'fail' for a context's gain interval, or 'too few items' below MIN_VERDICT_ITEMS."""
    if e["items"] < MIN_VERDICT_ITEMS:
        return "too few items"
    return "pass" if e["passes"] else "fail"


def summarise_context(name: str, per_item: list, gains: list, ranks: list, delta: list, delta_centred: list, adv: list, hinted: list,
                      success: list, G: int, cfg, items_per_step: int) -> dict:
    """One context's summary (see the module doc for every field)."""
    from recursa.stats import bootstrap_mean_ci, wilson_interval

    have = [b for b, h in enumerate(per_item) if h is not None]
    g = [gains[b] for b in have]
    lo, hi = bootstrap_mean_ci(g) if g else (None, None)
    all_fail = [gains[b] for b in have if not any(success[b * G : (b + 1) * G])]
    n_rank = len(ranks)
    t_pref, s_pref = sum(r["teacher"] for r in ranks), sum(r["student"] for r in ranks)
    failed_d = [delta[i] for i in range(len(delta)) if hinted[i] and not success[i]]
    won_d = [delta[i] for i in range(len(delta)) if hinted[i] and success[i]]
    raw = grouped_corr(delta, adv, G, mask=hinted)
    cen = grouped_corr(delta_centred, adv, G, mask=hinted)
    trust = {c: simulate_trust(d, adv, hinted, name, G, items_per_step, cfg.model_copy(update={"teacher": cfg.teacher.model_copy(update={"center": c})}))
             for c, d in (("none", delta), ("group", delta_centred))}
    return {
        "items": len(have),
        "gain": sum(g) / len(g) if g else None, "gain_lo": lo, "gain_hi": hi, "passes": bool(lo is not None and lo > 0),
        "gain_positive_items": sum(x > 0 for x in g), "gain_all_fail_items": sum(all_fail) / len(all_fail) if all_fail else None, "all_fail_items": len(all_fail),
        "divergent_failed": n_rank, "teacher_ranks_ref": t_pref / n_rank if n_rank else None,
        "teacher_ranks_ref_ci": list(wilson_interval(t_pref, n_rank)) if n_rank else None,
        "student_ranks_ref": s_pref / n_rank if n_rank else None,
        "flips_to_ref": sum(r["teacher"] and not r["student"] for r in ranks), "flips_away": sum(r["student"] and not r["teacher"] for r in ranks),
        "delta_failed": sum(failed_d) / len(failed_d) if failed_d else None, "delta_won": sum(won_d) / len(won_d) if won_d else None,
        "corr": raw, "corr_centred": cen, "trust": trust,
    }


# ----------------------------------------------------------------------------- the probe


def attempt_logprobs(policy, cfg, system: str | None, trajs: list, attempts: list, hints: list, student_cache: dict | None = None):
    """(teacher, student) log-probs of every attempt's own tokens, as
    `methods.teacher.teacher_logprobs` computes them (zeros where the hint is None). With
    `student_cache` (a dict, attempt index -> student log-probs, shared by the contexts of
    one probe) the student scores, the same for every context, are computed once: the
    teacher prompt is rendered as `teacher_logprobs` renders it, the student prompt is the
    attempt's own prompt ids (its context has no hint)."""
    import torch

    from recursa.methods.attempts import score_actions, user_message
    from recursa.methods.teacher import teacher_logprobs
    from recursa.rollout import render_prompt

    contexts = [a.contexts[0] for a in attempts]
    if student_cache is None or any(c.hint is not None for c in contexts):
        return teacher_logprobs(policy, trajs, contexts, hints, cfg, system)
    tok = policy.tokenizer
    teacher = [torch.zeros(t.num_action_tokens, device=policy.device) for t in trajs]
    student = [torch.zeros(t.num_action_tokens, device=policy.device) for t in trajs]
    pairs, which, need = [], [], []
    for i, (row, ctx, hint) in enumerate(zip(trajs, contexts, hints)):
        if hint is None:
            continue
        first = row.action_mask.index(1)
        actions = row.token_ids[first:]
        if i not in student_cache:
            pairs.append((row.token_ids[:first], actions))
            need.append(i)
        pairs.append((render_prompt(tok, user_message(ctx, cfg.agent, hint), system), actions))
        which.append(i)
    scores = score_actions(policy, pairs, cfg) if pairs else []
    k, need = 0, set(need)
    for i in which:
        if i in need:
            student_cache[i] = scores[k]
            k += 1
        teacher[i], student[i] = scores[k], student_cache[i]
        k += 1
    return teacher, student


def score_context(policy, cfg, system: str | None, trajs: list, attempts: list, per_item: list, per_attempt: list, refs: list[list[int]], G: int,
                  student_cache: dict | None = None):
    """Score one teacher context on sampled attempts (grouped, G per item): per item the
    reference gain (None without the context), the failed attempts' ranks at their first
    divergence, and per attempt the mean token Delta, raw and centred on its group, and
    whether it had the context. Student prompts are the attempts' own prompt ids; teacher
    prompts the same message with the context (`teacher_logprobs`, `user_message`)."""
    import torch

    from recursa.algorithms.distill import (
        group_offsets,
        teacher_shift,
        trajectory_shift,
    )
    from recursa.methods.attempts import score_actions, user_message
    from recursa.rollout import render_prompt

    tok, B = policy.tokenizer, len(per_item)
    first = [t.action_mask.index(1) for t in trajs]
    att_ids = [t.token_ids[f:] for t, f in zip(trajs, first)]
    success = [bool(t.success) for t in trajs]
    # (a) the reference continuation, student then teacher, per item with the context
    pairs, have = [], [b for b, h in enumerate(per_item) if h is not None]
    for b in have:
        ctx = attempts[b * G].contexts[0]
        pairs.append((trajs[b * G].token_ids[: first[b * G]], refs[b]))
        pairs.append((render_prompt(tok, user_message(ctx, cfg.agent, per_item[b]), system), refs[b]))
    scored = score_actions(policy, pairs, cfg) if pairs else []
    gains: list = [None] * B
    ref_s, ref_t = {}, {}
    for k, b in enumerate(have):
        ref_s[b], ref_t[b] = scored[2 * k], scored[2 * k + 1]
        gains[b] = reference_gains([ref_t[b]], [ref_s[b]])[0]
    # (c) the attempts' own tokens, teacher vs student, as training scores them
    teacher, student = attempt_logprobs(policy, cfg, system, trajs, attempts, per_attempt, student_cache)
    # (b) failed attempts at their first divergence from the reference, under the item's context
    ranks = []
    for b in have:
        failed = [i for i in range(b * G, (b + 1) * G) if not success[i]]
        assert all(per_attempt[i] == per_item[b] for i in failed)  # a failed attempt's context is its item's
        ranks += divergence_ranks([att_ids[i] for i in failed], refs[b], ref_t[b].tolist(), ref_s[b].tolist(),
                                  [teacher[i].tolist() for i in failed], [student[i].tolist() for i in failed])
    hinted = [h is not None for h in per_attempt]
    width = max(len(x) for x in att_ids)
    mask = torch.zeros((B * G, width))
    lt, ls = torch.zeros_like(mask), torch.zeros_like(mask)
    for i, (t, s) in enumerate(zip(teacher, student)):
        n = len(att_ids[i])
        mask[i, :n] = 1
        lt[i, :n], ls[i, :n] = t.cpu(), s.cpu()
    md = trajectory_shift(teacher_shift(lt, ls, mask), mask)  # (A,)
    centred = md - group_offsets(md, torch.tensor(hinted), G)
    return gains, ranks, md.tolist(), centred.tolist(), hinted


def probe(policy, cfg, pool, seeds: list[int], G: int, contexts: list[str], sampling, system: str | None, log=print) -> dict:
    """Sample, score and summarise (see the module doc); returns the run record's body."""
    import torch

    from recursa.algorithms.advantages import compute_advantages
    from recursa.methods.attempts import completion_attempts
    from recursa.rollout import rollout

    tok, B = policy.tokenizer, len(seeds)
    eos = tok.eos_token_id
    walls = {}
    t0 = time.perf_counter()
    ro = rollout(policy, pool, seeds, G, sampling, torch.Generator().manual_seed(0), system)
    walls["sample"] = round(time.perf_counter() - t0, 1)
    trajs = ro.trajectories
    attempts = completion_attempts(trajs, 0)
    success = [bool(t.success) for t in trajs]
    rewards = torch.tensor([float(t.reward) for t in trajs]).view(B, G)
    adv = compute_advantages(cfg.algo.advantage, rewards).flatten().tolist()
    env = pool.take(1)[0]
    refs, ref_texts = [], []
    for s in seeds:
        env.reset(s)
        ref_texts.append(env.reference())
        refs.append(tok.encode(ref_texts[-1], add_special_tokens=False) + ([eos] if eos is not None else []))
    log(f"sampled {B} x {G} in {walls['sample']} s: {sum(success)}/{B * G} correct, "
        f"{sum(any(success[b * G:(b + 1) * G]) for b in range(B))} items with a correct attempt")
    items = [{"seed": s, "question": attempts[b * G].task[:200], "reference": ref_texts[b],
              "correct": sum(success[b * G : (b + 1) * G]), "attempts": [attempts[i].texts[0][:80] for i in range(b * G, b * G + 2)], "gain": {}}
             for b, s in enumerate(seeds)]
    summaries, student_cache = {}, {}  # the bare policy's scores of the attempts, computed once for all contexts
    for name in contexts:
        t1 = time.perf_counter()
        per_item, per_attempt = item_contexts(name, env, seeds, attempts, cfg, pool, G)
        gains, ranks, md, centred, hinted = score_context(policy, cfg, system, trajs, attempts, per_item, per_attempt, refs, G, student_cache)
        for b, g in enumerate(gains):
            if g is not None:
                items[b]["gain"][name] = round(g, 4)
        summaries[name] = summarise_context(name, per_item, gains, ranks, md, centred, adv, hinted, success, G, cfg,
                                            cfg.train.prompts_per_step)
        walls[name] = round(time.perf_counter() - t1, 1)
        e = summaries[name]
        log(f"{name:>9}: {e['items']} items, gain {_f(e['gain'])} [{_f(e['gain_lo'])}, {_f(e['gain_hi'])}] {verdict(e).upper()}; "
            f"ranks ref at divergence: teacher {_f(e['teacher_ranks_ref'], '.2f')} / student {_f(e['student_ranks_ref'], '.2f')} of {e['divergent_failed']}; "
            f"corr {_f(e['corr']['r'], '+.2f')} ({e['corr']['groups']} groups); trust {_f(e['trust']['none']['final'], '.2f')}; {walls[name]} s")
    return {"correct": sum(success), "attempts": B * G, "items_any_correct": sum(any(success[b * G : (b + 1) * G]) for b in range(B)),
            "contexts": summaries, "items_detail": items, "wall_s": walls,
            "tokens_per_attempt": sum(t.num_action_tokens for t in trajs) / len(trajs)}


def _f(x, spec="+.3f"):
    return "-" if x is None else format(x, spec)


# ----------------------------------------------------------------------------- the table


def table(results: Path = RESULTS) -> str:
    """Every committed run under `results` as one markdown table (one row per context), then
    each run's command and total wall time, and its `note` where the JSON has one."""
    runs = []
    rows = [("| testbed | model | items x G | correct | items all-fail | context | items | gain, nats/token [95% CI] | passes | "
             "failed attempts at divergence: teacher / student rank ref first (n) | corr(Delta, A) [95% CI] (groups) | centred | "
             "trust applied / final (agree / trials) | wall s |"),
            "|---|---|---|---:|---:|---|---:|---|---|---|---|---|---|---:|"]
    for path in sorted(results.glob("*.json")):
        r = json.loads(path.read_text())
        runs.append(f"- `{r['testbed']}`: `{r['command']}` ({r['wall_s']['total']} s; {r.get('threads', 2)} threads)"
                    + (f". Note: {r['note']}" if r.get("note") else ""))
        all_fail = sum(1 for it in r["items_detail"] if it["correct"] == 0)
        for name, e in r["contexts"].items():
            c, cc, t = e["corr"], e["corr_centred"], e["trust"]["none"]
            ci = f" [{_f(c['lo'], '+.2f')}, {_f(c['hi'], '+.2f')}]" if c["lo"] is not None else ""
            rows.append(
                f"| {r['testbed']} | {r['model_label']} | {r['items']} x {r['group_size']} | {r['correct']}/{r['attempts']} | {all_fail} | {name} | {e['items']} "
                f"| {_f(e['gain'])} [{_f(e['gain_lo'])}, {_f(e['gain_hi'])}] | {VERDICT_CELL.get(verdict(e), verdict(e))} "
                f"| {_f(e['teacher_ranks_ref'], '.2f')} / {_f(e['student_ranks_ref'], '.2f')} ({e['divergent_failed']}) "
                f"| {_f(c['r'], '+.2f')}{ci} ({c['groups']}) | {_f(cc['r'], '+.2f')} "
                f"| {_f(t['applied_mean'], '.2f')} / {_f(t['final'], '.2f')} ({t['agreements']} / {t['trials']}) | {r['wall_s'][name]} |")
    head = ["# Does the teacher know better? The entry probe of single-turn testbeds", "",
            "Written by `python benchmarks/teacher_knows.py --table` from `benchmarks/results/teacher_knows/*.json`; the metrics "
            "are defined in the script's docstring. gain: mean over items of the per-token log-prob gain of the reference reply, "
            "teacher (policy + context) minus student (bare policy); a context passes when its 95% interval is above 0 "
            f"(no verdict, 'too few items', with fewer than {MIN_VERDICT_ITEMS} items that have the context).", ""]
    return "\n".join(head + rows + ["", "Runs:", "", *runs]) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--task", default="arith2", help=f"a preset ({', '.join(TESTBEDS)}) or an env: arithmetic, rg:<dataset>")
    p.add_argument("--level", type=int, default=None, help="arithmetic difficulty (with --task arithmetic)")
    p.add_argument("--env-kwargs", default="{}", help="JSON env options (rg:<dataset> config), merged over the preset's")
    p.add_argument("--items", type=int, default=100, help="train-split items")
    p.add_argument("--group-size", type=int, default=8, help="G: attempts sampled per item")
    p.add_argument("--contexts", default="reference,worked,wrong,sibling", help=f"teacher contexts, from {', '.join(CONTEXTS)}")
    p.add_argument("--max-new-tokens", type=int, default=24)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--warm-start", default=None, help="an SFT run whose last checkpoint is probed (default: the base model)")
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    p.add_argument("--tiny", action="store_true", help="the tiny random model (checks the script)")
    p.add_argument("--out", default=None, help="the run's JSON (default: benchmarks/results/teacher_knows/<task>.json)")
    p.add_argument("--table", action="store_true", help="render the JSONs under --results to markdown and exit")
    p.add_argument("--results", default=str(RESULTS), help="with --table: where the JSONs are")
    p.add_argument("--table-out", default=str(REPO / "benchmarks" / "results" / "teacher_knows.md"), help="with --table: the markdown file ('-': stdout only)")
    args = p.parse_args(argv)
    if args.table:
        text = table(Path(args.results))
        if args.table_out != "-":
            Path(args.table_out).write_text(text)
        print(text, end="")
        return 0
    contexts = [c for c in args.contexts.split(",") if c]
    bad = [c for c in contexts if c not in CONTEXTS]
    if bad:
        raise SystemExit(f"--contexts: unknown {', '.join(bad)}; choose from {', '.join(CONTEXTS)}")
    if args.task in TESTBEDS:
        spec, kwargs, desc = TESTBEDS[args.task]
        kwargs = dict(kwargs)
    else:
        spec, kwargs, desc = args.task, {}, args.task
    if args.level is not None:
        kwargs["difficulty"] = args.level
        desc = f"{desc}, level {args.level}"
    kwargs.update(json.loads(args.env_kwargs))

    import torch

    from recursa.config import load_config
    from recursa.envs import make_env
    from recursa.envs.base import EnvPool, split_seed, system_prompt_of
    from recursa.generation import SamplingParams
    from recursa.models import load_policy

    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    sets = ["model.name=tiny-random"] if args.tiny else ["model.name=smollm2-135m-instruct"]
    if args.warm_start:
        sets.append(f'init.from_run="{args.warm_start}"')
    sets += [f"sampling.temperature={args.temperature}", f"sampling.max_new_tokens={args.max_new_tokens}", "train.micro_batch_size=32",
             f"train.group_size={args.group_size}"]
    cfg = load_config(None, sets, recipe="rsipo")
    t0 = time.perf_counter()
    if args.warm_start:
        from recursa.recipes.common import init_weights_dir

        policy = load_policy(cfg.model, base_dir=init_weights_dir(cfg))
    else:
        policy = load_policy(cfg.model)
    load_s = round(time.perf_counter() - t0, 1)
    pool = EnvPool(lambda: make_env(spec, **kwargs))
    seeds = [split_seed("train", FIRST_SEED + k) for k in range(args.items)]
    system = system_prompt_of(pool.take(1)[0]) or cfg.model.system_prompt or None
    sampling = SamplingParams(args.max_new_tokens, args.temperature, 1.0, ())
    t0 = time.perf_counter()
    body = probe(policy, cfg, pool, seeds, args.group_size, contexts, sampling, system)
    total = round(time.perf_counter() - t0, 1)
    body["wall_s"]["load"], body["wall_s"]["total"] = load_s, total
    name = args.task.replace(":", "_") + (f"_level{args.level}" if args.level is not None else "") + ("_tiny" if args.tiny else "")
    record = {"testbed": name, "description": desc, "env": spec, "env_kwargs": kwargs, "model": cfg.model.name,
              "model_label": ("tiny" if args.tiny else "135M") + (f" from {args.warm_start}" if args.warm_start else ""),
              "warm_start": args.warm_start, "items": args.items, "group_size": args.group_size, "max_new_tokens": args.max_new_tokens,
              "temperature": args.temperature, "first_seed": FIRST_SEED, "advantage": cfg.algo.advantage, "prompts_per_step": cfg.train.prompts_per_step,
              "threads": args.threads,
              "command": "python benchmarks/teacher_knows.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "torch": torch.__version__, **body}
    out = Path(args.out) if args.out else RESULTS / f"{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {out} ({total} s after a {load_s} s load)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
