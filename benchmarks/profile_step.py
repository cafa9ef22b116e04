"""Profile one recursa GRPO step (rollout and update separately) with cProfile.

    python benchmarks/profile_step.py --setting agent      # the vs_trl.py `agent` workload
    python benchmarks/profile_step.py --setting short --top 25
    python benchmarks/profile_step.py --model tiny-random --top 5  # checks the script in seconds

Runs one warm-up step, then profiles the next and prints the seconds of the rollout and
the update and the functions with the most own time. The breakdown in docs/speed.md comes from
this script.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import vs_trl  # noqa: E402  (same settings, prompts and config as the benchmark)

from recursa.algorithms.advantages import compute_advantages  # noqa: E402
from recursa.envs.base import EnvPool  # noqa: E402
from recursa.generation import SamplingParams  # noqa: E402
from recursa.models import embedded_model_dir, load_policy  # noqa: E402
from recursa.recipes.common import make_optimizer, step_generator  # noqa: E402
from recursa.recipes.grpo import train_seeds, update  # noqa: E402
from recursa.rollout import rollout  # noqa: E402
from recursa.trajectory import collate  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--setting", choices=sorted(vs_trl.SETTINGS), default="agent")
    ap.add_argument("--top", type=int, default=20, help="functions to list")
    ap.add_argument("--model", default=None, help="the embedded SmolLM2-135M-Instruct (default), tiny-random, or a local HF directory")
    args = ap.parse_args()
    torch.set_num_threads(2)
    spec = vs_trl.SETTINGS[args.setting]
    cfg = vs_trl.recursa_config(spec, args.model or str(embedded_model_dir()), 2)
    policy = load_policy(cfg.model)
    optimizer = make_optimizer([p for p in policy.model.parameters() if p.requires_grad], cfg)
    envs = EnvPool(lambda: vs_trl.make_setting_env(spec))
    sampling = SamplingParams(cfg.sampling.max_new_tokens, cfg.sampling.temperature, cfg.sampling.top_p, ())
    B, G = cfg.train.prompts_per_step, cfg.train.group_size

    def one_step(step: int) -> None:
        gen = step_generator(cfg.train.seed, step)
        t0 = time.perf_counter()
        ro = rollout(policy, envs, train_seeds(cfg, step), G, sampling, gen, cfg.model.system_prompt or None)
        t1 = time.perf_counter()
        rewards = torch.tensor([t.reward for t in ro.trajectories]).view(B, G)
        batch = collate(ro.trajectories, compute_advantages(cfg.algo.advantage, rewards).view(-1), policy.tokenizer.pad_token_id)
        st = update(policy, optimizer, batch, cfg, gen, step)
        t2 = time.perf_counter()
        print(f"step {step}: rollout {t1 - t0:.2f} s, update {t2 - t1:.2f} s ({st.rows_run}/{len(batch)} rows run), {ro.stats}")

    one_step(0)  # warm-up
    profiler = cProfile.Profile()
    profiler.runcall(one_step, 1)
    pstats.Stats(profiler).sort_stats("tottime").print_stats(args.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
