"""The admission actor's process wrapper: what it measures of the machine when it prices a model, what it
tells the coordinator after a pass (its report, no sockets), and its answer to each report (over mailboxes)."""

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import pytest
import structlog

from spill import memory
from spill import messages as m
from spill.admission import process
from spill.admission.calibration import Calibration, Calibrator
from spill.admission.passmodel import PassModel
from spill.admission.policy import BudgetPolicy
from spill.admission.scheduler import Scheduler
from spill.stages.split import stage_plans
from spill.streamer.plan import load_plan
from spill.wire import Endpoints, Mailbox

from .test_policy import MB, rows, sheet


def test_the_other_processes_are_priced_though_their_arguments_name_the_streamer():
    """Every actor's command line carries the endpoints, which name the streamer's socket: only the
    streamer's own process may be left out of the others' resident memory. The group stands in a process of its
    own, so no child of the test's process (a pytest worker's) is counted."""
    endpoints = '{"endpoints": {"streamer": "ipc:///run/streamer.sock"}}'
    group = ("import subprocess, sys, time; sleep = [sys.executable, '-c', 'import time; time.sleep(30)']; "
             f"a = subprocess.Popen([*sleep, {endpoints!r}]); "
             f"b = subprocess.Popen([*sleep, '-m', 'spill.streamer.process', {endpoints!r}]); "   # argv as the streamer's
             "print(a.pid, b.pid, flush=True); time.sleep(30)")
    coordinator = subprocess.Popen([sys.executable, "-c", group], stdout=subprocess.PIPE, text=True)
    sibling, streamer = map(int, coordinator.stdout.readline().split())
    try:
        time.sleep(1.0)
        others = process._others_rss(coordinator.pid)
        ours, theirs = memory.process_memory(coordinator.pid), memory.process_memory(sibling)
        # each process's own pages, and the shared libraries' file pages once (one copy in memory)
        once = ours.rss - ours.file + theirs.rss - theirs.file + max(ours.file, theirs.file)
        assert theirs.file > 2**20 and once - 2**20 <= others < once + 2**20
        assert others < ours.rss + theirs.rss - 2**20
    finally:
        for pid in (sibling, streamer):
            os.kill(pid, signal.SIGKILL)
        coordinator.kill()
        coordinator.wait()


def test_a_resident_reset_prices_every_layer_as_fixed_and_leaves_less_kv(make_tiny):
    folder = str(make_tiny("llama"))
    args, log = {"memory": "2GB"}, structlog.get_logger()
    streamed, _ = process._price(m.Reset(1, folder, "job"), args, None, log)
    resident, _ = process._price(m.Reset(1, folder, "job", resident=True), args, None, log)
    streamed, resident = streamed.policy, resident.policy
    assert resident.sheet.fixed["resident"] == 2 * load_plan(folder).total_bytes   # bf16, computed in float32
    assert resident.sheet.fixed["layers"] == 0 < streamed.sheet.fixed["layers"]
    assert resident.sheet.kv_budget < streamed.sheet.kv_budget


def test_a_resident_pipeline_reset_prices_the_stages_as_the_advisor_split_them(make_tiny):
    """The tiny model's first stage holds 3 layers of 4 split by compute (the tightest stage), 2 split by bytes."""
    folder = str(make_tiny("llama"))
    args, log = {"memory": "2GB"}, structlog.get_logger()
    weights = [process._price(m.Reset(1, folder, "job", resident=True, stages=2, by_compute=c), args, None, log)[0]
               .policy.sheet.fixed["resident"] for c in (False, True)]
    stages = [stage_plans(load_plan(folder), 2, by_compute=c) for c in (False, True)]
    assert weights[0] in [2 * p.total_bytes for p in stages[0]]   # bf16, computed in float32
    assert weights[1] == 2 * stages[1][0].total_bytes > weights[0] and [len(p.layers) for p in stages[1]] == [3, 1]


def test_a_pipeline_reset_prices_each_stage_against_the_memory_its_host_told(make_tiny, monkeypatch):
    """Rank 1 told 1 GB at join: its stage is priced on its own budget, a third of rank 0's, and is the tightest."""
    monkeypatch.setattr(process.memory, "group_rss", lambda parent, runtime: 64 * 2**20)   # one figure, each pricing
    folder, log = str(make_tiny("llama")), structlog.get_logger()
    priced = [process._price(m.Reset(1, folder, "job", stages=2, hosts=hosts), {"memory": "2GB"}, None, log)[0]
              .policy.sheet for hosts in ([], [m.Host(2 * 10**9, 0.78)], [m.Host(10**9, 0.5)])]
    assert priced[0] == priced[1]   # none told, or one as rank 0's: the prices of one host
    assert priced[2].working_set == 10**9 and priced[2].fraction == 0.5 and priced[2].kv_budget < priced[0].kv_budget


def test_a_pipelines_backpressure_weighs_rank_0s_memory_against_its_own_working_set(make_tiny, monkeypatch):
    """Rank 1's smaller host prices the KV; rank 0's report (the memory admission sees) holds at rank 0's share."""
    monkeypatch.setattr(process.memory, "group_rss", lambda parent, runtime: 64 * 2**20)   # not the test runner's
    folder, log = str(make_tiny("llama")), structlog.get_logger()
    tight = process._price(m.Reset(1, folder, "job", stages=2, hosts=[m.Host(5 * 10**8, 0.78)]), {"memory": "2GB"},
                           None, log)[0].policy.sheet
    assert tight.source == "rank 1"   # the tightest though it holds the fewer layers (split over the budgets)
    report = m.Pass(1, 0, 1.0, 0.0, 0.0, 0, 0, 0, [], 10**9, 10**9, 0)   # rank 0 holds 1 GB, half its 2 GB
    assert process._live(report, 0, 0, tight, 2 * 10**9) == 25 * 10**7 < tight.line(tight.guard)   # half rank 1's
    assert process._live(report, 0, 0, tight, 5 * 10**8) == 10**9   # a sheet on rank 0's own working set: as it is


def test_a_follower_past_its_guard_line_holds_admission_for_the_group(make_tiny, monkeypatch):
    """Each follower's process (its figures of a pass) weighs against its own host's working set, rank 0's against its
    own; the fullest sets the group's live memory, so rank 1 at 90% of its host holds admission though rank 0 is not."""
    monkeypatch.setattr(process.memory, "group_rss", lambda parent, runtime: 64 * 2**20)
    folder, log = str(make_tiny("llama")), structlog.get_logger()
    sched = process._price(m.Reset(1, folder, "job", stages=2, hosts=[m.Host(5 * 10**8, 0.78)]), {"memory": "2GB"},
                           None, log)[0]
    tight = sched.policy.sheet
    rank0 = m.StagePass(10**9, 0, 1.0, 0.5, 0.1, rss=10**9)

    def report(rank1: m.StagePass) -> m.Pass:   # rank 0 holds 1 GB, half its 2 GB: a quarter of rank 1's on its scale
        return m.Pass(1, 0, 1.0, 0.0, 0.0, 0, 0, 0, [], 10**9, 10**9, 0, stages=[rank0, rank1])
    calm = report(m.StagePass(10**8, 10**8, 1.0, 0.5, 0.1, rss=2 * 10**8))   # rank 1: 40% of its 0.5 GB
    full = report(m.StagePass(2 * 10**8, 10**8, 1.0, 0.5, 0.1, rss=45 * 10**7))   # 90%
    assert process._live(calm, 0, 0, tight, 2 * 10**9, [5 * 10**8]) == 25 * 10**7
    assert process._live(full, 0, 0, tight, 2 * 10**9, [5 * 10**8]) == 45 * 10**7 >= tight.line(tight.guard)
    sched.policy.observe(process._live(calm, 0, 0, tight, 2 * 10**9, [5 * 10**8]))
    assert not sched.policy.holding
    sched.policy.observe(process._live(full, 0, 0, tight, 2 * 10**9, [5 * 10**8]))
    assert sched.policy.holding


def test_the_streamers_runtime_from_its_ready_is_priced_with_the_others(make_tiny, monkeypatch):
    """The streamer's interpreter and libraries (its RSS at READY, before any model) are memory no KV gets;
    its library pages are counted once with the others' (memory.group_rss, test_memory.py)."""
    monkeypatch.setattr(process.memory, "group_rss", lambda parent, runtime: 50 * 2**20 + runtime[0] - runtime[1])
    sent = []
    box = type("Box", (), {"send": lambda self, peer, msg: sent.append(msg)})()
    log = type("Log", (), {"info": lambda *a, **k: None})()
    reset = m.Reset(1, str(make_tiny("llama")), "job", runtime=120 * 2**20, runtime_file=20 * 2**20)
    sched, others = process._price(reset, {"memory": "2GB"}, box, log)
    assert others == 150 * 2**20 and sched.policy.sheet.fixed["others"] == 150 * 2**20 and not sent


def test_the_report_carries_the_lines_the_hold_and_the_rows_preempted():
    p = BudgetPolicy(sheet(slots_mb=100), max_rows=8)
    sched = Scheduler(p)
    sched.offer(rows(*[40] * 8))
    sched.plan()
    sched.reported([], 500 * MB)
    sched.offer(rows(40, 40, start=8))
    sched.plan()
    sched.reported([], 902 * MB)                             # above the hard line: the next plan drops the 7 newest
    assert len(sched.plan().drop) == 7
    sched.reported([], 790 * MB)                             # under the guard, above it less hysteresis: held
    calibrator = Calibrator(SimpleNamespace(info=print, warning=print))
    calibrator.cal = Calibration("k", PassModel(bandwidth=3.5e9))
    told = m.decode(m.encode(process.report(2, 9, sched, 64 * MB, calibrator, "job1")))
    assert told == m.Budget(2, 9, 1000 * MB, int(0.78 * 1000 * MB), int(0.80 * 1000 * MB), int(0.90 * 1000 * MB),
                            64 * MB, held_rows=9, preempted_rows=7, probe_bandwidth=3.5e9, job="job1", running_rows=1)
    p.observe(700 * MB)                                        # below guard less hysteresis: no hold
    told = process.report(2, 10, sched, 0, Calibrator(None), "job1")
    assert (told.held_rows, told.preempted_rows, told.probe_bandwidth) == (0, 0, 0.0)   # no calibration: no figure


def test_a_plan_names_each_rows_pool_and_group_and_every_pools_shape():
    sched = Scheduler(BudgetPolicy(sheet(slots_mb=20)))
    sched.offer(rows(20, 600, 70, max_tokens=100))           # 120 tokens: width 128; 700: 768; 170: 192
    msg = m.decode(m.encode(process._plan(1, sched.plan(), [2], 0)))
    assert (msg.rows, msg.widths, msg.groups) == ([0, 2, 1], [128, 192, 768], [1, 2, 3])   # by prompt length
    assert sorted(msg.pools, key=lambda s: s[1]) == [[1, 128], [1, 192], [1, 768]]
    assert msg.chunks == [[1, 20], [2, 70], [3, 512]] and msg.index == 0


PRICE_SCRIPT = """
import sys
import pytest
import structlog
from spill import messages as m
from spill.admission import process
from spill.admission.calibration import Calibrator
log = structlog.get_logger()
process._price(m.Reset(1, sys.argv[1], "job"), {"memory": "2GB"}, None, log)
Calibrator(log).reset(sys.argv[1])
print(" ".join(name for name in ("mlx_lm", "transformers") if name in sys.modules) or "none")
"""


def test_pricing_a_model_with_its_calibration_stored_imports_no_mlx_lm(make_tiny, tmp_path, monkeypatch):
    # mlx-lm brings transformers: ~44 MB of the admission actor's RSS, which the budget takes from the KV
    from spill.admission.calibration import open_calibration
    monkeypatch.setenv("SPILL_HOME", str(tmp_path))
    folder = str(make_tiny("llama"))
    open_calibration(folder)   # first use probes (a real layer: mlx-lm); the actor then only loads it
    out = subprocess.run([sys.executable, "-c", PRICE_SCRIPT, folder], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "SPILL_HOME": str(tmp_path)})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-1] == "none"


@contextlib.contextmanager
def actor(tmp_path, args=None):
    """The admission actor's loop on a thread; the streamer's, coordinator's and tokenizer's mailboxes to it."""
    ends = Endpoints.in_dir(tmp_path)
    boxes = [Mailbox(ends, name, ("admission",)) for name in ("streamer", "coordinator", "tokenizer")]
    loop = threading.Thread(target=process.run_admission_process, args=(ends, args or {"memory": "2GB"},
                                                                        structlog.get_logger()), daemon=True)
    loop.start()
    try:
        yield boxes
    finally:
        boxes[1].send("admission", m.Shutdown())
        loop.join(10)
        for box in boxes:
            box.close()


def next_plan(streamer) -> m.Plan:
    while not isinstance(msg := streamer.recv(timeout_ms=60_000), m.Plan):
        assert msg is not None, "admission sent no plan"
    return msg


def test_each_pass_report_is_answered_by_the_next_plan_and_only_one_plan_runs_at_once(make_tiny, tmp_path):
    with actor(tmp_path) as (streamer, coordinator, tokenizer):
        coordinator.send("admission", m.Reset(1, str(make_tiny("llama")), "job"))
        tokenizer.send("admission", m.Tokenized(1, list(range(4)), *m.pack_tokens([[5, 6, 7]] * 4), [8] * 4,
                                                m.Sampling.of([m.RowSampling()] * 4)))
        first = next_plan(streamer)
        assert first.rows == [0, 1, 2, 3] and first.index == 0
        tokenizer.send("admission", m.Tokenized(1, [4, 5], *m.pack_tokens([[1, 2]] * 2), [8] * 2, m.Sampling.of([m.RowSampling()] * 2)))
        assert streamer.recv(timeout_ms=500) is None     # the streamer runs plan 0: nothing more until its report
        tokenizer.send("admission", m.Stop(1, [2]))      # a stop string: the next plan frees its slot
        streamer.send("admission", m.Pass(1, 0, 0.5, 0.1, 0.2, 0, 12, 4, [], 1 << 20, 1 << 20, 1 << 20, "job", plan=0))
        second = next_plan(streamer)
        assert (second.index, second.rows[:1], second.finish) == (1, [4], [2])


@pytest.mark.parametrize("stages,resident,replicas", [(1, False, False), (2, False, False), (2, True, False),
                                                      (2, True, True)])
def test_only_a_one_process_groups_passes_refit_the_pass_model(make_tiny, tmp_path, monkeypatch, stages, resident,
                                                               replicas):
    """A pipeline's pass (its stages' shares of the layers, rounds) is no observation of one process's pass; a
    resident pipeline's passes, and replicas', are priced against the stage model instead (`observe_pipeline`)."""
    seen, piped, hops = [], [], []

    class Watched(process.Calibrator):
        def observe(self, *a, **kw):
            seen.append(a)
            return super().observe(*a, **kw)

        def observe_pipeline(self, shape, msg, n, micro_batches, replicas=False):
            piped.append((n, micro_batches, replicas))
            hops.append(self.hop(64))
    monkeypatch.setattr(process, "Calibrator", Watched)
    with actor(tmp_path) as (streamer, coordinator, tokenizer):
        folder = make_tiny("llama")   # rank 1's link: 1 ms and 1 MB/s
        coordinator.send("admission", m.Reset(1, str(folder), "job", stages=stages, resident=resident,
                                              replicas=replicas, hosts=[m.Host(8 << 30, 0.5, 0.001, 1e6)][:stages - 1]))
        tokenizer.send("admission", m.Tokenized(1, [0, 1], *m.pack_tokens([[5, 6, 7]] * 2), [8] * 2,
                                                m.Sampling.of([m.RowSampling()] * 2)))
        for index in range(2):
            next_plan(streamer)
            streamer.send("admission", m.Pass(1, index, 0.5, 0.1, 0.2, 0, 6 if index == 0 else 0, 2, [], 1 << 20,
                                              1 << 20, 1 << 20, "job", plan=index))
        while not isinstance(msg := coordinator.recv(timeout_ms=60_000), m.Budget) or msg.index < 1:
            assert msg is not None, "admission reported no second pass"
        assert len(seen) == (2 if stages == 1 else 0)
        assert piped == ([(2, 1 if replicas else 2, replicas)] * 2 if resident else [])   # replicas: no micro-batches
        hidden = load_plan(folder).config["hidden_size"]   # 64 tokens' hidden states in float32 over the link
        assert hops == ([pytest.approx(0.001 + 64 * hidden * 4 / 1e6)] * 2 if resident else [])
