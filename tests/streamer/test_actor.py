"""The streamer actor's core, driven by messages without sockets."""

import numpy as np

from spill import messages as m
from spill.streamer.core import Row, Streamer
from spill.streamer.process import StreamerActor


def test_admitted_rows_give_the_tokens_of_the_core_and_a_reset_drops_them(make_tiny):
    folder = str(make_tiny("llama"))
    prompts = [[5, 6, 7], [9, 10]]
    actor = StreamerActor()
    actor.reset(m.Reset(1, folder))
    tokens, lengths = m.pack_tokens(prompts)
    actor.admit(m.Admit(1, [10, 11], tokens, lengths, [4, 4], [[0.0, 1.0, 0, None]] * 2, []))
    got = {10: [], 11: []}
    while actor.busy:
        out, stats = actor.step()
        assert out.epoch == stats.epoch == 1
        for row, tok in zip(out.rows, np.frombuffer(out.tokens, np.int32).tolist()):
            got[row].append(tok)
    assert sorted(stats.finished) == [10, 11]
    core = Streamer(folder)
    for i, p in zip((10, 11), prompts):
        core.add(Row(i, p, 4))
    want = {10: [], 11: []}
    while not core.idle:
        for e in core.step().emitted:
            want[e.row_id].append(e.token)
    assert got == want
    actor.admit(m.Admit(1, [12], *m.pack_tokens([[1, 2]]), [4], [[0.0, 1.0, 0, None]], []))
    actor.reset(m.Reset(2))
    assert not actor.busy


def test_preempted_rows_are_reported_to_admission_and_to_the_tokenizer(make_tiny):
    actor = StreamerActor()
    actor.reset(m.Reset(1, str(make_tiny("llama"))))
    actor.admit(m.Admit(1, [10, 11], *m.pack_tokens([[5, 6, 7], [9, 10]]), [4, 4], [[0.0, 1.0, 0, None]] * 2, [],
                        cache_limit=64 << 20))
    actor.step()
    actor.preempt(m.Preempt(1, [11]))
    out, stats = actor.step()
    assert stats.preempted == [11] and 11 not in stats.finished
    assert (out.rows[-1], out.finish[-1], np.frombuffer(out.tokens, np.int32)[-1]) == (11, "preempted", -1)
    assert stats.rss > 0 and stats.read_bandwidth > 0


def test_an_admit_puts_each_row_in_the_pool_of_its_width_and_a_preempt_shrinks_that_pool(make_tiny):
    actor = StreamerActor()
    actor.reset(m.Reset(1, str(make_tiny("llama"))))
    actor.admit(m.Admit(1, [10, 11, 12], *m.pack_tokens([[5, 6, 7], [9, 10], [3] * 9]), [6, 6, 6],
                        [[0.0, 1.0, 0, None]] * 3, [], widths=[256, 256, 512], pools=[[2, 256], [1, 512]]))
    actor.step()
    assert {w: (p.slots, len(p.live)) for w, p in actor.engine.pools.items()} == {256: (2, 2), 512: (1, 1)}
    actor.preempt(m.Preempt(1, [11], pools=[[1, 256], [1, 512]]))
    _, stats = actor.step()
    assert stats.preempted == [11] and stats.decode_rows == 2
    assert {w: (p.slots, len(p.live)) for w, p in actor.engine.pools.items()} == {256: (1, 1), 512: (1, 1)}


def test_a_row_the_engine_refuses_is_an_error_and_leaves(make_tiny):
    actor = StreamerActor()
    actor.reset(m.Reset(1, str(make_tiny("llama"))))
    actor.admit(m.Admit(1, [7], *m.pack_tokens([[]]), [4], [[0.0, 1.0, 0, None]], []))
    assert actor.busy
    _, stats = actor.step()
    assert stats.finished == [7] and "empty prompt" in actor.refused[0][1]
