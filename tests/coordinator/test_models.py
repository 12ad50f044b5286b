"""MODEL resolution: tags, Hugging Face ids and local folders, against a local fake hub."""

import json
import shutil
import socket
from pathlib import Path

import pytest

from spill.coordinator import models
from spill.errors import SpillError
from spill.memory import format_size

from .fake_hub import FakeHub, cache_model

QWEN = "Qwen/Qwen2.5-0.5B-Instruct"


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """An empty huggingface_hub cache; offline unless a test says otherwise."""
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("HF_TOKEN", raising=False)
    return cache


def _error(model: str) -> str:
    with pytest.raises(SpillError) as err:
        models.resolve(model)
    return str(err.value)


def test_a_tag_resolves_to_its_repo_in_the_cache(hub, make_tiny):
    tag = models.tags()["qwen2.5:0.5b"]
    assert (tag.repo, tag.revision, tag.quantization) == (QWEN, "main", "bf16")
    snapshot = cache_model(hub, QWEN, make_tiny("qwen2"))
    assert models.resolve("qwen2.5:0.5b") == snapshot
    assert models.resolve(QWEN) == snapshot


def test_org_name_at_revision_takes_that_revision(hub, make_tiny):
    cache_model(hub, QWEN, make_tiny("qwen2"))
    v1 = cache_model(hub, QWEN, make_tiny("llama"), revision="v1", commit="b" * 40)
    assert models.resolve(f"{QWEN}@v1") == v1
    assert models.resolve(f"{QWEN}@{'b' * 40}") == v1


def test_a_local_folder_wins_over_a_repo_id_of_the_same_spelling(hub, make_tiny, tmp_path, monkeypatch):
    shutil.copytree(make_tiny("llama"), tmp_path / "org" / "name")
    monkeypatch.chdir(tmp_path)
    assert models.resolve("org/name") == (tmp_path / "org" / "name").resolve()


def test_offline_and_not_cached(hub):
    assert _error("org/name") == (
        f"model 'org/name' at 'main' is not in the cache {hub} and HF_HUB_OFFLINE is set; unset "
        "HF_HUB_OFFLINE and run `spill pull org/name`")
    assert _error("llama3.3:70b") == (
        f"model 'meta-llama/Llama-3.3-70B-Instruct' at 'main' is not in the cache {hub} and HF_HUB_OFFLINE "
        "is set; unset HF_HUB_OFFLINE and run `spill pull llama3.3:70b`")


def test_no_network_and_not_cached(hub, monkeypatch):
    with socket.socket() as s:   # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    assert _error("org/name@v2") == (
        f"model 'org/name' at 'v2' is not in the cache {hub} and the Hugging Face Hub cannot be reached; "
        "connect to the network and run `spill pull org/name@v2`")


@pytest.mark.parametrize("model, sentence", [
    ("org/missing", "model 'org/missing': no such repository on Hugging Face (or it is private); check the "
                    "repo id, or set HF_TOKEN to a token that can read it"),
    ("org/gated", "model 'org/gated' is gated and this machine has no access: accept its terms at "
                  "https://huggingface.co/org/gated and set HF_TOKEN to a token of that account"),
    ("org/name@nope", "model 'org/name' has no revision 'nope'; give a branch, tag or commit of the "
                      "repository (main is the default)"),
])
def test_the_hub_errors_are_one_sentence(hub, monkeypatch, model, sentence):
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    with FakeHub() as endpoint:
        monkeypatch.setenv("HF_ENDPOINT", endpoint)
        assert _error(model) == sentence


def test_unknown_tag_and_missing_folder(hub):
    assert _error("llama3.3:700b") == (
        "model 'llama3.3:700b': no such tag in models.yaml; `spill models` lists the tags, or give a Hugging "
        "Face id (org/name) or a local folder")
    assert _error("./nowhere") == (
        "model './nowhere': expected a local model folder, a tag or a Hugging Face id (org/name), found no "
        "such folder; check the path")


def test_a_model_spill_cannot_run_is_refused_before_any_weight_is_read(hub, tmp_path):
    folder = tmp_path / "moe"
    folder.mkdir()   # config.json only: no weights to read
    shutil.copy(models_config("mixtral"), folder / "config.json")
    assert _error(str(folder)) == (
        f"model {str(folder)!r}: mixtral is a mixture-of-experts model (num_local_experts = 8 in config.json): "
        "per-token expert routing defeats layer-order streaming; use a dense model")


def test_an_expected_family_warns_in_one_line(hub, tmp_path):
    folder = tmp_path / "olmo"
    folder.mkdir()
    shutil.copy(models_config("olmo2"), folder / "config.json")
    assert models.resolve(str(folder)) == folder
    assert models.warning(folder) == ("olmo2 is a family mlx-lm supports but spill has not verified: it "
                                      "should run; `spill check MODEL` compares it with mlx-lm")


def models_config(name: str):
    from pathlib import Path
    return Path(__file__).parents[1] / "data" / "configs" / f"{name}.json"


def test_every_tag_names_a_repo_a_revision_and_a_quantization():
    for tag in models.tags().values():
        assert "/" in tag.repo and tag.revision and tag.quantization in {"bf16", "8bit", "4bit"}, tag
    assert json.dumps(sorted(models.tags()))   # names are plain strings


def test_spill_models_lists_tags_and_cached_models_and_pull_prints_the_folder(hub, make_tiny, monkeypatch):
    from typer.testing import CliRunner

    from spill.coordinator.cli import app
    monkeypatch.setenv("COLUMNS", "250")
    snapshot = cache_model(hub, QWEN, make_tiny("qwen2"))
    runner = CliRunner()
    result = runner.invoke(app, ["pull", "qwen2.5:0.5b"])
    assert (result.exit_code, result.output) == (0, f"{snapshot}\n")
    result = runner.invoke(app, ["models"])
    assert result.exit_code == 0, result.output
    size = sum(f.stat().st_size for f in snapshot.iterdir())
    tag_row = next(line for line in result.output.splitlines() if "qwen2.5:0.5b" in line)
    assert [c.strip() for c in tag_row.split("│")[1:6]] == ["qwen2.5:0.5b", QWEN, "main", "bf16", f"{size / 1e9:.2f} GB"]
    cached_row = next(line for line in result.output.splitlines() if str(snapshot) in line)
    assert [c.strip() for c in cached_row.split("│")[1:5]] == [QWEN, f"{size / 1e9:.2f} GB", "qwen2", "verified"]
    result = runner.invoke(app, ["pull", "org/name"])
    assert result.exit_code == 2
    assert result.output.startswith("spill: model 'org/name' at 'main' is not in the cache")


def test_a_download_that_would_not_fit_is_refused_before_it_starts(hub, monkeypatch):
    import shutil as sh
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    free = sh.disk_usage(hub).free
    with FakeHub() as endpoint:
        monkeypatch.setenv("HF_ENDPOINT", endpoint)
        sentence = _error("org/huge")   # 2 PB of safetensors; the 4 PB .bin is not a file spill reads
    need = 2 * 10**15 + 700
    assert sentence == (f"model 'org/huge' needs {format_size(need)} in {hub} but {format_size(free)} is free "
                        f"there; free {format_size(need - free)} or point HF_HUB_CACHE at a disk with room")
    assert not list(hub.iterdir())


def test_output_room_is_checked_where_the_output_goes(tmp_path, monkeypatch):
    from collections import namedtuple
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(models.shutil, "disk_usage", lambda path: usage(10**9, 10**9 - 10**6, 10**6))
    need = models.output_bytes(rows=2000, max_tokens=256)
    with pytest.raises(SpillError) as err:
        models.check_room(tmp_path / "job" / "out.jsonl", need, "the job's output may need", "there")
    assert str(err.value) == (f"the job's output may need 5.1 MiB in {tmp_path / 'job' / 'out.jsonl'} "
                              f"but 976.6 KiB is free there; free 4.1 MiB there")   # readable units, never "0.0 GB"
    models.check_room(tmp_path, 10**5, "x", "y")   # room enough: nothing said


VARIANTS = Path(__file__).parent.parent / "data" / "models" / "variants.yaml"


@pytest.fixture
def variant_tags(monkeypatch):
    monkeypatch.setattr(models, "tags", lambda: models.read_tags(VARIANTS.read_text()))


def test_a_models_quantized_variants_are_found_by_tag_or_repo_id(variant_tags):
    assert models.variants("tiny:1b") == [("tiny:1b-8bit", 8, 64), ("tiny:1b-4bit", 4, 32)]
    assert models.variants("org/Tiny-1B@main") == models.variants("tiny:1b")
    assert models.variants("other:1b-4bit") == [] and models.variants("./my-model") == []


def test_the_shipped_tags_name_their_variants():
    assert models.variants("llama3.3:70b") == [("llama3.3:70b-8bit", 8, 64), ("llama3.3:70b-4bit", 4, 64)]
    assert models.variants("qwen2.5:72b") == [("qwen2.5:72b-4bit", 4, 64)] and models.variants("mistral:7b") == []


def test_the_advisor_names_the_variant_of_models_yaml_that_would_fit(variant_tags, make_tiny, tmp_path, monkeypatch):
    from spill.admission import calibration
    from spill.admission.advisor import quantized
    from spill.admission.schedule import budget_policy
    from spill.admission.simulate import SimRow
    from spill.coordinator.estimate import advise_rows
    from spill.streamer.plan import load_plan
    monkeypatch.setenv("SPILL_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("SPILL_STREAM", "0")
    monkeypatch.setenv("SPILL_PREFILL_TOKENS", "512")   # one chunk: the budget prices no fewer on a small machine
    monkeypatch.setattr(calibration, "read_probe", lambda files: 2e9)
    folder = make_tiny("llama")
    s = budget_policy(quantized(load_plan(folder), 4, 32), "1GB", resident=True)[0].sheet
    # 4-bit: its row of 256 fits; 8-bit: its weights take more than the 0.2 row left (no slot)
    memory = str(int((sum(s.fixed.values()) + 1.2 * s.cost(1, 256)) / s.fraction))
    rows = [SimRow(0, 20, 10)]
    advice = advise_rows(folder, rows, memory=memory, name="tiny:1b")
    assert not advice.resident and advice.line.endswith("; tiny:1b-4bit would fit resident: spill run tiny:1b-4bit")
    assert "would fit" not in advise_rows(folder, rows, memory=memory, name=str(folder)).line
