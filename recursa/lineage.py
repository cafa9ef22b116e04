"""The lineage of gated self-improvement: every candidate change, its test and its verdict.

Each change proposed to the agent -- new weights, a new skill library, a new prompt -- is
a *candidate* of one kind, proposed against its *parent*: the incumbent of that kind at
the time. The acceptance gate (recursa.gate) scores both on the same gate items; its whole
decision is stored here with the candidate, and an accepted candidate becomes the new
incumbent of its kind. Each kind starts from a *root* (the initial incumbent, accepted by
definition, not gated). The rows form one tree per kind.

Two tables, created if absent in any SQLite database (normally RUN_DIR/ledger.sqlite,
shared with recursa.store's tables):

```
candidates  id, kind, parent_id, step, summary, payload_json, incumbent_score,
            candidate_score, n, stats_json, accepted, reason, created
test_looks  id, step, label, n, incumbent_rate, candidate_rate, gain, ci_lo, ci_hi,
            p_value, look_index
```

``stats_json`` holds every field of the gate decision (dataclasses.asdict; tuples become
lists). ``incumbent_score`` / ``candidate_score`` are the two systems' mean gate scores
on the items of that test (success rates for the binary gate).

The test split is looked at only a capped number of times in a run (each look at held-out
results that could steer the run spends some of its credibility), so
:meth:`Lineage.record_test_look` refuses a look past the cap.

Resuming from step k calls :meth:`Lineage.truncate_after`, which drops the rows of later
steps; a child's step is never below its parent's, so no orphan is left behind.

The command line (`recursa lineage RUN_DIR`) calls :func:`show_lineage`; the run report
calls :func:`report_section`.
"""

from __future__ import annotations

import dataclasses
import json
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from recursa.errors import UserError
from recursa.gate import ContinuousGateDecision, GateDecision

__all__ = [
    "KINDS",
    "Candidate",
    "TestLook",
    "Lineage",
    "format_tree",
    "plot_lineage",
    "summary_lines",
    "show_lineage",
    "report_section",
]

Kind = Literal["weights", "skills", "prompt"]
KINDS: tuple[str, ...] = ("weights", "skills", "prompt")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS candidates (
  id INTEGER PRIMARY KEY, kind TEXT NOT NULL, parent_id INTEGER REFERENCES candidates(id),
  step INTEGER NOT NULL, summary TEXT NOT NULL, payload_json TEXT NOT NULL,
  incumbent_score REAL, candidate_score REAL, n INTEGER, stats_json TEXT NOT NULL,
  accepted INTEGER NOT NULL, reason TEXT NOT NULL, created REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS test_looks (
  id INTEGER PRIMARY KEY, step INTEGER NOT NULL, label TEXT NOT NULL, n INTEGER NOT NULL,
  incumbent_rate REAL NOT NULL, candidate_rate REAL NOT NULL, gain REAL NOT NULL,
  ci_lo REAL NOT NULL, ci_hi REAL NOT NULL, p_value REAL NOT NULL, look_index INTEGER NOT NULL
);
"""

_CANDIDATE_FIELDS = (
    "kind", "parent_id", "step", "summary", "payload_json", "incumbent_score", "candidate_score", "n",
    "stats_json", "accepted", "reason", "created",
)
_LOOK_FIELDS = (
    "step", "label", "n", "incumbent_rate", "candidate_rate", "gain", "ci_lo", "ci_hi", "p_value", "look_index",
)


def _insert_sql(table: str, fields: tuple[str, ...]) -> str:
    return f"INSERT INTO {table} ({', '.join(fields)}) VALUES ({', '.join('?' * len(fields))})"


def _select_sql(table: str, fields: tuple[str, ...]) -> str:
    return f"SELECT id, {', '.join(fields)} FROM {table}"


# ----------------------------------------------------------------------------- rows


@dataclass(frozen=True)
class Candidate:
    """One row of ``candidates``, with payload and stats decoded from JSON.

    parent_id: None for a root. payload: what the change is (a checkpoint path, a list
    of skill ids, a prompt text). incumbent_score / candidate_score / n: mean gate
    scores of parent and candidate on the n items of its test (None for a root).
    stats: every field of the gate decision ({} for a root). reason: the gate's
    one-line verdict ("root" for a root).
    """

    id: int
    kind: str
    parent_id: int | None
    step: int
    summary: str
    payload: Any
    incumbent_score: float | None
    candidate_score: float | None
    n: int | None
    stats: dict
    accepted: bool
    reason: str
    created: float

    @property
    def is_root(self) -> bool:
        return self.parent_id is None


@dataclass(frozen=True)
class TestLook:
    """One look at the test split: incumbent vs candidate on its n held-out items.

    gain = candidate_rate - incumbent_rate, (ci_lo, ci_hi) its 95% interval, p_value the
    test's one-sided p-value; look_index counts looks from 1.
    """

    __test__ = False  # not a pytest test class despite its name

    id: int
    step: int
    label: str
    n: int
    incumbent_rate: float
    candidate_rate: float
    gain: float
    ci_lo: float
    ci_hi: float
    p_value: float
    look_index: int


def _candidate(row: tuple) -> Candidate:
    (id_, kind, parent_id, step, summary, payload, inc, cand, n, stats, accepted, reason, created) = row
    return Candidate(
        id_, kind, parent_id, step, summary, json.loads(payload), inc, cand, n,
        json.loads(stats), bool(accepted), reason, created,
    )


# ----------------------------------------------------------------------------- JSON


def _numpy_scalar(value):
    """json.dumps fallback: numpy scalars (gate statistics may carry them) as Python numbers."""
    if hasattr(value, "item") and callable(value.item):
        return value.item()
    raise TypeError(f"{type(value).__name__} is not JSON-serialisable")


def _payload_json(payload) -> str:
    try:
        return json.dumps(payload, default=_numpy_scalar)
    except TypeError as exc:
        raise ValueError(
            f"lineage payload must be JSON-serialisable (str, numbers, lists, dicts), got {exc}; "
            "pass a checkpoint path as str(path)"
        ) from None


def _decision_scores(decision, incumbent_score: float | None) -> tuple[float, float]:
    """(incumbent_score, candidate_score) of a gate decision.

    Binary: success rates from the counts, n_inc / n and (n_inc - c + b) / n.
    Continuous: the decision stores only the mean difference, so the caller passes the
    incumbent's mean score and the candidate's is incumbent_score + mean_diff.
    """
    if isinstance(decision, GateDecision):
        if incumbent_score is not None:
            raise ValueError("incumbent_score is derived from a binary GateDecision; do not pass it")
        n_inc = decision.n_incumbent_solved
        return n_inc / decision.n, (n_inc - decision.c + decision.b) / decision.n
    if incumbent_score is None:
        raise ValueError(
            "a ContinuousGateDecision records only the mean difference: pass incumbent_score, "
            "the incumbent's mean score on the gate items"
        )
    return float(incumbent_score), float(incumbent_score) + decision.mean_diff


# ----------------------------------------------------------------------------- ledger


class Lineage:
    """The candidates and test looks of a run, in a SQLite database.

    ``db``: a path (opened and owned; :meth:`close` closes it) or an open
    sqlite3.Connection (shared, e.g. ``RunStore.db``; never closed here). The tables
    are created if absent; other tables in the database are left alone.
    """

    def __init__(self, db: str | Path | sqlite3.Connection):
        self._owned = not isinstance(db, sqlite3.Connection)
        self.db = sqlite3.connect(db) if self._owned else db
        self.db.executescript(_SCHEMA)

    def close(self) -> None:
        if self._owned:
            self.db.close()

    # ---- writing ----------------------------------------------------------------
    def _insert(self, kind, parent_id, step, summary, payload, scores, n, stats, accepted, reason) -> int:
        """Insert one candidate row (payload and stats encoded as JSON); return its id."""
        cur = self.db.execute(
            _insert_sql("candidates", _CANDIDATE_FIELDS),
            (kind, parent_id, step, summary, _payload_json(payload), *scores, n,
             json.dumps(stats, default=_numpy_scalar), int(accepted), reason, time.time()),
        )
        self.db.commit()
        return cur.lastrowid

    def root(self, kind: Kind, summary: str, payload, step: int = 0) -> int:
        """Record the initial incumbent of ``kind`` (accepted, not gated); return its id."""
        _check_kind(kind)
        if self.candidates(kind):
            raise ValueError(f"lineage kind {kind!r} already has a root; read it with Lineage.incumbent({kind!r})")
        return self._insert(kind, None, step, summary, payload, (None, None), None, {}, True, "root")

    def record(
        self,
        kind: Kind,
        parent_id: int,
        step: int,
        summary: str,
        payload,
        decision: GateDecision | ContinuousGateDecision,
        incumbent_score: float | None = None,
    ) -> int:
        """Record a gated candidate of ``kind`` proposed against ``parent_id``; return its id.

        The parent must be an accepted candidate (an incumbent, now or earlier) of the
        same kind, at a step <= ``step``. Every field of ``decision`` goes to stats_json;
        the candidate is accepted, and becomes the incumbent, iff ``decision.accepted``.
        ``incumbent_score``: only for a ContinuousGateDecision (see _decision_scores).
        """
        _check_kind(kind)
        if not isinstance(decision, (GateDecision, ContinuousGateDecision)):
            raise TypeError(f"decision must be a GateDecision or ContinuousGateDecision, got {type(decision).__name__}")
        parent = self.get(parent_id)
        if parent.kind != kind:
            raise ValueError(f"parent #{parent_id} is a {parent.kind} candidate; a {kind} candidate needs a {kind} parent")
        if not parent.accepted:
            raise ValueError(f"parent #{parent_id} was rejected; a candidate's parent must be an incumbent (accepted)")
        if step < parent.step:
            raise ValueError(f"candidate step {step} is before its parent #{parent_id}'s step {parent.step}")
        scores = _decision_scores(decision, incumbent_score)
        stats = dataclasses.asdict(decision)
        return self._insert(kind, parent_id, step, summary, payload, scores, decision.n, stats, decision.accepted, decision.reason)

    def record_test_look(
        self,
        step: int,
        label: str,
        n: int,
        incumbent_rate: float,
        candidate_rate: float,
        ci95: tuple[float, float],
        p_value: float,
        max_looks: int,
    ) -> int:
        """Record a look at the test split; refuse (UserError) once ``max_looks`` looks exist.

        From recursa.stats.paired_compare(incumbent, candidate): n, before_rate,
        after_rate, diff_ci95, p_greater. The gain is candidate_rate - incumbent_rate.
        """
        if isinstance(max_looks, bool) or not isinstance(max_looks, int) or max_looks < 1:
            raise ValueError(f"max_looks must be an int >= 1, got {max_looks!r}")
        done = self.db.execute("SELECT COUNT(*) FROM test_looks").fetchone()[0]
        if done >= max_looks:
            raise UserError(
                f"the test split was already looked at {done} times, the cap of {max_looks} looks; "
                "compare candidates on the gate split, or raise the cap of test looks in the config"
            )
        cur = self.db.execute(
            _insert_sql("test_looks", _LOOK_FIELDS),
            (step, label, n, incumbent_rate, candidate_rate, candidate_rate - incumbent_rate,
             ci95[0], ci95[1], p_value, done + 1),
        )
        self.db.commit()
        return cur.lastrowid

    def truncate_after(self, step: int) -> None:
        """Drop every candidate and test look with a step greater than ``step`` (resume)."""
        self.db.execute("DELETE FROM candidates WHERE step > ?", (step,))
        self.db.execute("DELETE FROM test_looks WHERE step > ?", (step,))
        self.db.commit()

    # ---- reading ----------------------------------------------------------------
    def _select(self, where: str = "", args: tuple = (), order: str = "id") -> list[Candidate]:
        rows = self.db.execute(f"{_select_sql('candidates', _CANDIDATE_FIELDS)} {where} ORDER BY {order}", args)
        return [_candidate(r) for r in rows]

    def get(self, candidate_id: int) -> Candidate:
        """The candidate with this id (ValueError if there is none)."""
        found = self._select("WHERE id = ?", (candidate_id,))
        if not found:
            raise ValueError(f"no lineage candidate with id {candidate_id}")
        return found[0]

    def candidates(self, kind: Kind | None = None) -> list[Candidate]:
        """Every candidate (of ``kind``, if given), roots included, in recording order."""
        if kind is None:
            return self._select()
        _check_kind(kind)
        return self._select("WHERE kind = ?", (kind,))

    def children(self, candidate_id: int) -> list[Candidate]:
        """The candidates proposed against ``candidate_id``, by step then recording order."""
        return self._select("WHERE parent_id = ?", (candidate_id,), order="step, id")

    def incumbent(self, kind: Kind) -> Candidate:
        """The last accepted candidate of ``kind`` (its root until one is accepted)."""
        _check_kind(kind)
        found = self._select("WHERE kind = ? AND accepted = 1", (kind,), order="id DESC LIMIT 1")
        if not found:
            raise ValueError(f"lineage kind {kind!r} has no root yet: call Lineage.root({kind!r}, ...) first")
        return found[0]

    def counts(self) -> dict[str, dict[str, int]]:
        """{kind: {"accepted": a, "rejected": r}} over gated candidates (roots not counted),
        for every kind that has a row, in KINDS order."""
        out: dict[str, dict[str, int]] = {}
        for c in sorted(self.candidates(), key=lambda c: KINDS.index(c.kind)):
            tally = out.setdefault(c.kind, {"accepted": 0, "rejected": 0})
            if not c.is_root:
                tally["accepted" if c.accepted else "rejected"] += 1
        return out

    def test_looks(self) -> list[TestLook]:
        """Every look at the test split, in order."""
        rows = self.db.execute(f"{_select_sql('test_looks', _LOOK_FIELDS)} ORDER BY look_index")
        return [TestLook(*r) for r in rows]


def _check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"lineage kind must be one of {', '.join(KINDS)}; got {kind!r}")


# ----------------------------------------------------------------------------- text


def _clip(text: str, width: int) -> str:
    from recursa.skills.sanitize import sanitize

    text = sanitize(str(text))  # a summary can quote model-written text: nothing reaches the terminal as a command
    return text if len(text) <= width else text[: width - 1] + "…"


def _gain_text(stats: dict) -> str:
    """The tested gain: "+g [lo, hi] p=..." (binary) or "+d [lower, +inf) at 1 - alpha_t" (continuous)."""
    if "mean_diff" in stats:
        return f"{stats['mean_diff']:+.3f} [{stats['lower_bound']:+.3f}, +inf) at {1.0 - stats['alpha_t']:.3g}"
    lo, hi = stats["gain_ci95"]
    return f"{stats['gain']:+.3f} [{lo:+.3f}, {hi:+.3f}] p={stats['p_value']:.3g}"


def _verdict(c: Candidate) -> str:
    """ACCEPTED / rejected with the gate's reason (its own "accepted: " prefix dropped)."""
    reason = c.reason.split(": ", 1)[1] if c.reason.startswith(("accepted: ", "rejected: ")) else c.reason
    return f"{'ACCEPTED' if c.accepted else 'rejected'} ({reason})"


def _tree_line(c: Candidate, depth: int) -> str:
    head = f"{'  ' * depth}#{c.id} step {c.step}  {_clip(c.summary, 40)}"
    if c.is_root:
        return f"{head}  root"
    return f"{head}  {_gain_text(c.stats)}  {_verdict(c)}"


def format_tree(lineage: Lineage) -> str:
    """A text tree per kind: a header with counts, then each candidate indented under its
    parent, siblings by step; each line: id, step, summary, gain [interval] p, verdict."""
    counts = lineage.counts()
    if not counts:
        return "no lineage candidates recorded"
    blocks = []
    for kind, tally in counts.items():
        lines = [f"{kind}: {tally['accepted']} accepted, {tally['rejected']} rejected"]
        stack = [(c, 1) for c in reversed(lineage.candidates(kind)) if c.is_root]
        while stack:  # depth-first; a deep lineage must not hit the recursion limit
            node, depth = stack.pop()
            lines.append(_tree_line(node, depth))
            stack += [(child, depth + 1) for child in reversed(lineage.children(node.id))]
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


def summary_lines(lineage: Lineage) -> list[str]:
    """Markdown for the run report: accepted/rejected counts per kind, and each test look's
    gain with its 95% interval. Ends with a blank line."""
    lines = ["## Lineage (gated changes)", ""]
    counts = lineage.counts()
    if counts:
        lines += ["| kind | accepted | rejected | incumbent |", "|---|---:|---:|---|"]
        for kind, tally in counts.items():
            inc = lineage.incumbent(kind)
            lines.append(f"| {kind} | {tally['accepted']} | {tally['rejected']} | #{inc.id} {_md(_clip(inc.summary, 40))} |")
        lines.append("")
    else:
        lines += ["No candidates recorded.", ""]
    looks = lineage.test_looks()
    lines += ["### Test-split looks", ""]
    if not looks:
        return lines + ["The test split was not looked at.", ""]
    lines += [
        "| look | step | label | n | incumbent | candidate | gain [95% CI] | p |",
        "|---:|---:|---|---:|---:|---:|---|---:|",
    ]
    for t in looks:
        lines.append(
            f"| {t.look_index} | {t.step} | {_md(t.label)} | {t.n} | {t.incumbent_rate:.3f} | "
            f"{t.candidate_rate:.3f} | {t.gain:+.3f} [{t.ci_lo:+.3f}, {t.ci_hi:+.3f}] | {t.p_value:.3g} |"
        )
    return lines + [""]


def _md(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


# ----------------------------------------------------------------------------- plot


def _node_scores(cands: list[Candidate]) -> dict[int, float]:
    """Plotted gate score per candidate id: its candidate_score; for a root (never gated
    itself), the mean of the scores its children's tests measured for it, if any."""
    scores = {c.id: c.candidate_score for c in cands if c.candidate_score is not None}
    for root in (c for c in cands if c.is_root):
        measured = [c.incumbent_score for c in cands if c.parent_id == root.id]
        if measured:
            scores[root.id] = sum(measured) / len(measured)
    return scores


def _plot_kind(ax, kind: str, cands: list[Candidate], color: str) -> None:
    """Edges parent -> child, the incumbent's score as a step line through the accepted
    candidates, filled markers for accepted and hollow for rejected candidates."""
    y = _node_scores(cands)
    by_id = {c.id: c for c in cands}
    for c in cands:
        if c.parent_id in y and c.id in y:
            p = by_id[c.parent_id]
            ax.plot([p.step, c.step], [y[p.id], y[c.id]], color="0.6", lw=0.8, zorder=1)
    accepted = sorted((c for c in cands if c.accepted and c.id in y), key=lambda c: (c.step, c.id))
    if accepted:
        xs = [c.step for c in accepted] + [max(c.step for c in cands)]
        ys = [y[c.id] for c in accepted] + [y[accepted[-1].id]]
        ax.plot(xs, ys, drawstyle="steps-post", color=color, lw=1.8, zorder=2, label=f"{kind} incumbent")
        ax.scatter(xs[:-1], ys[:-1], s=40, color=color, zorder=3, label="accepted")
    rejected = [c for c in cands if not c.accepted and c.id in y]
    if rejected:
        ax.scatter([c.step for c in rejected], [y[c.id] for c in rejected], s=40,
                   facecolors="none", edgecolors=color, zorder=3, label="rejected")
    ax.set_ylabel(f"{kind}: gate score")
    ax.grid(True, alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="best", fontsize="small")


def _title(counts: dict[str, dict[str, int]]) -> str:
    if not counts:
        return "Lineage: no candidates recorded"
    parts = [f"{k} {t['accepted']} accepted / {t['rejected']} rejected" for k, t in counts.items()]
    return "Lineage: " + "; ".join(parts)


def plot_lineage(lineage: Lineage, path: Path) -> Path:
    """Write a PNG of the lineage (one panel per kind; x = step, y = gate score) and return
    its path. Works for an empty lineage (one empty panel saying so)."""
    counts = lineage.counts()
    kinds = list(counts) or ["(none)"]
    fig = Figure(figsize=(7.0, 1.0 + 2.8 * len(kinds)), dpi=100)
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(kinds), 1, sharex=True, squeeze=False)[:, 0]
    colors = {"weights": "tab:blue", "skills": "tab:green", "prompt": "tab:orange"}
    for ax, kind in zip(axes, kinds):
        if kind in counts:
            _plot_kind(ax, kind, lineage.candidates(kind), colors[kind])
        else:
            ax.text(0.5, 0.5, "no candidates recorded", ha="center", va="center", transform=ax.transAxes)
    axes[-1].set_xlabel("step")
    axes[-1].xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.suptitle(_title(counts), fontsize="medium")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")
    return path


# ----------------------------------------------------------------------------- run directory


def _open_ledger(run_dir: Path) -> sqlite3.Connection | None:
    """RUN_DIR/ledger.sqlite opened read-only, or None when it is missing or holds no
    lineage tables (a run without a gate). Reports never create or change a ledger."""
    from recursa.runio import inside

    ledger = inside(run_dir, Path(run_dir) / "ledger.sqlite")
    if not ledger.is_file():
        return None
    db = sqlite3.connect(f"{ledger.resolve().as_uri()}?mode=ro", uri=True)
    tables = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    if {"candidates", "test_looks"} <= tables:
        return db
    db.close()
    return None


def show_lineage(run_dir: Path) -> tuple[str, Path]:
    """For `recursa lineage RUN_DIR`: the text tree, and the PNG written to
    RUN_DIR/plots/lineage.png. UserError when the run has no lineage."""
    from recursa.runio import inside

    inside(run_dir, Path(run_dir) / "plots" / "lineage.png")  # written inside the run only (issue 49)
    db = _open_ledger(run_dir)
    if db is None:
        raise UserError(
            f"{run_dir} has no lineage (no ledger.sqlite with lineage tables): pass the directory "
            "of a `recursa train` run whose recipe gates its changes"
        )
    try:
        lineage = Lineage(db)
        return format_tree(lineage), plot_lineage(lineage, Path(run_dir) / "plots" / "lineage.png")
    finally:
        db.close()


def report_section(run_dir: Path) -> list[str]:
    """For write_report: summary_lines plus the lineage plot (RUN_DIR/plots/lineage.png,
    embedded by its path relative to RUN_DIR); [] for a run that recorded no lineage."""
    from recursa.runio import inside

    db = _open_ledger(run_dir)
    if db is None:
        return []
    try:
        lineage = Lineage(db)
        if not lineage.candidates() and not lineage.test_looks():
            return []
        plot_lineage(lineage, inside(run_dir, Path(run_dir) / "plots" / "lineage.png"))
        return summary_lines(lineage) + ["![Lineage](plots/lineage.png)", ""]
    finally:
        db.close()
