"""The streamer actor's core, driven by plans without sockets: it runs each exactly as written."""

import numpy as np

from spill import messages as m
from spill.streamer.core import Row, Streamer
from spill.streamer.process import StreamerActor



def plan(index, rows=(), prompts=(), max_tokens=4, groups=None, widths=None, chunks=(), **kw) -> m.Plan:
    tokens, lengths = m.pack_tokens(list(prompts))
    rows = list(rows)
    return m.Plan(1, rows, tokens, lengths, [max_tokens] * len(rows), m.Sampling.of([m.RowSampling()] * len(rows)), [], index=index,
                  widths=widths or [0] * len(rows), groups=groups or [1] * len(rows), chunks=[list(c) for c in chunks],
                  **kw)


def test_planned_rows_give_the_tokens_of_the_core_and_a_reset_drops_them(make_tiny):
    folder = str(make_tiny("llama"))
    prompts = [[5, 6, 7], [9, 10]]
    actor = StreamerActor()
    actor.reset(m.Reset(1, folder))
    got, index = {10: [], 11: []}, 0
    out, stats, _ = actor.run(plan(0, [10, 11], prompts, chunks=[(1, 3)]))
    finished = list(stats.finished)
    while True:
        assert out.epoch == stats.epoch == 1 and stats.plan == index
        for row, tok, at in zip(out.rows, np.frombuffer(out.tokens, np.int32).tolist(), out.positions):
            assert at == len(got[row])   # each token says how many of its row came before it
            got[row].append(tok)
        if actor.engine.idle:
            break
        index += 1
        out, stats, _ = actor.run(plan(index))
        finished += stats.finished
    assert sorted(finished) == [10, 11]
    core = Streamer(folder)
    for i, p in zip((10, 11), prompts):
        core.add(Row(i, p, 4))
    want = {10: [], 11: []}
    while not core.idle:
        for e in core.step().emitted:
            want[e.row_id].append(e.token)
    assert got == want
    actor.run(plan(index + 1, [12], [[1, 2]], groups=[2], chunks=[(2, 1)]))
    actor.reset(m.Reset(2))
    assert actor.engine.idle


def test_a_planned_chunk_is_what_a_prefill_group_advances(make_tiny):
    actor = StreamerActor()
    actor.reset(m.Reset(1, str(make_tiny("llama"))))
    _, first, _ = actor.run(plan(0, [10, 11], [list(range(3, 23)), list(range(5, 21))], groups=[1, 1], chunks=[(1, 7)]))
    _, second, _ = actor.run(plan(1, chunks=[(1, 13)]))
    assert (first.prefill_tokens, second.prefill_tokens, second.emitted) == (2 * 7, 2 * 13, 2)   # padded to 20


def test_dropped_rows_are_reported_to_admission_and_to_the_tokenizer(make_tiny):
    actor = StreamerActor()
    actor.reset(m.Reset(1, str(make_tiny("llama"))))
    actor.run(plan(0, [10, 11], [[5, 6, 7], [9, 10]], chunks=[(1, 3)], cache_limit=64 << 20))
    out, stats, _ = actor.run(plan(1, drop=[11]))
    assert stats.preempted == [11] and 11 not in stats.finished
    assert (out.rows[-1], out.finish[-1], np.frombuffer(out.tokens, np.int32)[-1]) == (11, "preempted", -1)
    assert stats.rss > 0 and stats.read_bandwidth > 0


def test_a_plan_puts_each_row_in_the_pool_of_its_width_and_a_drop_shrinks_that_pool(make_tiny):
    actor = StreamerActor()
    actor.reset(m.Reset(1, str(make_tiny("llama"))))
    actor.run(plan(0, [10, 11, 12], [[5, 6, 7], [9, 10], [3] * 9], max_tokens=6, groups=[1, 1, 2],
                   widths=[256, 256, 512], chunks=[(1, 3), (2, 9)], pools=[[2, 256], [1, 512]]))
    assert {w: (p.slots, len(p.live)) for w, p in actor.engine.pools.items()} == {256: (2, 2), 512: (1, 1)}
    _, stats, _ = actor.run(plan(1, drop=[11], pools=[[1, 256], [1, 512]]))
    assert stats.preempted == [11] and stats.decode_rows == 2
    assert {w: (p.slots, len(p.live)) for w, p in actor.engine.pools.items()} == {256: (1, 1), 512: (1, 1)}


def test_a_dropped_prefilling_row_takes_its_whole_group_with_it(make_tiny):
    actor = StreamerActor()
    actor.reset(m.Reset(1, str(make_tiny("llama"))))
    actor.run(plan(0, [10, 11], [list(range(3, 23)), list(range(5, 21))], chunks=[(1, 7)]))
    _, stats, _ = actor.run(plan(1, drop=[10]))
    assert sorted(stats.preempted) == [10, 11] and actor.engine.idle


def test_a_row_the_engine_refuses_is_an_error_and_leaves(make_tiny):
    actor = StreamerActor()
    actor.reset(m.Reset(1, str(make_tiny("llama"))))
    out, stats, refused = actor.run(plan(0, [7], [[]], chunks=[(1, 1)]))
    assert stats.finished == [7] and "empty prompt" in refused[0][1]
    assert (out.rows, out.finish) == ([7], ["refused"])   # the tokenizer forgets it


def test_a_prefill_group_allocates_exactly_what_the_sheet_prices_for_it(make_tiny):
    """The scheduler prices a group's prompt KV with the function Group.prefill allocates by (shares.prefill_kv_tokens)."""
    from spill.admission.prices import sheet_for
    from spill.streamer.plan import load_plan
    folder = str(make_tiny("llama"))
    actor = StreamerActor()
    actor.reset(m.Reset(1, folder))
    prompts = [list(range(3, 23)), list(range(5, 21))]
    actor.run(plan(0, [10, 11], prompts, chunks=[(1, 7)]))
    group = actor.engine.prefills[1]
    held = sum(c.keys.nbytes + c.values.nbytes for c in group.caches)
    sheet = sheet_for(load_plan(folder), 2**30, 4, prefill_tokens=512)   # float32 on the CPU, as the streamer computes
    assert held == sheet.prefill_kv([len(p) for p in prompts]) == 2 * 20 * sheet.kv_per_token


def test_a_reset_sets_the_kv_format_of_the_pools_the_job_runs_with(make_tiny):
    """Reset carries --kv-bits: the rows of that job decode in quantized pools, the next job's as it says."""
    from spill.streamer.kvquant import QuantPool
    folder = str(make_tiny("llama"))
    actor = StreamerActor()
    for epoch, bits, quantized in ((1, 8, True), (2, 0, False), (3, 4, True)):
        actor.reset(m.Reset(epoch, folder, kv_bits=bits, kv_group_size=32))
        actor.run(m.Plan(epoch, [0], *m.pack_tokens([[5, 6, 7]]), [4], m.Sampling.of([m.RowSampling()]), [], widths=[0], groups=[1],
                         chunks=[[1, 8]]))
        pool = next(iter(actor.engine.pools.values()))
        assert isinstance(pool, QuantPool) == quantized and pool.bits == (bits or None)
    actor.engine.close()
