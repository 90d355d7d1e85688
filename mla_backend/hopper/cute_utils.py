"""Torch -> CuTe DSL launch arguments shared by the SM90 launchers.

The kernels take raw global-memory pointers plus their run-time extents, never framework tensors: converting a
torch tensor (DLPack) costs microseconds of host time each, several per call, which eager callers pay on every
step. Compilation uses the same pointer type at a dummy address, so it needs no GPU.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass.cute as cute
from cutlass.cute.runtime import make_ptr

_COMPILE_ADDRESS = 1 << 20  # any aligned address: only the pointer's type and alignment are compiled in

# Pointer and stream objects by value. An engine passes the same buffers (KV cache, block table, plan,
# workspace, often out and lse) every step, and building a pointer object costs ~1 us of Python (29 per eager
# step). The objects are immutable values; the launch copies what they hold, so sharing them is safe. The
# caches are cleared when they grow past a bound (addresses of short-lived tensors keep changing).
_CACHE_LIMIT = 4096
_pointers = {}
_streams = {}


def gmem_ptr(dtype, align: int, address: int = _COMPILE_ADDRESS):
    """A global-memory pointer of `dtype` that the kernel may assume `align`-byte aligned."""
    key = (dtype, align, address)
    ptr = _pointers.get(key)
    if ptr is None:
        if len(_pointers) >= _CACHE_LIMIT:
            _pointers.clear()
        ptr = _pointers[key] = make_ptr(dtype, address, cute.AddressSpace.gmem, assumed_align=align)
    return ptr


def cuda_stream(stream=None):
    """The CUstream of a torch.cuda.Stream (None: the null stream, for compilation)."""
    handle = 0 if stream is None else stream.cuda_stream
    cu_stream = _streams.get(handle)
    if cu_stream is None:
        if len(_streams) >= _CACHE_LIMIT:
            _streams.clear()
        cu_stream = _streams[handle] = cuda.CUstream(handle)
    return cu_stream
