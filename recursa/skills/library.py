"""The skill library: skills with provenance, versions, usage and trust, in SQLite.

One table, `skills`, one row per version, created if absent in the given database, so
the library can live in a run's `ledger.sqlite` beside the evaluations and checkpoints
(pass `RunStore.db` to share its connection).  Columns:

    id              row id, also the skill's id
    lineage         id of the first version; every edit of a skill shares it
    version         1, 2, ... within the lineage
    parent_id       the version this one edits (None for a first version)
    text, norm      the rule, and its normalised form used for deduplication
    family          the task family it was written for (e.g. an env name), or None
    source_seed     task seed of the trajectory it was written from
    source_step     training step of that trajectory
    source_outcome  that episode's outcome ("won", "lost", "max_steps", ...)
    created_step    step it entered the library (default: source_step)
    removed_step    step the lineage was removed, or None
    uses, last_used_step     how often it was retrieved into a context, and when last
    trust_successes, trust_trials   agreement counts of its self-teacher, stored as given
                                    (raw, or decayed as ``TrustEstimator`` keeps them)
    replay_reward   the replay reward that admitted it

The active library is the latest version of each lineage that has not been removed.
Every write commits at once, so a second connection to the same file sees it.
`snapshot()` / `restore()` copy the whole table as a JSON-serialisable list, for
rolling back a rejected change or storing the library with a checkpoint.
"""

from __future__ import annotations

import math
import sqlite3
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from recursa.skills.sanitize import sanitize

_SCHEMA = """
CREATE TABLE IF NOT EXISTS skills (
  id INTEGER PRIMARY KEY, lineage INTEGER NOT NULL, version INTEGER NOT NULL,
  parent_id INTEGER, text TEXT NOT NULL, norm TEXT NOT NULL, family TEXT,
  source_seed INTEGER, source_step INTEGER, source_outcome TEXT,
  created_step INTEGER, removed_step INTEGER,
  uses INTEGER NOT NULL DEFAULT 0, last_used_step INTEGER,
  trust_successes REAL NOT NULL DEFAULT 0, trust_trials REAL NOT NULL DEFAULT 0,
  replay_reward REAL
);
CREATE INDEX IF NOT EXISTS skills_lineage ON skills (lineage, version);
"""

# a version is active when it is the newest of its lineage and not removed
_ACTIVE = "removed_step IS NULL AND version = (SELECT MAX(version) FROM skills AS s WHERE s.lineage = skills.lineage)"


@dataclass
class Skill:
    id: int
    text: str
    family: str | None
    version: int
    parent_id: int | None
    source_seed: int | None
    source_step: int | None
    source_outcome: str | None
    created_step: int | None
    removed_step: int | None = None
    uses: int = 0
    last_used_step: int | None = None
    trust_successes: float = 0.0
    trust_trials: float = 0.0
    replay_reward: float | None = None


@dataclass
class SkillStats:
    """Usage and trust of one skill version and of its lineage."""

    uses: int
    last_used_step: int | None
    lineage_uses: int  # uses summed over every version of the skill
    versions: int
    trust_successes: float
    trust_trials: float
    trust_rate: float | None  # successes / trials; None without trials
    replay_reward: float | None


_COLUMNS = ", ".join(f.name for f in fields(Skill))


def normalise(text: str) -> str:
    """Case, whitespace and a trailing period do not make a different rule."""
    return " ".join(text.lower().split()).rstrip(".!")


class SkillLibrary:
    """Skills in the `skills` table of an SQLite database (see the module doc).

    `path_or_connection`: a database file (created if absent) or an open connection,
    e.g. `RunStore.db`; a connection passed in is shared, not closed by `close()`.
    Methods taking an id raise KeyError for an id that is not in the library.
    """

    def __init__(self, path_or_connection: str | Path | sqlite3.Connection):
        self._owned = not isinstance(path_or_connection, sqlite3.Connection)
        self.db = sqlite3.connect(path_or_connection) if self._owned else path_or_connection
        self.db.executescript(_SCHEMA)
        self.db.commit()

    def close(self) -> None:
        if self._owned:
            self.db.close()

    # ---- reads ------------------------------------------------------------------
    def _select(self, where: str = "1", args: tuple = (), order: str = "id") -> list[Skill]:
        rows = self.db.execute(f"SELECT {_COLUMNS} FROM skills WHERE {where} ORDER BY {order}", args)
        return [Skill(*row) for row in rows]

    def _row(self, skill_id: int, column: str):
        row = self.db.execute(f"SELECT {column} FROM skills WHERE id = ?", (skill_id,)).fetchone()
        if row is None:
            raise KeyError(f"no skill with id {skill_id}")
        return row[0]

    def get(self, skill_id: int) -> Skill:
        found = self._select("id = ?", (skill_id,))
        if not found:
            raise KeyError(f"no skill with id {skill_id}")
        return found[0]

    def active(self, family: str | None = None) -> list[Skill]:
        """The latest version of each skill not removed, oldest skill first (an edit
        keeps its skill's place); only `family`'s when given."""
        if family is None:
            return self._select(_ACTIVE, order="lineage")
        return self._select(f"{_ACTIVE} AND family = ?", (family,), order="lineage")

    def all(self) -> list[Skill]:
        """Every version, removed ones included, in id order."""
        return self._select()

    def __len__(self) -> int:
        return self.db.execute(f"SELECT COUNT(*) FROM skills WHERE {_ACTIVE}").fetchone()[0]

    def stats(self, skill_id: int) -> SkillStats:
        s = self.get(skill_id)
        versions, lineage_uses = self.db.execute(
            "SELECT COUNT(*), SUM(uses) FROM skills WHERE lineage = ?", (self._row(skill_id, "lineage"),)
        ).fetchone()
        rate = s.trust_successes / s.trust_trials if s.trust_trials > 0 else None
        return SkillStats(s.uses, s.last_used_step, lineage_uses, versions, s.trust_successes, s.trust_trials, rate, s.replay_reward)

    # ---- writes -----------------------------------------------------------------
    def add(
        self,
        text: str,
        family: str | None,
        source_seed: int | None,
        source_step: int | None,
        source_outcome: str | None,
        parent_id: int | None = None,
        replay_reward: float | None = None,
        created_step: int | None = None,
    ) -> int:
        """Add a skill, or with `parent_id` a new version of that skill; returns its id.

        A text equal (after `normalise`) to an active skill of the same family is not
        added again: the existing id is returned.  An edit becomes the newest version of
        its parent's lineage and supersedes the versions before it; a removed skill
        cannot be edited (ValueError).
        """
        text = sanitize(text)  # no control characters, escapes or chat special tokens reach a prompt or a terminal
        norm = normalise(text)
        if not norm:
            raise ValueError("a skill needs a non-empty text")
        same = self.db.execute(f"SELECT id FROM skills WHERE {_ACTIVE} AND norm = ? AND family IS ?", (norm, family)).fetchone()
        if same:
            return same[0]
        if parent_id is None:
            lineage, version = None, 1
        else:
            if self._row(parent_id, "removed_step") is not None:
                raise ValueError(f"skill {parent_id} was removed; add the edit as a new skill (parent_id=None)")
            lineage = self._row(parent_id, "lineage")
            version = self.db.execute("SELECT MAX(version) FROM skills WHERE lineage = ?", (lineage,)).fetchone()[0] + 1
        step = source_step if created_step is None else created_step
        cur = self.db.execute(
            "INSERT INTO skills (lineage, version, parent_id, text, norm, family, source_seed, source_step,"
            " source_outcome, created_step, replay_reward) VALUES (?,?,?,?,?,?,?,?,?,?,?)",
            (lineage or 0, version, parent_id, text.strip(), norm, family, source_seed, source_step, source_outcome, step, replay_reward),
        )
        if lineage is None:  # a first version is its own lineage
            self.db.execute("UPDATE skills SET lineage = id WHERE id = ?", (cur.lastrowid,))
        self.db.commit()
        return cur.lastrowid

    def _update(self, sql: str, args: tuple, skill_id: int) -> None:
        self._row(skill_id, "id")  # KeyError for an unknown id
        self.db.execute(sql, args)
        self.db.commit()

    def remove(self, skill_id: int, step: int) -> None:
        """Remove the skill with all its versions from the active library at `step`
        (the rows stay, for provenance and `restore`)."""
        lineage = self._row(skill_id, "lineage")
        self.db.execute("UPDATE skills SET removed_step = ? WHERE lineage = ? AND removed_step IS NULL", (step, lineage))
        self.db.commit()

    def record_use(self, skill_id: int, step: int, n: int = 1) -> None:
        """The skill was retrieved into `n` contexts at `step`."""
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        self._update("UPDATE skills SET uses = uses + ?, last_used_step = ? WHERE id = ?", (n, step, skill_id), skill_id)

    def record_trust(self, skill_id: int, successes: float, trials: float) -> None:
        """Set the skill's trust counts (replacing the old ones)."""
        if not (math.isfinite(successes) and math.isfinite(trials) and 0 <= successes <= trials):
            raise ValueError(f"need finite 0 <= successes <= trials, got {successes} and {trials}")
        self._update("UPDATE skills SET trust_successes = ?, trust_trials = ? WHERE id = ?", (successes, trials, skill_id), skill_id)

    # ---- rollbacks ----------------------------------------------------------------
    def snapshot(self) -> list[dict]:
        """Every row as a dict of `Skill` fields, in id order (JSON-serialisable)."""
        return [asdict(s) for s in self.all()]

    def restore(self, snapshot: list[dict]) -> None:
        """Replace the whole table with `snapshot` (from `snapshot()`), in one transaction.
        Each text is sanitised as `add` does (a snapshot may come from someone else's run)."""
        try:
            skills = sorted((Skill(**{**row, "text": sanitize(str(row["text"]))}) for row in snapshot), key=lambda s: s.id)
        except (TypeError, KeyError, AttributeError) as exc:
            raise ValueError(f"not a skill library snapshot ({type(exc).__name__}: {exc})") from None
        lineage: dict[int, int] = {}
        with self.db:
            self.db.execute("DELETE FROM skills")
            for s in skills:
                lineage[s.id] = s.id if s.parent_id is None else lineage[s.parent_id]
                self.db.execute(
                    f"INSERT INTO skills ({_COLUMNS}, lineage, norm) VALUES ({', '.join('?' * (len(fields(Skill)) + 2))})",
                    (*asdict(s).values(), lineage[s.id], normalise(s.text)),
                )
