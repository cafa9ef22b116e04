"""The documentation stays true to the code: the generated configuration reference is
current, the metrics glossary names every key the recipes write (and nothing they do not),
every table on the results page carries the command that reproduces it, and the README's
links resolve."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from recursa import docs_gen
from recursa.config import load_config

ROOT = Path(__file__).resolve().parents[1]
GLOSSARY = ROOT / "docs" / "reference" / "metrics.md"

# ----------------------------------------------------------------------------- config reference


def test_config_reference_is_current():
    committed = (ROOT / "docs" / "reference" / "config.md").read_text()
    assert committed == docs_gen.render(), "docs/reference/config.md is stale: run `python -m recursa.docs_gen`"


def test_config_reference_lists_every_key():
    page = docs_gen.render()
    for line in docs_gen._HEADER.splitlines()[:1]:
        assert line in page
    from recursa.config import RECIPES

    def keys(model, prefix=""):
        for name, field in model.model_fields.items():
            sub = docs_gen._model_of(field.annotation)
            if sub is not None:
                yield from keys(sub, f"{prefix}{name}.")
                if name != "lora":
                    continue
            yield prefix, name

    for model in RECIPES.values():
        for prefix, name in keys(model):
            if name == "recipe":
                continue
            section = prefix.rstrip(".") or name  # a top-level table of tables ([methods]) is its own section
            start = page.index("{#" + section.replace(".", "") + "}")
            end = page.find("\n## ", start + 1)
            assert f"| `{name}` |" in page[start:end], f"{section}.{name} missing from its section"


def test_docs_gen_check_flags_a_stale_page(tmp_path, capsys):
    page = tmp_path / "config.md"
    assert docs_gen.main(["--out", str(page)]) == 0
    assert docs_gen.main(["--out", str(page), "--check"]) == 0
    page.write_text(page.read_text().replace("adapter rank", "adapter size"))
    assert docs_gen.main(["--out", str(page), "--check"]) == 1
    assert "stale" in capsys.readouterr().err


def test_config_reference_renders_arrays_of_tables_and_required_keys(monkeypatch):
    from pydantic import BaseModel, ConfigDict, Field

    class Reward(BaseModel):
        """A reward function."""

        model_config = ConfigDict(extra="forbid")
        func: str = Field(description="module:function")
        weight: float = Field(1.0, gt=0, description="its weight")

    class Toy(BaseModel):
        model_config = ConfigDict(extra="forbid")
        recipe: str = "toy"
        reward: list[Reward] = Field(default_factory=list, description="reward functions")

    monkeypatch.setattr(docs_gen, "RECIPES", {"toy": Toy})
    page = docs_gen.render()
    assert "## `[[reward]]` {#reward}" in page and "| [`[[reward]]`](#reward) | yes |" in page
    assert "one `[[reward]]` table per entry" in page
    assert "| `func` | string | *required* | module:function |" in page
    assert "| `weight` | float, > 0 | `1.0` | its weight |" in page


def test_config_reference_escapes_markdown():
    assert docs_gen._escape("rg:<dataset> a_b | c `x|y_z`") == "rg:&lt;dataset&gt; a\\_b \\| c `x|y_z`"
    assert docs_gen._toml_value({"a": [1, "b"], "c": None}) == '{a = [1, "b"], c = *none*}'


# ----------------------------------------------------------------------------- metrics glossary


def glossary_patterns() -> dict[str, re.Pattern]:
    """Every key named in the first column of the glossary's tables -> a regex (a name in
    angle brackets matches one path segment)."""
    found = {}
    for line in GLOSSARY.read_text().splitlines():
        if not line.startswith("| `"):
            continue
        first = line.split(" | ")[0]
        for key in re.findall(r"`([^`]+)`", first):
            parts = re.split(r"(<[^>]+>)", key)
            found[key] = re.compile("".join("[^/]+" if p.startswith("<") else re.escape(p) for p in parts) + r"\Z")
    return found


def _covered(key: str, patterns: dict[str, re.Pattern]) -> bool:
    return any(p.match(key) for p in patterns.values())


HOUSEHOLD = 'env.kwargs={rooms = 1, objects_per_room = 2, distractors = 0, tasks = "pick_and_place", max_steps = 4}'
FAST = ["model.name=tiny-random", "run.threads=1", "sampling.max_new_tokens=5"]
# Tiny runs that between them switch on every optional metric group the CPU can reach
# (not Ray's distributed/* and time/weights_s: the static check below covers those).
RUNS = {
    "grpo, single-turn, gated, prompt rounds, KL, TIS": ("examples/smoke.toml", None, [
        *FAST, "train.steps=2", "eval.n=4", "eval.every=1", "gate.mode=gate", "gate.every=1", "gate.n=4", "gate.prompt_every=1",
        "gate.prompt_candidates=1", "gate.prompt_select_n=2", "algo.kl_coef=0.1", "rollout.tis_cap=2.0"]),
    "grpo, game, GiGPO": (None, "grpo", [
        *FAST, "env.name=household", HOUSEHOLD, "train.steps=1", "train.prompts_per_step=2", "train.group_size=2", "algo.step_advantage=gigpo", "eval.n=2"]),
    "grpo, game, branching": (None, "grpo", [
        *FAST, "env.name=household", HOUSEHOLD, "train.steps=1", "train.prompts_per_step=2", "train.group_size=2", "rollout.branch=doubt",
        "rollout.branch_k=2", "eval.n=2"]),
    "sft": (None, "sft", [*FAST, "data.n=8", "train.epochs=1", "train.batch_size=4", "eval.n=2"]),
    "rft, game, gated": (None, "rft", [
        *FAST, "env.name=household", HOUSEHOLD, "rft.rounds=1", "rft.tasks_per_round=2", "rft.group_size=2", "gate.mode=gate", "gate.n=2", "eval.n=2"]),
    "rsipo, every learning signal, eval_both": ("examples/rsipo_ablations/signals.toml", None, [*FAST, "train.steps=2", "eval.n=2"]),
    "rsipo, skills in context, library gate, prompt rounds, imitation": ("examples/rsipo_smoke.toml", None, [
        *FAST, "train.steps=2", "eval.n=2", "skills.in_context=true", "gate.mode=gate", "gate.every=1", "gate.n=4", "gate.skills_every=1",
        "gate.prompt_every=1", "gate.prompt_candidates=1", "gate.prompt_select_n=2", "teacher.mode=imitation"]),
    "grpo, RLoop": ("examples/smoke.toml", None, [*FAST, "train.steps=2", "eval.n=2", "rloop.enabled=true", "rloop.rl_steps=1"]),
    "grpo, curriculum arms and tail": ("examples/smoke.toml", None, [
        *FAST, "train.steps=2", "eval.n=2", "curriculum.mode=progress", "curriculum.arms=[{kwargs = {difficulty = 0}}, {kwargs = {difficulty = 1}}]",
        "curriculum.tail.enabled=true", "curriculum.tail.min_attempts=2"]),
    "rft, curriculum schedule, tail and B-STaR": (None, "rft", [
        *FAST, "env.name=toy-corridor", "rft.rounds=2", "rft.tasks_per_round=2", "rft.group_size=2", "eval.n=2", "curriculum.mode=schedule",
        "curriculum.schedule_steps=[1]", "curriculum.arms=[{kwargs = {length = 1}}, {kwargs = {length = 2}}]", "curriculum.tail.enabled=true",
        "curriculum.tail.min_attempts=2", "curriculum.bstar.enabled=true", "curriculum.bstar.temperatures=[0.8, 1.2]", "curriculum.bstar.samples=[2]",
        "curriculum.bstar.probe_tasks=2"]),
    "grpo, rewards without a verifier": ("examples/smoke.toml", None, [
        *FAST, "train.steps=1", "eval.n=2", 'reward=[{kind = "self_consistency", verified_frac = 1.0, penalty = 0.1}, {kind = "self_judge"}]']),
}


@pytest.fixture(scope="module")
def written_keys(tmp_path_factory) -> dict[str, set[str]]:
    """key -> the runs that wrote it."""
    import importlib

    keys: dict[str, set[str]] = {}
    for i, (name, (path, recipe, sets)) in enumerate(RUNS.items()):
        cfg = load_config(ROOT / path if path else None, sets, recipe=recipe)
        out = tmp_path_factory.mktemp(f"run{i}")
        importlib.import_module(f"recursa.recipes.{cfg.recipe}").train(cfg, out, log=lambda *_: None)
        for line in (out / "metrics.jsonl").read_text().splitlines():
            for key in json.loads(line):
                keys.setdefault(key, set()).add(name)
    return keys


def test_glossary_covers_every_key_the_recipes_write(written_keys):
    patterns = glossary_patterns()
    missing = sorted(k for k in written_keys if not _covered(k, patterns))
    assert not missing, f"keys written to metrics.jsonl but not in docs/reference/metrics.md: {missing}"
    # the runs reach every recipe and the optional groups they are meant to
    for key in ("sft/loss", "rft/pass@2", "gate/p_value", "prompt/proposals", "hatch/win_rate", "skills/gate_p_value",
                "teacher/imitation_weight_mean", "teacher/critical_turn_mean", "eval_skills/success_rate", "rollout/tis_weight_mean",
                "episode/step_adv_abs_mean", "skills/retired", "reward/self_consistency/trust", "reward/self_judge/corr", "branch/nonzero_frac",
                "rloop/sft_loss", "rloop/harvest_rows", "time/rloop_s",
                "curriculum/tail_solved_share", "curriculum/arm", "curriculum/bstar_temperature", "curriculum/progress/arm0"):
        assert key in written_keys, key


# String literals in the modules that write metrics: "group/name" or f"group/{...}".
METRIC_SOURCES = ["recipes/*.py", "methods/*.py", "algorithms/*.py", "skills/*.py", "distributed/*.py", "rewards.py", "self_rewards.py", "envs/*.py", "branching.py",
                  "curriculum.py"]
_LITERAL = re.compile(r"""(f?)"([a-z_{}]+/[A-Za-z0-9_@/{}<>.]*)\"""")
_NOT_METRICS = re.compile(r"\.(json|jsonl|toml|md|png|safetensors|pt)$|^(checkpoints|incumbents|runs)/")


def code_keys() -> dict[str, bool]:
    """Metric-key literals in the code -> whether it is an f-string with placeholders."""
    found = {}
    for pattern in METRIC_SOURCES:
        for path in sorted((ROOT / "recursa").glob(pattern)):
            for f, text in _LITERAL.findall(path.read_text()):
                if _NOT_METRICS.search(text) or text.endswith("/"):
                    continue
                found[text] = bool(f) and "{" in text
    return found


def test_glossary_names_every_key_literal_in_the_code():
    patterns = glossary_patterns()
    keys = code_keys()
    assert {"reward/mean", "distributed/restarts", "prompt/accepted", "skills/invalid/<reason>"} <= set(keys)
    missing = []
    for text, templated in keys.items():
        if templated:  # f"route/{name}": some glossary key must fit the template
            rx = re.compile("".join(".+" if p.startswith("{") else re.escape(p) for p in re.split(r"(\{[^}]*\})", text)) + r"\Z")
            if not any(rx.match(k) for k in patterns):
                missing.append(text)
        elif not _covered(text, patterns):
            missing.append(text)
    assert not missing, f"metric keys in the code but not in docs/reference/metrics.md: {missing}"


def test_glossary_names_no_key_that_nothing_writes(written_keys):
    literals = code_keys()
    templates = [re.compile("".join(".+" if p.startswith("{") else re.escape(p) for p in re.split(r"(\{[^}]*\})", t)) + r"\Z")
                 for t, templated in literals.items() if templated]
    stale = []
    for key, rx in glossary_patterns().items():
        if key == "step" or key in literals or any(rx.match(k) for k in written_keys) or any(t.match(key) for t in templates):
            continue
        stale.append(key)
    assert not stale, f"docs/reference/metrics.md names keys no code writes: {stale}"


# ----------------------------------------------------------------------------- results, links


def test_every_results_table_carries_its_command():
    """Each table on the results page sits under a heading whose section shows, before the
    table, a shell block with the command that reproduces it."""
    text = (ROOT / "docs" / "results.md").read_text()
    tables = 0
    for section in re.split(r"\n(?=#{2,3} )", text):
        last = 0
        for m in re.finditer(r"(?m)^\|.*\|\n\|[-:| ]+\|\n", section):
            tables += 1
            blocks = re.findall(r"```bash\n(.*?)```", section[last : m.start()], flags=re.S)
            commands = [line for b in blocks for line in b.splitlines() if re.match(r"(recursa|python|make|torchrun|\.ci/|bash) ", line)]
            assert commands, f"table without a reproducing command above it in section {section.splitlines()[0]!r}"
            last = section.find("\n\n", m.end())
            last = len(section) if last < 0 else last
    assert tables >= 5


def test_site_hooks_rewrite_repository_links():
    import importlib.util

    spec = importlib.util.spec_from_file_location("mkdocs_hooks", ROOT / "scripts" / "mkdocs_hooks.py")
    hooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hooks)
    readme = "[usage](docs/usage.md), [b](benchmarks/README.md#settings), [smoke](examples/smoke.toml), [x](https://example.org)"
    assert hooks.rewrite_links(readme, "", "index.md") == (
        "[usage](usage.md), [b](benchmarks.md#settings), smoke (`examples/smoke.toml`), [x](https://example.org)")
    page = "[bench](../../benchmarks/README.md), [install](../install.md), [lora](lora.md#x)"
    assert hooks.rewrite_links(page, "docs/guides", "guides/gpu.md") == "[bench](../benchmarks.md), [install](../install.md), [lora](lora.md#x)"


def test_site_hooks_copy_images_from_outside_docs():
    """An image the README (the site's home page) or a docs page shows from outside docs/ is
    copied into the site at its repository path, and the link points at the copy; CI's
    `mkdocs build --strict` failed on a README plot before this."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("mkdocs_hooks", ROOT / "scripts" / "mkdocs_hooks.py")
    hooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hooks)
    readme = "![plot](benchmarks/results/a.png) and ![web](https://example.org/b.png) and ![d](docs/c.png)"
    assert hooks.outside_images(readme, "") == ["benchmarks/results/a.png"]
    assert hooks.rewrite_images(readme, "", "index.md") == (
        "![plot](benchmarks/results/a.png) and ![web](https://example.org/b.png) and ![d](c.png)")
    page = "![plot](../../benchmarks/results/a.png) ![own](fig.png)"
    assert hooks.outside_images(page, "docs/guides") == ["benchmarks/results/a.png"]
    assert hooks.rewrite_images(page, "docs/guides", "guides/gpu.md") == "![plot](../benchmarks/results/a.png) ![own](fig.png)"
    for m in re.finditer(r"!\[[^\]]*\]\(([^)\s]+)\)", (ROOT / "README.md").read_text()):
        if not re.match(r"^[a-z]+:", m.group(1)):
            assert (ROOT / m.group(1)).is_file(), f"README shows a missing image: {m.group(1)}"


def _links(path: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    return re.findall(r"(?<!!)\[[^\]]+\]\(([^)\s]+)\)", text)


@pytest.mark.parametrize("page", ["README.md", *[str(p.relative_to(ROOT)) for p in sorted((ROOT / "docs").rglob("*.md"))]])
def test_relative_links_resolve(page):
    path = ROOT / page
    for href in _links(path):
        if re.match(r"^[a-z]+:", href) or href.startswith("#"):
            continue
        target = (path.parent / href.split("#")[0]).resolve()
        assert target.exists(), f"{page}: link to {href} does not resolve"


def test_readme_is_a_front_page():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    for href in _links(ROOT / "README.md"):
        assert not re.match(r"^https?:", href), f"README links outside the repository: {href}"
