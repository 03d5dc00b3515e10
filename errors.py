"""errors.py: the one error type every module raises for bad input, below everything else."""


class UserError(Exception):
    """Bad input: shown as one line on stderr, exit code 2, no traceback (see runs.main_guard)."""


def first_line(e):
    """An exception's message, its first line only (or its type's name when it has none)."""
    return (str(e).splitlines() or [type(e).__name__])[0]
