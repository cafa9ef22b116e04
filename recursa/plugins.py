"""recursa's extension points, one `Registry` each (recursa/registry.py): names -> import
paths, so that a config is validated against the names without importing what they name.

| table        | config key                 | entry-point group     | an entry is                                              |
|--------------|----------------------------|-----------------------|----------------------------------------------------------|
| ADVANTAGES   | algo.advantage             | recursa.advantages    | rewards (B, G) -> advantages (B, G)                      |
| OBJECTIVES   | algo.objective             | recursa.objectives    | (MicroBatch, AlgoConfig) -> (loss, stats): the policy loss of one micro-batch |
| REWARDS      | [[reward]] func            | recursa.rewards       | fn(prompts, completions, **fields) -> list[float or None] |
| METHODS      | [methods.<name>]           | recursa.methods       | a `recursa.methods.Method` subclass                       |
| ENVS         | env.name                   | recursa.envs          | factory(**env.kwargs) -> an env (recursa/envs/base.py)     |

A package of yours adds an entry by declaring it (pyproject.toml):

    [project.entry-points."recursa.objectives"]
    my_loss = "my_pkg.losses:my_loss"

or a script by `OBJECTIVES.register("my_loss", my_loss)`. docs/extending.md walks through
one new objective and one new method, each in one file.
"""

from __future__ import annotations

from recursa.registry import Registry

ADVANTAGES = Registry("advantage estimator", "algo.advantage", "recursa.advantages", {
    "grpo": ("recursa.algorithms.advantages:grpo", "(r - group mean) / group std"),
    "dr_grpo": ("recursa.algorithms.advantages:dr_grpo", "r - group mean (Dr. GRPO: no std normalisation)"),
    "rloo": ("recursa.algorithms.advantages:rloo", "r - mean of the other rewards of the group (leave one out)"),
    "reinforce_pp": ("recursa.algorithms.advantages:reinforce_pp", "r - group mean, normalised over the whole batch (REINFORCE++)"),
    "gopo": ("recursa.algorithms.advantages:gopo", "the rank of r within its group, 2 - 4 (rho - 1) / (G - 1), ties by rollout order (GOPO, its release)"),
    "gopo_avg": ("recursa.algorithms.advantages:gopo_avg", "GOPO's rank advantage with tied rewards sharing their average rank (a constant group gets 0)"),
    "gpg": ("recursa.algorithms.advantages:gpg", "alpha x (r - group mean), alpha = groups / groups with unequal rewards (GPG)"),
})

OBJECTIVES = Registry("policy objective", "algo.objective", "recursa.objectives", {
    "ppo": ("recursa.algorithms.objectives:ppo_objective", "the clipped surrogate (PPO-clip, dual clip, KL, TIS weights)"),
    "spo": ("recursa.algorithms.objectives:spo_objective", "a quadratic penalty on the ratio in place of the clip (SPO)"),
    "gpg": ("recursa.algorithms.objectives:gpg_objective", "the plain policy gradient -A log pi (GPG)"),
    "nft": ("recursa.algorithms.objectives:nft_objective", "likelihood on successes and on failures through the implicit negative policy (NFT)"),
    "rebel": ("recursa.algorithms.objectives:sequence_objective", "pairs of a group regress their log-ratio difference onto their reward difference (REBEL)"),
    "apo": ("recursa.algorithms.objectives:sequence_objective", "beta log(pi / pi_ref) regressed onto r - V*(x) (A*-PO)"),
})

REWARDS = Registry("reward function", "reward.func", "recursa.rewards")

METHODS = Registry("training method", "methods", "recursa.methods", {
    "curriculum": ("recursa.methods.curriculum:CurriculumMethod", "[curriculum]: tasks drawn from arms by learning progress or a schedule, hints for the never-solved tail"),
    "rloop": ("recursa.methods.rloop:RLoopMethod", "[rloop]: RL phases, each ending in a fine-tune on its successes"),
    "igrpo": ("recursa.methods.igrpo:IGRPODrafts", "algo.igrpo: drafts per task, the best shown in the prompt of the rollout the update trains on"),
    "anchor": ("recursa.methods.anchor:AnchorMethod", "[anchor]: the warm start's SFT loss on demonstrations (or the run's own wins) at every optimizer step"),
    "gate": ("recursa.methods.gate:GateMethod", "[gate]: prompt rounds and the weights gate on held-out gate items, with rollback"),
    "replay": ("recursa.methods.attempts:ReplayMethod", "RSIPO: the replay buffer of earlier attempts (replay.jsonl) the skills, hatch, wins and teacher read"),
    "skills": ("recursa.methods.skills:SkillsMethod", "RSIPO [skills]: the skill library, in-context skills, skill writing rows rewarded by replay, the skills gate"),
    "hatch": ("recursa.methods.hatch:HatchMethod", "RSIPO [hatch]: hinted re-rolls of all-fail groups, trained under the un-hinted prompt"),
    "wins": ("recursa.methods.wins:WinsMethod", "RSIPO route.mode = 'pass_rate': stored wins as a supervised term for all-win groups"),
    "teacher": ("recursa.methods.teacher:TeacherMethod", "RSIPO [teacher] and [trust]: Delta, trust and the token advantages of the batch, imitation and distillation terms"),
})

# built-in envs by name; families (rg:, twx:, textworld:) are resolved by prefix in recursa/envs/base.py
ENVS = Registry("env", "env.name", "recursa.envs", {
    "arithmetic": ("recursa.envs.arithmetic:ArithmeticEnv", "built-in arithmetic; kwargs: difficulty=0..4, answer_format=last_number|tag|exact"),
    "household": ("recursa.envs.household:HouseholdEnv", "ALFWorld-style home, multi-turn; kwargs: rooms, objects_per_room, distractors, tasks, max_steps"),
    "search": ("recursa.envs.search:SearchEnv", "search agent (chat episodes, a BM25 search tool) over an invented encyclopedia per seed; kwargs: hops=1|2, people, towns, provinces, k"),
})
