"""benchmarks/teacher_knows.py (issue 44): its metrics against hand computations on a crafted
case, its worked solutions against the tasks' answers, and one run plus the table on the tiny
model.

The crafted case: a model with hand-set logits on the tiny model's tokenizer. Without the
teacher's context every next token is uniform (log p = -log V); once a token of the context
has been read, the logits are b, with b = s on a set R of tokens (the reference reply's) and
0 elsewhere, so log p(t) = b_t - log(|R| e^s + V - |R|). Everything the probe reports then
follows by hand."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent


def _tk():
    spec = importlib.util.spec_from_file_location("teacher_knows", REPO / "benchmarks" / "teacher_knows.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class _Decoder(torch.nn.Module):
    """Hidden state at position t: 1 in the last slot once a marker token has been read."""

    def __init__(self, vocab: int, markers: list[int]):
        super().__init__()
        self.vocab = vocab
        self.register_buffer("markers", torch.tensor(markers, dtype=torch.long))

    def forward(self, input_ids, attention_mask=None, use_cache=False, **_):
        seen = torch.isin(input_ids, self.markers).long().cummax(dim=1).values.float()  # (N, L)
        hidden = torch.zeros((*input_ids.shape, self.vocab + 1))
        hidden[..., self.vocab] = seen
        return SimpleNamespace(last_hidden_state=hidden)


class HandLM(torch.nn.Module):
    """logits = 0 before a marker, b after it (the lm head's last column)."""

    def __init__(self, vocab: int, markers: list[int], bonus: torch.Tensor):
        super().__init__()
        self.decoder = _Decoder(vocab, markers)
        self.head = torch.nn.Linear(vocab + 1, vocab, bias=False)
        with torch.no_grad():
            self.head.weight.zero_()
            self.head.weight[:, vocab] = bonus

    def get_decoder(self):
        return self.decoder

    def get_output_embeddings(self):
        return self.head


def _traj(prompt: list[int], actions: list[int], success: bool, group: int):
    from recursa.trajectory import Trajectory

    n = len(prompt) + len(actions)
    return Trajectory("hand", group, group, prompt + actions, [0] * len(prompt) + [1] * len(actions), [0.0] * n,
                      float(success), success, completion_text="", prompt_text="What is 2 + 3?")


@pytest.fixture(scope="module")
def case(tiny_policy):
    """Two items of G = 4 attempts each, the same question; item 0's first attempt is right."""
    from recursa.config import load_config
    from recursa.methods.attempts import Context, completion_attempts, user_message
    from recursa.models import Policy
    from recursa.rollout import render_prompt

    tok = tiny_policy.tokenizer
    cfg = load_config(None, ["model.name=tiny-random", "train.shared_prefix=false", "train.group_size=4"], recipe="rsipo")
    V = tiny_policy.causal_lm.config.vocab_size
    question, hint = "What is 2 + 3?", "A correct answer: 5"
    ref = tok.encode("5", add_special_tokens=False) + [tok.eos_token_id]
    assert len(ref) == 2 and len(set(ref)) == 2
    r0, eos = ref
    student_prompt = render_prompt(tok, question, None)
    teacher_prompt = render_prompt(tok, user_message(Context(None, question), cfg.agent, hint), None)
    x, y = [t for t in range(3, V) if t not in ref and t not in teacher_prompt][:2]  # two tokens outside R and the prompts
    markers = sorted(set(teacher_prompt) - set(student_prompt) - {r0, eos})  # read only in the teacher's prompt
    assert markers
    s = 2.0
    bonus = torch.zeros(V)
    bonus[ref] = s
    policy = Policy(HandLM(V, markers, bonus), tok, "hand")
    # item 0: right; diverges at 1 (eos vs x); diverges at 0 (r0 vs x); diverges at 0 (r0 vs eos, both in R)
    acts = [ref, [r0, x], [x, y], [eos, x]]
    wins = [True, False, False, False]
    trajs = [_traj(student_prompt, a, w, g) for g in range(2) for a, w in zip(acts, wins)]
    trajs[4].success = False  # item 1: all four fail
    attempts = completion_attempts(trajs, 0)
    lse = math.log(len(ref) * math.exp(s) + V - len(ref))
    return SimpleNamespace(policy=policy, cfg=cfg, trajs=trajs, attempts=attempts, ref=ref, hint=hint, s=s, V=V, lse=lse, acts=acts)


def test_first_divergence():
    tk = _tk()
    assert tk.first_divergence([1, 2, 3], [1, 2, 4]) == 2
    assert tk.first_divergence([5], [1, 2]) == 0
    assert tk.first_divergence([1, 2], [1, 2, 3]) is None  # a prefix: no divergent token
    assert tk.first_divergence([1, 2, 3], [1, 2]) is None


def test_gain_ranks_and_delta_on_the_hand_set_model(case):
    tk = _tk()
    G = 4
    per_item = [case.hint, case.hint]
    gains, ranks, md, centred, hinted = tk.score_context(case.policy, case.cfg, None, case.trajs, case.attempts, per_item,
                                                         [case.hint] * 8, [case.ref, case.ref], G)
    log_v = math.log(case.V)
    # (a) every reference token is in R: teacher s - lse, student -log V
    assert gains == pytest.approx([case.s - case.lse + log_v] * 2, abs=1e-5)
    # (b) item 0's three failed attempts, then item 1's (its first, the reference itself, has no
    # divergent token): the teacher prefers the reference token where it is in R and the sampled
    # one is not; the uniform student never strictly prefers
    assert [r["k"] for r in ranks] == [1, 0, 0, 1, 0, 0]
    assert [r["teacher"] for r in ranks] == [True, True, False, True, True, False]
    assert not any(r["student"] for r in ranks)
    # (c) mean token Delta = s * (share of the attempt's tokens in R) - lse + log V
    share = [1.0, 0.5, 0.0, 0.5]
    expect = [case.s * f - case.lse + log_v for f in share] * 2
    assert md == pytest.approx(expect, abs=1e-5)
    mean = sum(expect[:4]) / 4
    assert centred[:4] == pytest.approx([d - mean for d in expect[:4]], abs=1e-5)
    assert hinted == [True] * 8


def test_cached_student_scores_equal_the_library_teacher_logprobs(case):
    """attempt_logprobs with a student cache: the first context fills it, a second context
    (other hints, some None) reuses it; both equal `teacher_logprobs`, zeros where no hint."""
    from recursa.methods.teacher import teacher_logprobs

    tk = _tk()
    contexts = [a.contexts[0] for a in case.attempts]
    cache = {}
    for hints in ([case.hint] * 4 + [None] * 4, [None, "A correct answer: 7"] + [case.hint] * 6):
        t, s = tk.attempt_logprobs(case.policy, case.cfg, None, case.trajs, case.attempts, hints, cache)
        t0, s0 = teacher_logprobs(case.policy, case.trajs, contexts, hints, case.cfg, None)
        for a, b in zip(t + s, t0 + s0):
            assert torch.allclose(a, b, atol=1e-6)
        assert all(not x.any() for x, h in zip(t + s, hints * 2) if h is None)
    assert sorted(cache) == list(range(8))


def test_summary_of_the_crafted_case(case):
    """The whole summary: corr(Delta, A) over item 0 (item 1 is all-fail, A = 0) is corr(share in
    R, reward) = 0.5 / sqrt(0.5 x 0.75); trust follows the agreement trials by hand."""
    from recursa.algorithms.advantages import compute_advantages

    tk = _tk()
    G = 4
    per_item = [case.hint, case.hint]
    gains, ranks, md, centred, hinted = tk.score_context(case.policy, case.cfg, None, case.trajs, case.attempts, per_item,
                                                         [case.hint] * 8, [case.ref, case.ref], G)
    success = [t.success for t in case.trajs]
    adv = compute_advantages("grpo", torch.tensor([float(w) for w in success]).view(2, G)).flatten().tolist()
    e = tk.summarise_context("reference", per_item, gains, ranks, md, centred, adv, hinted, success, G, case.cfg, items_per_step=1)
    assert e["items"] == 2 and e["passes"]
    assert e["gain"] == pytest.approx(case.s - case.lse + math.log(case.V), abs=1e-5)
    assert e["gain_lo"] == pytest.approx(e["gain"], abs=1e-5) and e["gain_hi"] == pytest.approx(e["gain"], abs=1e-5)  # two equal items
    assert e["all_fail_items"] == 1
    assert e["divergent_failed"] == 6 and e["teacher_ranks_ref"] == pytest.approx(4 / 6) and e["student_ranks_ref"] == 0.0
    assert e["flips_to_ref"] == 4 and e["flips_away"] == 0
    assert e["corr"]["r"] == pytest.approx(0.5 / math.sqrt(0.5 * 0.75), abs=1e-6)
    assert e["corr"]["groups"] == 1 and e["corr"]["attempts"] == 4
    assert e["corr_centred"]["r"] == pytest.approx(e["corr"]["r"], abs=1e-6)  # one group: centring is a shift
    # trust, one item a step: step 1 (item 0) is applied at the cold trust 0, then its trials:
    # Delta > 0 for shares 1 and 0.5, < 0 for share 0 (s * 0 - lse + log V < 0); A > 0 for the win only:
    # agreements: the win and the share-0 loss, 2 of 4; item 1 has A = 0: no trials
    t = e["trust"]["none"]
    assert (t["agreements"], t["trials"], t["steps"]) == (2, 4, 2)
    # one group: the cold prior (1, 1); counts decayed once by 0.9 at step 2: (1.8 + 1) / (3.6 + 2) = 0.5
    assert t["posterior"] == pytest.approx((2 * 0.9 + 1) / (4 * 0.9 + 2))
    assert t["final"] == pytest.approx(0.0) and t["applied_mean"] == pytest.approx(0.0)


def test_grouped_corr_leaves_out_attempts_without_the_context():
    """G = 3. Group 0: A = (2, -1, -1), Delta = (1, 0, 2), all with the context; group 1 is
    all-fail (A = 0) and left out; group 2: its winner has no context (as `sibling` gives a
    group's only winner), its two losers Delta = (3, 1), A = -1. Kept pairs: (1, 2), (0, -1),
    (2, -1), (3, -1), (1, -1): Delta mean 7/5, A mean -2/5; cov sum = (-2/5)(12/5) +
    (-7/5)(-3/5) + (3/5)(-3/5) + (8/5)(-3/5) + (-2/5)(-3/5) = -6/5; Delta ss = 26/5,
    A ss = 36/5: r = -(6/5) / sqrt(26/5 x 36/5) = -6 / sqrt(936)."""
    tk = _tk()
    delta = [1.0, 0.0, 2.0, 5.0, 5.0, 5.0, 9.0, 3.0, 1.0]
    adv = [2.0, -1.0, -1.0, 0.0, 0.0, 0.0, 2.0, -1.0, -1.0]
    mask = [True] * 6 + [False, True, True]
    c = tk.grouped_corr(delta, adv, 3, mask=mask, n_boot=50)
    assert c["groups"] == 2 and c["attempts"] == 5
    assert c["r"] == pytest.approx(-6 / math.sqrt(936))
    assert c["lo"] is None  # fewer than 3 groups: no interval
    full = tk.grouped_corr(delta, adv, 3)  # without the mask the winner (9, 2) counts
    assert full["attempts"] == 6 and full["r"] > 0


def test_trust_simulation_by_hand():
    """G = 2, one item a step. Step 1: both agree -> r = (2 + 1) / (2 + 2), T = 0.5; step 2 is
    applied at 0.5, one of two agrees -> counts (1.8 + 1, 1.8 + 2), r = 3.8 / 5.8."""
    from recursa.config import load_config

    tk = _tk()
    cfg = load_config(None, [], recipe="rsipo")
    delta = [0.3, -0.2, 0.1, 0.4]
    adv = [1.0, -1.0, 1.0, -1.0]
    t = tk.simulate_trust(delta, adv, [True] * 4, "reference", 2, 1, cfg)
    assert (t["agreements"], t["trials"]) == (3, 4)
    assert t["applied_mean"] == pytest.approx((0.0 * 2 + 0.5 * 2) / 4)
    assert t["posterior"] == pytest.approx(3.8 / 5.8)
    assert t["final"] == pytest.approx(2 * 3.8 / 5.8 - 1)


def test_worked_solutions_end_in_the_answer():
    from recursa.envs import make_env

    tk = _tk()
    assert tk._place_value("63 - 28") == "63 - 28 = 63 - 20 - 8 = 43 - 8 = 35."
    assert tk._place_value("Calculate 722 + 330.") == "722 + 330 = 722 + 300 + 30 = 1022 + 30 = 1052."
    assert tk._place_value("(4 + 9) * 3") is None
    for spec, kwargs in [("arithmetic", {"difficulty": 1}), *[(tk.TESTBEDS[k][0], tk.TESTBEDS[k][1]) for k in ("add3", "leg_counting", "count_bits", "spell_backward")]]:
        env = make_env(spec, **kwargs)
        for seed in range(5):
            env.reset(seed)
            ref = env.reference()
            answer = ref.removeprefix("<answer>").removesuffix("</answer>")
            text = tk.worked_solution(env, seed)
            assert text is not None and text.endswith(f"The answer is {answer}."), (spec, seed, text)
            if spec == "arithmetic" or spec == "rg:basic_arithmetic":  # the steps' last number is the answer too
                assert text.split(" The answer")[0].rstrip(".").split()[-1] == answer


def test_a_tiny_run_and_its_table(tmp_path, capsys):
    tk = _tk()
    out = tmp_path / "runs" / "arith2_tiny.json"
    assert tk.main(["--tiny", "--task", "arith2", "--items", "3", "--group-size", "2", "--max-new-tokens", "4", "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["items"] == 3 and r["group_size"] == 2 and r["attempts"] == 6
    assert set(r["contexts"]) == {"reference", "worked", "wrong", "sibling"}
    ref = r["contexts"]["reference"]
    assert ref["items"] == 3 and ref["passes"] == (ref["gain_lo"] > 0)
    assert {"sample", "reference", "load", "total"} <= set(r["wall_s"])
    md = tmp_path / "table.md"
    assert tk.main(["--table", "--results", str(out.parent), "--table-out", str(md)]) == 0
    text = md.read_text()
    assert sum(line.startswith("| arith2_tiny | tiny | 3 x 2 |") for line in text.splitlines()) == 4  # one row per context
    assert "- `arith2_tiny`: `python benchmarks/teacher_knows.py --tiny" in text and "Note:" not in text
