"""One job as the coordinator runs it: which rows are left, their results written to the job store,
and the figures the live view shows. Pure: the daemon feeds it messages, tests feed it by hand."""

import hashlib
import time
from collections import OrderedDict

from spill import config
from spill import messages as m

from . import history
from .batch_input import Request
from .batch_output import error_line, success_line
from .jobstore import LIVE, Job

SUBMIT_BATCH = 64
SUBMIT_SHARE = 4   # a SUBMIT fills at most 1/4 of the frame cap: the TOKENIZED of its rows may outgrow their text


class JobRun:
    def __init__(self, job: Job, requests: list[Request], model_name: str, defaults: dict):
        self.job = job
        self.model_name = model_name
        self.defaults = defaults          # max_tokens, temperature for rows that do not set them
        self.requests = requests
        self.seeds = row_seeds(job.id, requests)
        done = job.done_ids()
        self.pending = {i for i, r in enumerate(requests) if r.custom_id not in done}
        self.window = config.submit_window()
        self.in_flight: dict[int, float] = {}   # rows submitted in this epoch, not written yet -> when (latency)
        self.cursor = 0                   # rows below it have been submitted in this epoch (or are done)
        self.left_at_start = len(self.pending)
        self.total = int(job.meta.get("total", len(requests)))
        self.started = time.monotonic()
        self.generated = 0                # tokens generated since this run of the job started
        self.last_pass: m.Pass | None = None
        self.passes = 0                   # passes reported in this run of the job, and when the first and last came
        self.pass_seconds = 0.0           # their summed duration as the streamer measured it
        self.first_pass_at = self.last_pass_at = 0.0
        self.peak_memory = 0
        self.drafts = {"rows": 0, "proposed": 0, "accepted": 0}   # decode rows summed over passes, draft tokens
        self.tiers: dict[str, list[int]] = {}   # prompt-length tier -> [drafts proposed, accepted] in its rows
        self.prompt_tokens: dict[int, int] | None = None   # each row's as the estimate tokenized it
        self.tails: OrderedDict[int, tuple[int, str]] = OrderedDict()   # row -> (tokens, tail)
        self.estimate = None              # a JobEstimate, when the daemon could make one
        self.finishes, self.lengths = [], []   # finish reason and output tokens of rows done in this run
        self.first_pass_s = 0.0
        self.notes: list[str] = []        # what the group says to the job's client once each (a pipeline's lost rank)

    # -- what goes to the group ---------------------------------------------------------------
    def submits(self, epoch: int) -> list[m.Submit]:
        """The first window of unfinished rows, on a fresh epoch (the group holds none of them)."""
        self.in_flight.clear()
        self.cursor = 0
        return self.refill(epoch)

    def refill(self, epoch: int) -> list[m.Submit]:
        """More rows, in order, up to `window` in flight; only once a batch's worth (SUBMIT_BATCH) has room."""
        out = []
        if self.window - len(self.in_flight) < min(SUBMIT_BATCH, self.window):
            return out
        limit = config.max_message_bytes() // SUBMIT_SHARE   # ZeroMQ drops a bigger frame without a word
        while self.cursor < len(self.requests) and len(self.in_flight) < self.window:
            rows, requests, size, room = [], [], 0, min(SUBMIT_BATCH, self.window - len(self.in_flight))
            while self.cursor < len(self.requests) and len(rows) < room:
                if self.cursor in self.pending:
                    r = self.requests[self.cursor]
                    request = row_request(r, self.defaults, r.seed if r.seed is not None else self.seeds[self.cursor])
                    n = len(m.pack(request))
                    if n > limit:
                        self._too_big(self.cursor, n, limit)
                    elif rows and size + n > limit:
                        break   # the next SUBMIT starts with it
                    else:
                        rows.append(self.cursor)
                        requests.append(request)
                        size += n
                self.cursor += 1
            if rows:
                self.in_flight.update(dict.fromkeys(rows, time.monotonic()))
                out.append(m.Submit(epoch, rows, requests))
        return out

    def _too_big(self, row: int, n: int, limit: int) -> None:
        r, mb = self.requests[row], 2 ** 20
        why = (f"line {r.line}: the request is {n / mb:.1f} MB, more than a message between spill's processes may carry "
               f"({limit / mb:.1f} MB a row); raise SPILL_MAX_MESSAGE_MB to {SUBMIT_SHARE * n / mb + 1:.0f} or shorten it")
        self._write([error_line(r.custom_id, code="invalid_request", message=why)], [row])

    # -- what comes back ------------------------------------------------------------------------
    def on_done(self, msg: m.Done) -> None:
        lines, rows = [], []
        for row, text, finish, p, c in zip(msg.rows, msg.texts, msg.finish, msg.prompt_tokens, msg.completion_tokens):
            if row in self.pending:   # a row recomputed after a crash may report twice
                r = self.requests[row]
                lines.append(success_line(r.custom_id, kind=r.kind, model=self.model_name, text=text,
                                          finish_reason=finish, prompt_tokens=p, completion_tokens=c))
                rows.append(row)
                self.finishes.append(finish)
                self.lengths.append(c)
        self._write(lines, rows)

    def on_error(self, msg: m.Error) -> None:
        lines, rows = [], []
        for row, code, message in zip(msg.rows, msg.codes, msg.messages):
            if row in self.pending:
                r = self.requests[row]
                lines.append(error_line(r.custom_id, code=code, message=f"line {r.line}: {message}"))
                rows.append(row)
        self._write(lines, rows)

    def _write(self, lines: list[dict], rows: list[int]) -> None:
        if lines:
            self.job.append(lines)    # fsynced before the rows count as done
            self.pending.difference_update(rows)
            for row in rows:
                self.in_flight.pop(row, None)
            for row in rows:
                self.tails.pop(row, None)
            if not self.pending and self.passes:
                history.written(self.job.dir, self.total)   # the plot's last point: every row done

    def on_pass(self, msg: m.Pass) -> None:
        now = time.monotonic()
        if not self.first_pass_at:
            self.first_pass_at, self.first_pass_s = now, msg.seconds
            if self.estimate is not None:
                self.estimate.started(now - msg.seconds)
        self.last_pass_at = now
        self.passes += 1
        self.pass_seconds += msg.seconds
        self.last_pass = msg
        self.generated += msg.emitted
        self.peak_memory = max(self.peak_memory, msg.peak_memory)
        for key, n in (("rows", msg.decode_rows), ("proposed", sum(n for _, n in msg.drafted)),
                       ("accepted", sum(n for _, n in msg.accepted))):
            self.drafts[key] += n
        self._tiers(msg)
        history.append(self.job.dir, msg, done=self.total - len(self.pending), eta_s=self.eta())

    def _tiers(self, msg: m.Pass) -> None:
        """A pass's drafts counted by the prompt-length tier of their rows, where the estimate tokenized them."""
        if not msg.drafted or self.estimate is None:
            return
        from spill.admission.schedule import tier_of
        if self.prompt_tokens is None:
            self.prompt_tokens = {r.row: r.prompt for r in self.estimate.rows}
        took = dict(msg.accepted)
        for row, n in msg.drafted:
            if row in self.prompt_tokens:
                t = self.tiers.setdefault(tier_of(self.prompt_tokens[row]), [0, 0])
                t[0], t[1] = t[0] + n, t[1] + took.get(row, 0)

    def on_progress(self, msg: m.Progress) -> None:
        for row, n, tail in zip(msg.rows, msg.tokens, msg.tails):
            if row in self.pending:
                self.tails[row] = (n, tail)
                self.tails.move_to_end(row)
        while len(self.tails) > 64:
            self.tails.popitem(last=False)

    @property
    def kv(self) -> tuple:
        """(bits, group size) of the job's quantized KV; bits 0: unquantized (as Reset carries it)."""
        return self.defaults.get("kv_bits") or 0, self.defaults.get("kv_group_size") or 64

    @property
    def speculate(self) -> int:
        """Drafts a decode row may carry a pass (--speculate K); 0: off."""
        return self.defaults.get("speculate") or 0

    @property
    def draft(self) -> str:
        """The draft model's folder (--draft); "": drafts by prompt lookup."""
        return self.defaults.get("draft") or ""

    @property
    def kv_format(self) -> str:
        from spill.streamer.shares import kv_format
        return kv_format(self.kv[0] or None, self.kv[1])

    @property
    def resident(self) -> bool:
        """The advisor's choice, made once when the job was submitted: every layer kept after its first read."""
        return bool(self.estimate and self.estimate.advice.resident)

    @property
    def by_compute(self) -> bool:
        """The advisor's split of a resident pipeline's layers: by compute, else by bytes (`split.stage_shares`)."""
        return bool(self.estimate and self.estimate.advice.by_compute)

    @property
    def replicas(self) -> bool:
        """The advisor's choice for several ranks: each the whole model and a share of the rows (stages/replicas.py)."""
        return bool(self.estimate and self.estimate.advice.replicas)

    @property
    def finished(self) -> bool:
        return not self.pending

    def status(self) -> dict:
        elapsed = max(time.monotonic() - self.started, 1e-9)
        done = self.total - len(self.pending)
        rate = self.generated / elapsed
        p = self.last_pass
        eta = self.live_eta() if self.job.meta.get("status") in (*LIVE, "done") else None   # ended early: none
        slots = [m.Slot(self.requests[r].custom_id, n, tail) for r, (n, tail) in list(self.tails.items())[-8:]]
        return {"job": self.job.id, "status": self.job.meta.get("status"), "done": done, "total": self.total,
                "tokens_per_s": rate, "pass_s": p.seconds if p else None, "peak_memory": self.peak_memory,
                "eta_s": eta, "slots": slots, "output": str(self.job.output_path), "passes": self.passes,
                "streamer_pass_s": self.pass_seconds / self.passes if self.passes else None,
                "wall_per_pass_s": (self.last_pass_at - self.first_pass_at) / (self.passes - 1) if self.passes > 1 else None,
                "estimate": self.estimate.first.to_dict() if self.estimate else None, "summary": self.summary(),
                "estimate_line": self.estimate.first_line if self.estimate else None,
                "advice": self.estimate.advice.line if self.estimate else None, "kv": self.kv_format,
                "notes": list(self.notes)}

    def on_budget(self, msg) -> None:
        """Admission priced the job: its figure of the group's memory is the one the ETA prices."""
        if self.estimate is not None:
            self.estimate.priced(msg.others)

    def eta(self) -> float | None:
        """Seconds left: the rows left re-simulated with the refitted pass model (None without an estimate)."""
        if self.estimate is None:
            return None
        try:
            return self.estimate.eta(self.pending, {r: n for r, (n, _) in self.tails.items()})
        except Exception:  # noqa: BLE001 - a figure, never the group's end: a model changed mid-job fails where it is read
            return None

    def live_eta(self) -> float | None:
        """The live view's ETA: the estimate's, else the time per row done in this run (None before the first)."""
        if self.estimate is not None:
            return self.eta()
        done_now = self.left_at_start - len(self.pending)
        return (time.monotonic() - self.started) / done_now * len(self.pending) if done_now > 0 else None

    def actual_seconds(self, until: float | None = None) -> float:
        """The job's time as its estimate counts it: from the first pass's start to `until` (default:
        the last pass's end)."""
        return (until or self.last_pass_at) - self.first_pass_at + self.first_pass_s if self.passes else 0.0

    def summary(self) -> dict:
        from .estimate_text import summary
        return summary(self.estimate.first.total_seconds if self.estimate else None, self.actual_seconds(),
                       self.finishes, self.lengths, self.passes, self.kv_format, self.drafts, self.draft, self.tiers)


def row_request(r: Request, defaults: dict, seed: int | None) -> m.RowRequest:
    """A row as the tokenizer takes it: the job's max_tokens and temperature where the line set none."""
    temperature = r.temperature if r.temperature is not None else defaults.get("temperature") or 0.0
    sampling = m.RowSampling(float(temperature), r.top_p or 1.0, r.top_k or 0, seed)
    return m.RowRequest(r.kind, r.max_tokens or defaults.get("max_tokens") or 256, r.messages, r.prompt, sampling, r.stop)


def row_seeds(job_id: str, requests: list[Request]) -> list[int]:
    """Each row's default seed, from its job and custom_id: a resumed job draws the same, no two rows share one."""
    seeds, taken = [], set()
    for r in requests:
        digest = hashlib.blake2b(f"{job_id}\0{r.custom_id}".encode(), digest_size=8).digest()
        seed = int.from_bytes(digest, "little") >> 1          # a non-negative int64
        while seed in taken:                                   # (2^-63 a pair; input order decides)
            seed = (seed + 1) & ((1 << 63) - 1)
        taken.add(seed)
        seeds.append(seed)
    return seeds
