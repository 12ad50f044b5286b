"""Copies on a CUDA GPU's copy engine, from the reader's pinned buffers into MLX memory, through the CUDA
driver (ctypes: MLX links libcuda itself, and its runtime is built in). MLX offers no pinned or device
target from Python; a copy by the host into its managed memory ran at ~2.3 GB/s on the H200."""

import ctypes
import threading

import numpy as np

_CU = ctypes.c_int           # CUresult, CUdevice
_PTR = ctypes.c_uint64       # CUdeviceptr: with unified addressing, any pointer the GPU can reach


class CopyEngine:
    """The primary context of one GPU (the one MLX uses): pins host memory and copies into MLX memory."""

    def __init__(self, device: int = 0, lib: str = "libcuda.so.1"):
        cu = self._cu = ctypes.CDLL(lib)
        for name, args in (("cuInit", [ctypes.c_uint]), ("cuDeviceGet", [ctypes.POINTER(_CU), ctypes.c_int]),
                           ("cuDevicePrimaryCtxRetain", [ctypes.POINTER(ctypes.c_void_p), _CU]),
                           ("cuCtxSetCurrent", [ctypes.c_void_p]),
                           ("cuMemHostRegister_v2", [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]),
                           ("cuMemHostUnregister", [ctypes.c_void_p]),
                           ("cuMemcpy", [_PTR, _PTR, ctypes.c_size_t]),
                           ("cuGetErrorString", [_CU, ctypes.POINTER(ctypes.c_char_p)])):
            getattr(cu, name).argtypes, getattr(cu, name).restype = args, _CU
        dev, self._ctx = _CU(), ctypes.c_void_p()
        self._call("cuInit", 0)
        self._call("cuDeviceGet", ctypes.byref(dev), device)
        self._call("cuDevicePrimaryCtxRetain", ctypes.byref(self._ctx), dev)
        self._current = threading.local()   # the context is current per thread

    def pin(self, buf: np.ndarray) -> None:
        """Page-lock `buf` for the GPU's DMA (a copy from it then needs no staging by the driver)."""
        self._in_context()
        self._call("cuMemHostRegister_v2", buf.ctypes.data, buf.nbytes, 0)

    def unpin(self, buf: np.ndarray) -> None:
        self._in_context()
        self._call("cuMemHostUnregister", buf.ctypes.data)

    def copy(self, dst: int, src: int, n: int) -> None:
        """n bytes from address src to dst, done when it returns (from pinned host memory it is synchronous)."""
        self._in_context()
        self._call("cuMemcpy", dst, src, n)

    def _in_context(self) -> None:
        if not getattr(self._current, "set", False):
            self._call("cuCtxSetCurrent", self._ctx)
            self._current.set = True

    def _call(self, name: str, *args) -> None:
        rc = getattr(self._cu, name)(*args)
        if rc:
            text = ctypes.c_char_p()
            self._cu.cuGetErrorString(rc, ctypes.byref(text))
            raise RuntimeError(f"CUDA {name} failed: {(text.value or b'').decode() or rc}")


_engine: "CopyEngine | None | bool" = False


def pinned(engine: "CopyEngine | None", bufs: list[tuple]) -> "CopyEngine | None":
    """`engine` once every buffer of `bufs` ((array, owner) pairs) is pinned; None, none pinned, where there is no
    engine or the driver refuses one (page-locked memory is the machine's to give)."""
    done = []
    try:
        for buf, _ in bufs if engine else ():
            engine.pin(buf)
            done.append(buf)
        return engine
    except RuntimeError:
        for buf in done:
            engine.unpin(buf)
        return None


def engine() -> "CopyEngine | None":
    """The copy engine of the GPU MLX computes on, or None where there is no CUDA driver (made once)."""
    global _engine
    if _engine is False:
        try:
            _engine = CopyEngine()
        except (OSError, RuntimeError, AttributeError):
            _engine = None
    return _engine


def placed(tensors: list[tuple], align: int = 256) -> list[tuple]:
    """(tensor, position as read, position in the MLX memory it is copied into) of a layer's (tensor, position)s:
    each at a multiple of `align`, so each is a view there (a GPU's matmuls refuse less than 256 bytes)."""
    out, end = [], 0
    for spec, pos in tensors:
        out.append((spec, pos, end))
        end = -(-(end + spec.nbytes) // align) * align
    return out
