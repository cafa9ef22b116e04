"""A built-in, dependency-free household game in the spirit of ALFWorld.

Each seed gives a procedurally generated home: a few rooms joined by doors, furniture
("receptacles") in every room, small objects in and on the furniture, and one goal such as

    Your task is to: put a clean cloth in the drawer.

The home and the goal are a pure function of (rooms, objects_per_room, distractors, tasks,
seed). The game implements the `AgentEnv` contract of `recursa.envs.base`.

Layout. The agent starts in the middle of a room. Every room has fixed furniture (the
kitchen always has a countertop, fridge, microwave, stove, sink and cabinet) plus
`distractors` extra pieces drawn from that room's optional furniture. Names are numbered
per kind across the whole home ("cabinet 1", "cabinet 2", "apple 1"). Cabinets, drawers,
safes, the fridge and the microwave open and start closed; what is inside a closed one is
not shown. Objects start neither hot, cold nor clean.

Actions (exactly these forms; `admissible_actions()` lists the ones valid now, sorted):

    go to <receptacle>          any receptacle in the current room (not the one you are at)
    go to <room>                a room joined to the current one by a door; you arrive in
                                the middle of it, at no receptacle
    open <r> / close <r>        the openable receptacle you are at
    take <obj> from <r>         an object in/on the receptacle you are at (hands empty;
                                you carry at most one object)
    put <obj> in <r> / on <r>   the carried object into/onto the receptacle you are at
                                ("in" for cabinet, drawer, fridge, microwave, sink, safe,
                                garbagecan; "on" for the rest)
    heat <obj> with <r>         at a microwave or stove, carrying a heatable object
    cool <obj> with <r>         at a fridge, carrying a coolable object
    clean <obj> with <r>        at a sink, carrying a cleanable object
    look / inventory            describe the surroundings / what you carry
    examine <x>                 the receptacle you are at, an object on it, or the one you carry

Heating makes an object hot (and no longer cold), cooling makes it cold (and no longer
hot); putting an object somewhere never changes its state. `step` lower-cases the action
and collapses whitespace (a trailing period is dropped) before matching it against the
admissible list. Anything else is invalid: the state is unchanged, the observation is
"Nothing happens.", the reward is -invalid_penalty and info["invalid"] is True.

Task types (option `tasks`):

    pick_and_place     put an <object> in/on the <receptacle kind>   (no such object starts there)
    heat_then_place    put a hot <object> in/on the <receptacle kind>
    cool_then_place    put a cool <object> in/on the <receptacle kind>
    clean_then_place   put a clean <object> in/on the <receptacle kind>

Any object of the named kind and any receptacle of the named kind will do. The step that
completes the goal ends the episode with reward 1.0 and won=True; otherwise the reward is 0
(or -invalid_penalty), and after `max_steps` steps the episode ends with won=False.

Options (all keyword-only):

    rooms             1..6, default 3: number of rooms (the kitchen is always one of them)
    objects_per_room  1..10, default 3: objects placed in each room
    distractors       0..4, default 2: extra receptacles per room beyond its fixed furniture
    tasks             task types to draw from: a list or a comma-separated string
                      (default: all four)
    max_steps         >= 1, default 30: steps (valid or not) before the episode ends unwon
    invalid_penalty   >= 0, default 0.0: subtracted from the reward of an invalid action
    system_prompt     str | None, default None: the system message for the rollout

`walkthrough()` returns a shortest winning action list from the reset state (a planner that
tries every goal object, appliance and target receptacle with shortest door paths); with the
defaults it is always well under `max_steps`.
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from recursa.envs.protocol import StepResult
from recursa.errors import UserError

__all__ = ["OPTIONS", "TASK_TYPES", "HouseholdEnv"]

TASK_TYPES: tuple[str, ...] = ("pick_and_place", "heat_then_place", "cool_then_place", "clean_then_place")
OPTIONS: tuple[str, ...] = (
    "rooms",
    "objects_per_room",
    "distractors",
    "tasks",
    "max_steps",
    "invalid_penalty",
    "system_prompt",
)
MAX_ROOMS = 6
MAX_OBJECTS_PER_ROOM = 10
MAX_DISTRACTORS = 4

# receptacle kind -> (preposition, openable)
_RECEPTACLES: dict[str, tuple[str, bool]] = {
    "armchair": ("on", False),
    "bed": ("on", False),
    "cabinet": ("in", True),
    "coffeetable": ("on", False),
    "countertop": ("on", False),
    "desk": ("on", False),
    "diningtable": ("on", False),
    "drawer": ("in", True),
    "dresser": ("on", False),
    "fridge": ("in", True),
    "garbagecan": ("in", False),
    "microwave": ("in", True),
    "safe": ("in", True),
    "shelf": ("on", False),
    "sidetable": ("on", False),
    "sink": ("in", False),
    "sofa": ("on", False),
    "stove": ("on", False),
    "towelholder": ("on", False),
    "tvstand": ("on", False),
}

# appliance kind -> the verb it serves
_APPLIANCES: dict[str, str] = {"microwave": "heat", "stove": "heat", "fridge": "cool", "sink": "clean"}
_VERB_OF_TASK = {"heat_then_place": "heat", "cool_then_place": "cool", "clean_then_place": "clean"}
_ADJECTIVE = {"heat": "hot", "cool": "cool", "clean": "clean"}

# room -> (fixed furniture, optional furniture drawn `distractors` times with replacement)
_ROOMS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "kitchen": (
        ("countertop", "fridge", "microwave", "stove", "sink", "cabinet"),
        ("cabinet", "drawer", "countertop", "shelf", "garbagecan"),
    ),
    "living room": (("sofa", "coffeetable", "tvstand"), ("armchair", "shelf", "drawer", "sidetable", "cabinet")),
    "bathroom": (("sink", "countertop", "cabinet", "towelholder"), ("drawer", "shelf", "garbagecan")),
    "bedroom": (("bed", "dresser", "sidetable"), ("drawer", "shelf", "desk", "safe")),
    "dining room": (("diningtable", "cabinet"), ("shelf", "sidetable", "drawer")),
    "office": (("desk", "shelf", "drawer"), ("cabinet", "shelf", "safe", "armchair", "garbagecan")),
}

_K, _L, _B, _D, _O = "kitchen", "living room", "bathroom", "dining room", "office"
_BED = "bedroom"
# object kind -> (verbs it supports, rooms it can start in)
_OBJECTS: dict[str, tuple[frozenset[str], tuple[str, ...]]] = {
    "alarmclock": (frozenset(), (_BED,)),
    "apple": (frozenset({"heat", "cool", "clean"}), (_K, _D)),
    "book": (frozenset(), (_L, _BED, _O)),
    "bottle": (frozenset({"cool"}), (_K, _D)),
    "bowl": (frozenset({"heat", "cool", "clean"}), (_K, _D)),
    "bread": (frozenset({"heat", "cool"}), (_K, _D)),
    "candle": (frozenset(), (_B, _L, _D)),
    "cd": (frozenset(), (_BED, _O)),
    "cloth": (frozenset({"clean"}), (_B, _K, _L)),
    "creditcard": (frozenset(), (_L, _O, _BED)),
    "cup": (frozenset({"heat", "cool", "clean"}), (_K, _D)),
    "egg": (frozenset({"heat", "cool"}), (_K,)),
    "fork": (frozenset({"clean"}), (_K, _D)),
    "keychain": (frozenset(), (_L, _BED)),
    "knife": (frozenset({"clean"}), (_K,)),
    "laptop": (frozenset(), (_O, _BED, _L)),
    "lettuce": (frozenset({"cool", "clean"}), (_K,)),
    "mug": (frozenset({"heat", "cool", "clean"}), (_K, _D, _O, _L)),
    "pan": (frozenset({"heat", "clean"}), (_K,)),
    "pen": (frozenset(), (_O, _BED)),
    "pencil": (frozenset(), (_O,)),
    "pillow": (frozenset(), (_BED, _L)),
    "plate": (frozenset({"heat", "cool", "clean"}), (_K, _D)),
    "potato": (frozenset({"heat", "cool", "clean"}), (_K,)),
    "remotecontrol": (frozenset(), (_L,)),
    "soapbar": (frozenset({"clean"}), (_B,)),
    "spoon": (frozenset({"clean"}), (_K, _D)),
    "spraybottle": (frozenset(), (_B,)),
    "toiletpaper": (frozenset(), (_B,)),
    "tomato": (frozenset({"heat", "cool", "clean"}), (_K,)),
    "towel": (frozenset({"clean"}), (_B,)),
    "vase": (frozenset(), (_L, _D)),
    "watch": (frozenset(), (_BED, _L)),
}
# Food and dishes (anything heatable or coolable) never go on beds, sofas or armchairs.
_SOFT_FURNITURE = frozenset({"bed", "sofa", "armchair"})
_NOT_A_START = frozenset({"microwave", "stove", "sink"})
_NOT_A_TARGET = frozenset({"microwave", "stove", "sink", "garbagecan"})


def _kind(name: str) -> str:
    return name.rsplit(" ", 1)[0]


def _natural(name: str) -> tuple[str, int]:
    kind, _, num = name.rpartition(" ")
    return (kind, int(num)) if num.isdigit() else (name, 0)


def _a(noun: str) -> str:
    return ("an " if noun[0] in "aeiou" else "a ") + noun


def _listing(names: list[str]) -> str:
    items = [_a(n) for n in names]
    if not items:
        return "nothing"
    if len(items) == 1:
        return items[0]
    if len(items) == 2:
        return f"{items[0]} and {items[1]}"
    return ", ".join(items[:-1]) + f", and {items[-1]}"


def _fits(obj_kind: str, rec_kind: str) -> bool:
    """Whether an object of this kind plausibly belongs in/on a receptacle of this kind."""
    verbs = _OBJECTS[obj_kind][0]
    if rec_kind == "fridge":
        return "cool" in verbs
    if rec_kind == "towelholder":
        return obj_kind in ("cloth", "towel")
    if rec_kind in _SOFT_FURNITURE:
        return not (verbs & {"heat", "cool"})
    return True


def _start_spots(obj_kind: str, receptacles: list[str], banned_kind: str | None) -> list[str]:
    """Receptacles (of one room) where an object of this kind may start."""
    return [
        r
        for r in receptacles
        if _kind(r) not in _NOT_A_START and _kind(r) != banned_kind and _fits(obj_kind, _kind(r))
    ]


@dataclass(frozen=True)
class _Layout:
    """The static part of a home: rooms, doors, furniture and objects."""

    rooms: tuple[str, ...]
    doors: dict[str, tuple[str, ...]]
    room_receptacles: dict[str, tuple[str, ...]]  # in natural order
    receptacle_room: dict[str, str]
    objects: tuple[str, ...]


@dataclass
class _State:
    """The mutable part: where the agent and every object are, what is open, object states."""

    room: str
    at: str | None
    held: str | None
    where: dict[str, str | None]  # object -> receptacle (None: carried)
    temp: dict[str, str]  # object -> "" | "hot" | "cold"
    clean: set[str]
    opened: set[str]

    def copy(self) -> _State:
        return _State(
            self.room, self.at, self.held, dict(self.where), dict(self.temp), set(self.clean), set(self.opened)
        )


@dataclass(frozen=True)
class _Goal:
    task_type: str
    obj_kind: str
    rec_kind: str
    verb: str | None  # heat / cool / clean, None for pick_and_place


@dataclass
class _Episode:
    layout: _Layout
    goal: _Goal
    initial: _State
    state: _State
    steps: int = 0
    done: bool = False
    won: bool = False
    admissible: list[str] = field(default_factory=list)


def _parse_tasks(tasks: Any) -> tuple[str, ...]:
    if tasks is None:
        return TASK_TYPES
    if isinstance(tasks, str):
        items = [t.strip() for t in tasks.split(",") if t.strip()]
    elif isinstance(tasks, (list, tuple)):
        items = list(tasks)
    else:
        raise UserError(
            f"household tasks must be a list or comma-separated string of {', '.join(TASK_TYPES)}; got {tasks!r}"
        )
    bad = [t for t in items if t not in TASK_TYPES]
    if bad or not items:
        raise UserError(
            f"household tasks must name at least one of: {', '.join(TASK_TYPES)} "
            f"(list or comma-separated string); got {tasks!r}"
        )
    return tuple(t for t in TASK_TYPES if t in items)  # canonical order, duplicates dropped


def _check_int(name: str, value: Any, lo: int, hi: int | None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo or (hi is not None and value > hi):
        span = f"{lo}..{hi}" if hi is not None else f">= {lo}"
        raise UserError(f"household {name} must be an int {span}, got {value!r}")
    return value


class HouseholdEnv:
    """A procedurally generated text home with ALFWorld-style tasks (see the module docstring)."""

    name = "household"

    def __init__(
        self,
        *,
        rooms: int = 3,
        objects_per_room: int = 3,
        distractors: int = 2,
        tasks: Any = None,
        max_steps: int = 30,
        invalid_penalty: float = 0.0,
        system_prompt: str | None = None,
        **unknown: Any,
    ) -> None:
        if unknown:
            raise UserError(
                f"unknown household option(s): {', '.join(sorted(unknown))}; valid options: {', '.join(OPTIONS)}"
            )
        self.rooms = _check_int("rooms", rooms, 1, MAX_ROOMS)
        self.objects_per_room = _check_int("objects_per_room", objects_per_room, 1, MAX_OBJECTS_PER_ROOM)
        self.distractors = _check_int("distractors", distractors, 0, MAX_DISTRACTORS)
        self.tasks = _parse_tasks(tasks)
        self.max_steps = _check_int("max_steps", max_steps, 1, None)
        if (
            isinstance(invalid_penalty, bool)
            or not isinstance(invalid_penalty, (int, float))
            or not 0 <= float(invalid_penalty) < float("inf")
        ):
            raise UserError(f"household invalid_penalty must be a finite number >= 0, got {invalid_penalty!r}")
        self.invalid_penalty = float(invalid_penalty)
        if system_prompt is not None and not isinstance(system_prompt, str):
            raise UserError(f"household system_prompt must be a string or None, got {system_prompt!r}")
        self.system_prompt = system_prompt
        self.task = ""
        self.task_type = ""
        self._ep: _Episode | None = None

    # ------------------------------------------------------------------ generation

    def _generate(self, seed: int) -> tuple[_Layout, _Goal, _State]:
        rng = random.Random(
            f"recursa.household:{self.rooms}:{self.objects_per_room}:{self.distractors}:"
            f"{','.join(self.tasks)}:{seed}"
        )
        task_type = rng.choice(self.tasks)
        verb = _VERB_OF_TASK.get(task_type)

        rooms = ["kitchen"] + rng.sample(sorted(r for r in _ROOMS if r != "kitchen"), self.rooms - 1)
        rng.shuffle(rooms)
        doors: dict[str, list[str]] = {r: [] for r in rooms}
        for i in range(1, len(rooms)):
            other = rng.choice(rooms[:i])
            doors[rooms[i]].append(other)
            doors[other].append(rooms[i])

        counts: dict[str, int] = {}

        def number(kind: str) -> str:
            counts[kind] = counts.get(kind, 0) + 1
            return f"{kind} {counts[kind]}"

        room_recs: dict[str, list[str]] = {}
        rec_room: dict[str, str] = {}
        for room in rooms:
            fixed, optional = _ROOMS[room]
            kinds = list(fixed) + [rng.choice(optional) for _ in range(self.distractors)]
            room_recs[room] = [number(k) for k in kinds]
            for rec in room_recs[room]:
                rec_room[rec] = room

        # The goal: an object kind that can appear here and a receptacle kind present here.
        present = sorted({_kind(r) for r in rec_room})
        pairs = []
        for obj_kind in sorted(_OBJECTS):
            verbs, homes = _OBJECTS[obj_kind]
            if (verb is not None and verb not in verbs) or not any(h in rooms for h in homes):
                continue
            for rec_kind in present:
                if rec_kind in _NOT_A_TARGET or not _fits(obj_kind, rec_kind):
                    continue
                if verb is not None and rec_kind in _APPLIANCES:
                    continue
                banned = rec_kind if verb is None else None
                if not any(_start_spots(obj_kind, room_recs[h], banned) for h in homes if h in rooms):
                    continue
                pairs.append((obj_kind, rec_kind))
        obj_kind, rec_kind = rng.choice(pairs)
        goal = _Goal(task_type, obj_kind, rec_kind, verb)

        # Objects: the first one in a room that can hold the goal kind is a goal object.
        # A pick_and_place goal object never starts in/on a receptacle of the target kind.
        banned = rec_kind if verb is None else None
        goal_room = rng.choice(
            [r for r in rooms if r in _OBJECTS[obj_kind][1] and _start_spots(obj_kind, room_recs[r], banned)]
        )
        where: dict[str, str | None] = {}
        objects: list[str] = []
        for room in rooms:
            local_kinds = sorted(k for k, (_, homes) in _OBJECTS.items() if room in homes)
            for i in range(self.objects_per_room):
                kind = obj_kind if (room == goal_room and i == 0) else rng.choice(local_kinds)
                spots = _start_spots(kind, room_recs[room], banned if kind == obj_kind else None)
                if not spots:  # only the goal kind can hit this; draw another kind instead
                    kind = rng.choice([k for k in local_kinds if k != obj_kind])
                    spots = _start_spots(kind, room_recs[room], None)
                obj = number(kind)
                objects.append(obj)
                where[obj] = rng.choice(spots)

        start = rng.choice(rooms)
        layout = _Layout(
            rooms=tuple(rooms),
            doors={r: tuple(sorted(d)) for r, d in doors.items()},
            room_receptacles={r: tuple(sorted(v, key=_natural)) for r, v in room_recs.items()},
            receptacle_room=rec_room,
            objects=tuple(sorted(objects, key=_natural)),
        )
        state = _State(start, None, None, where, {o: "" for o in objects}, set(), set())
        return layout, goal, state

    # ------------------------------------------------------------------ descriptions

    def _contents(self, rec: str) -> list[str]:
        assert self._ep is not None
        where = self._ep.state.where
        return sorted((o for o, r in where.items() if r == rec), key=_natural)

    def _visible(self, rec: str) -> bool:
        assert self._ep is not None
        return not _RECEPTACLES[_kind(rec)][1] or rec in self._ep.state.opened

    def _describe_receptacle(self, rec: str) -> str:
        prep, openable = _RECEPTACLES[_kind(rec)]
        inside = _listing(self._contents(rec))
        if openable:
            if not self._visible(rec):
                return f"The {rec} is closed."
            return f"The {rec} is open. In it, you see {inside}."
        return f"{prep.capitalize()} the {rec}, you see {inside}."

    def _describe_room(self) -> str:
        assert self._ep is not None
        st, lay = self._ep.state, self._ep.layout
        recs = _listing(list(lay.room_receptacles[st.room]))
        doors = lay.doors[st.room]
        if not doors:
            exits = "There are no doors to other rooms."
        elif len(doors) == 1:
            exits = f"A door leads to the {doors[0]}."
        else:
            exits = "Doors lead to the " + " and the ".join(doors) + "."
        return f"Looking around, you see {recs}. {exits}"

    def _examine_object(self, obj: str) -> str:
        assert self._ep is not None
        st = self._ep.state
        traits = [t for t in (st.temp[obj], "clean" if obj in st.clean else "") if t]
        if not traits:
            return f"There's nothing special about the {obj}."
        return f"The {obj} is {' and '.join(traits)}."

    # ------------------------------------------------------------------ rules

    def _compute_admissible(self) -> list[str]:
        assert self._ep is not None
        st, lay = self._ep.state, self._ep.layout
        acts = ["look", "inventory"]
        acts += [f"go to {r}" for r in lay.room_receptacles[st.room] if r != st.at]
        acts += [f"go to {room}" for room in lay.doors[st.room]]
        if st.held is not None:
            acts.append(f"examine {st.held}")
        if st.at is not None:
            rec = st.at
            kind = _kind(rec)
            prep, openable = _RECEPTACLES[kind]
            acts.append(f"examine {rec}")
            if openable:
                acts.append(f"close {rec}" if rec in st.opened else f"open {rec}")
            if self._visible(rec):
                for obj in self._contents(rec):
                    acts.append(f"examine {obj}")
                    if st.held is None:
                        acts.append(f"take {obj} from {rec}")
                if st.held is not None:
                    acts.append(f"put {st.held} {prep} {rec}")
            verb = _APPLIANCES.get(kind)
            if verb is not None and st.held is not None and verb in _OBJECTS[_kind(st.held)][0]:
                acts.append(f"{verb} {st.held} with {rec}")
        return sorted(acts)

    def _apply(self, action: str) -> str:
        """Carry out an admissible action; return the observation."""
        assert self._ep is not None
        st, lay = self._ep.state, self._ep.layout
        if action == "look":
            place = f"facing the {st.at}" if st.at else "in the middle of the room"
            return f"You are in the {st.room}, {place}. {self._describe_room()}"
        if action == "inventory":
            return f"You are carrying: {_a(st.held)}." if st.held else "You are not carrying anything."
        if action.startswith("go to "):
            target = action[len("go to ") :]
            if target in lay.doors:
                st.room, st.at = target, None
                return f"You walk into the {target}. {self._describe_room()}"
            st.at = target
            return f"You arrive at the {target}. {self._describe_receptacle(target)}"
        if action.startswith("examine "):
            target = action[len("examine ") :]
            if target in lay.receptacle_room:
                return self._describe_receptacle(target)
            return self._examine_object(target)
        if action.startswith("open "):
            rec = action[len("open ") :]
            st.opened.add(rec)
            return f"You open the {rec}. In it, you see {_listing(self._contents(rec))}."
        if action.startswith("close "):
            rec = action[len("close ") :]
            st.opened.discard(rec)
            return f"You close the {rec}."
        if action.startswith("take "):
            obj, rec = action[len("take ") :].split(" from ")
            st.where[obj] = None
            st.held = obj
            return f"You pick up the {obj} from the {rec}."
        if action.startswith("put "):
            obj, rec = st.held, st.at
            assert obj is not None and rec is not None
            st.where[obj] = rec
            st.held = None
            return f"You put the {obj} {_RECEPTACLES[_kind(rec)][0]} the {rec}."
        verb = action.split(" ", 1)[0]
        obj, rec = st.held, st.at
        assert obj is not None and rec is not None and verb in ("heat", "cool", "clean")
        if verb == "heat":
            st.temp[obj] = "hot"
        elif verb == "cool":
            st.temp[obj] = "cold"
        else:
            st.clean.add(obj)
        return f"You {verb} the {obj} using the {rec}."

    def _satisfied(self) -> bool:
        assert self._ep is not None
        st, goal = self._ep.state, self._ep.goal
        for obj, rec in st.where.items():
            if rec is None or _kind(obj) != goal.obj_kind or _kind(rec) != goal.rec_kind:
                continue
            if goal.verb is None:
                return True
            if goal.verb == "heat" and st.temp[obj] == "hot":
                return True
            if goal.verb == "cool" and st.temp[obj] == "cold":
                return True
            if goal.verb == "clean" and obj in st.clean:
                return True
        return False

    # ------------------------------------------------------------------ AgentEnv API

    def reset(self, seed: int) -> str:
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise UserError(f"seed must be a non-negative int, got {seed!r}")
        layout, goal, state = self._generate(seed)
        self._ep = _Episode(layout, goal, state.copy(), state)
        self._ep.admissible = self._compute_admissible()
        adj = _ADJECTIVE.get(goal.verb or "", "")
        noun = f"{adj} {goal.obj_kind}" if adj else goal.obj_kind
        self.task = f"Your task is to: put {_a(noun)} {_RECEPTACLES[goal.rec_kind][0]} the {goal.rec_kind}."
        self.task_type = goal.task_type
        return (
            f"You are in the middle of the {state.room}. {self._describe_room()}\n\n{self.task}"
        )

    def step(self, action_text: str) -> StepResult:
        ep = self._ep
        if ep is None or ep.done:
            raise RuntimeError("call reset(seed) before step(); the household episode is over")
        action = " ".join(str(action_text or "").lower().split()).rstrip(".").rstrip()
        ep.steps += 1
        invalid = action not in ep.admissible
        if invalid:
            obs = "Nothing happens."
            reward = -self.invalid_penalty
        else:
            obs = self._apply(action)
            ep.won = self._satisfied()
            reward = 1.0 if ep.won else 0.0
            if not ep.won:
                ep.admissible = self._compute_admissible()
        ep.done = ep.won or ep.steps >= self.max_steps
        if ep.done:
            ep.admissible = []
        return StepResult(
            obs=obs,
            reward=reward,
            done=ep.done,
            info={
                "won": ep.won,
                "success": ep.won,
                "invalid": invalid,
                "admissible": list(ep.admissible),
                "steps": ep.steps,
                "score": 1.0 if ep.won else 0.0,
            },
        )

    @property
    def goal(self) -> dict[str, str | None]:
        """The current game's goal: task_type, obj_kind, rec_kind and verb (heat / cool / clean,
        None for pick_and_place); for analyses of transcripts (benchmarks/failure_modes.py)."""
        if self._ep is None:
            raise RuntimeError("call reset(seed) before reading goal")
        g = self._ep.goal
        return {"task_type": g.task_type, "obj_kind": g.obj_kind, "rec_kind": g.rec_kind, "verb": g.verb}

    def admissible_actions(self) -> list[str] | None:
        """The actions valid now, sorted ([] once the episode is over)."""
        if self._ep is None:
            raise RuntimeError("call reset(seed) before admissible_actions()")
        return list(self._ep.admissible)

    def walkthrough(self) -> list[str] | None:
        """A shortest winning action list from the state right after `reset`."""
        if self._ep is None:
            raise RuntimeError("call reset(seed) before walkthrough()")
        return _plan(self._ep.layout, self._ep.goal, self._ep.initial)

    def search_walkthrough(self) -> list[str] | None:
        """A winning action list that looks for the goal object instead of knowing where it is.

        It visits the receptacles where objects can start (not the microwave, stove or sink),
        the start room's first and then room by room in door distance, each room's in the
        order the room lists them, going to each and opening it if closed, until one holds an
        object of the task's kind; from there it plays the shortest plan. With one room the
        visiting order never changes, so the choice at each receptacle, take the object or go
        on, depends only on the task line and what the last observation shows: what a
        demonstration of it teaches (`data.walkthrough = "search"`). Longer than
        `walkthrough()` when the object is not in the first place looked."""
        if self._ep is None:
            raise RuntimeError("call reset(seed) before search_walkthrough()")
        lay, goal, st = self._ep.layout, self._ep.goal, self._ep.initial.copy()
        rooms = sorted(lay.rooms, key=lambda r: (len(_room_path(lay, st.room, r)), _natural(r)))
        plan: list[str] = []
        for rec in (r for room in rooms for r in lay.room_receptacles[room] if _kind(r) not in _NOT_A_START):
            plan.extend(_travel(lay, st.room, st.at, rec))
            st.room, st.at = lay.receptacle_room[rec], rec
            if _RECEPTACLES[_kind(rec)][1] and rec not in st.opened:
                plan.append(f"open {rec}")
                st.opened.add(rec)
            if any(where == rec and _kind(obj) == goal.obj_kind for obj, where in st.where.items()):
                return plan + _plan(lay, goal, st)
        return None

    def state_key(self) -> str:
        """A string naming the current game state (GiGPO's anchor); equal keys, equal states."""
        return repr(self.snapshot())

    def snapshot(self) -> tuple:
        """A hashable copy of the game state (not the step count), for comparisons."""
        if self._ep is None:
            raise RuntimeError("call reset(seed) before snapshot()")
        st = self._ep.state
        return (
            st.room,
            st.at,
            st.held,
            tuple(sorted((o, r or "") for o, r in st.where.items())),
            tuple(sorted(st.temp.items())),
            tuple(sorted(st.clean)),
            tuple(sorted(st.opened)),
            self._ep.done,
            self._ep.won,
        )


# ------------------------------------------------------------------------------ planner


def _room_path(layout: _Layout, src: str, dst: str) -> list[str]:
    """Rooms entered on a shortest door path from src to dst (excluding src)."""
    if src == dst:
        return []
    prev: dict[str, str] = {src: src}
    queue = deque([src])
    while queue:
        room = queue.popleft()
        for nxt in layout.doors[room]:
            if nxt not in prev:
                prev[nxt] = room
                queue.append(nxt)
    path = [dst]
    while prev[path[-1]] != src:
        path.append(prev[path[-1]])
    return path[::-1]


def _travel(layout: _Layout, room: str, at: str | None, rec: str) -> list[str]:
    if at == rec:
        return []
    target_room = layout.receptacle_room[rec]
    return [f"go to {r}" for r in _room_path(layout, room, target_room)] + [f"go to {rec}"]


def _plan(layout: _Layout, goal: _Goal, state: _State) -> list[str]:
    """Try every (goal object, appliance, target receptacle); keep the shortest plan.

    Every winning play must reach the object, open its container if closed, take it, reach an
    appliance and use it (if the task needs one), reach a target, open it if still closed and
    put the object there; door paths are shortest paths, so the minimum here is optimal.
    """
    candidates = [o for o in layout.objects if _kind(o) == goal.obj_kind]
    recs = sorted(layout.receptacle_room, key=_natural)
    targets = [r for r in recs if _kind(r) == goal.rec_kind]
    appliances: list[str | None] = (
        [r for r in recs if _APPLIANCES.get(_kind(r)) == goal.verb] if goal.verb else [None]
    )
    best: list[str] | None = None
    for obj in candidates:
        for app in appliances:
            for target in targets:
                plan: list[str] = []
                opened = set(state.opened)
                room, at = state.room, state.at

                def visit(rec: str) -> None:
                    nonlocal room, at
                    plan.extend(_travel(layout, room, at, rec))
                    room, at = layout.receptacle_room[rec], rec
                    if _RECEPTACLES[_kind(rec)][1] and rec not in opened:
                        plan.append(f"open {rec}")
                        opened.add(rec)

                src = state.where[obj]
                assert src is not None
                visit(src)
                plan.append(f"take {obj} from {src}")
                if app is not None:
                    plan.extend(_travel(layout, room, at, app))
                    room, at = layout.receptacle_room[app], app
                    plan.append(f"{goal.verb} {obj} with {app}")
                visit(target)
                plan.append(f"put {obj} {_RECEPTACLES[_kind(target)][0]} {target}")
                if best is None or len(plan) < len(best):
                    best = plan
    assert best is not None, "generation guarantees a goal object and a target"
    return best
