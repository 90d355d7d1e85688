"""Torch -> CuTe DSL launch arguments shared by the SM90 launchers, and the programmatic-dependent-launch prologue.

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


def _cached(cache: dict, key, make):
    value = cache.get(key)
    if value is None:
        if len(cache) >= _CACHE_LIMIT:
            cache.clear()
        value = cache[key] = make()
    return value


def gmem_ptr(dtype, align: int, address: int = _COMPILE_ADDRESS):
    """A global-memory pointer of `dtype` that the kernel may assume `align`-byte aligned."""
    return _cached(_pointers, (dtype, align, address),
                   lambda: make_ptr(dtype, address, cute.AddressSpace.gmem, assumed_align=align))


def cuda_stream(stream=None):
    """The CUstream of a torch.cuda.Stream (None: the null stream, for compilation)."""
    handle = 0 if stream is None else stream.cuda_stream
    return _cached(_streams, handle, lambda: cuda.CUstream(handle))


def pdl_prologue(pdl: bool):
    """Inside a kernel compiled for programmatic dependent launch (the default, `CUTE_MLA_PDL`): wait for the
    previous kernel in the stream (its completion and memory flush) and let the next PDL kernel start launching.
    Must precede every store and every load of what the previous kernel writes (the combine reads the plan, which
    the kernel before the previous one wrote, ahead of it: `combine.py`). Each kernel is then launched while the one
    before it still runs, so its launch and CTA start-up overlap that kernel's tail; a kernel that follows one
    launched without PDL (any engine kernel) starts as usual, after it."""
    if pdl:
        cute.arch.griddepcontrol_wait()
        cute.arch.griddepcontrol_launch_dependents()
