"""Calibration: one pass model per model | dtype | device | machine, stored under
`$SPILL_HOME/calibration/`, started from the first-use probes (`probes.py`) and refitted from every
pass the streamer reports.

The model part of the key is its content (config, weight index, weight file names and sizes),
never its path: a copy of a model shares its numbers, another model never does.
"""

import hashlib
import json
import os
import platform
import random
from dataclasses import asdict
from pathlib import Path

import numpy as np

from spill import config
from spill.files import replaced
from spill.platform import default_dtype, device, on_cpu
from spill.stages.model import pass_seconds, replica_seconds

from . import drafts
from .passmodel import Observation, PassModel, fit, read_rate
from .probes import (PROBE_ROWS, _stored_dtype, compute_probe, pass_probe, priced_by_passes, probe_batch, read_probe,
                     weight_files)
from .schedule import pace, tier_of

HISTORY = 200                  # the last passes, kept for the refit
SAMPLE = 200                   # and a uniform sample of those before them (a job's tail is not the next job)
STAGED = 32                    # a resident pipeline's last passes, each as its seconds over the stage model's price
WIDER = 1.25                   # a job's batch past the widest decode pass seen by this much is probed first
FORMAT = 2                     # 2: a pass's prefill_context counts its chunk's own keys; another format is probed anew
ACCEPTANCE_DECAY = 0.99        # each pass that drafted keeps this much of the earlier drafts' weight (~100 passes)
TIERED = 50                    # drafts tried in a tier before its own acceptance counts: ~0.07 standard error at 0.5
ROWS_KEPT = 64                 # a tier's last ended rows' own acceptance, each over its life: how rows in it differ
ROW_TRIED = 8                  # drafts a row tried before its own acceptance is kept
ROWS_TIERED = 8                # rows kept in a tier before the estimate spreads its rows' acceptance as they did


# -- the key --------------------------------------------------------------------------------------
def model_key(folder: str | Path) -> str:
    """A digest of what the model is: config.json, the weight index and every weight file's name
    and size (not the path, not the bytes: hashing gigabytes would cost a full read)."""
    folder = Path(folder)
    h = hashlib.sha256()
    for name in ("config.json", "model.safetensors.index.json"):
        p = folder / name
        h.update(name.encode() + b"\0" + (p.read_bytes() if p.is_file() else b"") + b"\0")
    for p in sorted(folder.glob("*.safetensors")):
        h.update(f"{p.name}\0{p.stat().st_size}\0".encode())
    return h.hexdigest()[:20]


def machine_key() -> str:
    """Host name, architecture, CPU model and memory size: a rate measured here applies here."""
    cpu = platform.processor()
    try:
        cpu = next(l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name"))
    except (OSError, StopIteration):
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else 0
    raw = f"{platform.node()}|{platform.machine()}|{cpu}|{mem}"
    return hashlib.sha256(raw.encode()).hexdigest()[:12]


def key(folder: str | Path, dtype: str) -> str:
    return "|".join((model_key(folder), dtype, device(), machine_key()))


def store_path(k: str) -> Path:
    return config.home() / "calibration" / (k.replace("|", "__").replace(" ", "_") + ".json")


# -- the store and the refit ----------------------------------------------------------------------
class Calibration:
    """The stored numbers of one key: the probe's prior, the passes seen, the refitted model."""

    def __init__(self, k: str, prior: PassModel, passes: list[Observation] | None = None,
                 seen: int = 0, name: str = "", sample: list[Observation] | None = None, draft_counts: dict | None = None,
                 pairs: dict | None = None, staged: dict | None = None):
        self.key, self.prior, self.name = k, prior, name
        # per pipeline size (str(stages)): its resident passes' seconds over `stages.model.pass_seconds`'s price
        self.staged = {n: [float(x) for x in v][-STAGED:] for n, v in (staged or {}).items()}
        # drafts accepted and tried, decayed a pass (drafts.observe's count), and drafts tried in all: prompt lookup's and
        # each draft model's (--draft, by its model_key), in all and by prompt-length tier ("tiers")
        self.draft_counts = {**_counts(), **(draft_counts or {})}
        self.pairs = dict(pairs or {})
        self.streamed_bytes = 0                   # set by open_calibration from the model's plan
        self.passes = list(passes or [])[-HISTORY:]
        self.sample = list(sample or [])[-SAMPLE:]
        self.seen = seen                          # passes observed in all, kept or not
        self.model = fit(prior, self.passes, self.sample)

    def observe(self, obs: Observation) -> None:
        self.passes.append(obs)
        self.seen += 1
        if len(self.passes) > HISTORY:   # reservoir sampling: each pass that left the last ones, equally likely kept
            old, gone = self.passes.pop(0), self.seen - HISTORY
            at = random.Random(self.seen).randrange(gone)
            if len(self.sample) < SAMPLE:
                self.sample.append(old)
            elif at < SAMPLE:
                self.sample[at] = old
        self.model = fit(self.prior, self.passes, self.sample)

    def observe_staged(self, stages: int, ratio: float, replicas: bool = False) -> None:
        """A resident pipeline's pass of `stages` stages (or of as many `replicas`): its seconds over its price."""
        key = f"{stages} replicas" if replicas else str(stages)
        self.staged[key] = [*self.staged.get(key, []), ratio][-STAGED:]

    def stage_scale(self, stages: int, replicas: bool = False) -> float:
        """What the stage model's price of a resident pipeline of `stages` (or of as many `replicas`) is multiplied
        by: the median of its passes' ratios (`observe_staged`), 1.0 before any."""
        ratios = self.staged.get(f"{stages} replicas" if replicas else str(stages))
        return float(np.median(ratios)) if ratios else 1.0

    def observe_drafts(self, drafted, accepted, pair: str | None = None, prompts: dict | None = None) -> None:
        """A pass's [row, drafts carried] and [row, drafts accepted]: this model's acceptance of prompt lookup's drafts,
        or of the draft model `pair`'s (its model_key), recent passes weighing more; in all, and by the prompt-length
        tier of each row whose prompt tokens `prompts` ({row: tokens}) gives."""
        if not len(drafted):
            return
        took = dict((int(r), int(n)) for r, n in accepted)
        zero = np.zeros(len(drafted))
        hits, tried = drafts.observe(zero, zero, [n for _, n in drafted], [took.get(int(r), 0) for r, _ in drafted])
        d = self.counts(pair)
        if pair is not None:
            self.pairs[pair] = d
        _add(d, hits, tried)
        names = np.array([tier_of(prompts[int(r)]) if int(r) in (prompts or {}) else "" for r, _ in drafted])
        tiers = d.setdefault("tiers", {})
        for name in set(names.tolist()) - {""}:   # a tier's counts decay only in passes its rows drafted in
            _add(tiers.setdefault(name, _counts()), hits[names == name], tried[names == name])

    def observe_row(self, tier: str, hits: int, tried: int, pair: str | None = None) -> None:
        """A row that ended: its drafts accepted and tried over its life, kept in its tier's spread (`tier_rows`)."""
        d = self.counts(pair)
        if pair is not None:
            self.pairs[pair] = d
        kept = d.setdefault("tiers", {}).setdefault(tier, _counts()).setdefault("rows", [])
        kept.append(round(hits / tried, 4))
        del kept[:-ROWS_KEPT]

    def tier_rows(self, pair: str | None = None) -> dict[str, list[float]]:
        """Each tier's ended rows' own acceptance, sorted, where ROWS_TIERED of them were kept: one row's drafts are
        taken far more often than another's (a row that repeats its prompt), and a job's last row is its slowest."""
        tiers = self.counts(pair).get("tiers", {})
        return {name: sorted(d["rows"]) for name, d in tiers.items() if len(d.get("rows", ())) >= ROWS_TIERED}

    def counts(self, pair: str | None = None) -> dict:
        """Drafts accepted and tried: prompt lookup's (None), or the draft model `pair`'s; "tiers": the same by tier."""
        return self.draft_counts if pair is None else self.pairs.get(pair, _counts())

    def acceptance_of(self, pair: str | None = None) -> float | None:
        """Per-draft acceptance as passes measured it (`counts`): accepted over tried; None before any draft."""
        d = self.counts(pair)
        return d["accepted"] / d["tried"] if d["tried"] > 0 else None

    def tier_acceptance(self, pair: str | None = None) -> dict[str, float]:
        """Each prompt-length tier's own acceptance (`acceptance_of`'s, by tier), where TIERED drafts were tried in it."""
        tiers = self.counts(pair).get("tiers", {})
        return {name: d["accepted"] / d["tried"] for name, d in tiers.items() if d["count"] >= TIERED and d["tried"] > 0}

    @property
    def acceptance(self) -> float | None:
        """This model's acceptance of prompt lookup's drafts."""
        return self.acceptance_of(None)

    def save(self) -> None:
        path = store_path(self.key)
        path.parent.mkdir(parents=True, exist_ok=True)
        data = {"key": self.key, "format": FORMAT, "model_name": self.name, "seen": self.seen,
                "prior": self.prior.to_dict(), "fitted": self.model.to_dict(), "passes": [asdict(p) for p in self.passes],
                "sample": [asdict(p) for p in self.sample], "drafts": self.draft_counts, "pairs": self.pairs,
                "staged": self.staged}
        with replaced(path) as tmp:
            tmp.write_text(json.dumps(data))

    @classmethod
    def load(cls, k: str) -> "Calibration | None":
        """The stored calibration of exactly this key, or None (missing, unreadable, another key or format)."""
        try:
            data = json.loads(store_path(k).read_text())
            if data.get("key") != k or data.get("format", 1) != FORMAT:
                return None
            return cls(k, PassModel(**data["prior"]), [Observation(**p) for p in data["passes"]],
                       int(data.get("seen", 0)), data.get("model_name", ""),
                       [Observation(**p) for p in data.get("sample", [])], draft_counts=_draft_counts(data.get("drafts")),
                       pairs={k: c for k, v in (data.get("pairs") or {}).items() if (c := _draft_counts(v))},
                       staged=data.get("staged"))
        except (OSError, ValueError, TypeError, KeyError):
            return None


def _counts() -> dict:
    return {"accepted": 0.0, "tried": 0.0, "count": 0}


def _add(d: dict, hits: np.ndarray, tried: np.ndarray) -> None:
    """A pass's drafts accepted and tried (per row) into the counts `d`, its earlier ones decayed."""
    d["accepted"] = ACCEPTANCE_DECAY * d["accepted"] + float(hits.sum())
    d["tried"] = ACCEPTANCE_DECAY * d["tried"] + float(tried.sum())
    d["count"] += int(tried.sum())


def _draft_counts(d, tiered: bool = True) -> dict | None:
    """The stored acceptance counts, checked (None: none stored, or not numbers), with each tier's where stored."""
    try:
        out = {"accepted": float(d["accepted"]), "tried": float(d["tried"]), "count": int(d["count"])}
    except (TypeError, KeyError, ValueError):
        return None
    tiers = d.get("tiers") if tiered else None
    if isinstance(tiers, dict):
        out["tiers"] = {str(k): c for k, v in tiers.items() if (c := _draft_counts(v, False))}
    elif isinstance(rows := d.get("rows"), list):   # a tier's rows' own acceptance (`observe_row`)
        out["rows"] = [float(x) for x in rows if isinstance(x, (int, float)) and 0 <= x <= 1][-ROWS_KEPT:]
    return out


def open_calibration(folder: str | Path, dtype=None, kv: tuple | None = None, rows: int = 0) -> Calibration:
    """The calibration of this model on this machine, probing and storing it at first use.
    `dtype` is the compute dtype (default: the streamer's for this device); `kv`: (bits, group size) of quantized
    decode KV, whose attention runs other kernels at another cost: a calibration of its own; `rows`: the batch
    the job's budget runs, whose decode passes the pass probe times (`widen`) where no pass was near as wide."""
    from spill.streamer.plan import load_plan
    plan = load_plan(folder)
    k = _key_of(folder, plan, dtype, kv)
    cal = Calibration.load(k)
    if cal is None:   # the probes compute: MLX is loaded here alone (the lengths child, a benchmark)
        import mlx.core as mx
        dtype = dtype or default_dtype()
        prior, passes = compute_probe(plan, dtype or mx.bfloat16, kv), []
        try:
            passes = pass_probe(folder, dtype, kv, rows or PROBE_ROWS)
            prior = priced_by_passes(prior, passes)
        except Exception:   # a model the streamer cannot run: the layer probe's figures stay
            pass
        mx.clear_cache()   # the probes' freed buffers: not kept for the life of the process that probed
        prior.bandwidth = read_probe(weight_files(folder))
        # reads inside passes run slower than alone (they share the cores with the layers' math);
        # a pass of under 256 MiB times its calls, not the disk
        inside = read_rate(((p.bytes_streamed, p.read_s, p.compute_s) for p in passes), least=1 << 28)
        if inside:
            prior.bandwidth = min(prior.bandwidth, inside)
        # the probe's decode passes stay among the older ones: its widest batch beside a job's narrower
        cal = Calibration(k, prior, name=Path(folder).name, sample=passes[1:])
        cal.save()
    elif rows:
        widen(cal, folder, dtype, kv, rows)
    cal.streamed_bytes = plan.streamed_bytes
    return cal


def widest(cal: Calibration) -> int:
    """The most rows a decode pass the calibration holds ran (the probe's among them)."""
    return max((p.decode_rows for p in cal.passes + cal.sample), default=0)


def widen(cal: Calibration, folder, dtype, kv: tuple | None, rows: int) -> None:
    """Where the job's batch (`rows`, as the probe runs it) is past WIDER x the widest decode pass seen, the pass
    probe's decode passes at that batch join the older passes and the model is refitted: a line fitted at up to 21
    rows priced 8-bit KV's 72-row job 1.22x its time."""
    batch = probe_batch(rows)
    if batch <= PROBE_ROWS or batch <= WIDER * widest(cal):
        return
    try:
        import mlx.core as mx
        passes = pass_probe(folder, dtype or default_dtype(), kv, batch)
        mx.clear_cache()
    except Exception:   # a model the streamer cannot run: the calibration stays as it was
        return
    cal.prior = priced_by_passes(cal.prior, passes)   # what a first use at this batch would have priced
    cal.sample = (cal.sample + passes[1:])[-SAMPLE:]   # not its prefill: one such pass outweighed a warm-up's prompts
    cal.model = fit(cal.prior, cal.passes, cal.sample)
    cal.save()


def stored_calibration(folder: str | Path, kv: tuple | None = None) -> Calibration | None:
    """The calibration of this model on this machine (at this KV format) if one was made; never probes."""
    return Calibration.load(_key_of(folder, _plan_of(folder), None, kv))


def _plan_of(folder):
    from spill.streamer.plan import load_plan
    return load_plan(folder)


def _key_of(folder, plan, dtype, kv: tuple | None = None) -> str:
    """The key for computing in `dtype` (an MLX dtype), else in the streamer's default for this device, with
    quantized KV's bits and group size (unquantized: the dtype alone)."""
    if dtype is not None:
        name = str(dtype).replace("mlx.core.", "")
    else:
        name = "float32" if on_cpu() else f"stored-{_stored_dtype(plan)}"
    return key(folder, name + (f"-kv{kv[0]}g{kv[1]}" if kv else ""))


class Calibrator:
    """The admission actor's hook: opens the model's calibration on a reset, refits and stores it
    after every pass. A calibration that cannot be made is logged and skipped, never fatal."""

    def __init__(self, log):
        self.log = log
        self.model, self.kv = "", None
        self.cal: Calibration | None = None
        self.streamed = 0                      # bytes a pass streams
        self.pair: str | None = None           # the job's draft model's model_key (--draft); None: prompt lookup
        self.drafter = None                    # what its steps cost a pass (drafter.DraftCost), as the estimate stored it
        self.hop = None                        # a pipeline's hop price (schedule.hop_for), set with the epoch's budget

    def reset(self, model: str, resident: bool = False, kv: tuple | None = None, draft: str = "") -> None:
        """A new epoch; `resident`: passes read nothing, so no read time bounds a pass's prefill; `kv`: the job's
        quantized KV format (its own calibration), None: unquantized; `draft`: the draft model's folder (--draft):
        its passes teach the pair's acceptance, not the model's pass model (their time holds the draft model's)."""
        self.pair, self.drafter = None, None
        if draft:
            from .drafter import stored_drafter
            try:
                self.pair, self.drafter = model_key(draft), stored_drafter(draft)
            except OSError as err:   # the streamer fails the job with its sentence
                self.log.warning("draft_model", draft=draft, error=str(err))
        if model and (model, kv) != (self.model, self.kv):
            self.model, self.kv, self.cal = model, kv, None
            try:   # stored by the job's estimate before the job starts: admission never probes (nor loads MLX)
                self.cal = stored_calibration(model, kv)
                if self.cal is None:
                    self.log.warning("no calibration stored: the pace runs without a pass model", model=model)
                else:
                    self.cal.streamed_bytes = _plan_of(model).streamed_bytes
                    self.log.info("calibration", key=self.cal.key, passes=self.cal.seen, **self.cal.model.to_dict())
            except Exception as err:   # the streamer reports a model that cannot load; here it only costs the pace
                self.log.warning("calibration_failed", model=model, error=str(err))
        if model:
            self.streamed = 0 if resident or self.cal is None else self.cal.streamed_bytes

    def probe_bandwidth(self) -> float:
        """The cold read probe's bytes/s for this model and machine, 0.0 without a calibration."""
        return self.cal.prior.bandwidth if self.cal is not None else 0.0

    def pace(self, rows: int, context: int, need: int, offset: float = 0.0, most: int | None = None,
             empty: float = 0.0) -> int:
        """Prompt tokens the next pass may prefill in all (schedule.pace, the scheduler's `pace`): `rows` decoding
        with `context` tokens of KV, `need` what keeps the slots fed, `most` what the budget priced."""
        return pace(self.cal.model if self.cal else None, self.streamed, rows, context, need, offset, most, empty)

    def starting_rates(self, prompts) -> list[float]:
        """A new row's acceptance, before its own drafts, for each of `prompts` (prompt tokens): its tier's own (the
        pair's with a draft model), else drafts.PRIOR, not the model's: that was measured on other kinds of rows."""
        return drafts.starting(self.cal.tier_acceptance(self.pair) if self.cal is not None else {}, prompts)

    def priors(self, policy):
        """The scheduler's `priors` (decode rows -> their acceptance before their drafts) for the rows of `policy`."""
        return lambda rows: self.starting_rates([len(policy.running[r].prompt) for r in rows])

    def observe(self, shape, msg, prompts: dict | None = None, ended=()) -> None:
        """A pass as it was planned (`shape`: the rows that decoded in it and their context) and as it ran (`msg`);
        `prompts`: {row: prompt tokens} of the rows that drafted, whose tiers their acceptance counts in; `ended`: the
        rows it ended that drafted and ran their whole max_tokens, (prompt tokens, accepted, tried) over each one's life
        (`Scheduler.reported`)."""
        if self.cal is not None and self.pair is not None:   # a draft model's passes hold its time: its acceptance alone
            self.cal.observe_drafts(msg.drafted, msg.accepted, self.pair, prompts)
            self._rows(ended)
            self.cal.save()
        elif self.cal is not None:   # a resident pass reads nothing, yet prices compute and overhead
            self.cal.observe(Observation(shape.decode_rows, msg.prefill_tokens, shape.context_tokens,
                                         msg.bytes_streamed, msg.seconds, msg.wait_s, msg.compute_s, msg.read_s,
                                         prefill_groups=msg.prefill_groups, prefill_context=msg.prefill_context,
                                         columns=shape.columns))
            self.cal.observe_drafts(msg.drafted, msg.accepted, prompts=prompts)
            self._rows(ended)
            self.cal.save()

    def _rows(self, ended) -> None:
        """Ended rows that tried ROW_TRIED drafts over their lives, each kept in its tier's spread."""
        for tokens, hits, tried in ended:
            if tried >= ROW_TRIED:
                self.cal.observe_row(tier_of(tokens), hits, tried, self.pair)

    def observe_pipeline(self, shape, msg, stages: int, micro_batches: int, replicas: bool = False) -> None:
        """A resident pipeline's pass that read nothing (rank 0's report; its stages' shares, `msg.rounds` rounds, its
        hops priced by `self.hop`; or `replicas`' shares of the rows): its seconds against the stage model's price from
        this model's pass model, which it does not refit."""
        if self.cal is None or msg.bytes_streamed or msg.seconds <= 0:
            return
        priced = (replica_seconds(self.cal.model, shape, stages) if replicas else
                  pass_seconds(self.cal.model, shape, stages, micro_batches, msg.rounds, self.hop))
        if priced > 0:
            self.cal.observe_staged(stages, msg.seconds / priced, replicas)
            self.cal.save()
