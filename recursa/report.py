"""Turn a training run directory into a Markdown report with PNG plots.

A run directory may contain:

* ``metrics.jsonl`` -- one JSON object per line, each with an int ``"step"``
  and namespaced float metrics (``"reward/mean"``, ``"policy/kl"``, ...).
  Held-out evaluation lines carry ``"eval/success_rate"``,
  ``"eval/ci95_lo"``, ``"eval/ci95_hi"``, ``"eval/mean_reward"``.  Any key may
  be missing on any line.
* ``config.toml`` -- copied verbatim into a collapsible block.
* ``eval/*.json`` -- evaluation summaries ``{"env", "split", "n",
  "mean_reward", "success_rate", "ci95": [lo, hi], "items": [{"seed",
  "reward", "success"}, ...]}`` with optional ``"label"`` and ``"model"``.
  When ``eval/before.json`` and ``eval/after.json`` share item seeds, the
  report adds a paired comparison (exact McNemar test).

:func:`write_report` writes ``plots/*.png`` and ``report.md`` into the run
directory.  Matplotlib is driven through the Agg canvas directly, so no
display and no global backend change are involved.
"""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path
from typing import Iterable, Sequence

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from recursa.stats import paired_compare, wilson_interval

__all__ = ["load_metrics", "load_eval", "write_report"]


# --------------------------------------------------------------------------- loading


def load_metrics(path: Path) -> list[dict]:
    """Read a JSON-lines metrics file into a list of dicts (file order).

    Blank lines are skipped.  A malformed LAST line (a run killed mid-write)
    is dropped with a warning; a malformed line anywhere else raises
    ValueError naming the line number.  A missing file gives ``[]``.
    """
    path = Path(path)
    if not path.exists():
        return []
    lines = path.read_text(encoding="utf-8").splitlines()
    numbered = [(i + 1, line) for i, line in enumerate(lines) if line.strip()]
    records: list[dict] = []
    for pos, (lineno, line) in enumerate(numbered):
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            if pos == len(numbered) - 1:
                warnings.warn(f"{path}:{lineno}: dropping truncated last line ({exc})", stacklevel=2)
                break
            raise ValueError(f"{path}:{lineno}: invalid JSON: {exc}") from exc
        if not isinstance(obj, dict):
            raise ValueError(f"{path}:{lineno}: expected a JSON object, got {type(obj).__name__}")
        records.append(obj)
    return records


def load_eval(path: Path) -> dict:
    """Read one evaluation JSON file (see the module docstring for the schema)."""
    path = Path(path)
    data = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return data


# --------------------------------------------------------------------------- helpers


def _number(value) -> float | None:
    """``value`` as a finite float, or None if it is missing or not a finite number."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def _series(records: Iterable[dict], key: str) -> tuple[list[float], list[float]]:
    """(steps, values) over the records that have both a numeric step and ``key``."""
    steps, values = [], []
    for rec in records:
        step, value = _number(rec.get("step")), _number(rec.get(key))
        if step is not None and value is not None:
            steps.append(step)
            values.append(value)
    return steps, values


def _fmt(value, digits: int = 6) -> str:
    """Compact number formatting for tables ("-" for missing)."""
    num = _number(value)
    if num is None:
        return "-" if value is None else str(value)
    if num == int(num) and abs(num) < 1e15:
        return str(int(num))
    return f"{num:.{digits}g}"


def _fmt_p(p: float) -> str:
    """p-value formatting shared by the report and its tests."""
    return f"{p:.3g}"


def _md_cell(text) -> str:
    """Escape a value for use inside a Markdown table cell."""
    return str(text).replace("|", "\\|").replace("\n", " ")


def _new_axes(title: str, ylabel: str):
    """A fresh Agg-backed figure and its single axes."""
    fig = Figure(figsize=(7.0, 4.0), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    return fig, ax


def _save(fig: Figure, ax, path: Path) -> Path:
    """Add a legend when there are labelled artists, write the PNG, return its path."""
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="best")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")
    return path


# --------------------------------------------------------------------------- plots


def _line_plot(
    records: Sequence[dict],
    keys: Sequence[str],
    path: Path,
    title: str,
    ylabel: str,
) -> Path | None:
    """One line per key in ``keys`` that has data; None (no file) if none has."""
    series = [(key, *_series(records, key)) for key in keys]
    series = [s for s in series if s[1]]
    if not series:
        return None
    fig, ax = _new_axes(title, ylabel)
    for key, steps, values in series:
        ax.plot(steps, values, marker="." if len(steps) < 50 else None, label=key)
    return _save(fig, ax, path)


def _reward_plot(records: Sequence[dict], path: Path) -> Path | None:
    """Mean training reward with a +-std band where ``reward/std`` is logged."""
    steps, means = _series(records, "reward/mean")
    if not steps:
        return None
    fig, ax = _new_axes("Training reward", "reward")
    ax.plot(steps, means, marker="." if len(steps) < 50 else None, label="reward/mean")
    # Band only between consecutive logged points that both carry reward/std,
    # so a step without std does not get an interpolated band.
    rows = [
        (_number(r.get("step")), _number(r.get("reward/mean")), _number(r.get("reward/std")))
        for r in records
    ]
    rows = [t for t in rows if t[0] is not None and t[1] is not None]
    if any(s is not None for _, _, s in rows):
        ax.fill_between(
            [x for x, _, _ in rows],
            [m - (s or 0.0) for _, m, s in rows],
            [m + (s or 0.0) for _, m, s in rows],
            where=[s is not None for _, _, s in rows],
            alpha=0.25,
            label="± reward/std",
        )
    return _save(fig, ax, path)


def _eval_plot(records: Sequence[dict], path: Path) -> Path | None:
    """Held-out success rate per evaluation step, with its 95% interval as error bars."""
    points = []
    for rec in records:
        step, rate = _number(rec.get("step")), _number(rec.get("eval/success_rate"))
        if step is None or rate is None:
            continue
        lo, hi = _number(rec.get("eval/ci95_lo")), _number(rec.get("eval/ci95_hi"))
        below = max(0.0, rate - lo) if lo is not None else 0.0
        above = max(0.0, hi - rate) if hi is not None else 0.0
        points.append((step, rate, below, above))
    if not points:
        return None
    fig, ax = _new_axes("Held-out success rate (95% CI)", "success rate")
    ax.errorbar(
        [p[0] for p in points],
        [p[1] for p in points],
        yerr=[[p[2] for p in points], [p[3] for p in points]],
        marker="o",
        capsize=3,
        label="eval/success_rate",
    )
    ax.set_ylim(-0.02, 1.02)
    return _save(fig, ax, path)


def _make_plots(records: Sequence[dict], plot_dir: Path) -> list[tuple[str, Path]]:
    """Write every plot whose keys are present; return (caption, path) pairs."""
    made = [
        ("Training reward", _reward_plot(records, plot_dir / "reward.png")),
        ("Held-out success rate", _eval_plot(records, plot_dir / "eval_success.png")),
        ("KL divergence", _line_plot(records, ["policy/kl"], plot_dir / "kl.png", "KL divergence", "KL")),
        (
            "Policy entropy",
            _line_plot(records, ["policy/entropy"], plot_dir / "entropy.png", "Policy entropy", "entropy"),
        ),
        (
            "Completion length",
            _line_plot(
                records, ["completion/len_mean"], plot_dir / "completion_len.png",
                "Mean completion length", "tokens",
            ),
        ),
        (
            "Step time",
            _line_plot(
                records, ["time/rollout_s", "time/update_s", "time/step_s"], plot_dir / "step_time.png",
                "Step time: rollout vs update", "seconds",
            ),
        ),
        (
            "Episodes (multi-turn games)",
            _line_plot(
                records, ["episode/success_rate", "episode/invalid_rate"], plot_dir / "episodes.png",
                "Training episodes: success and invalid-action rate", "rate",
            ),
        ),
        (
            "Supervised loss (SFT, expert iteration)",
            _line_plot(records, ["sft/loss"], plot_dir / "sft_loss.png", "Negative log-likelihood of the target tokens", "nats / token"),
        ),
        (
            "Expert iteration: attempts and kept solutions",
            _line_plot(
                records, ["rft/pass@1", "rft/tasks_solved_frac", "rft/attempt_distinct_frac", "rft/success_distinct_frac"],
                plot_dir / "rft.png", "pass@1, tasks solved, diversity of attempts and of successes", "rate",
            ),
        ),
        (
            "Self-teacher (RSIPO): share of the token advantage, rows taught, corr(Delta, outcome advantage)",
            _line_plot(
                records, ["teacher/share", "teacher/rows_frac", "teacher/corr_delta_adv"], plot_dir / "teacher.png",
                "Self-teacher: advantage share, rows with a hint, agreement with the outcome", "value",
            ),
        ),
        (
            "Trust in the self-teacher (RSIPO)",
            _line_plot(
                records, ["trust/mean", "trust/min", "trust/max", "teacher/trust_applied_mean", "trust/agreement"], plot_dir / "trust.png",
                "Trust per skill group (summary) and this step's agreement rate", "trust",
            ),
        ),
        (
            "Skill writing (RSIPO)",
            _line_plot(
                records, ["skills/valid_frac", "skills/replay_reward_mean", "skills/replay_reward_max"], plot_dir / "skills.png",
                "Written skills: valid fraction and replay reward", "value",
            ),
        ),
        (
            "Skill library size (RSIPO)",
            _line_plot(records, ["skills/library_size"], plot_dir / "skill_library.png", "Active skills in the library", "skills"),
        ),
    ]
    return [(caption, p) for caption, p in made if p is not None]


# --------------------------------------------------------------------------- report sections


def _eval_success_ci(data: dict) -> tuple[float, float] | None:
    """The eval's ``ci95``, or a Wilson interval from its items / rate when absent."""
    ci = data.get("ci95")
    if isinstance(ci, (list, tuple)) and len(ci) == 2 and all(_number(v) is not None for v in ci):
        return (float(ci[0]), float(ci[1]))
    items = data.get("items")
    if isinstance(items, list) and items:
        k = sum(1 for it in items if isinstance(it, dict) and it.get("success"))
        return wilson_interval(k, len(items))
    n, rate = data.get("n"), _number(data.get("success_rate"))
    if isinstance(n, int) and n > 0 and rate is not None:
        return wilson_interval(round(rate * n), n)
    return None


def _eval_table(evals: Sequence[tuple[Path, dict]]) -> list[str]:
    """Markdown table summarising each evaluation file."""
    lines = [
        "| eval | file | env | split | model | n | success rate [95% CI] | mean reward |",
        "|---|---|---|---|---|---:|---|---:|",
    ]
    for path, data in evals:
        rate = _number(data.get("success_rate"))
        ci = _eval_success_ci(data)
        rate_txt = "-" if rate is None else f"{rate:.3f}"
        if rate is not None and ci is not None:
            rate_txt += f" [{ci[0]:.3f}, {ci[1]:.3f}]"
        cells = [
            data.get("label") or path.stem,
            f"eval/{path.name}",
            data.get("env", "-"),
            data.get("split", "-"),
            data.get("model", "-"),
            _fmt(data.get("n")),
            rate_txt,
            _fmt(data.get("mean_reward")),
        ]
        lines.append("| " + " | ".join(_md_cell(c) for c in cells) + " |")
    return lines


def _success_by_seed(data: dict) -> dict | None:
    """Map item seed -> success for one eval; None if the seeds are missing or repeated."""
    items = data.get("items")
    if not isinstance(items, list):
        return None
    out: dict = {}
    for it in items:
        if not isinstance(it, dict) or "seed" not in it:
            return None
        seed = it["seed"]
        if not isinstance(seed, (int, str)) or seed in out:
            return None
        out[seed] = bool(it.get("success"))
    return out


def _paired_section(before: dict, after: dict) -> list[str]:
    """Paired before -> after comparison lines over the shared item seeds."""
    b_map, a_map = _success_by_seed(before), _success_by_seed(after)
    if b_map is None or a_map is None:
        return ["Paired comparison skipped: items lack unique seeds in before.json or after.json.", ""]
    shared = sorted(set(b_map) & set(a_map), key=lambda s: (isinstance(s, str), s))
    if not shared:
        return ["Paired comparison skipped: before.json and after.json share no item seeds.", ""]
    res = paired_compare([b_map[s] for s in shared], [a_map[s] for s in shared])
    lo, hi = res["diff_ci95"]
    note = ""
    if len(shared) < max(len(b_map), len(a_map)):
        note = f" (only the {len(shared)} seeds present in both files are paired)"
    return [
        "## Paired comparison (before → after)",
        "",
        f"On n = {res['n']} shared seeds{note}: success rate "
        f"{res['before_rate']:.3f} → {res['after_rate']:.3f}, "
        f"difference {res['diff']:+.3f} (95% CI [{lo:+.3f}, {hi:+.3f}], Newcombe method 10); "
        f"discordant b = {res['b']} (only after solves), c = {res['c']} (only before solves); "
        f"exact McNemar p = {_fmt_p(res['p_greater'])} (one-sided, after better), "
        f"p = {_fmt_p(res['p_two_sided'])} (two-sided).",
        "",
    ]


def _final_metrics_table(records: Sequence[dict]) -> list[str]:
    """Each metric's last logged value and the step it was logged at."""
    last: dict[str, tuple] = {}
    for rec in records:
        for key, value in rec.items():
            if key != "step" and _number(value) is not None:
                last[key] = (value, rec.get("step"))
    if not last:
        return ["No numeric metrics were logged.", ""]
    lines = ["| metric | value | step |", "|---|---:|---:|"]
    for key in sorted(last):
        value, step = last[key]
        lines.append(f"| {_md_cell(key)} | {_fmt(value)} | {_fmt(step)} |")
    return lines + [""]


def _config_block(text: str) -> list[str]:
    """config.toml verbatim inside a collapsible <details> block."""
    longest = 0
    run = 0
    for ch in text:
        run = run + 1 if ch == "`" else 0
        longest = max(longest, run)
    fence = "`" * max(3, longest + 1)
    return [
        "<details><summary>config.toml</summary>",
        "",
        f"{fence}toml",
        text.rstrip("\n"),
        fence,
        "",
        "</details>",
        "",
    ]


# --------------------------------------------------------------------------- entry point


def contained_outputs(run_dir: Path) -> None:
    """Refuse (one-line UserError) a report.md, plots/ directory or plot file that leads out
    of the run directory (a symlink): the report and the plots are written only inside it."""
    from recursa.runio import inside

    inside(run_dir, run_dir / "report.md")
    plots = inside(run_dir, run_dir / "plots")
    if plots.is_dir():
        for p in plots.iterdir():
            inside(run_dir, p)


def write_report(run_dir: Path) -> Path:
    """Write ``run_dir/plots/*.png`` and ``run_dir/report.md``; return the report path.

    Sections: title, config (collapsible), evaluation table, paired
    before/after comparison (when ``eval/before.json`` and ``eval/after.json``
    share item seeds), final-step metrics, and the plots, embedded by paths
    relative to ``run_dir``.  Plots whose metrics were never logged are skipped.
    """
    from recursa.runio import inside

    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"run directory not found: {run_dir}")
    contained_outputs(run_dir)  # every file read or written below stays inside the run (issue 49)
    records = load_metrics(inside(run_dir, run_dir / "metrics.jsonl"))
    eval_dir = inside(run_dir, run_dir / "eval")
    evals = [(p, load_eval(inside(run_dir, p))) for p in sorted(eval_dir.glob("*.json"))] if eval_dir.is_dir() else []

    name = run_dir.resolve().name
    lines = [f"# Run report: {name}", ""]

    config = inside(run_dir, run_dir / "config.toml")
    if config.is_file():
        lines += _config_block(config.read_text(encoding="utf-8"))

    lines += ["## Evaluations", ""]
    if evals:
        lines += _eval_table(evals) + [""]
    else:
        lines += ["No evaluation files found in `eval/`.", ""]

    by_name = {p.name: data for p, data in evals}
    if "before.json" in by_name and "after.json" in by_name:
        lines += _paired_section(by_name["before.json"], by_name["after.json"])

    lines += ["## Final metrics", ""]
    if records:
        lines += _final_metrics_table(records)
    else:
        lines += ["No `metrics.jsonl` records.", ""]

    from recursa.lineage import report_section

    lines += report_section(run_dir)  # gated changes and test-split looks; nothing for ungated runs
    plots = _make_plots(records, run_dir / "plots")
    if plots:
        lines += ["## Plots", ""]
        for caption, path in plots:
            rel = path.relative_to(run_dir).as_posix()
            lines += [f"### {caption}", "", f"![{caption}]({rel})", ""]

    report = run_dir / "report.md"
    from recursa.runio import atomic_write_text

    atomic_write_text(report, "\n".join(lines).rstrip("\n") + "\n")  # a kill never leaves a torn report
    return report
