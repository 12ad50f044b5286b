"""Helpers for end-to-end tests that start real processes."""

import json
import os
import shutil
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import mlx.core as mx

from spill import config

QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.", "Explain photosynthesis.",
             "List three uses of a paperclip.", "What is 12 times 12?", "Translate 'thank you' into Spanish.",
             "Name a grey cat.", "Why do leaves change colour in autumn?", "Summarise the water cycle.",
             "What does a compiler do?"]


def write_input(path: Path, n: int, max_tokens: int = 8) -> list[dict]:
    rows = []
    for i in range(n):
        q = QUESTIONS[i % len(QUESTIONS)] + " " * (i // len(QUESTIONS))
        if i % 2:
            rows.append({"custom_id": f"r{i:03d}", "messages": [{"role": "user", "content": q}], "max_tokens": max_tokens})
        else:
            rows.append({"custom_id": f"r{i:03d}", "prompt": q, "max_tokens": max_tokens})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


def llama_job(make_tiny, tmp_path_factory, n: int, max_tokens: int = 8) -> tuple[Path, Path, dict[str, str]]:
    """A job of n rows on the tiny llama: (model folder, input file, what resident mlx-lm writes)."""
    folder = make_tiny("llama")
    data = tmp_path_factory.mktemp(f"job{n}")
    rows = write_input(data / "in.jsonl", n, max_tokens=max_tokens)
    return folder, data / "in.jsonl", resident_texts(folder, rows)


def seed_home(home: Path, calibration: Path) -> None:
    """Give a test's own data home the session's calibrations (conftest's llama_calibration), so its group does not probe."""
    shutil.copytree(calibration, Path(home) / "calibration", dirs_exist_ok=True)


def spill(*args, timeout=300, check=False, **kw) -> subprocess.CompletedProcess:
    """Run the spill CLI in a child process, the way a user does."""
    result = subprocess.run([sys.executable, "-m", "spill.coordinator.cli", *map(str, args)],
                            capture_output=True, text=True, timeout=timeout, env={**os.environ, **kw.pop("env", {})}, **kw)
    if check:
        assert result.returncode == 0, result.stdout + result.stderr
    return result


@contextmanager
def one_group(env: dict | None = None):
    """`spill up` (with `env`) for the jobs of the block and `spill down` after: one group's start for them all."""
    spill("up", check=True, env=env or {})
    try:
        yield
    finally:
        spill("down", env=env or {})


def read_output(path: Path) -> dict[str, dict]:
    """custom_id -> output line; fails if a custom_id appears twice."""
    out = {}
    for line in Path(path).read_text().splitlines():
        row = json.loads(line)
        assert row["custom_id"] not in out, f"{row['custom_id']} written twice"
        out[row["custom_id"]] = row
    return out


def texts(out: dict[str, dict]) -> dict[str, str]:
    def text(body):
        choice = body["choices"][0]
        return choice["message"]["content"] if "message" in choice else choice["text"]
    return {cid: text(row["response"]["body"]) for cid, row in out.items()}


def resident_texts(folder: Path, rows: list[dict]) -> dict[str, str]:
    """What mlx-lm gives with the model resident, greedy, in float32 (the CPU compute dtype)."""
    from mlx_lm.generate import generate_step
    from mlx_lm.utils import load
    model, tok = load(str(folder))
    model.set_dtype(mx.float32)
    out = {}
    for r in rows:
        if "messages" in r:
            ids = tok.apply_chat_template(r["messages"], add_generation_prompt=True)
            ids = list(ids["input_ids"] if isinstance(ids, dict) else ids)
        else:
            ids = tok.encode(r["prompt"])
        tokens = []
        for t, _ in generate_step(mx.array(ids), model, max_tokens=r["max_tokens"]):
            if int(t) in tok.eos_token_ids:
                break
            tokens.append(int(t))
        out[r["custom_id"]] = tok.decode(tokens)
    return out


def last_actor_pids(n: int = 3) -> list[int]:
    """Pids of the last n actors the coordinator started (from its JSON log)."""
    log = config.home() / "run" / "logs" / "coordinator.log"
    started = [json.loads(line) for line in log.read_text().splitlines() if '"started"' in line]
    return [e["actor_pid"] for e in started[-n:]]


def assert_actors_exit(pids: list[int], within_s: float = 10.0) -> None:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        alive = []
        for pid in pids:
            try:
                os.kill(pid, 0)
                with open(f"/proc/{pid}/stat") as f:   # a zombie has exited
                    if f.read().split(")")[-1].split()[0] != "Z":
                        alive.append(pid)
            except (ProcessLookupError, FileNotFoundError):
                pass
        if not alive:
            return
        time.sleep(0.1)
    raise AssertionError(f"actors {alive} outlived their coordinator")


def log_events(role: str, home: Path | None = None) -> list[dict]:
    """The JSON log events of one process of the group (a line still being written is skipped)."""
    path, events = Path(home or config.home()) / "run" / "logs" / f"{role}.log", []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            events.append(json.loads(line))
        except ValueError:
            pass
    return events
