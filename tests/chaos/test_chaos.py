"""One chaos trial of each scenario in CI (tests/chaos/chaos.py runs 20 by hand): no row lost, duplicated,
wrong or changed; a fault the user must fix is one sentence, never a traceback."""

import os

import pytest

from tests.coordinator.group_util import resident_texts

from . import chaos

ROOT = os.geteuid() == 0     # the filesystem scenarios mount a tmpfs


@pytest.fixture(scope="module")
def job(make_tiny, tmp_path_factory, llama_calibration):   # calibrated: the stop trial's own home copies it
    model = make_tiny("llama")
    inp = tmp_path_factory.mktemp("chaos") / "in.jsonl"
    return model, inp, resident_texts(model, chaos.write_job(inp))


@pytest.mark.parametrize("scenario", ["kill", "stop", "disk", "readonly"])
def test_a_fault_mid_job_loses_nothing(job, tmp_path, scenario):
    if scenario in ("disk", "readonly") and not ROOT:
        pytest.skip("mounting a tmpfs needs root")
    model, inp, expected = job
    (r,) = chaos.run_trials(scenario, 1, model, tmp_path, expected, inp, seed=int.from_bytes(os.urandom(2), "little"))
    assert (r["lost"], r["duplicated"], r["wrong"], r["changed"], r["tracebacks"], r["exit"]) == (0, 0, 0, 0, 0, 0), r
    assert r["rows"] == len(expected)
    if scenario == "stop":
        assert r["hung_restarts"] == (1 if r["victim"] == "streamer (SIGSTOP)" else 0), r
    if scenario == "disk" and r["grew"] > r["slack"]:   # the rows after the fill needed a new page
        assert r["resumes"] >= 1 and r["said"][0].startswith("spill: no space left to write "), r
    if scenario == "readonly":
        assert r["resumes"] >= 1 and "(Read-only file system)" in r["said"][0], r


def test_an_unwritable_spill_home_is_one_sentence(job, tmp_path):
    if not ROOT:
        pytest.skip("mounting a tmpfs needs root")
    model, inp, expected = job
    (r,) = chaos.run_trials("home", 1, model, tmp_path, expected, inp)
    assert r["exit"] == 2 and r["tracebacks"] == 0 and len(r["said"]) == 1, r
    assert r["said"][0].startswith("spill: cannot write to ") and "(Read-only file system); set SPILL_HOME" in r["said"][0]
