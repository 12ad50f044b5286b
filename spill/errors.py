"""Errors a user can fix: the CLI prints their message as one line, never a traceback."""


class SpillError(Exception):
    """A problem with the user's input or setup; the message names the fix."""


class GroupDead(SpillError):
    """The group stopped answering: unrecoverable for this command (distinct from a row error)."""


def one_line(err: BaseException) -> str:
    """An unexpected error as one short line for a user's screen: its type and message (the traceback goes to a log)."""
    return f"{type(err).__name__}: {' '.join(str(err).split())}"[:300]
