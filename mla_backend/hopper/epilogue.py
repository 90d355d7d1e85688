"""The end of a segment in the SM90 decode kernels: a row's lse and output scale, and the output rows.

A request with one split gets its final bf16 output and natural-log lse; a split request gets an fp16 partial and
its lse in workspace slot `slot`, in units of the V scale (k_scale): a convex combination of e4m3 values, so
|x| <= 448, which fp16 holds whatever the scale; the combine kernel applies k_scale when it merges them.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float16, Float32, Int32

from .decode_layout import BF16, LN2


class DecodeEpilogue:
    """Mixin of the decode kernels (`decode_common.MLADecodeSM90`): needs self.cfg, self.rows and
    self.all_dims_per_warpgroup."""

    @cute.jit
    def _finish_row(self, m: Float32, l: Float32, k_scale: Float32, sInvL: cute.Tensor, mLse: cute.Tensor,
                    mPLse: cute.Tensor, srow: Int32, srow_g: Int32, b: Int32, split, slot: Int32):
        """A row's final max m and sum l (base 2, P scaled by p_scale): its output scale into sInvL and its
        natural-log lse into lse (single split) or the partial lse of its workspace slot. No KV: lse -inf,
        output 0."""
        inv_l = Float32(0.0)
        lse = -Float32.inf
        # A partial stays in units of the V scale (k_scale), so that fp16 holds it whatever the scale: it is a
        # convex combination of e4m3 values, |x| <= 448. The combine applies k_scale.
        v_scale = k_scale
        if split:
            v_scale = Float32(1.0)
        # l != 0 rather than l > 0: a NaN sum (NaN in q or the KV) stays NaN in the output and lse, never an
        # empty row
        if l != Float32(0.0):
            inv_l = v_scale / (l * self.cfg.p_scale)
            lse = (m + cute.math.log2(l, fastmath=True)) * LN2
        sInvL[srow] = inv_l
        if srow_g < self.cfg.num_rows:
            if split:
                mPLse[srow_g, slot] = lse
            else:
                mLse[srow_g, b] = lse

    @cute.jit
    def _write_rows(self, acc_O: cute.Tensor, sInvL: cute.Tensor, mOut: cute.Tensor, mPOut: cute.Tensor, row0: Int32,
                    b: Int32, split, slot: Int32, wg: Int32, wl: Int32, lg: Int32, lt: Int32,
                    num_o_tiles: cutlass.Constexpr):
        """This thread's output rows, scaled by sInvL: the final bf16 output of request b, or the fp16 partial of
        workspace slot `slot` when the request is split."""
        R = self.cfg.num_rows
        ROWS = self.rows
        NA = ROWS // 2
        # lane (g, t) of warp wl holds, per tile and row 8j + 2 lt + e, the dims
        # (d0 + 2 lg, d0 + 2 lg + 1): one 4-byte store each (an fp16 or a bf16 pair). Warpgroup wg writes dims
        # [256 wg, 256 wg + 256) (ping-pong: of the 8 tiles each holds after the merge, its own 4).
        o2 = cute.make_rmem_tensor(cute.make_layout((2,)), Float32)
        o2_bf16 = cute.make_rmem_tensor(cute.make_layout((2,)), BF16)
        o2_f16 = cute.make_rmem_tensor(cute.make_layout((2,)), Float16)
        for j in cutlass.range_constexpr(ROWS // 8):
            for e in cutlass.range_constexpr(2):
                orow = 8 * j + 2 * lt + e
                if row0 + orow < R:
                    inv = sInvL[orow]
                    for t in cutlass.range_constexpr(num_o_tiles):
                        if cutlass.const_expr(self.all_dims_per_warpgroup):
                            own = t // 4 == wg
                            tile = t
                        else:
                            own = True
                            tile = wg * 4 + t
                        if own:
                            o2[0] = acc_O[t * NA + 4 * j + e] * inv
                            o2[1] = acc_O[t * NA + 4 * j + 2 + e] * inv
                            pair = tile * 32 + wl * 8 + lg  # dims [2 pair, 2 pair + 2)
                            if split:
                                o2_f16.store(o2.load().to(Float16))
                                cute.autovec_copy(o2_f16, cute.local_tile(mPOut[None, row0 + orow, slot], (2,),
                                                                          (pair,)))
                            else:
                                o2_bf16.store(o2.load().to(BF16))
                                cute.autovec_copy(o2_bf16, cute.local_tile(mOut[None, row0 + orow, b], (2,),
                                                                           (pair,)))
