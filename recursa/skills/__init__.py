"""Skills: rules the policy writes from its own trajectories, kept in a library and
retrieved into later contexts.

    writing.py    the prompt that asks for a skill, and the parser of the reply
    library.py    the SQLite library: provenance, versions, usage, trust, rollbacks
    retrieval.py  BM25 (default) or embedding retrieval of the skills for a task
    curator.py    rules that reject single-action or junk skills, merge near-duplicates, retire useless ones
"""

from recursa.skills.library import Skill, SkillLibrary, SkillStats, normalise
from recursa.skills.retrieval import BM25Index, EmbeddingRetriever, related, retrieve, retrieve_many, tokenize
from recursa.skills.writing import (
    ParsedSkill,
    SkillWritingStats,
    contrastive_writing_prompt,
    parse_skill,
    render_trajectory_for_skill,
    skill_writing_prompt,
)

__all__ = [
    "BM25Index",
    "EmbeddingRetriever",
    "ParsedSkill",
    "Skill",
    "SkillLibrary",
    "SkillStats",
    "SkillWritingStats",
    "contrastive_writing_prompt",
    "normalise",
    "parse_skill",
    "render_trajectory_for_skill",
    "related",
    "retrieve",
    "retrieve_many",
    "skill_writing_prompt",
    "tokenize",
]
