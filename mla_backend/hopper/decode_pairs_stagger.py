"""The chunk-pairs schedule with its two MMA warpgroups a phase apart (`DecodeConfig.pair_stagger`, research; 64
rows, one P plane, phase after phase with `early_rescale`).

Why. In `decode_pairs.py` both warpgroups compute S at once, exchange their chunks' row maxima, and run their
softmax at once, so that both chunks' P share one max; the tensor pipe then idles through both softmaxes (~1700 of
~4620 cycles a pair at H128 on an H100, timeline). S at 64 rows reads its two operands from shared memory at the
pipe's full 128 B a cycle, so nothing else runs beside it, and the registers O^T leaves hold no second S: the
softmax is the one place left to hide, and it can only hide under the other warpgroup's MMAs.

Here warpgroup 0 leads and warpgroup 1 follows, a phase behind. The leader takes P of its chunk 2p against its
rows' max over the pair so far, new(2p) = max(m(p - 1), max S(2p)); the follower takes P of chunk 2p + 1 against
m(p) = max(new(2p), max S(2p + 1)), the max the first form takes for both. O^T (each warpgroup's 256 dims, both
chunks) follows the online softmax a chunk at a time: O^T *= alpha = exp2(m(p - 1) - new(2p)), += P(2p).V, O^T *=
beta = exp2(new(2p) - m(p)), += P(2p + 1).V; beta is 1 for every row whose max chunk 2p + 1 does not move, and the
sums follow the same factors. One pair (barriers of `barriers.py`, each arrived at by one warpgroup and waited on by
the other once a pair):

    leader                                        follower
    S(2p) issued [-> S_BAR with pair_stagger 2]
    S(2p) done [-> S_BAR with pair_stagger 1]     (S_BAR) S(2p + 1), wait; its maxima
    maxima, alphas published -> MAX_BAR           (MAX_BAR) m(p), betas and the flag published; O^T *= alpha,
    O^T *= alpha; (P0_FREE_BAR) P(2p) -> P0_BAR     P(2p + 1) -> P1_BAR
    P.V(2p), half of V^T(2p + 1)                  (P0_BAR) P.V(2p), half of V^T(2p + 1), wait [-> P0_FREE_BAR]
    (P1_BAR) wait; O^T *= beta; P.V(2p + 1)       O^T *= beta; P.V(2p + 1)

so that the leader's softmax runs beside the follower's S, and the follower's beside the leader's P.V(2p). The
follower issues S(2p + 1) once the leader's S is done (`pair_stagger` 1) or issued (2: the tensor pipe then
takes it behind the leader's): side by side the two S would end at once and put the softmaxes back in step. The
follower tells the leader whether its chunk moves any row's max (a flag, the same in every thread of both: a
`bar.red.or` in the follower, `ptx.barrier_any`), and both skip beta's multiplies where none does: unconditional,
ptxas serialises every wgmma (C7512, spilling 36-164 bytes), even with a single factor for all of O^T. One pair's P
buffers serve (P0_FREE_BAR: the follower's P.V of chunk 2p is done before the leader rewrites its P), and with
them the fifth ring stage (`config.default_deep_ring`).

Measured (experiments.md): on an H100 5-13% slower than phase after phase where the tensor cores bound the step
(ncu at H128 q1 128K x B4: 275K cycles an SM against 246K, the tensor pipe 49% active against 55%). One
warpgroup's S alone takes ~950 cycles where both take ~1150 side by side (its two chains issued a step of each in
turn, as here, or one after the other alike), a softmax alone takes about as long as two side by side (~1300
against ~1400: its chain of dependent steps, not its pipes, sets it), and the follower's P, then the leader's
second P.V, sit on one chain.

Exactness. P(2p + 1), the maxima and the lse are the first form's; P(2p) is taken against new(2p) <= m(p), so its
values differ from the first form's where chunk 2p + 1 moves a row's max (their e4m3 rounding then differs), and
O^T takes one more rounding (beta) there. The error against the fp32 reference measures the same to three digits
(7.33e-3 at H128 q1 128K x B4); with every score equal no max moves past a segment's first chunk and the outputs
are the first form's bit for bit (tests/hopper/test_decode.py).

Every shared buffer a pair writes is read within it and rewritten only past a barrier that orders the reads
(the maxima and factors in `sMax` and `sAlpha`, column 0 the leader's, 1 the follower's; the flag after the row
sums in `row_ml`; P's two buffers). The leader zeroes the tail of a segment's last chunk, the follower's too,
before its S: the follower's S and V^T reads of it come past S_BAR, and the leader may read the second chunk's V^T
before the follower's signal.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from ..shapes import KV_DIM
from .barriers import (PAIR_WG_BAR, STAGGER_MAX_BAR, STAGGER_P0_BAR, STAGGER_P0_FREE_BAR, STAGGER_P1_BAR,
                       STAGGER_S_BAR)
from .decode_common import CTAContext
from .decode_layout import SOFTMAX_THREADS, WARPGROUP, p_buffer_bytes
from .decode_pairs import PAIRS_VT_TILES_UNDER_PV, MLADecodePairsSM90
from .ptx import barrier_any, smem_desc_lo, wgmma_commit, wgmma_fence

LEADER, FOLLOWER = 1, 2  # the MMA warpgroups' roles (`_mma_segments`): warpgroup 0 leads, 1 follows


class MLADecodePairsStaggerSM90(MLADecodePairsSM90):
    """The chunk-pairs schedule with the MMA warpgroups a phase apart (module docstring)."""

    @cute.jit
    def _mma_roles(self, cta: CTAContext, g: Int32, g_end: Int32, b: Int32):
        """Each MMA warpgroup its own code (no wgmma is issued under a branch inside the pair loop)."""
        if cta.wg == 0:
            self._mma_segments(cta, g, g_end, b, LEADER)
        else:
            self._mma_segments(cta, g, g_end, b, FOLLOWER)

    @cute.jit
    def _pair(self, cta: CTAContext, seg, acc_O: cute.Tensor, acc_S: cute.Tensor, acc_A: cute.Tensor,
              acc_B: cute.Tensor, q_regs: cute.Tensor, sPw: cute.Tensor, sMax: cute.Tensor, sAlpha: cute.Tensor,
              pr: Int32, m0: Float32, m1: Float32, l0: Float32, l1: Float32, k_cur=None,
              role: cutlass.Constexpr = 0):
        """Pair pr in this warpgroup's role. Returns the rows' maxima m(pr) and this thread's shares of their sums
        (against m(pr)), as `MLADecodePairsSM90._pair`."""
        if cutlass.const_expr(role == LEADER):
            return self._lead_pair(cta, seg, acc_O, acc_S, acc_A, acc_B, q_regs, sPw, sMax, sAlpha, pr, m0, m1, l0,
                                   l1)
        return self._follow_pair(cta, seg, acc_O, acc_S, acc_A, acc_B, q_regs, sPw, sMax, sAlpha, pr, m0, m1, l0,
                                 l1)

    @cute.jit
    def _lead_pair(self, cta: CTAContext, seg, acc_O: cute.Tensor, acc_S: cute.Tensor, acc_A: cute.Tensor,
                   acc_B: cute.Tensor, q_regs: cute.Tensor, sPw: cute.Tensor, sMax: cute.Tensor,
                   sAlpha: cute.Tensor, pr: Int32, m0: Float32, m1: Float32, l0: Float32, l1: Float32):
        """Warpgroup 0: S and P of chunk 2pr, P.V of both chunks into its dims."""
        lead = cta.tidx % WARPGROUP == 0
        lt = cta.lt
        r0 = 16 * cta.wl + cta.lg
        self._wait_mma(acc_O)  # P.V of the pair before: its V^T registers are free
        k_base = self._own_chunk_k_base(cta, seg, 2 * pr)
        if 2 * pr + 2 == seg.n_chunks:
            # the follower's chunk is the segment's last: its tail zeroed here too (the follower zeroes none), seen
            # by the follower's S past STAGGER_S_BAR, so that this warpgroup may load its V^T before STAGGER_P1_BAR
            self._own_chunk_k_base(cta, seg, 2 * pr + 1)
        self._stamp(cta, lead, pr, 8 + 0)  # "chunk landed"
        self._issue_qk_chains(acc_A, acc_B, q_regs, k_base, cta.q_addr)
        if cutlass.const_expr(self.cfg.pair_stagger == 2):  # the tensor pipe takes the follower's S behind it
            cute.arch.barrier_arrive(barrier_id=STAGGER_S_BAR, number_of_threads=SOFTMAX_THREADS)
        self._sum_qk_chains(acc_S, acc_A, acc_B)
        if cutlass.const_expr(self.cfg.pair_stagger == 1):
            cute.arch.barrier_arrive(barrier_id=STAGGER_S_BAR, number_of_threads=SOFTMAX_THREADS)
        self._stamp(cta, lead, pr, 8 + 1)  # "S done"
        cmax0, cmax1 = self._chunk_maxima(cta, seg, acc_S, 2 * pr)
        _, _, use0, use1, alpha0, alpha1 = self._publish_maxima(cta, sMax, sAlpha, m0, m1, cmax0, cmax1)
        cute.arch.barrier_arrive(barrier_id=STAGGER_MAX_BAR, number_of_threads=SOFTMAX_THREADS)
        self._stamp(cta, lead, pr, 8 + 2)  # "maxima passed"
        a0 = self._load_vt(k_base, 0, cta.wl, cta.lane)  # V^T of its own chunk (landed, tail zeroed)
        cute.arch.barrier(barrier_id=PAIR_WG_BAR, number_of_threads=WARPGROUP)  # this warpgroup's alphas
        self._rescale_o(acc_O, sAlpha[None, 0], lt, False)
        if pr > 0:  # the follower's P.V of the pair before's chunk 2pr - 2 is done: its P buffer may be rewritten
            cute.arch.barrier(barrier_id=STAGGER_P0_FREE_BAR, number_of_threads=SOFTMAX_THREADS)
        csum0, csum1 = self._write_p(acc_S, sPw, cta.scale_log2, use0, use1, r0, lt, 0)
        cute.arch.barrier_arrive(barrier_id=STAGGER_P0_BAR, number_of_threads=SOFTMAX_THREADS)
        cute.arch.barrier(barrier_id=PAIR_WG_BAR, number_of_threads=WARPGROUP)  # P(2pr) of all four warps
        self._stamp(cta, lead, pr, 8 + 3)  # "P barrier passed"
        p_addr = cta.storage.p.data_ptr().toint()
        self._issue_pv_regs(acc_O, a0, p_addr, 0)
        # half of the second chunk's V^T under P.V(2pr) (as many tiles as the first form loads there); its chunk
        # landed long before (the follower's S read it), so these waits return
        stage0, stage1, has_c1 = self._pair_stages(cta, seg, pr)
        stage1_addr = cta.ring_addr + stage1 * self.stage_bytes
        under = PAIRS_VT_TILES_UNDER_PV[self.rows, self.register_budgets()[0], self.cfg.p_planes]
        a1 = self._load_vt(stage1_addr, 0, cta.wl, cta.lane, under)
        # P(2pr + 1), the follower's maxima, betas and flag
        cute.arch.barrier(barrier_id=STAGGER_P1_BAR, number_of_threads=SOFTMAX_THREADS)
        self._wait_mma(acc_O)  # P.V(2pr): a0's registers free, O^T may be rescaled
        moved = self._moved_flag(cta)[0]
        if moved != 0:  # (module docstring: unconditional, ptxas serialises the wgmmas)
            self._rescale_o(acc_O, sAlpha[None, 1], lt, False)
        a1 = a1 + self._load_vt(stage1_addr, under, cta.wl, cta.lane, 4 - under)
        self._release_pair_stages(cta, stage0, stage1, has_c1)
        self._stamp(cta, lead, pr, 8 + 4)  # "V^T loaded" (the second chunk's)
        self._issue_pv_regs(acc_O, a1, p_addr + p_buffer_bytes(self.rows, self.cfg.p_planes), 0)
        self._stamp(cta, lead, pr, 8 + 5)  # "P.V issued"
        beta0 = sAlpha[r0, 1]
        beta1 = sAlpha[r0 + 8, 1]
        return sMax[r0, 1], sMax[r0 + 8, 1], (l0 * alpha0 + csum0) * beta0, (l1 * alpha1 + csum1) * beta1

    @cute.jit
    def _follow_pair(self, cta: CTAContext, seg, acc_O: cute.Tensor, acc_S: cute.Tensor, acc_A: cute.Tensor,
                     acc_B: cute.Tensor, q_regs: cute.Tensor, sPw: cute.Tensor, sMax: cute.Tensor,
                     sAlpha: cute.Tensor, pr: Int32, m0: Float32, m1: Float32, l0: Float32, l1: Float32):
        """Warpgroup 1: S and P of chunk 2pr + 1 (past the segment's end: Q's own rows, masked whole), P.V of
        both chunks into its dims."""
        lead = cta.tidx % WARPGROUP == 0
        lt = cta.lt
        r0 = 16 * cta.wl + cta.lg
        self._wait_mma(acc_O)
        k_base = self._own_chunk_k_base(cta, seg, 2 * pr + 1, False)  # (its tail: the leader zeroes it)
        cute.arch.barrier(barrier_id=STAGGER_S_BAR, number_of_threads=SOFTMAX_THREADS)  # the leader's S done
        self._stamp(cta, lead, pr, 16 + 0)  # "chunk landed"
        self._issue_qk_chains(acc_A, acc_B, q_regs, k_base, cta.q_addr)
        self._sum_qk_chains(acc_S, acc_A, acc_B)
        self._stamp(cta, lead, pr, 16 + 1)  # "S done"
        cmax0, cmax1 = self._chunk_maxima(cta, seg, acc_S, 2 * pr + 1)
        # the leader's new maxima and alphas (and its chunk's zeroed tail)
        cute.arch.barrier(barrier_id=STAGGER_MAX_BAR, number_of_threads=SOFTMAX_THREADS)
        self._stamp(cta, lead, pr, 16 + 2)  # "maxima passed"
        led0 = sMax[r0, 0]
        led1 = sMax[r0 + 8, 0]
        new0, new1, use0, use1, beta0, beta1 = self._publish_maxima(cta, sMax, sAlpha, led0, led1, cmax0, cmax1)
        # whether chunk 2pr + 1 moves any row's max (a beta below 1), the same in every thread of this warpgroup,
        # and for the leader in shared memory
        mine = Int32(0)
        if new0 != led0:
            mine = Int32(1)
        if new1 != led1:
            mine = Int32(1)
        moved = barrier_any(PAIR_WG_BAR + 1, WARPGROUP, mine)
        flag = self._moved_flag(cta)
        if lead:
            flag[0] = moved
        alpha0 = sAlpha[r0, 0]
        alpha1 = sAlpha[r0 + 8, 0]
        stage0, stage1, has_c1 = self._pair_stages(cta, seg, pr)
        a0 = self._load_vt(cta.ring_addr + stage0 * self.stage_bytes, 4, cta.wl, cta.lane)
        self._rescale_o(acc_O, sAlpha[None, 0], lt, False)
        csum0, csum1 = self._write_p(acc_S, sPw, cta.scale_log2, use0, use1, r0, lt, 1)
        cute.arch.barrier_arrive(barrier_id=STAGGER_P1_BAR, number_of_threads=SOFTMAX_THREADS)
        # P(2pr) written; every thread of this warpgroup past it: its own P(2pr + 1) and betas too
        cute.arch.barrier(barrier_id=STAGGER_P0_BAR, number_of_threads=SOFTMAX_THREADS)
        self._stamp(cta, lead, pr, 16 + 3)  # "P barrier passed"
        p_addr = cta.storage.p.data_ptr().toint()
        self._issue_pv_regs(acc_O, a0, p_addr, 0)
        stage1_addr = cta.ring_addr + stage1 * self.stage_bytes
        under = PAIRS_VT_TILES_UNDER_PV[self.rows, self.register_budgets()[0], self.cfg.p_planes]
        a1 = self._load_vt(stage1_addr, 4, cta.wl, cta.lane, under)  # half of V^T(2pr + 1) under P.V(2pr)
        self._wait_mma(acc_O)  # P.V(2pr): a0's registers and P(2pr)'s buffer free, O^T may be rescaled
        # (the leader waits for it in the next pair, before its P(2pr + 2); past the segment's last pair the
        # segment's end orders it)
        if 2 * pr + 2 < seg.n_chunks:
            cute.arch.barrier_arrive(barrier_id=STAGGER_P0_FREE_BAR, number_of_threads=SOFTMAX_THREADS)
        if moved != 0:
            self._rescale_o(acc_O, sAlpha[None, 1], lt, False)
        a1 = a1 + self._load_vt(stage1_addr, 4 + under, cta.wl, cta.lane, 4 - under)
        self._release_pair_stages(cta, stage0, stage1, has_c1)
        self._stamp(cta, lead, pr, 16 + 4)  # "V^T loaded" (the second chunk's)
        self._issue_pv_regs(acc_O, a1, p_addr + p_buffer_bytes(self.rows, self.cfg.p_planes), 0)
        self._stamp(cta, lead, pr, 16 + 5)  # "P.V issued"
        return new0, new1, l0 * (alpha0 * beta0) + csum0, l1 * (alpha1 * beta1) + csum1

    @cute.jit
    def _publish_maxima(self, cta: CTAContext, sMax: cute.Tensor, sAlpha: cute.Tensor, old0: Float32, old1: Float32,
                        cmax0: Float32, cmax1: Float32):
        """This thread's rows' new maxima max(old, chunk max), and the factors from old to them, into column wg of
        sMax and sAlpha (the leader's 0, the follower's 1; one thread a quad). Returns the new maxima, those P is
        taken against, and the factors."""
        r0 = 16 * cta.wl + cta.lg
        new0 = cute.arch.fmax(old0, cmax0)
        new1 = cute.arch.fmax(old1, cmax1)
        use0, use1, f0, f1 = self._reference_maxima(old0, old1, new0, new1)
        if cta.lt == 0:
            sMax[r0, cta.wg] = new0
            sMax[r0 + 8, cta.wg] = new1
        self._publish_alphas(cta, sAlpha, f0, f1)
        return new0, new1, use0, use1, f0, f1

    def _moved_flag(self, cta: CTAContext) -> cute.Tensor:
        """The follower's flag of a pair (an Int32 after the row sums in `row_ml`, which the segment's end alone
        uses): nonzero where its chunk moves a row's max."""
        ptr = cute.recast_ptr(cta.storage.row_ml.data_ptr() + self.rows, dtype=Int32)
        return cute.make_tensor(ptr, cute.make_layout((1,)))

    @cute.jit
    def _issue_qk_chains(self, acc_A: cute.Tensor, acc_B: cute.Tensor, q_regs: cute.Tensor, k_base: Int32,
                         q_addr: Int32):
        """S of the chunk at k_base as the first form's two chains (k32 steps [0, 9) into acc_A, [9, 18) into
        acc_B, each from zero), issued a step of each in turn, so that a warpgroup whose S runs mostly alone gives
        the tensor pipe two independent accumulations. The same sums in the same order. (Measured no faster than
        the chains one after the other: S alone takes ~950 cycles either way against ~576 of tensor work.)"""
        half = KV_DIM // 64
        k_lo = smem_desc_lo(k_base)
        q_lo = smem_desc_lo(q_addr)
        wgmma_fence()
        for kk in cutlass.range_constexpr(half if self.cfg.runs("s") else 0):
            for acc, ks in ((acc_A, kk), (acc_B, half + kk)):
                self._issue_s_step(acc, k_base, q_addr, k_lo, q_lo, ks, 0 if kk == 0 else 1, True, True)
        wgmma_commit()
