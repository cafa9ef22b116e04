"""Oracle chat transcripts of the search testbed, for an SFT warm start (docs/chat.md).

    python scripts/search_transcripts.py --config examples/search.toml --n 64 --out runs/search_demos.jsonl
    recursa train examples/search_sft.toml

One JSON line per training-split question, {"messages": [...], "seed": s}: the oracle's
searches with their real results and the answer, as chat mode shows them to the policy
(`recursa.chat.oracle_transcript`), under the config's model template and agent settings.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from recursa.chat import oracle_transcript
from recursa.config import load_config
from recursa.envs import make_env, split_seeds
from recursa.models import load_policy


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", required=True, help="a config with env.name = 'search' (its model, env kwargs and [agent])")
    ap.add_argument("--n", type=int, default=64, help="training questions (seeds 0 .. n-1 of the train split)")
    ap.add_argument("--start", type=int, default=0, help="first train-split index")
    ap.add_argument("--out", required=True, help="the JSONL file to write")
    args = ap.parse_args(argv)
    cfg = load_config(Path(args.config))
    env = make_env(cfg.env.name, **cfg.env.kwargs)
    tokenizer = load_policy(cfg.model).tokenizer
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w") as f:
        for seed in split_seeds("train", args.n, args.start):
            f.write(json.dumps({"messages": oracle_transcript(env, seed, tokenizer, cfg.agent), "seed": seed}) + "\n")
    print(f"wrote {args.n} transcripts to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
