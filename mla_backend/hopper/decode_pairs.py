"""The SM90 decode for 64-row blocks with S and the softmax in the P.V warpgroups' registers, two chunks at a time
(research: `DecodeConfig.chunk_pairs`).

Why. In the S^T-warpgroup schedule (`decode_swg.py`) a third warpgroup computes S^T and hands it over through
shared memory; the two P.V warpgroups then read it back, run the softmax, load V^T and issue P.V, one chunk after
the other. At 64 rows that chain paces the chunk: ~2900 cycles (timeline, H128), against ~1100 of tensor work and
~1600 of shared-memory traffic (S^T's 16 KB stored and read back included), so neither pipe is busy.

Here warpgroups 0 and 1 take the chunks in pairs, (2p, 2p + 1): warpgroup w computes S = Q.K^T of chunk 2p + w
with the 64 query rows as M (both operands in shared memory, two chains of 9 k32 steps summed in fp32), and runs
its softmax on the accumulators, where a row's 16 values of a thread and its quad's 3 others are the whole row
(two shuffles). The two warpgroups then exchange their chunks' row maxima (shared memory, one 256-thread barrier),
so that both take the same new max m(p) = max(m(p - 1), max S(2p), max S(2p + 1)) and both chunks' P are relative
to it; each writes its chunk's P (e4m3 words, the P.V B operand) and, after a second barrier, rescales its O^T
once for the pair (alpha = exp2(m(p - 1) - m(p))) and accumulates both chunks into its 256 dims: V^T of both
chunks by ldmatrix.trans into registers (64), then 16 (32 with two P planes) back-to-back wgmmas. S^T never goes
through shared memory, the softmax reads no shared memory, and one rescale serves two chunks.

The third warpgroup only loads. Its warp 0 issues each chunk's TMA boxes onto the stage's
"landed" mbarrier once the stage's "read" mbarrier says both P.V warpgroups are done with the chunk it held
(every thread of both arrives after its V^T loads of that chunk; the owner's S was waited for before); its 128
threads copy Q by cp.async at a segment's start and arrive on PAIR_Q_BAR once it landed. The chunks are counted
over the CTA's segments, so each stage's mbarrier phases follow from the count. A segment's last chunk is zeroed
past its end by the warpgroup that computes its S, before that S (both warpgroups read its V^T only after the
P barrier). A segment with an odd number of chunks ends with a pair whose second chunk does not exist: warpgroup 1
then computes S on the first chunk's stage with every token masked, so its P is zero and its maxima -inf, and
both warpgroups accumulate that zero P against the first chunk's V^T (no wgmma is issued under a branch, which
would make ptxas serialise them all). The ring has 4 stages: one pair computed while the next lands.

Registers (setmaxnreg): 232 for the P.V warpgroups (O^T 128, S's two chains 64, or both chunks' V^T 64) and 40 for
the load warpgroup, the 3 x 168 a 384-thread launch gives each thread triple. S of the next pair is issued once
the previous pair's P.V is done, not under it: its 64 accumulators do not fit beside O^T and V^T.

Not yet run on a GPU.
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from ..shapes import KV_DIM
from .barriers import PAIR_MAX_BAR, PAIR_P_BAR, PAIR_Q_BAR, PAIR_SUM_BAR, PAIR_WG_BAR
from .decode_common import CTAContext, MLADecodeSM90
from .decode_layout import (CHUNK, KV_BLOCKS, SOFTMAX_THREADS, WARPGROUP, p_buffer_bytes, p_words_layout,
                            smem_region_bytes)
from .ptx import fence_operand, fence_proxy_async_smem, quantize_p_e4m3, quantize_p_hi_lo, wgmma_wait

PAIRS_REGS_MMA, PAIRS_REGS_LOAD = 232, 40
STAGE_BYTES = CHUNK * 128 * KV_BLOCKS
QUAD = 4  # the lanes of a quad hold one accumulator row


class MLADecodePairsSM90(MLADecodeSM90):
    """The chunk-pairs schedule (module docstring): 64-row blocks, KV by TMA."""

    num_threads = SOFTMAX_THREADS + WARPGROUP
    # maxntid and one CTA per SM, so that ptxas gives the setmaxnreg regions their budgets (`decode_swg.py`)
    launch_bounds = dict(max_number_threads=[SOFTMAX_THREADS + WARPGROUP, 1, 1], min_blocks_per_mp=1)
    ring_mbarriers = 2  # per stage "landed" (TMA) and "read" (both P.V warpgroups)

    def register_budgets(self):
        """(P.V warpgroups, load warpgroup) setmaxnreg budgets."""
        return PAIRS_REGS_MMA, PAIRS_REGS_LOAD

    def smem_regions(self) -> dict:
        """As the other schedules', with the S^T region holding only the two warpgroups' chunk maxima (row,
        warpgroup)."""
        regions = smem_region_bytes(self.rows, self.cfg.num_stages, self.cfg.p_planes)
        regions["s"] = 2 * self.rows * 4
        return regions

    @cute.jit
    def _schedule(self, cta: CTAContext):
        NS = self.cfg.num_stages
        bars = cta.storage.kv_full.data_ptr()
        if cta.tidx == SOFTMAX_THREADS:
            for st in cutlass.range_constexpr(NS):
                cute.arch.mbarrier_init(bars + st, 1)  # landed: the issuing lane's expect-tx arrival
                cute.arch.mbarrier_init(bars + NS + st, SOFTMAX_THREADS)  # read: every P.V thread
            cute.arch.mbarrier_init_fence()
        cute.arch.barrier()  # the mbarriers are initialised before anyone waits on or arrives at them
        g = cta.mCtaTileStart[cta.cta]
        g_end = cta.mCtaTileStart[cta.cta + 1]
        b = cta.mCtaFirstReq[cta.cta]
        if cta.wg == 2:
            self._load_warpgroup(cta, g, g_end, b)
        else:
            self._mma_warpgroups(cta, g, g_end, b)

    # ------------------------------------------------------------------------------ warpgroup 2: the loads
    @cute.jit
    def _load_warpgroup(self, cta: CTAContext, g: Int32, g_end: Int32, b: Int32):
        cute.arch.setmaxregister_decrease(self.register_budgets()[1])
        C = CHUNK
        NS = self.cfg.num_stages
        tw = cta.tidx - SOFTMAX_THREADS
        # CuTe's TMA copy elects one lane of the warp that reaches it: warp 0 issues the boxes
        issuer = tw < 32
        bars = cta.storage.kv_full.data_ptr()
        boxes = self._kv_tma_partitions(cta, cta.storage.ring.data_ptr())
        done = Int32(0)  # chunks of the CTA's earlier segments
        while g < g_end:
            b, seg_end, seq_len, tok_begin, tok_end, n_chunks = self._segment(cta.mReqTileStart, cta.mSeq, b, g,
                                                                              g_end, cta.t_last)
            self._load_q_block(cta, tw, b)
            cute.arch.cp_async_commit_group()
            if issuer:
                # the first NS chunks: their stages were all read in the earlier segments (the P.V threads
                # arrive before the segment-end barrier), so no wait holds them; their pages read together
                pages = [self._lookup_chunk_pages(cta.mBT, b, tok_begin + st * C, tok_end) for st in range(NS)]
                for st in cutlass.range_constexpr(NS):
                    if st < n_chunks:
                        self._refill_stage(cta, boxes, bars, done + st, pages[st][0], pages[st][1],
                                           tok_begin + st * C)
            cute.arch.cp_async_wait_group(0)
            fence_proxy_async_smem()  # Q is a wgmma operand
            cute.arch.barrier_arrive(barrier_id=PAIR_Q_BAR, number_of_threads=self.num_threads)
            if issuer:
                page_a, page_b = self._lookup_chunk_pages(cta.mBT, b, tok_begin + NS * C, tok_end)
                for j in range(NS, n_chunks):
                    self._refill_stage(cta, boxes, bars, done + j, page_a, page_b, tok_begin + j * C)
                    # the next chunk's page, read while this warp waits for its stage
                    page_a, page_b = self._lookup_chunk_pages(cta.mBT, b, tok_begin + (j + 1) * C, tok_end)
            cute.arch.barrier()  # segment end: every S of the segment is done, sQ may be refilled
            done = done + n_chunks
            g = seg_end
            b = b + 1

    @cute.jit
    def _refill_stage(self, cta: CTAContext, boxes, bars: cute.Pointer, v: Int32, page_a: Int32, page_b: Int32,
                      tok0: Int32):
        """The CTA's chunk v (counted over its segments; tokens [tok0, tok0 + C) on page_a / page_b) into stage
        v % NS, once both P.V warpgroups read the chunk v - NS it held."""
        NS = self.cfg.num_stages
        stage = v % NS
        if v >= NS:
            cute.arch.mbarrier_wait(bars + NS + stage, (v // NS + 1) % 2)
        # the P.V threads read the stage by ldmatrix (the generic proxy) and TMA (the async proxy) writes it
        # next: a proxy fence on the path from those reads to these writes (`decode_swg_tma._refill`)
        fence_proxy_async_smem()
        self._issue_chunk_tma(cta, boxes, bars + stage, page_a, page_b, tok0, stage)

    # ----------------------------------------------------------------- warpgroups 0 and 1: S, softmax, P.V
    @cute.jit
    def _mma_warpgroups(self, cta: CTAContext, g: Int32, g_end: Int32, b: Int32):
        cute.arch.setmaxregister_increase(self.register_budgets()[0])
        ROWS = self.rows
        NA = ROWS // 2
        NT = self.num_threads
        wg, wl, lg, lt = cta.wg, cta.wl, cta.lg, cta.lt
        r0 = 16 * wl + lg  # this thread's accumulator rows of S: r0 and r0 + 8
        sPw = cute.make_tensor(cute.recast_ptr(cta.storage.p.data_ptr(), dtype=Int32),
                               p_words_layout(ROWS, self.cfg.p_planes))
        sMax = cta.storage.s.get_tensor(cute.make_layout((ROWS, 2), stride=(1, ROWS)))
        sAlpha = cta.storage.alpha.get_tensor(cute.make_layout((ROWS, 2), stride=(1, ROWS)))
        sSum = cta.storage.row_ml.get_tensor(cute.make_layout((ROWS,)))
        acc_O = cute.make_rmem_tensor(cute.make_layout((4 * NA,)), Float32)
        acc_S = cute.make_rmem_tensor(cute.make_layout((CHUNK // 2,)), Float32)
        acc_S2 = cute.make_rmem_tensor(cute.make_layout((CHUNK // 2,)), Float32)
        done = Int32(0)  # chunks of the CTA's earlier segments
        while g < g_end:
            b, seg_end, seq_len, tok_begin, tok_end, n_chunks = self._segment(cta.mReqTileStart, cta.mSeq, b, g,
                                                                              g_end, cta.t_last)
            row_end0 = self._row_end(tok_end, seq_len, cta.row0 + r0)
            row_end1 = self._row_end(tok_end, seq_len, cta.row0 + r0 + 8)
            split = cta.mNumSplits[b] != 1
            slot = cta.mSplitOffset[b] + cta.cta - cta.mReqFirstCta[b]
            acc_O.fill(0.0)
            m0 = -Float32.inf
            m1 = -Float32.inf
            l0 = Float32(0.0)
            l1 = Float32(0.0)
            cute.arch.barrier(barrier_id=PAIR_Q_BAR, number_of_threads=NT)  # Q of the segment landed
            for pr in range((n_chunks + 1) // 2):
                m0, m1, l0, l1 = self._pair(cta, acc_O, acc_S, acc_S2, sPw, sMax, sAlpha, done, pr, n_chunks,
                                            tok_begin, tok_end, row_end0, row_end1, m0, m1, l0, l1)
            cute.arch.barrier()  # segment end: every S of the segment is done, sQ may be refilled
            wgmma_wait(0)
            for i in cutlass.range_constexpr(4 * NA):
                acc_O[i] = fence_operand(acc_O[i])
            self._end_segment(cta, acc_O, sSum, m0, m1, l0, l1, b, split, slot)
            done = done + n_chunks
            g = seg_end
            b = b + 1

    @cute.jit
    def _pair(self, cta: CTAContext, acc_O: cute.Tensor, acc_S: cute.Tensor, acc_S2: cute.Tensor,
              sPw: cute.Tensor, sMax: cute.Tensor, sAlpha: cute.Tensor, done: Int32, pr: Int32, n_chunks: Int32,
              tok_begin: Int32, tok_end: Int32, row_end0: Int32, row_end1: Int32, m0: Float32, m1: Float32,
              l0: Float32, l1: Float32):
        """Pair pr of the segment: S and the softmax of this warpgroup's chunk, the maxima exchange, P, and P.V
        of both chunks into this warpgroup's dims (module docstring). Returns the rows' new maxima and this
        thread's shares of their sums."""
        C = CHUNK
        NS = self.cfg.num_stages
        NA = self.rows // 2
        wg, wl, lg, lt = cta.wg, cta.wl, cta.lg, cta.lt
        tw = cta.tidx % WARPGROUP
        bars = cta.storage.kv_full.data_ptr()
        r0 = 16 * wl + lg
        c0 = 2 * pr
        own = c0 + wg  # this warpgroup's chunk (past the segment's end: S on chunk c0's stage, all masked)
        v0 = done + c0
        stage0 = v0 % NS
        s_stage = stage0
        s_phase = (v0 // NS) % 2
        if own < n_chunks:
            s_stage = (v0 + wg) % NS
            s_phase = ((v0 + wg) // NS) % 2
        cute.arch.mbarrier_wait(bars + s_stage, s_phase)
        n_valid = tok_end - (tok_begin + own * C)
        if own < n_chunks:
            if n_valid < C:
                # the segment's last chunk ends inside a loaded page: zero the rest before S and V^T read it
                self._zero_tail_tokens(cta.sRing, cta.zero16, n_valid, s_stage, tw, WARPGROUP)
                fence_proxy_async_smem()
                cute.arch.barrier(barrier_id=PAIR_WG_BAR + wg, number_of_threads=WARPGROUP)
        # the previous pair's P.V is done: its V^T registers are free and its P buffers may be rewritten
        wgmma_wait(0)
        for i in cutlass.range_constexpr(4 * NA):
            acc_O[i] = fence_operand(acc_O[i])
        self._issue_s_rows_as_m(acc_S, acc_S2, cta.ring_addr, cta.q_addr, s_stage)

        # the softmax of this warpgroup's chunk, on the accumulators: acc_S[4i + e] = (row r0, token 8i + 2lt + e),
        # acc_S[4i + 2 + e] = (row r0 + 8, same token)
        tok0 = tok_begin + own * C
        cmax0 = -Float32.inf
        cmax1 = -Float32.inf
        for i in cutlass.range_constexpr(C // 8):
            for e in cutlass.range_constexpr(2):
                n = 8 * i + 2 * lt + e
                s0 = acc_S[4 * i + e] * cta.scale_log2
                s1 = acc_S[4 * i + 2 + e] * cta.scale_log2
                if tok0 + n >= row_end0:
                    s0 = -Float32.inf
                if tok0 + n >= row_end1:
                    s1 = -Float32.inf
                acc_S[4 * i + e] = s0
                acc_S[4 * i + 2 + e] = s1
                cmax0 = cute.arch.fmax(cmax0, s0)
                cmax1 = cute.arch.fmax(cmax1, s1)
        cmax0 = self._quad_allreduce(cmax0, True)
        cmax1 = self._quad_allreduce(cmax1, True)
        if lt == 0:
            sMax[r0, wg] = cmax0
            sMax[r0 + 8, wg] = cmax1
        cute.arch.barrier(barrier_id=PAIR_MAX_BAR, number_of_threads=SOFTMAX_THREADS)
        # both warpgroups take the same max (fmax is exact and commutative)
        new0 = cute.arch.fmax(m0, cute.arch.fmax(cmax0, sMax[r0, 1 - wg]))
        new1 = cute.arch.fmax(m1, cute.arch.fmax(cmax1, sMax[r0 + 8, 1 - wg]))
        use0 = new0
        use1 = new1
        if new0 == -Float32.inf:
            use0 = Float32(0.0)
        if new1 == -Float32.inf:
            use1 = Float32(0.0)
        alpha0 = cute.math.exp2(m0 - use0, fastmath=True)
        alpha1 = cute.math.exp2(m1 - use1, fastmath=True)
        csum0, csum1 = self._write_p(acc_S, sPw, use0, use1, r0, lt, wg)
        if lt == 0:
            sAlpha[r0, wg] = alpha0
            sAlpha[r0 + 8, wg] = alpha1
        cute.arch.barrier(barrier_id=PAIR_P_BAR, number_of_threads=SOFTMAX_THREADS)

        # both chunks into this warpgroup's 256 dims (a missing second chunk: zero P against chunk c0's V^T)
        stage1 = stage0
        phase1 = (v0 // NS) % 2
        if c0 + 1 < n_chunks:
            stage1 = (v0 + 1) % NS
            phase1 = ((v0 + 1) // NS) % 2
        # landed (the other warpgroup's chunk: its owner waited, this wait only returns)
        cute.arch.mbarrier_wait(bars + stage0, (v0 // NS) % 2)
        cute.arch.mbarrier_wait(bars + stage1, phase1)
        a0 = self._load_vt(cta.ring_addr + stage0 * STAGE_BYTES, wg * 4, wl, cta.lane)
        a1 = self._load_vt(cta.ring_addr + stage1 * STAGE_BYTES, wg * 4, wl, cta.lane)
        cute.arch.mbarrier_arrive(bars + NS + stage0)
        if c0 + 1 < n_chunks:
            cute.arch.mbarrier_arrive(bars + NS + stage1)
        self._rescale_o(acc_O, sAlpha[None, wg], lt, self.cfg.unit_rescale_skip)
        PB = p_buffer_bytes(self.rows, self.cfg.p_planes)
        p_addr = cta.storage.p.data_ptr().toint()
        self._issue_pv_regs(acc_O, a0, p_addr, 0)
        self._issue_pv_regs(acc_O, a1, p_addr + PB, 0)
        return new0, new1, l0 * alpha0 + csum0, l1 * alpha1 + csum1

    @cute.jit
    def _issue_s_rows_as_m(self, acc_S: cute.Tensor, acc_S2: cute.Tensor, ring_addr: Int32, q_addr: Int32,
                           stage: Int32):
        """S = Q.K^T of the chunk in `stage` with the 64 rows as M, waited for: two chains of 9 k32 steps summed
        in fp32 into acc_S (or one chain of 18, `DecodeConfig.s_chains`)."""
        half = KV_DIM // 64
        if cutlass.const_expr(self.cfg.s_chains == 1):
            self._issue_s(acc_S, ring_addr, q_addr, stage, 0, 2 * half, True)
            wgmma_wait(0)
            for i in cutlass.range_constexpr(CHUNK // 2):
                acc_S[i] = fence_operand(acc_S[i])
        else:
            self._issue_s(acc_S, ring_addr, q_addr, stage, 0, half, True)
            self._issue_s(acc_S2, ring_addr, q_addr, stage, half, half, True)
            wgmma_wait(0)
            for i in cutlass.range_constexpr(CHUNK // 2):
                acc_S[i] = fence_operand(acc_S[i]) + fence_operand(acc_S2[i])

    @cute.jit
    def _write_p(self, acc_S: cute.Tensor, sPw: cute.Tensor, use0: Float32, use1: Float32, r0: Int32, lt: Int32,
                 wg: Int32):
        """P = exp2(s - max) of this thread's values of rows r0 and r0 + 8 as e4m3 words (x p_scale; one plane,
        or hi and lo) into P buffer wg: word 4k + lt of a row is tokens 16k + 2lt + (0, 1, 8, 9), the pi order of
        the P.V A registers (`decode_mma`), which are this thread's acc_S[8k + (0, 1, 4, 5)] (row r0) and
        [8k + (2, 3, 6, 7)] (row r0 + 8). Returns the thread's sums of the two rows' p."""
        SCALE = self.cfg.p_scale
        csum0 = Float32(0.0)
        csum1 = Float32(0.0)
        if cutlass.const_expr(self.cfg.runs("softmax")):  # else a research build: P is not written
            for k in cutlass.range_constexpr(CHUNK // 16):
                for h in cutlass.range_constexpr(2):
                    use = use0 if h == 0 else use1
                    pv = [cute.math.exp2(acc_S[8 * k + 2 * h + d] - use, fastmath=True) for d in (0, 1, 4, 5)]
                    part = (pv[0] + pv[1]) + (pv[2] + pv[3])
                    if h == 0:
                        csum0 = csum0 + part
                    else:
                        csum1 = csum1 + part
                    row = r0 + 8 * h
                    if cutlass.const_expr(self.cfg.p_planes == 2):
                        hi, lo = quantize_p_hi_lo(pv[0] * SCALE, pv[1] * SCALE, pv[2] * SCALE, pv[3] * SCALE)
                        sPw[4 * k + lt, row, 0, wg] = hi
                        sPw[4 * k + lt, row, 1, wg] = lo
                    else:
                        sPw[4 * k + lt, row, 0, wg] = quantize_p_e4m3(pv[0] * SCALE, pv[1] * SCALE, pv[2] * SCALE,
                                                                      pv[3] * SCALE)
            fence_proxy_async_smem()  # P is a wgmma operand
        return csum0, csum1

    @cute.jit
    def _quad_allreduce(self, val: Float32, is_max: cutlass.Constexpr) -> Float32:
        """Reduce over the 4 lanes of a quad (one accumulator row)."""
        for i in cutlass.range_constexpr(int(math.log2(QUAD))):
            other = cute.arch.shuffle_sync_bfly(val, offset=QUAD >> (i + 1))
            if cutlass.const_expr(is_max):
                val = cute.arch.fmax(val, other)
            else:
                val = val + other
        return val

    @cute.jit
    def _end_segment(self, cta: CTAContext, acc_O: cute.Tensor, sSum: cute.Tensor, m0: Float32, m1: Float32,
                     l0: Float32, l1: Float32, b: Int32, split, slot: Int32):
        """A segment's rows: each row's sum over its quad and both warpgroups, its lse and output scale
        (warpgroup 0), then both warpgroups' dims of the output or partial."""
        wg, wl, lg, lt = cta.wg, cta.wl, cta.lg, cta.lt
        r0 = 16 * wl + lg
        l0 = self._quad_allreduce(l0, False)
        l1 = self._quad_allreduce(l1, False)
        if wg == 1 and lt == 0:
            sSum[r0] = l0
            sSum[r0 + 8] = l1
        cute.arch.barrier(barrier_id=PAIR_SUM_BAR, number_of_threads=SOFTMAX_THREADS)
        if wg == 0 and lt == 0:
            self._finish_row(m0, l0 + sSum[r0], cta.k_scale, cta.sInvL, cta.mLse, cta.mPLse, r0, cta.row0 + r0, b,
                             split, slot)
            self._finish_row(m1, l1 + sSum[r0 + 8], cta.k_scale, cta.sInvL, cta.mLse, cta.mPLse, r0 + 8,
                             cta.row0 + r0 + 8, b, split, slot)
        cute.arch.barrier(barrier_id=PAIR_SUM_BAR, number_of_threads=SOFTMAX_THREADS)  # sInvL written
        self._write_rows(acc_O, cta.sInvL, cta.mOut, cta.mPOut, cta.row0, b, split, slot, wg, wl, lg, lt, 4)
