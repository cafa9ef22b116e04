"""Tests for recursa.envs: splits, answer parsing, the arithmetic env and the reasoning-gym adapter."""

from __future__ import annotations

import pytest

from recursa.envs import (
    SPLITS,
    Env,
    StepResult,
    extract_answer,
    last_number,
    list_envs,
    make_env,
    split_of,
    split_seed,
    split_seeds,
    system_prompt_of,
)
from recursa.envs.arithmetic import ArithmeticEnv, make_item
from recursa.errors import UserError

# ------------------------------------------------------------------------------- splits


def test_split_ranges_are_disjoint_and_split_of_inverts():
    assert SPLITS == ("train", "gate", "test")
    seen: dict[int, str] = {}
    for split in SPLITS:
        seeds = split_seeds(split, 50) + split_seeds(split, 5, start=999_999_995)
        for seed in seeds:
            assert seed not in seen
            seen[seed] = split
            assert split_of(seed) == split
    assert split_seed("train", 3) == 3
    assert split_seed("gate", 0) == 1_000_000_000
    assert split_seed("test", 7) == 2_000_000_007
    assert split_seeds("gate", 3, start=10) == [1_000_000_010, 1_000_000_011, 1_000_000_012]
    assert split_seeds("test", 0) == []


@pytest.mark.parametrize(
    "call",
    [
        lambda: split_seed("eval", 0),
        lambda: split_seed("train", -1),
        lambda: split_seed("train", 1_000_000_000),
        lambda: split_seeds("gate", 2, start=999_999_999),
        lambda: split_seeds("validation", 0),
        lambda: split_of(3_000_000_000),
        lambda: split_of(-5),
    ],
)
def test_bad_split_arguments_raise_user_error(call):
    with pytest.raises(UserError):
        call()


def test_unknown_split_lists_choices():
    with pytest.raises(UserError, match="train, gate, test"):
        split_seed("eval", 0)


# ------------------------------------------------------------------------- answer parsing


def test_extract_answer_takes_last_tag():
    assert extract_answer("<answer> 3 </answer> then <answer>\n42\n</answer>") == "42"
    assert extract_answer("no tag here 5") is None
    assert extract_answer("<answer></answer>") == ""
    assert extract_answer("<answer>unclosed") is None


@pytest.mark.parametrize(
    "text, expected",
    [
        ("The answer is 12.", "12"),
        ("1,000 apples", "1000"),
        ("it is -7", "-7"),
        ("x = -0", "0"),
        ("2.50 dollars", "2.5"),
        ("3.0", "3"),
        ("5-3", "3"),
        ("first 4 then 1,234,567", "1234567"),
        ("1, 2, 3", "3"),
        ("no digits", None),
        ("", None),
    ],
)
def test_last_number(text, expected):
    assert last_number(text) == expected


# ----------------------------------------------------------------------------- arithmetic


def test_arithmetic_items_are_deterministic_and_vary():
    for difficulty in range(5):
        items = [make_item(seed, difficulty) for seed in range(40)]
        assert items == [make_item(seed, difficulty) for seed in range(40)]
        assert len({item.question for item in items}) > 20
    a, b = ArithmeticEnv(difficulty=2), ArithmeticEnv(difficulty=2)
    assert a.reset(123) == b.reset(123)


def test_arithmetic_answers_match_the_question():
    for difficulty in range(5):
        for seed in range(200):
            item = make_item(seed, difficulty)
            assert eval(item.question) == item.answer  # the question is a plain Python expression


def test_arithmetic_difficulty_ranges():
    for seed in range(200):
        q0 = make_item(seed, 0)
        a, b = (int(x) for x in q0.question.split(" + "))
        assert 0 <= a <= 9 and 0 <= b <= 9
        q1 = make_item(seed, 1)
        assert all(10 <= int(x) <= 99 for x in q1.question.replace("-", "+").split(" + "))
        assert q1.answer >= 0
        q3 = make_item(seed, 3)
        assert "(" in q3.question and q3.question.count(" ") == 4
        assert all(1 <= int(t.strip("()")) <= 20 for t in q3.question.split() if t.strip("()").isdigit())
        q4 = make_item(seed, 4)
        assert max(int(t.strip("()")) for t in q4.question.split() if t.strip("()").isdigit()) >= 10
    assert any(" * " in make_item(s, 2).question for s in range(50))
    assert any(make_item(s, 2).question.count(" ") == 4 for s in range(50))
    assert max(abs(make_item(s, 4).answer) for s in range(50)) > 1000


def _reply(env: ArithmeticEnv, seed: int, text: str) -> StepResult:
    env.reset(seed)
    return env.step(text)


def test_arithmetic_last_number_format():
    env = make_env("arithmetic", difficulty=1)
    assert isinstance(env, Env) and env.name == "arithmetic"
    obs = env.reset(5)
    assert obs.startswith("What is ") and obs.endswith("Reply with only the number.")
    answer = make_item(5, 1).answer
    good = _reply(env, 5, f"Let me think... so it is {answer}.")
    assert (good.reward, good.done, good.info["success"]) == (1.0, True, True)
    assert good.info["answer"] == str(answer) and good.info["parsed"] == str(answer)
    assert _reply(env, 5, f"{answer + 1}").reward == 0.0
    bad = _reply(env, 5, "I don't know")
    assert bad.reward == 0.0 and bad.info["parsed"] is None and bad.info["note"]


def test_arithmetic_tag_format():
    env = ArithmeticEnv(difficulty=0, answer_format="tag")
    answer = make_item(9, 0).answer
    assert "<answer>" in env.reset(9)
    assert _reply(env, 9, f"ok <answer> {answer} </answer>").reward == 1.0
    assert _reply(env, 9, f"{answer}").reward == 0.0  # tag required
    assert _reply(env, 9, f"<answer>{answer + 1}</answer>").reward == 0.0
    nonnum = _reply(env, 9, "<answer>seven</answer>")
    assert nonnum.reward == 0.0 and nonnum.info["parsed"] == "seven" and nonnum.info["note"]


def test_arithmetic_exact_format():
    env = ArithmeticEnv(difficulty=0, answer_format="exact")
    answer = make_item(2, 0).answer
    assert _reply(env, 2, f"  {answer}\n").reward == 1.0
    assert _reply(env, 2, f"The answer is {answer}").reward == 0.0
    assert _reply(env, 2, f"{answer + 1}").reward == 0.0
    empty = _reply(env, 2, "   ")
    assert empty.reward == 0.0 and empty.info["parsed"] is None


def test_arithmetic_prompt_template_and_system_prompt():
    env = ArithmeticEnv(prompt_template="Compute {question}.", system_prompt="Be brief.")
    assert env.reset(0) == f"Compute {make_item(0, 0).question}."
    assert system_prompt_of(env) == "Be brief."
    assert system_prompt_of(ArithmeticEnv()) is None


def test_arithmetic_step_needs_reset():
    env = ArithmeticEnv()
    with pytest.raises(RuntimeError):
        env.step("1")
    env.reset(0)
    env.step("1")
    with pytest.raises(RuntimeError):
        env.step("1")


@pytest.mark.parametrize(
    "kwargs",
    [
        {"difficulty": 5},
        {"difficulty": -1},
        {"difficulty": "2"},
        {"answer_format": "regex"},
        {"prompt_template": "no placeholder"},
        {"prompt_template": "{question} {other}"},
    ],
)
def test_arithmetic_bad_kwargs_raise_user_error(kwargs):
    with pytest.raises(UserError):
        ArithmeticEnv(**kwargs)


# ------------------------------------------------------------------------------- registry


def test_unknown_spec_raises_user_error():
    with pytest.raises(UserError, match="recursa envs"):
        make_env("arithmatic")
    with pytest.raises(UserError):
        make_env("gsm8k")


def test_list_envs_includes_builtins():
    rows = list_envs()
    assert rows[0][0] == "arithmetic"
    assert any(spec.startswith("rg:") for spec, _ in rows)
    assert all(isinstance(desc, str) and "\n" not in desc for _, desc in rows)


# ------------------------------------------------------------------------- reasoning-gym

RG_DATASETS = ["basic_arithmetic", "leg_counting", "spell_backward"]


@pytest.fixture
def rg():
    return pytest.importorskip("reasoning_gym")


@pytest.mark.parametrize("dataset", RG_DATASETS)
def test_reasoning_gym_scores_true_and_wrong_answers(rg, dataset):
    env = make_env(f"rg:{dataset}")
    assert env.name == f"rg:{dataset}"
    for seed in split_seeds("train", 3) + split_seeds("test", 2):
        obs = env.reset(seed)
        truth = rg.create_dataset(dataset, seed=seed, size=1)[0]
        assert obs.startswith(truth["question"].rstrip()) and "<answer></answer>" in obs
        good = env.step(f"Reasoning...\n<answer>{truth['answer']}</answer>")
        assert good.reward == 1.0 and good.done and good.info["success"]
        assert good.info["answer"] == truth["answer"] and good.info["note"] == ""
        env.reset(seed)
        bad = env.step("<answer>definitely wrong 0</answer>")
        assert bad.reward < 1.0 and not bad.info["success"]


def test_reasoning_gym_items_are_deterministic(rg):
    a, b = make_env("rg:chain_sum"), make_env("rg:chain_sum")
    seeds = split_seeds("train", 20)
    assert [a.reset(s) for s in seeds] == [b.reset(s) for s in seeds]
    assert len({a.reset(s) for s in seeds}) > 10
    # config kwargs change the item family
    wide = make_env("rg:chain_sum", min_terms=5, max_terms=5)
    assert wide.entry(3)["metadata"]["num_terms"] == 5


def test_reasoning_gym_matches_fresh_dataset_for_seed_dependent_constructor(rg):
    env = make_env("rg:gsm_symbolic")  # its constructor draws task templates from the seed
    assert not env._source.reseed
    for seed in (0, 5, 1_000_000_001):
        assert env.entry(seed)["question"] == rg.create_dataset("gsm_symbolic", seed=seed, size=1)[0]["question"]


def test_reasoning_gym_reseeding_matches_fresh_dataset(rg):
    env = make_env("rg:spell_backward")  # slow constructor (word list): built once, reseeded
    assert env._source.reseed
    for seed in (0, 17, 2_000_000_003):
        assert env.entry(seed) == rg.create_dataset("spell_backward", seed=seed, size=1)[0]


def test_reasoning_gym_falls_back_to_last_line(rg):
    env = make_env("rg:leg_counting")
    env.reset(4)
    answer = env.entry(4)["answer"]
    result = env.step(f"Counting legs...\n{answer}\n\n")
    assert result.reward == 1.0 and result.info["parsed"] == answer
    env.reset(4)
    empty = env.step("")
    assert empty.reward == 0.0 and empty.info["parsed"] is None


def test_reasoning_gym_scorer_error_gives_zero_with_note(rg, monkeypatch):
    env = make_env("rg:basic_arithmetic")
    env.reset(1)
    dataset_cls = type(env._current.dataset)

    def boom(self, answer, entry):
        raise ValueError("bad input")

    monkeypatch.setattr(dataset_cls, "score_answer", boom)
    result = env.step("<answer>1</answer>")
    assert result.reward == 0.0 and result.done and not result.info["success"]
    assert result.info["note"] == "scorer error: ValueError: bad input"


def test_reasoning_gym_success_threshold(rg):
    env = make_env("rg:spell_backward", success_threshold=0.5)
    env.reset(0)
    answer = env.entry(0)["answer"]
    result = env.step(f"<answer>{answer[:-1]}#</answer>")  # partial credit: all but one letter
    assert 0.5 <= result.reward < 1.0 and result.info["success"]


def test_reasoning_gym_user_errors(rg):
    with pytest.raises(UserError, match="rg:basic_arithmetic"):
        make_env("rg:basic_arithmetc")
    with pytest.raises(UserError, match="min_terms"):
        make_env("rg:basic_arithmetic", nonsense=1)
    with pytest.raises(UserError, match="seed"):
        make_env("rg:basic_arithmetic", seed=3)
    with pytest.raises(UserError):
        make_env("rg:basic_arithmetic", min_terms=5, max_terms=2)
    assert any("rg:" in spec for spec, _ in list_envs())


def test_core_works_without_reasoning_gym(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # makes `import reasoning_gym` fail
    assert make_env("arithmetic").name == "arithmetic"
    assert any("not installed" in desc for _, desc in list_envs())
    with pytest.raises(UserError, match="pip install"):
        make_env("rg:basic_arithmetic")
