"""The split planner as one CuTe DSL kernel (one CTA), computing exactly what `planner.plan_splits` does.

Why a kernel: the plain-torch planner is about 25 small launches (cumsums, searchsorteds, copies), which cost
~67 us per decode step on the H200 even inside a CUDA graph: half of a 128K-token step. One CTA does the same
work in a microsecond or two. The torch planner stays the definition (and the CPU path); tests check both agree
bit for bit.

Both forms find every CTA boundary by a binary search over the requests' cost prefix (CTA c starts at cost
c * total // N), and every request's first and last CTA from the cost positions of its first and last tile,
((p + 1) * N - 1) // total, with no search and no wait for the boundaries.

Two forms, by the plan's max_batch (`config.planner_config` picks):
- `WarpPlanSplitsSM90`, up to WARP_PLANNER_MAX_BATCH requests: no CTA barrier. The planner's time is a launch
  and a chain of dependent steps (seq_lens from memory, a scan, searches, stores), each a few hundred cycles,
  so every warp loads all of seq_lens and scans it itself (lane l owns requests [l * PER, (l + 1) * PER), one
  shuffle scan over the lanes) and no warp waits for another. The boundary warps search their own copy of the
  prefixes in shared memory; the last warp plans the requests (a second shuffle scan numbers the workspace
  slots). H200, the planner alone: 1.95-2.02 -> 1.44-1.50 us at max_batch 8-16, 2.08 -> 1.70 at 64.
- `CtaPlanSplitsSM90`, for larger plans: 512 threads, thread t owning requests [t * PER, (t + 1) * PER), the
  scans through shared memory (5 CTA barriers); after the first scan warps 0-7 find the CTA boundaries while
  warps 8-15 plan the requests. The warp form's per-lane loops grow with max_batch (PER = max_batch / 32): 2.21
  against 2.14 us at 128, 3.87 against 2.34 at 256, 7.5 against 2.5 at 512.

Static configuration (`config.PlannerConfig`): the plan's fixed shape (max_batch, num_ctas, tile_tokens,
segment_overhead) and the form, so an engine compiles it once.
"""

from __future__ import annotations

import functools
import math

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.memory
from cutlass import Int32, Int64

from .. import jit_cache
from ..config import MAX_PLANNED_KV_LEN, PlannerConfig, planner_config
from .launch import cuda_stream, gmem_ptr, pdl_prologue

LANES = 32
# warp form: boundary warps, one boundary per lane for up to 8 * 32 - 1 CTAs, more per lane beyond
MAX_BOUNDARY_WARPS = 8
# CTA form: threads, and after the first scan threads [0, REQUEST_THREAD0) find the CTA boundaries, the rest plan
# the requests
THREADS = 512
WARPS = THREADS // 32
REQUEST_THREAD0 = 256
REQUEST_WARPS = (THREADS - REQUEST_THREAD0) // 32
REQUEST_BARRIER = 1  # named barrier of the request warps' scan (0 is the CTA's)


def _search_steps(n: int) -> int:
    """Iterations for a binary search over n sorted elements."""
    return max(1, math.ceil(math.log2(n + 1)) + 1)


class _PlannerSM90:
    """What both forms share: the static key, a request's tiles and cost, the searches and the CTA of a cost
    position."""

    def __init__(self, cfg: PlannerConfig):
        max_batch, num_ctas, tile_tokens, segment_overhead = (cfg.max_batch, cfg.num_ctas, cfg.tile_tokens,
                                                              cfg.segment_overhead)
        self.pdl = cfg.pdl
        self.max_batch = max_batch
        self.num_ctas = num_ctas
        self.tile_tokens = tile_tokens
        self.overhead = segment_overhead
        # the cost and tile sums fit int32 (plan_splits checks it); (p + 1) * N may not: 64-bit unless it fits
        largest_total = max(max_batch * (MAX_PLANNED_KV_LEN // tile_tokens + segment_overhead), num_ctas)
        self.wide_cta_of_cost = (largest_total + 1) * num_ctas >= 1 << 31
        self.narrow_total = (1 << 31) // num_ctas - 1  # totals below it keep (p + 1) * N in int32 (p < total)

    @cute.jit
    def __call__(self, p_seq_lens: cute.Pointer, p_cta_tile_start: cute.Pointer, p_cta_first_request: cute.Pointer,
                 p_request_tile_start: cute.Pointer, p_request_first_cta: cute.Pointer, p_num_splits: cute.Pointer,
                 p_split_offset: cute.Pointer, batch: Int32, stream: cuda.CUstream):
        B, N = self.max_batch, self.num_ctas
        seq_lens = cute.make_tensor(p_seq_lens, cute.make_layout(batch))
        outputs = (cute.make_tensor(p_cta_tile_start, cute.make_layout(N + 1)),
                   cute.make_tensor(p_cta_first_request, cute.make_layout(N)),
                   cute.make_tensor(p_request_tile_start, cute.make_layout(B + 1)),
                   cute.make_tensor(p_request_first_cta, cute.make_layout(B)),
                   cute.make_tensor(p_num_splits, cute.make_layout(B)),
                   cute.make_tensor(p_split_offset, cute.make_layout(B)))
        self.kernel(seq_lens, *outputs, batch).launch(grid=[1, 1, 1], block=[self.threads, 1, 1], stream=stream,
                                                      use_pdl=self.pdl)

    @cute.jit
    def _tiles(self, seq_lens: cute.Tensor, batch: Int32, b) -> Int32:
        """KV tiles of request b (0 past the batch), its length clamped as the torch planner clamps it."""
        length = Int32(0)
        if b < batch:
            length = seq_lens[b]
            if length < 0:
                length = Int32(0)
            if length > MAX_PLANNED_KV_LEN:
                length = Int32(MAX_PLANNED_KV_LEN)
        return (length + (self.tile_tokens - 1)) // self.tile_tokens

    @cute.jit
    def _cost(self, tiles: Int32) -> Int32:
        cost = Int32(0)
        if tiles > 0:
            cost = tiles + self.overhead
        return cost

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

    @cute.jit
    def _boundary(self, c, total: Int32, cost_start: cute.Tensor, req_start: cute.Tensor,
                  cta_tile_start: cute.Tensor, cta_first_request: cute.Tensor):
        """CTA c's first tile and first request. CTA c starts at cost c * total // N; the tiles that start before
        it are those of every request before the last one starting at or before it, plus that one's tiles past
        its overhead."""
        B, N = self.max_batch, self.num_ctas
        bound = ((Int64(c) * Int64(total)) // N).to(Int32)
        holder = self._count_at_most(cost_start, 0, B, bound) - 1
        start = req_start[holder]
        inside = bound - cost_start[holder] - self.overhead
        if inside < 0:
            inside = Int32(0)
        if inside > req_start[holder + 1] - start:
            inside = req_start[holder + 1] - start
        g = start + inside
        cta_tile_start[c] = g
        if c < N:
            first = self._count_at_most(req_start, 1, B, g)
            if first > B - 1:
                first = Int32(B - 1)
            cta_first_request[c] = first

    @cute.jit
    def _plan_request(self, b, cost_start: Int32, tiles: Int32, tile_start: Int32, total: Int32, total_tiles: Int32,
                      request_first_cta: cute.Tensor, num_splits: cute.Tensor, merged: cute.Tensor) -> Int32:
        """Request b's first CTA and split count, written to the plan, and its workspace slots (its splits when
        it has several, else 0) written to `merged` and returned. The first and last CTA are those whose cost
        intervals [c * total // N, (c + 1) * total // N) hold the cost positions of its first (last) tile. A
        request without tiles takes the position of the next request's first tile (the same cost start), or
        the last CTA when no tile follows."""
        position = cost_start + self.overhead
        first = Int32(self.num_ctas - 1)
        if tile_start < total_tiles:
            first = self._cta_of_cost(position, total)
        splits = Int32(0)
        if tiles > 0:
            splits = self._cta_of_cost(position + tiles - 1, total) - first + 1
        request_first_cta[b] = first
        num_splits[b] = splits
        slots = Int32(0)
        if splits > 1:
            slots = splits
        merged[b] = slots
        return slots

    @cute.jit
    def _cta_of_cost(self, p: Int32, total: Int32) -> Int32:
        """The CTA whose cost interval holds cost position p, clamped to [0, N - 1]."""
        N = self.num_ctas
        c = Int32(0)
        if cutlass.const_expr(self.wide_cta_of_cost):
            # 64-bit division only for totals that need it (~70 instructions instead of ~20)
            if total < self.narrow_total:
                c = ((p + 1) * N - 1) // total
            else:
                c = (((Int64(p) + 1) * N - 1) // Int64(total)).to(Int32)
        else:
            c = ((p + 1) * N - 1) // total
        if c < 0:
            c = Int32(0)
        if c > N - 1:
            c = Int32(N - 1)
        return c


class WarpPlanSplitsSM90(_PlannerSM90):
    """The barrier-free form (module docstring): boundary warps, then one request warp."""

    def __init__(self, cfg: PlannerConfig):
        super().__init__(cfg)
        self.per_lane = -(-cfg.max_batch // LANES)
        self.boundary_warps = min(MAX_BOUNDARY_WARPS, -(-(cfg.num_ctas + 1) // LANES))
        self.threads = LANES * (self.boundary_warps + 1)

    @cute.jit
    def _warp_exclusive_scan(self, value: Int32, lane):
        """(exclusive prefix, total) of one value per lane over the warp."""
        inclusive = value
        for k in cutlass.range_constexpr(5):
            other = cute.arch.shuffle_sync_up(inclusive, 1 << k)
            if lane >= (1 << k):
                inclusive = inclusive + other
        return inclusive - value, cute.arch.shuffle_sync(inclusive, LANES - 1)

    @cute.kernel
    def kernel(self, seq_lens: cute.Tensor, cta_tile_start: cute.Tensor, cta_first_request: cute.Tensor,
               request_tile_start: cute.Tensor, request_first_cta: cute.Tensor, num_splits: cute.Tensor,
               split_offset: cute.Tensor, batch: Int32):
        pdl_prologue(self.pdl)
        B, N, PER, BW = self.max_batch, self.num_ctas, self.per_lane, self.boundary_warps
        tidx, _, _ = cute.arch.thread_idx()
        lane = tidx % LANES
        warp = tidx // LANES
        smem = cutlass.memory.SmemAllocator()
        # each boundary warp's own copy of the requests' cost and tile prefixes (for its searches)
        cost_start = smem.allocate_tensor(Int32, cute.make_layout((B, BW), stride=(1, B)), 16)
        req_start = smem.allocate_tensor(Int32, cute.make_layout((B + 1, BW), stride=(1, B + 1)), 16)
        merged = smem.allocate_tensor(Int32, cute.make_layout(B), 16)  # the request warp's split counts > 1

        first_b = lane * PER
        lane_tiles = cute.make_rmem_tensor(cute.make_layout((PER,)), Int32)
        my_tiles = Int32(0)
        my_cost = Int32(0)
        for i in cutlass.range_constexpr(PER):
            t = self._tiles(seq_lens, batch, first_b + i)
            lane_tiles[i] = t
            my_tiles = my_tiles + t
            my_cost = my_cost + self._cost(t)
        tiles_before, total_tiles = self._warp_exclusive_scan(my_tiles, lane)
        cost_before, total_cost = self._warp_exclusive_scan(my_cost, lane)
        total = total_cost
        if total < N:
            total = Int32(N)  # fewer cost units than CTAs: unit intervals, later CTAs idle

        if warp < BW:
            # this warp's copy of the prefixes (requests past max_batch, from idle lanes, are not stored)
            for i in cutlass.range_constexpr(PER):
                b = first_b + i
                if b < B:
                    req_start[b, warp] = tiles_before
                    cost_start[b, warp] = cost_before
                    tiles_before = tiles_before + lane_tiles[i]
                    cost_before = cost_before + self._cost(lane_tiles[i])
            if lane == 0:
                req_start[B, warp] = total_tiles
            cute.arch.sync_warp()
            for c in cutlass.range(tidx, N + 1, BW * LANES):
                self._boundary(c, total, cost_start[None, warp], req_start[None, warp], cta_tile_start,
                               cta_first_request)
        else:
            self._plan_requests(lane_tiles, merged, request_tile_start, request_first_cta, num_splits,
                                split_offset, total, total_tiles, tiles_before, cost_before, lane)

    @cute.jit
    def _plan_requests(self, lane_tiles: cute.Tensor, merged: cute.Tensor, request_tile_start: cute.Tensor,
                       request_first_cta: cute.Tensor, num_splits: cute.Tensor, split_offset: cute.Tensor,
                       total: Int32, total_tiles: Int32, tiles_before: Int32, cost_before: Int32, lane):
        """The request warp: each of the lane's requests' first CTA and split count (`_plan_request`), then
        workspace slots in request order for those with several splits (a scan over the lanes)."""
        B, PER = self.max_batch, self.per_lane
        first_b = lane * PER
        my_merged = Int32(0)
        for i in cutlass.range_constexpr(PER):
            b = first_b + i
            t = lane_tiles[i]
            if b < B:
                request_tile_start[b] = tiles_before
                my_merged = my_merged + self._plan_request(b, cost_before, t, tiles_before, total, total_tiles,
                                                           request_first_cta, num_splits, merged)
            tiles_before = tiles_before + t
            cost_before = cost_before + self._cost(t)
        slots_before, _total_slots = self._warp_exclusive_scan(my_merged, lane)
        for i in cutlass.range_constexpr(PER):
            b = first_b + i
            if b < B:
                split_offset[b] = slots_before
                slots_before = slots_before + merged[b]  # written by this lane above
        if lane == 0:
            request_tile_start[B] = total_tiles


class CtaPlanSplitsSM90(_PlannerSM90):
    """The 512-thread form for large plans (module docstring)."""

    def __init__(self, cfg: PlannerConfig):
        super().__init__(cfg)
        self.threads = THREADS
        self.per_thread = -(-cfg.max_batch // THREADS)
        self.per_request_thread = -(-cfg.max_batch // (THREADS - REQUEST_THREAD0))

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

    @cute.kernel
    def kernel(self, seq_lens: cute.Tensor, cta_tile_start: cute.Tensor, cta_first_request: cute.Tensor,
               request_tile_start: cute.Tensor, request_first_cta: cute.Tensor, num_splits: cute.Tensor,
               split_offset: cute.Tensor, batch: Int32):
        pdl_prologue(self.pdl)
        B, N, PER = self.max_batch, self.num_ctas, self.per_thread
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
                t = self._tiles(seq_lens, batch, b)
                tiles[b] = t
                my_tiles = my_tiles + t
                my_cost = my_cost + self._cost(t)
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
                cost_before = cost_before + self._cost(t)
        if tidx == 0:
            req_start[B] = total_tiles
        cute.arch.barrier()

        total = total_cost
        if total < N:
            total = Int32(N)  # fewer cost units than CTAs: unit intervals, later CTAs idle
        if tidx < REQUEST_THREAD0:
            for c in cutlass.range(tidx, N + 1, REQUEST_THREAD0):
                self._boundary(c, total, cost_start, req_start, cta_tile_start, cta_first_request)
        else:
            self._plan_requests(tiles, cost_start, req_start, merged, scratch, request_tile_start, request_first_cta,
                                num_splits, split_offset, total, total_tiles, tidx - REQUEST_THREAD0, lane)

    @cute.jit
    def _plan_requests(self, tiles: cute.Tensor, cost_start: cute.Tensor, req_start: cute.Tensor, merged: cute.Tensor,
                       scratch: cute.Tensor, request_tile_start: cute.Tensor, request_first_cta: cute.Tensor,
                       num_splits: cute.Tensor, split_offset: cute.Tensor, total: Int32, total_tiles: Int32, t, lane):
        """The request warps (t: 0 to THREADS - REQUEST_THREAD0 - 1): each request's first CTA and split count
        (`_plan_request`), then workspace slots in request order for those with several splits."""
        B, PER = self.max_batch, self.per_request_thread
        my_merged = Int32(0)
        for i in cutlass.range_constexpr(PER):
            b = t * PER + i
            if b < B:
                my_merged = my_merged + self._plan_request(b, cost_start[b], tiles[b], req_start[b], total,
                                                           total_tiles, request_first_cta, num_splits, merged)
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


FORMS = {"warp": WarpPlanSplitsSM90, "cta": CtaPlanSplitsSM90}


def compile_planner(cfg: PlannerConfig):
    """The compiled planner of a configuration (once per configuration: `jit_cache`; no GPU needed)."""
    return jit_cache.compiled(cfg, lambda: (FORMS[cfg.form](cfg),
                                            (*(gmem_ptr(Int32, 4) for _ in range(7)), Int32(1), cuda_stream())))


def run_planner(seq_lens, plan, stream, cfg: PlannerConfig = None) -> None:
    """Refill `plan` (a SplitPlan on the GPU) from device `seq_lens` (int32 [batch <= max_batch]) with the
    planner of `cfg` (default: the runtime's for the plan's shape)."""
    if cfg is None:
        cfg = _planner_config(plan.max_batch, plan.num_ctas, plan.tile_tokens, plan.segment_overhead)
    fn = compile_planner(cfg)
    seq_lens = seq_lens.contiguous()
    fn(*(gmem_ptr(Int32, 4, t.data_ptr()) for t in (seq_lens, *plan.tensors())), Int32(seq_lens.shape[0]),
       cuda_stream(stream))


_planner_config = functools.lru_cache(maxsize=None)(planner_config)
