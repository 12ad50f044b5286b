"""Output lines in the OpenAI Batch output shape.

    {"id": "batch_req_<hex>", "custom_id": "q1",
     "response": {"status_code": 200, "request_id": "<hex>",
                  "body": {"id": "chatcmpl-<hex>", "object": "chat.completion", "created": 1735689600, "model": "...",
                           "choices": [{"index": 0, "message": {"role": "assistant", "content": "..."},
                                        "finish_reason": "stop", "logprobs": null}],
                           "usage": {"prompt_tokens": 12, "completion_tokens": 5, "total_tokens": 17}}},
     "error": null}
An error line has "response": null and "error": {"code": "...", "message": "..."}.
"""

from __future__ import annotations

import json
import time
import uuid

FINISH_REASONS = ("stop", "length")


def success_line(custom_id: str, *, kind: str, model: str, text: str, finish_reason: str,
                 prompt_tokens: int, completion_tokens: int, created: int | None = None) -> dict:
    """One finished row; kind "chat" gives a chat.completion body, "completion" a text_completion body."""
    if finish_reason not in FINISH_REASONS:
        raise ValueError(f"finish_reason must be one of {FINISH_REASONS}, got {finish_reason!r}")
    if kind == "chat":
        prefix, obj = "chatcmpl-", "chat.completion"
        choice = {"index": 0, "message": {"role": "assistant", "content": text},
                  "finish_reason": finish_reason, "logprobs": None}
    elif kind == "completion":
        prefix, obj = "cmpl-", "text_completion"
        choice = {"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": None}
    else:
        raise ValueError(f'kind must be "chat" or "completion", got {kind!r}')
    body = {"id": prefix + _hex(), "object": obj, "created": int(time.time()) if created is None else created,
            "model": model, "choices": [choice],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens}}
    return {"id": "batch_req_" + _hex(), "custom_id": custom_id,
            "response": {"status_code": 200, "request_id": _hex(), "body": body}, "error": None}


def error_line(custom_id: str | None, *, code: str, message: str) -> dict:
    """One row that could not run (a BadRow, a prompt too long for the model, ...)."""
    return {"id": "batch_req_" + _hex(), "custom_id": custom_id, "response": None,
            "error": {"code": code, "message": message}}


def bad_row_line(bad) -> dict:
    """error_line for a batch_input.BadRow."""
    return error_line(bad.custom_id, code=bad.code, message=bad.message)


def encode(line: dict) -> bytes:
    """One JSONL line: compact, UTF-8 as is (no \\u escapes unless a lone surrogate needs one), newline-terminated."""
    try:
        return json.dumps(line, ensure_ascii=False, separators=(",", ":")).encode("utf-8") + b"\n"
    except UnicodeEncodeError:
        return json.dumps(line, separators=(",", ":")).encode("ascii") + b"\n"


def _hex() -> str:
    return uuid.uuid4().hex
