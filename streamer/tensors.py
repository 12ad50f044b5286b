"""Read bytes as finished mx.arrays, the weight reader's convert step (reader.py): a view of the MLX memory they were
read into where aligned and kept as stored, else a copy; floating tensors cast to the compute dtype in MLX."""

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from .pages import FLOATS, MX_OF, NP_OF, UINT_OF
from .plan import TensorSpec


@dataclass
class Tensors:
    dtype: "mx.Dtype | None"     # the compute dtype floating tensors are cast to (None: as stored)
    into: str                    # the reader's buffers (platform.read_into)
    align: int = 1               # a view's start: the item size on a CPU; a GPU's matmuls (cuBLASLt) need 256 bytes
    view_stream: "mx.Stream | None" = None   # "pinned": views made on the host's stream (read_path.py may set None)

    def aligned(self, spec: TensorSpec, pos: int) -> bool:
        """Whether MLX can view a tensor at `pos` of a read buffer in place: a dtype it has, its bytes aligned."""
        return spec.dtype in MX_OF and pos % max(np.dtype(NP_OF[spec.dtype]).itemsize, self.align) == 0

    def viewed(self, spec: TensorSpec, pos: int) -> bool:
        """Whether a tensor read into MLX memory stays a view of it: aligned, and not cast."""
        stored = mx.bfloat16 if spec.dtype == "BF16" else MX_OF.get(spec.dtype)
        cast = self.dtype is not None and spec.dtype in FLOATS and stored != self.dtype
        return self.aligned(spec, pos) and not cast

    def convert(self, spec: TensorSpec, buf: np.ndarray, pos: int, owner=None, at=None) -> mx.array:
        """An evaluated mx.array (nothing lazy is left for the compute thread): a view of the MLX memory `owner`
        (array, offset of a DIO boundary in it), `at` bytes past that boundary, where aligned; else a copy of buf."""
        item, s, at = np.dtype(NP_OF[spec.dtype]).itemsize, None, pos if at is None else at
        start = at + (owner[1] if owner is not None else 0)
        if owner is not None and self.aligned(spec, at):
            s = self.view_stream   # "pinned": made on the host's stream, a view waits for no GPU work
            a = mx.as_strided(owner[0], (spec.nbytes,), (1,), start, stream=s)
            a = mx.reshape(mx.view(a, MX_OF[spec.dtype], stream=s), spec.shape, stream=s)
        elif self.into == "mlx" and owner is not None and spec.dtype in MX_OF and item in UINT_OF:   # x | 0, host
            a = mx.bitwise_or(owner[0][start:start + spec.nbytes].view(UINT_OF[item]), 0, stream=mx.cpu)
            a = a.view(MX_OF[spec.dtype]).reshape(spec.shape)
        else:
            a = mx.array(buf[pos:pos + spec.nbytes].view(NP_OF[spec.dtype]).reshape(spec.shape))
        if spec.dtype == "BF16":
            a = mx.view(a, mx.bfloat16, stream=s)
        if self.dtype is not None and spec.dtype in FLOATS and a.dtype != self.dtype:
            a = a.astype(self.dtype)
        mx.eval(a)
        return a
