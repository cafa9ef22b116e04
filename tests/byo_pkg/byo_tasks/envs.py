"""Environments of the byo-tasks package.

`make_qa_env` is registered under the `recursa.envs` entry point `byo-qa`: a question-answer
task over this package's JSONL file, written against recursa's Env protocol (name,
reset(seed) -> str, step(action_text) -> StepResult), which reads its items through
recursa's DatasetEnv (so the train / gate / test split is recursa's) and scores a reply
its own way: the answer must appear in the reply as a whole word.
"""

import re

from recursa.envs import StepResult
from recursa.envs.dataset import DatasetEnv

from byo_tasks import DATA


class QAEnv:
    def __init__(self, path: str = str(DATA)):
        self.rows = DatasetEnv(path, prompt_key="question", answer_key="answer", scorer="exact")
        self.name = "byo-qa"
        self.answer = ""

    def reset(self, seed: int) -> str:
        question = self.rows.reset(seed)
        self.answer = self.rows.answer()
        return question + " Reply with the number only."

    def step(self, action_text: str) -> StepResult:
        won = re.search(rf"(?<!\d){re.escape(self.answer)}(?!\d)", action_text) is not None
        return StepResult("", float(won), True, {"success": won, "answer": self.answer, "parsed": action_text.strip(), "note": ""})

    def num_items(self, split: str) -> int:
        return self.rows.num_items(split)


def make_qa_env(path: str = str(DATA)) -> QAEnv:
    return QAEnv(path)


class NotAnEnv:
    """Has reset but no step: `env.name = "byo_tasks.envs:NotAnEnv"` is refused at config load."""

    name = "not-an-env"

    def reset(self, seed: int) -> str:
        return ""
