"""Gated weights for the recipes: keep a change to the policy only on held-out evidence.

Every `gate.every` steps (rounds, for expert iteration) and at the end of training, the
current weights are a *candidate* against the *incumbent*, the last accepted weights:

    seeds      <- n fresh gate-split items (round t takes block t of the gate split, so no
                  item is ever scored twice across rounds)
    scores     <- greedy evaluation of the candidate, then of the incumbent (its weights
                  are loaded into the same model, and published to the run's rollout
                  engine when it keeps its own copy, e.g. vLLM), on those items
    decision   <- recursa.gate.binary_gate: exact one-sided McNemar p <= alpha_t (basel
                  spending across rounds by default), net gain >= delta, regression budget
    accepted   -> the candidate becomes the incumbent: its weights and optimizer state
                  are saved under RUN_DIR/incumbents/step_XXXXXX
    rejected   -> mode "gate": weights and optimizer roll back to the incumbent and
                  training continues from there; mode "log": recorded only
    lineage    <- every candidate, its statistics and the decision (recursa.lineage, in
                  the run's ledger.sqlite); `recursa lineage RUN_DIR` draws the tree

Test-split evaluations of a gated run are recorded as *looks* (paired against the
evaluation before training, with the gain's interval), capped by `gate.max_test_looks`.

Prompt proposals (`PromptGate`) and changes to RSIPO's skill library (`SkillGate`) are
gated the same way, each on its own region of the gate split (weights rounds from index 0,
prompt rounds from 500_000_000, skills rounds from 750_000_000), each with its own alpha
spending over its rounds, all recorded in the same lineage.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Callable

import torch

from recursa.envs import EnvPool
from recursa.errors import UserError
from recursa.evaluate import EvalResult, evaluate
from recursa.gate import GateConfig, binary_gate, fresh_gate_seeds
from recursa.lineage import Lineage
from recursa.models import Policy, restore_weights
from recursa.runio import inside_tree
from recursa.stats import paired_compare
from recursa.skills.sanitize import sanitize
from recursa.store import RunStore, load_optimizer, write_weights


def gate_config(gc) -> GateConfig:
    """The statistical test's settings from a config's [gate] section."""
    return GateConfig(
        alpha=gc.alpha, delta=gc.delta, max_regressions=gc.max_regressions, regression_rate=gc.regression_rate,
        regression_confidence=gc.regression_confidence, spending=gc.spending,
    )


class WeightsGate:
    """The weights gate of one run; `check` runs one round."""

    def __init__(self, cfg, store: RunStore, pool: EnvPool, start_step: int, log: Callable[[str], None] = print,
                 hints: Callable[[list[int]], list[str | None]] | None = None, engine=None):
        """`hints`: seeds -> the hint each gate item is shown with (RSIPO's skills.in_context:
        both weights are evaluated with the run's current skill library in context).
        `engine`: the run's rollout engine (None: native); it decodes the gate items and gets
        the weights published whenever a round swaps them."""
        gc = cfg.gate
        self.cfg, self.store, self.pool, self.log, self.hints, self.engine = cfg, store, pool, log, hints, engine
        num_items = getattr(pool.take(1)[0], "num_items", None)  # a finite task (a dataset's rows)
        if callable(num_items) and gc.n > num_items("gate"):
            raise UserError(
                f"gate.n = {gc.n}, but the task has {num_items('gate')} gate items: a round would score some twice, which the paired test "
                "counts as independent evidence; lower gate.n, or give the gate more rows (data.gate_frac, data.split_key)"
            )
        self.gate_cfg = gate_config(gc)
        self.lineage = Lineage(store.db)
        self.lineage.truncate_after(start_step)  # a resumed run forgets rounds after its checkpoint

    # ---- the incumbent on disk ------------------------------------------------------
    def _dir(self, step: int) -> Path:
        return self.store.path / "incumbents" / f"step_{step:06d}"

    def _save(self, step: int, policy: Policy, optimizer: torch.optim.Optimizer) -> Path:
        return write_weights(self._dir(step), policy, optimizer)

    def start(self, policy: Policy, optimizer: torch.optim.Optimizer, summary: str) -> None:
        """Record the initial weights as the root incumbent (once per run)."""
        if not self.lineage.candidates("weights"):
            path = self._save(0, policy, optimizer)
            self.lineage.root("weights", summary, {"dir": str(path.relative_to(self.store.path))}, step=0)

    # ---- one round ------------------------------------------------------------------
    def check(self, policy: Policy, optimizer: torch.optim.Optimizer, step: int, progress=None) -> dict:
        """Gate the current weights at `step`; returns gate/* metrics. With mode "gate", a
        rejection leaves `policy` and `optimizer` at the incumbent's state."""
        gc = self.cfg.gate
        incumbent = self.lineage.incumbent("weights")
        inc_dir = inside_tree(self.store.path, self.store.path / incumbent.payload["dir"])  # the ledger's dir, and every file of it, inside the run (issue 49)
        if not (inc_dir / "optimizer.pt").exists():
            raise UserError(f"the incumbent's weights {inc_dir} are missing: the run directory was pruned; start the run again")
        t = len(self.lineage.candidates("weights"))  # the root plus t - 1 earlier rounds
        # block t - 1 of the gate split: disjoint across rounds, and after the held-out items when
        # the run evaluates on the gate split (a pilot), so the gate never selects on them
        held_out = self.cfg.eval.n if self.cfg.eval.split == "gate" else 0
        seeds = fresh_gate_seeds(t - 1, gc.n, set(), start=held_out)
        cand = self._score(policy, seeds, f"gate candidate @ {step}", progress)
        trainable = {k: v.detach().clone() for k, v in policy.model.state_dict().items()}
        restore_weights(policy, inc_dir)
        self._publish(policy)
        inc = self._score(policy, seeds, f"gate incumbent @ {step}", progress)
        inc_ok = {i.seed: i.success for i in inc.items}
        decision = binary_gate([inc_ok[i.seed] for i in cand.items], [i.success for i in cand.items], self.gate_cfg, t=t)
        keep_candidate = decision.accepted or gc.mode == "log"
        if keep_candidate:
            policy.model.load_state_dict(trainable)
            self._publish(policy)
        else:
            load_optimizer(optimizer, inc_dir / "optimizer.pt")
        payload = {"seeds": [seeds[0], seeds[-1]]}
        if decision.accepted:
            payload["dir"] = str(self._save(step, policy, optimizer).relative_to(self.store.path))
        self.lineage.record("weights", incumbent.id, step, f"weights after step {step}", payload, decision)
        verdict = "accepted" if decision.accepted else ("rejected, kept (log mode)" if keep_candidate else "rejected, rolled back")
        self.log(
            f"gate @ {step}: incumbent {inc.success_rate:.3f} -> candidate {cand.success_rate:.3f} on {gc.n} fresh gate items, "
            f"b={decision.b} c={decision.c} p={decision.p_value:.3g} (alpha_t {decision.alpha_t:.3g}): {verdict}"
        )
        return {
            "gate/accepted": float(decision.accepted), "gate/rolled_back": float(not keep_candidate), "gate/p_value": decision.p_value,
            "gate/alpha_t": decision.alpha_t, "gate/gain": decision.gain, "gate/incumbent_rate": inc.success_rate,
            "gate/candidate_rate": cand.success_rate, "gate/regressions": decision.c, "time/gate_s": cand.seconds + inc.seconds,
        }

    def _publish(self, policy: Policy) -> None:
        if self.engine is not None:
            self.engine.load_weights(policy)

    def _score(self, policy: Policy, seeds: list[int], label: str, progress) -> EvalResult:
        cfg = self.cfg
        return evaluate(
            policy, self.pool, cfg.env.name, "gate", len(seeds), cfg.eval.max_new_tokens or cfg.sampling.max_new_tokens,
            cfg.model.system_prompt or None, batch_size=cfg.eval.batch_size, stop=tuple(cfg.sampling.stop), label=label,
            progress=(lambda d, n: progress(label, d, n)) if progress else None, agent=cfg.agent, seeds=seeds,
            hints=self.hints(seeds) if self.hints is not None else None, engine=self.engine,
        )

    # ---- test-split looks -----------------------------------------------------------
    def look(self, step: int, label: str, before: EvalResult | None, now: EvalResult) -> None:
        """Record a test-split evaluation as a look, paired against the one before training."""
        if before is None:
            return
        prior = {i.seed: i.success for i in before.items}
        common = [i for i in now.items if i.seed in prior]
        if not common:
            return
        cmp = paired_compare([prior[i.seed] for i in common], [i.success for i in common])
        self.lineage.record_test_look(
            step, label, cmp["n"], cmp["before_rate"], cmp["after_rate"], cmp["diff_ci95"], cmp["p_greater"], self.cfg.gate.max_test_looks
        )


# ------------------------------------------------------------------------------ prompts

PROMPT_MARKER = "INSTRUCTION:"
PROMPT_GATE_BASE = 500_000_000  # prompt rounds draw gate items from the upper half of the gate split


def prompt_proposal_request(current: str, failures: list[tuple[str, str]], max_chars: int) -> str:
    """The user message asking the policy for a revised prompt, shown its recent failures
    as (what it was asked, what it answered) pairs."""
    lines = ["You write the instruction given to an AI agent.", f"Current instruction: {current.strip() or '(none)'}", ""]
    lines.append("Cases where the agent failed:")
    for asked, answered in failures:
        lines.append(f"- Asked: {_squash(asked, 300)}")
        lines.append(f"  Answered: {_squash(answered, 120)}")
    lines += ["", f"Write one improved instruction (at most {max_chars} characters) that would help the agent succeed.",
              f"Reply with one line that starts with {PROMPT_MARKER}"]
    return "\n".join(lines)


def parse_prompt_proposal(reply: str, max_chars: int) -> str | None:
    """The proposed instruction, or None when the reply is malformed (same checks as a
    written skill: letters, ASCII, length, no repetition). Never raises."""
    from recursa.skills import parse_skill

    text = reply if isinstance(reply, str) else ""
    at = text.upper().find(PROMPT_MARKER)
    if at >= 0:
        text = text[at + len(PROMPT_MARKER) :]
    parsed = parse_skill(text, max_words=max_chars, max_chars=max_chars)
    return parsed.text if parsed.valid else None


def _squash(text: str, limit: int) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


class PromptGate:
    """Prompt proposals by the policy itself (the harness step of Self-HPO), admitted only
    by the gate. The revised text is the games' agent instruction (`agent.instruction`,
    the last line of every turn's prompt) or, for single-turn tasks, the system prompt
    (`model.system_prompt`; an env's own system prompt still takes precedence).

    A round: the policy reads its recent failures and samples `prompt_candidates`
    proposals; malformed or unchanged ones are dropped; the best proposal on
    `prompt_select_n` training items (greedy) is then scored with the incumbent prompt on
    `gate.n` fresh gate items (never used for selection) and gated like weights. An
    admitted prompt is written into the run's config object, so rollouts, evaluations and
    the weights gate all use it from then on; a resumed run restores it from the lineage.
    With `hints` (RSIPO's skills.in_context) every item is scored with the hint the policy
    is shown for it, so a prompt is judged as the policy meets it.
    """

    def __init__(self, cfg, store: RunStore, pool: EnvPool, lineage: Lineage, multi_turn: bool, log: Callable[[str], None] = print, engine=None,
                 hints: Callable[[list[int]], list[str | None]] | None = None):
        gc = cfg.gate
        self.cfg, self.store, self.pool, self.lineage, self.multi_turn, self.log = cfg, store, pool, lineage, multi_turn, log
        self.engine = engine  # the run's rollout engine (None: native): samples proposals, decodes the gate items
        self.hints = hints
        self.gate_cfg = gate_config(gc)
        if not lineage.candidates("prompt"):
            lineage.root("prompt", _squash(self.text, 80), {"text": self.text}, step=0)
        if gc.mode == "gate":
            self._apply(sanitize(str(lineage.incumbent("prompt").payload["text"]), one_line=False))  # the admitted prompt, also after a resume

    @property
    def text(self) -> str:
        return self.cfg.agent.instruction if self.multi_turn else (self.cfg.model.system_prompt or "")

    def _apply(self, text: str) -> None:
        if self.multi_turn:
            self.cfg.agent.instruction = text
        else:
            self.cfg.model.system_prompt = text

    def _score(self, policy: Policy, text: str, split: str, seeds: list[int], label: str) -> EvalResult:
        cfg = self.cfg
        agent = cfg.agent.model_copy(update={"instruction": text}) if self.multi_turn else cfg.agent
        system_prompt = cfg.model.system_prompt if self.multi_turn else text
        return evaluate(
            policy, self.pool, cfg.env.name, split, len(seeds), cfg.eval.max_new_tokens or cfg.sampling.max_new_tokens,
            system_prompt or None, batch_size=cfg.eval.batch_size, stop=tuple(cfg.sampling.stop), label=label, agent=agent, seeds=seeds,
            hints=self.hints(seeds) if self.hints is not None else None, engine=self.engine,
        )

    def propose(self, policy: Policy, failures: list[tuple[str, str]], generator: torch.Generator) -> tuple[list[str], int]:
        """Sampled proposals (valid, distinct, different from the current prompt) and the
        number of replies dropped as malformed."""
        from recursa.engines import NativeEngine
        from recursa.generation import SamplingParams
        from recursa.rollout import render_prompt

        gc = self.cfg.gate
        request = prompt_proposal_request(self.text, failures, gc.prompt_max_chars)
        ids = render_prompt(policy.tokenizer, request, None)
        params = SamplingParams(max(16, gc.prompt_max_chars // 3), 1.0)
        samples = (self.engine or NativeEngine(policy)).generate([ids], params, n=gc.prompt_candidates, generator=generator)
        out, dropped = [], 0
        for s in samples:
            text = parse_prompt_proposal(policy.tokenizer.decode(s.token_ids, skip_special_tokens=True), gc.prompt_max_chars)
            if text is None:
                dropped += 1
            elif text != self.text and text not in out:
                out.append(text)
        return out, dropped

    def check(self, policy: Policy, step: int, failures: list[tuple[str, str]], generator: torch.Generator) -> dict:
        """One prompt round at `step`; returns prompt/* metrics."""
        from recursa.envs.base import split_seed

        gc = self.cfg.gate
        proposals, dropped = self.propose(policy, failures, generator)
        metrics = {"prompt/proposals": float(len(proposals)), "prompt/malformed": float(dropped)}
        if not proposals:
            self.log(f"prompt round @ {step}: no usable proposal ({dropped} malformed)")
            return metrics
        rng_seeds = torch.randint(0, 10_000_000, (gc.prompt_select_n,), generator=generator, device="cpu").tolist()  # the step generator lives on the CPU
        select = [split_seed("train", int(s)) for s in rng_seeds]
        scored = [(self._score(policy, p, "train", select, "prompt selection").success_rate, i, p) for i, p in enumerate(proposals)]
        best_rate, _, best = max(scored, key=lambda x: (x[0], -x[1]))
        t = len(self.lineage.candidates("prompt"))  # the root plus t - 1 earlier rounds
        seeds = [split_seed("gate", PROMPT_GATE_BASE + (t - 1) * gc.n + i) for i in range(gc.n)]
        cand = self._score(policy, best, "gate", seeds, "prompt candidate")
        inc = self._score(policy, self.text, "gate", seeds, "prompt incumbent")
        inc_ok = {i.seed: i.success for i in inc.items}
        decision = binary_gate([inc_ok[i.seed] for i in cand.items], [i.success for i in cand.items], self.gate_cfg, t=t)
        incumbent = self.lineage.incumbent("prompt")
        self.lineage.record("prompt", incumbent.id, step, _squash(best, 80), {"text": best, "selection_rate": best_rate, "seeds": [seeds[0], seeds[-1]]}, decision)
        adopted = decision.accepted and gc.mode == "gate"
        if adopted:
            self._apply(best)
        self.log(
            f"prompt round @ {step}: {best!r} ({best_rate:.2f} on {gc.prompt_select_n} training items) vs the current prompt on {gc.n} fresh gate items: "
            f"{inc.success_rate:.3f} -> {cand.success_rate:.3f}, p={decision.p_value:.3g}: {'adopted' if adopted else 'rejected' if not decision.accepted else 'accepted, not adopted (log mode)'}"
        )
        metrics.update({
            "prompt/accepted": float(decision.accepted), "prompt/p_value": decision.p_value, "prompt/gain": decision.gain,
            "prompt/selection_rate": best_rate, "prompt/incumbent_rate": inc.success_rate, "prompt/candidate_rate": cand.success_rate,
        })
        return metrics


# ------------------------------------------------------------------------------ skills

SKILLS_GATE_BASE = 750_000_000  # skill rounds screen gate items from here: weights rounds start at 0, prompt rounds at 500_000_000
_COUNTERS = ("uses", "last_used_step", "trust_successes", "trust_trials")  # usage and trust, kept through a revert


def draw_probes(screened: list[tuple[int, bool]], n: int) -> tuple[list[int], list[int]]:
    """The probes of a skills round from the screening block's (seed, incumbent solved)
    pairs, in block order: the first n - n // 2 seeds the incumbent failed and the first
    n // 2 it solved. A side that runs short gives all it has and the other side does not
    make up for it, so a round may test fewer than n probes (all of them on one side when
    the incumbent solves everything or nothing). Block order is seed order, which the
    tasks do not depend on, so the first ones are as good as a random draw."""
    failed = [s for s, ok in screened if not ok][: n - n // 2]
    solved = [s for s, ok in screened if ok][: n // 2]
    return failed, solved


def stratified_gain(screen_failed: int, screen_solved: int, inc: dict[int, bool], cand: dict[int, bool], failed: list[int], solved: list[int]) -> float:
    """The change in success rate the candidate brings over the whole screened population:
    w_f mean(cand - inc | failed probes) + w_s mean(cand - inc | solved probes), with w the
    share of each side in the screen (a side without probes has weight 0). Half-and-half
    probes over-weight the smaller side: (b - c) / n alone can be positive while this is
    negative (an incumbent solving 90% that gains 20% of its failures and loses 5% of its
    successes loses 2.5 points overall)."""
    total = screen_failed + screen_solved
    gain = 0.0
    for weight, side in ((screen_failed / total, failed), (screen_solved / total, solved)):
        if side:
            gain += weight * sum(int(cand[s]) - int(inc[s]) for s in side) / len(side)
    return gain


class SkillGate:
    """Changes to the RSIPO skill library admitted only by the gate, as in GRASP.

    What is measured: with `skills.in_context` the policy is shown its library's best skill
    for each task in its own prompts, so a library is as good as the policy is with it in
    context; a change is gated by evaluating the same weights with the incumbent library and
    with the candidate library on the same gate items. (Without in_context the library only
    feeds the self-teacher during training and never reaches the policy at evaluation, so
    there is no held-out test of it: the config refuses gate.skills_every without it.)

    A round (every `gate.skills_every` steps and at the end, right after the step's skills
    are written and before the teacher uses them):

        candidate  <- the live library: the incumbent plus every skill admitted (edited,
                      removed) since the last round; no change, no round
        screen     <- the incumbent library in context on `gate.skills_screen` fresh gate
                      items (the next unused block from index 750_000_000 of the gate split)
        probes     <- `draw_probes`: half items the incumbent failed, half it solved (fewer
                      when a side runs short); the solved half is what gives the regression
                      budget something to count
        scores     <- greedy evaluation with the incumbent library, then the candidate
                      library, on the probes; the screening scores picked the probes and are
                      never reused as the incumbent's scores
        decision   <- binary_gate (exact McNemar, alpha spending over skills rounds, delta,
                      regression budget), and the screen-weighted gain `stratified_gain`
                      >= delta (half-and-half probes alone can accept a change that lowers
                      the overall success rate)
        accepted   -> the live library becomes the incumbent
        rejected   -> mode "gate": the library goes back to the incumbent (usage and trust
                      counts kept; a rejected new skill stays as a removed row, so no skill
                      id is ever reused); mode "log": recorded only
        lineage    <- kind "skills": the added and removed skills, the screen block, the
                      probes and the decision

    Between rounds (skills_every > 1) the pending skills are in the library, so the teacher
    and the in-context prompts already use them until a rejection takes them out. The
    incumbent snapshot is stored with each checkpoint, so a resumed run goes on from the
    same incumbent; the lineage is the run's (truncated once per run by the WeightsGate).
    """

    def __init__(self, cfg, pool: EnvPool, lineage: Lineage, library, hints: Callable, incumbent: list[dict] | None = None,
                 log: Callable[[str], None] = print, engine=None):
        gc = cfg.gate
        self.cfg, self.pool, self.lineage, self.library, self.hints, self.log = cfg, pool, lineage, library, hints, log
        self.engine = engine  # the run's rollout engine (None: native), decodes the probes
        self.gate_cfg = gate_config(gc)
        self.incumbent: list[dict] = library.snapshot() if incumbent is None else incumbent
        if not lineage.candidates("skills"):
            active = library.active()
            lineage.root("skills", f"{len(active)} skills", {"active": [s.id for s in active]}, step=0)

    # ---- the libraries ----------------------------------------------------------------
    def _incumbent_library(self):
        from recursa.skills import SkillLibrary

        lib = SkillLibrary(":memory:")
        lib.restore(self.incumbent)
        return lib

    def pending(self) -> tuple[list, list]:
        """(added, removed): active skills of the live library that the incumbent lacks, and
        the incumbent's active skills the live library no longer has (an edit is both)."""
        lib = self._incumbent_library()
        before = {s.id: s for s in lib.active()}
        lib.close()
        now = {s.id: s for s in self.library.active()}
        return [s for i, s in now.items() if i not in before], [s for i, s in before.items() if i not in now]

    def _revert(self, step: int) -> None:
        """Back to the incumbent: its rows with today's usage and trust counts, plus every
        new skill since, kept as a row removed at `step` (provenance; ids are not reused).
        An edit's new version is dropped (the recipe writes no edits)."""
        now = {r["id"]: r for r in self.library.snapshot()}
        kept = {r["id"] for r in self.incumbent}
        rows = [{**r, **{k: now[r["id"]][k] for k in _COUNTERS}} if r["id"] in now else r for r in self.incumbent]
        rows += [{**r, "removed_step": step if r["removed_step"] is None else r["removed_step"]}
                 for i, r in now.items() if i not in kept and r["parent_id"] is None]
        self.library.restore(rows)

    def _score(self, policy: Policy, library, seeds: list[int], label: str) -> EvalResult:
        cfg = self.cfg
        return evaluate(
            policy, self.pool, cfg.env.name, "gate", len(seeds), cfg.eval.max_new_tokens or cfg.sampling.max_new_tokens,
            cfg.model.system_prompt or None, batch_size=cfg.eval.batch_size, stop=tuple(cfg.sampling.stop), label=label,
            agent=cfg.agent, seeds=seeds, hints=self.hints(library, seeds), engine=self.engine,
        )

    def _screen_block(self) -> list[int]:
        """The next unused block of the skills region of the gate split."""
        from recursa.envs.base import split_seed

        gc = self.cfg.gate
        size = gc.skills_screen or 2 * gc.n
        used = [c.payload["screen"][1] for c in self.lineage.candidates("skills") if not c.is_root]
        start = (max(used) - split_seed("gate", 0) + 1) if used else SKILLS_GATE_BASE
        return [split_seed("gate", start + i) for i in range(size)]

    # ---- one round ----------------------------------------------------------------------
    def check(self, policy: Policy, step: int) -> dict:
        """Gate the library's changes since the last round at `step`; returns skills/gate_*
        metrics ({} when nothing changed). With mode "gate", a rejection leaves the library
        at the incumbent."""
        gc = self.cfg.gate
        added, removed = self.pending()
        if not added and not removed:
            return {}
        t = len(self.lineage.candidates("skills"))  # the root plus t - 1 earlier rounds
        block = self._screen_block()
        incumbent_lib = self._incumbent_library()
        screen = self._score(policy, incumbent_lib, block, f"skills screen @ {step}")
        screened = [(i.seed, i.success) for i in screen.items]
        failed, solved = draw_probes(screened, gc.n)
        probes = failed + solved
        inc = self._score(policy, incumbent_lib, probes, f"skills incumbent @ {step}")
        incumbent_lib.close()
        cand = self._score(policy, self.library, probes, f"skills candidate @ {step}")
        inc_ok, cand_ok = {i.seed: i.success for i in inc.items}, {i.seed: i.success for i in cand.items}
        decision = binary_gate([inc_ok[s] for s in probes], [cand_ok[s] for s in probes], self.gate_cfg, t=t)
        n_solved = sum(ok for _, ok in screened)
        weighted = stratified_gain(len(screened) - n_solved, n_solved, inc_ok, cand_ok, failed, solved)
        if weighted < gc.delta:
            note = f"screen-weighted gain {weighted:.4f} < delta {gc.delta:g}"
            decision = replace(decision, accepted=False, reason=f"rejected: {note}" if decision.accepted else f"{decision.reason}; {note}")
        keep = decision.accepted or gc.mode == "log"
        payload = {
            "added": [{"id": s.id, "text": s.text} for s in added], "removed": [{"id": s.id, "text": s.text} for s in removed],
            "screen": [block[0], block[-1]], "screen_solved": n_solved, "probes_failed": failed, "probes_solved": solved,
            "weighted_gain": weighted,
        }
        summary = " ".join([f"+{len(added)}"] + ([f"-{len(removed)}"] if removed else []) + [_squash(added[0].text if added else removed[0].text, 60)])
        incumbent = self.lineage.incumbent("skills")
        self.lineage.record("skills", incumbent.id, step, summary, payload, decision)
        if decision.accepted:
            self.incumbent = self.library.snapshot()
        elif not keep:
            self._revert(step)
        verdict = "accepted" if decision.accepted else ("rejected, kept (log mode)" if keep else "rejected, library restored")
        self.log(
            f"skills gate @ {step}: +{len(added)} -{len(removed)} skills; incumbent {inc.success_rate:.3f} -> candidate {cand.success_rate:.3f} "
            f"on {len(failed)} failed + {len(solved)} solved probes (screen {n_solved}/{len(screened)}), b={decision.b} c={decision.c} "
            f"p={decision.p_value:.3g} (alpha_t {decision.alpha_t:.3g}), screen-weighted gain {weighted:.3f}: {verdict}"
        )
        return {
            "skills/gate_accepted": float(decision.accepted), "skills/gate_restored": float(not keep), "skills/gate_p_value": decision.p_value,
            "skills/gate_gain": decision.gain, "skills/gate_weighted_gain": weighted, "skills/gate_regressions": decision.c,
            "skills/gate_incumbent_rate": inc.success_rate, "skills/gate_candidate_rate": cand.success_rate,
            "skills/gate_probes_failed": float(len(failed)), "skills/gate_probes_solved": float(len(solved)),
            "skills/gate_screen_rate": n_solved / len(screened), "time/skills_gate_s": screen.seconds + inc.seconds + cand.seconds,
        }
