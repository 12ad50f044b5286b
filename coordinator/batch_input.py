"""Read a JSONL batch file into runnable rows and bad rows.

Accepted lines (one JSON object each; CRLF, a UTF-8 BOM and blank lines are fine):
    {"custom_id": "q1", "method": "POST", "url": "/v1/chat/completions", "body": {"messages": [...], "max_tokens": 64}}
    {"custom_id": "q2", "method": "POST", "url": "/v1/completions", "body": {"prompt": "..."}}
    {"custom_id": "q3", "messages": [...], "temperature": 0.7}        # plain forms: params at top level
    {"custom_id": "q4", "prompt": "..."}
A problem with the whole file is one SpillError; a problem with one line is a BadRow (an error line in the output).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from spill.errors import SpillError

URLS = {"/v1/chat/completions": "chat", "/v1/completions": "completion"}
ROLES = ("system", "user", "assistant")
MAX_STOP = 4
MAX_INT = (1 << 31) - 1             # max_tokens and top_k: int32 on the wire
MAX_SEED = (1 << 63) - 1            # seeds: a non-negative int64
MAX_LINE = 16 << 20                 # bytes in one input line
BOM = b"\xef\xbb\xbf"
_MISSING = object()


@dataclass
class Request:
    """One runnable row; sampling fields are None when the line does not set them (use the job default)."""
    line: int
    custom_id: str
    kind: str                       # "chat" (messages) or "completion" (prompt)
    messages: list[dict] | None     # [{"role": "user", "content": "..."}], content always a string
    prompt: str | None
    max_tokens: int | None
    temperature: float | None
    top_p: float | None
    top_k: int | None               # None also when the line asks for no top-k (0 or -1)
    seed: int | None
    stop: list[str]


@dataclass
class BadRow:
    """A line that cannot run; its message names the line, the reason and what to change."""
    line: int
    custom_id: str | None
    code: str                       # "invalid_request" | "invalid_json" | "invalid_utf8"
    message: str


EXAMPLE = '{"custom_id": "q1", "prompt": "Hello"}'
BATCH_EXAMPLE = ('{"custom_id": "q1", "url": "/v1/chat/completions", '
                 '"body": {"messages": [{"role": "user", "content": "Hello"}]}}')


def read_batch(path: Path) -> tuple[list[Request], list[BadRow]]:
    """Parse every line; one SpillError for a file that cannot be a batch (missing, empty, not JSONL, duplicate ids)."""
    path = Path(path)
    data = _read(path)
    parsed = []                     # (line, dict | BadRow) for each non-blank line
    for n, raw in enumerate(data.split(b"\n"), 1):
        raw = raw.removeprefix(BOM)  # at the file start, or where BOM files were concatenated
        if raw.strip():
            parsed.append((n, _parse_line(n, raw)))
    if not parsed:
        raise SpillError(f"{path} is empty; write one JSON request per line, e.g. {EXAMPLE}")
    _check_jsonl(path, data, parsed)
    _check_unique(path, parsed)
    requests, bad = [], []
    for n, obj in parsed:
        row = obj if isinstance(obj, BadRow) else _row(n, obj)
        (bad if isinstance(row, BadRow) else requests).append(row)
    if not requests:   # a job of error lines alone would only hide the one fix they all need
        many = f"{len(bad)} lines; the first: " if len(bad) > 1 else ""
        raise SpillError(f"no line of {path} is a request spill can run ({many}{bad[0].message}); write one request "
                         f"per line, e.g. {EXAMPLE} or the OpenAI Batch form {BATCH_EXAMPLE}")
    return requests, bad


# 1. The file as a whole

def _read(path: Path) -> bytes:
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise SpillError(f"input file {path} not found; check the path") from None
    except IsADirectoryError:
        raise SpillError(f"{path} is a folder; give the path of a .jsonl file") from None
    except OSError as err:
        raise SpillError(f"cannot read {path} ({err.strerror}); check the path and its permissions") from None
    if data[:2] == b"\x1f\x8b":
        raise SpillError(f"{path} is gzip-compressed; decompress it first (gunzip -k {path})")
    if data[:2] in (b"\xff\xfe", b"\xfe\xff"):
        raise SpillError(f"{path} is UTF-16 text; save it as UTF-8 "
                         f"(iconv -f UTF-16 -t UTF-8 {path} > {path.stem}-utf8.jsonl)")
    return data


def _check_jsonl(path: Path, data: bytes, parsed: list) -> None:
    """A JSON array or document, or mostly non-object lines, is not a batch: say so before anything runs."""
    bad = [n for n, obj in parsed if isinstance(obj, BadRow)]
    if not bad:
        return
    try:
        doc = json.loads(data.removeprefix(BOM).decode("utf-8"))
    except (ValueError, RecursionError):
        doc = None
    target = path.with_suffix(".jsonl") if path.suffix != ".jsonl" else path.with_name(path.stem + "-lines.jsonl")
    if isinstance(doc, list):
        raise SpillError(f"{path} is one JSON array, not JSONL (one JSON object per line); "
                         f"convert it with: jq -c '.[]' {path} > {target}")
    if isinstance(doc, dict):
        raise SpillError(f"{path} is one JSON document over {len(parsed)} lines, not JSONL (one JSON object per line); "
                         f"put each request on its own line, e.g. jq -c . {path} > {target}")
    if 2 * len(bad) > len(parsed):
        first = data.split(b"\n")[bad[0] - 1].removeprefix(BOM).decode("utf-8", "replace").strip()
        raise SpillError(f"{path} is not JSONL: expected one JSON object per line, but {len(bad)} of {len(parsed)} "
                         f"non-blank lines are not (lines {_spans(bad, ', ')}); line {bad[0]} starts {_clip(first)!r}")


def _check_unique(path: Path, parsed: list) -> None:
    at: dict[str, list[int]] = {}
    for n, obj in parsed:
        cid = obj.custom_id if isinstance(obj, BadRow) else obj.get("custom_id")
        if isinstance(cid, str) and cid:
            at.setdefault(cid, []).append(n)
    dups = [f"duplicate custom_id at lines {_spans(ns, ' and ')} ({cid!r})" for cid, ns in at.items() if len(ns) > 1]
    if dups:
        raise SpillError(f"{path}: {'; '.join(dups)}; give each row its own custom_id")


# 2. One line

def _parse_line(n: int, raw: bytes) -> dict | BadRow:
    if len(raw) > MAX_LINE:
        return BadRow(n, None, "invalid_request", f"line {n}: {len(raw)} bytes, more than the {MAX_LINE >> 20} MB "
                                                  "a line may hold; shorten the prompt")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        return BadRow(n, _salvage_id(raw.decode("utf-8", "replace")), "invalid_utf8",
                      f"line {n}: not valid UTF-8 (byte 0x{raw[err.start]:02x} at byte {err.start + 1}); "
                      f"save the file as UTF-8")
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as err:
        return BadRow(n, _salvage_id(text), "invalid_json",
                      f"line {n}: not valid JSON ({err.msg} at column {err.colno}); write one JSON object per line")
    except RecursionError:
        return BadRow(n, _salvage_id(text), "invalid_json",
                      f"line {n}: JSON nested too deeply to read; flatten the request")
    if not isinstance(obj, dict):
        return BadRow(n, None, "invalid_json",
                      f"line {n}: expected a JSON object, found {_show(obj)}; write one JSON object per line")
    return obj


def _salvage_id(text: str) -> str | None:
    """The custom_id of a line that is not JSON, when it can still be read, so its error line can be matched."""
    m = re.search(r'"custom_id"\s*:\s*("(?:[^"\\]|\\.)*")', text)
    try:
        cid = json.loads(m.group(1)) if m else None
    except ValueError:
        return None
    return cid if cid and "\ufffd" not in cid else None


def _row(n: int, obj: dict) -> Request | BadRow:
    errs: list[str] = []
    cid = _get(obj, "custom_id", "custom_id", lambda v: isinstance(v, str) and v != "", "a non-empty string", errs)
    if any(k in obj for k in ("url", "method", "body")):  # Batch API form
        url = obj.get("url")
        pre, kind = "body.", URLS.get(url) if isinstance(url, str) else None
        method = obj.get("method", "POST")
        if not (isinstance(method, str) and method.upper() == "POST"):
            errs.append(f'method must be "POST", found {_show(method)}')
        if kind is None:
            found = _show(obj.get("url", _MISSING))
            errs.append(f'url must be "/v1/chat/completions" or "/v1/completions", found {found}')
        body = obj.get("body", _MISSING)
        if not isinstance(body, dict):
            errs.append(f"body must be a JSON object with messages or prompt, found {_show(body)}")
            body = {}
        elif kind is not None:
            need, other, url = ("messages", "prompt", "/v1/completions") if kind == "chat" else \
                ("prompt", "messages", "/v1/chat/completions")
            if need not in body:
                hint = f" (url {obj['url']} takes {need}; for {other} use {url})" if other in body else ""
                errs.append(f"body.{need} is missing{hint}")
        kind = kind or ("chat" if "messages" in body else "completion")
    else:                                                 # plain form
        pre, body = "", obj
        if "messages" in obj and "prompt" in obj:
            errs.append("has both messages and prompt; keep one")
        elif "messages" not in obj and "prompt" not in obj:
            errs.append('needs "messages" (a chat) or "prompt" (a completion)')
        kind = "chat" if "messages" in obj else "completion"
    messages = _messages(body.get("messages", _MISSING), pre + "messages", errs) if kind == "chat" else None
    prompt = _get(body, "prompt", pre + "prompt", lambda v: isinstance(v, str), "a string", errs) \
        if kind == "completion" and "prompt" in body else None
    params = _params(body, pre, errs)
    if errs:
        return BadRow(n, cid, "invalid_request", f"line {n}: {'; '.join(errs)}")
    return Request(line=n, custom_id=cid, kind=kind, messages=messages, prompt=prompt, **params)


def _messages(value, name: str, errs: list[str]) -> list[dict] | None:
    if value is _MISSING:
        return None                                       # already reported above
    if not isinstance(value, list) or not value:
        errs.append(f"{name} must be a non-empty list of {{role, content}} objects, found {_show(value)}")
        return None
    out = []
    for i, m in enumerate(value):
        where = f"{name}[{i}]"
        if not isinstance(m, dict):
            errs.append(f"{where} must be an object with role and content, found {_show(m)}")
            continue
        role = m.get("role", _MISSING)
        if not (isinstance(role, str) and role in ROLES):
            errs.append(f'{where}.role must be "system", "user" or "assistant", found {_show(role)}')
        out.append({"role": role, "content": _content(m.get("content", _MISSING), where + ".content", errs)})
    return out


def _content(value, name: str, errs: list[str]) -> str | None:
    """A string, or a list of text parts ([{"type": "text", "text": "..."}]) joined into one string."""
    if isinstance(value, str):
        return value
    if value is _MISSING:
        errs.append(f"{name} is missing")
        return None
    if isinstance(value, list) and value and all(isinstance(p, dict) and p.get("type") == "text"
                                                  and isinstance(p.get("text"), str) for p in value):
        return "".join(p["text"] for p in value)
    if isinstance(value, list) and any(isinstance(p, dict) and p.get("type") not in (None, "text") for p in value):
        kinds = sorted({str(p.get("type")) for p in value if isinstance(p, dict)} - {"text"})
        errs.append(f"{name} has parts of type {', '.join(kinds)}; spill runs text only, send text parts or a string")
        return None
    errs.append(f"{name} must be a string, found {_show(value)}")
    return None


def _params(body: dict, pre: str, errs: list[str]) -> dict:
    def num(v):
        return isinstance(v, (int, float)) and not isinstance(v, bool)

    def integer(v):
        return isinstance(v, int) and not isinstance(v, bool)

    mt, mct = body.get("max_tokens"), body.get("max_completion_tokens")
    if mt is not None and mct is not None and mt != mct:
        errs.append(f"{pre}max_tokens and {pre}max_completion_tokens differ ({_show(mt)} and {_show(mct)}); keep one")
    key = "max_tokens" if mt is not None else "max_completion_tokens"
    max_tokens = _get(body, key, pre + key, lambda v: integer(v) and 1 <= v <= MAX_INT,
                      f"an integer from 1 to {MAX_INT}", errs, None)
    temperature = _get(body, "temperature", pre + "temperature", lambda v: num(v) and 0 <= v <= 2,
                       "a number from 0 to 2", errs, None)
    top_p = _get(body, "top_p", pre + "top_p", lambda v: num(v) and 0 < v <= 1,
                 "a number above 0 and at most 1", errs, None)
    top_k = _get(body, "top_k", pre + "top_k", lambda v: integer(v) and -1 <= v <= MAX_INT,
                 f"an integer from 1 to {MAX_INT} (0 or -1: no top-k)", errs, None)
    seed = _get(body, "seed", pre + "seed", lambda v: integer(v) and 0 <= v <= MAX_SEED,
                f"an integer from 0 to {MAX_SEED}", errs, None)
    stop = _get(body, "stop", pre + "stop",
                lambda v: (isinstance(v, str) and v != "") or (isinstance(v, list) and len(v) <= MAX_STOP and all(
                    isinstance(s, str) and s != "" for s in v)),
                f"a non-empty string or a list of at most {MAX_STOP} non-empty strings", errs, None)
    n = body.get("n")
    if n is not None and not (integer(n) and n == 1):
        errs.append(f"{pre}n must be 1 (spill makes one completion per row; repeat the row under other custom_ids "
                    f"for more), found {_show(n)}")
    return {"max_tokens": max_tokens, "top_k": top_k if top_k not in (0, -1) else None, "seed": seed,
            "temperature": None if temperature is None else float(temperature),
            "top_p": None if top_p is None else float(top_p),
            "stop": [stop] if isinstance(stop, str) else list(stop or [])}


def _get(obj: dict, key: str, name: str, ok, expect: str, errs: list[str], default=_MISSING):
    """obj[key] when it passes ok; else note '<name> must be <expect>, found <value>' (or 'is missing') and return None.
    With a default, a missing key or null is not an error and gives the default."""
    value = obj.get(key, _MISSING)
    if default is not _MISSING and value in (_MISSING, None):
        return default
    if value is _MISSING:
        errs.append(f"{name} is missing")
        return None
    if not ok(value):
        errs.append(f"{name} must be {expect}, found {_show(value)}")
        return None
    return value


def _show(value) -> str:
    if value is _MISSING:
        return "nothing"
    text = json.dumps(value, ensure_ascii=False)
    return _clip(text)


def _clip(text: str, width: int = 40) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


def _spans(numbers: list[int], last: str) -> str:
    """[3, 4, 5, 9] -> '3-5 and 9' (or '3-5, 9'): every line named, runs collapsed."""
    runs: list[list[int]] = []
    for x in numbers:
        if runs and x == runs[-1][1] + 1:
            runs[-1][1] = x
        else:
            runs.append([x, x])
    parts = [f"{a}-{b}" if b > a else str(a) for a, b in runs]
    return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + last + parts[-1]


def check_params(values: dict) -> list[str]:
    """The sentences a row with these sampling fields would get (the CLI's defaults get the same checks)."""
    errs: list[str] = []
    _params(values, "", errs)
    return errs
