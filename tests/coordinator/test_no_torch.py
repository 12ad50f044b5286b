"""A machine with torch installed: transformers imports it whenever it can (~400 MB a process), and spill
needs none of it. No process of the group, nor the CLI, may import it."""

import pytest

from .group_util import llama_job, read_output, spill, texts


@pytest.fixture
def torch_installed(tmp_path):
    """A `torch` that transformers sees as installed (it has package metadata) and that leaves a mark
    when imported."""
    site, mark = tmp_path / "site", tmp_path / "imported"
    (site / "torch").mkdir(parents=True)
    (site / "torch" / "__init__.py").write_text(
        f"open({str(mark)!r}, 'a').write(__import__('sys').argv[0] + '\\n')\n"
        "raise ImportError('torch is a stand-in here')\n")
    (site / "torch-2.14.0.dist-info").mkdir()
    (site / "torch-2.14.0.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: torch\nVersion: 2.14.0\n")
    return {"PYTHONPATH": str(site), "SPILL_ESTIMATE_APART": "1"}, mark   # the estimate's child too


def test_no_process_of_the_group_imports_torch(make_tiny, tmp_path_factory, tmp_path, torch_installed):
    folder, inp, expected = llama_job(make_tiny, tmp_path_factory, 4)
    env, mark = torch_installed
    spill("run", folder, inp, "-o", tmp_path / "out.jsonl", check=True, env=env)
    assert texts(read_output(tmp_path / "out.jsonl")) == expected
    spill("estimate", folder, inp, check=True, env=env)
    assert not mark.exists(), f"torch was imported by: {mark.read_text()}"
