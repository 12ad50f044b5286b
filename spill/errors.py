"""Errors a user can fix: the CLI prints their message as one line, never a traceback."""


class SpillError(Exception):
    """A problem with the user's input or setup; the message names the fix."""


class GroupDead(SpillError):
    """The group stopped answering: unrecoverable for this command (distinct from a row error)."""
