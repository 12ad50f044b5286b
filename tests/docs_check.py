"""The docs' commands, run: every ```console block of README.md and docs/guide.md, in the order the docs show
them, in one scratch folder and one fresh data home, each command's output matched against the lines shown.

A block is lines `$ COMMAND` followed by what it prints. The output must match line by line, where a shown line
`...` stands for any number of lines (progress lines come every few seconds), and within a line what depends on
the machine or the moment matches its shape only: a table's rules, numbers (with their unit; `-` where none is known yet), durations, sizes, job ids, paths and
quoted text. A command must exit 0 unless it ends in `; echo "exit code $?"`, whose line is then matched too.
A job id in a command stands for the last job id the docs' commands printed. Two commands are not run here:
the install (`pip install -e ...`, this checkout is installed) and the test suite itself; `.ci/run` runs both,
and test_docs.py checks it runs exactly the README's.

    python tests/docs_check.py README.md docs/guide.md     # prints each command's actual output beside the doc's
"""

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ("README.md", "docs/guide.md")
EXIT = '; echo "exit code $?"'
JOB = r"\d{6}-\d{6}-[0-9a-f]{6}"
INSTALL = re.compile(r"^pip install -e \S+ && ")
TESTS = "python -m pytest -q -n 2"
_SHAPES = [   # (what a shown line says, what the actual line may say instead), tried in this order
    (re.compile(r"'[^']*'|\"[^\"]*\""), r"('.*'|\".*\")"),
    (re.compile(r"[─━═]+"), r"[─━═]+"),   # a table's rules, as wide as its widest cell
    (re.compile(JOB), JOB),
    (re.compile(r"(?<![\w.])(?:~|\.{0,2})/[^\s;,)]*"), r"\S+?"),
    (re.compile(r"\d+h \d{2}m|\d+m \d{2}s|(?<![\d.])\d+s\b"), r"(?:\d+h \d{2}m|\d+m \d{2}s|\d+s)"),
    (re.compile(r"\d[\d.,]*(?:[hms]\d[\d.]*)*[a-z%]*(?: [KMGT]?i?B\b)?"), r"(?:-|\d[\d.,hms]*[a-z%]*(?: [KMGT]?i?B\b)?)"),
]


@dataclass
class Command:
    doc: str
    line: int
    command: str
    shown: list[str] = field(default_factory=list)


def commands(doc: str) -> list[Command]:
    """The `$ ` lines of the doc's console blocks, each with the lines shown under it."""
    out, inside = [], False
    for n, text in enumerate((ROOT / doc).read_text().splitlines(), 1):
        if text.strip().startswith("```"):
            inside = text.strip() == "```console"
            continue
        if not inside:
            continue
        if text.startswith("$ "):
            out.append(Command(doc, n, text[2:].strip()))
        elif out:
            out[-1].shown.append(text)
    return out


def pattern(shown: str) -> re.Pattern:
    """A shown line as the regex of the lines it stands for."""
    parts, k = [], 0
    while k < len(shown):
        for shape, stands in _SHAPES:
            m = shape.match(shown, k)
            if m and m.end() > k:
                parts.append(stands)
                k = m.end()
                break
        else:
            space = re.match(r"\s+", shown[k:])
            parts.append(r"\s+" if space else re.escape(shown[k]))
            k += space.end() if space else 1
    return re.compile("".join(parts).rstrip())


def matches(shown: list[str], actual: list[str]) -> bool:
    """Whether the actual lines are the shown ones, `...` standing for any number of lines."""
    shown = [s.rstrip() for s in shown if s.strip()]
    actual = [a.rstrip() for a in actual if a.strip()]
    memo = {}

    def at(i: int, j: int) -> bool:
        if (i, j) not in memo:
            if i == len(shown):
                memo[i, j] = j == len(actual)
            elif shown[i].strip() == "...":
                memo[i, j] = any(at(i + 1, k) for k in range(j, len(actual) + 1))
            else:
                memo[i, j] = j < len(actual) and bool(pattern(shown[i]).fullmatch(actual[j])) and at(i + 1, j + 1)
        return memo[i, j]
    return at(0, 0)


def scratch(where: Path) -> dict:
    """A folder like a fresh checkout's (examples/ only) and the environment of a user on a fresh machine."""
    shutil.copytree(ROOT / "examples", where / "examples")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPILL_")}
    env.update(SPILL_HOME=str(where / "home"), SPILL_METRICS_PORT="0", COLUMNS="100", HF_HUB_OFFLINE="1",
               HF_HUB_CACHE=str(where / "hf-cache"),   # `spill models` lists no model this machine happens to have
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}")
    return env


def run(cmd: Command, where: Path, env: dict, last_job: str | None, timeout_s: float = 300) -> tuple[str, str]:
    """(the command's output, stdout and stderr interleaved, with its exit code line where asked, the command run)."""
    line = INSTALL.sub("", cmd.command)
    if last_job:
        line = re.sub(JOB, last_job, line)
    done = subprocess.run(["bash", "-c", line], cwd=where, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=timeout_s, stdin=subprocess.DEVNULL)
    out = done.stdout
    if not line.endswith(EXIT) and done.returncode != 0:
        out += f"\n(exit code {done.returncode}, where the doc shows 0)"
    return out, line


def check(where: Path, docs=DOCS, show: bool = False) -> list[str]:
    """Run every command of `docs`; one message for each whose output does not match what the doc shows."""
    env, last_job, failures = scratch(where), None, []
    for doc in docs:
        for cmd in commands(doc):
            if INSTALL.sub("", cmd.command) == TESTS:
                continue
            out, line = run(cmd, where, env, last_job)
            jobs = re.findall(rf"\bjob ({JOB})", out)
            last_job = jobs[-1] if jobs else last_job
            ok = matches(cmd.shown, out.splitlines())
            if show:
                print(f"--- {doc}:{cmd.line} $ {line}  [{'ok' if ok else 'DIFFERS'}]\n{out}", flush=True)
            if not ok:
                failures.append(f"{doc}:{cmd.line}: `{cmd.command}` printed:\n{out}\nwhere the doc shows:\n"
                                + "\n".join(cmd.shown))
    return failures


if __name__ == "__main__":
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        failed = check(Path(tmp), docs=sys.argv[1:] or DOCS, show=True)
    sys.exit(1 if failed else 0)
