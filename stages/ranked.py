"""What a streamer on one rank of a group does alike, a pipeline stage's (`staged.py`) or a replica's
(`replicas.py`): rank 0 tells the others each change before it makes it (`tell`), and they follow (`follow`);
rows change only through plans; drafts are not verified across ranks."""

from spill.errors import SpillError
from spill.streamer.core import Streamer

from . import plans
from .relay import Relay, StageLost

SHARED = ("prefill_chunk", "resident", "kv_bits", "kv_group_size", "seed")   # every rank alike, sent with "load"


def tell(relay: Relay, op: str, body=None) -> None:
    """Rank 0: an op (plans.py) to every other rank; elsewhere nothing (a follower does what it was told)."""
    if relay.rank == 0 and relay.size > 1:
        relay.plan(plans.pack(op, body))


class OnRanks(Streamer):
    """The streamer core on one rank of `relay`'s group. Rank 0 drives (`run`, `clear`...: each told to the others,
    a plan before its pass); the others `follow`. A subclass names the op its passes travel as (`PASS`)."""

    PASS = "plan"

    def __init__(self, folder, relay: Relay, **kw):
        self.relay, self.rank, self.size = relay, relay.rank, relay.size
        self.first, self.last = self.rank == 0, self.rank == self.size - 1
        self.followers: list = []   # rank 0: each follower's figures.PASS (a pipeline's: of the pass before the last)
        super().__init__(folder, **kw)

    def _load(self, folder, kw: dict, **more) -> None:
        """Rank 0: every other rank to load `folder` as this one did (`more`: what differs between groups)."""
        dtype = None if self.dtype is None else str(self.dtype).rsplit(".", 1)[-1]
        self._tell("load", {"model": str(folder), "dtype": dtype, **{k: kw[k] for k in SHARED if k in kw}, **more})

    @property
    def speculate(self) -> int:
        return 0

    @speculate.setter
    def speculate(self, k: int) -> None:
        if k:
            raise SpillError("drafts are not verified across the ranks of a group yet; run a group of several ranks "
                             "with --speculate 0 and no --draft")

    def set_draft(self, folder: str | None) -> None:
        if folder:
            raise SpillError("a draft model is not run across the ranks of a group yet; run without --draft")

    def _tell(self, op: str, body=None) -> None:
        tell(self.relay, op, body)

    def follow(self, on_pass=None) -> tuple[str, object]:
        """Ranks 1..N-1: do what rank 0 says (`on_pass(report)` after each pass) until it stops this rank's model,
        names another or lets the rank go: that op and its body."""
        done = {"clear": lambda _: self.clear(), "resident": self.set_resident, "kv": lambda kv: self.set_kv(*kv)}
        while True:
            op, body = plans.unpack(self.relay.plan())
            if op == self.PASS:
                report = self._follow_pass(body)
                if on_pass is not None:
                    on_pass(report)
            elif op in done:
                done[op](body)
            else:
                return op, body

    def _follow_pass(self, body):
        return self.run(body)

    def clear(self) -> None:
        super().clear()
        self._tell("clear")

    def set_resident(self, resident: bool) -> None:
        super().set_resident(resident)
        self._tell("resident", resident)

    def set_kv(self, bits: int | None, group_size: int) -> None:
        super().set_kv(bits, group_size)   # rank 0 first: a format it refuses never reaches the others
        self._tell("kv", [bits, group_size])

    def finish(self, row_id, reason: str = "stop") -> None:
        raise SpillError("a streamer on several ranks changes its rows only through plans; end a row with "
                         "PassPlan.finish")

    def preempt(self, row_ids, pools=None) -> None:
        raise SpillError("a streamer on several ranks changes its rows only through plans; drop rows with "
                         "PassPlan.drop")

    def close(self) -> None:
        """Rank 0 stops the others' models (they wait for the next, `staged.serve`); every rank lets its reader go."""
        try:
            if self.first:   # the followers' figures of the last pass, taken before they stop: none left pending
                self.followers = self.relay.settle() or self.followers
            self._tell("stop")
        except StageLost:
            pass   # the group is gone: nobody to stop
        finally:
            super().close()
