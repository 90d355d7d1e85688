"""The split planner as one CuTe DSL kernel (one CTA), computing exactly what `planner.plan_splits` does.

Why a kernel: the plain-torch planner is about 25 small launches (cumsums, searchsorteds, copies), which cost
~67 us per decode step on the H200 even inside a CUDA graph: half of a 128K-token step. One CTA does the same
work in a few microseconds: the batch's tiles and costs are scanned once in shared memory, every CTA boundary is
found by a binary search over the requests' cost prefix, and every request's first and last CTA from the cost
position of its first and last tile (the CTA whose cost interval holds it), with no search and no wait for the
boundaries. The torch planner stays the definition (and the CPU path); tests check both agree bit for bit.

Static key: (max_batch, num_ctas, tile_tokens, segment_overhead), the plan's fixed shape, so an engine compiles
it once. Thread t owns requests [t * PER, (t + 1) * PER) for the first scan. After it the two halves of the CTA
work apart: warps 0-7 find the CTA boundaries (two binary searches each), warps 8-15 the requests' first CTAs,
split counts and workspace slots (with a scan of their own over a named barrier). In the same threads one after
the other, the two paths took ~0.5 us each of a ~2.5 us kernel (H200, parts left out, docs/performance.md).
"""

from __future__ import annotations

import math

import cutlass
import cutlass.memory
import cutlass.cute as cute
from cutlass import Int32, Int64

from ..planner import MAX_PLANNED_KV_LEN
from .cute_utils import cuda_stream, gmem_ptr, pdl_prologue, use_pdl

THREADS = 512
WARPS = THREADS // 32
# after the first scan: threads [0, REQUEST_THREAD0) find the CTA boundaries, the rest plan the requests
REQUEST_THREAD0 = 256
REQUEST_WARPS = (THREADS - REQUEST_THREAD0) // 32
REQUEST_BARRIER = 1  # named barrier of the request warps' scan (0 is the CTA's)


def _search_steps(n: int) -> int:
    """Iterations for a binary search over n sorted elements."""
    return max(1, math.ceil(math.log2(n + 1)) + 1)


class PlanSplitsSM90:
    def __init__(self, max_batch: int, num_ctas: int, tile_tokens: int, segment_overhead: int, pdl: bool = False):
        self.pdl = pdl
        self.max_batch = max_batch
        self.num_ctas = num_ctas
        self.tile_tokens = tile_tokens
        self.overhead = segment_overhead
        self.per_thread = -(-max_batch // THREADS)
        self.per_request_thread = -(-max_batch // (THREADS - REQUEST_THREAD0))

    @cute.jit
    def __call__(self, p_seq_lens: cute.Pointer, p_cta_tile_start: cute.Pointer, p_cta_first_request: cute.Pointer,
                 p_request_tile_start: cute.Pointer, p_request_first_cta: cute.Pointer, p_num_splits: cute.Pointer,
                 p_split_offset: cute.Pointer, batch: Int32, stream):
        B, N = self.max_batch, self.num_ctas
        seq_lens = cute.make_tensor(p_seq_lens, cute.make_layout(batch))
        outputs = (cute.make_tensor(p_cta_tile_start, cute.make_layout(N + 1)),
                   cute.make_tensor(p_cta_first_request, cute.make_layout(N)),
                   cute.make_tensor(p_request_tile_start, cute.make_layout(B + 1)),
                   cute.make_tensor(p_request_first_cta, cute.make_layout(B)),
                   cute.make_tensor(p_num_splits, cute.make_layout(B)),
                   cute.make_tensor(p_split_offset, cute.make_layout(B)))
        self.kernel(seq_lens, *outputs, batch).launch(grid=[1, 1, 1], block=[THREADS, 1, 1], stream=stream,
                                                      use_pdl=self.pdl)

    @cute.jit
    def _exclusive_scan(self, values, scratch: cute.Tensor, warp, lane, warps: cutlass.Constexpr = WARPS,
                        barrier_id: cutlass.Constexpr = 0):
        """Exclusive prefix sums of one or more values per thread over `warps` warps (warp: 0 to warps - 1; all
        the CTA's with barrier 0, else a named barrier of those warps), scanned together (one pair of barriers
        for all): returns [(prefix, total)] in the order of `values`. scratch holds len(values) * warps."""
        n = len(values)
        inclusive = cute.make_rmem_tensor(cute.make_layout((n,)), Int32)
        for j in cutlass.range_constexpr(n):
            inclusive[j] = values[j]
        for k in cutlass.range_constexpr(5):
            offset = 1 << k
            for j in cutlass.range_constexpr(n):
                other = cute.arch.shuffle_sync_up(inclusive[j], offset)
                if lane >= offset:
                    inclusive[j] = inclusive[j] + other
        if lane == 31:
            for j in cutlass.range_constexpr(n):
                scratch[j * warps + warp] = inclusive[j]
        self._sync(warps, barrier_id)
        results = []
        for j in cutlass.range_constexpr(n):
            base = Int32(0)
            total = Int32(0)
            for w in cutlass.range_constexpr(warps):
                part = scratch[j * warps + w]
                if w < warp:
                    base = base + part
                total = total + part
            results.append((base + inclusive[j] - values[j], total))
        self._sync(warps, barrier_id)  # scratch is reused by the next scan
        return results

    @cute.jit
    def _sync(self, warps: cutlass.Constexpr, barrier_id: cutlass.Constexpr):
        if cutlass.const_expr(barrier_id == 0):
            cute.arch.barrier()
        else:
            cute.arch.barrier(barrier_id=barrier_id, number_of_threads=warps * 32)

    @cute.jit
    def _count_at_most(self, values: cute.Tensor, first: int, count: int, x: Int32) -> Int32:
        """How many of values[first : first + count] (sorted ascending) are <= x."""
        lo = Int32(0)
        hi = Int32(count)
        for _ in cutlass.range_constexpr(_search_steps(count)):
            if lo < hi:
                mid = (lo + hi) // 2
                if values[first + mid] <= x:
                    lo = mid + 1
                else:
                    hi = mid
        return lo

    @cute.kernel
    def kernel(self, seq_lens: cute.Tensor, cta_tile_start: cute.Tensor, cta_first_request: cute.Tensor,
               request_tile_start: cute.Tensor, request_first_cta: cute.Tensor, num_splits: cute.Tensor,
               split_offset: cute.Tensor, batch: Int32):
        pdl_prologue(self.pdl)
        B, N, T, OVH, PER = self.max_batch, self.num_ctas, self.tile_tokens, self.overhead, self.per_thread
        tidx, _, _ = cute.arch.thread_idx()
        lane = tidx % 32
        warp = tidx // 32
        smem = cutlass.memory.SmemAllocator()
        tiles = smem.allocate_tensor(Int32, cute.make_layout(B), 16)
        cost_start = smem.allocate_tensor(Int32, cute.make_layout(B), 16)
        req_start = smem.allocate_tensor(Int32, cute.make_layout(B + 1), 16)
        merged = smem.allocate_tensor(Int32, cute.make_layout(B), 16)
        scratch = smem.allocate_tensor(Int32, cute.make_layout(2 * WARPS), 16)

        # Tiles and cost (tiles + one overhead per request with KV) of this thread's requests, both scanned at once.
        my_tiles = Int32(0)
        my_cost = Int32(0)
        for i in cutlass.range_constexpr(PER):
            b = tidx * PER + i
            if b < B:
                length = Int32(0)
                if b < batch:
                    length = seq_lens[b]
                    if length < 0:
                        length = Int32(0)
                    if length > MAX_PLANNED_KV_LEN:
                        length = Int32(MAX_PLANNED_KV_LEN)
                t = (length + (T - 1)) // T
                tiles[b] = t
                my_tiles = my_tiles + t
                if t > 0:
                    my_cost = my_cost + t + OVH
        scans = self._exclusive_scan((my_tiles, my_cost), scratch, warp, lane)
        tiles_before, total_tiles = scans[0]
        cost_before, total_cost = scans[1]
        for i in cutlass.range_constexpr(PER):
            b = tidx * PER + i
            if b < B:
                t = tiles[b]
                req_start[b] = tiles_before
                cost_start[b] = cost_before
                tiles_before = tiles_before + t
                if t > 0:
                    cost_before = cost_before + t + OVH
        if tidx == 0:
            req_start[B] = total_tiles
        cute.arch.barrier()

        total = total_cost
        if total < N:
            total = Int32(N)  # fewer cost units than CTAs: unit intervals, later CTAs idle
        if tidx < REQUEST_THREAD0:
            # CTA c starts at cost c * total // N; the tiles that start before it are those of every request
            # before the last one starting at or before it, plus that one's tiles past its overhead.
            for c in cutlass.range(tidx, N + 1, REQUEST_THREAD0):
                bound = ((Int64(c) * Int64(total)) // N).to(Int32)
                b = self._count_at_most(cost_start, 0, B, bound) - 1
                inside = bound - cost_start[b] - OVH
                if inside < 0:
                    inside = Int32(0)
                if inside > tiles[b]:
                    inside = tiles[b]
                g = req_start[b] + inside
                cta_tile_start[c] = g
                if c < N:
                    first = self._count_at_most(req_start, 1, B, g)
                    if first > B - 1:
                        first = Int32(B - 1)
                    cta_first_request[c] = first
        else:
            self._plan_requests(tiles, cost_start, req_start, merged, scratch, request_tile_start, request_first_cta,
                                num_splits, split_offset, total, total_tiles, tidx - REQUEST_THREAD0, lane)

    @cute.jit
    def _plan_requests(self, tiles: cute.Tensor, cost_start: cute.Tensor, req_start: cute.Tensor, merged: cute.Tensor,
                       scratch: cute.Tensor, request_tile_start: cute.Tensor, request_first_cta: cute.Tensor,
                       num_splits: cute.Tensor, split_offset: cute.Tensor, total: Int32, total_tiles: Int32, t, lane):
        """The request warps (t: 0 to THREADS - REQUEST_THREAD0 - 1): each request's first and last CTA are the
        CTAs whose cost intervals [c * total // N, (c + 1) * total // N) hold the cost positions of its first
        (last) tile, ((p + 1) * N - 1) // total: no search over the CTA boundaries and no wait for them. A
        request without tiles takes the position of the next request's first tile (the same cost_start), or
        the last CTA when no tile follows. Requests with several splits get workspace slots in order."""
        B, N, OVH, PER = self.max_batch, self.num_ctas, self.overhead, self.per_request_thread
        my_merged = Int32(0)
        for i in cutlass.range_constexpr(PER):
            b = t * PER + i
            if b < B:
                position = cost_start[b] + OVH
                first = Int32(N - 1)
                if req_start[b] < total_tiles:
                    first = self._cta_of_cost(position, total)
                splits = Int32(0)
                if tiles[b] > 0:
                    splits = self._cta_of_cost(position + tiles[b] - 1, total) - first + 1
                request_first_cta[b] = first
                num_splits[b] = splits
                m = Int32(0)
                if splits > 1:
                    m = splits
                merged[b] = m
                my_merged = my_merged + m
        slots_before, _total_slots = self._exclusive_scan((my_merged,), scratch, t // 32, lane, REQUEST_WARPS,
                                                          REQUEST_BARRIER)[0]
        for i in cutlass.range_constexpr(PER):
            b = t * PER + i
            if b < B:
                split_offset[b] = slots_before
                slots_before = slots_before + merged[b]
                request_tile_start[b] = req_start[b]
        if t == 0:
            request_tile_start[B] = req_start[B]

    @cute.jit
    def _cta_of_cost(self, p: Int32, total: Int32) -> Int32:
        """The CTA whose cost interval holds cost position p, clamped to [0, N - 1]."""
        N = self.num_ctas
        c = (((Int64(p) + 1) * N - 1) // Int64(total)).to(Int32)
        if c < 0:
            c = Int32(0)
        if c > N - 1:
            c = Int32(N - 1)
        return c


_compiled = {}


def compile_plan_splits_sm90(max_batch: int, num_ctas: int, tile_tokens: int, segment_overhead: int):
    """The compiled planner for a plan shape, cached by its static key (no GPU needed to compile)."""
    key = (max_batch, num_ctas, tile_tokens, segment_overhead, use_pdl())
    if key not in _compiled:
        op = PlanSplitsSM90(*key)
        _compiled[key] = cute.compile(op, *(gmem_ptr(Int32, 4) for _ in range(7)), Int32(1), cuda_stream())
    return _compiled[key]


def run_plan_splits_sm90(seq_lens, plan, stream) -> None:
    """Refill `plan` (a SplitPlan on the GPU) from device `seq_lens` (int32 [batch <= max_batch])."""
    fn = compile_plan_splits_sm90(plan.max_batch, plan.num_ctas, plan.tile_tokens, plan.segment_overhead)
    seq_lens = seq_lens.contiguous()
    fn(*(gmem_ptr(Int32, 4, t.data_ptr()) for t in (seq_lens, *plan.tensors())), Int32(seq_lens.shape[0]),
       cuda_stream(stream))
