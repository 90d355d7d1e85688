"""The SM90 decode for 32-, 48- and 64-row blocks (MTP q_len 2-8, many heads per rank): the S^T-warpgroup schedule
(the runtime's at 32 and 48 rows; 64-row blocks run the chunk-pairs schedule, `decode_pairs.py`, unless asked).

A third warpgroup (wg 2) loads Q and the KV chunks (a ring of 3 or 4 stages) and runs all 18 k32 steps of S^T per
chunk (two chains of 9 summed in fp32), storing the full S^T into one of two buffers; warpgroups 0 and 1 run only
the softmax (all 256 threads; 192 with 48 rows) and P.V (256 dims each). They meet through named barriers
(`barriers.py`), per chunk j: S_FULL[j % 2] (S^T(j) stored, its chunk landed: warpgroup 2 arrives, 0 and 1 wait)
and S_FREE[j % 2] (S^T(j) read and the V^T registers of chunk j loaded: 0 and 1 arrive; warpgroup 2 waits before
it loads chunk j + NS - 1 into that stage, which also orders its S^T(j + 2) store after the reads of S^T(j)). So
S^T(j + 1) and the loads run under the softmax of chunk j, and the softmax warps never issue, wait for or store
S^T. H200, decode alone, one process, against both warpgroups on every chunk (S^T split over K, O^T over the
dims): H12 q8 1M x B1 512.9 -> 426.1 us, q8 128K x B4 263.1 -> 221.7, H16 q2 1M x B2 447.1 -> 395.5, H12 q4 1M x B1
280.6 -> 238.2, H128 q1 page 64 128K x B4 337.3 -> 257.7, H16 q4 page 64 1M x B1 367.3 -> 283.2. (The softmax in a
third warpgroup instead was no faster: one warpgroup's softmax chain became the bottleneck.)

Registers: setmaxnreg gives the softmax / P.V warpgroups and the S^T warpgroup budgets that add up to what a
384-thread launch gives each thread triple (3 x 168): 208 / 88, and 200 / 104 for 64 rows, where the S^T warpgroup
holds two chains of 32 accumulators and the P.V warpgroups 128 O^T registers (ptxas, sm_90a: 208 / 88 serialises
the wgmmas there, 216 / 72 spills, 200 / 104 neither).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from .barriers import LOAD_BAR, PV_BAR, S_FREE, S_FULL, SWG_ALPHA_BAR
from .decode_common import CTAContext, MLADecodeSM90
from .decode_layout import (CHUNK, KV_BLOCKS, SOFTMAX_THREADS, WARPGROUP, p_buffer_bytes, p_words_layout,
                            s_full_layout, s_logical_row)
from .ptx import fence_proxy_async_smem

SW_REGS_PV, SW_REGS_S = 208, 88
SW_REGS_PV_64, SW_REGS_S_64 = 200, 104


def sw_register_budgets(rows_per_block: int):
    """(softmax / P.V warpgroups, S^T warpgroup) setmaxnreg budgets (module docstring)."""
    return (SW_REGS_PV_64, SW_REGS_S_64) if rows_per_block == 64 else (SW_REGS_PV, SW_REGS_S)


class MLADecodeSwgSM90(MLADecodeSM90):
    num_threads = SOFTMAX_THREADS + WARPGROUP
    softmax_pool = SOFTMAX_THREADS
    # maxntid (not the automatic reqntid) and one CTA per SM, or ptxas caps the whole kernel at 65536 / 384 = 168
    # registers instead of giving the setmaxnreg regions their budgets
    launch_bounds = dict(max_number_threads=[SOFTMAX_THREADS + WARPGROUP, 1, 1], min_blocks_per_mp=1)
    # S^T's rows spread over the banks, so that the S^T warpgroup's 4-byte stores meet no bank twice (72-float
    # rows in order: 2-way). H200, decode alone, one process, outputs identical: H128 q1 page 64 128K x B4 208.3 ->
    # 206.2 us (minima 194.3 -> 185.5), H16 q4 page 64 1M x B2 424.9 -> 392.6, H64 page 64 1M x B2 403.4 -> 398.8
    # (minima 378.4 -> 364.4); 32 and 48 rows unchanged.
    s_rows_spread = True

    def __init__(self, cfg):
        super().__init__(cfg)
        # 32 rows issue P.V(ci - 1) between the words of the softmax of chunk ci (`_pv_in_softmax_chunk`); every
        # thread of the two warpgroups owns a row then, so all of them reach each wgmma
        self.pv_in_softmax = self.rows == 32
        assert not self.pv_in_softmax or self.softmax_threads == SOFTMAX_THREADS

    def register_budgets(self):
        """(softmax / P.V warpgroups, S^T warpgroup) setmaxnreg budgets."""
        return sw_register_budgets(self.rows)

    @cute.jit
    def _schedule(self, cta: CTAContext):
        storage = cta.storage
        # full S^T (row, token, 0, buffer = chunk % 2); P words (word, row, plane, buffer); alpha (row, buffer)
        sS = storage.s.get_tensor(s_full_layout(self.rows))
        sPw = cute.make_tensor(cute.recast_ptr(storage.p.data_ptr(), dtype=Int32), p_words_layout(self.rows, self.cfg.p_planes))
        sAlpha = storage.alpha.get_tensor(cute.make_layout((self.rows, 2), stride=(1, self.rows)))
        # the CTA's global tiles [g, g_end), from its first request b on
        g = cta.mCtaTileStart[cta.cta]
        g_end = cta.mCtaTileStart[cta.cta + 1]
        b = cta.mCtaFirstReq[cta.cta]
        if cta.wg == 2:
            self._s_warpgroup(cta, sS, g, g_end, b)
        else:
            self._softmax_warpgroups(cta, sS, sPw, sAlpha, g, g_end, b)

    # ----------------------------------------------------------------------------- warpgroup 2: loads and S^T
    @cute.jit
    def _s_warpgroup(self, cta: CTAContext, sS: cute.Tensor, g: Int32, g_end: Int32, b: Int32):
        cute.arch.setmaxregister_decrease(self.register_budgets()[1])
        ROWS = self.rows
        NA = ROWS // 2
        C = CHUNK
        NS = self.cfg.num_stages
        NT = self.num_threads
        mBT, mKV, atom, sRing, zero16 = cta.mBT, cta.mKV, cta.atom_cp_async, cta.sRing, cta.zero16
        tw = cta.tidx - SOFTMAX_THREADS
        lead = tw == 0
        acc_S = cute.make_rmem_tensor(cute.make_layout((NA,)), Float32)
        acc_S2 = cute.make_rmem_tensor(cute.make_layout((NA,)), Float32)
        while g < g_end:
            b, seg_end, seq_len, tok_begin, tok_end, n_chunks = self._segment(cta.mReqTileStart, cta.mSeq, b, g,
                                                                              g_end, cta.t_last)
            # Q and chunks 0 .. NS - 2
            self._load_q_block(cta, tw, b)
            for st in cutlass.range_constexpr(NS - 1):
                if st < n_chunks:
                    self._load_chunk_wg(mBT, mKV, atom, sRing, zero16, b, tok_begin + st * C, tok_end, st, tw)
                cute.arch.cp_async_commit_group()
            # The block-table entries (one per half chunk) of the next chunk to load and of the one after: read two
            # iterations before their copies, or this warpgroup's chain (and so S^T of the next chunk) waits one L2
            # round trip per chunk (ncu, q_len 8: the softmax warps then waited for S_FULL; H200, decode alone: q8
            # 1M x B1 443.7 -> 417.8 us, q8 128K x B4 228.8 -> 213.9, H16 q2 1M x B2 408.0 -> 392.2).
            next_a = self._lookup_page(mBT, b, tok_begin + (NS - 1) * C, tok_end, tw)
            next_b = self._lookup_page(mBT, b, tok_begin + (NS - 1) * C + C // 2, tok_end, tw)
            after_a = self._lookup_page(mBT, b, tok_begin + NS * C, tok_end, tw)
            after_b = self._lookup_page(mBT, b, tok_begin + NS * C + C // 2, tok_end, tw)

            for j in range(n_chunks):
                cute.arch.cp_async_wait_group(NS - 2)  # chunk j (and Q) landed: one group younger in flight
                fence_proxy_async_smem()
                cute.arch.barrier(barrier_id=LOAD_BAR, number_of_threads=WARPGROUP)  # every copy of chunk j done
                self._stamp(cta, lead, j, 0)  # "chunk landed"
                self._issue_s_chains(acc_S, acc_S2, cta.ring_addr, cta.q_addr, j % NS)
                if cutlass.const_expr(ROWS == 64):
                    # 64 rows: the next chunk's copies are issued while S^T(j) runs, and S_FULL(j) follows them.
                    # H200, decode alone, one process, copies after S_FULL(j) -> under S^T(j): H128 q1 1M x B4
                    # 1948.8 -> 1908.5 us, page 64 128K x B4 259.0 -> 252.8, H128 q2 256K x B2 476.2 -> 464.2, H16 q4
                    # 1M x B1 271.2 -> 267.1; steps H128 q1 1M x B4 1767.7 / 1797.0 -> 1738.8 / 1739.9. With 32 and
                    # 48 rows it was 1-5% slower (q8 1M x B1 412.4 -> 436.5): there S_FULL(j) waiting for the
                    # copies delays the softmax.
                    self._stamp(cta, lead, j, 3)  # "S_FREE wait begins"
                    self._copy_next_chunk(cta, next_a, next_b, tok_begin, j, n_chunks, tw)
                    self._stamp(cta, lead, j, 4)  # "copies issued"
                self._sum_s_chains(acc_S, acc_S2)
                self._stamp(cta, lead, j, 1)  # "S^T done"
                # buffer j % 2 last held S^T(j - 2), released (S_FREE) before this warpgroup loaded chunk j + 1
                self._store_s(acc_S, sS[None, None, None, j % 2], 0, cta.wl, cta.lg, cta.lt)
                cute.arch.barrier_arrive(barrier_id=S_FULL + j % 2, number_of_threads=NT)
                self._stamp(cta, lead, j, 2)  # "S^T stored"
                if cutlass.const_expr(ROWS != 64):
                    self._stamp(cta, lead, j, 3)  # "S_FREE wait begins"
                    self._copy_next_chunk(cta, next_a, next_b, tok_begin, j, n_chunks, tw)
                    self._stamp(cta, lead, j, 4)  # "copies issued"
                next_a = after_a
                next_b = after_b
                after_a = self._lookup_page(mBT, b, tok_begin + (j + NS + 1) * C, tok_end, tw)
                after_b = self._lookup_page(mBT, b, tok_begin + (j + NS + 1) * C + C // 2, tok_end, tw)
            self._end_segment_s(n_chunks)
            g = seg_end
            b = b + 1

    @cute.jit
    def _end_segment_s(self, n_chunks: Int32):
        """The S^T warpgroup's end of a segment: S_FREE of its last chunk (whose S^T and V^T the softmax warpgroups
        have read), its own copies done (a segment without chunks still loaded Q), then the two CTA barriers the
        softmax warpgroups meet at the segment's end."""
        if n_chunks > 0:
            cute.arch.barrier(barrier_id=S_FREE + (n_chunks - 1) % 2, number_of_threads=self.num_threads)
        cute.arch.cp_async_wait_group(0)
        cute.arch.barrier()  # segment end: sQ and the ring are free, sInvL written
        cute.arch.barrier()  # the outputs are written

    @cute.jit
    def _copy_next_chunk(self, cta: CTAContext, page_a: Int32, page_b: Int32, tok_begin: Int32, j: Int32,
                         n_chunks: Int32, tw: Int32):
        """The S^T warpgroup in iteration j: copy chunk j + NS - 1 (its two halves on pages page_a and page_b) into
        the stage that held chunk j - 1, once S_FREE(j - 1) says that chunk's V^T registers and S^T are read, and
        commit the copies as one group (an empty one past the segment's end)."""
        C = CHUNK
        NS = self.cfg.num_stages
        if j >= 1:
            cute.arch.barrier(barrier_id=S_FREE + (j - 1) % 2, number_of_threads=self.num_threads)
        if j + NS - 1 < n_chunks:
            tok_load = tok_begin + (j + NS - 1) * C
            stage = (j + NS - 1) % NS
            self._load_chunk(cta.mKV, cta.atom_cp_async, cta.sRing, cta.zero16, page_a, tok_load, stage, tw)
            self._load_chunk(cta.mKV, cta.atom_cp_async, cta.sRing, cta.zero16, page_b, tok_load, stage, tw, C // 2)
        cute.arch.cp_async_commit_group()

    # ------------------------------------------------------------------ warpgroups 0 and 1: softmax and P.V
    @cute.jit
    def _softmax_warpgroups(self, cta: CTAContext, sS: cute.Tensor, sPw: cute.Tensor, sAlpha: cute.Tensor, g: Int32,
                            g_end: Int32, b: Int32):
        cute.arch.setmaxregister_increase(self.register_budgets()[0])
        ROWS = self.rows
        NA = ROWS // 2
        C = CHUNK
        TPR = self.tpr
        PB = p_buffer_bytes(ROWS, self.cfg.p_planes)  # bytes of one P buffer
        tidx, wg, wl, lt = cta.tidx, cta.wg, cta.wl, cta.lt
        p_addr = cta.storage.p.data_ptr().toint()
        lead = tidx % WARPGROUP == 0
        acc_O = cute.make_rmem_tensor(cute.make_layout((4 * NA,)), Float32)
        vt = cute.make_rmem_tensor(cute.make_layout((4 * 4 * (C // 32),)), Int32)  # V^T of the pending P.V
        vals = cute.make_rmem_tensor(cute.make_layout((4 * self.words_per_thread,)), Float32)
        s_row = tidx // TPR  # the row of the S^T buffer this thread reads
        srow = s_row  # the query row of the block whose S^T that is
        if cutlass.const_expr(self.s_rows_spread):
            srow = s_logical_row(s_row)
        ssub = tidx % TPR
        srow_g = cta.row0 + srow
        while g < g_end:
            b, seg_end, tok_begin, tok_end, n_chunks, row_end, split, slot = self._segment_of_row(cta, b, g, g_end,
                                                                                                 srow_g)
            acc_O.fill(0.0)
            row_max = -Float32.inf
            row_sum = Float32(0.0)
            if cutlass.const_expr(self.pv_in_softmax):
                # 32 rows: P.V(ci - 1) is issued a dim tile at a time between the words of the softmax of chunk ci.
                # Its wgmmas issue only as fast as the tensor pipe takes them, so issued in one block after the
                # rescale they kept these warps from the next softmax for as long as they ran (timeline: 770-1000
                # cycles of a 2400-3500-cycle chunk, 300-400 with one P plane; H200, decode alone, H16 q2 1M x B2
                # 401.8 -> 382.2 us, steps 1M x B4 681.4 -> 656.8). Chunk 0 has no P.V before it: peeled, so that
                # no wgmma is issued under a branch (ptxas then serialises them all, C7520). 48 and 64 rows keep
                # one block after the rescale (measured: 4% slower this way, 48 rows with warps 6 and 7 repeating
                # a row so that all warps run the wgmmas).
                if n_chunks > 0:
                    row_max, row_sum = self._pv_in_softmax_chunk(cta, acc_O, vt, vals, sS, sPw, sAlpha, p_addr,
                                                                 Int32(0), tok_begin, row_end, row_max, row_sum, srow,
                                                                 ssub, s_row, lead, False)
                for ci in range(1, n_chunks):
                    row_max, row_sum = self._pv_in_softmax_chunk(cta, acc_O, vt, vals, sS, sPw, sAlpha, p_addr, ci,
                                                                 tok_begin, row_end, row_max, row_sum, srow, ssub,
                                                                 s_row, lead, True)
                if n_chunks > 0:
                    self._issue_pv_part(acc_O, vt, p_addr + ((n_chunks - 1) % 2) * PB, 0, 4, True)
            else:
                for ci in range(n_chunks):
                    row_max, row_sum = self._softmax_pv_chunk(cta, acc_O, sS, sPw, sAlpha, p_addr, ci, tok_begin,
                                                              row_end, row_max, row_sum, srow, ssub, s_row, lead)
            self._wait_mma(acc_O)
            row_sum = self._row_allreduce(row_sum, False)
            if ssub == 0 and srow < ROWS:
                self._finish_row(row_max, row_sum, cta.k_scale, cta.sInvL, cta.mLse, cta.mPLse, srow, srow_g, b, split,
                                 slot)
            cute.arch.barrier()  # sInvL written; the S^T warpgroup is done with the segment
            self._write_rows(acc_O, cta.sInvL, cta.mOut, cta.mPOut, cta.row0, b, split, slot, wg, wl, cta.lg, lt, 4)
            cute.arch.barrier()  # sInvL, sS, sP and sAlpha are reused by the next segment
            g = seg_end
            b = b + 1

    @cute.jit
    def _softmax_pv_chunk(self, cta: CTAContext, acc_O: cute.Tensor, sS: cute.Tensor, sPw: cute.Tensor,
                          sAlpha: cute.Tensor, p_addr: Int32, ci: Int32, tok_begin: Int32, row_end: Int32,
                          row_max: Float32, row_sum: Float32, srow: Int32, ssub: Int32, s_row: Int32, lead):
        """48 and 64 rows, chunk ci: the softmax, the V^T registers of ci (after the wait for P.V(ci - 1), whose A
        registers they reuse), the O^T rescale and the issue of P.V(ci) (`config.PV_ORDERS`). Returns the running
        max and sum."""
        C = CHUNK
        ROWS = self.rows
        NT = self.num_threads
        wg, wl, lt, lane = cta.wg, cta.wl, cta.lt, cta.lane
        buf = ci % 2
        vt_addr = cta.ring_addr + (ci % self.cfg.num_stages) * (C * 128 * KV_BLOCKS)  # chunk ci's ring stage
        cute.arch.barrier(barrier_id=S_FULL + buf, number_of_threads=NT)
        self._stamp(cta, lead, ci, 8 + 8 * wg + 0)  # "S_FULL passed"
        if cutlass.const_expr(self.cfg.early_rescale):
            row_max, row_sum = self._softmax_rescale_early(cta, acc_O, sS, sPw, sAlpha, ci, tok_begin, row_end,
                                                           row_max, row_sum, srow, ssub, s_row, lead)
        elif srow < ROWS:  # all threads but with 48 rows (then warps 6 and 7 skip it)
            row_max, row_sum, alpha = self._softmax_chunk(
                sS[None, None, None, buf], sPw[None, None, None, buf], row_max,
                row_sum, tok_begin + ci * C, row_end, cta.scale_log2, srow, ssub, s_row)
            if ssub == 0:
                sAlpha[srow, buf] = alpha
        if cutlass.const_expr(not self.cfg.early_rescale):
            self._stamp(cta, lead, ci, 8 + 8 * wg + 1)  # "softmax done"
            self._wait_mma(acc_O)  # P.V(ci - 1): its V^T registers may be reused
            self._stamp(cta, lead, ci, 8 + 8 * wg + 2)  # "P.V(ci-1) done"
        a_regs = self._load_vt(vt_addr, wg * 4, wl, lane)
        cute.arch.barrier_arrive(barrier_id=S_FREE + buf, number_of_threads=NT)
        self._stamp(cta, lead, ci, 8 + 8 * wg + 3)  # "V^T loaded"
        cute.arch.barrier(barrier_id=PV_BAR, number_of_threads=SOFTMAX_THREADS)  # P(ci), alpha(ci)
        self._stamp(cta, lead, ci, 8 + 8 * wg + 4)  # "P barrier passed"
        PB = p_buffer_bytes(ROWS, self.cfg.p_planes)
        if cutlass.const_expr(self.cfg.early_rescale):
            self._issue_pv_regs(acc_O, a_regs, p_addr + buf * PB, 0)  # O^T was rescaled beside P's exp2
        elif cutlass.const_expr(self.cfg.pv_order == "per_tile"):
            self._rescale_issue_pv(acc_O, sAlpha[None, buf], lt, a_regs, p_addr + buf * PB)
        else:
            self._rescale_o(acc_O, sAlpha[None, buf], lt, self.cfg.skips_unit_rescale)
            self._stamp(cta, lead, ci, 8 + 8 * wg + 5)  # "O^T rescaled"
            self._issue_pv_regs(acc_O, a_regs, p_addr + buf * PB, 0)
        self._stamp(cta, lead, ci, 8 + 8 * wg + 6)  # "P.V issued"
        return row_max, row_sum

    @cute.jit
    def _softmax_rescale_early(self, cta: CTAContext, acc_O: cute.Tensor, sS: cute.Tensor, sPw: cute.Tensor,
                               sAlpha: cute.Tensor, ci: Int32, tok_begin: Int32, row_end: Int32, row_max: Float32,
                               row_sum: Float32, srow: Int32, ssub: Int32, s_row: Int32, lead):
        """The softmax of chunk ci with O^T rescaled beside its exp2 (`DecodeConfig.early_rescale`, research):
        the rows' maxima and alphas first, the alphas published, P.V(ci - 1) waited for and a barrier of both
        warpgroups (a thread's O^T rows are other threads' softmax rows), then the 96 or 128 multiplies (FMA
        pipe) in the same block as P's exp2 (MUFU), where the other order runs them after the P barrier, on the
        chain before P.V(ci). The same operations on the same values. Returns the running max and sum."""
        ROWS = self.rows
        wg = cta.wg
        buf = ci % 2
        vals = cute.make_rmem_tensor(cute.make_layout((4 * self.words_per_thread,)), Float32)
        cmax = -Float32.inf
        if srow < ROWS:  # (with 48 rows warps 6 and 7 own no row)
            cmax = self._softmax_max(sS[None, None, None, buf], vals, tok_begin + ci * CHUNK, row_end,
                                     cta.scale_log2, s_row, ssub)
            _, _, alpha = self._row_alpha(row_max, cmax)
            if ssub == 0:
                sAlpha[srow, buf] = alpha
        self._wait_mma(acc_O)  # P.V(ci - 1): O^T may be rescaled, its V^T registers reused
        self._stamp(cta, lead, ci, 8 + 8 * wg + 2)  # "P.V(ci-1) done"
        cute.arch.barrier(barrier_id=SWG_ALPHA_BAR, number_of_threads=SOFTMAX_THREADS)  # alpha(ci) written
        # the multiplies in the same block as the exp2 (under a branch of its own the rescale could not
        # interleave with them), so with 48 rows the threads without a row rescale on the other path
        if srow < ROWS:
            self._rescale_o(acc_O, sAlpha[None, buf], cta.lt, False)
            row_max, row_sum, _ = self._softmax_exp(vals, cmax, sPw[None, None, None, buf], row_max, row_sum,
                                                    srow, ssub, None, None, Int32(0), False)
        else:
            self._rescale_o(acc_O, sAlpha[None, buf], cta.lt, False)
        self._stamp(cta, lead, ci, 8 + 8 * wg + 1)  # "softmax done" (O^T rescaled)
        return row_max, row_sum

    @cute.jit
    def _pv_in_softmax_chunk(self, cta: CTAContext, acc_O: cute.Tensor, vt: cute.Tensor, vals: cute.Tensor,
                             sS: cute.Tensor, sPw: cute.Tensor, sAlpha: cute.Tensor, p_addr: Int32, ci: Int32,
                             tok_begin: Int32, row_end: Int32, row_max: Float32, row_sum: Float32, srow: Int32,
                             ssub: Int32, s_row: Int32, lead, pv_prev: cutlass.Constexpr):
        """32 rows, chunk ci: the softmax with P.V(ci - 1) issued inside it (pv_prev), the V^T registers of ci
        into vt, the O^T rescale. Returns the running max and sum."""
        C = CHUNK
        ROWS = self.rows
        NT = self.num_threads
        wg = cta.wg
        buf = ci % 2
        PB = p_buffer_bytes(ROWS, self.cfg.p_planes)
        p_prev = p_addr + (1 - buf) * PB
        cute.arch.barrier(barrier_id=S_FULL + buf, number_of_threads=NT)
        self._stamp(cta, lead, ci, 8 + 8 * wg + 0)  # "S_FULL passed"
        cmax = self._softmax_max(sS[None, None, None, buf], vals, tok_begin + ci * C, row_end,
                                 cta.scale_log2, s_row, ssub)
        row_max, row_sum, alpha = self._softmax_exp(vals, cmax, sPw[None, None, None, buf], row_max, row_sum, srow,
                                                    ssub, acc_O, vt, p_prev, pv_prev)
        sAlpha[srow, buf] = alpha  # the row's TPR threads write the same value
        self._stamp(cta, lead, ci, 8 + 8 * wg + 1)  # "softmax done" (P.V(ci - 1) issued inside it)
        self._wait_mma(acc_O)  # P.V(ci - 1): its V^T registers may be reused
        self._stamp(cta, lead, ci, 8 + 8 * wg + 2)  # "P.V(ci-1) done"
        a_regs = self._load_vt(cta.ring_addr + (ci % self.cfg.num_stages) * (C * 128 * KV_BLOCKS), wg * 4, cta.wl,
                               cta.lane)
        for t in cutlass.range_constexpr(len(a_regs)):
            for k in cutlass.range_constexpr(4):
                vt[4 * t + k] = a_regs[t][k]
        cute.arch.barrier_arrive(barrier_id=S_FREE + buf, number_of_threads=NT)
        self._stamp(cta, lead, ci, 8 + 8 * wg + 3)  # "V^T loaded"
        cute.arch.barrier(barrier_id=PV_BAR, number_of_threads=SOFTMAX_THREADS)  # P(ci), alpha(ci)
        self._stamp(cta, lead, ci, 8 + 8 * wg + 4)  # "P barrier passed"
        self._rescale_o(acc_O, sAlpha[None, buf], cta.lt, self.cfg.skips_unit_rescale)
        self._stamp(cta, lead, ci, 8 + 8 * wg + 5)  # "O^T rescaled"
        return row_max, row_sum
