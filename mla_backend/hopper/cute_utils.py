"""Torch -> CuTe DSL launch arguments shared by the SM90 launchers.

The kernels take raw global-memory pointers plus their run-time extents, never framework tensors: converting a
torch tensor (DLPack) costs microseconds of host time each, several per call, which eager callers pay on every
step. Compilation uses the same pointer type at a dummy address, so it needs no GPU.
"""

from __future__ import annotations

import cutlass.cute as cute
from cutlass.cute.runtime import make_ptr

_COMPILE_ADDRESS = 1 << 20  # any aligned address: only the pointer's type and alignment are compiled in


def gmem_ptr(dtype, align: int, address: int = _COMPILE_ADDRESS):
    """A global-memory pointer of `dtype` that the kernel may assume `align`-byte aligned."""
    return make_ptr(dtype, address, cute.AddressSpace.gmem, assumed_align=align)


def cuda_stream(stream=None):
    """The CUstream of a torch.cuda.Stream (None: the null stream, for compilation)."""
    import cuda.bindings.driver as cuda

    return cuda.CUstream(0 if stream is None else stream.cuda_stream)
