"""Games that die: a game running in its own process crashes or hangs; the supervised pool
restarts it, fails the episode with a reason, counts env/restarts, and the run goes on
(docs/reliability.md, "Games that die")."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from recursa.cli import main
from recursa.envs import EnvPool, StepResult, register_env
from recursa.envs.supervise import Supervision
from recursa.errors import UserError

ROOT = Path(__file__).resolve().parents[1]

# A corridor game served by a child process over stdin/stdout, one JSON line per call, like
# a game engine in a JVM or an interpreter. "crash_on" makes it die (os._exit) at that step of
# every episode whose seed is even; the action "hang" makes it stop answering.
GAME = r"""
import json, os, sys, time
pos = steps = 0; seed = 0; crash_on = int(sys.argv[1])
for line in sys.stdin:
    cmd = json.loads(line)
    if cmd["op"] == "reset":
        seed, pos, steps = cmd["seed"], 0, 0
        out = {"obs": "You are in room 0 of 3."}
    else:
        steps += 1
        if cmd["action"] == "hang":
            time.sleep(3600)
        if crash_on and steps == crash_on and seed % 2 == 0:
            os._exit(3)
        if cmd["action"] == "go east":
            pos += 1
        won = pos >= 3
        out = {"obs": f"You are in room {pos} of 3.", "won": won, "done": won or steps >= 4, "steps": steps}
    sys.stdout.write(json.dumps(out) + "\n"); sys.stdout.flush()
"""


class PipeGame:
    """A multi-turn env whose game state lives in a child process."""

    name = "toy-pipe-game"
    system_prompt = None
    max_steps = 4
    invalid_penalty = 0.0
    started: list[int] = []  # pids of every game process, in order

    def __init__(self, crash_on: int = 0):
        self.proc = subprocess.Popen([sys.executable, "-c", GAME, str(crash_on)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        PipeGame.started.append(self.proc.pid)
        self.task = "Your task is to: reach room 3."

    def _ask(self, **cmd) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise EOFError("the game process closed its output")
        return json.loads(line)

    def reset(self, seed: int) -> str:
        return self._ask(op="reset", seed=seed)["obs"]

    def step(self, action_text: str) -> StepResult:
        out = self._ask(op="step", action=action_text)
        info = {"won": out["won"], "success": out["won"], "invalid": False, "admissible": self.admissible_actions(), "steps": out["steps"], "score": 0.0}
        return StepResult(out["obs"], float(out["won"]), out["done"], info)

    def admissible_actions(self) -> list[str]:
        return ["go east", "go west", "wait"]

    def walkthrough(self) -> list[str]:
        return ["go east"] * 3

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


register_env("toy-pipe-game", PipeGame, "toy: a corridor game in a child process that can crash (tests)")


def test_killed_game_process_is_restarted_and_the_episode_fails():
    pool = EnvPool(lambda: PipeGame(), supervision=Supervision())
    env = pool.take(1)[0]
    assert env.reset(1) == "You are in room 0 of 3."
    first = env.inner.proc
    os.kill(first.pid, signal.SIGKILL)  # the game process dies mid-episode
    first.wait()
    result = env.step("go east")
    assert result.done and result.reward == 0.0 and not result.info["success"]
    assert result.info["failure"] == "crashed"
    assert "EOFError" in result.info["failure_detail"] or "BrokenPipe" in result.info["failure_detail"]
    assert pool.restarts == 1 and pool.metrics() == {"env/restarts": 1.0} and pool.metrics() == {"env/restarts": 0.0}
    assert env.inner.proc.pid != first.pid and env.inner.proc.poll() is None  # a fresh game
    assert env.reset(2) == "You are in room 0 of 3."
    assert env.step("go east").obs == "You are in room 1 of 3."
    assert env.admissible_actions() == ["go east", "go west", "wait"]  # the wrapper is the env
    pool.close()


def test_hung_game_times_out_and_is_restarted():
    pool = EnvPool(lambda: PipeGame(), supervision=Supervision(step_timeout=1.0))
    env = pool.take(1)[0]
    env.reset(1)
    hung = env.inner.proc
    t0 = time.monotonic()
    result = env.step("hang")
    assert time.monotonic() - t0 < 30
    assert result.done and result.info["failure"] == "timeout"
    assert hung.poll() is not None  # the hung game was closed (killed)
    assert pool.restarts == 1
    env.reset(3)
    assert env.step("wait").obs == "You are in room 0 of 3."
    pool.close()


def test_a_game_that_always_crashes_stops_the_run():
    pool = EnvPool(lambda: PipeGame(crash_on=1), supervision=Supervision(max_restarts=2))
    env = pool.take(1)[0]
    for _ in range(2):
        env.reset(0)
        assert env.step("wait").info["failure"] == "crashed"
    env.reset(0)
    with pytest.raises(UserError, match="env.max_restarts = 2"):
        env.step("wait")
    pool.close()


def test_reset_failing_twice_is_a_user_error():
    class Broken:
        name = "broken"

        def reset(self, seed):
            raise ConnectionError("py4j gateway gone")

    pool = EnvPool(Broken, supervision=Supervision())
    with pytest.raises(UserError, match="failed twice in a row on reset"):
        pool.take(1)[0].reset(0)
    assert pool.restarts == 2


def test_training_survives_crashing_games(tmp_path, capsys):
    """GRPO on a game whose process dies at step 2 of every even-seeded episode: the run
    finishes (exit 0), every crash is an episode failed with reason 'crashed', and
    env/restarts counts them step by step."""
    run = tmp_path / "r"
    PipeGame.started.clear()
    argv = ["train", str(ROOT / "examples" / "smoke.toml"), "--out", str(run), "--set", "env.name='toy-pipe-game'",
            "--set", "env.kwargs={crash_on = 2}", "--set", "train.steps=2", "--set", "train.group_size=2", "--set", "train.prompts_per_step=2",
            "--set", "eval.n=2", "--set", "eval.batch_size=2", "--set", "eval.before=false", "--set", "run.checkpoint_every=0"]
    assert main(argv) == 0, capsys.readouterr().err
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if "reward/mean" in r]
    assert len(train_rows) == 2
    restarts = [r["env/restarts"] for r in train_rows]
    # each step plays 2 seeds x 2 episodes; the seeds' parity decides how many crash
    from recursa.config import load_config
    from recursa.recipes.grpo import train_seeds

    cfg = load_config(argv[1], [argv[i + 1] for i, a in enumerate(argv) if a == "--set"])
    expected = [2.0 * sum(s % 2 == 0 for s in train_seeds(cfg, step)) for step in range(2)]
    assert restarts == expected, (restarts, expected)
    assert len(PipeGame.started) >= 4 + sum(expected)  # the pool's 4 games plus one fresh game per crash
    for pid in PipeGame.started:  # every game process was reaped: nothing left running
        with pytest.raises(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)


def test_textworldexpress_jvm_killed_mid_episode_is_restarted():
    """The real thing: the TextWorldExpress JVM (reached through py4j) is killed mid-episode;
    the step fails the episode with reason 'crashed', a new JVM starts, the next episode plays."""
    import shutil

    pytest.importorskip("textworld_express", reason="textworld-express is not installed")
    if shutil.which("java") is None:
        pytest.skip("Java is not on PATH (TextWorldExpress runs in a JVM)")
    from recursa.envs import make_env

    pool = EnvPool(lambda: make_env("twx:coin", numLocations=3, numDistractorItems=0, includeDoors=False), supervision=Supervision())
    try:
        env = pool.take(1)[0]
        env.reset(1)
        jvm = env.inner._env._gateway.java_process
        jvm.kill()
        jvm.wait()
        result = env.step(env.admissible_actions()[0])
        assert result.done and result.info["failure"] == "crashed" and not result.info["won"]
        assert pool.restarts == 1
        assert env.inner._env._gateway.java_process.pid != jvm.pid
        env.reset(2)
        plan = env.walkthrough()
        for action in plan:
            result = env.step(action)
        assert result.info["won"]
    finally:
        pool.close()
