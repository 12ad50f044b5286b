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
