"""errors.py: bad input, said in one line (plumbing: skip it). Every module that checks what a user
gave (flags, files, data, models, envs, tools) raises UserError; runs.main_guard shows it as one
line on stderr and exits 2, with no traceback. This file imports nothing of the project."""


class UserError(Exception):
    """Bad input: shown as one line on stderr, exit code 2, no traceback (runs.main_guard)."""


def first_line(e):
    """An exception's message, its first line only (or its type's name when it has none)."""
    return (str(e).splitlines() or [type(e).__name__])[0]
