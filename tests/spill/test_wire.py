"""The mailboxes: every message an actor is sent reaches it."""

from spill import messages as m
from spill.wire import Endpoints, Mailbox

SENT = {   # what each actor sends to another in a job (messages.Kind says who sends what)
    ("coordinator", "streamer"): [m.Reset(0, "model", "job")],
    ("admission", "streamer"): [m.Plan(0, [1], b"\x01\0\0\0", [1], [4], m.Sampling.of([m.RowSampling()]), drop=[2],
                                       widths=[256], groups=[1], chunks=[[1, 1]], pools=[[1, 256]])],
    ("tokenizer", "admission"): [m.Stop(0, [1])],
}


def test_every_message_an_actor_is_sent_reaches_its_inbox(tmp_path):
    ends = Endpoints.in_dir(tmp_path)
    for (sender, to), msgs in SENT.items():
        box = Mailbox(ends, sender, (to,))
        inbox = Mailbox(ends, to, ())   # bound after the sender's own inbox, which may be the last test's address
        try:
            for msg in msgs:
                box.send(to, msg)
                assert type(inbox.recv(timeout_ms=5000)) is type(msg), f"{sender} -> {to}: {type(msg).__name__}"
        finally:
            box.close()
            inbox.close()
