"""The mailboxes: every message an actor is sent reaches it."""

from spill import messages as m
from spill.wire import Endpoints, Mailbox

SENT = {   # what each actor sends to another in a job (messages.Kind says who sends what)
    ("coordinator", "streamer"): [m.Reset(0, "model", "job")],
    ("tokenizer", "streamer"): [m.Stop(0, [1])],
    ("admission", "streamer"): [m.Preempt(0, [1], [[1, 256]])],
}


def test_every_message_an_actor_is_sent_reaches_its_inbox(tmp_path):
    ends = Endpoints.in_dir(tmp_path)
    inbox = Mailbox(ends, "streamer", ())
    try:
        for (sender, to), msgs in SENT.items():
            box = Mailbox(ends, sender, (to,))
            for msg in msgs:
                box.send(to, msg)
                assert type(inbox.recv(timeout_ms=5000)) is type(msg), f"{sender} -> {to}: {type(msg).__name__}"
            box.close()
    finally:
        inbox.close()
