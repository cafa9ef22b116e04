"""Errors that carry a message for the user.

A `UserError` is a mistake the user can fix (a wrong config key, an unknown task, a
missing model file). The CLI prints its message on one line and exits with status 2;
everything else is a bug and keeps its traceback.
"""


class UserError(Exception):
    """A mistake the user can fix; the CLI prints the message and exits 2."""
