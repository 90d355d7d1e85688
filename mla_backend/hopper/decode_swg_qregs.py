"""The TMA S^T-warpgroup schedule (`decode_swg_tma.py`) for 64-row blocks with S = Q.K^T as the S warpgroup's MMA
and Q in its registers (research: `DecodeConfig.q_in_registers`).

Today's S^T = K.Q^T reads both operands from shared memory: per chunk 36 KB of K and 36 KB of Q at 64 rows, while
the softmax warpgroups' V^T ldmatrix, S^T reads and P writes share the same pipe (performance.md: a chunk's V^T
loads take 500-600 cycles there against ~256 alone). With the query rows as M (64 rows fill wgmma's M exactly)
Q is the A operand, which wgmma can take from registers: the S warpgroup loads the first 448 bytes of the block's
Q rows into 56 registers once per segment (14 k32 steps x the 4-register mma.m16n8k32 A fragment of its warp's
16 rows, by ldmatrix from sQ after its cp.async lands), so each chunk's wgmmas read K (the B operand, in the
ring's 128B-swizzled K-major layout) and only the last 4 steps' 8 KB of Q. S accumulates as one chain of 18 steps
(56 + 32 registers fit the S warpgroup's 120), as FlashMLA's dense FP8 kernel does (`DecodeConfig.s_chains`).
With `s_chains=2` the steps run as two chains of 9 summed in fp32, as the default schedule's do, and 7 steps of Q
live in registers (28 + 64). The accumulator holds rows 16 wl + lg (+ 8) x tokens 8 i + 2 lt (+ 1): stored as
8-byte pairs into S's buffer rows in order (no spreading: each half warp's pairs meet every bank once).

Registers: 192 / 120 (the sum a 384-thread launch gives, as in `decode_swg.py`).

H200, decode alone (experiments.md), one chain: 4-7% faster than the default at H128, H64 and H16 q_len 4 with the
same output error, but its FP8-accumulated chain of 18 puts some rows' lse 2.4e-3 to 5.2e-3 off the fp32
reference, past the 2e-3 the GPU tests allow, so it is not the default. Two chains have not yet run on a GPU.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from .decode_layout import CHUNK, KV_BLOCKS, S_STRIDE
from .decode_swg_tma import MLADecodeSwgTmaSM90
from .ptx import fence_operand, store_shared_v2_f32, wgmma_commit, wgmma_wait

# The 18 k32 steps of the 576 bytes whose Q fragments live in registers, by S chains (the rest read Q from sQ). One
# chain: the first 14 (56 registers); ptxas (sm_90a, 192 / 120) spills 128 bytes and serialises the wgmmas with
# 18, spills 32 and serialises them with 16, neither with 14 or 12. Two (steps 0-8 and 9-17 summed in fp32, 32
# accumulators more): the first 7; 10 spill 96 bytes and 8 spill 32, both serialising the wgmmas.
K_STEPS_REGS = {1: 14, 2: 7}
S_CHAIN_STEPS = 9  # the first chain's k32 steps where there are two
QREGS_PV, QREGS_S = 192, 120


class MLADecodeSwgQRegsSM90(MLADecodeSwgTmaSM90):
    """`MLADecodeSwgTmaSM90` at 64 rows with S = Q.K^T, Q in the S warpgroup's registers (module docstring)."""

    q_in_registers = True
    s_rows_spread = False

    def __init__(self, cfg):
        super().__init__(cfg)
        self.k_steps_regs = K_STEPS_REGS[cfg.s_chains]

    def register_budgets(self):
        return QREGS_PV, QREGS_S

    def _s_accumulators(self):
        """S's accumulators: 32 per chain, the second chain's after the first's."""
        return cute.make_rmem_tensor(cute.make_layout((CHUNK // 2 * self.cfg.s_chains,)), Float32)

    def _s_second_registers(self):
        """Q's wgmma A fragments: 4 registers per k32 step."""
        return cute.make_rmem_tensor(cute.make_layout((4 * self.k_steps_regs,)), Int32)

    @cute.jit
    def _issue_s_chains(self, acc_S: cute.Tensor, q_regs: cute.Tensor, ring_addr: Int32, q_addr: Int32,
                        stage: Int32):
        """Issue (and commit) S = Q.K^T of the chunk in `stage`. One chain, all into acc_S: the k32 steps from
        k_steps_regs on with Q from sQ (the first from zero; their own commit group), then those before it with Q
        from registers. Two: steps S_CHAIN_STEPS .. 17 (Q from sQ, from zero) into acc_S[32:], then steps 0 ..
        S_CHAIN_STEPS - 1 into acc_S[:32], those before k_steps_regs from registers (the first from zero), the
        rest from sQ."""
        C = CHUNK
        NACC = C // 2
        KR = self.k_steps_regs
        two = self.cfg.s_chains == 2
        stage_addr = ring_addr + stage * (C * 128 * KV_BLOCKS)
        if cutlass.const_expr(two):
            second = cute.make_tensor(acc_S.iterator + NACC, cute.make_layout((NACC,)))
            self._issue_s(second, stage_addr, q_addr, S_CHAIN_STEPS, S_CHAIN_STEPS, True)
        else:
            self._issue_s(acc_S, stage_addr, q_addr, KR, 2 * S_CHAIN_STEPS - KR, True)
        self._issue_s_q_registers(acc_S, q_regs, stage_addr, KR, two)
        if cutlass.const_expr(two):
            self._issue_s(acc_S, stage_addr, q_addr, KR, S_CHAIN_STEPS - KR, True, False)
        else:
            wgmma_commit()

    @cute.jit
    def _sum_s_chains(self, acc_S: cute.Tensor, q_regs: cute.Tensor):
        """Wait for S and, with two chains, add the second into the first in fp32."""
        wgmma_wait(0)
        if cutlass.const_expr(self.cfg.s_chains == 2):
            for i in cutlass.range_constexpr(CHUNK // 2):
                acc_S[i] = fence_operand(acc_S[i]) + fence_operand(acc_S[CHUNK // 2 + i])

    @cute.jit
    def _store_s(self, acc_S: cute.Tensor, sS_chunk: cute.Tensor, part: Int32, wl: Int32, lg: Int32, lt: Int32):
        """S after wgmma_wait into sS_chunk (row, token): acc_S[4i + e] = (row 16 wl + lg, token 8i + 2 lt + e),
        [4i + 2 + e] = row + 8, as 8-byte pairs."""
        for i in cutlass.range_constexpr(CHUNK // 2):
            acc_S[i] = fence_operand(acc_S[i])
        row_addr = sS_chunk.iterator.toint() + ((16 * wl + lg) * S_STRIDE + 2 * lt) * 4
        for i in cutlass.range_constexpr(CHUNK // 8 if self.cfg.runs("store_s") else 0):
            store_shared_v2_f32(row_addr + 32 * i, acc_S[4 * i + 0], acc_S[4 * i + 1])
            store_shared_v2_f32(row_addr + 8 * S_STRIDE * 4 + 32 * i, acc_S[4 * i + 2], acc_S[4 * i + 3])
