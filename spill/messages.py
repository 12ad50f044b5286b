"""Everything that crosses a process boundary, and its encoding: one kind byte, then msgpack.

Rows travel as struct-of-arrays: `rows` (int row numbers within the job), packed int32 token
arrays, and per-row lists of parameters. No pickle anywhere on the wire. Each field declares its
type and range (spill/typed.py); `decode` checks every one, nested records included.
"""

import functools
from dataclasses import dataclass, field, fields, is_dataclass
from enum import IntEnum
from typing import Annotated

import msgpack
import numpy as np

from .control_messages import (REPLIES, REQUESTS, Ahead, Cancel, Down, Interrupt, JobStatus, Ping,  # noqa: F401
                               Pong, Queued, Refused, Slot, Status, Stopped, Stopping, SubmitJob)
from .typed import (MODEL_ROW, BadMessage, Count, Drafts, Fraction, Int64, MaxTokens, Natural, OneOf,  # noqa: F401
                    Packed, Pair, PerRow, Range, RequiredIf, RowId, SameLength, Seed, Temperature, TopK, checked)

FINISH = ("stop", "length")   # a finished row's reason


class Kind(IntEnum):
    READY = 1        # actor -> coordinator, once after start
    RESET = 2        # coordinator -> actors: drop every row, (re)load a model, new epoch
    SUBMIT = 3       # coordinator -> tokenizer: rows as the user wrote them
    TOKENIZED = 4    # tokenizer -> admission: rows with real token ids
    PLAN = 5         # admission -> streamer: everything the next pass does (admission/scheduler.py)
    TOKENS = 6       # streamer -> tokenizer: each row's tokens of a pass, in order (more than one: drafts accepted)
    STOP = 7         # tokenizer -> admission: rows that hit a stop string
    PASS = 8         # streamer -> admission, coordinator: what a pass did
    DONE = 9         # tokenizer -> coordinator: finished rows with their text
    ERROR = 10       # tokenizer -> coordinator: rows that cannot run
    PROGRESS = 11    # tokenizer -> coordinator: recent text of running rows, for the live view
    SHUTDOWN = 12    # coordinator -> actors
    HEARTBEAT = 13   # actor -> coordinator, every second from a thread: the process is scheduled
    BUDGET = 15      # admission -> coordinator, after each pass report: memory lines, holds, preemptions
    ENDED = 17       # admission -> tokenizer: rows that ended with no text to follow (refused): forget them
    PING = 22        # client -> coordinator: one kind per request (control_messages.py)
    SUBMIT_JOB = 23
    STATUS = 24
    INTERRUPT = 25
    CANCEL = 26
    DOWN = 27
    REFUSED = 30     # coordinator -> client: one kind per reply
    PONG = 31
    QUEUED = 32
    JOB_STATUS = 33
    STOPPED = 34
    STOPPING = 35


def pack_tokens(seqs: list[list[int]]) -> tuple[bytes, list[int]]:
    """Token sequences -> (int32 bytes, lengths)."""
    lengths = [len(s) for s in seqs]
    flat = np.fromiter((t for s in seqs for t in s), dtype=np.int32, count=sum(lengths))
    return flat.tobytes(), lengths


def unpack_tokens(data: bytes, lengths: list[int]) -> list[list[int]]:
    flat = np.frombuffer(data, dtype=np.int32)
    ends = np.cumsum(lengths)
    return [flat[e - n:e].tolist() for n, e in zip(lengths, ends)]


@dataclass
class Host:
    """A pipeline follower's memory, as its own `spill up` found it (stages/figures.py MEMORY), and the link into it
    from the rank before, timed at join (`stages/link.py` measure; bandwidth 0: not timed)."""
    working_set: Natural
    budget_fraction: Annotated[float, Range(1e-6, 1.0)]
    latency_s: Annotated[float, Range(0.0, 3600.0)] = 0.0
    bandwidth: Annotated[float, Range(0.0, 1e15)] = 0.0    # bytes/s

    def row(self) -> list:
        """As the estimate's arguments and a job's stored estimate carry it (`stages.model.hop_price` reads it)."""
        return [self.working_set, self.budget_fraction, self.latency_s, self.bandwidth]


@dataclass
class StagePass:
    """A pipeline stage's last pass as its rank measured it (stages/figures.py PASS): `spill status` shows it."""
    weights: Natural         # bytes of its weights held or in flight
    kv: Natural              # bytes of its share of the running rows' KV
    seconds: float
    compute_s: float
    link_s: float            # blocked on a neighbour
    rss: Natural = 0         # its process's resident memory: admission's lines weigh it (admission/process.py _live)


@dataclass
class Ready:
    role: str
    pid: Count
    rss: Natural = 0         # resident memory once set up, before any model: the budget prices it
    file: Natural = 0        # of rss, pages mapped from files (libraries other processes may map too)
    hosts: list[Host] = field(default_factory=list)   # a pipeline's streamer: each follower's memory, rank 1 first


@dataclass
class Heartbeat:
    role: str
    pid: Count
    progress: Natural = 0    # message batches the actor's loop has handled (spill.actor.inbox): moves while it works
    busy: bool = False       # its loop was working at the beat, not waiting for a message


@dataclass
class Reset:
    epoch: Count
    model: str = ""          # model folder; "" keeps the current one
    job: str = ""
    runtime: Natural = 0     # the streamer's RSS at its READY (interpreter, libraries): admission prices it
    runtime_file: Natural = 0   # of runtime, library pages: counted once with the other processes' own
    resident: bool = False   # keep every layer in memory after its first read (the advisor's choice)
    kv_bits: Annotated[int, Range(0, 8)] = 0            # the decode pools' K and V in 8 or 4 bits (--kv-bits); 0: unquantized
    kv_group_size: Annotated[int, Range(1, 1024)] = 64  # values per scale and bias of quantized KV (--kv-group-size)
    speculate: Drafts = 0    # drafts a decode row may carry a pass (--speculate K); 0: off; -1: auto
    draft: str = ""          # the draft model's folder (--draft); "": drafts by prompt lookup
    stages: Annotated[int, Range(1, 1024)] = 1   # the pipeline's ranks the streamer runs on now: each prices its share
    by_compute: bool = False   # resident, the stages' layers split by compute, else by bytes (the advisor's choice)
    replicas: bool = False     # resident, every rank the whole model and a share of the rows (the advisor's choice)
    hosts: list[Host] = field(default_factory=list)   # each follower's memory (its READY's); none: rank 0's each


@dataclass(frozen=True)
class RowSampling:
    """One row's sampling: greedy at temperature 0; else temperature, top_k (0: none), top_p, with its seed."""
    temperature: Temperature = 0.0
    top_p: Fraction = 1.0
    top_k: TopK = 0
    seed: Seed | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


@dataclass
class Sampling:
    """Rows' sampling, struct-of-arrays: row i samples with temperature[i], top_p[i], top_k[i], seed[i]."""
    temperature: list[Temperature] = field(default_factory=list)
    top_p: Annotated[list[Fraction], SameLength("temperature")] = field(default_factory=list)
    top_k: Annotated[list[TopK], SameLength("temperature")] = field(default_factory=list)
    seed: Annotated[list[Seed | None], SameLength("temperature")] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.temperature)

    def rows(self) -> list[RowSampling]:
        return list(map(RowSampling, self.temperature, self.top_p, self.top_k, self.seed))

    @classmethod
    def of(cls, rows) -> "Sampling":
        rows = list(rows)
        return cls([r.temperature for r in rows], [r.top_p for r in rows], [r.top_k for r in rows], [r.seed for r in rows])


@dataclass
class RowRequest:
    """One row as the tokenizer takes it: its text, and the job's defaults filled in where the line set none."""
    kind: Annotated[str, OneOf(("chat", "completion"))]
    max_tokens: MaxTokens
    messages: Annotated[list[dict[str, str]] | None, RequiredIf("kind", "chat")] = None   # [{role, content}]
    prompt: Annotated[str | None, RequiredIf("kind", "completion")] = None
    sampling: RowSampling = field(default_factory=RowSampling)
    stop: list[str] = field(default_factory=list)


@dataclass
class Submit:
    epoch: Count
    rows: list[RowId]
    requests: Annotated[list[RowRequest], PerRow]


@dataclass
class Tokenized:
    epoch: Count
    rows: list[RowId]
    tokens: Annotated[bytes, Packed(total="lengths")]   # packed int32 prompt ids
    lengths: Annotated[list[Count], PerRow]
    max_tokens: Annotated[list[MaxTokens], PerRow]
    sampling: Annotated[Sampling, PerRow]
    eos: list[Count] = field(default_factory=list)


@dataclass
class Plan(Tokenized):
    """One pass, as the scheduler decided it; the streamer runs exactly this. The Tokenized part: rows to start."""
    index: Count = 0         # the plan's number in its epoch; the pass report that ran it names it
    widths: Annotated[list[Count], PerRow] = field(default_factory=list)   # the decode pool each starting row joins
    groups: Annotated[list[Count], PerRow] = field(default_factory=list)   # the prefill group each starting row opens
    chunks: list[Pair] = field(default_factory=list)   # [group, prompt columns this pass] of every prefilling group
    drop: list[RowId] = field(default_factory=list)    # rows to drop before the pass (preempted: run again later)
    finish: list[RowId] = field(default_factory=list)  # rows ended outside the streamer (a stop string)
    pools: list[Pair] = field(default_factory=list)    # every decode pool's shape after it: [slots, width]
    cache_limit: Natural = 0  # bytes of MLX's buffer cache, set from the budget (0: leave it)
    drafts: list[Pair] = field(default_factory=list)   # [row, the most drafts it may carry] of decode rows that draft
    rounds: Annotated[int, Range(1, 1 << 16)] = 1      # decode steps a resident pipeline may run (stages/rounds.py)


@dataclass
class Tokens:
    epoch: Count
    pass_index: Count
    rows: list[RowId]
    tokens: Annotated[bytes, Packed(per="rows")]   # one int32 per entry; a row's entries in order
    # "" running, "stop" (EOS: not text), "length"; "preempted" (runs again), "refused" (never ran)
    finish: Annotated[list[Annotated[str, OneOf(("", *FINISH, "preempted", "refused"))]], PerRow]
    positions: Annotated[list[Count], PerRow]   # each row's tokens before this one: a gap means some were lost


@dataclass
class Stop:
    epoch: Count
    rows: list[RowId]


@dataclass
class Pass:
    epoch: Count
    index: Count
    seconds: float
    wait_s: float
    compute_s: float
    decode_rows: Count
    prefill_tokens: Count
    emitted: Count
    finished: list[RowId]
    active_memory: Natural
    peak_memory: Natural
    bytes_streamed: Natural
    job: str = ""
    preempted: list[RowId] = field(default_factory=list)   # rows dropped by PREEMPT, to run again
    cache_memory: Natural = 0    # MLX's buffer cache
    reader_memory: Natural = 0   # the reader's read buffers
    rss: Natural = 0             # the streamer's resident memory
    cgroup_usage: Int64 | None = None   # charged to the cgroup that limits us, less its inactive page cache
    minor_faults: Int64 = 0      # page faults of the streamer in this pass
    major_faults: Int64 = 0
    read_bandwidth: float = 0.0       # bytes streamed / seconds of the pass
    read_s: float = 0.0               # seconds the reader spent in read calls (they run beside the compute)
    prefill_groups: Count = 0         # prefill groups that ran (each its own attention, priced apart)
    prefill_context: Natural = 0      # prompt tokens x the keys each scores: its prompt cached before the chunk, and the chunk
    plan: Annotated[int, Range(-1, (1 << 31) - 1)] = -1   # the plan it ran (Plan.index)
    accepted: list[Pair] = field(default_factory=list)   # [row, drafts it accepted] of rows that took more than a token
    drafted: list[Pair] = field(default_factory=list)    # [row, drafts it carried] of rows that drafted
    columns: Annotated[int, Range(1, 1 << 16)] = 1       # tokens every decode row fed (1 + the most drafts, padded)
    link_s: float = 0.0               # a pipeline's rank 0: seconds blocked on its neighbours (its bubble)
    rounds: Annotated[int, Range(1, 1 << 16)] = 1       # decode steps every decode row took (stages/rounds.py)
    stages: list[StagePass] = field(default_factory=list)   # a pipeline: rank 0's, then each follower's (a pass behind)


@dataclass
class Budget:
    epoch: Count
    index: Count             # the pass this answers
    working_set: Natural     # bytes; the budget, guard and hard lines are admission's (policy.py)
    budget: Natural
    guard: Natural
    hard: Natural
    others: Natural          # resident memory of the group's other processes, as priced
    held_rows: Count         # rows held back for memory after this pass (0: no hold)
    preempted_rows: Count    # rows the pass reported preempted, queued again
    probe_bandwidth: float = 0.0   # the calibration's cold read probe, bytes/s (0: no calibration)
    job: str = ""
    running_rows: Count = 0  # rows prefilling or decoding after this pass (the scheduler's count)


@dataclass
class Ended:
    epoch: Count
    rows: list[RowId]


@dataclass
class Done:
    epoch: Count
    rows: list[RowId]
    texts: Annotated[list[str], PerRow]
    finish: Annotated[list[Annotated[str, OneOf(FINISH)]], PerRow]
    prompt_tokens: Annotated[list[Count], PerRow]
    completion_tokens: Annotated[list[Count], PerRow]
    job: str = ""            # the job whose rows these are (from its RESET)


@dataclass
class Error:
    epoch: Count
    rows: list[RowId]
    codes: Annotated[list[str], PerRow]
    messages: Annotated[list[str], PerRow]
    job: str = ""


@dataclass
class Progress:
    epoch: Count
    rows: list[RowId]
    tokens: Annotated[list[Count], PerRow]   # generated so far
    tails: Annotated[list[str], PerRow]      # last characters of the text
    job: str = ""


@dataclass
class Shutdown:
    reason: str = ""


_TYPES = {Kind.READY: Ready, Kind.RESET: Reset, Kind.SUBMIT: Submit, Kind.TOKENIZED: Tokenized,
          Kind.PLAN: Plan, Kind.TOKENS: Tokens, Kind.STOP: Stop, Kind.PASS: Pass, Kind.DONE: Done,
          Kind.ERROR: Error, Kind.PROGRESS: Progress, Kind.SHUTDOWN: Shutdown, Kind.HEARTBEAT: Heartbeat,
          Kind.BUDGET: Budget, Kind.ENDED: Ended,
          Kind.PING: Ping, Kind.SUBMIT_JOB: SubmitJob, Kind.STATUS: Status,
          Kind.INTERRUPT: Interrupt, Kind.CANCEL: Cancel, Kind.DOWN: Down,
          Kind.REFUSED: Refused, Kind.PONG: Pong, Kind.QUEUED: Queued,
          Kind.JOB_STATUS: JobStatus, Kind.STOPPED: Stopped, Kind.STOPPING: Stopping}
_KINDS = {t: k for k, t in _TYPES.items()}


def encode(msg) -> bytes:
    """The frame of a message: its fields as they are (no deep copy), a record inside them as a map."""
    return bytes([_KINDS[type(msg)]]) + pack(msg)


def pack(value) -> bytes:
    """msgpack of a message or a record in one (a request's size on the wire)."""
    return msgpack.packb(value, use_bin_type=True, default=_plain)


def _plain(value):
    if is_dataclass(value) and not isinstance(value, type):
        return {f.name: getattr(value, f.name) for f in _fields(type(value))}
    raise TypeError(f"cannot encode {type(value).__name__}")


@functools.cache
def _fields(cls) -> tuple:
    return fields(cls)


def decode(data: bytes):
    """The message in a frame, every field checked against its declared type and range; BadMessage for anything else."""
    try:
        cls = _TYPES[Kind(data[0])]
    except (IndexError, ValueError, KeyError):
        raise BadMessage(f"unknown message kind {data[:1].hex() or '(empty frame)'}") from None
    try:
        raw = msgpack.unpackb(data[1:], raw=False)
    except Exception as err:  # noqa: BLE001 - msgpack raises several types for garbage
        raise BadMessage(f"{cls.__name__}: not msgpack ({type(err).__name__})") from None
    return checked(cls, raw)
