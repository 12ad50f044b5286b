"""Everything that crosses a process boundary, and its encoding: one kind byte, then msgpack.

Rows travel as struct-of-arrays: `rows` (int row numbers within the job), packed int32 token
arrays, and per-row lists of parameters. No pickle anywhere on the wire.
"""

from dataclasses import asdict, dataclass, field, fields
from enum import IntEnum

import msgpack
import numpy as np


MODEL_ROW = -1   # the row number of an ERROR about the job's model rather than one row


class Kind(IntEnum):
    READY = 1        # actor -> coordinator, once after start
    RESET = 2        # coordinator -> actors: drop every row, (re)load a model, new epoch
    SUBMIT = 3       # coordinator -> tokenizer: rows as the user wrote them
    TOKENIZED = 4    # tokenizer -> admission: rows with real token ids
    ADMIT = 5        # admission -> streamer: rows to start this pass
    TOKENS = 6       # streamer -> tokenizer: one sampled token per row
    STOP = 7         # tokenizer -> streamer: rows that hit a stop string
    PASS = 8         # streamer -> admission, coordinator: what a pass did
    DONE = 9         # tokenizer -> coordinator: finished rows with their text
    ERROR = 10       # tokenizer -> coordinator: rows that cannot run
    PROGRESS = 11    # tokenizer -> coordinator: recent text of running rows, for the live view
    SHUTDOWN = 12    # coordinator -> actors
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


@dataclass
class Reset:
    epoch: int
    model: str = ""          # model folder; "" keeps the current one
    job: str = ""


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
class Admit(Tokenized):
    pass


@dataclass
class Tokens:
    epoch: int
    pass_index: int
    rows: list[int]
    tokens: bytes            # one int32 per row
    finish: list[str]        # "" running, "stop" (EOS: not text), "length"


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


@dataclass
class Done:
    epoch: int
    rows: list[int]
    texts: list[str]
    finish: list[str]
    prompt_tokens: list[int]
    completion_tokens: list[int]


@dataclass
class Error:
    epoch: int
    rows: list[int]
    codes: list[str]
    messages: list[str]


@dataclass
class Progress:
    epoch: int
    rows: list[int]
    tokens: list[int]        # generated so far
    tails: list[str]         # last characters of the text


@dataclass
class Shutdown:
    reason: str = ""


@dataclass
class Request:
    op: str                  # "ping", "submit", "status", "interrupt", "down"
    args: dict = field(default_factory=dict)


@dataclass
class Reply:
    ok: bool
    data: dict = field(default_factory=dict)
    error: str = ""          # one line for the user when not ok


_TYPES = {Kind.READY: Ready, Kind.RESET: Reset, Kind.SUBMIT: Submit, Kind.TOKENIZED: Tokenized,
          Kind.ADMIT: Admit, Kind.TOKENS: Tokens, Kind.STOP: Stop, Kind.PASS: Pass, Kind.DONE: Done,
          Kind.ERROR: Error, Kind.PROGRESS: Progress, Kind.SHUTDOWN: Shutdown, Kind.REQUEST: Request,
          Kind.REPLY: Reply}
_KINDS = {t: k for k, t in _TYPES.items()}


def encode(msg) -> bytes:
    return bytes([_KINDS[type(msg)]]) + msgpack.packb(asdict(msg), use_bin_type=True)


def decode(data: bytes):
    cls = _TYPES[Kind(data[0])]
    fields_ = msgpack.unpackb(data[1:], raw=False)
    return cls(**{f.name: fields_[f.name] for f in fields(cls) if f.name in fields_})
