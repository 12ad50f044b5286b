"""Output lines in the OpenAI Batch output shape, exactly as a user's tooling reads them."""

import json
import re

import pytest

from spill.coordinator.batch_input import BadRow
from spill.coordinator.batch_output import bad_row_line, encode, error_line, success_line

HEX = re.compile(r"[0-9a-f]{32}")


def test_chat_success_line():
    line = success_line("q1", kind="chat", model="llama3.3:70b", text="Paris.", finish_reason="stop",
                        prompt_tokens=12, completion_tokens=3, created=1735689600)
    assert re.fullmatch(r"batch_req_[0-9a-f]{32}", line["id"])
    assert HEX.fullmatch(line["response"]["request_id"])
    body = line["response"]["body"]
    assert re.fullmatch(r"chatcmpl-[0-9a-f]{32}", body["id"])
    assert line == {
        "id": line["id"], "custom_id": "q1", "error": None,
        "response": {"status_code": 200, "request_id": line["response"]["request_id"], "body": {
            "id": body["id"], "object": "chat.completion", "created": 1735689600, "model": "llama3.3:70b",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "Paris."},
                         "finish_reason": "stop", "logprobs": None}],
            "usage": {"prompt_tokens": 12, "completion_tokens": 3, "total_tokens": 15}}}}


def test_completion_success_line():
    line = success_line("q2", kind="completion", model="m", text=" upon a time", finish_reason="length",
                        prompt_tokens=1, completion_tokens=4)
    body = line["response"]["body"]
    assert re.fullmatch(r"cmpl-[0-9a-f]{32}", body["id"])
    assert body["object"] == "text_completion" and isinstance(body["created"], int)
    assert body["choices"] == [{"index": 0, "text": " upon a time", "finish_reason": "length", "logprobs": None}]
    assert body["usage"] == {"prompt_tokens": 1, "completion_tokens": 4, "total_tokens": 5}


def test_ids_are_fresh_per_line():
    a, b = (success_line("q", kind="chat", model="m", text="", finish_reason="stop", prompt_tokens=1,
                         completion_tokens=0) for _ in range(2))
    assert a["id"] != b["id"] and a["response"]["request_id"] != b["response"]["request_id"]


def test_error_lines():
    line = error_line("q3", code="context_length_exceeded", message="line 3: the prompt has 9000 tokens ...")
    assert re.fullmatch(r"batch_req_[0-9a-f]{32}", line["id"])
    assert line == {"id": line["id"], "custom_id": "q3", "response": None,
                    "error": {"code": "context_length_exceeded", "message": "line 3: the prompt has 9000 tokens ..."}}
    bad = bad_row_line(BadRow(line=7, custom_id=None, code="invalid_json", message="line 7: not valid JSON"))
    assert (bad["custom_id"], bad["response"], bad["error"]) == (
        None, None, {"code": "invalid_json", "message": "line 7: not valid JSON"})


def test_wrong_kind_or_finish_reason_is_a_programming_error():
    with pytest.raises(ValueError):
        success_line("q", kind="embedding", model="m", text="", finish_reason="stop", prompt_tokens=1,
                     completion_tokens=0)
    with pytest.raises(ValueError):
        success_line("q", kind="chat", model="m", text="", finish_reason="eos", prompt_tokens=1, completion_tokens=0)


def test_encode_is_one_utf8_line():
    line = error_line("q", code="x", message="naïve\nline")
    raw = encode(line)
    assert raw.endswith(b"\n") and raw.count(b"\n") == 1 and "naïve".encode() in raw
    assert json.loads(raw) == line
    lone = encode(error_line("q", code="x", message="bad \ud800 byte"))   # a lone surrogate is escaped, not a crash
    assert json.loads(lone)["error"]["message"] == "bad \ud800 byte"
