"""Command line: `recursa train | eval | export | report | lineage | envs | examples`.

Bad input (an unknown config key, a wrong type, an unknown task, a missing model file)
exits with status 2 and one line naming the problem and the fix; `--debug` shows the
traceback instead.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from recursa.errors import UserError
from recursa.runio import RunLock, is_run_dir, remove_run_files, user_error_of
from recursa.trust import PARTS, TRUST_FLAG

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _console():
    from rich.console import Console

    return Console(stderr=False, highlight=False, width=None if sys.stdout.isatty() else 160)


class _Progress:
    """A progress bar on a terminal; silent otherwise (logs stay readable in files)."""

    def __init__(self):
        self.enabled = sys.stderr.isatty()
        self._bars: dict[str, object] = {}
        self._rich = None
        if self.enabled:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self._rich = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), transient=True)
            self._rich.start()

    def __call__(self, phase: str, done: int, total: int) -> None:
        if not self.enabled:
            return
        if phase not in self._bars:
            self._bars[phase] = self._rich.add_task(phase, total=total)
        self._rich.update(self._bars[phase], completed=done)
        if done >= total:
            self._rich.remove_task(self._bars.pop(phase))

    def stop(self) -> None:
        if self._rich is not None:
            self._rich.stop()


def _recipe_train(name: str):
    """The `train` function of a recipe module (imported only when used)."""
    import importlib

    return importlib.import_module(f"recursa.recipes.{name}").train


def _run_config(run_dir: Path, args, parts, extra=()):
    """The stored config of a run directory the user names (with their --set overrides),
    after the trust boundary (recursa/trust.py): the code it names by import path is refused
    unless --trust-run-code or the same spec is typed again; then checked as a user's config is."""
    from recursa.config import check_plugins, load_config
    from recursa.trust import command_line_strings, refuse_run_code

    cfg = load_config(run_dir / "config.toml", args.set, check=False)
    refuse_run_code(cfg, str(run_dir), args.trust_run_code, command_line_strings(args.set, extra), parts)
    if set(parts) == set(PARTS):
        check_plugins(cfg)
    return cfg


def cmd_train(args) -> int:
    from recursa.config import RECIPES, describe, load_config
    from recursa.distributed import ddp
    from recursa.report import write_report

    if args.help_config:
        print("\n".join(describe(RECIPES[args.recipe])))
        return 0
    if args.out is not None and not args.out.strip():
        raise UserError("--out '': give the run directory a name, e.g. --out runs/smoke")
    if args.resume:
        run_dir = Path(args.resume)
        if not (run_dir / "config.toml").exists():
            raise UserError(f"--resume {run_dir}: no config.toml there; pass the directory of an earlier `recursa train` run")
        if args.config:  # a config the user passes may name code
            cfg = load_config(args.config, args.set)
        else:  # the run's stored config is data: the code it names needs --trust-run-code
            cfg = _run_config(run_dir, args, PARTS)
        out = run_dir
    else:
        if not args.config:
            raise UserError("recursa train needs a CONFIG file (e.g. examples/smoke.toml) or --resume RUN_DIR")
        cfg = load_config(args.config, args.set)
        out = Path(args.out or cfg.run.out or f"runs/{cfg.recipe}")
    learner = ddp.setup(cfg)  # None in one process; under torchrun, rank 0 drives and the other ranks serve updates
    if learner is not None and not learner.is_driver:
        from recursa.distributed.worker import serve

        serve(learner)  # never touches the run directory
        learner.close()
        return 0
    if out.exists() and not out.is_dir():
        raise UserError(f"{out} is a file, not a directory: choose another --out")
    resume = bool(args.resume)
    if not resume and cfg.run.resume == "auto" and not args.overwrite and (out / "config.toml").exists():
        resume = True  # run.resume = "auto": continue the run already there
        print(f"run.resume = 'auto': continuing the run in {out}")
    if args.overwrite and not resume and out.is_dir() and any(p.name != ".recursa.lock" for p in out.iterdir()) and not is_run_dir(out):
        remove_run_files(out)  # refuses (UserError) before anything, even a lock file, is written there
    from recursa.models import resolve_device

    resolve_device(cfg.model.device)  # a GPU asked for and missing fails before the run directory is touched
    # Held while this process writes the run; a second writer is refused in one line. A new
    # directory is locked when the run store creates it (nothing is written there before).
    lock = RunLock.of(out)
    if out.exists():
        lock.acquire()
    try:
        if not resume:
            if (out / "metrics.jsonl").exists() and not args.overwrite:
                raise UserError(f"{out} already holds a run: continue it with --resume {out}, choose another --out, or pass --overwrite")
            if args.overwrite:
                kept = remove_run_files(out)  # refuses a directory that is not a recursa run; deletes only the run's own files
                if kept:
                    print(f"--overwrite: kept {len(kept)} file(s) in {out} that are not the run's: {', '.join(sorted(kept)[:5])}", file=sys.stderr)
        console = _console()
        progress = _Progress()
        try:
            _recipe_train(cfg.recipe)(cfg, out, resume=resume, progress=progress, log=console.print)
        finally:
            progress.stop()
    finally:
        lock.release_all()  # also when the recipe stopped on an error without closing its store
    if learner is not None:  # on an error instead, torchrun stops the workers with rank 0
        learner.stop()
        learner.close()
    report = write_report(out)
    console.print(f"run written to {out}; report: {report}")
    return 0


def _eval_source(args):
    """(config, model config, weights dir or None, base dir or None, env name, env kwargs, max_new_tokens)."""
    from recursa.config import ModelConfig, load_config
    from recursa.export import run_base_dir, run_checkpoint
    from recursa.store import finished_checkpoints

    cfg = None
    weights = base = None
    if args.run:
        run_dir = Path(args.run)
        if not (run_dir / "config.toml").exists():
            raise UserError(f"--run {run_dir}: no config.toml there; pass a run directory written by `recursa train`")
        # the run's task is built here unless --env replaces it: its code, and its data file outside the run, need --trust-run-code
        cfg = _run_config(run_dir, args, () if args.env else ("env", "scorer", "data"), [args.env])
        if args.checkpoint == "last" and not finished_checkpoints(run_dir):
            raise UserError(f"{run_dir} has no checkpoint yet; evaluate the base model with --config instead")
        weights = run_checkpoint(run_dir, args.checkpoint)
        base = run_base_dir(cfg) if not args.model else None  # a LoRA run's adapters sit on its warm start
    elif args.config:
        cfg = load_config(args.config, args.set)
    else:
        cfg = load_config(None, args.set)
    model_cfg = cfg.model if not args.model else ModelConfig(**{**cfg.model.model_dump(), "name": args.model})
    env_name = args.env or cfg.env.name
    env_kwargs = dict(cfg.env.kwargs) if not args.env else {}
    for item in args.env_arg:
        from recursa.config import parse_override

        key, value = parse_override(item)
        env_kwargs[".".join(key)] = value
    max_new = args.max_new_tokens if args.max_new_tokens is not None else (cfg.eval.max_new_tokens or cfg.sampling.max_new_tokens)
    return cfg, model_cfg, weights, base, env_name, env_kwargs, max_new


def _check_eval_args(args):
    """Flags of `recursa eval` checked before anything is loaded; returns the --compare
    evaluation (read and validated now, not after a long evaluation) or None."""
    from recursa.config import SIZE_LIMITS
    from recursa.evaluate import EvalResult

    if args.n is not None and not 1 <= args.n <= SIZE_LIMITS["n"]:
        raise UserError(f"--n {args.n}: evaluate at least 1 and at most {SIZE_LIMITS['n']:g} items")
    if args.max_new_tokens is not None and not 1 <= args.max_new_tokens <= SIZE_LIMITS["max_new_tokens"]:
        raise UserError(f"--max-new-tokens {args.max_new_tokens}: give a cap between 1 and {SIZE_LIMITS['max_new_tokens']:g}")
    if args.checkpoint != "last" and not str(args.checkpoint).isdigit():
        raise UserError(f"--checkpoint {args.checkpoint!r}: give 'last' or a step number")
    if args.interpolate is not None:
        from recursa.export import check_alpha

        check_alpha(args.interpolate)
        if not args.run or args.model or args.policy != "model":
            raise UserError("--interpolate moves a run's checkpoint toward the run's warm start: pass --run RUN_DIR, without --model or --policy")
    if args.json:
        target = Path(args.json)
        if target.is_dir():
            raise UserError(f"--json {target} is a directory: pass a file path, e.g. {target / 'eval.json'}")
        if not target.parent.is_dir():
            raise UserError(f"--json {target}: directory {target.parent} does not exist; create it or choose another path")
        if not os.access(target.parent, os.W_OK):
            raise UserError(f"--json {target}: directory {target.parent} is not writable; choose another path")
    return EvalResult.load(Path(args.compare)) if args.compare else None


def _eval_hints(args, cfg, weights, env_name: str, pool, n: int):
    """`recursa eval --skills`: (one hint per evaluated seed, a line saying what was shown), or
    (None, "") for --skills off. The library is the snapshot stored with a checkpoint of an
    RSIPO run: the evaluated --run's checkpoint (on) or RUN_DIR's last one; each item is shown
    its task's best skill, retrieved as RSIPO's skills.in_context does during training."""
    import json

    from recursa.config import load_config
    from recursa.envs.base import split_seeds
    from recursa.recipes.rsipo import task_hints
    from recursa.rollout import is_agent_env
    from recursa.skills import SkillLibrary
    from recursa.store import finished_checkpoints

    if args.skills == "off":
        return None, ""
    if args.policy != "model":
        raise UserError(f"--skills shows skills to the model; --policy {args.policy} does not read prompts: drop --skills or use --policy model")
    if args.skills == "on":
        if weights is None:
            raise UserError("--skills on reads the library of the run being evaluated: pass --run RUN_DIR (an rsipo run), or --skills RUN_DIR")
        source, ckpt, run_cfg = Path(args.run), weights, cfg
    else:
        source = Path(args.skills)
        if not (source / "config.toml").exists():
            raise UserError(f"--skills {source}: no run there (no config.toml); pass on, off or the directory of an rsipo run")
        run_cfg = load_config(source / "config.toml", check=False)  # only its [skills] settings are read: nothing it names is imported
        ckpts = finished_checkpoints(source)
        if not ckpts:
            raise UserError(f"--skills {source}: the run has no finished checkpoint, so no stored library yet")
        ckpt = ckpts[-1]
    if run_cfg.recipe != "rsipo":
        raise UserError(f"--skills: {source} is a {run_cfg.recipe} run; only rsipo runs keep a skill library")
    try:
        snapshot = json.loads((ckpt / "state.json").read_text()).get("skills")
    except (ValueError, AttributeError):
        raise UserError(f"--skills: {ckpt / 'state.json'} is not a readable checkpoint state: the checkpoint is corrupt") from None
    if snapshot is None:
        raise UserError(f"--skills: {ckpt} stores no skill library (written by an older recursa?)")
    library = SkillLibrary(":memory:")
    library.restore(snapshot)
    multi_turn = is_agent_env(pool.take(1)[0])
    hints = task_hints(library, pool, split_seeds(args.split, n), run_cfg.skills.retrieve_k, run_cfg.skills.retrieval, env_name, multi_turn)
    shown = sum(h is not None for h in hints)
    return hints, f"skills: {len(library)} in the library of {source} ({ckpt.name}); {shown} of {n} items shown one"


def cmd_eval(args) -> int:
    import torch

    from recursa.envs import EnvPool, make_env
    from recursa.evaluate import evaluate, evaluate_scripted
    from recursa.models import load_policy
    from recursa.stats import paired_compare

    other = _check_eval_args(args)  # --compare is read before the evaluation, not after it
    cfg, model_cfg, weights, base, env_name, env_kwargs, max_new = _eval_source(args)
    torch.set_num_threads(cfg.run.threads)
    from recursa.envs.dataset import task_factory, uses_dataset
    from recursa.recipes.common import eval_items, supervision_of

    factory = task_factory(cfg) if uses_dataset(cfg) and not args.env else lambda: make_env(env_name, **env_kwargs)
    pool = EnvPool(factory, supervision=supervision_of(cfg))  # a crashed game is restarted, its item failed
    pool.take(1)  # fail fast on a bad task spec
    n = eval_items(pool, args.split, args.n if args.n is not None else cfg.eval.n)
    hints, skills_note = _eval_hints(args, cfg, weights, env_name, pool, n)
    progress = _Progress()
    try:
        if args.policy != "model":
            result = evaluate_scripted(args.policy, pool, env_name, args.split, n, seed=cfg.train.seed, label=args.label or args.policy)
        else:
            from recursa.engines import make_engine

            policy = load_policy(model_cfg, weights_dir=weights, base_dir=base)
            if args.interpolate is not None:  # theta_0 + alpha (theta - theta_0), theta_0 the run's warm start
                from recursa.export import interpolated_policy, warm_start_policy

                policy = interpolated_policy(policy, warm_start_policy(cfg, model_cfg.device), args.interpolate)
            from recursa.config import resolve_auto
            from recursa.rollout import is_agent_env

            resolve_auto(cfg, is_agent_env(pool.take(1)[0]))  # 'auto' rollout settings for this task (a run's config.toml has them resolved)
            engine = make_engine(cfg.rollout, policy)  # rollout.engine: native (default) or vllm
            result = evaluate(
                policy,
                pool,
                env_name,
                args.split,
                n,
                max_new,
                cfg.model.system_prompt or None,
                batch_size=cfg.eval.batch_size,
                stop=tuple(cfg.sampling.stop),
                label=args.label or (weights.name if weights else model_cfg.name) + (f"@{args.interpolate:g}" if args.interpolate is not None else "")
                + ("+skills" if hints is not None else ""),
                progress=lambda d, t: progress("eval", d, t),
                agent=cfg.agent,
                hints=hints,
                engine=engine,
            )
            engine.close()
    finally:
        progress.stop()
        pool.close()
    from rich.table import Table

    table = Table(title=f"{env_name} · {args.split} split")
    for col in ("policy", "n", "success [95% CI]", "mean reward", "mean steps [95% CI]", "invalid rate [95% CI]", "seconds"):
        table.add_column(col)
    table.add_row(
        result.label,
        str(result.n),
        f"{result.success_rate:.3f} [{result.ci95[0]:.3f}, {result.ci95[1]:.3f}]",
        f"{result.mean_reward:.3f}",
        f"{result.mean_steps:.2f} [{result.mean_steps_ci95[0]:.2f}, {result.mean_steps_ci95[1]:.2f}]",
        f"{result.invalid_rate:.3f} [{result.invalid_rate_ci95[0]:.3f}, {result.invalid_rate_ci95[1]:.3f}]",
        f"{result.seconds:.1f}",
    )
    console = _console()
    console.print(table)
    if skills_note:
        console.print(skills_note)
    if args.json:
        result.save(Path(args.json))
        console.print(f"wrote {args.json}")
    if other is not None:
        before = {i.seed: i.success for i in other.items}
        common = [i for i in result.items if i.seed in before]
        if not common:
            raise UserError(f"{args.compare} shares no item seeds with this evaluation: evaluate the same split and n")
        cmp = paired_compare([before[i.seed] for i in common], [i.success for i in common])
        console.print(
            f"vs {args.compare}: {cmp['before_rate']:.3f} -> {cmp['after_rate']:.3f} (diff {cmp['diff']:+.3f}, "
            f"95% CI [{cmp['diff_ci95'][0]:+.3f}, {cmp['diff_ci95'][1]:+.3f}]) on {cmp['n']} shared items; "
            f"McNemar b={cmp['b']} c={cmp['c']} p(one-sided)={cmp['p_greater']:.3g} p(two-sided)={cmp['p_two_sided']:.3g}"
        )
        if args.json:
            from recursa.runio import atomic_write_json

            data = {**result.to_json(), "compare": {"against": str(args.compare), **{k: (list(v) if isinstance(v, tuple) else v) for k, v in cmp.items()}}}
            atomic_write_json(Path(args.json), data)
    return 0


def cmd_export(args) -> int:
    from recursa.export import export_run

    run_dir = Path(args.run_dir)
    if not run_dir.is_dir():
        raise UserError(f"{run_dir} is not a directory: pass a run directory written by `recursa train`")
    if not args.out.strip():
        raise UserError("--out '': give the model directory a name, e.g. --out models/smoke")
    out = export_run(run_dir, Path(args.out), args.checkpoint, args.dtype, args.overwrite, args.interpolate)
    print(f"wrote {out}: load it with AutoModelForCausalLM.from_pretrained({str(out)!r}) or vllm.LLM(model={str(out)!r})")
    return 0


def cmd_report(args) -> int:
    from recursa.report import write_report

    run_dir = Path(args.run_dir)
    if not run_dir.is_dir():
        raise UserError(f"{run_dir} is not a directory: pass a run directory written by `recursa train`")
    try:
        path = write_report(run_dir)
    except (ValueError, KeyError, TypeError) as exc:
        raise UserError(f"{run_dir}: cannot read the run's logs ({_first_line(exc)}): the run directory is corrupt; fix or remove that file") from None
    print(f"wrote {path}")
    return 0


def cmd_lineage(args) -> int:
    from recursa.lineage import show_lineage

    run_dir = Path(args.run_dir)
    if not run_dir.is_dir():
        raise UserError(f"{run_dir} is not a directory: pass a run directory written by `recursa train`")
    tree, png = show_lineage(run_dir)
    print(tree)
    print(f"wrote {png}")
    return 0


def cmd_envs(args) -> int:
    from recursa.envs import list_envs

    for name, desc in list_envs():
        print(f"{name:28s} {desc}")
    if args.all:
        try:
            from recursa.envs.base import list_reasoning_gym_datasets

            for name in list_reasoning_gym_datasets():
                print(f"rg:{name}")
        except UserError as exc:
            print(exc)
    return 0


def _examples_source():
    """The example configs: the `recursa.examples` data package of an installed wheel (or an
    editable install), else the `examples/` directory of a source checkout."""
    from importlib import resources

    try:
        return resources.files("recursa.examples")
    except ModuleNotFoundError:
        checkout = Path(__file__).resolve().parent.parent / "examples"
        if checkout.is_dir():
            return checkout
    raise UserError("the example configs are missing from this installation: reinstall recursa from a wheel or a source checkout")


def _example_files(root, rel: Path = Path()) -> list[tuple[Path, object]]:
    """(relative path, traversable) of every .toml under `root`, sorted."""
    found = []
    for entry in root.iterdir():
        if entry.is_dir() and not entry.name.startswith(("_", ".")):
            found.extend(_example_files(entry, rel / entry.name))
        elif entry.name.endswith(".toml"):
            found.append((rel / entry.name, entry))
    return sorted(found, key=lambda item: item[0])


def cmd_examples(args) -> int:
    files = _example_files(_examples_source())
    if args.list:
        for rel, _ in files:
            print(rel.as_posix())
        return 0
    from recursa.runio import atomic_write_bytes, inside

    dest = Path(args.dir)
    if dest.exists() and not dest.is_dir():
        raise UserError(f"{dest} is a file: pass a directory to copy the examples into")
    for rel, _ in files:  # a file or folder of DIR linked elsewhere is never written through (issue 49)
        inside(dest, dest / rel, "the examples directory")
    clashes = [rel for rel, src in files if (dest / rel).exists() and (dest / rel).read_bytes() != src.read_bytes()]
    if clashes and not args.overwrite:
        raise UserError(f"{dest / clashes[0]} exists and differs from recursa's example ({len(clashes)} such files): pass --overwrite or another DIR")
    for rel, src in files:
        atomic_write_bytes(dest / rel, src.read_bytes())  # replaces a link inside DIR instead of writing through it
    print(f"copied {len(files)} example configs to {dest}/; try: recursa train {(dest / 'smoke.toml').as_posix()} --out runs/smoke")
    return 0


TRUST_HELP = ("import the code (an env factory, reward function or data scorer named 'pkg.module:attr') that the run directory's stored "
              "config.toml names, and read the data file (data.path) it names outside the run directory; without it such a run is refused, "
              "since a run directory someone else wrote is data, not code")


class _Parser(argparse.ArgumentParser):
    """argparse with a one-line error (the usage is one --help away)."""

    def error(self, message: str):
        self.exit(2, f"error: {self.prog}: {message} (see `{self.prog} --help`)\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="recursa", description="Recursive self-improving policy optimization for language-model agents.")
    p.add_argument("--debug", action="store_true", help="show tracebacks for user errors")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    t = sub.add_parser("train", help="train a policy with a recipe config (TOML): grpo, rsipo, sft or rft (expert iteration); "
                       "data-parallel under `torchrun --nproc_per_node N -m recursa.cli train ...`")
    t.add_argument("config", nargs="?", help="recipe config, e.g. examples/smoke.toml")
    t.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config value, e.g. --set train.lr=1e-5 (repeatable)")
    t.add_argument("--out", help="run directory (default: run.out from the config, else runs/<recipe>)")
    t.add_argument("--resume", metavar="RUN_DIR", help="continue a run from its last checkpoint")
    t.add_argument("--overwrite", action="store_true", help="replace an existing run directory")
    t.add_argument(TRUST_FLAG, action="store_true", help="with --resume: " + TRUST_HELP)
    t.add_argument("--help-config", action="store_true", help="list every config key of --recipe with its default and meaning")
    t.add_argument("--recipe", default="grpo", choices=["grpo", "rsipo", "sft", "rft"], help="the recipe --help-config describes (a config file names its own)")
    t.set_defaults(func=cmd_train)

    e = sub.add_parser("eval", help="evaluate a model or a run's checkpoint on held-out items")
    src = e.add_mutually_exclusive_group()
    src.add_argument("--config", help="take model, task and eval settings from a recipe config")
    src.add_argument("--run", help="evaluate a run's checkpoint (see --checkpoint)")
    e.add_argument("--checkpoint", default="last", help="checkpoint step of --run, or 'last'")
    e.add_argument("--policy", default="model", choices=["model", "random", "oracle"], help="who plays: the model (greedy), a uniformly random admissible action, or the game's walkthrough (multi-turn games)")
    e.add_argument("--model", help="model name or directory (overrides the config's)")
    e.add_argument("--env", help="task spec, e.g. arithmetic or rg:basic_arithmetic (see `recursa envs`)")
    e.add_argument("--env-arg", action="append", default=[], metavar="KEY=VALUE", help="task option, e.g. --env-arg difficulty=1")
    e.add_argument("--split", default="test", choices=["gate", "test"], help="held-out seed range")
    e.add_argument("--n", type=int, help="number of items (default: eval.n)")
    e.add_argument("--max-new-tokens", type=int, help="completion cap")
    e.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    e.add_argument("--interpolate", type=float, metavar="ALPHA", help="evaluate theta_0 + ALPHA (theta - theta_0): the --run's checkpoint moved toward "
                   "the weights it started from (init.from_run, else the base model); 1 = the checkpoint, 0 = the warm start (WiSE-FT)")
    e.add_argument(TRUST_FLAG, action="store_true", help="with --run: " + TRUST_HELP)
    e.add_argument("--label", help="label stored in the JSON")
    e.add_argument("--json", help="write the evaluation as JSON to this file")
    e.add_argument("--compare", metavar="EVAL_JSON", help="paired exact McNemar test against an earlier evaluation on the same items")
    e.add_argument(
        "--skills", default="off", metavar="off|on|RUN_DIR",
        help="show each item its task's best skill from a skill library in the prompt (as RSIPO's skills.in_context does): on = the --run's own "
        "library at the evaluated checkpoint, RUN_DIR = that rsipo run's library at its last checkpoint, off (default) = none",
    )
    e.set_defaults(func=cmd_eval)

    x = sub.add_parser("export", help="write a run's checkpoint as a standalone Hugging Face model directory (LoRA merged)")
    x.add_argument("run_dir")
    x.add_argument("--out", required=True, help="the model directory to write")
    x.add_argument("--checkpoint", default="last", help="checkpoint step, or 'last'")
    x.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"], help="weights dtype of the export (auto: the run's model.dtype)")
    x.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    x.add_argument("--interpolate", type=float, metavar="ALPHA", help="write theta_0 + ALPHA (theta - theta_0), the checkpoint moved toward the run's warm start")
    x.set_defaults(func=cmd_export)

    r = sub.add_parser("report", help="write report.md and plots for a run")
    r.add_argument("run_dir")
    r.set_defaults(func=cmd_report)

    g = sub.add_parser("lineage", help="print the tree of gated changes (weights, skills, prompt) and write plots/lineage.png")
    g.add_argument("run_dir")
    g.set_defaults(func=cmd_lineage)

    v = sub.add_parser("envs", help="list the available tasks")
    v.add_argument("--all", action="store_true", help="also list every reasoning-gym dataset")
    v.set_defaults(func=cmd_envs)

    xs = sub.add_parser("examples", help="copy the example configs (shipped inside the package) into a directory")
    xs.add_argument("dir", nargs="?", default="examples", help="where to copy them (default: ./examples)")
    xs.add_argument("--list", action="store_true", help="only list the example configs")
    xs.add_argument("--overwrite", action="store_true", help="replace files in DIR that differ from the examples")
    xs.set_defaults(func=cmd_examples)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print("interrupted: continue with `recursa train --resume RUN_DIR`", file=sys.stderr)
        return 130
    except Exception as exc:  # noqa: BLE001 -- every failure becomes one line; --debug shows the traceback
        if args.debug:
            raise
        message = expected_failure(exc)
        if message is not None:
            print(f"error: {message}", file=sys.stderr)
            return 2
        print(f"internal error: {_where(exc)}: {_first_line(exc)} -- a bug in recursa; rerun with --debug for the traceback and report it", file=sys.stderr)
        return 1


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:400] if text else type(exc).__name__


def _where(exc: BaseException) -> str:
    import traceback

    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return type(exc).__name__
    f = frames[-1]
    return f"{type(exc).__name__} at {Path(f.filename).name}:{f.lineno}"


def expected_failure(exc: BaseException) -> str | None:
    """The one-line message of a failure the user can fix (exit 2), or None for a bug:
    UserError; the operating system's disk-full, permission, read-only and missing-path
    errors; a corrupt SQLite ledger or weights file; running out of memory."""
    import sqlite3

    if isinstance(exc, UserError):
        return " ".join(str(exc).split()) or type(exc).__name__  # the whole message, on one line
    err = user_error_of(exc)
    if err is not None:
        return str(err)
    if isinstance(exc, sqlite3.DatabaseError):
        return f"a run's ledger.sqlite cannot be read ({_first_line(exc)}): the run directory is corrupt; restore it or start a new run"
    name = type(exc).__name__
    if name == "SafetensorError" or "safetensors" in type(exc).__module__:
        return f"a weights file is corrupt or truncated ({_first_line(exc)}): use an earlier checkpoint or re-export the model"
    if isinstance(exc, MemoryError) or name == "OutOfMemoryError":
        return "out of memory: lower train.micro_batch_size, eval.batch_size, train.prompts_per_step x train.group_size or sampling.max_new_tokens"
    if isinstance(exc, OSError):
        where = f" ({exc.filename})" if getattr(exc, "filename", None) else ""
        return f"{exc.strerror or _first_line(exc)}{where}: check the path and the disk"
    return None


if __name__ == "__main__":
    sys.exit(main())
