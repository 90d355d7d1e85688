"""Online softmax of the SM90 decode kernels: one chunk of S^T in shared memory -> P as e4m3 words for the P.V wgmma.

Base 2 with the scale folded (scale_log2 = softmax_scale * q_scale * k_scale * log2 e), fp32 throughout: TPR
consecutive threads share a row (shuffle reductions), each owning P words w = ssub + TPR * i (4 tokens each, in
the token order pi that the P.V wgmma's A registers use, `decode_mma`). P enters the MMA as e4m3(p * p_scale):
one plane, or two (hi and lo = e4m3(p * p_scale - hi)); see config.P_PRECISIONS.
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from .ptx import fence_proxy_async_smem, quantize_p_e4m3, quantize_p_hi_lo

E4M3_MAX = 448.0


def rescale_slack(p_scale: float) -> float:
    """How far (base 2) a chunk's max may pass a row's reference max before the reference moves (lazy rescale):
    p = exp2(s - reference) then stays <= E4M3_MAX / p_scale, so p * p_scale is still a normal e4m3 value and
    keeps e4m3's relative precision (1.75 at p_scale 256, less a margin for exp2's approximation)."""
    return math.log2(E4M3_MAX / p_scale) - 0.05


def max_tree(values: list) -> Float32:
    """The max of a thread's values in a tree of depth log2(n) instead of a chain of n: the maxima exchange
    waits on it (fmax is exact, so every order gives the same value)."""
    while len(values) > 1:
        values = [cute.arch.fmax(values[i], values[i + 1]) if i + 1 < len(values) else values[i]
                  for i in range(0, len(values), 2)]
    return values[0]


class OnlineSoftmax:
    """Mixin of the decode kernels (`decode_common.MLADecodeSM90`): needs self.cfg, self.tpr,
    self.words_per_thread and (for P.V issued inside the softmax) `decode_mma.DecodeMMA._issue_pv_part`."""

    @cute.jit
    def _softmax_chunk(self, sS_chunk: cute.Tensor, sPw_buf: cute.Tensor, row_max: Float32, row_sum: Float32,
                       chunk_tok0: Int32, row_end: Int32, scale_log2: Float32, srow: Int32, ssub: Int32,
                       s_row=None):
        """Online softmax of one chunk for the row this thread shares with TPR - 1 others: S^T from sS_chunk
        (row, token, 0), P as e4m3 words (one plane, or hi and lo) w = ssub + TPR*i (tokens
        pi(4w .. 4w + 3)) into sPw_buf (word, row, plane), tokens >= row_end masked. Returns the new running max
        (the row's), this thread's share of the running sum (its tokens only: `_row_allreduce` at the end of a
        segment adds the shares) and the factor alpha that rescales the output accumulated so far. Fences P for
        the wgmma. The row's S^T is row s_row of sS_chunk (srow unless given: `decode_layout.s_logical_row`)."""
        vals = cute.make_rmem_tensor(cute.make_layout((4 * self.words_per_thread,)), Float32)
        cmax = self._softmax_max(sS_chunk, vals, chunk_tok0, row_end, scale_log2, srow if s_row is None else s_row,
                                 ssub)
        return self._softmax_exp(vals, cmax, sPw_buf, row_max, row_sum, srow, ssub, None, None, Int32(0), False)

    @cute.jit
    def _softmax_max(self, sS_chunk: cute.Tensor, vals: cute.Tensor, chunk_tok0: Int32, row_end: Int32,
                     scale_log2: Float32, srow: Int32, ssub: Int32) -> Float32:
        """First half of `_softmax_chunk`: this thread's scaled, masked S values (row srow of sS_chunk) into vals
        and the row's max."""
        TPR = self.tpr
        WPT = self.words_per_thread
        cmax = -Float32.inf
        if cutlass.const_expr(self.cfg.runs("softmax")):  # else a research build: S^T is not read
            for i in cutlass.range_constexpr(WPT):
                w = ssub + TPR * i
                n0 = (w // 4) * 16 + (w % 4) * 2  # tokens n0, n0 + 1, n0 + 8, n0 + 9 (the pi order)
                for j in cutlass.range_constexpr(4):
                    n = n0 + (j // 2) * 8 + j % 2
                    s = sS_chunk[srow, n, 0] * scale_log2
                    if chunk_tok0 + n >= row_end:
                        s = -Float32.inf
                    vals[4 * i + j] = s
                    cmax = cute.arch.fmax(cmax, s)
            cmax = self._row_allreduce(cmax, True)
        return cmax

    @cute.jit
    def _softmax_exp(self, vals: cute.Tensor, cmax: Float32, sPw_buf: cute.Tensor, row_max: Float32,
                     row_sum: Float32, srow: Int32, ssub: Int32, acc_O: cute.Tensor, vt: cute.Tensor, p_prev: Int32,
                     pv_prev: cutlass.Constexpr):
        """Second half of `_softmax_chunk`: P from vals and the row's chunk max; returns the new running max,
        this thread's share of the running sum and alpha. With pv_prev, the 4 dim tiles of P.V(ci - 1) are issued
        between its words (a tile before each of the first words), so that no issue waits long for the pipe."""
        TPR = self.tpr
        WPT = self.words_per_thread
        SCALE = self.cfg.p_scale
        tiles_per_word = max(1, 4 // WPT)
        new_max = row_max
        new_sum = row_sum
        alpha = Float32(1.0)
        if cutlass.const_expr(not self.cfg.runs("softmax")):
            # research build: no softmax (P is not written, O^T not rescaled), P.V(ci - 1) still issued
            if cutlass.const_expr(pv_prev):
                self._issue_pv_part(acc_O, vt, p_prev, 0, 4, True)
        else:
            new_max, use_max, alpha = self._row_alpha(row_max, cmax)
            csum = Float32(0.0)
            for i in cutlass.range_constexpr(WPT):
                if cutlass.const_expr(pv_prev and i * tiles_per_word < 4):
                    self._issue_pv_part(acc_O, vt, p_prev, i * tiles_per_word, min(4, (i + 1) * tiles_per_word),
                                        i == 0)
                w = ssub + TPR * i
                pv = [cute.math.exp2(vals[4 * i + j] - use_max, fastmath=True) for j in range(4)]
                csum = csum + (pv[0] + pv[1]) + (pv[2] + pv[3])
                if cutlass.const_expr(self.cfg.p_planes == 2):
                    hi, lo = quantize_p_hi_lo(pv[0] * SCALE, pv[1] * SCALE, pv[2] * SCALE, pv[3] * SCALE)
                    sPw_buf[w, srow, 0] = hi
                    sPw_buf[w, srow, 1] = lo
                else:
                    sPw_buf[w, srow, 0] = quantize_p_e4m3(pv[0] * SCALE, pv[1] * SCALE, pv[2] * SCALE,
                                                          pv[3] * SCALE)
            fence_proxy_async_smem()  # P is a wgmma operand
            # The sum stays per thread (alpha is the same for all the row's threads): reduced over the row's
            # threads once per segment, not per chunk, which took two shuffles off each chunk's softmax chain
            # (H200, decode alone, one process, two runs: H12 q8 1M x B1 400.7 -> 389.4 and 445.1 -> 433.8 us,
            # H128 q1 page 64 128K x B4 249.0 -> 243.2 and 273.2 -> 267.5).
            new_sum = row_sum * alpha + csum
        return new_max, new_sum, alpha

    @cute.jit
    def _row_alpha(self, row_max: Float32, cmax: Float32):
        """A row's new running max after a chunk whose max is cmax, the max P is taken against (0 while the row
        has seen no token) and alpha = exp2(old max - that), the factor of the output accumulated so far."""
        new_max = cute.arch.fmax(row_max, cmax)
        if cutlass.const_expr(self.cfg.lazy_rescale):
            # the reference max stays while the chunk's max passes it by at most the slack: alpha is then
            # exactly 1 and the row needs no rescale (with row_max = -inf no finite cmax is within it)
            if cmax <= row_max + rescale_slack(self.cfg.p_scale):
                new_max = row_max
        use_max = new_max
        if new_max == -Float32.inf:
            use_max = Float32(0.0)
        return new_max, use_max, cute.math.exp2(row_max - use_max, fastmath=True)

    @cute.jit
    def _row_allreduce(self, val: Float32, is_max: cutlass.Constexpr, lanes: cutlass.Constexpr = None) -> Float32:
        """Reduce over the TPR consecutive lanes that own one softmax row (or over `lanes` of them)."""
        n = self.tpr if lanes is None else lanes
        for i in cutlass.range_constexpr(int(math.log2(n))):
            other = cute.arch.shuffle_sync_bfly(val, offset=n >> (i + 1))
            if cutlass.const_expr(is_max):
                val = cute.arch.fmax(val, other)
            else:
                val = val + other
        return val
