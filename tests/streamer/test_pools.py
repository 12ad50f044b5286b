"""Decode pools: rows join and leave reserved slots without copying the pool, a pool outgrown or shrunk is
copied once, and every row's tokens match the row run alone."""

from spill.streamer.core import Row, Streamer
from spill.streamer.groups import Pool

from .test_core import PROMPTS, _drive


def pool_growths(monkeypatch) -> list:
    """Every pool outgrown and copied into a bigger one from now on: (slots before, after)."""
    grown, move = [], Pool.move
    def counted(self, old):
        if self.slots > old.slots:
            grown.append((old.slots, self.slots))
        return move(self, old)
    monkeypatch.setattr(Pool, "move", counted)
    return grown


def test_rows_join_and_leave_the_reserved_pool_without_copying_it(make_tiny, monkeypatch):
    grown = pool_growths(monkeypatch)
    folder = make_tiny("llama")
    s = Streamer(folder, prefill_chunk=8)
    s.reserve([[4, 256]])
    schedule = {0: [("a", PROMPTS[0]), ("b", PROMPTS[1])], 2: [("c", PROMPTS[2])], 3: [("d", PROMPTS[3])]}
    out, passes, shapes = {}, 0, set()
    while passes <= max(schedule) or not s.idle:
        for rid, prompt in schedule.get(passes, []):
            s.add(Row(rid, prompt, 6 + 3 * len(out), width=256))   # rows of different lengths leave at different passes
            out[rid] = []
        for e in s.step().emitted:
            if e.finish != "stop":
                out[e.row_id].append(e.token)
        if s.pools:
            shapes.add(tuple((p.slots, p.width, p.caches[0].keys.shape) for p in s.pools.values()))
        passes += 1
    assert not grown and len(shapes) == 1
    for (rid, prompt), n in zip([r for p in sorted(schedule) for r in schedule[p]], [6, 9, 12, 15]):
        alone = _drive(Streamer(folder, prefill_chunk=8), {0: [(rid, prompt)]}, max_tokens=n)
        assert out[rid] == alone[rid][0]


def test_rows_in_pools_of_two_widths_share_each_pass_and_match_rows_run_alone(make_tiny, monkeypatch):
    grown = pool_growths(monkeypatch)
    folder = make_tiny("llama")
    s = Streamer(folder, prefill_chunk=8)
    s.reserve([[2, 256], [2, 512]])
    schedule = {0: [("a", PROMPTS[0], 256), ("b", PROMPTS[2], 512)], 1: [("c", PROMPTS[1], 256)],
                3: [("d", PROMPTS[3], 512)], 5: [("e", PROMPTS[4], 256), ("f", PROMPTS[0][:3], 256)]}
    out, passes, both, lens = {}, 0, 0, {}
    while passes <= max(schedule) or not s.idle:
        if passes == 5:
            s.reserve([[4, 256], [2, 512]])                  # admission grew the 256 pool: its rows move once
        for rid, prompt, width in schedule.get(passes, []):
            lens[rid] = 5 + 2 * len(out)
            s.add(Row(rid, prompt, lens[rid], width=width))
            out[rid] = []
        for e in s.step().emitted:
            if e.finish != "stop":
                out[e.row_id].append(e.token)
        both += sorted(p.width for p in s.pools.values()) == [256, 512]
        passes += 1
    assert both >= 5 and len(grown) == 1
    for rid, prompt, _ in [r for p in sorted(schedule) for r in schedule[p]]:
        alone = _drive(Streamer(folder, prefill_chunk=8), {0: [(rid, prompt)]}, max_tokens=lens[rid])
        assert out[rid] == alone[rid][0]


def test_a_preemption_shrinks_the_pool_and_the_rows_left_go_on_unchanged(make_tiny, monkeypatch):
    grown = pool_growths(monkeypatch)
    folder = make_tiny("qwen2")
    free = _drive(Streamer(folder), {0: [("a", PROMPTS[0]), ("b", PROMPTS[4])]})
    s = Streamer(folder)
    s.reserve([[8, 256]])
    s.add(Row("a", PROMPTS[0], 8, width=256))
    s.add(Row("b", PROMPTS[4], 8, width=256))
    got = {"a": [], "b": []}
    for _ in range(2):
        for e in s.step().emitted:
            got[e.row_id].append(e.token)
    s.preempt(["b"], [[1, 256]])
    report = s.step()
    assert report.preempted == ["b"] and s.pools[256].slots == 1
    got["a"] += [e.token for e in report.emitted]
    while not s.idle:
        for e in s.step().emitted:
            got[e.row_id].append(e.token)
    assert not grown and got["a"] == free["a"][0]


def test_rows_past_a_reserved_pool_get_a_slot_each_not_the_unreserved_growth(make_tiny):
    s = Streamer(make_tiny("llama"))
    s.reserve([[2, 256]])                       # admission's shapes, a pass behind the rows it sent
    for i in range(3):
        s.add(Row(f"r{i}", PROMPTS[i], 4, width=256))
    s.step()
    assert (s.pools[256].slots, s.pools[256].width) == (3, 256)   # not max(8, 2 x 3) slots nobody priced


def test_rows_past_an_unreserved_pool_move_it_once_and_match_rows_run_alone(make_tiny, monkeypatch):
    grown = pool_growths(monkeypatch)
    folder = make_tiny("llama")
    late = [(f"r{i}", PROMPTS[i % 5][: 3 + i]) for i in range(10)]
    s = Streamer(folder, prefill_chunk=8)
    together = _drive(s, {0: [("a", PROMPTS[0])], 2: late}, max_tokens=4)
    assert len(grown) == 1                       # 8 slots, then 11 rows: one bigger pool
    for rid, prompt in [("a", PROMPTS[0]), *late[::3]]:
        assert together[rid] == _drive(Streamer(folder, prefill_chunk=8), {0: [(rid, prompt)]}, max_tokens=4)[rid]
