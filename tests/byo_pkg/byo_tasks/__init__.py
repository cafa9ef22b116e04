"""A user's own recursa task package (tests/test_byo.py): envs, rewards and data."""

from pathlib import Path

DATA = Path(__file__).parent / "data" / "qa.jsonl"
