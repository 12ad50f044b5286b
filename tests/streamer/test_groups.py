"""The decode pool's KV slots (streamer/groups.py)."""

import gc
import weakref

import mlx.core as mx

from spill.streamer.groups import Pool


def test_a_retired_pool_frees_its_kv_at_once_not_at_the_next_garbage_collection():
    """Each layer's SlotCache refers to its pool: a cycle would hold the KV until Python's cycle
    collector happened to run, and a long job's active memory grew by a pool at every refill."""
    gc.disable()
    try:
        pool = Pool(4, 256, layers=2)
        kv = mx.ones((1, 2, 10, 8))
        for cache in pool.caches:
            cache.place(0, kv, kv)
        mx.eval([a for c in pool.caches for a in (c.keys, c.values)])
        gone = weakref.ref(pool)
        before = mx.get_active_memory()
        del pool, cache
        assert gone() is None
        assert mx.get_active_memory() <= before - 2 * 2 * (4 * 2 * 256 * 8) * 4   # 2 layers' K and V, float32
    finally:
        gc.enable()


def test_a_passs_decode_group_frees_the_pools_it_joined_at_once():
    """Each layer's JointCache refers to its Decode group: a cycle kept every pool a pass joined (and
    their KV) alive after the streamer replaced them, until a collection: 73 MiB on the three-tier job."""
    from spill.streamer.groups import Decode
    gc.disable()
    try:
        pools = [Pool(2, 256, layers=2), Pool(2, 512, layers=2)]
        decode = Decode(pools, layers=2)
        gone = [weakref.ref(p) for p in pools]
        del pools, decode
        assert [g() for g in gone] == [None, None]
    finally:
        gc.enable()


def test_a_pool_outgrown_is_copied_a_layer_at_a_time_never_whole_twice():
    """Admission lets a full pool grow into the KV that is free because its rows are copied a layer at
    a time; a copy of every layer at once would hold the old pool and the new one together."""
    layers, heads, width, dim = 16, 2, 256, 16
    old = Pool(4, width, layers)
    for cache in old.caches:
        for slot in range(4):
            kv = mx.ones((1, heads, 100, dim))
            cache.place(slot, kv, kv)
        mx.eval(cache.keys, cache.values)
        old.rows[:] = ["r"] * 4
    old.lens[:] = 100
    del kv
    pool_bytes = lambda slots: layers * 2 * slots * heads * width * dim * 4   # noqa: E731 - K and V, float32
    mx.clear_cache()
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    new = Pool(8, width, layers)
    new.move(old)
    del old
    mx.eval([(c.keys, c.values) for c in new.caches])
    grew = mx.get_peak_memory() - base
    assert grew < pool_bytes(8) - pool_bytes(4) + 3 * pool_bytes(8) // layers    # old and new: + pool_bytes(8)
    assert new.rows[:4] == ["r"] * 4 and list(new.lens[:4]) == [100] * 4
    assert mx.allclose(new.caches[5].keys[:4, :, :100], mx.ones((4, heads, 100, dim))).item()
