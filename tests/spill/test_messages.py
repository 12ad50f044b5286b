"""The wire format and the epoch gate."""

from dataclasses import asdict

import msgpack
import pytest

from spill import messages as m
from spill.actor import EpochGate


def test_every_message_round_trips_through_msgpack():
    tokens, lengths = m.pack_tokens([[1, 2, 3], [], [70000]])
    request = {"kind": "chat", "messages": [{"role": "user", "content": "hi"}], "prompt": None, "max_tokens": 8,
               "temperature": 0.7, "top_p": None, "top_k": None, "seed": 12, "stop": ["\n"]}
    samples = [m.Ready("streamer", 12), m.Reset(3, "/models/x", "job"), m.Submit(1, [0, 1], [request] * 2),
               m.Tokenized(1, [0, 1, 2], tokens, lengths, [4, 4, 4], [[0.0, 1.0, 0, None]] * 3, [2]),
               m.Plan(1, [0, 1, 2], tokens, lengths, [4] * 3, [[0.7, 0.9, 40, 7]] * 3, [2], widths=[256, 256, 1280],
                      groups=[1, 1, 2], chunks=[[1, 64], [2, 8]], drop=[5], finish=[6], pools=[[12, 256], [3, 1280]]),
               m.Tokens(1, 5, [0], b"\x01\x00\x00\x00", ["length"], [3]), m.Stop(1, [0]),
               m.Pass(1, 5, 1.5, 0.1, 1.2, 8, 32, 8, [0], 10, 20, 30), m.Done(1, [0], ["hi"], ["stop"], [3], [1]),
               m.Error(1, [2], ["code"], ["why"]), m.Budget(1, 5, 2**34, 2**33, 2**33 + 1, 2**33 + 2, 10, 3, 1, 5e9, "j"), m.Progress(1, [0], [2], ["..."]), m.Shutdown("down"),
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


@pytest.mark.parametrize("frame,why", [
    (b"", "unknown message kind (empty frame)"),
    (b"\x63" + msgpack.packb({}), "unknown message kind 63"),
    (bytes([m.Kind.STOP]) + b"\xc1garbage", "Stop: not msgpack (FormatError)"),
    (bytes([m.Kind.STOP]) + msgpack.packb([1, 2]), "Stop: expected a map of fields, found list"),
    (bytes([m.Kind.STOP]) + msgpack.packb({"epoch": 1}), "Stop: field rows is missing"),
    (bytes([m.Kind.STOP]) + msgpack.packb({"epoch": "1", "rows": []}), "Stop.epoch: expected int, found '1'"),
    (bytes([m.Kind.STOP]) + msgpack.packb({"epoch": -3, "rows": []}), "Stop.epoch: expected int, found -3"),
    (bytes([m.Kind.STOP]) + msgpack.packb({"epoch": 1, "rows": [2**40]}), "Stop.rows: expected int, found 1099511627776"),
    (bytes([m.Kind.STOP]) + msgpack.packb({"epoch": 1, "rows": [True]}), "Stop.rows: expected int, found True"),
    (bytes([m.Kind.DONE]) + msgpack.packb({"epoch": 1, "rows": [1, 2], "texts": ["a"], "finish": ["stop"],
                                           "prompt_tokens": [1], "completion_tokens": [1]}),
     "Done: rows, texts, finish, prompt_tokens, completion_tokens differ in length"),
    (bytes([m.Kind.TOKENS]) + msgpack.packb({"epoch": 1, "pass_index": 0, "rows": [1], "tokens": b"\x01", "finish": [""],
                                             "positions": [0]}),
     "Tokens: 1 token bytes for 1 rows"),
    (bytes([m.Kind.PLAN]) + msgpack.packb({"epoch": 1, "rows": [0], "tokens": b"\x01\0\0\0", "lengths": [1],
                                            "max_tokens": [4], "sampling": [[0.5, 1.0, 0, -1]], "widths": [256],
                                           "groups": [1]}),
     "Plan.sampling.seed: expected int | None, found int"),
    (bytes([m.Kind.PLAN]) + msgpack.packb({**asdict(m.Plan(1, [0], b"\x01\0\0\0", [1], [4], [[0.5, 1.0, 0, 1]])),
                                           "widths": [256], "groups": [1], "pools": [[-1, 256]]}), "Plan.pools: expected int, found -1"),
    (bytes([m.Kind.PLAN]) + msgpack.packb({**asdict(m.Plan(1, [], b"", [], [], [])), "pools": [[4, 256, 9]]}),
     "Plan.pools: expected pairs, found [[4, 256, 9]]"),
    (bytes([m.Kind.PLAN]) + msgpack.packb({**asdict(m.Plan(1, [], b"", [], [], [])), "drop": [-5]}),
     "Plan.drop: expected int, found -5"),
    (bytes([m.Kind.PLAN]) + msgpack.packb({**asdict(m.Plan(1, [0], b"\x01\0\0\0", [1], [4], [[0.5, 1.0, 0, 1]]))}),
     "Plan: rows, lengths, max_tokens, sampling, widths, groups differ in length"),
    (bytes([m.Kind.PASS]) + msgpack.packb({**asdict(m.Pass(1, 0, 1.0, 0.0, 1.0, 1, 1, 1, [], 1, 1, 1)),
                                           "seconds": float("nan")}), "Pass.seconds: expected float, found nan"),
    (bytes([m.Kind.BUDGET]) + msgpack.packb({**asdict(m.Budget(1, 0, 1, 1, 1, 1, 0, 0, 0)), "budget": -1}),
     "Budget.budget: expected int, found -1"),
], ids=lambda x: "" if isinstance(x, bytes) else x[:30])
def test_a_bad_frame_is_refused_at_the_boundary_with_one_sentence(frame, why):
    """Issue 8, finding 4: decoded messages trusted their contents (a bad row crashed a process three hops away)."""
    with pytest.raises(m.BadMessage) as err:
        m.decode(frame)
    assert str(err.value) == why


def test_a_submit_must_carry_what_the_tokenizer_reads():
    bad = {"kind": "chat", "messages": None, "prompt": None, "max_tokens": 4, "temperature": None, "top_p": None,
           "top_k": None, "seed": None, "stop": []}
    with pytest.raises(m.BadMessage, match="kind 'chat' without its messages or prompt"):
        m.decode(m.encode(m.Submit(1, [0], [bad])))
    with pytest.raises(m.BadMessage, match="Submit.requests.seed"):
        m.decode(m.encode(m.Submit(1, [0], [{**bad, "prompt": "x", "kind": "completion", "seed": 2**63}])))
