"""Fuzzing the batch reader and its validators (hypothesis): never a crash, each bad line one exact error
line, no good row lost, and every row that reads as good fits the wire (issue 8)."""

import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from spill import config, messages as m
from spill.coordinator.batch_input import BadRow, _show, read_batch
from spill.coordinator.batch_output import bad_row_line, encode
from spill.coordinator.jobrun import row_request, row_seeds

EXAMPLES = config.test_fuzz_examples()   # CI: bounded; by hand: SPILL_TEST_FUZZ_EXAMPLES=5000
FUZZ = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                             HealthCheck.function_scoped_fixture])
json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
                           lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=8), kids, max_size=4),
                           max_leaves=12)
numbers = st.integers(min_value=-2**70, max_value=2**70) | st.floats() | st.sampled_from([0, 1, -1, 2**31, 2**63, 2**64])
FIELDS = ("seed", "max_tokens", "top_k", "top_p", "temperature", "n", "stop", "max_completion_tokens")


def good_row(i: int, extra: dict) -> bytes:
    row = {"custom_id": f"ok{i}", "prompt": f"question {i}", **extra}
    return json.dumps(row).encode()


garbage = st.one_of(
    st.binary(max_size=60),                                                     # bytes, invalid UTF-8, NUL
    st.builds(lambda v: json.dumps(v).encode(), json_values),                   # JSON of any shape
    st.builds(lambda k, v: json.dumps({"custom_id": "bad" + str(k), "prompt": "x", "seed": v}, allow_nan=True).encode(),
              st.integers(0, 10**6), numbers),
    st.builds(lambda d: b'{"custom_id": "deep", "prompt": ' + b"[" * d + b"]" * d + b"}", st.integers(900, 50_000)),
    st.builds(lambda t: ('{"custom_id": "t", "prompt": "' + t + '"').encode("utf-8", "surrogatepass"), st.text(max_size=20)),
)


@FUZZ
@given(goods=st.lists(st.dictionaries(st.sampled_from(["temperature", "top_p", "seed", "max_tokens", "stop"]),
                                      st.none(), max_size=2), min_size=1, max_size=8),
       bads=st.lists(garbage, max_size=6), seps=st.lists(st.sampled_from([b"\n", b"\r\n", b"\n\n", b"\n\xef\xbb\xbf"]),
                                                        min_size=20, max_size=20), data=st.data())
def test_good_rows_survive_any_garbage_between_them(tmp_path_factory, goods, bads, seps, data):
    lines = [good_row(i, extra) for i, extra in enumerate(goods)]
    for bad in bads[:len(goods) - 1]:          # fewer bad lines than good: the file is still a batch
        lines.insert(data.draw(st.integers(0, len(lines))), bad)
    path = tmp_path_factory.mktemp("fuzz") / "in.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + b"".join(line + seps[i % len(seps)] for i, line in enumerate(lines)))
    try:
        requests, bad = read_batch(path)
    except Exception as err:                   # only a whole-file verdict, never a crash
        from spill.errors import SpillError
        assert isinstance(err, SpillError) and "duplicate custom_id" in str(err), err
        return
    assert {r.custom_id for r in requests} >= {f"ok{i}" for i in range(len(goods))}
    for b in bad:
        assert isinstance(b, BadRow) and b.message.startswith(f"line {b.line}: ") and "\n" not in b.message
        json.loads(encode(bad_row_line(b)))    # the error line is valid JSON
    assert len({r.line for r in requests} | {b.line for b in bad}) == len(requests) + len(bad)
    seeds = row_seeds("job", requests)
    reqs = [row_request(r, {"max_tokens": 16}, r.seed if r.seed is not None else s) for r, s in zip(requests, seeds)]
    assert m.decode(m.encode(m.Submit(1, list(range(len(reqs))), reqs))).requests == reqs   # fits the wire


@FUZZ
@given(field=st.sampled_from(FIELDS), value=numbers | json_values)
def test_each_sampling_field_is_in_range_or_an_exact_error(tmp_path_factory, field, value):
    path = tmp_path_factory.mktemp("field") / "in.jsonl"
    path.write_text(json.dumps({"custom_id": "a", "prompt": "x"}) + "\n" +
                    json.dumps({"custom_id": "b", "prompt": "x", field: value}) + "\n")
    requests, bad = read_batch(path)
    if bad:
        (b,) = bad
        assert b.message.startswith("line 2: ") and _show(value) in b.message, b.message
        return
    r = requests[-1]
    ranges = {"seed": (0, 2**63 - 1), "max_tokens": (1, 2**31 - 1), "max_completion_tokens": (1, 2**31 - 1),
              "top_k": (1, 2**31 - 1), "top_p": (0, 1), "temperature": (0, 2)}
    got = {"max_completion_tokens": r.max_tokens}.get(field, getattr(r, field, None))
    if field in ranges and got is not None:
        assert ranges[field][0] <= got <= ranges[field][1]
