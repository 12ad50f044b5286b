"""A micro-batched pipeline over MLX's ring backend on loopback: the greedy tokens of mlx-lm's own model."""

import json
import multiprocessing
from concurrent.futures import ProcessPoolExecutor

import mlx.core as mx
import pytest

from spill.stages import launch
from spill.stages.pipeline import left_padded, micro_batches
from spill.stages.split import stage_shares
from spill.streamer.plan import load_plan

PROMPTS = [[5, 9, 13, 2, 7], [30, 31], list(range(40, 60)), [3] * 17, [11, 12, 13, 14, 15, 16, 17], [100, 200, 300]]
MAX_TOKENS = 8
ring = pytest.mark.skipif(not mx.distributed.is_available("ring"), reason="this MLX build has no ring backend")


def test_micro_batches_are_contiguous_and_even():
    assert micro_batches(6, 3) == [range(0, 2), range(2, 4), range(4, 6)]
    assert micro_batches(7, 3) == [range(0, 2), range(2, 4), range(4, 7)]
    assert micro_batches(2, 3) == [range(0, 1), range(1, 2)]   # never an empty micro-batch


def test_prompts_are_padded_on_the_left():
    ids, pads = left_padded([[1, 2, 3], [7]])
    assert ids.tolist() == [[1, 2, 3], [0, 0, 7]] and pads == [0, 2]


def _mlx_lm_greedy(folder: str, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """mlx-lm's own model, resident, and its generate loop, a row at a time (in a process of its own)."""
    from pathlib import Path

    from mlx_lm.utils import load_model

    from spill.streamer.reference import resident_reference
    model, _ = load_model(Path(folder))
    model.set_dtype(mx.float32)
    return [resident_reference(model, p, max_tokens, eos=set())[0] for p in prompts]


def _ranks(n: int, folder, tmp_path, *extra):
    (tmp_path / "prompts.json").write_text(json.dumps(PROMPTS))
    out = tmp_path / f"tokens{n}.json"
    argv = ["-m", "spill.stages.run", str(folder), str(tmp_path / "prompts.json"), "--max-tokens", str(MAX_TOKENS),
            "--micro-batches", "3", "--out", str(out), *extra]
    return launch.spawn(n, argv), out


@ring
def test_two_and_three_stages_give_mlx_lms_greedy_tokens_row_for_row(make_tiny, tmp_path):
    folder = make_tiny("llama", "float32", "256KB")
    two, out2 = _ranks(2, folder, tmp_path, "--link")
    three, out3 = _ranks(3, folder, tmp_path)
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        expected = pool.submit(_mlx_lm_greedy, str(folder), PROMPTS, MAX_TOKENS).result(timeout=120)
    reports = {}
    for procs, out, n in ((two, out2, 2), (three, out3, 3)):
        ranks = launch.wait(procs, timeout=120)
        assert all(rc == 0 for rc, _, _ in ranks), [err[-800:] for _, _, err in ranks]
        reports[n] = [json.loads(stdout.strip().splitlines()[-1]) for _, stdout, _ in ranks]
        assert json.loads(out.read_text()) == expected, f"{n} ranks"
    plan = load_plan(folder)
    for n, stages in reports.items():   # each rank holds its share alone: its layers, what surrounds them
        shares = stage_shares(plan, n, by_compute=True)   # every stage resident
        assert [s["layers"] for s in stages] == [[s.layers.start, s.layers.stop] for s in shares]
        assert [s["bytes"] for s in stages] == [s.bytes for s in shares]
    # every hop of the 2-rank ring measured, on every rank alike
    links = reports[2][0]["links"]
    assert len(links) == 2 and links == reports[2][1]["links"]
    assert all(0 < link["latency_s"] < 1 and link["bandwidth"] > 1e6 for link in links)
