"""The docs cannot drift from the code: every command README.md and docs/guide.md show is run, and its output
matched against what they show (tests/docs_check.py says how); CI runs the README's test command."""

from pathlib import Path

from .docs_check import DOCS, INSTALL, ROOT, TESTS, check, commands, matches


def test_every_command_the_docs_show_prints_what_they_show(tmp_path):
    failures = check(tmp_path)
    assert not failures, "\n\n".join(failures)


def test_ci_runs_the_readme_s_install_and_test_commands():
    shown = [c.command for c in commands("README.md") if INSTALL.sub("", c.command) == TESTS]
    assert shown == ["pip install -e '.[test]' && python -m pytest -q -n 2"], shown
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert "python -m pip install -q -e '.[test]'" in ci   # the README's install, quietly
    assert TESTS in ci, "CI must run the README's test command as it is"


def test_a_shown_line_matches_its_shape_and_dots_stand_for_any_lines():
    shown = ["job 261206-032606-daa503: 20 rows; output ~/.streamweights/jobs/261206-032606-daa503/output.jsonl",
             "...", "took 18s against an estimate of 1m 05s (0.96x)"]
    assert matches(shown, ["job 270101-000000-abcdef: 20 rows; output /tmp/x/jobs/270101-000000-abcdef/output.jsonl",
                           "rows 3/20  ETA -", "took 2h 01m against an estimate of 9s (13.4x)"])
    assert not matches(shown, ["job 270101-000000-abcdef: 21 lines; output /x", "took 1s against an estimate of 1s (1x)"])
    assert not matches(shown[:1], [])


def test_the_docs_show_commands_at_all():
    assert all(commands(doc) for doc in DOCS)
    assert all(Path(ROOT / doc).exists() for doc in DOCS)
