"""The wire format and the epoch gate."""

import copy
import math

import msgpack
import pytest

from spill import messages as m
from spill import typed
from spill.actor import EpochGate


def _plan(**kw) -> m.Plan:
    tokens, lengths = m.pack_tokens([[1, 2, 3], [], [70000]])
    fields = dict(epoch=1, rows=[0, 1, 2], tokens=tokens, lengths=lengths, max_tokens=[4] * 3,
                  sampling=m.Sampling.of([m.RowSampling(0.7, 0.9, 40, 7), m.RowSampling(), m.RowSampling(seed=2)]),
                  eos=[2], widths=[256, 256, 1280], groups=[1, 1, 2], chunks=[[1, 64], [2, 8]], drop=[5], finish=[6],
                  pools=[[12, 256], [3, 1280]])
    return m.Plan(**{**fields, **kw})


CHAT = m.RowRequest("chat", 8, messages=[{"role": "user", "content": "hi"}],
                    sampling=m.RowSampling(0.7, 1.0, 0, 12), stop=["\n"])
SAMPLES = [m.Ready("streamer", 12), m.Heartbeat("admission", 3, 9, True), m.Reset(3, "/models/x", "job"),
           m.Submit(1, [0, 1], [CHAT, m.RowRequest("completion", 4, prompt="once")]),
           m.Tokenized(1, [0, 1, 2], _plan().tokens, _plan().lengths, [4, 4, 4], _plan().sampling, [2]), _plan(),
           m.Tokens(1, 5, [0], b"\x01\x00\x00\x00", ["length"], [3]), m.Stop(1, [0]), m.Ended(1, [3]),
           m.Pass(1, 5, 1.5, 0.1, 1.2, 8, 32, 8, [0], 10, 20, 30, cgroup_usage=-4), m.Done(1, [0], ["hi"], ["stop"], [3], [1]),
           m.Error(1, [m.MODEL_ROW], ["code"], ["why"]), m.Budget(1, 5, 2**34, 2**33, 2**33 + 1, 2**33 + 2, 10, 3, 1, 5e9, "j"),
           m.Progress(1, [0], [2], ["..."]), m.Shutdown("down"),
           m.Ping("token"), m.SubmitJob("demo", "/in.jsonl", None, 16, 0.5, None, True, True, 2**30, 0.5, "4242",
                        kv_bits=8, kv_group_size=32),
           m.Status("j", "4242"), m.Interrupt(), m.Cancel("j"), m.Down(),
           m.Refused("no"), m.Pong(7), m.Queued("j", 3, 1, 1, "/out.jsonl", 0, None, "metrics on :9100", "queued"),
           m.JobStatus("j", "running", 1, 3, slots=[m.Slot("a", 2, "x")], ahead=[m.Ahead("k", 0, 4)],
                       processes={"streamer": 9}, memory={"working_set": 2**34, "source": "cgroup"},
                       summary={"finish_reasons": {"stop": 1}}),
           m.Stopped("j", "running", 1, 3), m.Stopping([m.Stopped("j", "queued", 0, 3)])]


def test_every_message_kind_round_trips_through_msgpack():
    assert {type(msg) for msg in SAMPLES} == set(m._TYPES.values())
    for msg in SAMPLES:
        data = m.encode(msg)
        assert data[0] == m._KINDS[type(msg)]
        assert m.decode(data) == msg
    assert m.unpack_tokens(_plan().tokens, _plan().lengths) == [[1, 2, 3], [], [70000]]


def _leaves(value, path=()):
    """(path, value) of every leaf of a decoded msgpack body: map keys and list indices."""
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else None
    if items is None:
        yield path, value
    for key, inner in items or ():
        yield from _leaves(inner, (*path, key))


def _with(body, path, value):
    body = copy.deepcopy(body)
    inner = body
    for step in path[:-1]:
        inner = inner[step]
    inner[path[-1]] = value
    return body


FIGURES = ("summary", "estimate")   # JobStatus's figure maps: shown to the user, their values not checked


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda msg: type(msg).__name__)
def test_a_wrong_type_or_an_out_of_range_number_anywhere_in_a_message_is_refused_naming_that_field(msg):
    name, body = type(msg).__name__, msgpack.unpackb(m.encode(msg)[1:])
    for path, value in _leaves(body):
        if name == "JobStatus" and path[0] in FIGURES:
            continue
        where = name + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path)
        wrong = [[[True]]] + ([2**64 - 1] if type(value) is int and path[0] != "memory" else
                              [math.inf] if type(value) is float else [])
        for bad in wrong:
            with pytest.raises(m.BadMessage) as err:
                m.decode(bytes([m._KINDS[type(msg)]]) + msgpack.packb(_with(body, path, bad)))
            said = str(err.value)   # names the field, or the item within it where None was in its place
            assert said.startswith(where) and said[len(where)] in ":[", (where, bad, said)


def test_the_gate_drops_old_epochs_and_holds_early_ones_until_their_reset():
    gate = EpochGate()
    early = m.Stop(2, [7])
    assert gate(early) == []
    assert gate(m.Reset(1)) == [m.Reset(1)]
    assert gate(m.Stop(1, [1])) == [m.Stop(1, [1])]
    assert gate(m.Reset(2)) == [m.Reset(2), early]
    assert gate(m.Stop(1, [1])) == []


def _frame(msg, **fields) -> bytes:
    """msg's frame with some of its fields (nested ones by dotted name) replaced."""
    body = msgpack.unpackb(m.encode(msg)[1:])
    for name, value in fields.items():
        *path, last = name.split("__")
        inner = body
        for step in path:
            inner = inner[int(step)] if step.isdigit() else inner[step]
        inner[last] = value
    return bytes([m._KINDS[type(msg)]]) + msgpack.packb(body)


STOP = m.Stop(1, [0])
INT31 = 2**31 - 1
BIG = 2**63 - 1


@pytest.mark.parametrize("frame,why", [
    (b"", "unknown message kind (empty frame)"),
    (b"\x63" + msgpack.packb({}), "unknown message kind 63"),
    (bytes([m.Kind.STOP]) + b"\xc1garbage", "Stop: not msgpack (FormatError)"),
    (bytes([m.Kind.STOP]) + msgpack.packb([1, 2]), "Stop: expected a map of Stop's fields, found [1, 2]"),
    (bytes([m.Kind.STOP]) + msgpack.packb({"epoch": 1}), "Stop: field rows is missing"),
    (_frame(STOP, epoch="1"), f"Stop.epoch: expected an int from 0 to {INT31}, found '1'"),
    (_frame(STOP, epoch=-3), f"Stop.epoch: expected an int from 0 to {INT31}, found -3"),
    (_frame(STOP, rows=[0, 2**40]), f"Stop.rows[1]: expected an int from -1 to {INT31}, found 1099511627776"),
    (_frame(STOP, rows=[True]), f"Stop.rows[0]: expected an int from -1 to {INT31}, found True"),
    (_frame(m.Done(1, [1, 2], ["a", "b"], ["stop"] * 2, [1] * 2, [1] * 2), texts=["a"]), "Done: texts has 1 items for 2 rows"),
    (_frame(m.Done(1, [1], ["a"], ["stop"], [1], [1]), finish=["eos"]), "Done.finish[0]: expected one of 'stop', 'length', found 'eos'"),
    (_frame(m.Tokens(1, 0, [1], b"\x01\0\0\0", [""], [0]), tokens=b"\x01"), "Tokens: tokens has 1 bytes for 1 int32 (rows)"),
    (_frame(_plan(), tokens=b""), "Plan: tokens has 0 bytes for 4 int32 (the sum of lengths)"),
    (_frame(_plan(), sampling__seed=[7, None, -1]),
     f"Plan.sampling.seed[2]: expected an int from 0 to {BIG} or None, found -1"),
    (_frame(_plan(), sampling__temperature=[0.7, 0.0, 2.5]),
     "Plan.sampling.temperature[2]: expected a finite number from 0.0 to 2.0, found 2.5"),
    (_frame(_plan(), sampling__top_k=[40, 0]), "Plan.sampling: top_k has 2 items for 3 temperature"),
    (_frame(_plan(), sampling=[[0.5, 1.0, 0, 1]] * 3), "Plan.sampling: expected a map of Sampling's fields, found [[0.5, 1.0, 0, 1], [0.5, 1.0, 0, 1], ..."),
    (_frame(_plan(), pools=[[-1, 256]]), f"Plan.pools[0][0]: expected an int from 0 to {INT31}, found -1"),
    (_frame(_plan(), pools=[[4, 256, 9]]), "Plan.pools[0]: expected a list of 2, found [4, 256, 9]"),
    (_frame(_plan(), drop=[-5]), f"Plan.drop[0]: expected an int from -1 to {INT31}, found -5"),
    (_frame(_plan(), widths=[256]), "Plan: widths has 1 items for 3 rows"),
    (_frame(_plan(), max_tokens=[4, 0, 4]), f"Plan.max_tokens[1]: expected an int from 1 to {INT31}, found 0"),
    (_frame(m.Pass(1, 0, 1.0, 0.0, 1.0, 1, 1, 1, [], 1, 1, 1), seconds=float("nan")),
     "Pass.seconds: expected a finite number, found nan"),
    (_frame(m.Budget(1, 0, 1, 1, 1, 1, 0, 0, 0), budget=-1), f"Budget.budget: expected an int from 0 to {BIG}, found -1"),
    (_frame(m.Submit(1, [0], [CHAT]), requests__0__max_tokens=2**31),
     f"Submit.requests[0].max_tokens: expected an int from 1 to {INT31}, found 2147483648"),
    (_frame(m.Submit(1, [0], [CHAT]), requests__0__sampling__top_p=1.5),
     "Submit.requests[0].sampling.top_p: expected a finite number from 0.0 to 1.0, found 1.5"),
    (_frame(m.Submit(1, [0], [CHAT]), requests__0__messages=[{"role": "user", "content": None}]),
     "Submit.requests[0].messages[0].content: expected a string, found None"),
    (_frame(m.Submit(1, [0], [CHAT]), requests__0__kind="edit"),
     "Submit.requests[0].kind: expected one of 'chat', 'completion', found 'edit'"),
    (_frame(m.Submit(1, [0], [CHAT]), requests__0__stop="\n"), "Submit.requests[0].stop: expected a list, found '\\n'"),
    (_frame(m.SubmitJob("demo", "in.jsonl"), max_tokens=0),
     f"SubmitJob.max_tokens: expected an int from 1 to {INT31} or None, found 0"),
    (_frame(m.SubmitJob("demo", "in.jsonl"), budget_fraction=1.5),
     "SubmitJob.budget_fraction: expected a finite number from 0.0 to 1.0 or None, found 1.5"),
    (_frame(m.Status("j"), job=5), "Status.job: expected a string or None, found 5"),
    (bytes([m.Kind.CANCEL]) + msgpack.packb({}), "Cancel: field job is missing"),
    (_frame(m.Stopping([m.Stopped("j", "running", 1, 3)]), stopped__0__done=-1),
     f"Stopping.stopped[0].done: expected an int from 0 to {INT31} or None, found -1"),
    (_frame(m.JobStatus("j", slots=[m.Slot("a", 2, "x")]), slots__0__tokens="2"),
     f"JobStatus.slots[0].tokens: expected an int from 0 to {INT31}, found '2'"),
    (_frame(m.JobStatus("j"), processes={"streamer": "9"}),
     f"JobStatus.processes.streamer: expected an int from 0 to {INT31}, found '9'"),
], ids=lambda x: "" if isinstance(x, bytes) else x[:40])
def test_a_wrong_type_or_range_in_any_field_is_refused_at_the_boundary_naming_it(frame, why):
    """A decoded message trusted its contents: a bad row crashed a process three hops away."""
    with pytest.raises(m.BadMessage) as err:
        m.decode(frame)
    assert str(err.value) == why


def test_a_submit_must_carry_what_the_tokenizer_reads():
    with pytest.raises(m.BadMessage, match=r"^Submit.requests\[0\]: kind 'chat' without its messages$"):
        m.decode(m.encode(m.Submit(1, [0], [m.RowRequest("chat", 4, prompt="x")])))
    with pytest.raises(m.BadMessage, match=r"^Submit.requests\[0\]: kind 'completion' without its prompt$"):
        m.decode(m.encode(m.Submit(1, [0], [m.RowRequest("completion", 4, messages=[])])))


def test_every_field_of_every_message_declares_a_type_the_checker_knows():
    for cls in m._TYPES.values():
        typed._converter.cache_clear()
        typed._converter(cls)   # TypeError for a field type with no wire rule
