"""The mailboxes: every message an actor is sent reaches it."""

from spill import messages as m
from spill.wire import Endpoints, Mailbox

HANG_MS = 120_000   # a message not there by then is lost; a busy machine may take seconds to deliver one

SENT = {   # what each actor sends to another in a job (messages.Kind says who sends what)
    ("coordinator", "streamer"): [m.Reset(0, "model", "job")],
    ("admission", "streamer"): [m.Plan(0, [1], b"\x01\0\0\0", [1], [4], m.Sampling.of([m.RowSampling()]), drop=[2],
                                       widths=[256], groups=[1], chunks=[[1, 1]], pools=[[1, 256]])],
    ("tokenizer", "admission"): [m.Stop(0, [1])],
}


def test_every_message_an_actor_is_sent_reaches_its_inbox(tmp_path):
    for n, ((sender, to), msgs) in enumerate(SENT.items()):
        ends = Endpoints.in_dir(tmp_path / str(n))   # its own sockets: a closed one's file may be unlinked late
        box = Mailbox(ends, sender, (to,))
        inbox = Mailbox(ends, to, ())
        try:
            for msg in msgs:
                box.send(to, msg)
                assert type(inbox.recv(timeout_ms=HANG_MS)) is type(msg), f"{sender} -> {to}: {type(msg).__name__}"
        finally:
            box.close()
            inbox.close()
