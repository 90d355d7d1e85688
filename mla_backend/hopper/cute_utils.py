"""Torch <-> CuTe DSL tensor conversion shared by the SM90 kernels.

Kernels are compiled with every dimension static except the outer (batch-like) one, so inner strides are
compile-time constants: that is what lets the compiler prove 16-byte alignment and emit vector accesses.
`fake_tensor` builds the compile-time stand-in (no GPU needed), `to_cute` the run-time argument; both give
the same type, so one compiled kernel serves every batch size.
"""

from __future__ import annotations

import cutlass.cute as cute
import torch
from cutlass.cute.runtime import from_dlpack, make_fake_compact_tensor


def fake_tensor(dtype, shape, align: int = 16):
    """A row-major fake tensor; pass cute.sym_int() for the outer dimension to keep it dynamic."""
    return make_fake_compact_tensor(dtype, tuple(shape), stride_order=tuple(reversed(range(len(shape)))),
                                    assumed_align=align)


def to_cute(t: torch.Tensor, align: int = 16):
    """A contiguous torch tensor as a CuTe tensor whose outer dimension alone is dynamic."""
    return from_dlpack(t.detach(), assumed_align=align).mark_compact_shape_dynamic(mode=0)


def cuda_stream(stream: torch.cuda.Stream):
    import cuda.bindings.driver as cuda

    return cuda.CUstream(stream.cuda_stream)


def fake_stream():
    import cuda.bindings.driver as cuda

    return cuda.CUstream(0)
