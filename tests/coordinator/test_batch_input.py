"""Reading a batch file: the rows a user's JSONL becomes, and the exact error for each mistake."""

import json

import pytest

from spill.coordinator.batch_input import BadRow, Request, read_batch
from spill.errors import SpillError

CHAT = "/v1/chat/completions"
USER = [{"role": "user", "content": "Hi"}]


def _file(tmp_path, *lines, name="in.jsonl"):
    path = tmp_path / name
    path.write_bytes(b"".join((x if isinstance(x, bytes) else
                               (x if isinstance(x, str) else json.dumps(x)).encode()) + b"\n" for x in lines))
    return path


def _batch(cid, body, url=CHAT, method="POST"):
    return {"custom_id": cid, "method": method, "url": url, "body": body}


def _bad(tmp_path, row) -> BadRow:
    """The one BadRow a file of a good line and `row` (line 2) gives."""
    requests, bad = read_batch(_file(tmp_path, {"custom_id": "ok", "prompt": "x"}, row))
    assert [r.custom_id for r in requests] == ["ok"] and len(bad) == 1
    return bad[0]


def _refused(path) -> str:
    with pytest.raises(SpillError) as err:
        read_batch(path)
    return str(err.value)


def test_batch_api_lines_become_requests(tmp_path):
    requests, bad = read_batch(_file(
        tmp_path,
        _batch("c", {"model": "ignored", "messages": USER, "max_tokens": 64, "temperature": 0, "top_p": 0.9,
                     "top_k": 40, "seed": 7, "stop": "\n\n", "n": 1}),
        _batch("p", {"prompt": "Once", "max_completion_tokens": 8, "stop": ["a", "b"], "top_k": 0},
               url="/v1/completions")))
    assert bad == []
    assert requests == [
        Request(line=1, custom_id="c", kind="chat", messages=USER, prompt=None, max_tokens=64, temperature=0.0,
                top_p=0.9, top_k=40, seed=7, stop=["\n\n"]),
        Request(line=2, custom_id="p", kind="completion", messages=None, prompt="Once", max_tokens=8,
                temperature=None, top_p=None, top_k=None, seed=None, stop=["a", "b"])]


def test_plain_forms_with_crlf_bom_and_blank_lines(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"custom_id": "a", "prompt": "Hello", "max_tokens": 5}\r\n\r\n   \r\n'
                     b'{"custom_id": "b", "messages": [{"role": "system", "content": "Be brief."}, '
                     b'{"role": "user", "content": [{"type": "text", "text": "Caf\xc3\xa9"}, '
                     b'{"type": "text", "text": "?"}]}],'
                     b' "temperature": 1}\r\n')
    requests, bad = read_batch(path)
    assert bad == []
    assert [(r.line, r.custom_id, r.kind, r.prompt, r.max_tokens, r.temperature) for r in requests] == [
        (1, "a", "completion", "Hello", 5, None), (4, "b", "chat", None, None, 1.0)]
    assert requests[1].messages == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Café?"}]
    assert requests[0].stop == [] and requests[1].stop == []


def test_nulls_mean_not_given(tmp_path):
    (r,), _ = read_batch(_file(tmp_path, {"custom_id": "a", "prompt": "x", "max_tokens": None, "stop": None,
                                          "temperature": None, "n": None, "seed": None}))
    assert (r.max_tokens, r.temperature, r.seed, r.stop) == (None, None, None, [])


@pytest.mark.parametrize("row, code, message", [
    ({"prompt": "x"}, "invalid_request", "line 2: custom_id is missing"),
    ({"custom_id": 7, "prompt": "x"}, "invalid_request", "line 2: custom_id must be a non-empty string, found 7"),
    ({"custom_id": "r", "prompt": "x", "messages": USER}, "invalid_request",
     "line 2: has both messages and prompt; keep one"),
    ({"custom_id": "r", "text": "x"}, "invalid_request",
     'line 2: needs "messages" (a chat) or "prompt" (a completion)'),
    (_batch("r", {"messages": USER}, url="/v1/embeddings"), "invalid_request",
     'line 2: url must be "/v1/chat/completions" or "/v1/completions", found "/v1/embeddings"'),
    (_batch("r", {"messages": USER}, url=["/v1/completions"]), "invalid_request",
     'line 2: url must be "/v1/chat/completions" or "/v1/completions", found ["/v1/completions"]'),
    (_batch("r", {"messages": USER}, method="GET"), "invalid_request", 'line 2: method must be "POST", found "GET"'),
    ({"custom_id": "r", "url": CHAT, "body": "hi"}, "invalid_request",
     'line 2: body must be a JSON object with messages or prompt, found "hi"'),
    (_batch("r", {"max_tokens": 5}), "invalid_request", "line 2: body.messages is missing"),
    (_batch("r", {"prompt": "x"}), "invalid_request",
     "line 2: body.messages is missing (url /v1/chat/completions takes messages; for prompt use /v1/completions)"),
    (_batch("r", {"messages": USER}, url="/v1/completions"), "invalid_request",
     "line 2: body.prompt is missing (url /v1/completions takes prompt; for messages use /v1/chat/completions)"),
    (_batch("r", {"messages": []}), "invalid_request",
     "line 2: body.messages must be a non-empty list of {role, content} objects, found []"),
    (_batch("r", {"messages": "Hi"}), "invalid_request",
     'line 2: body.messages must be a non-empty list of {role, content} objects, found "Hi"'),
    (_batch("r", {"messages": ["Hi"]}), "invalid_request",
     'line 2: body.messages[0] must be an object with role and content, found "Hi"'),
    (_batch("r", {"messages": [{"role": "tool", "content": "x"}]}), "invalid_request",
     'line 2: body.messages[0].role must be "system", "user" or "assistant", found "tool"'),
    ({"custom_id": "r", "messages": [{"role": "user"}]}, "invalid_request", "line 2: messages[0].content is missing"),
    ({"custom_id": "r", "messages": [{"role": "user", "content": 5}]}, "invalid_request",
     "line 2: messages[0].content must be a string, found 5"),
    ({"custom_id": "r", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "invalid_request",
     "line 2: messages[0].content has parts of type image_url; spill runs text only, send text parts or a string"),
    ({"custom_id": "r", "prompt": ["a", "b"]}, "invalid_request", 'line 2: prompt must be a string, found ["a", "b"]'),
    ({"custom_id": "r", "prompt": "x", "max_tokens": 0}, "invalid_request",
     "line 2: max_tokens must be an integer from 1 to 2147483647, found 0"),
    ({"custom_id": "r", "prompt": "x", "max_tokens": 16.5}, "invalid_request",
     "line 2: max_tokens must be an integer from 1 to 2147483647, found 16.5"),
    (_batch("r", {"messages": USER, "max_completion_tokens": "many"}), "invalid_request",
     'line 2: body.max_completion_tokens must be an integer from 1 to 2147483647, found "many"'),
    (_batch("r", {"messages": USER, "max_tokens": 5, "max_completion_tokens": 6}), "invalid_request",
     "line 2: body.max_tokens and body.max_completion_tokens differ (5 and 6); keep one"),
    ({"custom_id": "r", "prompt": "x", "temperature": 2.5}, "invalid_request",
     "line 2: temperature must be a number from 0 to 2, found 2.5"),
    ({"custom_id": "r", "prompt": "x", "temperature": True}, "invalid_request",
     "line 2: temperature must be a number from 0 to 2, found true"),
    ({"custom_id": "r", "prompt": "x", "top_p": 0}, "invalid_request",
     "line 2: top_p must be a number above 0 and at most 1, found 0"),
    ({"custom_id": "r", "prompt": "x", "top_k": -5}, "invalid_request",
     "line 2: top_k must be an integer from 1 to 2147483647 (0 or -1: no top-k), found -5"),
    ({"custom_id": "r", "prompt": "x", "seed": "42"}, "invalid_request", 'line 2: seed must be an integer from 0 to 9223372036854775807, found "42"'),
    ({"custom_id": "r", "prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, "invalid_request",
     "line 2: stop must be a non-empty string or a list of at most 4 non-empty strings, "
     'found ["a", "b", "c", "d", "e"]'),
    ({"custom_id": "r", "prompt": "x", "stop": [1]}, "invalid_request",
     "line 2: stop must be a non-empty string or a list of at most 4 non-empty strings, found [1]"),
    (_batch("r", {"messages": USER, "n": 3}), "invalid_request",
     "line 2: body.n must be 1 (spill makes one completion per row; repeat the row under other custom_ids for more), "
     "found 3"),
    ('{"custom_id": "r", "prompt": "x",}', "invalid_json",
     "line 2: not valid JSON (Expecting property name enclosed in double quotes at column 34); "
     "write one JSON object per line"),
    (b'{"custom_id": "r", "prompt": "caf\xe9"}', "invalid_utf8",
     "line 2: not valid UTF-8 (byte 0xe9 at byte 34); save the file as UTF-8"),
    ("[1, 2]", "invalid_json", "line 2: expected a JSON object, found [1, 2]; write one JSON object per line"),
])
def test_a_bad_row_names_its_line_reason_and_fix(tmp_path, row, code, message):
    bad = _bad(tmp_path, row)
    assert (bad.line, bad.code, bad.message) == (2, code, message)


def test_a_bad_row_keeps_its_custom_id_when_it_can(tmp_path):
    assert _bad(tmp_path, {"custom_id": "r", "prompt": 3}).custom_id == "r"
    assert _bad(tmp_path, '{"custom_id": "r\\"1", "prompt": "x",}').custom_id == 'r"1'   # salvaged from broken JSON
    assert _bad(tmp_path, {"custom_id": 7, "prompt": "x"}).custom_id is None


def test_every_reason_of_a_row_is_named(tmp_path):
    bad = _bad(tmp_path, _batch("r", {"messages": [], "temperature": -1, "stop": ""}))
    assert bad.message == ("line 2: body.messages must be a non-empty list of {role, content} objects, found []; "
                           "body.temperature must be a number from 0 to 2, found -1; "
                           'body.stop must be a non-empty string or a list of at most 4 non-empty strings, found ""')


def test_duplicate_custom_ids_refuse_the_file_naming_every_line(tmp_path):
    rows = [{"custom_id": c, "prompt": "x"} for c in ["q0", "q1", "q2", "q1", "q2", "q2", "q3", "q2"]]
    path = _file(tmp_path, *rows[:2], "", *rows[2:], '{"custom_id": "q3", broken')   # blank line 3; line 10 not JSON
    assert _refused(path) == (f"{path}: duplicate custom_id at lines 2 and 5 ('q1'); "
                              f"duplicate custom_id at lines 4, 6-7 and 9 ('q2'); "
                              f"duplicate custom_id at lines 8 and 10 ('q3'); give each row its own custom_id")


def test_a_missing_or_empty_file_is_refused(tmp_path):
    assert _refused(tmp_path / "nope.jsonl") == f"input file {tmp_path / 'nope.jsonl'} not found; check the path"
    path = _file(tmp_path, "", "  ", name="empty.jsonl")
    assert _refused(path) == (f'{path} is empty; write one JSON request per line, '
                              f'e.g. {{"custom_id": "q1", "prompt": "Hello"}}')
    (tmp_path / "empty2.jsonl").write_bytes(b"\xef\xbb\xbf")
    assert "is empty" in _refused(tmp_path / "empty2.jsonl")


def test_a_json_array_or_document_is_not_jsonl(tmp_path):
    path = tmp_path / "in.json"
    path.write_text(json.dumps([{"custom_id": "a", "prompt": "x"}, {"custom_id": "b", "prompt": "y"}], indent=2))
    assert _refused(path) == (f"{path} is one JSON array, not JSONL (one JSON object per line); "
                              f"convert it with: jq -c '.[]' {path} > {tmp_path / 'in.jsonl'}")
    path = _file(tmp_path, json.dumps([{"custom_id": "a", "prompt": "x"}]))   # an array on one line
    assert _refused(path) == (f"{path} is one JSON array, not JSONL (one JSON object per line); "
                              f"convert it with: jq -c '.[]' {path} > {tmp_path / 'in-lines.jsonl'}")
    path.write_text(json.dumps({"custom_id": "a", "prompt": "x"}, indent=2))
    assert _refused(path) == (f"{path} is one JSON document over 4 lines, not JSONL (one JSON object per line); "
                              f"put each request on its own line, e.g. jq -c . {path} > {tmp_path / 'in-lines.jsonl'}")


def test_mostly_non_json_lines_is_not_jsonl(tmp_path):
    path = _file(tmp_path, "custom_id,prompt", "q1,Hello", {"custom_id": "q2", "prompt": "x"}, "q3,Bye", name="in.csv")
    assert _refused(path) == (f"{path} is not JSONL: expected one JSON object per line, but 3 of 4 non-blank lines "
                              f"are not (lines 1-2, 4); line 1 starts 'custom_id,prompt'")
    half = _file(tmp_path, "oops", {"custom_id": "q2", "prompt": "x"})   # half is not more than half: a bad row
    assert [b.line for b in read_batch(half)[1]] == [1]


def test_encodings_spill_cannot_read_are_named(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_bytes('{"custom_id": "a", "prompt": "x"}\n'.encode("utf-16"))
    assert _refused(path) == (f"{path} is UTF-16 text; save it as UTF-8 "
                              f"(iconv -f UTF-16 -t UTF-8 {path} > in-utf8.jsonl)")
    path.write_bytes(b"\x1f\x8b\x08\x00")
    assert _refused(path) == f"{path} is gzip-compressed; decompress it first (gunzip -k {path})"


@pytest.mark.parametrize("field,value,expect", [
    ("seed", -1, "an integer from 0 to 9223372036854775807"),
    ("seed", 10**20, "an integer from 0 to 9223372036854775807"),
    ("max_tokens", 10**20, "an integer from 1 to 2147483647"),
    ("top_k", 2**31, "an integer from 1 to 2147483647 (0 or -1: no top-k)"),
])
def test_numbers_out_of_range_are_bad_rows_not_crashes(tmp_path, field, value, expect):
    """A seed of -1 crash-looped the streamer; 10**20 overflowed msgpack in the coordinator (issue 8, finding 2)."""
    bad = _bad(tmp_path, {"custom_id": "r", "prompt": "x", field: value})
    assert bad.message == f"line 2: {field} must be {expect}, found {value}"


@pytest.mark.parametrize("text,expect", [
    ('{"custom_id": "r", "prompt": "x", "temperature": NaN}', "line 2: temperature must be a number from 0 to 2, found NaN"),
    ('{"custom_id": "r", "prompt": "x", "top_p": Infinity}', "line 2: top_p must be a number above 0 and at most 1, found Infinity"),
    ('{"custom_id": "r", "prompt": "x", "n": 100000000000000000000}', "line 2: n must be 1 (spill makes one completion per row; "
     "repeat the row under other custom_ids for more), found 100000000000000000000"),
    ('{"custom_id": "r", "prompt": ' + "[" * 100_000 + "]" * 100_000 + "}",
     "line 2: JSON nested too deeply to read; flatten the request"),
], ids=["nan", "infinity", "huge-n", "deep"])
def test_non_finite_huge_and_deeply_nested_values_are_bad_rows(tmp_path, text, expect):
    assert _bad(tmp_path, text).message == expect


def test_a_line_over_the_size_limit_is_a_bad_row(tmp_path, monkeypatch):
    from spill.coordinator import batch_input
    monkeypatch.setattr(batch_input, "MAX_LINE", 1 << 20, raising=False)
    row = {"custom_id": "r", "prompt": "x" * (1 << 20)}
    bad = _bad(tmp_path, row)
    assert bad.message == f"line 2: {len(json.dumps(row))} bytes, more than the 1 MB a line may hold; shorten the prompt"


def test_a_file_with_no_row_spill_can_run_is_refused_naming_the_first_problem(tmp_path):
    path = _file(tmp_path, {"question_id": 81, "turns": ["Hi"]}, {"question_id": 82, "turns": ["Bye"]})
    assert _refused(path) == (f'no line of {path} is a request spill can run (2 lines; the first: line 1: custom_id is '
                              f'missing; needs "messages" (a chat) or "prompt" (a completion)); write one request '
                              f'per line, e.g. {{"custom_id": "q1", "prompt": "Hello"}} or the OpenAI Batch form '
                              f'{{"custom_id": "q1", "url": "/v1/chat/completions", "body": {{"messages": [{{"role": "user", '
                              f'"content": "Hello"}}]}}}}')
    one_good = _file(tmp_path, {"question_id": 81}, {"custom_id": "q2", "prompt": "x"}, name="one.jsonl")
    assert [r.custom_id for r in read_batch(one_good)[0]] == ["q2"]   # one runnable row: a job, its bad rows as errors


def test_the_forms_the_refusal_suggests_are_requests(tmp_path):
    example = _refused(_file(tmp_path, {"question_id": 81}))
    forms = example.split("e.g. ")[1].split(" or the OpenAI Batch form ")
    for n, form in enumerate(forms):
        requests, bad = read_batch(_file(tmp_path, form, name=f"form{n}.jsonl"))
        assert [r.custom_id for r in requests] == ["q1"] and not bad, form
