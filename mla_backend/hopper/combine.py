"""Merge the split-KV partials of each request by their LSE (SM90, CuTe DSL).

Row mode: one CTA of 8 warps per (request, query row), or per quarter of the row's 512 columns while the batch's rows
fit one wave: it reads the split count and workspace offset from the plan (before its wait for the decode:
`_plan_before_wait`), so the grid is fixed (batch x rows
x 1 or 4, chosen from shapes the host knows) and needs no host reads. Requests with one split exit at once:
the decode kernel already wrote their final output. Requests without KV (no split at all) get out = 0,
lse = -inf here, since no decode CTA visits them.

Why a CTA per row and not a warp: a long request is cut into up to one split per SM (132 on an H200), and a
warp walking 132 partials one after the other waits on 132 dependent round trips to memory (the first
version spent ~100 us there for a single 128K request). Here the split LSEs are read by all 256 threads at
once and reduced across the CTA (with at most 32 splits every warp reduces them itself, a lane per split, and
no CTA barrier precedes the sum), and the 8 warps take every 8th partial each, so about 17 partial rows per
warp, eight at a time (unrolled), the first 2 (8 with four CTAs per row, all of them, up to 17, while the grid is
one CTA per SM) loaded before the LSE reductions so that their round trip overlaps the LSEs'; each lane owns
4-element vectors (8 bytes of fp16) of the CTA's 512 or 128 columns. Such a grid keeps one CTA per SM
(`config.combine_config`).
The warps' sums are added through shared memory at the end.

Warp mode, for batches of many rows with few splits each (`config.combine_config`): a CTA per row costs its
launch and a round trip for a row of 2-4 partials, and 768-1536 such CTAs took 3.8-6.3 us (8K x B64, q_len 8 128K
x B16). There a warp merges a row (lane s holds split s's LSE), eight rows per CTA, for every request
with at most HEAVY_SPLITS splits; the few requests with more (a plan of N CTAs holds at most N / 32 of them) are
merged row by row by rows x COMBINE_DIM_SPLITS (or x 1) CTAs of their own at the end of the grid, which find them with
one ballot pass over the plan. Every CTA reads the plan before its wait for the decode (`_plan_before_wait`).

out = v_scale * sum_s exp(lse_s - lse) * O_s, lse = log(sum_s exp(lse_s)), computed in base 2; a row whose
partials are all empty (lse -inf) gets out = 0 and lse = -inf.

The partials O_s are fp16 in units of the V scale (the decode's k_scale, read here from the same device tensor):
each is a convex combination of e4m3 values (|x| <= 448), which fp16 holds to 2^-11 relative, well inside the
bf16 output's 2^-8, and whatever the scale. In fp32 they were twice the bytes, which the combine reads from the
L2 at close to its bandwidth when rows have several splits each (q_len 8 x B16: ~16 MB of fp32 partials).
"""

from __future__ import annotations

import math

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.memory

from .. import jit_cache
from ..config import HEAVY_SPLITS, MAX_PLAN_CTAS, CombineConfig
from ..shapes import LATENT_DIM
from .launch import cuda_stream, gmem_ptr, pdl_prologue
from .ptx import load_global_cg_f32, load_global_cg_u32

LOG2_E = math.log2(math.e)
LN_2 = math.log(2.0)
WARPS = 8
THREADS = 32 * WARPS
VEC = 4  # partial elements per access (fp16: 8 bytes)
# Partials per warp loaded before the LSE reductions when the whole grid fits one CTA per SM (`prefetch_all`): a
# plan cuts a request into at most one split per SM, and 17 per warp cover the 132 SMs of an H200 (the loop
# after the prefetch takes any further splits). Their 68 registers would cost a larger grid its occupancy (H12
# q_len 8 128K x B1, 384 CTAs: combine 5.3 -> 6.8 us), so it keeps 8 (one vector per lane) or 2 (four).
PREFETCH_ALL = 17
MAX_SPLITS = MAX_PLAN_CTAS  # split weights kept in shared memory: a plan has at most num_ctas splits per request
WARP_PREFETCH = 3  # warp mode: partials per warp loaded before the LSEs
LSE_PER_THREAD = MAX_SPLITS // THREADS
# 4-byte words of unused shared memory that keep a second CTA off the SM (`one_per_sm`): with the ~12 KB of
# weights and sums a CTA then takes more than half of an H200 SM's 228 KB
ONE_PER_SM_WORDS = 104 * 1024 // 4
PARTIAL = cutlass.Float16  # the partials' type (module docstring)
VEC_BITS = VEC * 16


class CombineSplitsSM90:
    """The combine for a `config.CombineConfig` (module docstring)."""

    def __init__(self, cfg: CombineConfig):
        self.cfg = cfg
        self.pdl = cfg.pdl
        assert LATENT_DIM % (cfg.dim_splits * 32 * VEC) == 0
        self.rows = cfg.rows
        self.dim_splits = cfg.dim_splits
        self.cols = LATENT_DIM // cfg.dim_splits
        self.vecs_per_lane = self.cols // (32 * VEC)
        self.prefetch = PREFETCH_ALL if cfg.prefetch_all else max(2, 8 // self.vecs_per_lane)
        self.one_per_sm = cfg.prefetch_all
        # warp mode (heavy_slots >= 0): the CTAs of each request's rows, WARPS rows each, then rows x dim_splits
        # CTAs for the rows of the requests with more than HEAVY_SPLITS splits (at most heavy_slots of them)
        self.warp_rows = cfg.heavy_slots >= 0
        self.heavy_slots = max(cfg.heavy_slots, 0)
        self.row_groups = -(-cfg.rows // WARPS)

    @cute.jit
    def __call__(self, p_partial_out: cute.Pointer, p_partial_lse: cute.Pointer, p_out: cute.Pointer,
                 p_lse: cute.Pointer, p_num_splits: cute.Pointer, p_split_offset: cute.Pointer,
                 p_v_scale: cute.Pointer, batch: cutlass.Int32, num_slots: cutlass.Int32, max_batch: cutlass.Int32,
                 stream: cuda.CUstream):
        # Raw pointers plus the outer extents, not framework tensors: converting six torch tensors per call
        # cost tens of microseconds of host time in eager use. The inner strides stay compile-time constants.
        R = self.rows
        partial_out = cute.make_tensor(p_partial_out, cute.make_layout((num_slots, R, LATENT_DIM),
                                                                       stride=(R * LATENT_DIM, LATENT_DIM, 1)))
        partial_lse = cute.make_tensor(p_partial_lse, cute.make_layout((num_slots, R), stride=(R, 1)))
        out = cute.make_tensor(p_out, cute.make_layout((batch, R, LATENT_DIM), stride=(R * LATENT_DIM, LATENT_DIM, 1)))
        lse = cute.make_tensor(p_lse, cute.make_layout((batch, R), stride=(R, 1)))
        num_splits = cute.make_tensor(p_num_splits, cute.make_layout((max_batch,)))
        split_offset = cute.make_tensor(p_split_offset, cute.make_layout((max_batch,)))
        v_scale = cute.make_tensor(p_v_scale, cute.make_layout((1,)))
        grid = [batch, R, self.dim_splits]
        if cutlass.const_expr(self.warp_rows):
            grid = [self._heavy_ctas() + batch * self.row_groups, 1, 1]
        self.kernel(partial_out, partial_lse, out, lse, num_splits, split_offset, v_scale).launch(
            grid=grid, block=[THREADS, 1, 1], stream=stream, use_pdl=self.pdl)

    def _heavy_ctas(self) -> int:
        """Warp mode's CTAs for the heavy requests' rows: one per (row, column part), none where no request of
        the plan can have more than HEAVY_SPLITS splits."""
        return self.rows * self.dim_splits if self.heavy_slots > 0 else 0

    @cute.jit
    def _block_reduce(self, value: cutlass.Float32, scratch: cute.Tensor, warp, lane, is_max: cutlass.Constexpr):
        if cutlass.const_expr(is_max):
            value = cute.arch.warp_reduction_max(value)
        else:
            value = cute.arch.warp_reduction_sum(value)
        if lane == 0:
            scratch[warp] = value
        cute.arch.barrier()
        result = scratch[0]
        for w in cutlass.range_constexpr(1, WARPS):
            if cutlass.const_expr(is_max):
                result = cute.arch.fmax(result, scratch[w])
            else:
                result = result + scratch[w]
        cute.arch.barrier()  # scratch is reused by the next reduction
        return result

    @cute.kernel
    def kernel(self, partial_out: cute.Tensor, partial_lse: cute.Tensor, out: cute.Tensor, lse: cute.Tensor,
               num_splits: cute.Tensor, split_offset: cute.Tensor, v_scale_t: cute.Tensor):
        # The plan's entries this CTA needs and the V scale are read before the wait for the decode
        # (`_plan_before_wait`); everything else, every store included, follows the wait.
        request, row, part_of_row = cute.arch.block_idx()
        tidx, _, _ = cute.arch.thread_idx()
        lane = tidx % 32
        warp = tidx // 32
        # one allocator for every path: the heavy CTAs' search and their merge must not overlap in shared memory
        smem = cutlass.memory.SmemAllocator()
        weights = smem.allocate_tensor(cutlass.Float32, cute.make_layout(MAX_SPLITS), 16)
        scratch = smem.allocate_tensor(cutlass.Float32, cute.make_layout(WARPS), 16)
        sums = smem.allocate_tensor(cutlass.Float32, cute.make_layout((self.cols, WARPS), stride=(1, self.cols)), 16)
        if cutlass.const_expr(self.one_per_sm):
            # Shared memory no SM has room for twice, so that a grid of at most one CTA per SM runs on as many SMs:
            # its CTAs launch (PDL) as the decode's CTAs exit, and several of them on the first SMs to free up
            # would merge their rows there, one SM's loads for two or more CTAs.
            spread = smem.allocate_tensor(cutlass.Int32, cute.make_layout(ONE_PER_SM_WORDS), 16)
            if tidx >= THREADS:  # never: the buffer only has to exist
                spread[0] = tidx
        shared = (weights, scratch, sums)
        counts, found = None, None
        if cutlass.const_expr(self.warp_rows):
            counts = smem.allocate_tensor(cutlass.Int32, cute.make_layout(WARPS), 16)
            found = smem.allocate_tensor(cutlass.Int32, cute.make_layout((max(self.heavy_slots, 1), 3), stride=(3, 1)),
                                         16)
        # Warp mode: the warp CTAs first, the heavy CTAs after them. Most batches that take warp mode have no heavy
        # request, and their heavy CTAs only search the plan and exit; first in the grid, they were dispatched
        # ahead of the CTAs with the rows (H200, combine alone, heavy CTAs first -> last: q_len 8 128K x B16
        # 3.6 -> 3.3 us, 1M x B16 3.8-3.9 -> 3.5-3.6, 8K x B64 2.3 -> 2.0-2.1; 128K + 63 x 2K, whose heavy
        # request has ~63 splits, 2.7 both ways; steps unchanged).
        warp_ctas = cute.size(lse, mode=[0]) * self.row_groups
        splits, first, n_heavy, v_scale = self._plan_before_wait(num_splits, split_offset, v_scale_t, request,
                                                                 warp_ctas, counts, found, tidx, lane, warp)
        pdl_prologue(self.pdl)
        if cutlass.const_expr(self.warp_rows):
            c = request
            if c < warp_ctas:
                self._merge_rows_by_warps(partial_out, partial_lse, out, lse, splits, first, v_scale,
                                          c // self.row_groups, (c % self.row_groups) * WARPS + warp, lane)
            else:
                c = c - warp_ctas
                # one CTA per (row, column quarter) of every heavy request: usually one request (a long one
                # among short ones), at most heavy_slots of them, one after the other
                part_of_row = c % self.dim_splits
                row = c // self.dim_splits
                for h in range(n_heavy):
                    self._merge_row(partial_out, partial_lse, out, lse, shared, v_scale, found[h, 0], row,
                                    part_of_row, found[h, 1], found[h, 2], tidx, lane, warp)
                    cute.arch.barrier()  # the shared sums and weights are reused by the next request
        else:
            dst = cute.local_tile(out[request, row, None], (self.cols,), (part_of_row,))  # this CTA's columns
            if splits == 0:
                if tidx < self.cols // VEC:
                    zeros = cute.make_rmem_tensor((VEC,), cutlass.BFloat16)
                    zeros.fill(0.0)
                    cute.autovec_copy(zeros, cute.local_tile(dst, (VEC,), (tidx,)))
                if tidx == 0:
                    if part_of_row == 0:
                        lse[request, row] = -cutlass.Float32.inf
            if splits > 1:
                self._merge_row(partial_out, partial_lse, out, lse, shared, v_scale, request, row, part_of_row,
                                splits, first, tidx, lane, warp)

    @cute.jit
    def _plan_before_wait(self, num_splits: cute.Tensor, split_offset: cute.Tensor, v_scale_t: cute.Tensor, c,
                          warp_ctas, counts, found, tidx, lane, warp):
        """What the CTA reads of the plan, and the V scale, loaded before the wait for the decode, so that with PDL
        their round trips to memory run while the decode's last CTAs do (these CTAs start on the SMs the decode's
        first CTAs leave) rather than after it. Returns (splits, first, heavy, v_scale): row mode's and warp mode's
        row CTAs get their request's split count and workspace offset (read together: the partials' addresses
        need both, and a load behind the `splits > 1` branch would be one more round trip on every CTA's path);
        warp mode's heavy CTAs search the plan for its heavy requests (`_find_heavy`: into `found`, `heavy` of
        them). Safe: this grid starts only once every decode CTA has passed its own wait for the kernel before it,
        so whatever was written before the decode (the plan by the planner, in this step or, shared by the layers,
        earlier; the scale by the engine) is complete and in the L2. Read from the L2 (ld.global.cg), never from a
        stale L1 line. Without PDL there is no wait, and the grid starts after the decode."""
        splits = cutlass.Int32(0)
        first = cutlass.Int32(0)
        heavy = cutlass.Int32(0)
        if cutlass.const_expr(self.warp_rows):
            if c < warp_ctas:
                request = c // self.row_groups
                splits = load_global_cg_u32((num_splits.iterator + request).toint())
                first = load_global_cg_u32((split_offset.iterator + request).toint())
            else:
                heavy = self._find_heavy(num_splits, split_offset, warp_ctas // self.row_groups, counts, found, tidx,
                                         lane, warp)
        else:
            splits = load_global_cg_u32((num_splits.iterator + c).toint())
            first = load_global_cg_u32((split_offset.iterator + c).toint())
        v_scale = load_global_cg_f32(v_scale_t.iterator.toint())
        return splits, first, heavy, v_scale

    @cute.jit
    def _find_heavy(self, num_splits: cute.Tensor, split_offset: cute.Tensor, batch, counts: cute.Tensor,
                    found: cute.Tensor, tidx, lane, warp):
        """Warp mode's heavy CTAs: the requests, in request order, with more than HEAVY_SPLITS splits, as (request,
        splits, workspace offset) rows of `found` (at most heavy_slots of them, all a plan can hold); returns how
        many. One pass over the plan's first `batch` entries (the output's requests: a plan may hold more),
        THREADS at a time, ranked by ballots."""
        base = cutlass.Int32(0)
        for i0 in cutlass.range(0, batch, THREADS):
            i = i0 + tidx
            s = cutlass.Int32(0)
            o = cutlass.Int32(0)
            if i < batch:  # before the wait: from the L2 (`_plan_before_wait`)
                s = load_global_cg_u32((num_splits.iterator + i).toint())
                o = load_global_cg_u32((split_offset.iterator + i).toint())
            heavy = s > HEAVY_SPLITS
            ballot = cute.arch.vote_ballot_sync(heavy)
            if lane == 0:
                counts[warp] = cute.arch.popc(ballot)
            cute.arch.barrier()
            rank = base + cute.arch.popc(ballot & cute.arch.lanemask_lt())
            total = cutlass.Int32(0)
            for w in cutlass.range_constexpr(WARPS):
                n = counts[w]
                if w < warp:
                    rank = rank + n
                total = total + n
            if heavy:
                if rank < self.heavy_slots:
                    found[rank, 0] = i
                    found[rank, 1] = s
                    found[rank, 2] = o
            base = base + total
            cute.arch.barrier()  # counts are reused; found is written
        return cutlass.min(base, self.heavy_slots)

    @cute.jit
    def _warp_weights(self, partial_lse: cute.Tensor, first, row, splits, lane):
        """One warp's view of a row's (at most 32) splits, lane s holding split s: the largest LSE (base 2), the
        lane's weight 2^(lse_s - largest) and the weights' sum."""
        lse_l = -cutlass.Float32.inf
        if lane < splits:
            lse_l = partial_lse[first + lane, row] * LOG2_E
        anchor = cute.arch.warp_reduction_max(lse_l)
        if anchor == -cutlass.Float32.inf:
            anchor = cutlass.Float32(0.0)  # every partial empty: all weights are 0
        w_l = cutlass.Float32(0.0)
        if lane < splits:
            w_l = cute.math.exp2(lse_l - anchor, fastmath=True)
        return anchor, w_l, cute.arch.warp_reduction_sum(w_l)

    @cute.jit
    def _merge_rows_by_warps(self, partial_out: cute.Tensor, partial_lse: cute.Tensor, out: cute.Tensor,
                             lse: cute.Tensor, splits, first, v_scale, request, row, lane):
        """Warp mode: this warp's row of `request`, if the request has at most HEAVY_SPLITS splits (lane s holds
        split s's LSE and weight; the lane owns the 4-element vectors lane + 32 k of the 512 columns); `splits`
        and `first` are the request's plan entries."""
        VECS = LATENT_DIM // (32 * VEC)
        if row < self.rows:
            if splits == 0:
                zeros = cute.make_rmem_tensor((VEC,), cutlass.BFloat16)
                zeros.fill(0.0)
                for k in cutlass.range_constexpr(VECS):
                    cute.autovec_copy(zeros, cute.local_tile(out[request, row, None], (VEC,), (lane + 32 * k,)))
                if lane == 0:
                    lse[request, row] = -cutlass.Float32.inf
            if splits > 1 and splits <= HEAVY_SPLITS:
                load_atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), PARTIAL, num_bits_per_copy=VEC_BITS)
                pre = cute.make_rmem_tensor((VEC, VECS, WARP_PREFETCH), PARTIAL)
                for u in cutlass.range_constexpr(WARP_PREFETCH):
                    if u < splits:
                        for k in cutlass.range_constexpr(VECS):
                            cute.copy(load_atom, cute.local_tile(partial_out[first + u, row, None], (VEC,),
                                                                 (lane + 32 * k,)), pre[None, k, u])
                anchor, w_l, total = self._warp_weights(partial_lse, first, row, splits, lane)
                inv_total = cutlass.Float32(0.0)
                if total != cutlass.Float32(0.0):  # NaN stays NaN (NaN input), never an empty row
                    inv_total = v_scale / total
                acc = cute.make_rmem_tensor((VEC, VECS), cutlass.Float32)
                acc.fill(0.0)
                for u in cutlass.range_constexpr(WARP_PREFETCH):
                    if u < splits:
                        weight = cute.arch.shuffle_sync(w_l, u) * inv_total
                        for k in cutlass.range_constexpr(VECS):
                            for i in cutlass.range_constexpr(VEC):
                                acc[i, k] += weight * pre[i, k, u].to(cutlass.Float32)
                part = cute.make_rmem_tensor((VEC, VECS), PARTIAL)
                for s in cutlass.range(WARP_PREFETCH, splits, 1, unroll=4):
                    weight = cute.arch.shuffle_sync(w_l, s) * inv_total
                    for k in cutlass.range_constexpr(VECS):
                        cute.copy(load_atom, cute.local_tile(partial_out[first + s, row, None], (VEC,),
                                                             (lane + 32 * k,)), part[None, k])
                    for k in cutlass.range_constexpr(VECS):
                        for i in cutlass.range_constexpr(VEC):
                            acc[i, k] += weight * part[i, k].to(cutlass.Float32)
                vals = cute.make_rmem_tensor((VEC,), cutlass.BFloat16)
                for k in cutlass.range_constexpr(VECS):
                    for i in cutlass.range_constexpr(VEC):
                        vals[i] = acc[i, k].to(cutlass.BFloat16)
                    cute.autovec_copy(vals, cute.local_tile(out[request, row, None], (VEC,), (lane + 32 * k,)))
                if lane == 0:
                    result = -cutlass.Float32.inf
                    if total != cutlass.Float32(0.0):  # NaN stays NaN (NaN input), never an empty row
                        result = (anchor + cute.math.log2(total)) * LN_2
                    lse[request, row] = result

    @cute.jit
    def _merge_row(self, partial_out: cute.Tensor, partial_lse: cute.Tensor, out: cute.Tensor, lse: cute.Tensor,
                   shared, v_scale, request, row, part_of_row, splits, first, tidx, lane, warp):
        """The whole CTA merges the `splits` (> 1) partials of one row of `request`, over its columns (a quarter
        of them with COMBINE_DIM_SPLITS CTAs per row)."""
        dst = cute.local_tile(out[request, row, None], (self.cols,), (part_of_row,))  # this CTA's columns
        weights, scratch, sums = shared
        load_atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), PARTIAL, num_bits_per_copy=VEC_BITS)

        # The warp's first PREFETCH partials go in flight before the LSE reductions: their addresses need only
        # the plan, so the partials' round trip overlaps the LSEs' instead of following it.
        pre = cute.make_rmem_tensor((VEC, self.vecs_per_lane, self.prefetch), PARTIAL)
        for u in cutlass.range_constexpr(self.prefetch):
            s = warp + u * WARPS
            if s < splits:
                src = cute.local_tile(partial_out[first + s, row, None], (self.cols,), (part_of_row,))
                for k in cutlass.range_constexpr(self.vecs_per_lane):
                    cute.copy(load_atom, cute.local_tile(src, (VEC,), (lane + 32 * k,)), pre[None, k, u])

        # The largest LSE (base 2), then the weights 2^(lse_s - max) and their sum. Up to 32 splits (B8 and more
        # at q_len 1 on 132 SMs) every warp reduces the LSEs itself, lane s holding split s, and keeps its
        # weights in its own 32 slots of `weights`: no CTA barrier before the partials are summed. More splits
        # are reduced by the whole CTA.
        anchor = cutlass.Float32(0.0)
        total = cutlass.Float32(0.0)
        wbase = cutlass.Int32(0)
        if splits <= 32:
            anchor, w_l, total = self._warp_weights(partial_lse, first, row, splits, lane)
            wbase = warp * 32
            weights[wbase + lane] = w_l
            cute.arch.sync_warp()
        else:
            # The largest LSE (base 2), then the weights 2^(lse_s - max) and their sum, all splits at once. Each
            # thread reads its LSEs once (MAX_SPLITS / THREADS at most, predicated) and keeps them in registers:
            # a second pass over global memory cost one more dependent round trip.
            my_lse = cute.make_rmem_tensor((LSE_PER_THREAD,), cutlass.Float32)
            local_max = -cutlass.Float32.inf
            for k in cutlass.range_constexpr(LSE_PER_THREAD):
                my_lse[k] = -cutlass.Float32.inf
                s = tidx + k * THREADS
                if s < splits:
                    my_lse[k] = partial_lse[first + s, row] * LOG2_E
                local_max = cute.arch.fmax(local_max, my_lse[k])
            lse_max = self._block_reduce(local_max, scratch, warp, lane, True)
            anchor = lse_max
            if lse_max == -cutlass.Float32.inf:
                anchor = cutlass.Float32(0.0)  # every partial empty: all weights are 0
            local_sum = cutlass.Float32(0.0)
            for k in cutlass.range_constexpr(LSE_PER_THREAD):
                s = tidx + k * THREADS
                if s < splits:
                    w = cute.math.exp2(my_lse[k] - anchor, fastmath=True)
                    weights[s] = w
                    local_sum += w
            total = self._block_reduce(local_sum, scratch, warp, lane, False)  # its barriers publish weights
        inv_total = cutlass.Float32(0.0)
        if total != cutlass.Float32(0.0):  # NaN stays NaN (NaN input), never an empty row
            inv_total = v_scale / total

        # 8-byte accesses: every vector starts at a multiple of 4 elements of a 16-byte aligned row.
        acc = cute.make_rmem_tensor((VEC, self.vecs_per_lane), cutlass.Float32)
        acc.fill(0.0)
        for u in cutlass.range_constexpr(self.prefetch):
            s = warp + u * WARPS
            if s < splits:
                weight = weights[wbase + s] * inv_total
                for k in cutlass.range_constexpr(self.vecs_per_lane):
                    for i in cutlass.range_constexpr(VEC):
                        acc[i, k] += weight * pre[i, k, u].to(cutlass.Float32)
        part = cute.make_rmem_tensor((VEC, self.vecs_per_lane), PARTIAL)
        for s in cutlass.range(warp + self.prefetch * WARPS, splits, WARPS, unroll=8):  # 8 partials in flight
            weight = weights[wbase + s] * inv_total
            src = cute.local_tile(partial_out[first + s, row, None], (self.cols,), (part_of_row,))
            for k in cutlass.range_constexpr(self.vecs_per_lane):
                cute.copy(load_atom, cute.local_tile(src, (VEC,), (lane + 32 * k,)), part[None, k])
            for k in cutlass.range_constexpr(self.vecs_per_lane):
                for i in cutlass.range_constexpr(VEC):
                    acc[i, k] += weight * part[i, k].to(cutlass.Float32)
        for k in cutlass.range_constexpr(self.vecs_per_lane):
            for i in cutlass.range_constexpr(VEC):
                sums[(lane + 32 * k) * VEC + i, warp] = acc[i, k]
        cute.arch.barrier()

        # Thread t < cols / 2 adds the 8 warps' sums of columns 2t, 2t+1 and stores them as one bf16 pair.
        if tidx < self.cols // 2:
            pair = cute.make_rmem_tensor((2,), cutlass.BFloat16)
            for i in cutlass.range_constexpr(2):
                column = tidx * 2 + i
                value = sums[column, 0]
                for w in cutlass.range_constexpr(1, WARPS):
                    value += sums[column, w]
                pair[i] = value.to(cutlass.BFloat16)
            cute.autovec_copy(pair, cute.local_tile(dst, (2,), (tidx,)))
        if tidx == 0:
            if part_of_row == 0:
                result = -cutlass.Float32.inf
                if total != cutlass.Float32(0.0):  # NaN stays NaN (NaN input), never an empty row
                    result = (anchor + cute.math.log2(total)) * LN_2
                lse[request, row] = result


def compile_combine(cfg: CombineConfig):
    """The compiled combine of a configuration (once per configuration: `jit_cache`). Every run-time value
    (pointers, batch, slots, plan size, stream) is an argument, so this compiles without a GPU."""
    args = (gmem_ptr(PARTIAL, 16), gmem_ptr(cutlass.Float32, 4), gmem_ptr(cutlass.BFloat16, 16),
            gmem_ptr(cutlass.Float32, 4), gmem_ptr(cutlass.Int32, 4), gmem_ptr(cutlass.Int32, 4),
            gmem_ptr(cutlass.Float32, 4), cutlass.Int32(1), cutlass.Int32(1), cutlass.Int32(1), cuda_stream())
    return jit_cache.compiled(cfg, lambda: (CombineSplitsSM90(cfg), args))


def run_combine(cfg: CombineConfig, plan, partial_out, partial_lse, out, lse, v_scale, stream) -> None:
    """Merge the partials of every split request into `out` (bf16) and `lse` (natural log), as the op
    (`mla_backend.api`) validated them: partial_out fp16 [slots, q_len, H, 512] in units of v_scale (fp32 [1] on
    the device: the decode's k_scale), partial_lse fp32 [slots, q_len, H], out bf16 [batch, q_len, H, 512], lse
    fp32 [batch, q_len, H], all contiguous; the plan's num_splits / split_offset int32 [max_batch >= batch]."""
    batch = out.shape[0]
    fn = compile_combine(cfg)
    fn(gmem_ptr(PARTIAL, 16, partial_out.data_ptr()), gmem_ptr(cutlass.Float32, 4, partial_lse.data_ptr()),
       gmem_ptr(cutlass.BFloat16, 16, out.data_ptr()), gmem_ptr(cutlass.Float32, 4, lse.data_ptr()),
       gmem_ptr(cutlass.Int32, 4, plan.num_splits.data_ptr()),
       gmem_ptr(cutlass.Int32, 4, plan.split_offset.data_ptr()), gmem_ptr(cutlass.Float32, 4, v_scale.data_ptr()),
       cutlass.Int32(batch), cutlass.Int32(max(partial_lse.numel() // cfg.rows, 1)),
       cutlass.Int32(plan.num_splits.shape[0]), cuda_stream(stream))
