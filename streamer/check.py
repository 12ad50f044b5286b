"""`spill check`: the same prompts through the streamer and through mlx-lm with the model resident.

The gate is teacher-forced: the streamer is fed the resident's greedy tokens, and at every step its
logits must be within a tolerance derived from the compute dtype (ULPS rounding steps at the largest
logit) and its argmax the resident's wherever the resident's top two logits are not a near-tie. In
bf16 one rounding step can flip a flat argmax and free-running paths then diverge, so free-running
identity (0 difference is expected in float32) is reported beside it, not gated. The rows exercise
what the streamer does differently from mlx-lm: varied lengths in one batch, rows joining mid-run,
and a prompt long enough to be prefilled in several chunks.

With `--speculate K` the free-running rows carry up to K prompt-lookup drafts a pass (`speculate.py`; with `--draft
MODEL` the draft model's, `draft.py`), verified in the pass, and in float32 their identity is gated too: greedy
drafts must change no token. Teacher-forced rows take a token a pass beside them, in the same (1 + K)-column chunk.

With quantized KV (`--kv-bits`) the resident side is mlx-lm's own quantized cache (QuantizedKVCache, its
quantized attention) at the same bits and group size: the prompt computed unquantized and its KV quantized once
after it, as a row joining a decode pool, then `generate_step(..., kv_bits, kv_group_size, quantized_kv_start=0)`;
the tolerance adds one quantization step of the format at the largest logit, or is twice mlx-lm's own spread
where that is larger: its logits when every weight moves by a rounding step (a value near a quantization boundary
rounds the other way and later layers carry it on: 0.46 on the real SmolLM2 at 8 bits, against one KV step's 0.14).
With both, the drafts run over the quantized pools and the free-running rows' identity is gated against mlx-lm's
greedy tokens over its quantized cache, but for a row that parts from them at a near-tie (float32: 20/20 rows on the
real SmolLM2 at 8 bits, group 64; docs/benchmarks.md shows drafts, and the batch alone, parting there on longer rows).
"""

from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import numpy as np

from spill.errors import SpillError

from .core import Row, Streamer
from .reference import resident_side

def first_difference(a: list, b: list) -> int | None:
    """The first position where two token lists differ (the shorter one's end where one runs on), None where equal."""
    return next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def margin(logits: np.ndarray) -> float:
    """How far the top logit is above the second (infinite with one)."""
    top2 = np.partition(logits, -2)[-2:] if logits.size > 1 else np.array([-np.inf, logits.max()])
    return float(top2[1] - top2[0])


@dataclass
class CheckRow:
    id: str
    prompt_tokens: int
    joined_pass: int
    expected: list[int]                    # the resident's greedy tokens, EOS excluded
    ref_logits: list = field(default_factory=list, repr=False)   # resident logits per step
    got: list[int] = field(default_factory=list)                  # streamed, free-running
    # teacher-forced: the streamer fed the resident's tokens; its logits at every step against the resident's
    max_logit_diff: float = 0.0
    forced_steps: int = 0                  # steps the teacher-forced row emitted
    agree: int = 0                         # steps whose argmax equals the resident's, near-ties left out
    ties: int = 0                          # steps left out: the resident's top two logits within 2 x tolerance
    first_disagreement: int | None = None
    first_expected: int | None = None      # mlx_lm.generate's first token, run on its own
    first_got: int | None = None           # the free-running streamed row's first token (EOS included)
    drafted: int = 0                       # free-running: drafts it carried, drafts verification accepted
    accepted: int = 0
    decided: int = 0                       # free-running: tokens emitted (an EOS included), in `passes` passes
    passes: int = 0

    @property
    def identical(self) -> bool:
        return self.expected == self.got

    @property
    def first_identical(self) -> bool:
        return self.first_expected == self.first_got

    def first_difference(self) -> int | None:
        return first_difference(self.expected, self.got)


@dataclass
class CheckReport:
    rows: list[CheckRow]
    dtype: str                 # the compute dtype of both sides
    device: str                # "cpu" or "gpu"
    eps: float                 # machine epsilon of the dtype
    scale: float               # largest |logit| the resident produced
    tolerance: float
    derived: bool              # tolerance = (ULPS x eps + ULPS_F32 x eps of float32 + kv_step) x scale, else given
    kv_bits: int | None = None     # the decode pools' KV format; the reference quantizes the same way
    kv_group_size: int = 64
    spread: float = 0.0        # quantized KV: mlx-lm's own logits moved by a rounding step of every weight (reference.py)
    speculate: int = 0         # the most drafts a free-running row carried a pass (0: none)
    draft: str | None = None   # the draft model's folder (--draft); None: prompt lookup

    @property
    def kv_step(self) -> float:
        """One quantization step of the KV format, relative (2^-bits): K or V rounded the other way once."""
        return 2.0 ** -self.kv_bits if self.kv_bits else 0.0

    @property
    def max_logit_diff(self) -> float:
        return max((r.max_logit_diff for r in self.rows), default=0.0)

    @property
    def compared(self) -> int:
        return sum(len(r.ref_logits) - r.ties for r in self.rows)

    @property
    def agree(self) -> int:
        return sum(r.agree for r in self.rows)

    @property
    def ties(self) -> int:
        return sum(r.ties for r in self.rows)

    @property
    def identical(self) -> int:
        return sum(r.identical for r in self.rows)

    @property
    def first_tokens(self) -> int:
        return sum(r.first_identical for r in self.rows)

    @property
    def gates_identity(self) -> bool:
        """Drafts in float32: free-running rows must be identical (drafts verified greedily change no token)."""
        return bool(self.speculate) and self.dtype == "float32"

    def parted_at_near_tie(self, row: CheckRow) -> bool:
        """Over quantized KV, a free-running row that leaves the resident's tokens where its top two logits were a
        near-tie: a pass's shape (a chunk of drafts, the batch) can round a K or V value to the next level."""
        k = row.first_difference()
        return bool(self.kv_bits) and k is not None and k < len(row.ref_logits) and \
            margin(row.ref_logits[k]) <= 2 * self.tolerance

    @property
    def drafted(self) -> int:
        return sum(r.drafted for r in self.rows)

    @property
    def accepted(self) -> int:
        return sum(r.accepted for r in self.rows)

    @property
    def tokens_per_pass(self) -> float:
        """The free-running rows' tokens a pass, over the passes each emitted in (1.0 without drafts)."""
        return sum(r.decided for r in self.rows) / max(sum(r.passes for r in self.rows), 1)

    def failures(self) -> list[CheckRow]:
        """Rows whose teacher-forced logits leave the tolerance, or whose argmax differs outside a near-tie;
        with drafts in float32, free-running rows that are not identical too (over quantized KV, but at a near-tie)."""
        return [r for r in self.rows if r.max_logit_diff > self.tolerance or r.agree < len(r.ref_logits) - r.ties
                or r.forced_steps != len(r.ref_logits)
                or (self.gates_identity and not r.identical and not self.parted_at_near_tie(r))]

    @property
    def passed(self) -> bool:
        return not self.failures()


# The tolerance at the largest logit: a few rounding steps of the compute dtype (each layer rounds its
# output once) plus float32 accumulation in another order (the streamer batches and chunks differently).
ULPS, ULPS_F32 = 4, 64
DTYPES = {"bfloat16": mx.bfloat16, "float16": mx.float16, "float32": mx.float32}


def join_schedule(n: int) -> dict[int, list[int]]:
    """Row indices added at each pass: most at pass 0, the rest join mid-run."""
    first = max(1, (n * 3) // 5)
    second = first + (n - first) // 2
    return {0: list(range(first)), 2: list(range(first, second)), 5: list(range(second, n))}


def compute_dtype(dtype: str | None):
    """'bfloat16' | 'float16' | 'float32' -> mx.Dtype; None -> the streamer's default for the device."""
    if dtype is None:
        return "auto"
    if dtype not in DTYPES:
        raise SpillError(f"--dtype {dtype!r} is not one of {', '.join(DTYPES)}; pick one of them or leave it out")
    return DTYPES[dtype]


def run_check(folder: str | Path, n: int = 20, max_tokens: int = 16, prefill_chunk: int = 128,
              dtype: str | None = None, tolerance: float | None = None, kv_bits: int | None = None,
              kv_group_size: int = 64, speculate: int = 0, draft: str | Path | None = None) -> CheckReport:
    """Each prompt runs twice in the same streamed batch: free-running (its own greedy tokens, with up to
    `speculate` drafts a pass, from `draft` where given) and teacher-forced (fed the resident's tokens, so every step's logits can be
    compared); the resident side runs in a process of its own (reference.py)."""
    if n < 1:
        raise SpillError(f"--rows must be at least 1, got {n}")
    streamer = Streamer(folder, prefill_chunk=prefill_chunk, keep_logits=True, dtype=compute_dtype(dtype),
                        kv_bits=kv_bits, kv_group_size=kv_group_size, draft=str(draft) if draft else None)
    kv = None if kv_bits is None else {"kv_bits": kv_bits, "kv_group_size": kv_group_size}
    try:
        dtype_name = None if streamer.dtype is None else str(streamer.dtype).removeprefix("mlx.core.")
        ref = resident_side(folder, dtype_name, n, max_tokens, long_tokens=3 * prefill_chunk, kv=kv)
        prompts, eos, used = ref["prompts"], frozenset(ref["eos"]), getattr(mx, ref["dtype"])
        schedule = join_schedule(n)
        rows: dict[str, CheckRow] = {}
        steps: dict[str, list[int]] = {}
        for joined, indices in schedule.items():
            for i in indices:
                steps[str(i)], ref_logits, first = ref["rows"][i]
                ref_logits = ref_logits[:len(steps[str(i)])]   # generate_step computes one step ahead
                expected = [t for t in steps[str(i)] if t not in eos]
                rows[str(i)] = CheckRow(str(i), len(prompts[i]), joined, expected, ref_logits, first_expected=first)
        scale = max((float(np.abs(x).max()) for r in rows.values() for x in r.ref_logits), default=0.0)
        eps = float(mx.finfo(used).eps)
        derived, step = tolerance is None, 2.0 ** -kv_bits if kv_bits else 0.0
        tol = (ULPS * eps + ULPS_F32 * float(mx.finfo(mx.float32).eps) + step) * max(scale, 1.0) if derived else tolerance
        tol = max(tol, 2 * ref["spread"]) if derived else tol
        _stream(streamer, prompts, schedule, rows, steps, max_tokens, eos, tol, speculate)
    finally:
        streamer.close()
    device = "gpu" if mx.default_device() == mx.gpu else "cpu"
    return CheckReport([rows[str(i)] for i in range(n)], ref["dtype"], device, eps, scale, tol, derived, kv_bits,
                       kv_group_size, ref["spread"], speculate, str(draft) if draft else None)


_TEACHER = "/teacher"


def _stream(streamer, prompts, schedule, rows, steps, max_tokens, eos, tol, speculate) -> None:
    passes, bounds = 0, {}
    while passes <= max(schedule) or not streamer.idle:
        for i in schedule.get(passes, []):
            rid = str(i)
            streamer.add(Row(rid, prompts[i], max_tokens, eos_ids=eos))
            # no EOS: the row runs exactly as many steps as the resident did, fed its tokens
            streamer.add(Row(rid + _TEACHER, prompts[i], len(steps[rid]), teacher=tuple(steps[rid])))
            bounds[rid] = speculate   # free-running rows only: teacher-forced ones take a token a pass
        report = streamer.step(bounds if speculate else None)
        for rid, k in report.drafted.items():
            rows[rid].drafted += k
            rows[rid].accepted += report.accepted[rid]
        for e in report.emitted:
            if e.row_id.endswith(_TEACHER):
                _compare(rows[e.row_id.removesuffix(_TEACHER)], steps[e.row_id.removesuffix(_TEACHER)], e, tol)
            else:
                row = rows[e.row_id]
                row.first_got = e.token if row.first_got is None else row.first_got
                row.decided += 1
                if e.finish != "stop":
                    row.got.append(e.token)
        for rid in {e.row_id for e in report.emitted if not e.row_id.endswith(_TEACHER)}:
            rows[rid].passes += 1
        passes += 1


def _compare(row: CheckRow, steps: list[int], e, tol: float) -> None:
    """One teacher-forced step: the logits' distance, and the argmax unless the resident's top two
    logits are within 2 x tolerance of each other (a near-tie either side may flip)."""
    k = row.forced_steps
    row.forced_steps += 1
    if k >= len(row.ref_logits):
        return
    ref = row.ref_logits[k]
    row.max_logit_diff = max(row.max_logit_diff, float(np.abs(ref - e.logits).max()))
    if margin(ref) <= 2 * tol:
        row.ties += 1
    elif e.token == steps[k]:
        row.agree += 1
    elif row.first_disagreement is None:
        row.first_disagreement = k
