"""The pass model and its fit, with passes made by a known model."""

import random

import pytest

from spill.admission.passmodel import CHUNK_PASSES, Observation, PassModel, PassShape, fit, read_rate

TRUE = PassModel(bandwidth=2e9, fixed_s=0.8, per_row_s=0.02, per_prefill_token_s=0.003,
                 per_context_token_s=2e-5, overlap=0.7, overhead_s=0.05)


def fake_passes(model: PassModel, n: int, bytes_=4_000_000_000, seed=0) -> list[Observation]:
    """Passes as an engine with this model would report them (compute and wait split accordingly)."""
    rnd = random.Random(seed)
    out = []
    for _ in range(n):
        shape = PassShape(rnd.randint(1, 128), rnd.choice([0, 0, 64, 512, 2048]), rnd.randint(0, 60000), bytes_)
        c = model.compute_s(shape)
        seconds = model.pass_s(shape)
        out.append(Observation(**vars(shape), seconds=seconds, wait_s=seconds - model.overhead_s - c, compute_s=c))
    return out


def test_the_pass_is_the_longer_term_plus_the_unhidden_part_of_the_shorter():
    shape = PassShape(10, 100, 1000, 4_000_000_000)   # IO 2.0 s, compute 0.8 + 0.2 + 0.3 + 0.02 = 1.32 s
    assert TRUE.io_s(shape) == pytest.approx(2.0)
    assert TRUE.compute_s(shape) == pytest.approx(1.32)
    assert TRUE.roofline_s(shape) == pytest.approx(2.0)
    assert TRUE.pass_s(shape) == pytest.approx(2.0 + 0.3 * 1.32 + 0.05)


def test_fit_recovers_the_compute_terms_the_overlap_and_the_overhead():
    prior = PassModel(bandwidth=2e9, fixed_s=0.3, per_row_s=0.05, per_prefill_token_s=0.001,
                      per_context_token_s=1e-4)
    got = fit(prior, fake_passes(TRUE, 120))
    for term in ("fixed_s", "per_row_s", "per_prefill_token_s", "per_context_token_s"):
        assert getattr(got, term) == pytest.approx(getattr(TRUE, term), rel=0.05), term
    assert got.overlap == pytest.approx(0.7, abs=0.02)
    assert got.overhead_s == pytest.approx(0.05, abs=1e-6)


def test_each_prefill_group_beside_the_decode_rows_is_priced_as_one_more_product():
    """Prompts paced in small chunks cost more a token than at full speed (lean45 on 2 vCPUs: 0.049 s
    against 0.034): each prefill group is its own product through every weight."""
    assert [PassShape(r, t, 0, 0, prefill_groups=g).extra_products
            for r, t, g in ((16, 0, 0), (0, 64, 1), (16, 64, 1), (0, 64, 2), (16, 96, 3))] == [0, 0, 1, 1, 3]
    true = PassModel(**{**vars(TRUE), "per_product_s": 0.5})
    prior = PassModel(**{**vars(TRUE), "per_product_s": 1.0})   # the probe's: what a lone row's product costs
    rnd, passes = random.Random(2), []
    for i in range(80):
        groups = 0 if i % 3 == 0 else rnd.randint(1, 3)
        shape = PassShape(rnd.randint(8, 20), groups * rnd.choice([32, 64, 512]), rnd.randint(0, 20000),
                          4_000_000_000, prefill_groups=groups)
        c = true.compute_s(shape)
        passes.append(Observation(**vars(shape), seconds=c + 0.05, wait_s=0.0, compute_s=c))
    got = fit(prior, passes)
    assert got.per_product_s == pytest.approx(0.5, rel=0.1)
    paced = PassShape(20, 96, 10000, 4_000_000_000, prefill_groups=3)
    assert got.compute_s(paced) == pytest.approx(true.compute_s(paced), rel=0.03)
    # the pace leaves the prompts' product room under the read: one chunk beside the decode rows
    room = got.prefill_allowance(4_000_000_000, 20, 10000)
    assert true.compute_s(PassShape(20, room, 10000, 0, prefill_groups=1)) <= true.io_s(paced) * 1.01


def test_a_few_passes_stay_near_the_prior_on_terms_they_do_not_exercise():
    prior = PassModel(bandwidth=2e9, fixed_s=0.8, per_row_s=0.02, per_prefill_token_s=0.003,
                      per_context_token_s=2e-5)
    passes = [p for p in fake_passes(TRUE, 50) if p.prefill_tokens == 0][:3]
    got = fit(prior, passes)
    assert got.per_prefill_token_s == pytest.approx(0.003, rel=0.1)


def test_read_bound_passes_replace_the_probed_bandwidth():
    slow_disk = PassModel(bandwidth=1e9, fixed_s=0.1, per_row_s=0.04, overlap=0.8)
    prior = PassModel(bandwidth=3e9, fixed_s=0.1, per_row_s=0.001)
    got = fit(prior, fake_passes(slow_disk, 10))
    assert got.bandwidth == pytest.approx(1e9, rel=0.01)
    compute_bound = fake_passes(TRUE, 10, bytes_=100_000)
    assert fit(prior, compute_bound).bandwidth == 3e9


def test_the_prefill_allowance_keeps_compute_under_the_read():
    for rows, context in ((1, 0), (16, 5000), (32, 10000)):
        n = TRUE.prefill_allowance(4_000_000_000, rows, context)
        shape = PassShape(rows, n, context, 4_000_000_000)
        assert TRUE.compute_s(shape) <= TRUE.io_s(shape)
        assert TRUE.compute_s(PassShape(rows, n + 1, context, 4_000_000_000)) > TRUE.io_s(shape)
    assert TRUE.prefill_allowance(100, 128, 0) == 1     # compute-bound already: still one token


def test_a_term_fitted_below_zero_is_dropped_and_the_others_refitted():
    """Six real passes of the 1b factory model on the dev VM (2 vCPUs, heavily shared): their noise
    fits a negative per-row cost; clipping it without refitting priced decode passes 80% high."""
    prior = PassModel(bandwidth=1.655e8, fixed_s=6.292, per_row_s=0.7426, per_prefill_token_s=0.2809,
                      per_context_token_s=1.237e-05)
    seen = [(16, 448, 177.36, 1.45, 175.04), (12, 0, 49.19, 3.78, 44.46), (10, 112, 106.28, 4.15, 101.47),
            (14, 240, 134.08, 3.77, 129.98), (11, 0, 30.32, 2.75, 27.29), (9, 80, 81.24, 2.55, 77.59)]
    passes = [Observation(r, p, 0, 1_946_288_128, s, w, c) for r, p, s, w, c in seen]
    got = fit(prior, passes)
    assert min(getattr(got, t) for t in ("fixed_s", "per_row_s", "per_prefill_token_s", "per_context_token_s")) >= 0
    errors = sorted(abs(got.pass_s(p) / p.seconds - 1) for p in passes)
    assert errors[len(errors) // 2] < 0.15


def test_what_prefill_passes_cost_beyond_their_tokens_does_not_land_on_the_decode_terms():
    """A short first job (24 rows, 16 tokens each) on the dev VM: its prefill passes cost more as the batch
    grew (long prompts' later chunks), so fitted together per_row took it: 0.29 s a row against ~0.06,
    and the next job's 20-row decode passes were priced at 5.8 s where they took 2.2."""
    prior = PassModel(bandwidth=2e9, fixed_s=0.3, per_row_s=0.017, per_prefill_token_s=0.016,
                      per_context_token_s=1e-6)
    true = PassModel(bandwidth=2e9, fixed_s=1.9, per_row_s=0.04, per_prefill_token_s=0.025, overlap=0.9)
    rnd, passes = random.Random(1), []
    for i in range(44):
        rows = rnd.randint(1, 14)
        tokens = 0 if i % 3 == 0 else rnd.randint(400, 512)
        extra = 0.7 * rows if tokens else 0.0     # not in the model: it grows with the rows beside the chunk
        c = true.compute_s(PassShape(rows, tokens, 0, 0)) + extra
        passes.append(Observation(rows, tokens, 0, 2_666_373_120, c + 0.1, 0.1, c))
    got = fit(prior, passes)
    decode20 = PassShape(20, 0, 0, 2_666_373_120)
    assert got.compute_s(decode20) == pytest.approx(true.compute_s(decode20), rel=0.1)


def test_reads_the_streamer_timed_inside_passes_set_the_bandwidth_though_compute_bound():
    """The dev VM's cold-read probe said 0.97 GB/s; compute-bound passes (never read-bound) kept it, and
    priced every decode pass of a 2.67 GB model at 2.75 s of IO where its reads took ~1.5 s."""
    prior = PassModel(bandwidth=0.97e9, fixed_s=1.9, per_row_s=0.05)
    passes = [Observation(12, 0, 0, 2_666_373_120, 2.3, 0.05, 2.25, read_s=1.5 + 0.01 * i) for i in range(5)]
    got = fit(prior, passes)
    assert got.bandwidth == pytest.approx(2_666_373_120 / 1.52, rel=0.01)
    assert got.pass_s(PassShape(12, 0, 0, 2_666_373_120)) == pytest.approx(2.3, rel=0.05)
    untimed = [Observation(**{**vars(p), "read_s": 0.0}) for p in passes]
    assert fit(prior, untimed).bandwidth == 0.97e9


def test_a_single_row_pass_does_not_price_the_batched_passes_per_row():
    """The three-tier job's last 200 passes on the dev VM: its lone long row's decode passes computed in
    ~1.2 s (a matrix-vector product) and 12-row passes in ~3.3 s (OpenBLAS packs every weight for a
    product), so a line through them priced a row at 0.19 s and a 74-row pass at 15 s where it took ~4."""
    def true(rows, tokens, context):   # 2.0 s of packing once a pass carries more than one row
        return 1.2 + 2.0 * (rows + tokens > 1) + 0.012 * rows + 0.025 * tokens + 1e-5 * context

    prior = PassModel(bandwidth=0.5e9, fixed_s=0.5, per_row_s=0.0144, per_prefill_token_s=0.016, per_context_token_s=2e-6)
    rnd, passes = random.Random(2), []
    for i in range(200):
        rows, tokens = (1, 0) if i % 2 else (rnd.randint(2, 24), rnd.choice([0, 0, 0, 512]))
        context = rows * rnd.randint(300, 1000)
        c = true(rows, tokens, context) * rnd.uniform(0.95, 1.05)
        passes.append(Observation(rows, tokens, context, 2_730_000_000, c + 0.3, 0.3, c, read_s=3.0))
    got = fit(prior, passes)
    for rows in (1, 12, 74):
        assert got.compute_s(PassShape(rows, 0, rows * 600, 0)) == pytest.approx(true(rows, 0, rows * 600), rel=0.1), rows


def test_passes_of_one_row_leave_the_per_row_price_to_the_prior():
    """A first job's opening passes on the dev VM: a prompt chunk each beside 0 or 1 decoding row. Fitted
    freely, a row took the fixed cost (0.95 s a row, fixed 0), and the live ETA of 30 rows went 17 -> 69 min."""
    prior = PassModel(bandwidth=1.16e9, fixed_s=0.82, per_row_s=0.035, per_prefill_token_s=0.026, overlap=0.97)
    seen = [(0, 56, 1.94), (0, 56, 1.95), (0, 74, 2.81), (0, 74, 3.36), (0, 64, 3.07), (0, 64, 3.17), (0, 42, 2.4),
            (1, 0, 0.82), (1, 64, 3.42), (1, 62, 3.47), (1, 62, 3.58), (1, 62, 3.62), (1, 62, 3.55), (1, 62, 3.64),
            (1, 62, 3.45), (1, 62, 3.73), (1, 62, 3.81), (1, 62, 3.99), (1, 62, 4.18), (1, 62, 4.22)]
    passes = [Observation(r, t, 0, 2_666_373_120, c + 0.1, 0.1, c, read_s=2.8) for r, t, c in seen]
    got = fit(prior, passes)
    assert got.per_row_s == prior.per_row_s
    assert got.compute_s(PassShape(16, 0, 0, 0)) < 2.5


def test_a_warm_up_of_few_decode_passes_leaves_the_price_of_context_to_the_probe():
    """A 24-row warm-up on lean45 (2 vCPUs): its 15 decode passes carry ~450 tokens of context a row, so
    rows and context move together. Fitted freely, context went to 0 and a row to 0.05-0.07 s, which priced
    the 60-row job's decode passes 9% short; the probe had timed attention at 1.0e-4 s a token."""
    prior = PassModel(bandwidth=6.7e8, fixed_s=1.27, per_row_s=0.032, per_prefill_token_s=0.027,
                      per_context_token_s=1.03e-4, overlap=0.67)
    seen = [(0, 51, 0, 3.12), (1, 0, 52, 1.48), (2, 431, 485, 17.7), (3, 571, 547, 22.93), (5, 826, 1890, 36.2),
            (8, 828, 3298, 33.11), (12, 877, 4757, 36.25), (16, 571, 6220, 24.68), (23, 829, 10393, 32.8),
            (23, 0, 10416, 2.75), (22, 0, 9991, 2.63), (21, 0, 9937, 2.55), (19, 0, 8586, 2.45), (18, 0, 8534, 2.38),
            (16, 0, 7178, 2.17), (15, 0, 7128, 2.35), (12, 0, 5703, 1.92), (11, 0, 5647, 2.22), (9, 0, 4315, 1.83),
            (8, 0, 4248, 1.65), (6, 0, 2879, 1.7), (5, 0, 2813, 1.52), (3, 0, 1443, 1.53), (2, 0, 1373, 1.43)]
    passes = [Observation(r, t, ctx, 2_666_373_120, c + 2.0, 2.0, c, read_s=4.0) for r, t, ctx, c in seen]
    got = fit(prior, passes)
    assert got.per_context_token_s == prior.per_context_token_s
    # the 60-row job's decode passes of its 900-token tier: 8 rows, ~950 tokens of context each, 2.2 s
    assert got.compute_s(PassShape(8, 0, 7500, 0)) == pytest.approx(2.2, rel=0.1)


def test_a_read_bound_pass_runs_past_its_read_by_a_tail_the_compute_bound_ones_do_not_show():
    """The 200-row job on lean45 (2 vCPUs): decode passes ran 0.36 s past their reads at 1.6-3.5 s of compute
    (0.37 in its warm-up), prefill passes 0.13 s past their compute (3.9 s of reads). One overlap, fitted on
    the compute-bound ones, priced every decode pass 0.26 s short: 6% of a job of 1,200 decode passes."""
    engine = PassModel(bandwidth=6.75e8, fixed_s=1.2, per_row_s=0.05, per_prefill_token_s=0.03, overlap=0.97,
                       overhead_s=0.01, read_tail_s=0.35)
    rnd, passes = random.Random(3), []
    for i in range(120):
        shape = PassShape(rnd.randint(8, 24), 0 if i % 4 else rnd.randint(300, 900), 0, 2_666_373_120)
        c, io = engine.compute_s(shape), engine.io_s(shape) * rnd.uniform(0.97, 1.03)
        seconds = io + 0.35 + 0.01 if io >= c else engine.pass_s(shape)
        passes.append(Observation(**vars(shape), seconds=seconds, wait_s=seconds - c - 0.01, compute_s=c, read_s=io))
    got = fit(PassModel(bandwidth=7.4e8, fixed_s=1.0, per_row_s=0.04, per_prefill_token_s=0.026), passes)
    assert got.read_tail_s == pytest.approx(0.35, abs=0.01) and got.overlap == pytest.approx(0.97, abs=0.02)
    for shape in (PassShape(22, 0, 0, 2_666_373_120), PassShape(20, 600, 0, 2_666_373_120)):
        assert got.pass_s(shape) == pytest.approx(engine.pass_s(shape), rel=0.02)
    assert PassModel(**{**vars(engine), "read_tail_s": None}).pass_s(passes[1]) < 0.95 * passes[1].seconds


def test_the_bandwidth_is_the_rate_of_the_reads_that_passes_waited_on():
    """The same job: reads inside its compute-bound prefill passes ran at 0.84 GB/s, inside its read-bound
    decode passes at 0.68 (the warm-up's: 0.94 and 0.66). The median of every pass, 0.88 GB/s from a warm-up
    of half prefill passes, priced the job's decode passes 25% short of the reads they waited on."""
    passes = [Observation(20, 0, 0, 2_666_373_120, 4.3, 2.0, 2.3, read_s=2_666_373_120 / 0.68e9) for _ in range(5)]
    passes += [Observation(8, 500, 0, 2_666_373_120, 20.1, 0.1, 20.0, read_s=2_666_373_120 / 0.84e9)
               for _ in range(6)]
    assert fit(PassModel(bandwidth=1e9, fixed_s=1.0), passes).bandwidth == pytest.approx(0.68e9)
    assert read_rate([(2e9, 1.0, 9.0)] * 6) == 2e9   # no pass waited on its read: every timed read counts
    assert read_rate([(2e8, 1.0, 0.1)] * 6, least=1 << 28) is None   # a small pass times its calls, not the disk


def test_the_keys_a_prompt_token_scores_are_priced_from_the_passes_that_differ_in_them():
    """Paced chunks of long prompts attend to the prompt their earlier chunks cached (lean45 on 2 vCPUs: a late
    chunk of a 900-token prompt cost 1.6-2x an early one; chunks of ~90 tokens 0.029-0.030 s a token against
    0.027 for whole prompts), and a long chunk to more of itself. Priced per token alone, late chunks were priced
    short and early ones long."""
    true = PassModel(**{**vars(TRUE), "per_product_s": 0.2, "per_prefill_context_s": 3e-6})
    prior = PassModel(**{**vars(TRUE), "per_product_s": 0.2})      # the probe's: no price for it
    rnd, passes = random.Random(4), []
    for i in range(90):
        tokens = 0 if i % 3 == 0 else rnd.choice([64, 96, 300, 512])
        cached = 0 if not tokens else tokens * (rnd.choice([0, 0, 128, 400, 800]) + tokens)   # cached + chunk
        shape = PassShape(rnd.randint(8, 20), tokens, rnd.randint(0, 20000), 4_000_000_000,
                          prefill_groups=int(tokens > 0), prefill_context=cached)
        c = true.compute_s(shape)
        passes.append(Observation(**vars(shape), seconds=c + 0.05, wait_s=0.0, compute_s=c))
    got = fit(prior, passes)
    assert got.per_prefill_context_s == pytest.approx(3e-6, rel=0.1)
    late = PassShape(16, 96, 10000, 0, prefill_groups=1, prefill_context=96 * (800 + 96))
    assert got.compute_s(late) == pytest.approx(true.compute_s(late), rel=0.02)
    # fewer than CHUNK_PASSES passes scoring twice the keys a token of the fewest does: the prior's price (none) stays
    keys = lambda p: p.prefill_context / p.prefill_tokens
    prompts = sorted((p for p in passes if p.prefill_tokens), key=keys)
    alike = [p for p in prompts if keys(p) < 2 * keys(prompts[0])]
    few = [p for p in passes if not p.prefill_tokens] + alike + prompts[len(alike):len(alike) + CHUNK_PASSES - 1]
    assert len(alike) >= 10 and fit(prior, few).per_prefill_context_s == 0.0


def test_the_allowance_prices_the_prompt_its_tokens_find_cached():
    model = PassModel(**{**vars(TRUE), "per_prefill_context_s": 3e-6})
    for offset in (0, 300, 800):
        n = model.prefill_allowance(4_000_000_000, 16, 5000, offset)
        shape = PassShape(16, n, 5000, 4_000_000_000, prefill_context=n * offset)
        assert model.compute_s(shape) <= model.io_s(shape) * (1 + 1e-9)
        more = PassShape(16, n + 1, 5000, 4_000_000_000, prefill_context=(n + 1) * offset)
        assert model.compute_s(more) > model.io_s(shape)
    assert model.prefill_allowance(4_000_000_000, 16, 5000, 800) < model.prefill_allowance(4_000_000_000, 16, 5000)


def test_a_drafting_pass_costs_what_passes_measured_beyond_its_padded_shape():
    """A small model read from an H100's disk: a pass 95 ms, and a pass with drafts 64 ms more (lookup, the longer
    head, verification) though its padded compute still hides under the read."""
    from spill.admission.drafts import padded
    engine = PassModel(bandwidth=2.8e9, fixed_s=0.01, per_row_s=2e-4, overlap=0.95, overhead_s=0.002, read_tail_s=0.0)
    rnd, passes = random.Random(5), []
    for i in range(90):
        shape = PassShape(16, 0, rnd.randint(2000, 6000), 266_000_000)
        if i % 3:
            shape = padded(shape, rnd.randint(2, 5))
        c = engine.compute_s(shape)
        seconds = engine.pass_s(shape) + (0.064 if shape.columns > 1 else 0.0)
        passes.append(Observation(**vars(shape), seconds=seconds, wait_s=seconds - c - 0.002, compute_s=c,
                                  read_s=engine.io_s(shape)))
    got = fit(PassModel(bandwidth=2.5e9, fixed_s=0.01, per_row_s=2e-4), passes)
    assert got.draft_s == pytest.approx(0.064, abs=0.005)
    plain, drafting = PassShape(16, 0, 4000, 266_000_000), padded(PassShape(16, 0, 4000, 266_000_000), 5)
    assert got.pass_s(drafting) == pytest.approx(engine.pass_s(drafting) + 0.064, rel=0.03)
    assert got.pass_s(plain) == pytest.approx(engine.pass_s(plain), rel=0.03)
    assert fit(got, [p for p in passes if p.columns == 1]).draft_s == got.draft_s   # no drafting pass: kept


def test_a_pass_that_computes_longer_is_never_priced_shorter_where_read_bound_passes_timed_their_tail():
    """As fitted on the VM (8-bit KV, one row left): read-bound, a pass runs 0.13 s past its 0.23 s read; the same
    row with 4 drafts computes 0.28 s, past the read, and was priced at that alone, below the plain pass."""
    vm = PassModel(bandwidth=9.4e8, fixed_s=0.193, per_row_s=0.0055, per_context_token_s=3.76e-5, overlap=1.0,
                   read_tail_s=0.134)
    from spill.admission.drafts import padded
    plain = PassShape(1, 0, 327, 212_405_760)
    assert vm.compute_s(plain) < vm.io_s(plain) < vm.compute_s(padded(plain, 5))
    assert vm.pass_s(padded(plain, 5)) >= vm.pass_s(plain)
    for columns in range(1, 9):   # more columns never cost less
        assert vm.pass_s(padded(plain, columns + 1)) >= vm.pass_s(padded(plain, columns))


def test_a_pass_that_reads_nothing_pays_no_read_tail():
    """A resident pass (nothing read) is its compute: the tail past a read is a read's, not every pass's (the demo's
    resident passes, 0.08 s each, were priced at the 0.13 s tail the first pass timed)."""
    model = PassModel(bandwidth=1e9, fixed_s=0.05, per_row_s=0.001, overlap=1.0, read_tail_s=0.13, overhead_s=0.01)
    resident = PassShape(20, 0, 400, 0)
    assert model.pass_s(resident) == pytest.approx(model.compute_s(resident) + 0.01)
