"""The streamer's process loop over real mailboxes: each PLAN is one pass, reported with the plan's index."""

import threading

import structlog

from spill import messages as m
from spill.streamer import process
from spill.wire import Endpoints, Mailbox

from .test_actor import plan


def test_each_plan_is_one_pass_and_nothing_runs_without_one(make_tiny, tmp_path):
    ends = Endpoints.in_dir(tmp_path)
    coordinator = Mailbox(ends, "coordinator", ("streamer",))
    admission, tokenizer = Mailbox(ends, "admission", ("streamer",)), Mailbox(ends, "tokenizer", ())
    loop = threading.Thread(target=process.run_streamer_process, args=(ends, {}, structlog.get_logger()), daemon=True)
    loop.start()

    def report() -> m.Pass | None:
        while (msg := admission.recv(timeout_ms=60_000)) is not None:
            if isinstance(msg, m.Pass):
                return msg
        return None
    try:
        coordinator.send("streamer", m.Reset(1, str(make_tiny("llama")), "job"))
        admission.send("streamer", plan(0, [0], [[5, 6, 7]], max_tokens=40, widths=[64], chunks=[(1, 3)],
                                        pools=[[2, 64]]))
        first = report()
        assert (first.plan, first.prefill_tokens, first.emitted) == (0, 3, 1)
        assert admission.recv(timeout_ms=1000) is None      # a running row, but no plan: no pass
        admission.send("streamer", plan(1, [1], [[9, 10]], max_tokens=40, widths=[64], groups=[2], chunks=[(2, 2)],
                                        pools=[[2, 64]]))
        second = report()
        assert (second.plan, second.prefill_tokens, second.decode_rows) == (1, 2, 2)   # rows in the pool after it
    finally:
        coordinator.send("streamer", m.Shutdown())
        loop.join(10)
        for box in (coordinator, admission, tokenizer):
            box.close()
