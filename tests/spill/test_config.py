"""The environment is read in one place: every SPILL_* variable declared once in spill/config.py, read only
there, and documented in the section of docs/configuration.md its category names."""

import ast
import re
from pathlib import Path

import pytest

from spill import config
from spill.errors import SpillError

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ("spill", "coordinator", "admission", "streamer", "tokenizer_worker", "grafana", "benchmarks", "tests")
NAME = re.compile(r"(?<![A-Z0-9_])_?SPILL_[A-Z0-9_]*[A-Z0-9]")


def sources():
    for folder in FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path != ROOT / "spill" / "config.py":
                yield path, path.read_text()


def _spill_name(node) -> bool:
    """A string (or f-string) naming a SPILL_ variable."""
    if isinstance(node, ast.JoinedStr) and node.values:
        node = node.values[0]
    return isinstance(node, ast.Constant) and isinstance(node.value, str) and bool(NAME.match(node.value))


def _environ(node) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == "environ"


def environment_reads(tree) -> list[int]:
    """Lines that read os.environ or os.getenv for a SPILL_ name: get, [...] loaded, `in`, getenv."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args and _spill_name(node.args[0]):
            f = node.func
            if (isinstance(f, ast.Attribute) and (f.attr == "getenv" or f.attr == "get" and _environ(f.value))):
                lines.append(node.lineno)
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and _environ(node.value) \
                and _spill_name(node.slice):
            lines.append(node.lineno)
        elif isinstance(node, ast.Compare) and _spill_name(node.left) and any(_environ(c) for c in node.comparators):
            lines.append(node.lineno)
    return lines


def test_no_module_but_config_reads_a_spill_variable_from_the_environment():
    found = [f"{path.relative_to(ROOT)}:{line}" for path, text in sources() for line in environment_reads(ast.parse(text))]
    assert not found, f"read SPILL_ variables through spill.config, not os.environ: {found}"


def test_the_walk_sees_each_way_of_reading_the_environment():
    code = ('os.environ.get("SPILL_HOME")\nos.getenv("SPILL_HOME", "1")\nos.environ["SPILL_HOME"]\n'
            '"SPILL_HOME" in os.environ\nos.environ.get(f"SPILL_TEST_CRASH_{r}")\nos.environ["SPILL_HOME"] = "1"\n'
            'env.pop("SPILL_HOME")\nos.environ.get("HOME")\n')
    assert environment_reads(ast.parse(code)) == [1, 2, 3, 4, 5]


def test_every_spill_variable_the_code_names_is_declared():
    named = {v for _, text in sources() for v in NAME.findall(text)}
    unknown = sorted(named - set(config.KNOBS) - {"SPILL_TEST_CRASH"})   # f"SPILL_TEST_CRASH_{role}": one a role
    assert not unknown, f"named in the code, not declared in spill/config.py: {unknown}"


def test_every_declared_variable_is_documented_in_its_categorys_section():
    doc = (ROOT / "docs" / "configuration.md").read_text()
    sections = {"user": "## Environment", "tuning": "## Tuning", "test": "## For tests and benchmarks",
                "internal": "## For tests and benchmarks"}
    for knob in config.KNOBS.values():
        name = "SPILL_TEST_CRASH_<ROLE>" if knob.name.startswith("SPILL_TEST_CRASH_") else knob.name
        section = doc.split(sections[knob.category], 1)[1].split("\n## ", 1)[0]
        assert f"`{name}" in section, f"{knob.name} ({knob.category}) is not in {sections[knob.category]}"
    assert all(k.name.split("_")[:2] == ["SPILL", "TEST"] for k in config.KNOBS.values() if k.category == "test")


def test_a_value_that_does_not_parse_is_one_sentence(monkeypatch):
    monkeypatch.setenv("SPILL_MAX_ROWS", "many")
    with pytest.raises(SpillError, match=r"^SPILL_MAX_ROWS='many' is not a whole number; set it to one \(decode "
                                         r"slots at most; .*\), or unset it$"):
        config.max_rows()
    monkeypatch.setenv("SPILL_MAX_ROWS", " ")
    assert config.max_rows() == 256 and config.get("SPILL_STREAM", {"SPILL_STREAM": "0"}) is False
