"""recursa: recursive self-improving policy optimization for language-model agents.

Entry points: the `recursa` command (`recursa.cli`), the recipes in `recursa.recipes`,
and the building blocks they write out (models, generation, rollout, envs, algorithms,
evaluate, store). See README.md for the picture and docs/ for the details and measured numbers.
"""

__version__ = "0.1.0"
