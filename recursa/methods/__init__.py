"""Training methods as plug-ins of a recipe's step (`recursa.methods.base`): each module here
holds one method behind the hooks it needs; `METHODS` finds them by name."""

from recursa.methods.base import METHODS, Method, Methods, RunContext, StepEnd, check_methods, open_methods

__all__ = ["METHODS", "Method", "Methods", "RunContext", "StepEnd", "check_methods", "open_methods"]
