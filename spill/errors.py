"""Errors a user can fix: the CLI prints their message as one line, never a traceback."""


class SpillError(Exception):
    """A problem with the user's input or setup; the message names the fix."""


class RankLost(SpillError):
    """A pipeline group lost a rank (`rank`, -1 where unknown): the ring ends and the streamer starts again alone;
    the end of the pipeline, never a job's error."""

    def __init__(self, message: str, rank: int = -1):
        super().__init__(message)
        self.rank = rank


class GroupDead(SpillError):
    """The group stopped answering: unrecoverable for this command (distinct from a row error)."""


def one_line(err: BaseException) -> str:
    """An unexpected error as one short line for a user's screen: its type and message (the traceback goes to a log)."""
    return f"{type(err).__name__}: {' '.join(str(err).split())}"[:300]
