"""Everything that crosses a process boundary, and its encoding: one kind byte, then msgpack.

Rows travel as struct-of-arrays: `rows` (int row numbers within the job), packed int32 token
arrays, and per-row lists of parameters. No pickle anywhere on the wire.
"""

import functools
import math
import types
import typing
from dataclasses import MISSING, asdict, dataclass, field, fields, is_dataclass
from enum import IntEnum

import msgpack
import numpy as np


MODEL_ROW = -1   # the row number of an ERROR about the job's model rather than one row


class Kind(IntEnum):
    READY = 1        # actor -> coordinator, once after start
    RESET = 2        # coordinator -> actors: drop every row, (re)load a model, new epoch
    SUBMIT = 3       # coordinator -> tokenizer: rows as the user wrote them
    TOKENIZED = 4    # tokenizer -> admission: rows with real token ids
    PLAN = 5         # admission -> streamer: everything the next pass does (admission/scheduler.py)
    TOKENS = 6       # streamer -> tokenizer: one sampled token per row
    STOP = 7         # tokenizer -> admission: rows that hit a stop string
    PASS = 8         # streamer -> admission, coordinator: what a pass did
    DONE = 9         # tokenizer -> coordinator: finished rows with their text
    ERROR = 10       # tokenizer -> coordinator: rows that cannot run
    PROGRESS = 11    # tokenizer -> coordinator: recent text of running rows, for the live view
    SHUTDOWN = 12    # coordinator -> actors
    HEARTBEAT = 13   # actor -> coordinator, every second from a thread: the process is scheduled
    BUDGET = 15      # admission -> coordinator, after each pass report: memory lines, holds, preemptions
    ENDED = 17       # admission -> tokenizer: rows that ended with no text to follow (refused): forget them
    REQUEST = 20     # client -> coordinator
    REPLY = 21       # coordinator -> client


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
class Ready:
    role: str
    pid: int
    rss: int = 0             # resident memory once set up, before any model: the budget prices it
    file: int = 0            # of rss, pages mapped from files (libraries other processes may map too)


@dataclass
class Heartbeat:
    role: str
    pid: int
    progress: int = 0        # message batches the actor's loop has handled (spill.actor.inbox): moves while it works
    busy: bool = False       # its loop was working at the beat, not waiting for a message


@dataclass
class Reset:
    epoch: int
    model: str = ""          # model folder; "" keeps the current one
    job: str = ""
    runtime: int = 0         # the streamer's RSS at its READY (interpreter, libraries): admission prices it
    runtime_file: int = 0    # of runtime, library pages: counted once with the other processes' own
    resident: bool = False   # keep every layer in memory after its first read (the advisor's choice)


@dataclass
class Submit:
    epoch: int
    rows: list[int]
    requests: list[dict]     # kind, messages | prompt, max_tokens, temperature, top_p, top_k, seed, stop


@dataclass
class Tokenized:
    epoch: int
    rows: list[int]
    tokens: bytes            # packed int32 prompt ids
    lengths: list[int]
    max_tokens: list[int]
    sampling: list[list]     # [temperature, top_p, top_k, seed] per row
    eos: list[int] = field(default_factory=list)


@dataclass
class Plan(Tokenized):
    """One pass, as the scheduler decided it; the streamer runs exactly this. The Tokenized part: rows to start."""
    index: int = 0           # the plan's number in its epoch; the pass report that ran it names it
    widths: list[int] = field(default_factory=list)        # the decode pool each starting row joins, by its width
    groups: list[int] = field(default_factory=list)        # the prefill group each starting row opens with
    chunks: list[list[int]] = field(default_factory=list)  # [group, prompt columns this pass] of every prefilling group
    drop: list[int] = field(default_factory=list)          # rows to drop before the pass (preempted: run again later)
    finish: list[int] = field(default_factory=list)        # rows ended outside the streamer (a stop string)
    pools: list[list[int]] = field(default_factory=list)   # every decode pool's shape after it: [slots, width]
    cache_limit: int = 0     # bytes of MLX's buffer cache, set from the budget (0: leave it)


@dataclass
class Tokens:
    epoch: int
    pass_index: int
    rows: list[int]
    tokens: bytes            # one int32 per row
    finish: list[str]        # "" running, "stop" (EOS: not text), "length"
    positions: list[int]     # each row's tokens before this one: where they differ from the text's, some were lost


@dataclass
class Stop:
    epoch: int
    rows: list[int]


@dataclass
class Pass:
    epoch: int
    index: int
    seconds: float
    wait_s: float
    compute_s: float
    decode_rows: int
    prefill_tokens: int
    emitted: int
    finished: list[int]
    active_memory: int
    peak_memory: int
    bytes_streamed: int
    job: str = ""
    preempted: list[int] = field(default_factory=list)   # rows dropped by PREEMPT, to run again
    cache_memory: int = 0    # MLX's buffer cache
    reader_memory: int = 0   # the reader's read buffers
    rss: int = 0             # the streamer's resident memory
    cgroup_usage: int | None = None   # charged to the cgroup that limits us, less its inactive page cache
    minor_faults: int = 0    # page faults of the streamer in this pass
    major_faults: int = 0
    read_bandwidth: float = 0.0       # bytes streamed / seconds of the pass
    read_s: float = 0.0               # seconds the reader spent in read calls (they run beside the compute)
    prefill_groups: int = 0           # prefill groups that ran (each its own attention, priced apart)
    prefill_context: int = 0          # prompt tokens x the keys each scores: its prompt cached before the chunk, and the chunk
    plan: int = -1                    # the plan it ran (Plan.index)


@dataclass
class Budget:
    epoch: int
    index: int               # the pass this answers
    working_set: int         # bytes; the budget, guard and hard lines are admission's (policy.py)
    budget: int
    guard: int
    hard: int
    others: int              # resident memory of the group's other processes, as priced
    held_rows: int           # rows held back for memory after this pass (0: no hold)
    preempted_rows: int      # rows the pass reported preempted, queued again
    probe_bandwidth: float = 0.0   # the calibration's cold read probe, bytes/s (0: no calibration)
    job: str = ""
    running_rows: int = 0    # rows prefilling or decoding after this pass (the scheduler's count)


@dataclass
class Ended:
    epoch: int
    rows: list[int]


@dataclass
class Done:
    epoch: int
    rows: list[int]
    texts: list[str]
    finish: list[str]
    prompt_tokens: list[int]
    completion_tokens: list[int]
    job: str = ""            # the job whose rows these are (from its RESET)


@dataclass
class Error:
    epoch: int
    rows: list[int]
    codes: list[str]
    messages: list[str]
    job: str = ""


@dataclass
class Progress:
    epoch: int
    rows: list[int]
    tokens: list[int]        # generated so far
    tails: list[str]         # last characters of the text
    job: str = ""


@dataclass
class Shutdown:
    reason: str = ""


@dataclass
class Request:
    op: str                  # "ping", "submit", "status", "interrupt", "down"
    args: dict = field(default_factory=dict)
    token: str = ""          # the control token; required on a tcp control socket


@dataclass
class Reply:
    ok: bool
    data: dict = field(default_factory=dict)
    error: str = ""          # one line for the user when not ok


_TYPES = {Kind.READY: Ready, Kind.RESET: Reset, Kind.SUBMIT: Submit, Kind.TOKENIZED: Tokenized,
          Kind.PLAN: Plan, Kind.TOKENS: Tokens, Kind.STOP: Stop, Kind.PASS: Pass, Kind.DONE: Done,
          Kind.ERROR: Error, Kind.PROGRESS: Progress, Kind.SHUTDOWN: Shutdown, Kind.HEARTBEAT: Heartbeat,
          Kind.BUDGET: Budget, Kind.ENDED: Ended,
          Kind.REQUEST: Request, Kind.REPLY: Reply}
_KINDS = {t: k for k, t in _TYPES.items()}


INT64 = (-(1 << 63), (1 << 63) - 1)
ROW = (MODEL_ROW, (1 << 31) - 1)     # row numbers within a job
COUNT = (0, (1 << 31) - 1)           # token counts and ids, lengths, epochs, pass indices
SEED = (0, (1 << 63) - 1)
BYTES = (0, (1 << 63) - 1)
_RANGES = {"epoch": COUNT, "index": COUNT, "pass_index": COUNT, "positions": COUNT, "pid": COUNT, "rows": ROW, "finished": ROW,
           "lengths": COUNT, "max_tokens": COUNT, "prompt_tokens": COUNT, "completion_tokens": COUNT,
           "tokens": COUNT, "eos": COUNT, "seed": SEED, "top_k": (-1, COUNT[1]), "held_rows": COUNT,
           "preempted_rows": COUNT, "running_rows": COUNT, "widths": COUNT, "pools": COUNT, "groups": COUNT, "chunks": COUNT,
           "drop": ROW, "finish": ROW, "plan": (-1, COUNT[1]), **dict.fromkeys(("working_set", "budget", "guard", "hard", "others"), BYTES)}
_PARALLEL = {Submit: ("rows", "requests"), Tokenized: ("rows", "lengths", "max_tokens", "sampling"),
             Plan: ("rows", "lengths", "max_tokens", "sampling", "widths", "groups"), Tokens: ("rows", "finish", "positions"),
             Done: ("rows", "texts", "finish", "prompt_tokens", "completion_tokens"),
             Error: ("rows", "codes", "messages"), Progress: ("rows", "tokens", "tails")}
_REQUEST = {"kind": str, "messages": list[dict[str, str | None]] | None, "prompt": str | None,
            "max_tokens": int, "temperature": float | None, "top_p": float | None, "top_k": int | None,
            "seed": int | None, "stop": list[str]}
_SAMPLING = (float, float, int, int | None)   # temperature, top_p, top_k, seed


class BadMessage(ValueError):
    """A frame that is not a well-formed message of ours: the receiver drops it and logs one line."""


def encode(msg) -> bytes:
    """The frame of a message: its fields as they are (no deep copy), a dataclass inside them as a map."""
    values = {f.name: getattr(msg, f.name) for f in _fields(type(msg))}
    return bytes([_KINDS[type(msg)]]) + msgpack.packb(values, use_bin_type=True, default=_plain)


def _plain(value):
    if is_dataclass(value) and not isinstance(value, type):
        return asdict(value)
    raise TypeError(f"cannot encode {type(value).__name__}")


@functools.cache
def _fields(cls) -> tuple:
    return fields(cls)


@functools.cache
def _hints(cls) -> dict:
    return typing.get_type_hints(cls)


@functools.cache
def _parts(hint) -> tuple:
    return typing.get_origin(hint), typing.get_args(hint)


def decode(data: bytes):
    """The message in a frame, checked field by field; BadMessage for anything else."""
    try:
        cls = _TYPES[Kind(data[0])]
    except (IndexError, ValueError):
        raise BadMessage(f"unknown message kind {data[:1].hex() or '(empty frame)'}") from None
    try:
        raw = msgpack.unpackb(data[1:], raw=False)
    except Exception as err:  # noqa: BLE001 - msgpack raises several types for garbage
        raise BadMessage(f"{cls.__name__}: not msgpack ({type(err).__name__})") from None
    if not isinstance(raw, dict):
        raise BadMessage(f"{cls.__name__}: expected a map of fields, found {type(raw).__name__}")
    hints = _hints(cls)
    values = {}
    for f in _fields(cls):
        if f.name in raw:
            values[f.name] = _checked(raw[f.name], hints[f.name], _RANGES.get(f.name, INT64), f"{cls.__name__}.{f.name}")
        elif f.default is MISSING and f.default_factory is MISSING:
            raise BadMessage(f"{cls.__name__}: field {f.name} is missing")
    msg = cls(**values)
    _check_shape(msg)
    return msg


def _checked(value, hint, bounds: tuple[int, int], where: str):
    """value when it is of type hint (ints within bounds, floats finite), else BadMessage."""
    if _test(hint, bounds)(value):
        return value   # the common case, checked fast; the walk below names what is wrong
    origin, args = _parts(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        for option in args:
            try:
                return _checked(value, option, bounds, where)
            except BadMessage:
                pass
        raise BadMessage(f"{where}: expected {hint}, found {type(value).__name__}")
    if hint is type(None):
        ok = value is None
    elif hint is int:
        ok = isinstance(value, int) and not isinstance(value, bool) and bounds[0] <= value <= bounds[1]
    elif hint is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    elif hint in (str, bytes, bool):
        ok = isinstance(value, hint)
    elif hint is list or origin is list:
        if not isinstance(value, list):
            raise BadMessage(f"{where}: expected a list, found {type(value).__name__}")
        return [_checked(v, args[0], bounds, where) for v in value] if args else value
    elif hint is dict or origin is dict:
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise BadMessage(f"{where}: expected a map with string keys, found {type(value).__name__}")
        return {k: _checked(v, args[1], bounds, where) for k, v in value.items()} if args else value
    else:
        ok = False
    if not ok:
        raise BadMessage(f"{where}: expected {getattr(hint, '__name__', hint)}, found {_clip(value)}")
    return value


@functools.cache
def _test(hint, bounds: tuple[int, int]):
    """A predicate saying whether a decoded value (msgpack's own types) is of type hint."""
    origin, args = _parts(hint)
    if origin in (typing.Union, types.UnionType):
        first, rest = _test(args[0], bounds), _test(typing.Union[args[1:]], bounds)
        return lambda v: first(v) or rest(v)
    if hint is int:
        lo, hi = bounds
        return lambda v: type(v) is int and lo <= v <= hi
    if hint is float:
        return lambda v: type(v) in (int, float) and math.isfinite(v)
    if hint in (type(None), str, bytes, bool):
        return lambda v: type(v) is hint
    if hint is list or origin is list:
        item = _test(args[0], bounds) if args else (lambda v: True)
        return lambda v: type(v) is list and all(map(item, v))
    if hint is dict or origin is dict:
        item = _test(args[1], bounds) if args else (lambda v: True)
        return lambda v: type(v) is dict and all(type(k) is str for k in v) and all(map(item, v.values()))
    return lambda v: False


def _check_shape(msg) -> None:
    """Parallel lists of one length, packed tokens of the stated size, requests and sampling as the actors read them."""
    name = type(msg).__name__
    lists = _PARALLEL.get(type(msg), ())
    if len({len(getattr(msg, f)) for f in lists}) > 1:
        raise BadMessage(f"{name}: {', '.join(lists)} differ in length")
    if isinstance(msg, Tokenized) and len(msg.tokens) != 4 * sum(msg.lengths):
        raise BadMessage(f"{name}: {len(msg.tokens)} token bytes for lengths summing to {sum(msg.lengths)}")
    for pairs in ("pools", "chunks") if isinstance(msg, Plan) else ():
        if any(len(p) != 2 for p in getattr(msg, pairs)):
            raise BadMessage(f"{name}.{pairs}: expected pairs, found {_clip(getattr(msg, pairs))}")
    if isinstance(msg, Tokens) and len(msg.tokens) != 4 * len(msg.rows):
        raise BadMessage(f"{name}: {len(msg.tokens)} token bytes for {len(msg.rows)} rows")
    for s in getattr(msg, "sampling", []) if isinstance(msg, Tokenized) else []:
        if len(s) != 4:
            raise BadMessage(f"{name}.sampling: expected [temperature, top_p, top_k, seed], found {_clip(s)}")
        for v, hint, key in zip(s, _SAMPLING, ("temperature", "top_p", "top_k", "seed")):
            _checked(v, hint, _RANGES.get(key, INT64), f"{name}.sampling.{key}")
    for r in msg.requests if isinstance(msg, Submit) else []:
        for key, hint in _REQUEST.items():
            _checked(r.get(key), hint, _RANGES.get(key, INT64), f"{name}.requests.{key}")
        if r["kind"] not in ("chat", "completion") or r[{"chat": "messages", "completion": "prompt"}[r["kind"]]] is None:
            raise BadMessage(f"{name}.requests: kind {_clip(r['kind'])} without its messages or prompt")


def _clip(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
