"""The SM90 decode for 16-row blocks (q_len x H <= 16, the TP8 decode case): the ping-pong schedule.

Warpgroup w takes the chunks 2j + w of a segment (ring stages w and w + 2, loading its own chunks one ahead) and
runs all of S^T, the softmax and P.V (all 512 dims, 64 fp32 accumulators per thread) on them with its own running
max and sum and named warpgroup barriers only, so one warpgroup's softmax latency overlaps the other's MMAs; the
two partial results are merged through shared memory once per segment. On the H200 this took q_len 1 at 1M tokens
from 1.31-1.38x to 1.09-1.15x the floor (decode alone, against both warpgroups on every chunk); 32 rows would need
128 O^T accumulators per thread, and 16-row blocks for 32 or more rows were slower (each row block reads the KV
again).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from .barriers import PINGPONG_WG
from .decode_common import CTAContext, MLADecodeSM90
from .decode_layout import CHUNK, KV_BLOCKS, WARPGROUP, p_buffer_bytes, p_words_layout, s_full_layout
from .ptx import fence_proxy_async_smem


class MLADecodeRows16SM90(MLADecodeSM90):
    num_threads = 2 * WARPGROUP
    softmax_pool = WARPGROUP  # each warpgroup runs the softmax of its own chunks
    l2_prefetch_copies = True
    all_dims_per_warpgroup = True

    @cute.jit
    def _schedule(self, cta: CTAContext):
        ROWS = self.rows
        NA = ROWS // 2  # accumulators per m64 tile of S^T or O^T
        WGT = WARPGROUP
        C = CHUNK
        TPR = self.tpr
        tidx, wg, wl, lg, lt, lane = cta.tidx, cta.wg, cta.wl, cta.lg, cta.lt, cta.lane
        mBT, mKV, atom, sRing, zero16 = cta.mBT, cta.mKV, cta.atom_cp_async, cta.sRing, cta.zero16
        storage = cta.storage

        # S^T of each warpgroup's current chunk (row, token, 0, warpgroup)
        sS = storage.s.get_tensor(s_full_layout(ROWS))
        # P words of this warpgroup (word, row, plane)
        sPw = cute.make_tensor(cute.recast_ptr(storage.p.data_ptr(), dtype=Int32),
                               p_words_layout(ROWS, self.cfg.p_planes))[None, None, None, wg]
        sAlpha = storage.alpha.get_tensor(cute.make_layout((ROWS, 2), stride=(1, ROWS)))[None, wg]
        # (max or sum, row, warpgroup) at the end of a segment
        sML = storage.row_ml.get_tensor(cute.make_layout((2, ROWS, 2), stride=(1, 2, 2 * ROWS)))
        # O^T accumulators handed to the other warpgroup at the end of a segment, in the (then idle) ring:
        # (thread, accumulator, tile of the receiver's half, receiving warpgroup)
        sX = cute.make_tensor(cute.recast_ptr(storage.ring.data_ptr(), dtype=Float32), cute.make_layout(
            (WGT, NA, 4, 2), stride=(1, WGT, NA * WGT, 4 * NA * WGT)))
        p_addr = storage.p.data_ptr().toint() + wg * p_buffer_bytes(ROWS, self.cfg.p_planes)
        tw = tidx % WGT  # thread in the warpgroup
        wg_bar = PINGPONG_WG + wg

        acc_S = cute.make_rmem_tensor(cute.make_layout((NA,)), Float32)
        acc_S2 = cute.make_rmem_tensor(cute.make_layout((NA,)), Float32)  # the second chain of S^T
        acc_O = cute.make_rmem_tensor(cute.make_layout((8 * NA,)), Float32)  # all 8 m64 tiles of dims

        srow = tw // TPR
        ssub = tw % TPR
        srow_g = cta.row0 + srow

        g = cta.mCtaTileStart[cta.cta]
        g_end = cta.mCtaTileStart[cta.cta + 1]
        b = cta.mCtaFirstReq[cta.cta]
        while g < g_end:
            b, seg_end, tok_begin, tok_end, n_chunks, row_end, split, slot = self._segment_of_row(cta, b, g, g_end,
                                                                                                 srow_g)

            # ---- Q of request b: cp.async (thread t: row t / 4, pieces t % 4 + 4i), padding rows zeroed ----
            qrow = tidx // 4
            if qrow < ROWS:
                self._load_q_rows(cta.mQ, atom, cta.sQ8, zero16, cta.row0, qrow, tidx, b)
            cute.arch.cp_async_commit_group()

            acc_O.fill(0.0)
            row_max = -Float32.inf  # base-2, scaled
            row_sum = Float32(0.0)  # this thread's share of the row's sum (reduced over its TPR threads at the end)

            n_mine = (n_chunks + 1 - wg) // 2
            if n_mine > 0:
                self._load_chunk_wg(mBT, mKV, atom, sRing, zero16, b, tok_begin + wg * C, tok_end, wg, tw)
            cute.arch.cp_async_commit_group()
            # pages of this warpgroup's next chunk, read a whole warpgroup iteration before its copies
            next0 = self._lookup_page(mBT, b, tok_begin + (wg + 2) * C, tok_end, tw)
            next1 = self._lookup_page(mBT, b, tok_begin + (wg + 2) * C + C // 2, tok_end, tw)
            cute.arch.cp_async_wait_group(1)  # Q
            fence_proxy_async_smem()  # the Q writers (all in warpgroup 0) -> the S^T wgmmas of both warpgroups
            cute.arch.barrier()

            for j in range(n_mine):
                chunk_tok0 = tok_begin + (2 * j + wg) * C
                stage = wg + 2 * (j % 2)
                cute.arch.cp_async_wait_group(0)  # chunk j: the only group of this thread in flight
                fence_proxy_async_smem()
                # chunk j landed for the whole warpgroup; P.V of chunk j - 1 is done with the other stage, sS and sP
                cute.arch.barrier(barrier_id=wg_bar, number_of_threads=WGT)
                if j + 1 < n_mine:
                    next_stage = wg + 2 * ((j + 1) % 2)
                    self._load_chunk(mKV, atom, sRing, zero16, next0, chunk_tok0 + 2 * C, next_stage, tw)
                    self._load_chunk(mKV, atom, sRing, zero16, next1, chunk_tok0 + 2 * C, next_stage, tw, C // 2)
                cute.arch.cp_async_commit_group()
                next0 = self._lookup_page(mBT, b, chunk_tok0 + 4 * C, tok_end, tw)
                next1 = self._lookup_page(mBT, b, chunk_tok0 + 4 * C + C // 2, tok_end, tw)

                self._issue_s_chains(acc_S, acc_S2, cta.ring_addr, cta.q_addr, stage)
                self._sum_s_chains(acc_S, acc_S2)
                self._store_s(acc_S, sS[None, None, None, wg], 0, wl, lg, lt)
                cute.arch.barrier(barrier_id=wg_bar, number_of_threads=WGT)

                row_max, row_sum, alpha = self._softmax_chunk(
                    sS[None, None, None, wg], sPw, row_max, row_sum, chunk_tok0, row_end, cta.scale_log2, srow, ssub)
                if ssub == 0:
                    sAlpha[srow] = alpha
                cute.arch.barrier(barrier_id=wg_bar, number_of_threads=WGT)

                self._rescale_o(acc_O, sAlpha, lt, True)
                stage_addr = cta.ring_addr + stage * (C * 128 * KV_BLOCKS)
                self._issue_pv(acc_O, stage_addr, p_addr, 0, 0, wl, lane)  # tiles 0-3, then 4-7: 32 A
                self._issue_pv(acc_O, stage_addr, p_addr, 4, 4, wl, lane)  # registers live at a time
                self._wait_mma(acc_O)
            cute.arch.cp_async_wait_group(0)

            self._merge_warpgroups(cta, acc_O, sML, sX, row_max, row_sum, srow, ssub, srow_g, tw, b, split, slot)
            self._write_rows(acc_O, cta.sInvL, cta.mOut, cta.mPOut, cta.row0, b, split, slot, wg, wl, lg, lt, 8)
            cute.arch.barrier()  # sInvL, sQ, sML and the ring are reused by the next segment

            g = seg_end
            b = b + 1

    @cute.jit
    def _merge_warpgroups(self, cta: CTAContext, acc_O: cute.Tensor, sML: cute.Tensor, sX: cute.Tensor,
                          row_max: Float32, row_sum: Float32, srow: Int32, ssub: Int32, srow_g: Int32, tw: Int32,
                          b: Int32, split, slot: Int32):
        """The end of a segment: rescale each warpgroup's O^T to the rows' common max and swap halves of the dims,
        so that warpgroup wg holds the merged dims [256 wg, 256 wg + 256); warpgroup 0 finishes the rows."""
        ROWS = self.rows
        NA = ROWS // 2
        wg, lt = cta.wg, cta.lt
        row_sum = self._row_allreduce(row_sum, False)
        if ssub == 0:
            sML[0, srow, wg] = row_max
            sML[1, srow, wg] = row_sum
        cute.arch.barrier()  # also: no copy into the ring and no read of it is in flight any more
        for jj in cutlass.range_constexpr(ROWS // 8):
            for e in cutlass.range_constexpr(2):
                orow = 8 * jj + 2 * lt + e
                m_all = cute.arch.fmax(sML[0, orow, 0], sML[0, orow, 1])
                if m_all == -Float32.inf:
                    m_all = Float32(0.0)
                a_own = cute.math.exp2(sML[0, orow, wg] - m_all, fastmath=True)
                for t in cutlass.range_constexpr(8):
                    acc_O[t * NA + 4 * jj + e] = acc_O[t * NA + 4 * jj + e] * a_own
                    acc_O[t * NA + 4 * jj + 2 + e] = acc_O[t * NA + 4 * jj + 2 + e] * a_own
        # (tile indices stay compile-time constants: a runtime index would put acc_O in local memory)
        for t in cutlass.range_constexpr(8):
            if t // 4 != wg:
                for i in cutlass.range_constexpr(NA):
                    sX[tw, i, t % 4, 1 - wg] = acc_O[t * NA + i]
        if wg == 0:
            if ssub == 0:
                m0 = sML[0, srow, 0]
                m1 = sML[0, srow, 1]
                m_all = cute.arch.fmax(m0, m1)
                if m_all == -Float32.inf:
                    m_all = Float32(0.0)
                l_all = (sML[1, srow, 0] * cute.math.exp2(m0 - m_all, fastmath=True)
                         + sML[1, srow, 1] * cute.math.exp2(m1 - m_all, fastmath=True))
                self._finish_row(m_all, l_all, cta.k_scale, cta.sInvL, cta.mLse, cta.mPLse, srow, srow_g, b, split,
                                 slot)
        cute.arch.barrier()
        for t in cutlass.range_constexpr(8):
            if t // 4 == wg:
                for i in cutlass.range_constexpr(NA):
                    acc_O[t * NA + i] = acc_O[t * NA + i] + sX[tw, i, t % 4, wg]
