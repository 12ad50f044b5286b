"""The MLX memory the weight reader fills: read into on the host, or copied into on a CUDA GPU; and MLX's
cache limit, set to what admission prices for the layers a pass frees."""

import mlx.core as mx
import numpy as np

from spill import config
from spill.memory import cache_allowance

from .pages import DIO, FLOATS, NP_OF, huge_pages
from .plan import ModelPlan, TensorSpec


_made = [0]   # host buffers made by this process (SPILL_TEST_ALLOC_FAIL counts them)


def host_buffer(size: int) -> tuple:
    """New MLX memory to read into: (a numpy view of `size` bytes at a DIO boundary, (the array, that offset)).
    Zero-filled on the host, also on a GPU: 59 MB took 4 ms from MLX's cache, 41 ms fresh (2 vCPUs); then backed
    by huge pages where Linux can (pages.huge_pages), as the reader's own buffers are."""
    _made[0] += 1
    if _made[0] == config.test_alloc_fail()[0]:
        raise RuntimeError(f"[malloc] Unable to allocate {size + DIO} bytes.")
    raw = mx.zeros((size + DIO,), mx.uint8, stream=mx.cpu)
    mx.eval(raw)
    view = np.asarray(memoryview(raw))
    skip = -view.ctypes.data % DIO
    if config.huge_pages():
        huge_pages(view)
    return view[skip:skip + size], (raw, skip)


def gpu_buffer(size: int) -> tuple:
    """New MLX memory a layer is copied into on a GPU: (the array, the offset of a DIO boundary, its address).
    Made on the GPU, so the host never touches its pages; asking its address makes it managed memory, once."""
    raw = mx.zeros((size + DIO,), mx.uint8)
    mx.eval(raw)
    addr = np.asarray(memoryview(raw)).ctypes.data
    skip = -addr % DIO
    return raw, skip, addr + skip


def raise_cache_limit(plan: ModelPlan, dtype, recycled: bool) -> None:
    """Let MLX keep the buffers a pass recycles (its Linux CPU default is 32 MiB, and a fresh allocation
    there costs ~7x a reused one in page faults): the limit admission prices (`memory.cache_allowance`)."""
    def out_bytes(t: TensorSpec) -> int:
        if dtype is not None and t.dtype in FLOATS:
            return t.nbytes // np.dtype(NP_OF[t.dtype]).itemsize * dtype.size
        return t.nbytes
    layer = max((sum(out_bytes(t) for t in ts) for ts in plan.layers), default=0)
    cast = max((sum(t.nbytes for t in ts if out_bytes(t) != t.nbytes) for ts in plan.layers), default=0)
    largest = max((out_bytes(t) for ts in plan.layers for t in ts), default=0)
    need = cache_allowance(layer, cast, largest, recycled)
    previous = mx.set_cache_limit(need)
    if previous > need:
        mx.set_cache_limit(previous)
