"""The simulator: the scheduler against the pass model, with a fake clock."""

import random

import numpy as np
import pytest

from spill.admission.passmodel import Observation, PassModel, fit
from spill.admission.policy import BudgetPolicy, Waiting
from spill.admission.prices import Sheet
from spill.admission import schedule
from spill.admission.scheduler import Scheduler, Status
from spill.admission.simulate import SimRow, simulate, tier_of

TRUE = PassModel(bandwidth=2e9, fixed_s=0.5, per_row_s=0.01, per_prefill_token_s=0.002,
                 per_context_token_s=1e-5, per_product_s=0.3, per_prefill_context_s=2e-6, overlap=0.6, overhead_s=0.05)
BYTES = 4_000_000_000


def FifoPolicy(max_rows=64, prefill_tokens=4096):
    """The budget policy with memory to spare: first in, first out under its caps."""
    return BudgetPolicy(Sheet(2**40, kv_per_token=1), max_rows=max_rows, prefill_tokens=prefill_tokens)


def waiting(r: SimRow) -> Waiting:
    return Waiting(r.row, np.zeros(r.prompt, np.int32), r.max_tokens or r.out)


def job(n=150, seed=1):
    rnd = random.Random(seed)
    rows = []
    for i in range(n):
        prompt = rnd.choice([45, 420, 900])
        rows.append(SimRow(i, prompt, rnd.randint(20, 128)))
    return rows


def run_fake(rows, policy, model=TRUE, seed=0):
    """The admission actor's scheduler with passes timed by TRUE with +-5% noise, each reported as the
    streamer reports it: the job's measured total and its passes' observations."""
    by_id, rnd, clock, seen = {r.row: r for r in rows}, random.Random(seed), 0.0, []
    sched = Scheduler(policy, lambda *a: schedule.pace(model, BYTES, *a), 512, BYTES)
    sched.offer([waiting(r) for r in rows])
    schedule.interleave(policy.queue, schedule.prompt_length)
    while sched.busy:
        planned = sched.plan()
        shape = planned.shape
        seconds = TRUE.pass_s(shape) * rnd.uniform(0.95, 1.05)
        compute = TRUE.compute_s(shape) * seconds / TRUE.pass_s(shape)
        clock += seconds
        seen.append(Observation(shape.decode_rows, shape.prefill_tokens, shape.context_tokens, BYTES, seconds,
                                max(seconds - 0.05 - compute, 0), compute, prefill_groups=shape.prefill_groups,
                                prefill_context=shape.prefill_context))
        sched.reported([r for r in policy.running
                        if sched.status[r] == Status.DECODING and sched.generated[r] >= by_id[r].out])
    return clock, seen


def test_the_simulator_reproduces_a_fake_engines_total_within_2_percent():
    rows = job()
    measured, seen = run_fake(rows, FifoPolicy(max_rows=32, prefill_tokens=2048))
    prior = PassModel(bandwidth=2e9, fixed_s=1.0, per_row_s=0.02, per_prefill_token_s=0.001, per_context_token_s=1e-4)
    for model in (TRUE, fit(prior, seen)):          # the engine's own model, and one refitted from its passes
        est = simulate(rows, FifoPolicy(max_rows=32, prefill_tokens=2048), waiting,
                       model, BYTES)
        assert est.total_seconds == pytest.approx(measured, rel=0.02)
        # the refit's terms, a little off the engine's, move a full-speed fill by a pass or two (schedule.fill_now)
        assert est.passes == (len(seen) if model is TRUE else pytest.approx(len(seen), rel=0.01))
        assert est.timeline[-1][1] == len(rows)


def test_tiers_report_rows_prompt_tokens_batch_passes_and_time():
    rows = [SimRow(0, 100, 3), SimRow(1, 100, 3), SimRow(2, 1000, 2)]
    roomy = PassModel(**{**vars(TRUE), "per_prefill_token_s": 1e-6})     # every prompt fits one pass
    est = simulate(rows, FifoPolicy(max_rows=8, prefill_tokens=4096), waiting, roomy, BYTES, chunk=512)
    short, long_ = est.tiers
    assert (short.rows, short.prompt_tokens, long_.rows, long_.prompt_tokens) == (2, 200, 1, 1000)
    # pass 1: prefill 100+100+512, the short rows' first tokens; pass 2: they decode, the long row
    # prefills its last 488 tokens and emits its first; pass 3: every row's last token
    assert est.passes == 3 and est.prefill == [712, 488, 0]
    assert short.passes == long_.passes == 3 and short.batch == 2 and long_.batch == 1
    assert est.timeline[-1] == (est.total_seconds, 3)
    assert est.total_seconds == pytest.approx(sum(t.seconds for t in est.tiers))


def test_rows_the_policy_refuses_are_counted_as_errors_not_priced():
    class Refusing(BudgetPolicy):
        def offer(self, rows):
            super().offer([w for w in rows if len(w.prompt) < 500])
            return [(w, "too long") for w in rows if len(w.prompt) >= 500]
    rows = [SimRow(0, 100, 3), SimRow(1, 900, 3)]
    est = simulate(rows, Refusing(Sheet(2**40, kv_per_token=1)), waiting, TRUE, BYTES, errors=2)
    assert est.errors == 3 and est.timeline[-1][1] == 1 and not est.stalled


def test_resident_the_first_pass_reads_the_weights_and_later_ones_nothing():
    rows = [SimRow(i, 40, 12) for i in range(8)]
    streamed = simulate(rows, FifoPolicy(), waiting, TRUE, BYTES)
    resident = simulate(rows, FifoPolicy(), waiting, TRUE, 0, read_once=BYTES)
    first = streamed.timeline[0][0]
    assert resident.passes == streamed.passes and resident.timeline[0][0] == pytest.approx(first)
    later = [b - a for (a, _), (b, _) in zip(resident.timeline, resident.timeline[1:])]
    assert all(s < BYTES / TRUE.bandwidth for s in later)     # compute alone, under the read time
    assert resident.total_seconds < streamed.total_seconds


def test_a_resident_pipeline_is_priced_as_its_stages_run_it_and_a_streamed_one_as_one_process():
    """Rounds (SPILL_ROUNDS) and prompts in micro-batches, as admission plans them for a resident pipeline."""
    rows = [SimRow(i, 40, 10 + i % 7) for i in range(24)]
    one = simulate(rows, FifoPolicy(), waiting, TRUE, 0, read_once=BYTES)
    three = simulate(rows, FifoPolicy(), waiting, TRUE, 0, read_once=BYTES, stages=3)
    assert three.timeline[-1][1] == one.timeline[-1][1] == 24        # every row ends, at its own token count
    assert three.passes < one.passes and three.total_seconds < one.total_seconds
    streamed = simulate(rows, FifoPolicy(), waiting, TRUE, BYTES, stages=3)
    assert streamed.total_seconds == simulate(rows, FifoPolicy(), waiting, TRUE, BYTES).total_seconds


def test_running_rows_already_prefilled_only_decode_what_they_have_left():
    """The live ETA re-simulates the rows left: a running row's prompt is in its KV already, so it is
    not prefilled again (it was, and the ETA at 75% of a job was 10x the time left)."""
    rows = [SimRow(i, 900, 10, context=950) for i in range(4)] + [SimRow(9, 45, 3)]
    est = simulate(rows, FifoPolicy(), waiting, TRUE, BYTES)
    assert est.prefill[0] == 45 and sum(est.prefill) == 45    # only the waiting row's prompt
    assert est.passes == 10                                     # the running rows' 10 steps, at once


def test_a_prompts_later_chunks_are_priced_for_the_prompt_they_attend_to():
    """A chunk attends to the prompt its earlier chunks cached (lean45 on 2 vCPUs: a late chunk of a 900-token
    prompt cost 1.6-2x an early one) and to itself: the simulator carries those keys into each pass's price."""
    rows = [SimRow(0, 900, 2)]
    flat = PassModel(**{**vars(TRUE), "per_prefill_context_s": 0.0})
    priced = simulate(rows, FifoPolicy(), waiting, TRUE, 0, chunk=300, read_once=BYTES)   # resident: compute alone
    plain = simulate(rows, FifoPolicy(), waiting, flat, 0, chunk=300, read_once=BYTES)
    assert priced.prefill == plain.prefill == [300, 300, 300, 0]
    gaps = [b - a for (a, _), (b, _) in zip(priced.timeline, priced.timeline[1:])]
    plain_gaps = [b - a for (a, _), (b, _) in zip(plain.timeline, plain.timeline[1:])]
    first = priced.timeline[0][0] - plain.timeline[0][0]
    assert first == pytest.approx((1 - TRUE.overlap) * 300 * 300 * 2e-6)   # the first chunk: its own keys, under the read
    assert gaps[0] - plain_gaps[0] == pytest.approx(300 * 600 * 2e-6)      # the second: 300 cached and its 300
    assert gaps[1] - plain_gaps[1] == pytest.approx(300 * 900 * 2e-6)      # the third: 600 and its 300


def test_the_ideal_stays_below_the_estimate_when_passes_are_compute_bound():
    """Nothing streamed (resident): every pass is compute, so the ideal must not charge a prompt group's
    product to every decode pass; it did, and the demo's estimate read 0.79x its ideal."""
    rows = [SimRow(i, 26, 256) for i in range(20)]
    est = simulate(rows, FifoPolicy(), waiting, TRUE, 0, max_batch=lambda r: 20)
    assert 0 < est.ideal_seconds <= est.total_seconds


def test_the_ideal_is_the_whole_jobs_where_a_few_long_rows_share_the_short_rows_passes():
    """A mixed job's passes serve every tier at once. The ideal summed each tier's passes as if the tiers
    ran apart, so three long rows were charged 64 read-bound passes of their own, and the 53-row
    mixed-length job's estimate read 0.93x its ideal."""
    rows = [SimRow(i, 30, 64) for i in range(40)] + [SimRow(40 + i, 900, 64) for i in range(3)]
    est = simulate(rows, FifoPolicy(), waiting, TRUE, BYTES, max_batch=lambda r: 50 if r.prompt < 128 else 12)
    assert 0 < est.ideal_seconds <= est.total_seconds
    assert est.ideal_seconds == pytest.approx(sum(t.ideal_seconds for t in est.tiers))
    # the whole job needs at least its longest row's passes, each at least the model's read
    assert est.ideal_seconds >= 64 * BYTES / TRUE.bandwidth


def test_the_simulated_schedule_is_the_one_a_real_streamed_run_plays(make_tiny, monkeypatch):
    """The estimate's passes, per tier too, against the same scheduler driving the real streamer on a model's
    weights (rows ending where the model ends them: EOS or max_tokens), not a fake that shares its rules."""
    from spill.streamer.core import PassPlan, Row, Streamer
    monkeypatch.setenv("SPILL_PREFILL_TOKENS", "64")          # the pace without a pass model: 64 tokens a pass
    folder, rnd = make_tiny("llama"), random.Random(3)
    eos = frozenset(range(0, 1000, 9))                       # a ninth of the ids end a row: some end early
    prompts = [[rnd.randrange(3, 200) for _ in range(rnd.choice([6, 12, 150, 170]))] for _ in range(20)]
    rows = [SimRow(i, len(p), rnd.randint(4, 24)) for i, p in enumerate(prompts)]

    def policy():
        return BudgetPolicy(Sheet(2**34, kv_per_token=1), max_rows=6, prefill_tokens=64)
    sched = Scheduler(policy(), lambda *a: schedule.pace(None, 0, *a), 64)
    sched.offer([Waiting(r.row, np.array(prompts[r.row], np.int32), r.out) for r in rows])
    schedule.interleave(sched.policy.queue, schedule.prompt_length)
    streamer, emitted, tiers = Streamer(folder, prefill_chunk=64), {r.row: 0 for r in rows}, {}
    while sched.busy:
        planned = sched.plan()
        start = [(Row(w.row, w.prompt.tolist(), w.max_tokens, eos_ids=eos, width=w.width), g) for w, g in planned.start]
        report = streamer.run(PassPlan(start, planned.chunks, planned.drop, planned.finish, planned.pools))
        for e in report.emitted:
            emitted[e.row_id] += 1
        for r in sched.policy.running:
            tiers.setdefault(tier_of(rows[r].prompt), set()).add(sched.index)
        sched.reported(report.left)
    streamer.close()
    assert any(emitted[r.row] < r.out for r in rows)          # some rows ended on EOS, before max_tokens
    played = [SimRow(r.row, r.prompt, emitted[r.row], max_tokens=r.out) for r in rows]
    est = simulate(played, policy(), waiting, TRUE, 0, chunk=64)
    assert est.passes == pytest.approx(sched.index, rel=0.05)
    assert {t.name: t.passes for t in est.tiers} == pytest.approx({k: len(v) for k, v in tiers.items()}, rel=0.05)


READ_BOUND = PassModel(bandwidth=1e9, fixed_s=0.1, per_row_s=1e-3, overlap=1.0)         # 4 s of reading a pass
COMPUTE_BOUND = PassModel(bandwidth=1e12, fixed_s=0.1, per_row_s=0.05, overlap=1.0)     # 4 ms of reading


def test_drafts_at_a_measured_acceptance_finish_in_the_passes_tokens_per_row_predicts():
    from spill.admission.drafts import tokens_per_row
    rows = [SimRow(i, 16, 61) for i in range(20)]
    off = simulate(rows, FifoPolicy(), waiting, READ_BOUND, BYTES)
    on = simulate(rows, FifoPolicy(), waiting, READ_BOUND, BYTES, speculate=4, acceptance=0.6)
    # one pass prefills and samples each row's first token; the other 60 come tokens_per_row(0.6, 4) a pass on
    # average, and the job lasts as long as its unluckiest row
    assert off.passes == 61
    assert 0.9 < (on.passes - 1) / (60 / float(tokens_per_row(0.6, 4))) < 1.35
    assert on.timeline[-1][1] == len(rows) and on.total_seconds < 0.6 * off.total_seconds
    assert (on.drafts["speculate"], on.drafts["acceptance"]) == (4, 0.6) and on.drafts["passes"] >= on.passes - 2
    assert on.drafts["tokens_per_decode_row"] == pytest.approx(float(tokens_per_row(0.6, 4)), rel=0.1)


def test_a_rows_drafts_are_taken_at_its_prompt_tiers_acceptance_not_the_models():
    # open questions (short prompts) accept 0.3 of drafts where the model's documents (long) accept 0.9
    short, long_ = [SimRow(i, 40, 61) for i in range(20)], [SimRow(i, 900, 61) for i in range(20, 24)]
    tiers = {tier_of(40): 0.3, tier_of(900): 0.95}
    priced = simulate(short, FifoPolicy(), waiting, READ_BOUND, BYTES, speculate=4, acceptance=0.9, by_tier=tiers)
    own = simulate(short, FifoPolicy(), waiting, READ_BOUND, BYTES, speculate=4, acceptance=0.3)
    model = simulate(short, FifoPolicy(), waiting, READ_BOUND, BYTES, speculate=4, acceptance=0.9)
    assert (priced.passes, priced.total_seconds) == (own.passes, own.total_seconds)
    assert priced.total_seconds > 1.5 * model.total_seconds
    assert (priced.drafts["acceptance"], priced.drafts["tiers"]) == (0.9, {"short (<=128)": 0.3})
    mixed = simulate(short + long_ + [SimRow(30, 300, 61)], FifoPolicy(), waiting, READ_BOUND, BYTES, speculate=-1,
                     acceptance=0.9, by_tier=tiers)   # a tier not measured: the model's
    assert mixed.drafts["tiers"] == {"short (<=128)": 0.3, "medium (<=640)": 0.9, "long (>640)": 0.95}


def test_drafts_without_a_measured_acceptance_are_not_priced_but_said():
    rows = [SimRow(i, 16, 30) for i in range(8)]
    off = simulate(rows, FifoPolicy(), waiting, READ_BOUND, BYTES)
    unpriced = simulate(rows, FifoPolicy(), waiting, READ_BOUND, BYTES, speculate=-1)
    assert (unpriced.passes, unpriced.total_seconds) == (off.passes, off.total_seconds)
    assert unpriced.drafts["speculate"] == "auto" and unpriced.drafts["acceptance"] is None


def test_auto_drafts_nothing_where_passes_are_compute_bound():
    rows = [SimRow(i, 16, 30) for i in range(20)]
    off = simulate(rows, FifoPolicy(), waiting, COMPUTE_BOUND, BYTES)
    auto = simulate(rows, FifoPolicy(), waiting, COMPUTE_BOUND, BYTES, speculate=-1, acceptance=0.8)
    assert (auto.passes, auto.total_seconds, auto.drafts) == (off.passes, off.total_seconds, None)
    read_bound = simulate(rows, FifoPolicy(), waiting, READ_BOUND, BYTES, speculate=-1, acceptance=0.8)
    assert read_bound.passes < 0.6 * off.passes      # the same rows where the read is the pass's cost
    forced = simulate(rows, FifoPolicy(), waiting, COMPUTE_BOUND, BYTES, speculate=4, acceptance=0.8)
    # K drafts anyway: fewer passes, each priced as 5 columns for every decode row
    assert forced.passes < off.passes and forced.total_seconds / forced.passes > 2 * off.total_seconds / off.passes


# a small streamed model on two CPU cores, as calibrated: one draft a row pays at the prior's acceptance, more
# only once rows accept more
CPU_SMALL = PassModel(bandwidth=1.37e9, fixed_s=0.12, per_row_s=0.005, per_context_token_s=3e-6, overlap=0.8,
                      overhead_s=0.003, read_tail_s=0.075)


def test_auto_keeps_drafting_for_rows_that_accept_most_drafts_when_the_first_pass_drafts_one():
    rows = [SimRow(i, 100, 200) for i in range(16)]
    off = simulate(rows, FifoPolicy(), waiting, CPU_SMALL, 270_000_000)
    auto = simulate(rows, FifoPolicy(), waiting, CPU_SMALL, 270_000_000, speculate=-1, acceptance=0.84)
    # each draft is accepted or not: rows that accept rise above the prior and draft more, as in a job
    assert auto.drafts["tokens_per_decode_row"] > 2.0 and auto.passes < 0.6 * off.passes
    again = simulate(rows, FifoPolicy(), waiting, CPU_SMALL, 270_000_000, speculate=-1, acceptance=0.84)
    assert (again.passes, again.total_seconds) == (auto.passes, auto.total_seconds)   # seeded: the same each time


def test_a_draft_models_steps_price_each_drafting_pass_up_and_its_acceptance_the_passes_down():
    from spill.admission.drafter import DraftCost
    rows = [SimRow(i, 16, 61) for i in range(20)]
    steps = DraftCost(step_s=0.5, prompt_token_s=0.01)
    off = simulate(rows, FifoPolicy(), waiting, READ_BOUND, BYTES)
    lookup = simulate(rows, FifoPolicy(), waiting, READ_BOUND, BYTES, speculate=4, acceptance=0.6)
    drafted = simulate(rows, FifoPolicy(), waiting, READ_BOUND, BYTES, speculate=4, acceptance=0.6, drafter=steps)
    assert drafted.passes == lookup.passes < 0.6 * off.passes              # the same draws: as many passes
    # each drafting pass adds 4 steps at 0.5 s; the first adds each row's 17 tokens taken in, too
    added = drafted.total_seconds - lookup.total_seconds
    assert added == pytest.approx(drafted.drafts["passes"] * 2.0 + 20 * 17 * 0.01, rel=0.05)
    assert drafted.drafts["draft_s"] == pytest.approx(added / drafted.drafts["passes"], abs=1e-3)
    unmeasured = simulate(rows, FifoPolicy(), waiting, READ_BOUND, BYTES, speculate=4, drafter=steps)
    # no acceptance measured: its steps priced, none of its drafts taken (an upper bound)
    assert unmeasured.passes == off.passes and unmeasured.total_seconds > off.total_seconds + 50 * 2.0
    assert unmeasured.drafts["acceptance"] is None and unmeasured.total_seconds > drafted.total_seconds


def test_a_tiers_rows_take_its_ended_rows_spread_of_acceptance_and_the_job_ends_with_its_slowest():
    rows = [SimRow(i, 40, 61) for i in range(16)]
    alike = simulate(rows, FifoPolicy(), waiting, READ_BOUND, BYTES, speculate=4, acceptance=0.5,
                     by_tier={tier_of(40): 0.5})
    # the same mean, rows apart: half accept nothing, half every draft; the job lasts as long as a row without any
    apart = simulate(rows, FifoPolicy(), waiting, READ_BOUND, BYTES, speculate=4, acceptance=0.5,
                     by_tier={tier_of(40): 0.5}, spread={tier_of(40): [0.0] * 8 + [1.0] * 8})
    assert apart.passes == 61 and alike.passes < 45
    assert apart.drafts["tiers"] == {"short (<=128)": 0.5}
