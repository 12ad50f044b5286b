"""The control plane's messages (spill.messages encodes them): one request type per operation a client asks of
the coordinator, each answered by its own reply type or by Refused, one sentence of what went wrong.

    Ping -> Pong    SubmitJob -> Queued    Status -> JobStatus    Interrupt, Cancel -> Stopped    Down -> Stopping
"""

from dataclasses import dataclass, field
from typing import Annotated, ClassVar

from .typed import Count, Drafts, Fraction, MaxTokens, Natural, Range, Temperature


# -- requests: each carries the control token, required on a tcp control socket --------------------------
@dataclass
class Ping:
    op: ClassVar[str] = "ping"
    token: str = ""


@dataclass
class SubmitJob:
    """`spill run`: a job of the rows in `input`, or the job `resume` names; None where the command set nothing."""
    op: ClassVar[str] = "submit"
    model: str | None = None
    input: str | None = None
    output: str | None = None
    max_tokens: MaxTokens | None = None
    temperature: Temperature | None = None
    resume: str | None = None
    new: bool = False
    stream: bool = False
    memory: Natural | None = None           # --memory in bytes
    budget_fraction: Fraction | None = None
    client: str = ""                        # the asking process: its job stops once it stops asking
    token: str = ""
    kv_bits: Annotated[int, Range(0, 8)] | None = None           # --kv-bits: 8 or 4 (quantized KV); None: the group's
    kv_group_size: Annotated[int, Range(1, 1024)] | None = None  # --kv-group-size
    speculate: Drafts | None = None                               # --speculate: K, 0 off; None: the job's or off
    draft: str | None = None                                      # --draft: the draft model; None: the job's or none
    ranks: Annotated[int, Range(1, 1024)] | None = None           # --ranks: the pipeline's ranks; None: the group's
    micro_batches: Annotated[int, Range(0, 1 << 16)] | None = None  # --micro-batches; None: the group's


@dataclass
class Status:
    """The running job, or the job named; a job's own client says who it is, so the group knows it still follows."""
    op: ClassVar[str] = "status"
    job: str | None = None
    client: str = ""
    token: str = ""


@dataclass
class Interrupt:
    """Stop a job at the next pass boundary (Ctrl-C in its `spill run`); None: the running one."""
    op: ClassVar[str] = "interrupt"
    job: str | None = None
    token: str = ""


@dataclass
class Cancel:
    op: ClassVar[str] = "cancel"
    job: str
    token: str = ""


@dataclass
class Down:
    op: ClassVar[str] = "down"
    token: str = ""


REQUESTS = (Ping, SubmitJob, Status, Interrupt, Cancel, Down)


# -- replies ---------------------------------------------------------------------------------------------
@dataclass
class Refused:
    error: str               # one line for the user


@dataclass
class Pong:
    pid: Count               # the coordinator's


@dataclass
class Queued:
    job: str
    total: Count
    done: Count              # rows already written, the invalid ones included
    invalid: Count
    output: str
    queued: Count
    warning: str | None = None
    metrics: str = ""        # where the metrics are served, or why not
    status: str | None = None


@dataclass
class Slot:
    """A running row in the live view."""
    custom_id: str
    tokens: Count
    tail: str


@dataclass
class Ahead:
    """A job queued ahead of the one asked about."""
    job: str
    done: Count
    total: Count


@dataclass
class JobStatus:
    """A job's figures (None where not known yet), and the group's processes; job None: no job runs."""
    job: str | None = None
    status: str | None = None
    done: Count | None = None
    total: Count | None = None
    output: str | None = None
    succeeded: Count = 0
    failed: Count = 0
    error: str | None = None
    tokens_per_s: float | None = None
    pass_s: float | None = None
    peak_memory: Natural = 0
    eta_s: float | None = None
    slots: list[Slot] = field(default_factory=list)
    passes: Count = 0
    streamer_pass_s: float | None = None
    wall_per_pass_s: float | None = None
    estimate: dict | None = None      # the estimate's figures, as job.json keeps them
    summary: dict | None = None       # the end-of-job figures (coordinator/estimate.py summary)
    estimate_line: str | None = None
    advice: str | None = None
    processes: dict[str, Count] = field(default_factory=dict)
    queued: Count = 0
    ahead: list[Ahead] = field(default_factory=list)
    estimating: str | None = None     # what an estimating job waits for
    kv: str = "unquantized"           # the decode pools' KV format (--kv-bits), as the summary names it
    memory: dict[str, str | float | None] | None = None   # what the group plans for (spill.memory.describe)
    metrics: str = ""
    stages: list[str] = field(default_factory=list)   # a pipeline group's stages, a line each (`spill status`)
    joined: Count = 0    # of its ranks past 0, those that joined the streamer's group and told their memory
    notes: list[str] = field(default_factory=list)    # what the group told the job, oldest first (a lost rank)


@dataclass
class Stopped:
    job: str | None
    was: str | None = None   # its status before; None: no such job ran or waited
    done: Count | None = None
    total: Count | None = None


@dataclass
class Stopping:
    stopped: list[Stopped] = field(default_factory=list)


REPLIES = {Ping: Pong, SubmitJob: Queued, Status: JobStatus, Interrupt: Stopped, Cancel: Stopped, Down: Stopping}
