"""The streamer's process loop over real mailboxes: its next pass waits a short while for admission's answer
to the last report, so rows admitted after pass k start in pass k+1."""

import threading
import time

import structlog

from spill import messages as m
from spill.streamer import process
from spill.wire import Endpoints, Mailbox

GREEDY = [0.0, 1.0, 0, None]


def _group(tmp_path, folder):
    """The streamer in a thread, one row running in a pool of two slots, with the mailboxes of the actors it
    talks to: (admission, stop)."""
    ends = Endpoints.in_dir(tmp_path)
    coordinator = Mailbox(ends, "coordinator", ("streamer",))
    admission, tokenizer = Mailbox(ends, "admission", ("streamer",)), Mailbox(ends, "tokenizer", ())
    loop = threading.Thread(target=process.run_streamer_process, args=(ends, {}, structlog.get_logger()), daemon=True)
    loop.start()
    coordinator.send("streamer", m.Reset(1, folder, "job"))
    admission.send("streamer", m.Admit(1, [0], *m.pack_tokens([[5, 6, 7]]), [40], [GREEDY], [],
                                               widths=[64], pools=[[2, 64]]))

    def stop():
        coordinator.send("streamer", m.Shutdown())
        loop.join(10)
        for box in (coordinator, admission, tokenizer):
            box.close()
    return admission, stop


def _report(box, index: int) -> m.Pass:
    while True:
        msg = box.recv(timeout_ms=60_000)
        assert msg is not None, f"no report of pass {index}"
        if isinstance(msg, m.Pass) and msg.index == index:
            return msg


def test_rows_admitted_in_answer_to_a_report_start_in_the_next_pass(make_tiny, tmp_path, monkeypatch):
    monkeypatch.setattr(process, "ANSWER_WAIT", (5.0, 5.0))   # however slow this machine answers
    admission, stop = _group(tmp_path, str(make_tiny("llama")))
    try:
        assert _report(admission, 1).prefill_tokens == 3
        time.sleep(0.3)   # admission takes its time: without the wait, pass 2 has long started
        admission.send("streamer", m.Admit(1, [1], *m.pack_tokens([[9, 10]]), [40], [GREEDY], [],
                                                   widths=[64], pools=[[2, 64]]))
        admission.send("streamer", m.Pace(1, 4096, answers=1))
        assert _report(admission, 2).prefill_tokens == 2
    finally:
        stop()


def test_a_report_admission_does_not_answer_holds_the_next_pass_only_a_short_while(make_tiny, tmp_path, monkeypatch):
    monkeypatch.setattr(process, "ANSWER_WAIT", (0.5, 0.5))
    admission, stop = _group(tmp_path, str(make_tiny("llama")))
    try:
        assert _report(admission, 1).prefill_tokens == 3
        started = time.monotonic()
        second = _report(admission, 2)
        assert second.decode_rows == 1 and 0.4 < time.monotonic() - started < 5
    finally:
        stop()

