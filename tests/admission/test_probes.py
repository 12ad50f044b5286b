"""The pass probe (probes.py) against a streamer whose first pass of each kind pays a cold start."""

from types import SimpleNamespace

import pytest

from spill.admission import probes
from spill.streamer import core

COLD, WARM = 10.0, 0.01   # a kernel's first use (on CUDA, compiled then) against its later ones


class ColdStartStreamer:
    """Rows prefill in the pass after they are added, then decode once a pass until max_tokens; each kind's first
    pass costs COLD seconds of compute, later ones WARM. `ran`: (rows prefilled, rows decoded) of each pass."""
    ran: list = []

    def __init__(self, folder, *, dtype=None, prefill_chunk=512, kv_bits=None, kv_group_size=64):
        self.new, self.live, self.seen = [], {}, set()
        ColdStartStreamer.ran = []

    def add(self, row):
        self.new.append(row)

    def reserve(self, pools):
        self.reserved = pools

    def step(self):
        prefill, decode = self.new, list(self.live.values())
        self.new = []
        for r in prefill:
            self.live[r.id] = [r, 0]
        for entry in self.live.values():
            entry[1] += 1
        self.live = {k: e for k, e in self.live.items() if e[1] < e[0].max_tokens}
        self.ran.append((len(prefill), len(decode)))
        kind = "prefill" if prefill else "decode"
        compute = WARM if kind in self.seen else COLD
        self.seen.add(kind)
        return SimpleNamespace(prefill_tokens=sum(len(r.prompt) for r in prefill), bytes_streamed=1, seconds=compute,
                               wait_s=0.0, compute_s=compute, read_s=0.0, prefill_groups=1 if prefill else 0,
                               prefill_context=sum(len(r.prompt) ** 2 for r in prefill))

    def close(self):
        pass


def test_the_pass_probe_times_a_prefill_that_is_not_the_first(monkeypatch, tmp_path, on_device):
    """On a fresh H200 the probe's prefill pass, the process's first, priced a prompt token at 0.044 s
    against 0.00044 once MLX's kernels were compiled: the estimate said 13 minutes for a 2.5-minute job."""
    monkeypatch.setattr(core, "Streamer", ColdStartStreamer)
    on_device("gpu-Fake CUDA")
    prefill, many, one = probes.pass_probe(tmp_path, None)
    n = probes.PROBE_ROWS   # the warm-up's rows end with their pass: the decode passes are the probe's rows alone
    assert ColdStartStreamer.ran == [(n, 0), (n, 0), (0, n), (0, n), (0, 1)]
    assert prefill.prefill_tokens == n * 16 and prefill.compute_s == WARM
    assert (many.decode_rows, many.compute_s) == (n, WARM)
    assert (one.decode_rows, one.compute_s) == (1, WARM)


def test_on_the_cpu_the_probe_spends_no_pass_warming_up_a_prefill(monkeypatch, tmp_path, on_device):
    """A first prefill costs what the next does there (3.82 s and 3.79 s, the factory's small llama, 2 vCPUs)."""
    monkeypatch.setattr(core, "Streamer", ColdStartStreamer)
    on_device("cpu")
    prefill, many, one = probes.pass_probe(tmp_path, None)
    n = probes.PROBE_ROWS
    assert ColdStartStreamer.ran == [(n, 0), (0, n), (0, n), (0, 1)]
    assert prefill.prefill_tokens == n * 16 and (many.decode_rows, one.decode_rows) == (n, 1)


def test_the_probe_decodes_at_the_budgets_batch_then_16_rows_then_one(monkeypatch, tmp_path, on_device):
    """8-bit KV ran lean45's three-tier job at 72 rows a pass, priced from a probe of 16 rows and a warm-up of
    at most 21: the estimate said 1.22x the job. The probe times the batch the budget runs."""
    monkeypatch.setattr(core, "Streamer", ColdStartStreamer)
    on_device("cpu")
    prefill, *decodes = probes.pass_probe(tmp_path, None, rows=72)
    assert ColdStartStreamer.ran == [(72, 0)] + [(0, 72)] * 4 + [(0, 16), (0, 1)]
    assert prefill.prefill_tokens == 72 * 16
    assert [(p.decode_rows, p.context_tokens) for p in decodes] == [(72, 72 * 18), (72, 72 * 19), (72, 72 * 20),
                                                                    (16, 16 * 21), (1, 22)]
    assert probes.probe_batch(5000) == probes.PROBE_MOST and probes.probe_batch(3) == probes.PROBE_ROWS


def curve(rows: int, context: int) -> float:
    """A decode pass with a large fixed part: the weights' trip, their packing for a product of 2 rows or more,
    rows dear up to 16 and cheap past them, attention per key."""
    return 0.67 + 0.1 * (rows > 1) + 0.0185 * min(rows, 16) + 0.003 * max(rows - 16, 0) + 7e-5 * context


def test_a_pass_model_priced_from_the_probe_prices_the_widest_batch_right():
    from spill.admission.passmodel import Observation, PassModel, PassShape
    passes = [Observation(0, 72 * 16, 0, 1, 9.0, 0.0, 8.9)] + [
        Observation(r, 0, r * 18, 1, curve(r, r * 18), 0.0, curve(r, r * 18)) for r in (72, 16, 1)]
    model = probes.priced_by_passes(PassModel(1e9, per_context_token_s=7e-5), passes)
    for rows in (72, 16, 1):
        shape = PassShape(rows, 0, rows * 500, 1)
        assert model.compute_s(shape) == pytest.approx(curve(rows, rows * 500), rel=0.1)


def test_the_probes_rows_hold_the_pool_admission_would_reserve_for_them(make_tiny, monkeypatch):
    """An unreserved pool takes twice its rows' slots, 256 tokens each: at 64 rows of the `tall` model the probe held
    3.3 GB of KV, 9x what the job's budget priced, and was OOM-killed under a 1 GiB cap."""
    class Watched(core.Streamer):
        shapes: list = []

        def step(self, *a, **kw):
            report = super().step(*a, **kw)
            Watched.shapes += [(p.slots, p.width) for p in self.pools.values()]
            return report
    monkeypatch.setattr(core, "Streamer", Watched)
    probes.pass_probe(make_tiny("llama"), None, rows=40)
    assert Watched.shapes and all(slots <= 40 and width <= 32 for slots, width in Watched.shapes), Watched.shapes
