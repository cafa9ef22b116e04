#!/usr/bin/env python
"""The self-improvement benchmark: does a recipe improve its warm start, and does RSIPO beat GRPO?

Every recipe starts from the same warm-start weights of a game, plays training episodes of
that game, and is evaluated greedily on the same held-out games at the same points. What is
compared is held-out success at equal numbers of *sampled episodes* (every episode a recipe
samples counts: training episodes, and for RSIPO skill-replay and hinted re-rolls, read from
the run's `episodes/sampled` metric; GRPO samples B x G per step).

    python benchmarks/rsipo_vs_grpo.py --games twx:twc                 # warm_start, grpo, rsipo x seeds 0,1,2; reuses committed runs
    python benchmarks/rsipo_vs_grpo.py --games twx:twc --recipes grpo --seeds 0      # one piece of it
    python benchmarks/rsipo_vs_grpo.py --report                        # tables and plots from committed results alone
    python benchmarks/rsipo_vs_grpo.py --games household --recipes warm_start,grpo,rloop   # RLoop, a GRPO option (examples/rloop_household.toml)
    python benchmarks/rsipo_vs_grpo.py --games household_light --recipes rft      # expert iteration at GRPO's episodes (examples/household_light_rft.toml)
    python benchmarks/rsipo_vs_grpo.py --games twx:twc --split gate --recipes grpo --seeds 0 --steps 8   # a pilot on the dev fold
    python benchmarks/rsipo_vs_grpo.py --games household_light --report --baseline grpo@lr1e-5   # compared with a tagged GRPO run
    python benchmarks/rsipo_vs_grpo.py --games household_light --recipes grpo --interpolate 0.5   # + each run's weights halfway to the warm start
    python benchmarks/rsipo_vs_grpo.py --games household_light --recipes grpo --steps 16 --tag @x16 --extend-from @x   # runs of @x trained on
    python benchmarks/rsipo_vs_grpo.py --tiny --out /tmp/bench         # tiny random model on toy-corridor: checks the script

Design (issue 12):

* Held-out items are fixed before any run: the first `eval_n` items of the test split
  (TWX's test fold; household's test seed range), the same for every recipe and seed.
  Pilots that choose a budget or a learning rate use `--split gate` (the dev fold) and
  write under `pilot/`, never into the test results.
* Each finished run writes one small file, `<results>/<game>/<recipe>_seed<k>.json`: the
  run's settings (`spec`), its learning curve (success on every held-out item at each
  evaluation point, with the episodes sampled so far), diagnostics and wall time. A run
  whose file exists with identical settings is never run again, so the benchmark can be
  finished in pieces over several sittings (commit each file as it lands) and re-tabulated
  from committed files alone (`--report`).
* The summary of a game, `<results>/<game>.json`, keeps the layout
  `recipes.<name>.seeds[].heldout.items[]` (`seed`, `success`), with `env` and `budget`;
  `warm_start` is a recipe there: the warm start itself on the same items (greedy play is
  deterministic, so it is evaluated once and paired with every training seed's run).
  Every invocation rebuilds it from all committed runs whose comparison settings match,
  whichever seeds and recipes the invocation itself ran.
* Paired tests over (training seed, held-out game) pairs: each recipe against `warm_start`
  and against `grpo`, exact one-sided McNemar p and Newcombe's 95% interval on the
  difference; because the same game appears once per training seed, a game-clustered
  bootstrap interval (games resampled with all their seeds) is reported beside it.
* One plot per game: pooled held-out success (Wilson 95% band over all seeds' items)
  against sampled episodes, every recipe, the warm start as a band.

Each run is its own subprocess (a fresh interpreter and model); run directories go under
`runs/bench/<game>/` (pilots: `runs/bench_pilot/<game>/`; `--runs-dir`) without their checkpoints
unless `--keep-checkpoints`. A run cut off (the end of a sitting) keeps its checkpoints, one
per evaluation point, and the next invocation with the same settings resumes it there.
Pilots: `--set KEY=VALUE --tag @name` overrides training settings of every run but the warm
start, under a tagged recipe name.

`--interpolate 0.5` also evaluates each trained run's final weights moved halfway back to the
warm start (theta_0 + 0.5 (theta - theta_0), WiSE-FT) on the same held-out games, as the
recipe `<name>+wise0.5` at the run's episodes (it samples none). The weight is fixed before
the runs. A committed run whose checkpoints were not kept is trained again for its weights;
its committed file stays, and the new file says whether the retrained run won the same games.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import math
import os
import random
import shutil
import subprocess
import sys
import time
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

RESULTS = REPO / "benchmarks" / "results" / "self_improve"
ABLATIONS_DIR = REPO / "examples" / "rsipo_ablations"
ABLATIONS = tuple(sorted(p.stem for p in ABLATIONS_DIR.glob("*.toml")))
RSIPO_SECTIONS = ("teacher", "trust", "skills", "hatch", "route")  # what an ablation config may switch
BASE_RECIPES = ("warm_start", "grpo", "rsipo")
# GRPO options run as entries of their own: name -> (example config, the section of it whose keys
# switch the option on; the example is the single source of truth for the option's settings).
GRPO_OPTIONS = {"rloop": ("rloop_household.toml", "rloop")}
# Expert iteration (the `rft` recipe) as an entry: its [rft] and [train] settings come from this
# example; its rounds are set so it samples the episodes GRPO samples in the run's steps.
RFT_EXAMPLE = "household_light_rft.toml"
# Settings of the games that the rft recipe does not have (it samples tasks_per_round x rft.group_size).
GRPO_ONLY = ("algo.", "train.prompts_per_step=", "train.group_size=", "train.steps=")
# Part of every run's settings: bump it when a change to recursa alters what an existing
# configuration does (a new switch does not: its --set is part of the settings), so that
# committed results of the old behaviour are rerun rather than reused.
CODE_VERSION = 1

# The games. `sets` are the --set overrides every recipe of the game shares; `rsipo` the
# RSIPO-only ones; B x G episodes per step; `steps` per run; held-out evaluations every
# `eval_every` steps on `eval_n` games.
# What both games' runs share: the SFT runs' prompt format, sampling, GiGPO, B x G, lr.
RL_SETS = [
    "agent.history_turns=1",  # the SFT runs' prompt format
    "sampling.temperature=1.0",
    "sampling.max_new_tokens=12",
    "algo.step_advantage=gigpo",
    "train.prompts_per_step=4",
    "train.group_size=8",
    "train.micro_batch_size=32",
    "train.lr=2e-5",
    "run.threads=2",
]
RL_BUDGET = {
    "rsipo": ["skills.write_per_group=1", "skills.candidates=4", "skills.max_new_tokens=24", "skills.replay_size=2", "skills.replay_turns=2"],
    "steps": 16,
    "eval_n": 100,
    "eval_every": 4,
}
TWX_TWC = {
    "env": "twx:twc",
    "slug": "twx_twc",
    "warm_start": "runs/twx_twc_sft",
    "warm_start_cmd": "recursa train examples/twx_twc_sft.toml",
    "sets": [
        "model.name=smollm2-135m-instruct",
        'env.name="twx:twc"',
        "env.kwargs={numLocations = 1, numItemsToPutAway = 1, includeDoors = 0, max_steps = 10}",
        *RL_SETS,
    ],
    **RL_BUDGET,
}
HOUSEHOLD = {
    "env": "household",
    "slug": "household",
    "warm_start": "runs/household_sft",
    "warm_start_cmd": "recursa train examples/household_sft.toml",
    "sets": [
        "model.name=smollm2-135m-instruct",
        'env.name="household"',
        'env.kwargs={rooms = 1, objects_per_room = 2, distractors = 0, tasks = ["pick_and_place", "heat_then_place", "cool_then_place", "clean_then_place"], max_steps = 12}',
        *RL_SETS,
    ],
    **RL_BUDGET,
    "group_by": "task_type",  # success per task type: the warm start saw two of the four
}
HOUSEHOLD_LIGHT = {  # the same games from a light warm start (32 walkthroughs of all four types, 2 epochs; 10/50 on the dev split)
    **HOUSEHOLD,
    "slug": "household_light",
    "warm_start": "runs/household_sft_light",
    "warm_start_cmd": "recursa train examples/household_sft_light.toml",
}
TINY = {
    "env": "toy-corridor",
    "slug": "toy_corridor",
    "warm_start": None,  # the tiny model's own random weights
    "warm_start_cmd": None,
    "sets": [
        "model.name=tiny-random",
        "env.name=toy-corridor",
        "env.kwargs={max_steps = 4}",
        "agent.history_turns=1",
        "sampling.max_new_tokens=5",
        "train.prompts_per_step=2",
        "train.group_size=4",
        "train.micro_batch_size=16",
        "train.lr=1e-3",
        "run.threads=1",
    ],
    "rsipo": ["skills.write_per_group=1", "skills.candidates=2", "skills.max_new_tokens=8", "skills.replay_size=2", "skills.replay_turns=2"],
    "steps": 4,
    "eval_n": 8,
    "eval_every": 2,
}
HOUSEHOLD_HINTED = {  # the light warm start's data, half its rows with a win hint (data.win_hints = 1): a policy that reads hints
    **HOUSEHOLD,
    "slug": "household_hinted",
    "warm_start": "runs/household_sft_hinted",
    "warm_start_cmd": "recursa train examples/household_sft_hinted.toml",
}
HOUSEHOLD_SEARCH = {  # the light warm start's 32 games, demonstrated by searching the receptacles (data.walkthrough = "search")
    **HOUSEHOLD,
    "slug": "household_search",
    "warm_start": "runs/household_sft_search",
    "warm_start_cmd": "recursa train examples/household_sft_search.toml",
}
ARITH2 = {  # issue 44: two-digit a + b and a - b (arithmetic difficulty 1) from the embedded model itself, the
    # testbed where the entry probe (benchmarks/teacher_knows.py) found that the teacher knows better: the reference
    # answer in its context adds 1.77 nats/token to the correct reply, and 87 of 100 items have no correct attempt in 8
    "env": "arithmetic",
    "slug": "arith2",
    "warm_start": None,  # the embedded model's own weights, as the probe ran
    "warm_start_cmd": None,
    "sets": [
        "model.name=smollm2-135m-instruct",
        'env.name="arithmetic"',
        "env.kwargs={difficulty = 1}",
        "sampling.temperature=1.0",
        "sampling.max_new_tokens=16",
        "train.prompts_per_step=8",  # the demo's budget: 16 steps x 8 prompts x 8 samples, lr 2e-5
        "train.group_size=8",
        "train.micro_batch_size=32",
        "train.lr=2e-5",
        "run.threads=2",
    ],
    "rsipo": RL_BUDGET["rsipo"],
    "steps": 16,
    "eval_n": 200,
    "eval_every": 8,
}
SEARCH = {  # issue 48: the search-agent testbed, chat episodes with a BM25 search tool (docs/chat.md), from an SFT
    # warm start on 128 oracle chats. RSIPO's teacher renders turn-mode prompts and refuses chat episodes, so only
    # recipes that play chats are offered.
    "env": "search",
    "slug": "search",
    "warm_start": "runs/search_sft",
    "warm_start_cmd": "recursa train examples/search_sft.toml",
    "recipes": ("warm_start", "grpo"),
    "sets": [
        "model.name=smollm2-135m-instruct",
        'env.name="search"',
        "env.kwargs={hops = 1}",
        'agent.episode="chat"',
        "agent.max_tool_calls=3",
        'agent.instruction="Call the search tool, then reply with only the answer as <answer>NAME</answer>."',
        "sampling.temperature=1.0",
        "sampling.max_new_tokens=48",
        "train.prompts_per_step=4",
        "train.group_size=8",
        "train.micro_batch_size=16",
        "train.lr=2e-5",
        "run.threads=2",
    ],
    "steps": 8,  # 256 episodes, about 4 min per run (the warm start wins most groups, so most rows carry no advantage and are not run)
    "eval_n": 100,
    "eval_every": 4,
}
GAMES = {
    "arith2": ARITH2,
    "search": SEARCH,
    "twx:twc": TWX_TWC,
    "household": HOUSEHOLD,
    "household_light": HOUSEHOLD_LIGHT,
    "household_hinted": HOUSEHOLD_HINTED,
    "household_search": HOUSEHOLD_SEARCH,
}


def _toml_value(value) -> str:
    """A TOML literal for --set (strings quoted, tables inline)."""
    import tomli_w

    return tomli_w.dumps({"v": value}).split("=", 1)[1].strip()


def ablation_sets(name: str) -> list[str]:
    """The switches of examples/rsipo_ablations/<name>.toml as --set overrides: the keys of its
    RSIPO sections whose value differs from examples/rsipo_smoke.toml (the example configs are
    the single source of truth for what each ablation changes)."""
    data = tomllib.loads((ABLATIONS_DIR / f"{name}.toml").read_text())
    full = tomllib.loads((REPO / "examples" / "rsipo_smoke.toml").read_text())
    sets = []
    for section in RSIPO_SECTIONS:
        for key, value in data.get(section, {}).items():
            if full.get(section, {}).get(key) != value:
                sets.append(f"{section}.{key}={_toml_value(value)}")
    return sets


def option_sets(name: str) -> list[str]:
    """The switches of a GRPO option entry as --set overrides: every key of its example's section."""
    path, section = GRPO_OPTIONS[name]
    data = tomllib.loads((REPO / "examples" / path).read_text())
    return [f"{section}.{key}={_toml_value(value)}" for key, value in data[section].items()]


def rft_sets() -> list[str]:
    """The rft entry's settings: every key of its example's [rft] and [train] sections."""
    data = tomllib.loads((REPO / "examples" / RFT_EXAMPLE).read_text())
    return [f"{section}.{key}={_toml_value(value)}" for section in ("rft", "train") for key, value in data[section].items()]


def _last(sets: list[str], key: str) -> str | None:
    """The value a list of --set overrides gives `key` (the last one wins), or None."""
    return next((s.split("=", 1)[1] for s in reversed(sets) if s.startswith(key + "=")), None)


def rft_run_sets(sets: list[str]) -> list[str]:
    """An rft run's overrides from its spec's: the GRPO-only settings dropped, `train.steps`
    turned into the rounds that sample as many episodes (steps x B x G = rounds x
    tasks_per_round x rft.group_size) and `eval.every` into rounds at the same episodes."""
    steps, every = int(_last(sets, "train.steps")), int(_last(sets, "eval.every") or 0)
    per_step = int(_last(sets, "train.prompts_per_step")) * int(_last(sets, "train.group_size"))
    per_round = int(_last(sets, "rft.tasks_per_round")) * int(_last(sets, "rft.group_size"))
    if (steps * per_step) % per_round or (every * per_step) % per_round:
        raise SystemExit(f"rft: {steps} steps (evaluations every {every}) x {per_step} episodes is not a whole number of "
                         f"{per_round}-episode rounds; choose --steps / --eval-every to fit")
    kept = [s for s in sets if not s.startswith(GRPO_ONLY + ("eval.every=",))]
    return [*kept, f"rft.rounds={steps * per_step // per_round}", f"eval.every={every * per_step // per_round}"]


def recipe_spec(name: str, game: dict) -> tuple[str, list[str]]:
    """(recipe, --set overrides) of a benchmark entry."""
    if name in ("grpo", "warm_start"):
        return "grpo", []
    if name == "rft":
        return "rft", rft_sets()
    if name == "rsipo":
        return "rsipo", list(game["rsipo"])
    if name in GRPO_OPTIONS:
        return "grpo", option_sets(name)
    if name in ABLATIONS:
        sets = ablation_sets(name)
        return "rsipo", (list(game["rsipo"]) if "skills.enabled=false" not in sets else []) + sets
    raise SystemExit(f"unknown recipe {name!r}; choose from {', '.join(BASE_RECIPES)}, rft, {', '.join(GRPO_OPTIONS)}, {', '.join(ABLATIONS)} (or all)")


def setting_value(game: dict, key: str) -> int:
    return int(_last(game["sets"], key))


def _config_sha(game: dict) -> str | None:
    cfg = REPO / game["warm_start"] / "config.toml"
    return hashlib.sha256(cfg.read_bytes()).hexdigest()[:16] if cfg.exists() else None


def _weights_sha(game: dict) -> str | None:
    """sha256 of the warm start's last checkpoint's weight files (names and bytes). Hashed once
    per process while the files' sizes and modification times stay the same."""
    ckpts = sorted((REPO / game["warm_start"] / "checkpoints").glob("step_*"))
    files = sorted(ckpts[-1].glob("*.safetensors")) if ckpts else []
    if not files:
        return None
    return _hash_files(tuple((str(f), f.stat().st_mtime_ns, f.stat().st_size) for f in files))


@functools.lru_cache(maxsize=16)
def _hash_files(files: tuple[tuple[str, int, int], ...]) -> str:
    h = hashlib.sha256()
    for path, _, _ in files:
        f = Path(path)
        h.update(f.name.encode())
        with f.open("rb") as fh:
            for block in iter(lambda: fh.read(1 << 24), b""):
                h.update(block)
    return h.hexdigest()


def _read_pin(game: dict) -> dict | None:
    """The game's warm_start_pin.json, or None when it has none yet."""
    pin_path = game.get("pin")
    return json.loads(pin_path.read_text()) if pin_path is not None and pin_path.exists() else None


def warm_start_id(game: dict) -> str | None:
    """What identifies the warm start's weights: a hash of the config that trained them,
    pinned in `<results>/<game>/warm_start_pin.json` with the weights' own hash. A warm start
    retrained later (its config.toml written with keys recursa added since) keeps the pinned
    id when its weights are byte-identical, so committed results stay valid; with other
    weights it gets a new id and every run is redone. A warm start that is not at hand (a
    `--report` after its run directory is gone) is the pinned one."""
    if game["warm_start"] is None:
        return None
    config_sha, pin = _config_sha(game), _read_pin(game)
    if pin is None:
        return config_sha
    if config_sha is None:
        return pin["config_sha"]
    if pin["config_sha"] == config_sha:
        return config_sha
    return pin["config_sha"] if _weights_sha(game) == pin["weights_sha256"] else config_sha


def pin_mismatch(game: dict) -> str | None:
    """A one-line warning when the warm start at hand was trained by the pinned config but its
    weights are not the pinned bytes (SFT on CPU is not always bit-exact from one sitting to the
    next); None when they match or nothing is pinned. Committed results keep being reused then,
    since their id is the config's, so the warning says which weights they came from."""
    pin = _read_pin(game)
    if game["warm_start"] is None or pin is None:
        return None
    weights = _weights_sha(game)
    if weights is None or pin["config_sha"] != _config_sha(game) or weights == pin["weights_sha256"]:
        return None
    return (f"warning: {game['warm_start']} was trained by the pinned config but its weights (sha256 {weights[:12]}) are not the pinned "
            f"ones ({pin['weights_sha256'][:12]}, {game['pin']}); committed runs came from the pinned weights, new runs from these")


def pin_warm_start(game: dict) -> None:
    """Write the pin (config hash, weights hash) the first time a game's warm start is used."""
    pin_path = game.get("pin")
    if game["warm_start"] is None or pin_path is None or pin_path.exists():
        return
    weights = _weights_sha(game)
    if weights is not None:
        pin_path.parent.mkdir(parents=True, exist_ok=True)
        pin_path.write_text(json.dumps({"config_sha": _config_sha(game), "weights_sha256": weights, "warm_start": game["warm_start"],
                                        "trained_by": game["warm_start_cmd"]}, indent=1) + "\n")


# ----------------------------------------------------------------------------- one run (subprocess)


def worker(spec: dict) -> None:
    """Train one (recipe, seed) run into spec['out'], or run `recursa` with spec['eval'] as its
    arguments (an evaluation of a run); called in a fresh interpreter."""
    if spec["tiny"]:
        import importlib.util

        # toy-corridor is registered by the test suite's conftest (the toy envs live there)
        s = importlib.util.spec_from_file_location("recursa_test_envs", REPO / "tests" / "conftest.py")
        s.loader.exec_module(importlib.util.module_from_spec(s))
    if "eval" in spec:
        from recursa.cli import main as recursa_main

        if recursa_main(spec["eval"]) != 0:
            raise SystemExit(2)
        return
    import importlib

    from recursa.config import load_config

    sets = worker_sets(spec)[0]
    cfg = load_config(None, [*sets, *spec.get("resume_sets", [])], recipe=spec["recipe"])
    train = importlib.import_module(f"recursa.recipes.{spec['recipe']}").train
    train(cfg, Path(spec["out"]), resume=bool(spec.get("resume")), log=lambda m: print(m, flush=True))


def run_spec(name: str, seed: int, args, game: dict) -> dict:
    """The full settings of one run: what its result file is keyed on."""
    recipe, extra = recipe_spec(name, game)
    steps = 0 if name == "warm_start" else args.steps or game["steps"]
    eval_n = args.eval_n or game["eval_n"]
    every = args.eval_every or game["eval_every"]
    sets = [
        *game["sets"], *extra,
        f"init.from_run={game['warm_start'] or ''}",
        f"train.steps={steps}", f"train.seed={seed}",
        f"eval.n={eval_n}", f"eval.batch_size={min(eval_n, 100)}", f"eval.every={every}", f"eval.split={args.split}",
        "eval.before=false", "eval.after=true", "run.checkpoint_every=0",  # the warm start's own evaluation is warm_start's
        *([f"model.device={args.device}"] if args.device else []),  # CPU and GPU draw different random streams: part of the settings
        *(getattr(args, "set", []) if name != "warm_start" else []),  # --set: a pilot's overrides of the training settings (the warm start has none)
    ]
    return {"recipe": recipe, "name": name, "seed": seed, "sets": sets, "tiny": args.tiny, "warm_start_id": warm_start_id(game), "code": CODE_VERSION}


def add_committed(result: dict, args, game: dict, seeds: list[int]) -> list[int]:
    """Complete the summary with every committed run of the game that this invocation did not
    produce, so that it never shrinks to the seeds or recipes one invocation ran:
    * runs of other recipes (a pilot's tagged runs from earlier invocations) and other seeds of
      this invocation's recipes, whose comparison settings are this invocation's: the same
      warm start, code version, training steps and held-out evaluation (split, items, points);
      a recipe of this invocation must also match its training settings (all but the seed);
    * the committed warm start, paired with every seed of the summary, when this invocation
      did not evaluate it.
    Files that are not results of a finished run (e.g. a stopped run's `*_stopped.json`) are
    skipped. Returns the summary's seeds."""
    keys = ("train.steps=", "eval.n=", "eval.every=", "eval.split=")
    mine = run_spec("grpo", seeds[0], args, game)  # any trained recipe: only its shared settings are compared
    want = sorted(x for x in mine["sets"] if x.startswith(keys))
    recipes = result["recipes"]
    have = {(name, s["seed"]) for name, entry in recipes.items() for s in entry["seeds"]}

    def unseeded(sets: list[str]) -> list[str]:
        return [x for x in sets if not x.startswith("train.seed=")]

    found, warm = [], None
    for path in sorted((Path(args.results) / game["slug"]).glob("*_seed*.json")):
        name, _, seed = path.stem.rpartition("_seed")
        if not seed.isdigit() or (name, int(seed)) in have or (name == "warm_start" and "warm_start" in recipes):
            continue
        try:
            entry = json.loads(path.read_text())
            spec = entry["spec"]
        except (OSError, ValueError, KeyError):
            continue
        if "heldout" not in entry or spec.get("code") != CODE_VERSION or spec.get("warm_start_id") != mine["warm_start_id"]:
            continue
        if name == "warm_start":
            if spec == run_spec("warm_start", int(seed), args, game):
                warm = entry
            continue
        if sorted(x for x in spec["sets"] if x.startswith(keys)) != want:
            continue
        if name in recipes and unseeded(spec["sets"]) != unseeded(recipes[name]["seeds"][0]["spec"]["sets"]):
            continue
        found.append((name, int(seed), entry, path))
    for name, seed, entry, path in found:
        extra = [x for x in entry["spec"]["sets"] if x not in mine["sets"]]
        recipes.setdefault(name, {"recipe": entry["spec"]["recipe"], "sets": extra, "seeds": []})["seeds"].append(entry)
        print(f"{game['env']:>10} {name:>14} seed {seed}: committed result of an earlier invocation ({path.name})", flush=True)
    all_seeds = sorted({*seeds, *(s["seed"] for name, entry in recipes.items() if name != "warm_start" for s in entry["seeds"])})
    for entry in recipes.values():
        entry["seeds"].sort(key=lambda s: s["seed"])
    if "warm_start" in recipes:
        ws = recipes["warm_start"]["seeds"][0]
        recipes["warm_start"]["seeds"] = [{**ws, "seed": s} for s in all_seeds]
    elif warm is not None:  # first in the summary, as when this invocation evaluates it
        result["recipes"] = {"warm_start": {"recipe": recipe_spec("warm_start", game)[0], "sets": [], "seeds": [{**warm, "seed": s} for s in all_seeds]}, **recipes}
        print(f"{game['env']:>10}     warm_start: committed result of an earlier invocation", flush=True)
    return all_seeds


def label(name: str, args) -> str:
    """A recipe's name in result files and tables: with --set, the pilot's --tag appended."""
    return name if name == "warm_start" else f"{name}{getattr(args, 'tag', '')}"


def result_path(args, game: dict, name: str, seed: int) -> Path:
    return Path(args.results) / game["slug"] / f"{label(name, args)}_seed{seed}.json"


def _items(result: dict, keep_completion: bool = False) -> list[dict]:
    keys = ("seed", "success", "reward", "steps") + (("completion",) if keep_completion else ())
    return [{k: i[k] for k in keys if k in i} for i in result["items"]]


def _heldout(evaluation: dict) -> dict:
    """A result file's `heldout`: an evaluation's summary and its items (completions kept)."""
    keys = ("env", "split", "n", "success_rate", "ci95", "mean_reward", "invalid_rate", "mean_steps")
    return {**{k: evaluation[k] for k in keys if k in evaluation}, "items": _items(evaluation, keep_completion=True)}


def read_run(out: Path, spec: dict, game: dict) -> dict:
    """The result record of a finished run directory: its curve (every evaluation, the
    episodes sampled before it, and per-item success), diagnostics and sampled episodes."""
    from recursa.report import load_metrics

    rows = [r for r in load_metrics(out / "metrics.jsonl") if isinstance(r.get("step"), int)]
    B, G = setting_value(game, "train.prompts_per_step"), setting_value(game, "train.group_size")
    per_step: dict[int, float] = {}
    total = 0.0
    for r in sorted(rows, key=lambda r: r["step"]):  # a step's sampled episodes: the recipe's own count, else B x G (GRPO)
        if "budget/episodes" in r and "episodes/sampled" not in r:  # rft logs the running total per round (B-STaR's probes included)
            per_step[r["step"]], total = float(r["budget/episodes"]) - total, float(r["budget/episodes"])
        elif "reward/mean" in r or "episodes/sampled" in r:
            per_step[r["step"]] = float(r.get("episodes/sampled", per_step.get(r["step"], B * G)))

    steps = next(int(s.split("=", 1)[1]) for s in spec["sets"] if s.startswith("train.steps="))
    # rft's steps are rounds: an evaluation after round k is shown at the GRPO step of equal episodes
    scale = steps / int(_last(rft_run_sets(spec["sets"]), "rft.rounds")) if spec["recipe"] == "rft" else 1

    def episodes_before(done: int) -> int:  # training metrics of step k are logged as step k + 1
        return int(sum(v for s, v in per_step.items() if s * scale <= done))
    curve = []
    for path in (out / "eval").glob("*.json"):
        if not (path.stem in ("before", "after") or path.stem.startswith("step_")):
            continue  # e.g. after_skills.json: the same weights with the skill library (read as diagnostics)
        data = json.loads(path.read_text())
        at = 0 if path.stem == "before" else steps if path.stem == "after" else round(int(path.stem.split("_")[1]) * scale)
        curve.append({"step": at, "label": path.stem, "episodes": episodes_before(at), "success_rate": data["success_rate"],
                      "items": _items(data, keep_completion=path.stem == "after")})
    curve.sort(key=lambda p: (p["step"], p["label"] != "before"))
    dedup = {}
    for p in curve:  # 'after' and an eval.every point at the last step are the same weights
        dedup.setdefault(p["step"], p)
    curve = list(dedup.values())
    heldout = _heldout(json.loads((out / "eval" / "after.json").read_text()))
    record = {"curve": curve, "heldout": heldout, "episodes": episodes_before(steps), "diagnostics": diagnostics(rows, out)}
    for extra in ("after_skills", "after_no_skills"):  # skills.eval_both: the final policy with / without its library
        if (out / "eval" / f"{extra}.json").exists():
            data = json.loads((out / "eval" / f"{extra}.json").read_text())
            record[extra] = {"success_rate": data["success_rate"], "items": _items(data)}
    return record


def same_settings(out: Path, spec: dict) -> bool:
    """Whether the run directory `out` was started with exactly these settings."""
    try:
        return json.loads((out / "bench_spec.json").read_text()) == spec
    except (OSError, ValueError):
        return False


def resumable(out: Path, spec: dict) -> bool:
    """Whether `out` holds an interrupted run of exactly these settings with a checkpoint to go on from."""
    return same_settings(out, spec) and any((out / "checkpoints").glob("step_*"))


def attempts_wall(out: Path) -> tuple[float, int]:
    """(seconds, pieces): the wall time of every attempt at a run, summed. An attempt is a
    `start` mark, heartbeats (`alive`) and an `end` mark; one cut off with the benchmark has
    no end and counts until its last heartbeat (its work after the last checkpoint was
    redone, and counts again in the next attempt)."""
    total, pieces, start, last = 0.0, 0, None, None
    for line in (out / "bench_attempts.jsonl").read_text().splitlines():
        mark = json.loads(line)
        if "start" in mark:
            if start is not None:
                total += last - start
            start = last = mark["start"]
            pieces += 1
        elif start is not None:
            last = mark.get("end", mark.get("alive"))
            if "end" in mark:
                total, start = total + last - start, None
    if start is not None:
        total += last - start
    return total, pieces


def run_one(name: str, seed: int, args, game: dict) -> dict | None:
    """A run's result record: the committed file when its settings match (always with
    --report), else train it now and write the file. None when --report finds none.
    With --interpolate, also the result of its final weights moved toward the warm start
    (`interpolate_one`); a committed run whose weights are gone is trained again for them,
    its committed file left as it is."""
    spec = run_spec(name, seed, args, game)
    path = result_path(args, game, name, seed)
    out = Path(args.runs_dir) / game["slug"] / f"{label(name, args)}_seed{seed}"
    wanted = [a for a in args.interpolate if name != "warm_start" and not committed(interpolated_path(args, game, name, seed, a), interpolated_spec(spec, a))]
    done = None
    if path.exists():
        done = json.loads(path.read_text())
        if args.report or (done["spec"] == spec and not wanted):
            print(f"{game['env']:>10} {label(name, args):>14} seed {seed}: committed result ({path.relative_to(REPO) if path.is_relative_to(REPO) else path})", flush=True)
            return done
        if done["spec"] != spec:
            if not getattr(args, "replace", False):
                raise SystemExit(f"{label(name, args)} seed {seed}: {path} holds a result of other settings; give these settings a --tag of "
                                 "their own, or pass --replace to train them and replace that file")
            print(f"{game['env']:>10} {label(name, args):>14} seed {seed}: the committed result has other settings; rerunning (--replace)", flush=True)
            done = None
        elif final_checkpoint(out, spec) is not None:
            interpolate_one(name, seed, args, game, spec, out, done, wanted)
            return done
        else:
            print(f"{game['env']:>10} {label(name, args):>14} seed {seed}: committed result, but --interpolate needs its final weights, "
                  "which were not kept: training it again (its committed file stays)", flush=True)
    if args.report:
        return None
    record = train_one(name, seed, args, game, spec, out)
    if done is None:
        write_result(path, record)
        print(f"{game['env']:>10} {label(name, args):>14} seed {seed}: held-out success {record['heldout']['success_rate']:.3f} after "
              f"{record['episodes']} episodes ({record['wall_s']:.0f} s) -> {path}", flush=True)
    rerun = None
    if done is not None:  # trained again for its weights: say whether it reproduced the committed run
        same = [i["success"] for i in record["heldout"]["items"]] == [i["success"] for i in done["heldout"]["items"]]
        rerun = {"success_rate": record["heldout"]["success_rate"], "same_items": same, "wall_s": record["wall_s"]}
        print(f"{game['env']:>10} {label(name, args):>14} seed {seed}: trained again, held-out success {record['heldout']['success_rate']:.3f} "
              f"({'the same games as' if same else 'NOT the same games as'} the committed run's {done['heldout']['success_rate']:.3f})", flush=True)
    interpolate_one(name, seed, args, game, spec, out, done or record, wanted, rerun)
    if not args.keep_checkpoints:
        shutil.rmtree(out / "checkpoints", ignore_errors=True)
        shutil.rmtree(out / "incumbents", ignore_errors=True)
    return done or record


def committed(path: Path, spec: dict) -> bool:
    """Whether `path` holds a result of exactly `spec`."""
    try:
        return json.loads(path.read_text())["spec"] == spec
    except (OSError, ValueError, KeyError):
        return False


def write_result(path: Path, record: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=1) + "\n")
    tmp.replace(path)


def without_steps(spec: dict) -> dict:
    return {**spec, "sets": [s for s in spec["sets"] if not s.startswith("train.steps=")]}


def extension_source(name: str, seed: int, args, game: dict, spec: dict) -> tuple[Path, int]:
    """(run directory, its steps) of the kept run that --extend-from names for this recipe and
    seed: the same settings but fewer training steps, with its checkpoint at its last step.
    The recipes' per-step seeds, learning rate (warm-up, then constant) and curriculum state do
    not depend on train.steps, so going on from that checkpoint is the longer run itself."""
    src = Path(args.runs_dir) / game["slug"] / f"{name}{args.extend_from}_seed{seed}"
    try:
        src_spec = json.loads((src / "bench_spec.json").read_text())
    except (OSError, ValueError):
        raise SystemExit(f"--extend-from {args.extend_from}: {src} holds no benchmark run to extend") from None
    steps, mine = int(_last(src_spec["sets"], "train.steps")), int(_last(spec["sets"], "train.steps"))
    if without_steps(src_spec) != without_steps(spec) or not steps < mine:
        raise SystemExit(f"--extend-from {args.extend_from}: {src} was trained with other settings than these, or with {steps} steps, "
                         f"not fewer than {mine}")
    if final_checkpoint(src, src_spec) is None:
        raise SystemExit(f"--extend-from {args.extend_from}: {src} kept no checkpoint at its step {steps}; train it with --keep-checkpoints")
    problem = steps_dependence(spec)
    if problem:
        raise SystemExit(f"--extend-from {args.extend_from}: {problem}, so its first {steps} steps are not the shorter run's; train it whole")
    return src, steps


def steps_dependence(spec: dict) -> str | None:
    """Why a run's first steps would depend on its train.steps (then it cannot be a shorter
    run gone on with), or None."""
    from recursa.config import load_config

    if spec["recipe"] not in ("grpo", "rsipo"):
        return f"recipe {spec['recipe']} counts its schedule in rounds of its own"
    cfg = load_config(None, worker_sets(spec)[0], recipe=spec["recipe"])
    if cfg.gate.mode != "off" or getattr(cfg.gate, "skills_every", 0):
        return "its gate tests a candidate at the last step"
    if getattr(getattr(cfg, "rloop", None), "enabled", False):
        return "rloop's last phase ends at train.steps"
    hatch = getattr(cfg, "hatch", None)
    if hatch is not None and hatch.enabled and hatch.anneal_steps is None and hatch.anneal != "constant":
        return "hatch's coefficient anneals over train.steps (set hatch.anneal_steps)"
    return None


def start_extension(src: Path, steps: int, out: Path, spec: dict, sets: list[str]) -> None:
    """Make `out` the run `src` stopped at its last step, ready to be resumed under `spec`: its
    logs, ledger, evaluations and attempts copied, its last checkpoint linked (never changed
    in place), its final evaluation relabelled as the mid-run one of that step (the longer run
    evaluates there too), and the longer run's config. `bench_spec.json` comes last: a copy cut
    off before it is started again from scratch."""
    from recursa.config import dump_config, load_config
    from recursa.store import RunStore

    if out.exists():
        shutil.rmtree(out)
    (out / "eval").mkdir(parents=True)
    for f in src.iterdir():
        if f.is_file() and f.suffix in (".jsonl", ".sqlite"):
            shutil.copy2(f, out / f.name)
    for f in (src / "eval").glob("*.json"):  # the curve's points; not evaluations of the final weights made another way (after_wise*, after_skills)
        if f.stem in ("before", "after") or f.stem.startswith("step_"):
            shutil.copy2(f, out / "eval" / f.name)
    ckpt = Path("checkpoints") / f"step_{steps:06d}"
    for f in (src / ckpt).rglob("*"):
        if f.is_file():
            (out / f.relative_to(src)).parent.mkdir(parents=True, exist_ok=True)
            os.link(f, out / f.relative_to(src))
    store = RunStore(out)
    try:
        store.reconcile(log=lambda _: None)  # the checkpoints not linked lose their ledger rows
        store.relabel_eval("after", f"step_{steps:04d}")
    finally:
        store.close()
    (out / "config.toml").write_text(dump_config(load_config(None, sets, recipe=spec["recipe"])))
    (out / "bench_spec.json").write_text(json.dumps(spec, indent=1) + "\n")


def worker_sets(spec: dict) -> tuple[list[str], list[str]]:
    """(the run's overrides, the checkpointing ones the benchmark adds): checkpoints at every
    evaluation point, so a run cut off (a sitting's end) resumes there; they do not change what
    the run computes (resume replays the uninterrupted run)."""
    every = next(int(s.split("=", 1)[1]) for s in spec["sets"] if s.startswith("eval.every="))
    sets = rft_run_sets(spec["sets"]) if spec["recipe"] == "rft" else spec["sets"]
    return sets, [f"run.checkpoint_every={every}", "run.keep_last=2"]


def train_one(name: str, seed: int, args, game: dict, spec: dict, out: Path) -> dict:
    """Train (or resume, or extend: --extend-from) one run in `out` in a subprocess; its result
    record (checkpoints kept)."""
    resume = resumable(out, spec)
    extended = None
    if resume:
        print(f"{game['env']:>10} {label(name, args):>14} seed {seed}: resuming the interrupted run in {out}", flush=True)
    elif getattr(args, "extend_from", None) is not None and name != "warm_start":
        src, steps = extension_source(name, seed, args, game, spec)
        print(f"{game['env']:>10} {label(name, args):>14} seed {seed}: going on from step {steps} of {src}", flush=True)
        sets, checkpointing = worker_sets(spec)
        from recursa.errors import UserError

        try:
            start_extension(src, steps, out, spec, [*sets, *checkpointing])
        except UserError as exc:
            raise SystemExit(f"--extend-from {args.extend_from}: {exc}") from None
        resume, extended = True, {"run": str(src.relative_to(REPO)) if src.is_relative_to(REPO) else str(src), "steps": steps}
    else:
        if out.exists():
            shutil.rmtree(out)
        out.mkdir(parents=True)
        (out / "bench_spec.json").write_text(json.dumps(spec, indent=1) + "\n")
    worker_spec = {"recipe": spec["recipe"], "sets": spec["sets"], "out": str(out), "tiny": args.tiny, "resume": resume,
                   "resume_sets": worker_sets(spec)[1]}
    attempts = out / "bench_attempts.jsonl"
    with attempts.open("a") as fh:
        fh.write(json.dumps({"start": time.time()}) + "\n")
    log = out.parent / f"{label(name, args)}_seed{seed}.log"
    with log.open("a" if resume else "w") as fh:
        proc = subprocess.Popen([sys.executable, __file__, "--worker", json.dumps(worker_spec)], cwd=REPO, stdout=fh, stderr=subprocess.STDOUT, text=True)
        while proc.poll() is None:  # a heartbeat: an attempt cut off with this process counts until its last beat
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                with attempts.open("a") as beat:
                    beat.write(json.dumps({"alive": time.time()}) + "\n")
    with attempts.open("a") as fh:
        fh.write(json.dumps({"end": time.time()}) + "\n")
    wall, pieces = attempts_wall(out)
    if proc.returncode != 0:
        raise SystemExit(f"{name} seed {seed} failed (exit {proc.returncode}); log: {log}\n{log.read_text()[-2000:]}")
    return {"spec": spec, "env": game["env"], "recipe": name, "seed": seed, **read_run(out, spec, game), "wall_s": round(wall, 1), "pieces": pieces,
            "finished": time.strftime("%Y-%m-%d %H:%M:%S"), "run_dir": str(out.relative_to(REPO)) if out.is_relative_to(REPO) else str(out),
            **({"extended_from": extended} if extended else {})}


# --interpolate: a trained run's final weights moved toward its warm start, theta_0 + alpha
# (theta - theta_0) (WiSE-FT; `recursa eval --interpolate`), evaluated on the same held-out
# games. Its result is a recipe of its own, `<name>+wise<alpha>`, at the run's episodes: the
# interpolation samples no episode. alpha is fixed before the runs, never chosen on them.
def interpolated_label(name: str, args, alpha: float) -> str:
    return f"{label(name, args)}+wise{alpha:g}"


def interpolated_path(args, game: dict, name: str, seed: int, alpha: float) -> Path:
    return Path(args.results) / game["slug"] / f"{interpolated_label(name, args, alpha)}_seed{seed}.json"


def interpolated_spec(spec: dict, alpha: float) -> dict:
    return {**spec, "sets": [*spec["sets"], f"interpolate={alpha:g}"], "interpolate": alpha}


def final_checkpoint(out: Path, spec: dict) -> Path | None:
    """The run's checkpoint at its last training step, when it was kept (and of these settings)."""
    from recursa.store import finished_checkpoints

    ckpt = out / "checkpoints" / f"step_{int(_last(spec['sets'], 'train.steps')):06d}"
    return ckpt if same_settings(out, spec) and ckpt in finished_checkpoints(out) else None


def interpolate_one(name: str, seed: int, args, game: dict, spec: dict, out: Path, base: dict, alphas: list[float], rerun: dict | None = None) -> None:
    """Evaluate the run's final weights interpolated toward its warm start at each alpha on
    the held-out games of `base` (its committed record) and write each result file. `rerun`:
    how a run trained again for its weights compared with `base` (stored beside, for the reader)."""
    steps = int(_last(spec["sets"], "train.steps"))
    n = len(base["heldout"]["items"])
    for alpha in alphas:
        target = out / "eval" / f"after_wise{alpha:g}.json"
        argv = ["eval", "--run", str(out), "--checkpoint", str(steps), "--interpolate", str(alpha), "--split", base["heldout"].get("split", args.split),
                "--n", str(n), "--json", str(target), "--label", f"after@{alpha:g}"]
        started = time.time()
        with (out.parent / f"{label(name, args)}_seed{seed}.log").open("a") as fh:
            proc = subprocess.run([sys.executable, __file__, "--worker", json.dumps({"eval": argv, "tiny": args.tiny})], cwd=REPO, stdout=fh, stderr=subprocess.STDOUT, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"{name} seed {seed}: evaluating the weights interpolated at {alpha:g} failed (exit {proc.returncode}); log in {out.parent}")
        data = json.loads(target.read_text())
        heldout = _heldout(data)
        point = {"step": steps, "label": f"after@{alpha:g}", "episodes": base["episodes"], "success_rate": data["success_rate"], "items": heldout["items"]}
        record = {"spec": interpolated_spec(spec, alpha), "env": game["env"], "recipe": interpolated_label(name, args, alpha), "seed": seed,
                  "interpolate": {"alpha": alpha, "of": label(name, args), "of_success_rate": base["heldout"]["success_rate"]},
                  "curve": [point], "heldout": heldout, "episodes": base["episodes"], "diagnostics": base.get("diagnostics", {}),
                  "wall_s": round(time.time() - started, 1), "finished": time.strftime("%Y-%m-%d %H:%M:%S"), "run_dir": base.get("run_dir")}
        if rerun is not None:
            record["interpolate"]["trained_again"] = rerun
        path = interpolated_path(args, game, name, seed, alpha)
        write_result(path, record)
        print(f"{game['env']:>10} {interpolated_label(name, args, alpha):>14} seed {seed}: held-out success {data['success_rate']:.3f} "
              f"(the run's own {base['heldout']['success_rate']:.3f}) -> {path}", flush=True)


def interpolated_entries(name: str, seed: int, args, game: dict) -> list[tuple[str, dict]]:
    """(label, record) of the run's committed interpolated results (every alpha of --interpolate)."""
    found = []
    for alpha in args.interpolate:
        path = interpolated_path(args, game, name, seed, alpha)
        if path.exists():
            found.append((interpolated_label(name, args, alpha), json.loads(path.read_text())))
    return found


# what the recipe did in a run: step means of these metrics (non-finite steps skipped), and of
# every metric under these prefixes
DIAGNOSTICS = ("reward/mean", "episodes/sampled", "loss/distill")
DIAGNOSTIC_PREFIXES = ("policy/", "teacher/", "anchor/", "trust/", "skills/", "route/", "hint/", "hatch/", "rollout/", "rloop/", "rft/", "curriculum/", "branch/")
# the summary's table shows the diagnostics that start with one of these (the result files keep all)
REPORTED_DIAGNOSTICS = ("teacher/share", "teacher/trust", "teacher/corr", "teacher/abs_gap", "teacher/toward", "teacher/distill", "loss/distill", "skills/effect", "trust/mean",
                        "skills/admitted", "skills/replay", "route/", "hint/", "hatch/episodes_total", "hatch/wins_total", "episodes/", "reward/mean", "rollout/logprob", "anchor/nll",
                        "policy/clip_frac", "policy/approx_kl_old", "policy/entropy")


def diagnostics(rows: list[dict], run_dir: Path) -> dict:
    """Step means of the diagnostic metrics of a run, plus a few of the skills it wrote."""
    import sqlite3

    keys = sorted({k for r in rows for k in r if k in DIAGNOSTICS or k.startswith(DIAGNOSTIC_PREFIXES)})
    out: dict = {}
    for key in keys:
        values = [r[key] for r in rows if isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool) and math.isfinite(r[key])]
        if values:
            out[key] = round(sum(values) / len(values), 6)
    hatched = [r for r in rows if isinstance(r.get("hatch/episodes"), (int, float))]
    if hatched:  # the hinted re-rolls over the whole run: a step mean of win_rate hides how many there were
        out["hatch/episodes_total"] = sum(int(r["hatch/episodes"]) for r in hatched)
        # hatch/wins where logged; logs written before it existed give it as episodes x win rate
        out["hatch/wins_total"] = sum(int(r["hatch/wins"]) if isinstance(r.get("hatch/wins"), (int, float))
                                      else round(r["hatch/episodes"] * r.get("hatch/win_rate", 0.0)) for r in hatched)
    ledger = run_dir / "ledger.sqlite"
    if ledger.exists():
        con = sqlite3.connect(ledger)
        try:
            out["skills_sample"] = [
                {"text": t, "outcome": o, "step": st, "replay_reward": r}
                for t, o, st, r in con.execute("SELECT text, source_outcome, created_step, replay_reward FROM skills ORDER BY id DESC LIMIT 5")
            ]
        except sqlite3.OperationalError:  # a run without a skills table
            pass
        finally:
            con.close()
    return out


# ----------------------------------------------------------------------------- statistics


def pairs(a: dict[tuple[int, int], bool], b: dict[tuple[int, int], bool]) -> tuple[list[bool], list[bool], list[int]]:
    """The common (training seed, game) keys of two recipes' item maps: a's and b's success,
    and each pair's game (the cluster of the bootstrap)."""
    common = sorted(set(a) & set(b))
    return [a[k] for k in common], [b[k] for k in common], [k[1] for k in common]


BOOT_REPS = 10_000  # resamples of the game-clustered bootstrap


def cluster_bootstrap(x: list[bool], y: list[bool], games: list[int], reps: int = BOOT_REPS, seed: int = 0) -> dict:
    """Paired difference mean(y) - mean(x) with a game-clustered bootstrap: games are resampled
    with replacement, each bringing all of its (training seed) pairs. Returns the 95%
    percentile interval and the one-sided p of 'no gain' (share of resamples with diff <= 0)."""
    by_game: dict[int, list[int]] = {}
    for i, g in enumerate(games):
        by_game.setdefault(g, []).append(i)
    clusters = [(sum(int(y[i]) - int(x[i]) for i in idx), len(idx)) for idx in by_game.values()]
    rng = random.Random(seed)
    diffs = []
    for _ in range(reps):
        draw = [clusters[rng.randrange(len(clusters))] for _ in clusters]
        diffs.append(sum(d for d, _ in draw) / sum(n for _, n in draw))
    diffs.sort()
    return {"ci95": (diffs[int(0.025 * reps)], diffs[int(0.975 * reps) - 1]), "p_greater": sum(d <= 0 for d in diffs) / reps, "reps": reps}


def compare(a_items: dict, b_items: dict) -> dict | None:
    """b against a on their common (training seed, game) pairs: McNemar and the cluster bootstrap."""
    from recursa.stats import paired_compare

    x, y, games = pairs(a_items, b_items)
    if not x:
        return None
    out = paired_compare(x, y)
    boot = cluster_bootstrap(x, y, games)
    return {"n": out["n"], "diff": out["diff"], "diff_ci95": list(out["diff_ci95"]), "b": out["b"], "c": out["c"],
            "p_greater": out["p_greater"], "p_two_sided": out["p_two_sided"], "cluster_ci95": list(boot["ci95"]), "cluster_p_greater": boot["p_greater"],
            "cluster_reps": boot["reps"]}


def item_map(entry: dict, point: str = "final", episodes: int | None = None) -> dict[tuple[int, int], bool]:
    """(training seed, held-out game seed) -> success, at the final evaluation or at the last
    evaluation point of each seed with at most `episodes` sampled episodes."""
    out = {}
    for s in entry["seeds"]:
        if point == "final":
            items = s["heldout"]["items"]
        else:
            reached = [p for p in s["curve"] if p["episodes"] <= episodes]
            if not reached:
                continue
            items = reached[-1]["items"]
        for i in items:
            out[(s["seed"], i["seed"])] = bool(i["success"])
    return out


# ----------------------------------------------------------------------------- summary


def summarise(result: dict) -> dict:
    """Paired comparisons of every recipe against warm_start and the GRPO baseline
    (result['baseline'], by default the recipe named grpo; a pilot's tagged GRPO, e.g.
    grpo@lr1e-5, with --baseline), and the episodes each recipe needed to reach the
    baseline's final pooled success (result['comparisons'])."""
    from recursa.stats import wilson_interval

    recipes = result["recipes"]
    base = result.get("baseline", "grpo")
    grpo_items = item_map(recipes[base]) if base in recipes else {}
    comparisons = {}
    for name, entry in recipes.items():
        items = item_map(entry)
        k, n = sum(items.values()), len(items)
        row = {"pooled": [k, n, *wilson_interval(k, n)] if n else None}
        if "warm_start" in recipes and name != "warm_start":
            row["vs_warm_start"] = compare(item_map(recipes["warm_start"]), items)
        if base in recipes and name not in (base, "warm_start"):
            # at equal budgets: a recipe that sampled more episodes than GRPO (hinted re-rolls) is
            # compared at its last evaluation within GRPO's episodes
            budget = min(s["episodes"] for s in recipes[base]["seeds"])
            over = any(s["episodes"] > budget for s in entry["seeds"])
            row["vs_grpo"] = compare(grpo_items, item_map(entry, "curve", budget) if over else items)
            if row["vs_grpo"] is not None:
                row["vs_grpo"]["at_episodes"] = budget if over else None
        if base in recipes and name not in (base, "warm_start"):
            target = sum(grpo_items.values()) / max(len(grpo_items), 1)
            points = sorted({p["episodes"] for s in entry["seeds"] for p in s["curve"]})
            reach = None
            for e in points:
                m = item_map(entry, "curve", e)
                if m and len(m) == n and sum(m.values()) / len(m) >= target:
                    reach = e
                    break
            row["episodes_to_grpo_final"] = reach
        comparisons[name] = row
    return comparisons


def item_groups(game: dict, seeds: list[int]) -> dict[int, str]:
    """The label of each held-out game under game['group_by'] (an attribute the env sets on
    reset, e.g. household's task_type); {} for a game without one."""
    if not game.get("group_by"):
        return {}
    from recursa.config import load_config
    from recursa.envs import make_env

    cfg = load_config(None, game["sets"], recipe="grpo")
    env = make_env(cfg.env.name, **cfg.env.kwargs)
    labels = {}
    for seed in seeds:
        env.reset(seed)
        labels[seed] = str(getattr(env, game["group_by"]))
    return labels


def by_group(result: dict, labels: dict[int, str]) -> dict[str, dict[str, list[int]]]:
    """recipe -> label -> [successes, items] of the final held-out play, pooled over seeds."""
    out = {}
    for name, entry in result["recipes"].items():
        counts: dict[str, list[int]] = {}
        for s in entry["seeds"]:
            for item in s["heldout"]["items"]:
                c = counts.setdefault(labels[item["seed"]], [0, 0])
                c[0] += bool(item["success"])
                c[1] += 1
        out[name] = dict(sorted(counts.items()))
    return out


def _game_name(result: dict) -> str:
    """The env, and the benchmark's game when it differs (household from the light warm start: household_light)."""
    game = result.get("game")
    return result["env"] if not game or game == result["env"].replace(":", "_").replace("-", "_") else f"{result['env']} ({game})"


def _fmt_cmp(c: dict | None) -> str:
    if c is None:
        return "-"
    at = f" (at <= {c['at_episodes']} episodes)" if c.get("at_episodes") else ""
    # no resample at or below 0: the bootstrap p is below 1/reps, not 0
    cp = f"<{1 / c.get('cluster_reps', BOOT_REPS):.0g}" if c["cluster_p_greater"] == 0 else f"={c['cluster_p_greater']:.2g}"
    return (f"{c['diff']:+.3f}{at} [{c['diff_ci95'][0]:+.3f}, {c['diff_ci95'][1]:+.3f}] p={c['p_greater']:.2g}"
            f" (games: [{c['cluster_ci95'][0]:+.3f}, {c['cluster_ci95'][1]:+.3f}] p{cp})")


def table(result: dict) -> str:
    b = result["budget"]
    lines = [
        f"# Self-improvement on {_game_name(result)}",
        "",
        f"Warm start `{result['warm_start']}`; per run {b['steps']} steps x {b['prompts_per_step']} games x {b['group_size']} episodes "
        f"= {b['episodes']} training episodes (RSIPO's extra sampled episodes are counted in its curve); held-out: the first "
        f"{b['eval_n']} {b['split']}-split games, greedy, the same for every run; training seeds {result['seeds']}.",
        "",
        f"| recipe | seeds | episodes sampled (mean) | final success, pooled k/n [Wilson 95%] | per seed | vs warm_start: diff [95%] one-sided McNemar p (game-clustered bootstrap) | vs {result.get('baseline', 'grpo')} | s per run |",
        "|---|---:|---:|---|---|---|---|---:|",
    ]
    for name, entry in result["recipes"].items():
        c = result["comparisons"][name]
        pooled = c["pooled"]
        per_seed = ", ".join(f"{s['heldout']['success_rate']:.2f}" for s in entry["seeds"])
        episodes = sum(s["episodes"] for s in entry["seeds"]) / len(entry["seeds"])
        wall = sum(s["wall_s"] for s in entry["seeds"]) / len(entry["seeds"])
        lines.append(
            f"| {name} | {len(entry['seeds'])} | {episodes:.0f} | {pooled[0]}/{pooled[1]} = {pooled[0] / pooled[1]:.3f} [{pooled[2]:.3f}, {pooled[3]:.3f}] "
            f"| {per_seed} | {_fmt_cmp(c.get('vs_warm_start'))} | {_fmt_cmp(c.get('vs_grpo'))} | {wall:.0f} |"
        )
    reach = {n: c["episodes_to_grpo_final"] for n, c in result["comparisons"].items() if "episodes_to_grpo_final" in c}
    if reach:
        base = result.get("baseline", "grpo")
        lines += ["", f"Episodes each recipe needed to reach {base}'s final pooled success (at an evaluation point; '-' = not reached): "
                  + ", ".join(f"{n}: {e if e is not None else '-'}" for n, e in reach.items()) + f" ({base}: {b['episodes']})."]
    lines += ["", "Pairs are (training seed, held-out game); the warm start's greedy play is deterministic, so its one evaluation is paired "
              "with every seed. The clustered bootstrap resamples games (each with all its seeds), the honest interval when the same "
              "game is played by every seed.", ""]
    if result.get("by_group"):
        labels = sorted({g for counts in result["by_group"].values() for g in counts})
        lines += [f"Final success by {result['group_by']} (pooled over seeds, k/n):", "", "| recipe | " + " | ".join(labels) + " |",
                  "|---|" + "---:|" * len(labels)]
        for name, counts in result["by_group"].items():
            lines.append(f"| {name} | " + " | ".join(f"{counts[g][0]}/{counts[g][1]}" if g in counts else "-" for g in labels) + " |")
        lines.append("")
    keys = sorted({k for e in result["recipes"].values() for s in e["seeds"] for k, v in s.get("diagnostics", {}).items() if isinstance(v, (int, float))})
    keys = [k for k in keys if k.startswith(REPORTED_DIAGNOSTICS)]
    if keys:
        lines += ["What each recipe did (step means, then the mean over seeds):", "", "| recipe | " + " | ".join(keys) + " |", "|---|" + "---:|" * len(keys)]
        for name, entry in result["recipes"].items():
            cells = []
            for key in keys:
                values = [s["diagnostics"][key] for s in entry["seeds"] if key in s.get("diagnostics", {})]
                cells.append(f"{sum(values) / len(values):.3f}" if values else "-")
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from recursa.stats import wilson_interval

    fig = Figure(figsize=(8, 4.8), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    start = None  # every run starts from the warm start: its pooled success is each curve's first point
    if "warm_start" in result["recipes"]:
        m = item_map(result["recipes"]["warm_start"])
        start = (sum(m.values()), len(m))
    xmax = max((p["episodes"] for e in result["recipes"].values() for s in e["seeds"] for p in s["curve"]), default=1) or 1
    for c, (name, entry) in enumerate(result["recipes"].items()):
        color = f"C{c}"
        if name == "warm_start":
            m = item_map(entry)
            k, n = sum(m.values()), len(m)
            lo, hi = wilson_interval(k, n)
            ax.axhline(k / n, color=color, linestyle="--", label=f"warm start ({k}/{n})")
            ax.axhspan(lo, hi, color=color, alpha=0.1)
            continue
        points = sorted({p["episodes"] for s in entry["seeds"] for p in s["curve"]})
        xs, ys, los, his = [], [], [], []
        if start is not None and 0 not in points:
            lo, hi = wilson_interval(*start)
            xs.append(0), ys.append(start[0] / start[1]), los.append(lo), his.append(hi)
        for x in points:
            items = [i["success"] for s in entry["seeds"] for p in s["curve"] if p["episodes"] == x for i in p["items"]]
            if not items:
                continue
            k, n = sum(items), len(items)
            lo, hi = wilson_interval(k, n)
            xs.append(x), ys.append(k / n), los.append(lo), his.append(hi)
        ax.plot(xs, ys, marker="o", color=color, label=f"{name} ({len(entry['seeds'])} seeds pooled)")
        ax.fill_between(xs, los, his, color=color, alpha=0.15)
        for s in entry["seeds"]:
            ax.plot([p["episodes"] for p in s["curve"]], [p["success_rate"] for p in s["curve"]], color=color, alpha=0.3, linewidth=0.8)
    ax.set_xlim(-0.02 * xmax, 1.02 * xmax)
    ax.set_xlabel("episodes sampled (every episode the recipe played)")
    ax.set_ylabel(f"held-out success ({result['budget']['split']} split, greedy)")
    ax.set_title(f"{_game_name(result)}: held-out success vs episodes (Wilson 95% over pooled items; thin: seeds)")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(True, alpha=0.3)
    ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, format="png")


# ----------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--games", default="twx:twc", help=f"comma-separated: {', '.join(GAMES)}")
    p.add_argument("--tiny", action="store_true", help="tiny random model on toy-corridor (checks the script; seconds per run)")
    p.add_argument("--recipes", default=",".join(BASE_RECIPES), help=f"comma-separated: {', '.join(BASE_RECIPES)}, rft (expert iteration at equal episodes), GRPO options {', '.join(GRPO_OPTIONS)}, RSIPO ablations {', '.join(ABLATIONS)}, or all (the base recipes and every ablation)")
    p.add_argument("--seeds", default="0,1,2", help="training seeds (at least 3)")
    p.add_argument("--steps", type=int, help="training steps per run (default: the game's)")
    p.add_argument("--eval-n", type=int, help="held-out games per evaluation (default: the game's)")
    p.add_argument("--eval-every", type=int, help="evaluate every N steps, besides after (default: the game's)")
    p.add_argument("--split", choices=("test", "gate"), default="test", help="held-out split; gate (the dev fold) is for pilots and writes under pilot/")
    p.add_argument("--results", help="where per-run result files and the summaries go (default: benchmarks/results/self_improve[/pilot])")
    p.add_argument("--out", help="alias of --results (the tiny check writes here)")
    p.add_argument("--runs-dir", help="run directories (default: runs/bench, runs/bench_pilot with --split gate)")
    p.add_argument("--keep-checkpoints", action="store_true", help="keep each run's checkpoints (large for the 135M model)")
    p.add_argument("--device", help="model.device for every run (e.g. cuda); default: recursa's auto")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a training setting of every run but warm_start (a pilot, e.g. train.lr=2e-6); needs --tag")
    p.add_argument("--tag", default="", help="appended to the recipe names of runs made with --set (e.g. @lr2e-6), so they never replace the default runs")
    p.add_argument("--baseline", default="grpo", help="the GRPO run the others are compared with in the summary (e.g. a pilot's grpo@lr1e-5)")
    p.add_argument("--interpolate", default="", metavar="ALPHA[,ALPHA]",
                   help="also evaluate each trained run's final weights moved toward the warm start, theta_0 + ALPHA (theta - theta_0), "
                   "as recipe <name>+wise<ALPHA> (fix ALPHA before the runs); a committed run whose weights were not kept is trained again")
    p.add_argument("--extend-from", metavar="TAG", help="train each run by going on from the kept last checkpoint of the same recipe and seed "
                   "under TAG (--keep-checkpoints), trained with the same settings but fewer --steps: e.g. --steps 16 --tag @x16 --extend-from @x")
    p.add_argument("--replace", action="store_true", help="a committed result of other settings under the same name is trained again and replaced "
                   "(without it, such a run stops with an error)")
    p.add_argument("--report", action="store_true", help="run nothing: tables and plots from the result files present")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    try:
        args.interpolate = [float(a) for a in args.interpolate.split(",") if a.strip()]
    except ValueError:
        print(f"error: --interpolate {args.interpolate!r}: give weights between 0 and 1, e.g. 0.5", file=sys.stderr)
        return 2
    if any(not 0.0 < a < 1.0 for a in args.interpolate):
        print(f"error: --interpolate {args.interpolate}: give weights strictly between 0 (the warm start) and 1 (the run)", file=sys.stderr)
        return 2
    if args.worker:
        worker(json.loads(args.worker))
        return 0

    games = [TINY] if args.tiny else []
    if not args.tiny:
        for g in (g.strip() for g in args.games.split(",") if g.strip()):
            if g not in GAMES:
                print(f"error: unknown game {g!r}; choose from {', '.join(GAMES)}", file=sys.stderr)
                return 2
            games.append(GAMES[g])
    names = list(dict.fromkeys(["warm_start", "grpo", "rsipo", *ABLATIONS] if args.recipes == "all" else [r.strip() for r in args.recipes.split(",") if r.strip()]))
    for name in names:
        for game in games:
            if "recipes" in game and name not in game["recipes"]:
                print(f"error: {game['slug']} offers only {', '.join(game['recipes'])} (its episodes are chats; docs/chat.md), not {name!r}", file=sys.stderr)
                return 2
        recipe_spec(name, games[0])  # fail fast on an unknown name
    seeds = [int(s) for s in args.seeds.split(",")]
    if args.set and not args.tag:
        print("error: --set changes the runs' settings: give them a --tag (e.g. --tag @lr2e-6) so their results are kept apart", file=sys.stderr)
        return 2
    args.results = args.results or args.out or str(RESULTS / "pilot" if args.split == "gate" else RESULTS)
    args.runs_dir = args.runs_dir or str(REPO / "runs" / ("bench_tiny" if args.tiny else "bench_pilot" if args.split == "gate" else "bench"))
    games = [{**game, "pin": Path(args.results) / game["slug"] / "warm_start_pin.json"} for game in games]
    for game in games:
        if not args.report and game["warm_start"] and not (REPO / game["warm_start"] / "config.toml").exists():
            print(f"error: the warm start {game['warm_start']} is missing: train it first, {game['warm_start_cmd']}", file=sys.stderr)
            return 2
        if not args.report:
            pin_warm_start(game)
            if (warning := pin_mismatch(game)) is not None:
                print(warning, file=sys.stderr)
    for game in games:
        steps = args.steps or game["steps"]
        B, G = setting_value(game, "train.prompts_per_step"), setting_value(game, "train.group_size")
        model = next(s.split("=", 1)[1] for s in game["sets"] if s.startswith("model.name="))
        result = {
            "env": game["env"],
            "game": game["slug"],
            "warm_start": game["warm_start"] or f"{model}'s own weights",
            "budget": {"steps": steps, "prompts_per_step": B, "group_size": G, "episodes": steps * B * G, "eval_n": args.eval_n or game["eval_n"],
                       "eval_every": args.eval_every or game["eval_every"], "split": args.split, "model": model},
            "seeds": seeds,
            "settings": game["sets"],
            "baseline": args.baseline,
            "recipes": {},
        }
        for seed in seeds:  # seeds outermost, recipes alternating: slow drift of a shared machine hits all alike
            for name in names:
                if name == "warm_start":  # deterministic: evaluated once, paired with every seed
                    entry = run_one(name, seeds[0], args, game)
                    if entry is not None:
                        entry = {**entry, "seed": seed}
                else:
                    entry = run_one(name, seed, args, game)
                if entry is not None:
                    sets = recipe_spec(name, game)[1] + (args.set if name != "warm_start" else [])
                    result["recipes"].setdefault(label(name, args), {"recipe": recipe_spec(name, game)[0], "sets": sets, "seeds": []})["seeds"].append(entry)
                    for derived, record in ([] if name == "warm_start" else interpolated_entries(name, seed, args, game)):
                        result["recipes"].setdefault(derived, {"recipe": recipe_spec(name, game)[0], "sets": [*sets, f"interpolate={record['interpolate']['alpha']:g}"],
                                                               "seeds": []})["seeds"].append(record)
        result["seeds"] = add_committed(result, args, game, seeds)
        if not result["recipes"]:
            print(f"{game['env']}: no results yet", flush=True)
            continue
        result["comparisons"] = summarise(result)
        labels = item_groups(game, sorted({i["seed"] for e in result["recipes"].values() for s in e["seeds"] for i in s["heldout"]["items"]}))
        if labels:
            result["group_by"], result["by_group"] = game["group_by"], by_group(result, labels)
        out = Path(args.results)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{game['slug']}.json").write_text(json.dumps(result, indent=1) + "\n")
        text = table(result)
        (out / f"{game['slug']}.md").write_text(text)
        plot(result, out / f"{game['slug']}.png")
        print(text)
        print(f"wrote {out / game['slug']}.json, .md and .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
