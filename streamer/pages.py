"""Whole pages of safetensors files into aligned buffers: the spans a layer is read as, the buffers
(2 MiB aligned, huge pages), the file descriptors (O_DIRECT where allowed, F_NOCACHE on macOS) and the
numpy and MLX types the stored bytes are viewed as."""

import ctypes
import mmap
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

from .plan import TensorSpec

DIO = 4096              # O_DIRECT: file offsets, lengths and buffer addresses are multiples of this
_GAP = 1 << 20          # tensors of a file closer than this are read as one span
_HUGE = 2 << 20         # a huge page: buffers start at a multiple of it
_F_NOCACHE = 48         # macOS fcntl: reads bypass the unified buffer cache
_MADV_COLLAPSE = 25     # Linux: make a mapped range's pages huge now (Python's mmap has no name for it)


# safetensors code -> numpy dtype of the stored bytes (bf16 travels as uint16, fp8 as raw bytes)
NP_OF = {
    "BOOL": np.bool_, "U8": np.uint8, "I8": np.int8,
    "F8_E5M2": np.uint8, "F8_E4M3": np.uint8, "F8_E8M0": np.uint8,
    "I16": np.int16, "U16": np.uint16, "F16": np.float16, "BF16": np.uint16,
    "I32": np.int32, "U32": np.uint32, "F32": np.float32,
    "I64": np.int64, "U64": np.uint64, "F64": np.float64, "C64": np.complex64,
}
FLOATS = {"F16", "BF16", "F32", "F64"}   # cast to `dtype`; integer (quantized) tensors never are
# safetensors code -> the MLX dtype a view of read bytes takes (bf16 through uint16, as above)
MX_OF = {code: getattr(mx, np.dtype(t).name) for code, t in NP_OF.items() if code != "BOOL"} | {"BF16": mx.uint16}
UINT_OF = {1: mx.uint8, 2: mx.uint16, 4: mx.uint32, 8: mx.uint64}   # item size -> the unsigned int a copy goes through


def open_file(path, drop_cache: bool) -> int:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    if drop_cache and sys.platform == "darwin":
        import fcntl
        fcntl.fcntl(fd, _F_NOCACHE, 1)
    return fd


def open_direct(paths) -> dict | None:
    """fds opened with O_DIRECT, or None where the OS or a file system refuses it (macOS, tmpfs)."""
    flag = getattr(os, "O_DIRECT", 0)
    fds = {}
    try:
        for p in paths:
            fds[p] = os.open(p, os.O_RDONLY | flag | getattr(os, "O_CLOEXEC", 0))
            if not flag:
                raise OSError("no O_DIRECT here")
            os.preadv(fds[p], [memoryview(mmap.mmap(-1, DIO))], 0)   # some file systems refuse only the read
    except OSError:
        for fd in fds.values():
            os.close(fd)
        return None
    return fds


@dataclass
class Span:
    """Whole pages of one file holding a run of a layer's tensors, and where they go in a buffer."""
    path: Path
    file_start: int                 # a multiple of DIO
    buf_start: int                  # a multiple of DIO
    length: int                     # a multiple of DIO; may run past the end of the file
    tensors: list[TensorSpec]

    @property
    def data_end(self) -> int:
        return max(t.offset + t.nbytes for t in self.tensors)


def layout(tensors: list[TensorSpec]) -> tuple[list[tuple[TensorSpec, int]], list[Span], int]:
    """Each tensor's position in a buffer, the spans to read and the bytes needed. Tensors of one file
    with less than _GAP between them share a span: one sequential read, at the same offset within a
    page as in the file (what O_DIRECT needs, and drop-behind then never drops pages not yet read)."""
    placed, spans, end = {}, [], 0
    for t in sorted(tensors, key=lambda t: (str(t.path), t.offset)):
        sp = spans[-1] if spans else None
        if sp is None or sp.path != t.path or t.offset > sp.data_end + _GAP:
            sp = Span(t.path, t.offset - t.offset % DIO, end, 0, [])
            spans.append(sp)
        sp.tensors.append(t)
        sp.length = -(-(sp.data_end - sp.file_start) // DIO) * DIO
        placed[t.name] = sp.buf_start + t.offset - sp.file_start
        end = sp.buf_start + sp.length
    return [(t, placed[t.name]) for t in tensors], spans, end


def huge_pages(view: np.ndarray) -> None:
    """Back the 2 MiB-aligned interior of `view`, memory already mapped (MLX's), with huge pages now (Linux 6.1+:
    MADV_COLLAPSE), else when the kernel gets to it. O_DIRECT into 4 KiB pages read lean45 at
    1.5-1.9 GB/s for 0.30-0.38 s of system CPU a pass; into huge pages 3.3-3.5 GB/s for 0.07-0.11 s (2 vCPUs)."""
    start, end = -(-view.ctypes.data // _HUGE) * _HUGE, (view.ctypes.data + view.nbytes) // _HUGE * _HUGE
    if end <= start or not sys.platform.startswith("linux"):
        return
    madvise = ctypes.CDLL(None).madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    if madvise(start, end - start, _MADV_COLLAPSE) != 0:   # an older kernel, or no huge page free: khugepaged, later
        madvise(start, end - start, mmap.MADV_HUGEPAGE)


def aligned_buffer(size: int) -> np.ndarray:
    """A buffer of private memory, 2 MiB aligned, huge pages advised (Linux), its pages mapped. Huge
    pages let one O_DIRECT request carry MiBs: 4 KiB pages cap it at the disk's segments (254 x 4 KiB)."""
    m = mmap.mmap(-1, max(size, 1) + _HUGE, flags=mmap.MAP_PRIVATE)   # shared anonymous memory gets no huge pages
    try:
        m.madvise(mmap.MADV_HUGEPAGE)
    except (AttributeError, OSError):   # macOS; a kernel built without transparent huge pages
        pass
    buf = np.frombuffer(m, np.uint8)
    skip = -buf.ctypes.data % _HUGE
    buf = buf[skip:skip + size]
    buf.fill(0)
    return buf
