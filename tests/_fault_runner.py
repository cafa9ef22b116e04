"""Runs `recursa` commands that kill themselves at a named write point (tests/test_faults.py).
Not a test module.

Usage: python tests/_fault_runner.py JOBS_JSON  ->  prints one JSON list of outcomes.

Each job is {"argv": [...], "fault": "point@k" or null, "enospc": "point" or null}. The runner
imports recursa, torch and transformers once and forks one child per job, so each kill costs
a training run, not an interpreter start. The parent itself never runs torch code (no thread
pool exists yet when it forks). A child sets RECURSA_FAULT_AT / RECURSA_FAULT_ENOSPC and runs
the command in-process; it dies by SIGKILL at that point (recursa.runio.fault_point), or exits
with the command's status. Jobs run one after another, in order.
"""

import json
import os
import signal
import sys

os.environ.setdefault("RECURSA_DEVICE", "cpu")
sys.path.insert(0, os.path.dirname(__file__))

import conftest  # noqa: E402,F401  the suite's toy envs
import torch  # noqa: E402,F401
import transformers  # noqa: E402,F401

from recursa.cli import main  # noqa: E402


def run(job: dict) -> dict:
    pid = os.fork()
    if pid == 0:  # the child
        try:
            for key, name in (("fault", "RECURSA_FAULT_AT"), ("enospc", "RECURSA_FAULT_ENOSPC")):
                if job.get(key):
                    os.environ[name] = job[key]
            code = main(job["argv"])
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        except BaseException:  # noqa: BLE001
            import traceback

            traceback.print_exc()
            code = 1
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        return {"signal": os.WTERMSIG(status), "killed": os.WTERMSIG(status) == signal.SIGKILL}
    return {"exit": os.WEXITSTATUS(status), "killed": False}


if __name__ == "__main__":
    jobs = json.loads(sys.argv[1])
    print(json.dumps([run(j) for j in jobs]))
