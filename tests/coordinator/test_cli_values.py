"""What `spill` says about its own flags and files before any group starts: the same wording as a
row's fields, one line, no traceback, in a fraction of a second (no MLX, no ZeroMQ, no group)."""

import json
import os
import subprocess
import sys

from typer.testing import CliRunner

from spill.coordinator.cli import app

runner = CliRunner()


def _one_line(args) -> str:
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("spill: "), result.output
    return lines[0]


def _input(tmp_path, rows=1):
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps({"custom_id": f"q{i}", "prompt": "hi"}) + "\n" for i in range(rows)))
    return path


def _row_says(field: str, value) -> str:
    """What a row with this field gets, e.g. 'max_tokens must be ..., found 0'."""
    from spill.coordinator.batch_input import check_params
    (sentence,) = check_params({field: value})
    return sentence.removeprefix(field)


def test_max_tokens_zero_is_refused_as_a_row_would_be(tmp_path):
    assert _row_says("max_tokens", 0).endswith(", found 0")
    assert _one_line(["run", "demo", str(_input(tmp_path)), "--max-tokens", "0"]) == (
        "spill: --max-tokens" + _row_says("max_tokens", 0))


def test_negative_temperature_is_refused_as_a_row_would_be(tmp_path):
    assert _one_line(["run", "demo", str(_input(tmp_path)), "--temperature", "-3"]) == (
        "spill: --temperature" + _row_says("temperature", -3.0))


def test_listen_garbage_is_one_sentence():
    assert _one_line(["up", "--listen", "garbage"]) == (
        "spill: --listen must be a port (5557) or an address such as tcp://127.0.0.1:5557, found 'garbage'")


def test_flags_have_no_bool_metavar_and_there_is_a_version():
    help_text = runner.invoke(app, ["run", "--help"]).output
    assert "--new" in help_text and "<bool>" not in help_text
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0 and result.output.startswith("spill 0.")


REFUSE = """
import sys, time
from spill.coordinator.cli import app
t = time.monotonic()
try:
    app(sys.argv[1:], prog_name="spill")
except SystemExit as e:
    code = e.code
print("RESULT", code, round(time.monotonic() - t, 3), sorted(m for m in ("mlx", "zmq", "numpy") if m in sys.modules))
"""


def _refuse(args, home, cwd) -> tuple[str, list]:
    """Run `spill ARGS` in a fresh interpreter: its error line, and the heavy modules it imported."""
    out = subprocess.run([sys.executable, "-c", REFUSE, *map(str, args)], capture_output=True, text=True,
                         cwd=cwd, env={**os.environ, "SPILL_HOME": str(home)}, timeout=60)
    result = [line for line in out.stdout.splitlines() if line.startswith("RESULT")][0].split(" ", 3)
    assert result[1] == "2", out.stdout + out.stderr
    assert not (home / "run" / "logs").exists(), "a group was started to refuse the command"
    return out.stderr.strip(), eval(result[3])


def test_file_level_errors_are_refused_before_any_group_or_mlx_starts(tmp_path, make_tiny):
    home = tmp_path / "home"
    (tmp_path / "empty.jsonl").write_text("")
    dup = tmp_path / "dup.jsonl"
    dup.write_text('{"custom_id": "a", "prompt": "x"}\n{"custom_id": "a", "prompt": "y"}\n')
    (tmp_path / "taken.jsonl").write_text("something\n")
    cases = [(["run", "demo", "empty.jsonl"], "is empty"),
             (["run", "demo", "missing.jsonl"], "not found"),
             (["run", "demo", "dup.jsonl"], "custom_id"),
             (["run", "demo", str(_input(tmp_path)), "-o", "taken.jsonl"], "already exists and is not empty"),
             (["run", "./no-such-model", str(_input(tmp_path))], "no-such-model"),
             (["run", str(tmp_path), str(_input(tmp_path))], "config.json")]
    for args, expect in cases:
        line, heavy = _refuse(args, home, tmp_path)
        assert line.startswith("spill: ") and expect in line and len(line.splitlines()) == 1, (args, line)
        assert heavy == [], (args, heavy)


def test_openblas_missing_is_said_once_with_the_install_command(monkeypatch, tmp_path):
    from spill import platform
    monkeypatch.setattr(platform, "_CANDIDATES", [str(tmp_path / "no-libopenblas.so.0")])
    monkeypatch.setattr(platform.sys, "platform", "linux")
    monkeypatch.delenv("SPILL_NO_OPENBLAS", raising=False)
    note = "install it with `sudo apt-get install libopenblas0-pthread`"
    for args in (["status"], ["run", "demo", str(tmp_path / "missing.jsonl")]):
        result = runner.invoke(app, args)
        assert result.output.count(note) == 1, result.output
        assert result.output.splitlines()[0].startswith("spill: OpenBLAS was not found"), result.output


def test_openblas_present_says_nothing(monkeypatch, tmp_path):
    from spill import platform
    (tmp_path / "libopenblas.so.0").write_bytes(b"")
    monkeypatch.setattr(platform, "_CANDIDATES", [str(tmp_path / "libopenblas.so.0")])
    assert "OpenBLAS" not in runner.invoke(app, ["status"]).output
