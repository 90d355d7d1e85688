"""Merge the split-KV partials of each request by their LSE (SM90, CuTe DSL).

One warp per (request, query row): it reads the split count and workspace offset from the plan, so the grid
is fixed (batch x row blocks) and needs no host reads. Requests with one split exit at once: the decode
kernel already wrote their final output. Requests without KV (no split at all) get out = 0, lse = -inf here,
since no decode CTA visits them. Each lane owns 16 of the 512 output columns as four 16-byte
vectors, so every partial row is read in fully coalesced 512-byte sweeps.

out = sum_s exp(lse_s - lse) * O_s, lse = log(sum_s exp(lse_s)), computed in base 2; a row whose partials
are all empty (lse -inf) gets out = 0 and lse = -inf.
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
import torch

from ..shapes import LATENT_DIM
from .cute_utils import cuda_stream, fake_stream, fake_tensor, to_cute

LOG2_E = math.log2(math.e)
LN_2 = math.log(2.0)
WARPS_PER_CTA = 4
VEC = 4  # fp32 per 16-byte access
VECS_PER_LANE = LATENT_DIM // (32 * VEC)


class CombineSplitsSM90:
    """Static configuration: the number of query rows per request (q_len * heads)."""

    def __init__(self, rows: int):
        self.rows = rows

    @cute.jit
    def __call__(self, partial_out: cute.Tensor, partial_lse: cute.Tensor, out: cute.Tensor, lse: cute.Tensor,
                 num_splits: cute.Tensor, split_offset: cute.Tensor, stream):
        # partial_out [slots, rows, 512] f32, partial_lse [slots, rows] f32, out [batch, rows, 512] bf16,
        # lse [batch, rows] f32, num_splits / split_offset [max_batch >= batch] i32.
        row_blocks = (self.rows + WARPS_PER_CTA - 1) // WARPS_PER_CTA
        self.kernel(partial_out, partial_lse, out, lse, num_splits, split_offset).launch(
            grid=[out.shape[0], row_blocks, 1], block=[32 * WARPS_PER_CTA, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, partial_out: cute.Tensor, partial_lse: cute.Tensor, out: cute.Tensor, lse: cute.Tensor,
               num_splits: cute.Tensor, split_offset: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        request, row_block, _ = cute.arch.block_idx()
        lane = tidx % 32
        row = row_block * WARPS_PER_CTA + tidx // 32
        splits = num_splits[request]
        if splits == 0 and row < self.rows:
            zeros = cute.make_rmem_tensor((VEC,), cutlass.BFloat16)
            zeros.fill(0.0)
            dst = out[request, row, None]
            for k in cutlass.range_constexpr(VECS_PER_LANE):
                cute.autovec_copy(zeros, cute.local_tile(dst, (VEC,), (lane + 32 * k,)))
            if lane == 0:
                lse[request, row] = -cutlass.Float32.inf
        if splits > 1 and row < self.rows:
            first = split_offset[request]
            # Pass 1: the largest LSE (base 2). Pass 2: the sum of 2^(lse_s - max).
            lse_max = -cutlass.Float32.inf
            for s in cutlass.range(splits):
                lse_max = cute.arch.fmax(lse_max, partial_lse[first + s, row] * LOG2_E)
            anchor = lse_max
            if lse_max == -cutlass.Float32.inf:
                anchor = cutlass.Float32(0.0)  # every partial empty: weights are all 0
            total = cutlass.Float32(0.0)
            for s in cutlass.range(splits):
                total += cute.arch.exp2(partial_lse[first + s, row] * LOG2_E - anchor)
            inv_total = cutlass.Float32(0.0)
            if total > cutlass.Float32(0.0):
                inv_total = cutlass.Float32(1.0) / total

            # 16-byte accesses: every vector starts at a multiple of 4 elements of a 16-byte aligned row.
            load_atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), cutlass.Float32, num_bits_per_copy=128)
            store_atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), cutlass.BFloat16, num_bits_per_copy=64)
            acc = cute.make_rmem_tensor((VEC, VECS_PER_LANE), cutlass.Float32)
            acc.fill(0.0)
            part = cute.make_rmem_tensor((VEC,), cutlass.Float32)
            for s in cutlass.range(splits):
                weight = cute.arch.exp2(partial_lse[first + s, row] * LOG2_E - anchor) * inv_total
                src = partial_out[first + s, row, None]
                for k in cutlass.range_constexpr(VECS_PER_LANE):
                    cute.copy(load_atom, cute.local_tile(src, (VEC,), (lane + 32 * k,)), part)
                    for i in cutlass.range_constexpr(VEC):
                        acc[i, k] += weight * part[i]

            dst = out[request, row, None]
            packed = cute.make_rmem_tensor((VEC,), cutlass.BFloat16)
            for k in cutlass.range_constexpr(VECS_PER_LANE):
                for i in cutlass.range_constexpr(VEC):
                    packed[i] = acc[i, k].to(cutlass.BFloat16)
                cute.copy(store_atom, packed, cute.local_tile(dst, (VEC,), (lane + 32 * k,)))
            if lane == 0:
                result = -cutlass.Float32.inf
                if total > cutlass.Float32(0.0):
                    result = (anchor + cute.math.log2(total)) * LN_2
                lse[request, row] = result


_compiled = {}


def compile_combine_sm90(rows: int, example=None):
    """The compiled combine for `rows` query rows per request, cached by that static key.

    `example` is the argument tuple of a first call; without it the kernel is compiled from fake tensors
    (no GPU needed).
    """
    if rows not in _compiled:
        if example is None:
            example = _fake_args(rows)
        _compiled[rows] = cute.compile(CombineSplitsSM90(rows), *example)
    return _compiled[rows]


def _fake_args(rows: int):
    slots, batch, max_batch = cute.sym_int(), cute.sym_int(), cute.sym_int()
    return (fake_tensor(cutlass.Float32, (slots, rows, LATENT_DIM)), fake_tensor(cutlass.Float32, (slots, rows)),
            fake_tensor(cutlass.BFloat16, (batch, rows, LATENT_DIM)), fake_tensor(cutlass.Float32, (batch, rows)),
            fake_tensor(cutlass.Int32, (max_batch,), align=4), fake_tensor(cutlass.Int32, (max_batch,), align=4),
            fake_stream())


def run_combine_sm90(plan, partial_out: torch.Tensor, partial_lse: torch.Tensor, out: torch.Tensor,
                     lse: torch.Tensor, stream: torch.cuda.Stream):
    """Merge the partials of every split request into `out` (bf16) and `lse` (natural log)."""
    batch, q_len, heads, _ = out.shape
    rows = q_len * heads
    if batch == 0:
        return
    args = (to_cute(partial_out.view(-1, rows, LATENT_DIM)), to_cute(partial_lse.view(-1, rows)),
            to_cute(out.view(batch, rows, LATENT_DIM)), to_cute(lse.view(batch, rows)),
            to_cute(plan.num_splits, align=4), to_cute(plan.split_offset, align=4), cuda_stream(stream))
    compile_combine_sm90(rows, args)(*args)
