"""The S^T-warpgroup schedule (`decode_swg.py`) with the KV chunks loaded by TMA: 32-, 48- and 64-row blocks.

The softmax / P.V warpgroups are those of `decode_swg.py`; only the S^T warpgroup differs. With cp.async its 128
threads issue 18 copies each per chunk (~900 cycles while the S^T wgmmas hold the shared-memory pipe), and at 64
rows those copies sit on the chunk's critical cycle: S_FREE(j - 1) -> copies of chunk j + NS - 1 -> S^T(j) stored
-> S_FULL(j) -> softmax(j) -> V^T(j) -> S_FREE(j) (timeline, H128: 1810 cycles from the S^T issue to the end of
the copies, of a ~3300-cycle chunk). Here warp 0 of the warpgroup issues the chunk's TMA boxes
(`paged_kv._issue_chunk_tma`: two per chunk on pages of 64, ten on pages of 32) and the chunk's landing is a
per-stage mbarrier (`kv_full`, expect-tx bytes), so per chunk j the warpgroup: waits for chunk j's mbarrier (and,
on a segment's first chunk, its own cp.async of Q), zeroes the tokens of a segment's last chunk past its end,
issues S^T(j), then (`kv_refill="under_s"`, the default) waits S_FREE(j - 1) and issues the boxes of chunk
j + NS - 1 into the stage chunk j - 1 held while S^T(j) runs, sums the two chains, stores S^T(j) and arrives
S_FULL(j) (`"after_store"` waits and issues only after that arrival). The mbarrier phases follow each stage's uses
across segments (`phases`, one bit per stage).

H200, decode alone, one process, outputs identical: cp.async -> TMA (ten boxes, refills after the store) H128 q1
page 64 128K x B4 228.2 -> 221.4 us, H12 q8 1M x B1 393.8 -> 363.2, H16 q2 1M x B2 356.2 -> 323.4
(`config.default_kv_loads`); then ten boxes after the store -> two boxes under S^T: H128 225.8 -> 195.3, H64
page 64 1M x B2 447.8 -> 398.4, H16 q4 page 64 1M x B2 449.0 -> 398.3 (ten boxes under S^T: 206.3, 422.1, 409.5;
`config.KV_REFILLS`, `config.KV_BOX_TOKENS`).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from .barriers import LOAD_BAR, S_FREE, S_FULL
from .decode_common import CTAContext
from .decode_layout import CHUNK, SOFTMAX_THREADS, WARPGROUP
from .decode_swg import MLADecodeSwgSM90
from .ptx import fence_proxy_async_smem


class MLADecodeSwgTmaSM90(MLADecodeSwgSM90):
    """`MLADecodeSwgSM90` with the S^T warpgroup's loads by TMA (module docstring)."""

    q_in_registers = False  # `decode_swg_qregs.py`: the S warpgroup loads Q into registers once per segment

    def _s_accumulators(self):
        """The first S^T chain's accumulators."""
        return cute.make_rmem_tensor(cute.make_layout((self.rows // 2,)), Float32)

    def _s_second_registers(self):
        """The S^T warpgroup's registers beside acc_S: the second chain's accumulators."""
        return cute.make_rmem_tensor(cute.make_layout((self.rows // 2,)), Float32)

    @cute.jit
    def _s_warpgroup(self, cta: CTAContext, sS: cute.Tensor, g: Int32, g_end: Int32, b: Int32):
        cute.arch.setmaxregister_decrease(self.register_budgets()[1])
        ROWS = self.rows
        C = CHUNK
        NS = self.cfg.num_stages
        NT = self.num_threads
        mBT, zero16 = cta.mBT, cta.zero16
        tw = cta.tidx - SOFTMAX_THREADS
        lead = tw == 0
        # CuTe's TMA copy elects one lane of the warp that reaches it (elect.sync over all 32): warp 0 issues the
        # boxes, lane 0 the expect-tx arrive before them
        issuer = tw < 32
        bars = cta.storage.kv_full.data_ptr()
        boxes = self._kv_tma_partitions(cta, cta.storage.ring.data_ptr())
        if lead:
            for st in cutlass.range_constexpr(NS):
                cute.arch.mbarrier_init(bars + st, 1)
            cute.arch.mbarrier_init_fence()
        cute.arch.barrier(barrier_id=LOAD_BAR, number_of_threads=WARPGROUP)  # the mbarriers are initialised
        phases = Int32(0)  # bit s: the parity of stage s's next completion
        acc_S = self._s_accumulators()
        acc_S2 = self._s_second_registers()
        while g < g_end:
            b, seg_end, seq_len, tok_begin, tok_end, n_chunks = self._segment(cta.mReqTileStart, cta.mSeq, b, g,
                                                                              g_end, cta.t_last)
            self._load_q_block(cta, tw, b)  # by cp.async
            cute.arch.cp_async_commit_group()
            # chunks 0 .. NS - 2 (the ring is free: the previous segment ended with every stage read)
            if issuer:
                fence_proxy_async_smem()  # as in `_refill`: the previous segment's ldmatrix reads of the ring
                for st in cutlass.range_constexpr(NS - 1):
                    if st < n_chunks:
                        tok0 = tok_begin + st * C
                        page_a, page_b = self._lookup_chunk_pages(mBT, b, tok0, tok_end)
                        self._issue_chunk_tma(cta, boxes, bars + st, page_a, page_b, tok0, st)
            # the pages of the next chunk to load and of the one after, read two iterations ahead of their boxes
            next_a, next_b = self._lookup_chunk_pages(mBT, b, tok_begin + (NS - 1) * C, tok_end)
            after_a, after_b = self._lookup_chunk_pages(mBT, b, tok_begin + NS * C, tok_end)

            for j in range(n_chunks):
                stage = j % NS
                cute.arch.mbarrier_wait(bars + stage, (phases >> stage) & 1)
                phases = phases ^ (1 << stage)
                n_valid = tok_end - (tok_begin + j * C)
                if j == 0 or n_valid < C:
                    # Q (this thread's cp.async) landed; the tail of a segment's last chunk zeroed; both made
                    # visible to the whole warpgroup and to the wgmmas (the async proxy)
                    cute.arch.cp_async_wait_group(0)
                    if n_valid < C:
                        self._zero_tail_tokens(cta.sRing, zero16, n_valid, stage, tw, WARPGROUP)
                    fence_proxy_async_smem()
                    cute.arch.barrier(barrier_id=LOAD_BAR, number_of_threads=WARPGROUP)
                    if cutlass.const_expr(self.q_in_registers):
                        if j == 0:
                            self._load_q_registers(cta, acc_S2, self.k_steps_regs)
                self._stamp(cta, lead, j, 0)  # "chunk landed"
                self._issue_s_chains(acc_S, acc_S2, cta.ring_addr, cta.q_addr, stage)
                if cutlass.const_expr(self.cfg.kv_refill == "under_s"):
                    self._refill(cta, boxes, bars, next_a, next_b, tok_begin, j, n_chunks, issuer, lead)
                self._sum_s_chains(acc_S, acc_S2)
                self._stamp(cta, lead, j, 1)  # "S^T done"
                # buffer j % 2 last held S^T(j - 2), released (S_FREE) before this warpgroup issued chunk j + 1
                self._store_s(acc_S, sS[None, None, None, j % 2], 0, cta.wl, cta.lg, cta.lt)
                cute.arch.barrier_arrive(barrier_id=S_FULL + j % 2, number_of_threads=NT)
                self._stamp(cta, lead, j, 2)  # "S^T stored"
                if cutlass.const_expr(self.cfg.kv_refill == "after_store"):
                    self._refill(cta, boxes, bars, next_a, next_b, tok_begin, j, n_chunks, issuer, lead)
                next_a = after_a
                next_b = after_b
                after_a, after_b = self._lookup_chunk_pages(mBT, b, tok_begin + (j + NS + 1) * C, tok_end)
            self._end_segment_s(n_chunks)
            g = seg_end
            b = b + 1

    @cute.jit
    def _refill(self, cta: CTAContext, boxes, bars: cute.Pointer,
                page_a: Int32, page_b: Int32, tok_begin: Int32, j: Int32, n_chunks: Int32, issuer, lead):
        """Iteration j: chunk j + NS - 1 (its halves on page_a and page_b) into the stage chunk j - 1 held, once
        S_FREE(j - 1) says that chunk's S^T and V^T registers are read."""
        NS = self.cfg.num_stages
        if j >= 1:
            cute.arch.barrier(barrier_id=S_FREE + (j - 1) % 2, number_of_threads=self.num_threads)
        self._stamp(cta, lead, j, 3)  # "S_FREE passed"
        if issuer and j + NS - 1 < n_chunks:
            # The softmax warpgroups read the stage by ldmatrix (the generic proxy) before S_FREE, and TMA (the
            # async proxy) writes it next: a write after read across proxies, which needs a proxy fence on the
            # path from the reads to the writes (PTX memory model, proxy-preserved causality order). Here one
            # warp runs it once per chunk; in the 256 readers before their arrive it cost 2-5% (experiments.md).
            fence_proxy_async_smem()
            self._issue_chunk_tma(cta, boxes, bars + (j + NS - 1) % NS, page_a, page_b,
                                  tok_begin + (j + NS - 1) * CHUNK, (j + NS - 1) % NS)
        self._stamp(cta, lead, j, 4)  # "boxes issued"
