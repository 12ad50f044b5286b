"""The reader tests' helpers: a layer checked against the file's tensors, an array's address, and a copy engine
whose part the host does (the reader's "pinned" path where no CUDA GPU is)."""

import ctypes

import mlx.core as mx
import numpy as np

MX_OF = {"BF16": mx.bfloat16, "F16": mx.float16, "F32": mx.float32, "I32": mx.int32, "U8": mx.uint8}


def bits(a: mx.array) -> np.ndarray:
    """The raw bytes of an mx.array (bf16 through its uint16 view)."""
    if a.dtype == mx.bfloat16:
        a = a.view(mx.uint16)
    return np.array(a).view(np.uint8)


def expected_f32(code: str, arr: np.ndarray) -> np.ndarray:
    if code == "BF16":                               # exact: the bf16 bits are the high half of an f32
        return (arr.astype(np.uint32) << 16).view(np.float32)
    return arr.astype(np.float32)


def check_layer(got: dict, tensors: dict, names: list[str], dtype=None):
    assert list(got) == names
    for name in names:
        code, arr = tensors[name]
        a = got[name]
        assert a.shape == arr.shape
        if dtype is None or code in ("I32", "U8"):   # stored as is; integer tensors are never cast
            assert a.dtype == MX_OF[code]
            assert bits(a).tobytes() == arr.tobytes()
        else:
            assert a.dtype == dtype
            got_f32, want = np.array(a), expected_f32(code, arr)
            if code == "F16":   # f16 NaNs come out quieted (MLX sets the quiet bit); all else bitwise
                assert np.array_equal(np.isnan(got_f32), np.isnan(want))
                got_f32, want = np.nan_to_num(got_f32, nan=0.0), np.nan_to_num(want, nan=0.0)
            assert got_f32.tobytes() == want.tobytes()


def address(a: mx.array) -> int:
    return np.asarray(memoryview(a.view(mx.uint16) if a.dtype == mx.bfloat16 else a)).ctypes.data


class HostCopy:
    """A copy engine's part done by the host (gpu_copy.CopyEngine's interface): the reader's "pinned" path
    where no CUDA GPU is. It records what was pinned, and the copies."""
    def __init__(self):
        self.pinned, self.copies = {}, 0

    def pin(self, buf):
        self.pinned[buf.ctypes.data] = buf.nbytes

    def unpin(self, buf):
        del self.pinned[buf.ctypes.data]

    def copy(self, dst, src, n):
        assert any(a <= src and src + n <= a + size for a, size in self.pinned.items()), "from pinned buffers only"
        ctypes.memmove(dst, src, n)
        self.copies += 1
