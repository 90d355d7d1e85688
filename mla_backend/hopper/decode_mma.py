"""The tensor-core work of the SM90 decode kernels: S^T = K.Q^T and O^T += V^T.P^T as FP8 wgmmas.

- S^T = K.Q^T with wgmma m64 x ROWS x k32: the chunk's 64 tokens fill the 64 M rows and the query rows are N
  (16 to 64), so 12 or 16 heads do not pad M = 64 four- to five-fold. The 18 k32 steps of the 576 bytes run as
  two chains of 9 summed in fp32: the FP8 wgmma accumulator keeps fewer mantissa bits than fp32, and one chain of
  18 measured 4x the lse error (2.4e-3 against 5.6e-4).
- O^T += V^T.P^T with wgmma m64 x ROWS x k32, A from registers: FP8 wgmma wants K-major shared-memory operands and
  V is token-major, so instead of a transposed copy, ldmatrix.trans (b16) on 32 tokens x 16 bytes gives lane
  (g, t) the byte pairs of tokens (2t, 2t+1) at dims (2g, 2g+1), and `prmt` regroups them into A registers: M row
  g = dim 2g, row g + 8 = dim 2g + 1, k = token pi(k) = 16*(k/16) + 8*((k%4)/2) + 2*((k%16)/4) + k%2 within each
  32 tokens. The softmax writes P^T in that token order (K-major core matrices, the wgmma B operand), so no data
  moves twice, and the latent is read from DRAM once per CTA for both products.
- O^T (512 x ROWS, fp32) lives in registers, in m64 tiles of dims: in tile t (dims [64 t, 64 t + 64)), warp wl's
  16 M rows are dims d0 = 64 t + 16 wl: rows 0-7 the even dims d0 + 2g, rows 8-15 the odd ones. Its A registers
  come from ldmatrix.trans on tokens 32 ks + lane, 16 bytes at d0, which sit in block d0 / 128, piece
  (d0 % 128) / 16.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from ..shapes import KV_DIM, LATENT_DIM
from .decode_layout import CHUNK, KV_BLOCKS, LATENT_BLOCKS, P_LBO, P_SBO
from .ptx import (fence_operand, ldmatrix_x4, prmt, smem_desc_lo, wgmma_commit, wgmma_fence, wgmma_rs_e4m3,
                  wgmma_ss_e4m3, wgmma_ss_e4m3_a64, wgmma_ss_e4m3_desc, wgmma_wait)

VT_HALF_BYTES = LATENT_DIM // 2 * CHUNK  # a chunk's V^T in a P.V warpgroup's 256 dims (`_store_vt`)


class DecodeMMA:
    """Mixin of the decode kernels (`decode_common.MLADecodeSM90`): needs self.cfg, self.rows, self.q_rows and
    self.s_rows_spread."""

    @cute.jit
    def _issue_s(self, acc_S: cute.Tensor, k_base: Int32, q_addr: Int32, k0: Int32, ksteps: cutlass.Constexpr,
                 rows_as_m: cutlass.Constexpr = False, from_zero: cutlass.Constexpr = True,
                 stepped_descriptors: cutlass.Constexpr = False):
        """Issue (and commit, not wait for) S^T = K.Q^T of the chunk at shared address k_base (a ring stage, or
        any block of 64 rows x 576 bytes in the ring's layout) over the k32 steps [k0, k0 + ksteps) of the 576
        bytes, the first from zero (or, not from_zero, onto what acc_S holds); with rows_as_m S = Q.K^T (64 rows:
        Q is A, the chunk's tokens N). stepped_descriptors: each operand's descriptor word made once and stepped
        by a constant (`ptx.smem_desc_lo`), for a caller whose k_base and q_addr are warp-uniform. With
        `DecodeConfig.rope_rows` 64 the rope's k32 steps (16 and 17) read both operands in the 64B swizzle. (A
        research build without S issues no wgmma.)"""
        k_lo = smem_desc_lo(k_base) if stepped_descriptors else None
        q_lo = smem_desc_lo(q_addr) if stepped_descriptors else None
        wgmma_fence()
        for kk in cutlass.range_constexpr(ksteps if self.cfg.runs("s") else 0):
            self._issue_s_step(acc_S, k_base, q_addr, k_lo, q_lo, k0 + kk, 0 if kk == 0 and from_zero else 1,
                               rows_as_m, stepped_descriptors)
        wgmma_commit()

    @cute.jit
    def _issue_s_step(self, acc_S: cute.Tensor, k_base: Int32, q_addr: Int32, k_lo, q_lo, ks,
                      accumulate: cutlass.Constexpr, rows_as_m: cutlass.Constexpr,
                      stepped_descriptors: cutlass.Constexpr):
        """One wgmma of `_issue_s`: k32 step ks into acc_S (onto it where accumulate is 1); k_lo / q_lo are the
        operands' stepped descriptor words (stepped_descriptors) or None."""
        C = CHUNK
        n_acc = (C if rows_as_m else self.rows) // 2
        kb = ks // 4
        koff = (ks % 4) * 32
        # the rope's block (kb 4) at the same offset either way: the latent's 4 blocks x rows x 128 bytes. Its
        # swizzle picks the descriptor at trace time, so the steps must be Python ints there
        assert self.cfg.rope_rows == 128 or isinstance(ks, int), "rope_rows 64 needs S's k32 steps at trace time"
        rope64 = self.cfg.rope_rows == 64 and kb == LATENT_BLOCKS
        if cutlass.const_expr(stepped_descriptors):
            k_desc = k_lo + ((kb * (C * 128) + koff) >> 4)
            q_desc = q_lo + ((kb * (self.q_rows * 128) + koff) >> 4)  # Q's blocks: its buffer's rows x 128 B
            d = wgmma_ss_e4m3_desc(q_desc if rows_as_m else k_desc, k_desc if rows_as_m else q_desc,
                                   [acc_S[i] for i in range(n_acc)], accumulate, swizzle64=rope64)
        else:
            k_addr = k_base + kb * (C * 128) + koff
            q_step = q_addr + kb * (self.q_rows * 128) + koff  # Q's blocks are its buffer's rows x 128 bytes
            d = wgmma_ss_e4m3(q_step if rows_as_m else k_addr, k_addr if rows_as_m else q_step,
                              [acc_S[i] for i in range(n_acc)], accumulate, swizzle64=rope64)
        for i in cutlass.range_constexpr(n_acc):
            acc_S[i] = d[i]

    @cute.jit
    def _wait_mma(self, acc: cute.Tensor):
        """Wait for every wgmma this warpgroup issued and pin acc's registers (`ptx.fence_operand`), so that no
        use of them moves above the wait."""
        wgmma_wait(0)
        for i in cutlass.range_constexpr(cute.size(acc)):
            acc[i] = fence_operand(acc[i])

    @cute.jit
    def _load_q_registers(self, cta, q_regs: cute.Tensor, ksteps: cutlass.Constexpr):
        """Q's first `ksteps` k32 steps of the block from sQ (landed and fenced) into the wgmma A fragments of this
        warp's rows 16 wl .. 16 wl + 15 (S = Q.K^T with the 64 rows as M), 4 registers a step: ldmatrix.x4 matrix
        m = lane / 8 is rows + 8 (m % 2) x bytes + 16 (m / 2) of the k32 step, so lane (g, t) gets bytes
        4t .. 4t + 3 of rows g and g + 8, then of the step's second 16 bytes."""
        m = cta.lane // 8
        r = 16 * cta.wl + cta.lane % 8 + 8 * (m % 2)
        for ks in cutlass.range_constexpr(ksteps):
            piece = (ks % 4) * 2 + m // 2  # the 16-byte piece of block ks / 4
            a = ldmatrix_x4(cta.q_addr + (ks // 4) * (self.q_rows * 128) + r * 128 + ((piece ^ (r % 8)) * 16))
            for k in cutlass.range_constexpr(4):
                q_regs[4 * ks + k] = a[k]

    @cute.jit
    def _issue_s_q_registers(self, acc_S: cute.Tensor, q_regs: cute.Tensor, k_base: Int32,
                             ksteps: cutlass.Constexpr, from_zero: cutlass.Constexpr):
        """Issue (no fence, no commit) S = Q.K^T's k32 steps [0, ksteps) with the 64 rows as M, Q's A fragments
        from q_regs (`_load_q_registers`) and K from the chunk at k_base, the first from zero where from_zero.
        (A research build without S issues no wgmma.)"""
        C = CHUNK
        for ks in cutlass.range_constexpr(ksteps if self.cfg.runs("s") else 0):
            d = wgmma_rs_e4m3([q_regs[4 * ks + k] for k in range(4)], k_base + (ks // 4) * (C * 128) + (ks % 4) * 32,
                              16, 1024, [acc_S[i] for i in range(C // 2)], b_swizzle128=True,
                              accumulate=not (from_zero and ks == 0))
            for i in cutlass.range_constexpr(C // 2):
                acc_S[i] = d[i]

    @cute.jit
    def _issue_s_chains(self, acc_S: cute.Tensor, acc_S2: cute.Tensor, ring_addr: Int32, q_addr: Int32,
                        stage: Int32):
        """Issue S^T of the chunk in `stage` over all 18 k32 steps, as two chains of 9 (module docstring), or as
        one chain into acc_S (`DecodeConfig.s_chains`, research)."""
        half = KV_DIM // 64
        k_base = ring_addr + stage * (CHUNK * 128 * KV_BLOCKS)
        if cutlass.const_expr(self.cfg.s_chains == 1):
            self._issue_s(acc_S, k_base, q_addr, 0, 2 * half)
        else:
            self._issue_s(acc_S, k_base, q_addr, 0, half)
            self._issue_s(acc_S2, k_base, q_addr, half, half)

    @cute.jit
    def _sum_s_chains(self, acc_S: cute.Tensor, acc_S2: cute.Tensor):
        """Wait for the chains of `_issue_s_chains` and add the second into acc_S, in fp32."""
        wgmma_wait(0)
        if cutlass.const_expr(self.cfg.s_chains == 2):
            for i in cutlass.range_constexpr(self.rows // 2):
                acc_S[i] = fence_operand(acc_S[i]) + fence_operand(acc_S2[i])

    @cute.jit
    def _store_s(self, acc_S: cute.Tensor, sS_chunk: cute.Tensor, part: Int32, wl: Int32, lg: Int32, lt: Int32):
        """Write a warpgroup's S^T (partial) after wgmma_wait to sS_chunk[..., part] (row, token, part):
        acc_S[4i + 0/1] = (token 16 wl + lg, rows 8i + 2 lt + 0/1), [4i + 2/3] = token + 8."""
        ROWS = self.rows
        for i in cutlass.range_constexpr(ROWS // 2):
            acc_S[i] = fence_operand(acc_S[i])
        for i in cutlass.range_constexpr(ROWS // 8 if self.cfg.runs("store_s") else 0):
            tok = wl * 16 + lg
            r0 = i * 8 + 2 * lt
            r1 = r0 + 1
            if cutlass.const_expr(self.s_rows_spread):  # decode_layout.s_logical_row
                r0 = i * 8 + lt
                r1 = r0 + 4
            sS_chunk[r0, tok, part] = acc_S[4 * i + 0]
            sS_chunk[r1, tok, part] = acc_S[4 * i + 1]
            sS_chunk[r0, tok + 8, part] = acc_S[4 * i + 2]
            sS_chunk[r1, tok + 8, part] = acc_S[4 * i + 3]

    @cute.jit
    def _rescale_o(self, acc_O: cute.Tensor, sAlpha: cute.Tensor, lt: Int32, skip_when_unit: cutlass.Constexpr):
        """O^T *= alpha of each row: acc_O[t * NA + 4j + e] = (dim d0 + 2 lg, row 8j + 2 lt + e),
        [.. + 2 + e] = (dim + 1, same row).

        skip_when_unit: skip the multiplies when every alpha of the thread is 1. alpha = exp2(old max - new max)
        is exactly 1 when a row's max did not move, which after the first chunks of a long segment is most chunks,
        so the skip changes no bit of O^T. It pays in the 16-row ping-pong schedule (H200, decode alone: H12 q1
        1M x B1 176.5 -> 165.0 us, 128K x B4 91.6 -> 88.2) and cost 3-4% where the branch sat between two wgmma
        waits (the earlier two-warpgroup schedule for more rows: H12 q8 1M x B1 526.0 -> 544.6 us)."""
        ROWS = self.rows
        als = self._row_factors(sAlpha, lt)
        if cutlass.const_expr(not self.cfg.runs("rescale")):
            pass  # research build: O^T is not rescaled
        elif cutlass.const_expr(skip_when_unit):
            al_min = Float32(1.0)
            for i in cutlass.range_constexpr(ROWS // 4):
                al_min = cute.arch.fmin(al_min, als[i])
            if al_min < Float32(1.0):
                self._scale_rows(acc_O, als)
        else:
            self._scale_rows(acc_O, als)

    @cute.jit
    def _row_factors(self, sAlpha: cute.Tensor, lt: Int32) -> cute.Tensor:
        """This thread's rows' factors from sAlpha (row): als[2j + e] of row 8j + 2 lt + e."""
        als = cute.make_rmem_tensor(cute.make_layout((self.rows // 4,)), Float32)
        for j in cutlass.range_constexpr(self.rows // 8):
            for e in cutlass.range_constexpr(2):
                als[2 * j + e] = sAlpha[8 * j + 2 * lt + e]
        return als

    @cute.jit
    def _scale_rows(self, acc_O: cute.Tensor, als: cute.Tensor):
        """acc_O rows (see _rescale_o) times this thread's row factors als[2j + e]."""
        for t in cutlass.range_constexpr(cute.size(acc_O) // (self.rows // 2)):
            self._scale_tile(acc_O, als, t)

    @cute.jit
    def _scale_tile(self, acc_O: cute.Tensor, als: cute.Tensor, t: cutlass.Constexpr):
        """Accumulator tile t of acc_O times this thread's row factors als[2j + e] (see _rescale_o)."""
        NA = self.rows // 2
        for j in cutlass.range_constexpr(self.rows // 8):
            for e in cutlass.range_constexpr(2):
                acc_O[t * NA + 4 * j + e] = acc_O[t * NA + 4 * j + e] * als[2 * j + e]
                acc_O[t * NA + 4 * j + 2 + e] = acc_O[t * NA + 4 * j + 2 + e] * als[2 * j + e]

    @cute.jit
    def _rescale_issue_pv(self, acc_O: cute.Tensor, sAlpha: cute.Tensor, lt: Int32, a_regs, p_addr: Int32):
        """O^T *= alpha and O^T += V^T.P^T, one dim tile after the other (`config.PV_ORDERS`, "per_tile"): the
        multiplies of tile t + 1 run while the wgmmas of tile t do, instead of all 128 before the first wgmma
        (whose issue then waits on the tensor pipe with nothing left to do). Each tile's multiplies are ordered
        before its wgmmas by a wgmma fence; one commit group for all."""
        als = self._row_factors(sAlpha, lt)
        for t in cutlass.range_constexpr(4):
            if cutlass.const_expr(self.cfg.runs("rescale")):
                self._scale_tile(acc_O, als, t)
            wgmma_fence()
            self._pv_wgmmas(acc_O, lambda tt, ks: a_regs[tt * (CHUNK // 32) + ks], p_addr, 0, t, t + 1)
        wgmma_commit()

    @cute.jit
    def _issue_pv(self, acc_O: cute.Tensor, stage_addr: Int32, p_addr: Int32, acc_tile0: cutlass.Constexpr,
                  dim_tile0: Int32, wl: Int32, lane: Int32):
        """Issue (and commit) O^T += V^T.P^T for 4 m64 tiles of dims: accumulator tiles [acc_tile0, + 4) are the
        dim tiles [dim_tile0, + 4). All A registers first (32 per thread), then one fence and 16 back-to-back
        wgmmas (2 k32 steps x the planes of P)."""
        self._issue_pv_regs(acc_O, self._load_vt(stage_addr, dim_tile0, wl, lane), p_addr, acc_tile0)

    @cute.jit
    def _load_vt(self, stage_addr: Int32, dim_tile0: Int32, wl: Int32, lane: Int32,
                 num_tiles: cutlass.Constexpr = 4):
        """The A registers of P.V for num_tiles m64 tiles of dims from dim_tile0 (8 per tile and thread): V^T by
        ldmatrix.trans + prmt."""
        C = CHUNK
        a_regs = []
        for t in cutlass.range_constexpr(num_tiles):
            tile = dim_tile0 + t
            piece = ((tile % 2) * 4 + wl) ^ (lane % 8)
            v_addr = stage_addr + (tile // 2) * (C * 128) + lane * 128 + piece * 16
            for ks in cutlass.range_constexpr(C // 32):
                m = ldmatrix_x4(v_addr + ks * 32 * 128, True)
                a_regs.append((prmt(m[0], m[1], 0x6420), prmt(m[0], m[1], 0x7531),
                               prmt(m[2], m[3], 0x6420), prmt(m[2], m[3], 0x7531)))
        return a_regs

    @cute.jit
    def _issue_pv_regs(self, acc_O: cute.Tensor, a_regs, p_addr: Int32, acc_tile0: cutlass.Constexpr):
        """Issue (and commit) the 16 P.V wgmmas on A registers from `_load_vt`."""
        wgmma_fence()
        self._pv_wgmmas(acc_O, lambda t, ks: a_regs[t * (CHUNK // 32) + ks], p_addr, acc_tile0, 0, 4)
        wgmma_commit()

    @cute.jit
    def _pv_wgmmas(self, acc_O: cute.Tensor, a_of, p_addr: Int32, acc_tile0: cutlass.Constexpr,
                   t0: cutlass.Constexpr, t1: cutlass.Constexpr):
        """The P.V wgmmas of dim tiles [t0, t1) (2 k32 steps x the P planes each) into accumulator tiles
        acc_tile0 + t; a_of(t, ks) gives the 4 A registers. (A research build without P.V issues none.)"""
        C = CHUNK
        ROWS = self.rows
        NA = ROWS // 2
        for t in cutlass.range_constexpr(t0, t1 if self.cfg.runs("pv") else t0):
            at = acc_tile0 + t
            for ks in cutlass.range_constexpr(C // 32):
                for plane in cutlass.range_constexpr(self.cfg.p_planes):
                    d = wgmma_rs_e4m3(a_of(t, ks), p_addr + plane * (ROWS * 64) + ks * 2 * P_LBO,
                                      P_LBO, P_SBO, [acc_O[at * NA + i] for i in range(NA)])
                    for i in cutlass.range_constexpr(NA):
                        acc_O[at * NA + i] = d[i]

    @cute.jit
    def _store_vt(self, stage_addr: Int32, sVt: cute.Tensor, dim_tile0: Int32, wl: Int32, lane: Int32):
        """V^T of 4 dim tiles from dim_tile0 of the chunk in the ring stage at stage_addr into sVt (Int32 words) in
        the K-major 64B-swizzled layout of a P.V A operand (`_pv_wgmmas_smem`): the tiles' dim d (0-255) has its
        64 tokens in one 64-byte row, byte o = 64 d + token at o ^ ((o >> 7) & 3) << 4. `_load_vt`'s registers
        are the mma.m16n8k32 A fragment: register r of (tile t, k32 step ks) holds dim 64 t + 16 wl + lane / 4 +
        8 (r % 2), tokens 32 ks + 16 (r // 2) + 4 (lane % 4) + (0..3), one a byte. The swizzle's XOR takes
        (dim >> 1) & 3 = (lane >> 3) & 3 here, so the thread's 4 token offsets are computed once and every store
        is one of them plus a constant; a warp's 32 stores meet 32 distinct banks."""
        C = CHUNK
        row = (16 * wl + lane // 4) * C + 4 * (lane % 4)
        flip = (lane >> 3) & 3
        cols = [row + 16 * (j ^ flip) for j in range(4)]  # j = 2 ks + r // 2: the token's 16-byte block
        for t in cutlass.range_constexpr(4):
            regs = self._load_vt(stage_addr, dim_tile0 + t, wl, lane, 1)
            for ks in cutlass.range_constexpr(C // 32):
                for r in cutlass.range_constexpr(4):
                    sVt[(cols[2 * ks + r // 2] + (64 * t + 8 * (r % 2)) * C) // 4] = regs[ks][r]

    @cute.jit
    def _pv_wgmmas_smem(self, acc_O: cute.Tensor, vt_addr: Int32, p_addr: Int32):
        """The P.V wgmmas of 4 dim tiles (2 k32 steps x the P planes each) with V^T from the buffer `_store_vt`
        wrote at vt_addr: accumulator tiles 0-3. (A research build without P.V issues none.)"""
        C = CHUNK
        ROWS = self.rows
        NA = ROWS // 2
        for t in cutlass.range_constexpr(4 if self.cfg.runs("pv") else 0):
            for ks in cutlass.range_constexpr(C // 32):
                for plane in cutlass.range_constexpr(self.cfg.p_planes):
                    d = wgmma_ss_e4m3_a64(vt_addr + t * (64 * C) + 32 * ks,
                                          p_addr + plane * (ROWS * 64) + ks * 2 * P_LBO, P_LBO, P_SBO,
                                          [acc_O[t * NA + i] for i in range(NA)])
                    for i in cutlass.range_constexpr(NA):
                        acc_O[t * NA + i] = d[i]

    @cute.jit
    def _issue_pv_part(self, acc_O: cute.Tensor, vt: cute.Tensor, p_addr: Int32, t0: cutlass.Constexpr,
                       t1: cutlass.Constexpr, fence: cutlass.Constexpr):
        """Issue (and commit) the P.V wgmmas of dim tiles [t0, t1) on the V^T registers kept in vt."""
        KS = CHUNK // 32
        if cutlass.const_expr(fence):
            wgmma_fence()
        self._pv_wgmmas(acc_O, lambda t, ks: tuple(vt[4 * (t * KS + ks) + k] for k in range(4)), p_addr, 0, t0, t1)
        wgmma_commit()
