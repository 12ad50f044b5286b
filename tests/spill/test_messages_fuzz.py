"""Fuzzing the wire decoder: any frame is a checked message or BadMessage, never another exception."""

from dataclasses import fields

import msgpack
from hypothesis import given, settings
from hypothesis import strategies as st

from spill import config, messages as m

FUZZ = settings(max_examples=config.test_fuzz_examples() * 3, deadline=None)
values = st.recursive(st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats() | st.text(max_size=8)
                      | st.binary(max_size=8), lambda kids: st.lists(kids, max_size=3)
                      | st.dictionaries(st.text(max_size=6), kids, max_size=3), max_leaves=8)


def _decoded_or_refused(frame: bytes) -> None:
    try:
        msg = m.decode(frame)
    except m.BadMessage as err:
        assert str(err) and "\n" not in str(err)
        return
    assert m.decode(m.encode(msg)) == msg      # what passes the checks is a message that round-trips


@FUZZ
@given(st.binary(max_size=200))
def test_random_bytes(frame):
    _decoded_or_refused(frame)


@FUZZ
@given(kind=st.sampled_from(list(m.Kind)), data=st.data())
def test_every_kind_with_random_field_values(kind, data):
    cls = m._TYPES[kind]
    names = [f.name for f in fields(cls)]
    body = data.draw(st.fixed_dictionaries({}, optional={n: values for n in names}))
    _decoded_or_refused(bytes([kind]) + msgpack.packb(body, use_bin_type=True))
