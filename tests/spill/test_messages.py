"""The wire format and the epoch gate."""

from spill import messages as m
from spill.actor import EpochGate


def test_every_message_round_trips_through_msgpack():
    tokens, lengths = m.pack_tokens([[1, 2, 3], [], [70000]])
    samples = [m.Ready("streamer", 12), m.Reset(3, "/models/x", "job"), m.Submit(1, [0, 1], [{"kind": "chat"}] * 2),
               m.Tokenized(1, [0, 1, 2], tokens, lengths, [4, 4, 4], [[0.0, 1.0, 0, None]] * 3, [2]),
               m.Admit(1, [0], tokens, lengths, [4], [[0.7, 0.9, 40, 7]], [2]),
               m.Tokens(1, 5, [0], b"\x01\x00\x00\x00", ["length"]), m.Stop(1, [0]),
               m.Pass(1, 5, 1.5, 0.1, 1.2, 8, 32, 8, [0], 10, 20, 30), m.Done(1, [0], ["hi"], ["stop"], [3], [1]),
               m.Error(1, [2], ["code"], ["why"]), m.Progress(1, [0], [2], ["..."]), m.Shutdown("down"),
               m.Request("status", {"job": "j"}), m.Reply(False, {}, "no")]
    for msg in samples:
        data = m.encode(msg)
        assert data[0] == m._KINDS[type(msg)]
        assert m.decode(data) == msg
    assert m.unpack_tokens(tokens, lengths) == [[1, 2, 3], [], [70000]]


def test_the_gate_drops_old_epochs_and_holds_early_ones_until_their_reset():
    gate = EpochGate()
    early = m.Stop(2, [7])
    assert gate(early) == []
    assert gate(m.Reset(1)) == [m.Reset(1)]
    assert gate(m.Stop(1, [1])) == [m.Stop(1, [1])]
    assert gate(m.Reset(2)) == [m.Reset(2), early]
    assert gate(m.Stop(1, [1])) == []
