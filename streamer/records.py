"""What goes into a pass and what comes out of it: a row, a pass's plan, a sampled token, a pass's report."""

from dataclasses import dataclass, field

import numpy as np

from .sampling import SamplingParams


@dataclass
class Row:
    id: int | str
    prompt: list[int]
    max_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    eos_ids: frozenset[int] = frozenset()
    teacher: tuple[int, ...] | None = None   # fed instead of the sampled tokens (`spill check`)
    width: int = 0           # the reserved decode pool it joins (0: an unreserved one, grown as rows come)


@dataclass
class Emitted:
    """One sampled token. `finish` is "stop" (the token is EOS: not part of the text) or "length"."""
    row_id: str
    token: int
    finish: str | None = None
    logits: np.ndarray | None = None
    position: int = 0        # the row's tokens before this one (EOS excluded): the tokenizer sees a gap


@dataclass
class PassPlan:
    """One pass as a scheduler decided it (admission/scheduler.py; `Streamer.step` plans for a caller alone)."""
    start: list[tuple[Row, int]] = field(default_factory=list)   # rows to start, each with the prefill group it opens
    chunks: dict[int, int] = field(default_factory=dict)          # prefill group -> its prompt columns this pass
    drop: list = field(default_factory=list)                      # rows dropped before it, to run again (preempted)
    finish: list = field(default_factory=list)                    # rows ended outside the streamer (a stop string)
    pools: list | None = None                                     # [slots, width] of every decode pool (None: kept)
    drafts: dict = field(default_factory=dict)                    # decode row -> the most drafts it may carry (speculate.py)
    rounds: int = 1                                               # decode steps a pipeline may run (stages/rounds.py)


@dataclass
class PassReport:
    index: int
    emitted: list[Emitted]
    decode_rows: int
    prefill_tokens: int          # prompt positions computed this pass (padding included)
    seconds: float
    wait_s: float                # compute thread blocked on the reader
    compute_s: float             # layer math, eval included
    bytes_streamed: int
    active_memory: int
    peak_memory: int
    left: list = field(default_factory=list)        # ids of rows that left this pass, however they ended
    preempted: list = field(default_factory=list)   # ids of rows dropped by `preempt`, to run again
    cache_memory: int = 0                           # MLX's buffer cache
    reader_memory: int = 0                          # the reader's read buffers
    rss: int = 0                                    # this process's resident memory
    cgroup_usage: int | None = None                 # the limiting cgroup's usage less its inactive page cache
    minor_faults: int = 0                           # this pass's page faults
    major_faults: int = 0
    read_s: float = 0.0                             # the reader's seconds in read calls (beside the compute)
    prefill_groups: int = 0                         # prefill groups that ran: each its own attention (families run_layer)
    prefill_context: int = 0                        # prompt tokens this pass x the keys each scores (cached + chunk)
    accepted: dict = field(default_factory=dict)    # row -> drafts it accepted, where it drafted (speculate.py)
    drafted: dict = field(default_factory=dict)     # row -> drafts it carried
    columns: int = 1                                # tokens every decode row fed (1 + the most drafts)
    link_s: float = 0.0                             # a pipeline stage's seconds blocked on its neighbours
    rounds: int = 1                                 # decode steps every decode row took (stages/rounds.py)
