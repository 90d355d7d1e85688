"""Split-KV decode step of paged FP8 MLA for Hopper (sm_90a), in CuTe DSL.

What one CTA does
-----------------
Grid (num_row_blocks, num_ctas). CTA (rb, c) walks the global KV tiles [cta_tile_start[c], cta_tile_start[c+1])
of the split plan (`mla_backend.planner`), cut into segments = (request b, local tiles [t0, t1)). For each segment
it attends the query rows [rb*ROWS, rb*ROWS + ROWS) of request b (row r = t*H + h of q[b].view(R, 576)) over the
tokens [t0*T, min(t1*T, L_b)), with causal masking j <= L_b - q_len + t, and writes either the final bf16 output
and natural-log lse (num_splits[b] == 1) or an fp16 partial (in units of k_scale) into workspace slot
split_offset[b] + c - request_first_cta[b] (the combine kernel merges those). The row block is the fastest grid
index so that the row blocks of one plan CTA run side by side and read each KV tile from L2 after the first.

Data path: FP8 end to end on the tensor cores (wgmma)
----------------------------------------------------
- KV is gathered through the block table with 16-byte cp.async into a ring of NUM_STAGES chunks of 64 tokens,
  in the K-major 128B-swizzled layout wgmma reads: 128-byte row blocks (576 bytes = 4.5 of them), byte (token
  r, 16-byte piece c of block kb) at kb * 8 KB + r * 128 + ((c ^ (r % 8)) * 16). Thread t copies token t / 4,
  pieces t % 4 + 4i; its block-table entry is read one chunk ahead, because a dependent global read right
  before the copies stalled every warp once per chunk (-7% step time). Tokens past the segment end are
  zero-filled in shared memory (never loaded), so the block table is never read past ceil(L_b / page_size);
  whatever the metadata (unchecked inside CUDA graphs), page indices are clamped to the table's width and
  entries outside the cache zero-fill instead of loading.
- The FP8 chunk is used as it landed, for both products: the latent is read from DRAM once per CTA.
  * S^T = K.Q^T with wgmma m64 x ROWS x k32: tokens fill the 64 M rows and the query rows are N (16 or 32),
    so 12 or 16 heads do not pad M = 64 four- to five-fold. Warpgroup wg runs the 9 k32 steps of its half of
    the 576 bytes; the two fp32 partials meet in shared memory.
  * O^T += V^T.P^T with wgmma m64 x ROWS x k32, A from registers: FP8 wgmma wants K-major shared-memory
    operands and V is token-major, so instead of a transposed copy, ldmatrix.trans (b16) on 32 tokens x 16
    bytes gives lane (g, t) the byte pairs of tokens (2t, 2t+1) at dims (2g, 2g+1), and `prmt` regroups them
    into A registers: M row g = dim 2g, row g + 8 = dim 2g + 1, k = token pi(k) = 16*(k/16) + 8*((k%4)/2) +
    2*((k%16)/4) + k%2 within each 32 tokens. The softmax writes P^T in that token order (K-major core
    matrices, the wgmma B operand), so no data moves twice. Warpgroup wg owns dims [256 wg, 256 wg + 256).
  Earlier versions converted each chunk to f16 in shared memory (mma.sync f16: ~1.8 TB/s of KV), then ran
  FP8 mma.sync m16n8k32 on the raw chunk (1.69 TB/s: issue-bound, two warps per scheduler waiting on
  dependent MMAs); the two wgmma steps took the kernel to ~2.9 TB/s (docs/performance.md).
- Online softmax in base 2 with the scale folded (scale_log2 = softmax_scale * q_scale * k_scale * log2 e),
  fp32 throughout: NUM_THREADS / ROWS threads per row, shuffle reductions, the per-row rescale in shared memory.
- P goes to the FP8 MMA as two e4m3 planes, hi = e4m3(p * 256) and lo = e4m3(p * 256 - hi), one wgmma each.
  One e4m3 plane alone (3 mantissa bits, up to 6.25% relative error per p) would give ~2% relative error on
  the output when attention is spread over many tokens (an estimate, not built: the per-token errors do not
  average out against an output that is itself an average). hi + lo represents p to ~2^-8 relative (p * 256 keeps p >= 2^-14 out of
  e4m3's subnormals), which with fp32 accumulation and the bf16 output keeps the relative L2 error against the
  fp32 reference below 5e-3 (tests/hopper; the bench measures 4.5e-4 to 1.4e-3 on random data).
  CUTE_MLA_P_PLANES=1 keeps one plane for more than 16 query rows (`default_p_planes`): half the P.V wgmmas and
  P conversions, for ~10x the error (H200, same inputs: relative L2 7.5e-3 to 1.5e-2 against 8e-4 to 2.3e-3;
  below the FP8 cache's own error against a bf16 cache, 0.8e-2 to 6.6e-2 in a torch emulation). Decode alone,
  H200: H12 q8 1M x B1 512.4 -> 468.9 us, H128 q1 128K x B4 318.5 -> 274.7, H16 q2 1M x B2 423.0 -> 380.5, H12
  q4 1M x B1 278.5 -> 247.6. Two planes stay the default: accuracy first, and the gain alone reaches no target
  of the issues (docs/performance.md).
- O^T (512 x ROWS, fp32) lives in registers: 4 m64 tiles x ROWS / 2 accumulators per thread.

Rows per block
--------------
ROWS is 16 when R = q_len * H <= 16 (the ping-pong schedule below); otherwise the fewest row blocks of 32, 48 or
64 rows, the smallest on a tie (H 16 q_len 2: 32; H 12 q_len 4 and 8: 48; H 128: 64). R > ROWS uses several row
blocks, each of which reads the KV again (from L2 when its neighbours in the grid run at the same time). 96 rows
(H 12, q_len 8) in one block would need 192 KB of fp32 O^T, more than the register file. 48 and 64 rows run 3
ring stages and one S^T buffer (ptxas, two-warpgroup `kernel`: 48 rows 220 registers; 64 rows, with 128 O^T and 32
S^T accumulators per thread, 255 registers, no spills; `kernel_sw`, the default, below; tests/hopper's spill check
guards both). Against 32-row blocks on the H200
(decode alone): H12 q8 1M x B1 630.6 -> 548.4 us, H128 q1 128K x B4 433.1 -> 327.7, H12 q4 1M x B1 429.1 ->
285.8.

Pipeline
--------
Per 64-token chunk ci: one CTA barrier (chunk ci + 1 landed, the S^T partials of chunk ci are in shared memory),
the cp.async of chunk ci + 3, the S^T wgmmas of chunk ci + 1 issued behind P.V of chunk ci - 1 (neither waited
for yet), the softmax of chunk ci (P into buffer ci % 2), then the wait for both wgmma groups, the V^T registers of
chunk ci, a second barrier (P and the row rescale written), the O^T rescale, P.V of chunk ci issued (waited for in
the next iteration) and the S^T partials of chunk ci + 1 stored. The tensor cores run P.V and S^T under the
softmax. Measured on the H200 (decode alone, against P.V waited for before the next chunk): H12 q8 1M x B1 554.2
-> 525.1 us, H128 q1 128K x B4 335.9 -> 320.1, H12 q4 1M x B1 305.2 -> 289.7; earlier, with 32-row blocks as
the q_len 8 default and the V^T loads after the second barrier, the same reordering measured slower. Three
barriers with S^T in its own iteration measured 4% slower than two.

16-row blocks (q_len x H <= 16, the TP8 decode case) run a ping-pong schedule instead:
warpgroup w takes the chunks 2j + w (ring stages w and w + 2, loading its own chunks one ahead) and runs all of
S^T, the softmax and P.V (all 512 dims, 64 fp32 accumulators per thread) on them with its own running max and
sum and named warpgroup barriers only, so one warpgroup's softmax latency overlaps the other's MMAs; the two
partial results are merged through shared memory once per segment. S^T of a whole chunk is two wgmma chains of 9
k32 steps summed in fp32 (the FP8 wgmma accumulation keeps fewer mantissa bits than fp32; one chain of 18 failed
the lse tolerance). On the H200 this took q_len 1 at 1M tokens from 1.31-1.38x to 1.09-1.15x the floor (decode
alone); with 32 rows it would need 128 O^T accumulators per thread, and 16-row blocks for 32+ rows were slower
(a second pass over the KV).

S^T warpgroup (32-, 48- and 64-row blocks, `kernel_sw`, the default; CUTE_MLA_S_WARPGROUP=0 turns it off): a third
warpgroup loads Q and the KV ring and runs all 18 k32 steps of S^T per chunk, storing the full S^T into one of
two buffers; warpgroups 0 and 1 run only the softmax and P.V. The softmax warps no longer issue, wait for or store
S^T, and S^T(ci + 1) runs under the softmax of chunk ci. H200, decode alone, one process, against the
two-warpgroup split schedule: H12 q8 1M x B1 512.9 -> 426.1 us (one P plane 467.8 -> 378.2), q8 128K x B4 263.1
-> 221.7, H16 q2 1M x B2 447.1 -> 395.5, H12 q4 1M x B1 280.6 -> 238.2. (The softmax in a third warpgroup instead
was no faster: one warpgroup's softmax chain became the bottleneck.) Warpgroup 2 reads the block-table entries of
a chunk two iterations before its copies: read right before them, their L2 round trip sat on its chain once per
chunk and the softmax warps waited for S_FULL (ncu: 10.5% of stall samples); ahead, decode alone: q8 1M x B1
443.7 -> 417.8 us, q8 128K x B4 228.8 -> 213.9, H16 q2 1M x B2 408.0 -> 392.2, H12 q4 1M x B1 245.7 -> 230.2.
With 32 rows the softmax warpgroups issue P.V(ci - 1) a dim tile at a time between the words of the softmax of
chunk ci instead of in one block after the rescale (`_sw_chunk`): wgmmas issue only as fast as the tensor pipe
takes them, so the block kept the warps from the next softmax for as long as P.V ran (timeline: 770-1000 cycles
of a chunk; 300-400 with one P plane). H200, one process: decode alone H16 q2 1M x B2 401.8 -> 382.2 us, 1M x B4
729.9 -> 708.7; steps H16 q2 1M x B4 681.4 / 682.6 -> 656.8 / 656.5 (1.29 -> 1.24 of the floor). 48 and 64
rows measured 4% slower that way and keep the block.
64-row blocks (H128, H16 q_len 4) run it too, with setmaxnreg 200 / 104 (`sw_register_budgets`): the S^T
warpgroup's 64 accumulators and the P.V warpgroups' 128 O^T registers fit no other split of 3 x 168 without
spills or serialised wgmmas. Decode alone against `kernel` (bench_decode_kernel, one process): H128 q1 page 64
128K x B4 337.3 -> 257.7 us, H128 q2 256K x B2 624.7 -> 475.7, H16 q4 page 64 1M x B1 367.3 -> 283.2.

Shared memory per CTA (4 stages): 160 KB ring + 5 x ROWS x 128 B Q + 2 x 2 x ROWS x 72 x 4 B S partials +
2 x ROWS x 64 B P (~190 KB for ROWS 16, ~220 KB for ROWS 32); 3 stages and one S^T buffer: ~191 KB for ROWS 48,
~214 KB for ROWS 64.
"""

from __future__ import annotations

import math
import os
from typing import Optional

import cutlass
import cutlass.memory
import cutlass.cute as cute
from cutlass import Float16, Float32, Int32
from cutlass.cute.nvgpu import cpasync

from ..shapes import default_rows_per_block
from .cute_utils import cuda_stream, gmem_ptr, pdl_prologue, use_pdl
from .warp_fp8 import (cp_async_16_l2_128, fence_operand, fence_proxy_async_smem, ldmatrix_x4, prmt,
                       quantize_p_e4m3, quantize_p_hi_lo, wgmma_commit, wgmma_fence, wgmma_rs_e4m3, wgmma_ss_e4m3,
                       wgmma_wait)

KV_DIM = 576
V_DIM = 512
LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
SM90_SMEM_CAPACITY = 227 * 1024  # dynamic shared memory per CTA
# KV and Q in shared memory: K-major 128B-swizzled blocks of 128 bytes per row (the wgmma canonical layout):
# byte (row r, piece c16 of block kb) lives at kb * BLOCK + r * 128 + ((c16 ^ (r % 8)) * 16). 576 bytes = 4.5
# blocks; the rope half block keeps its own 128-byte rows.
KV_BLOCKS = 5
# P^T (rows x 64 tokens, K-major) for the P.V wgmma: 8-row x 16-byte core matrices of 128 contiguous bytes,
# P_LBO apart along the tokens, P_SBO apart along the rows; one such plane for hi and one for lo.
P_LBO = 128
P_SBO = 4 * 128
P_SCALE = 256.0  # P is stored as e4m3(p * 256): p in [2^-14, 1] stays normal, p * 256 <= 448
CHUNK = 64  # tokens per ring stage: the wgmma M of S^T
NUM_THREADS = 256  # two warpgroups
S_K_GROUPS = 2  # S^T: warpgroup wg sums the k32 steps [9 wg, 9 wg + 9) of the 576 bytes
S_STRIDE = 64 + 8  # padded fp32 row of the S partials

FP8 = cutlass.Float8E4M3FN
BF16 = cutlass.BFloat16


def default_num_stages(rows_per_block: int) -> int:
    return 4 if rows_per_block <= 32 else 3


P_PLANES_ENV = "CUTE_MLA_P_PLANES"
# setmaxnreg of the softmax / P.V warpgroups and of the S^T warpgroup in `kernel_sw`: 2 x 208 + 88 = 504 =
# 3 x 168, what a 384-thread launch gives each thread triple (setmaxnreg.inc waits for registers that .dec freed)
SW_REGS_PV = 208
SW_REGS_S = 88
# 64 rows: the S^T warpgroup holds two chains of 32 accumulators, the P.V warpgroups 128 O^T registers. ptxas
# (sm_90a): 208 / 88 serialises the wgmmas, 216 / 72 spills, 200 / 104 neither.
SW_REGS_PV_64 = 200
SW_REGS_S_64 = 104


# kernel_sw's named barriers (0 is the CTA's), shared by its S^T warpgroup loop and `_sw_chunk`
PV_BAR = 1  # warpgroups 0 and 1 (256 threads): P(ci) and alpha(ci) written
S_FULL = 2  # + buffer: S^T(j) stored, its chunk landed
S_FREE = 4  # + buffer: S^T(j) read, the V^T registers of chunk j loaded
LOAD_BAR = 6  # warpgroup 2 alone: every copy of a chunk landed


def sw_register_budgets(rows_per_block: int):
    """(P.V warpgroups, S^T warpgroup) setmaxnreg budgets of `kernel_sw`."""
    return (SW_REGS_PV_64, SW_REGS_S_64) if rows_per_block == 64 else (SW_REGS_PV, SW_REGS_S)


def default_s_warpgroup(rows_per_block: int) -> bool:
    """Whether 32-, 48- and 64-row blocks run `kernel_sw` (S^T and the KV loads in a third warpgroup)."""
    return rows_per_block in (32, 48, 64) and os.environ.get("CUTE_MLA_S_WARPGROUP", "1") == "1"


def default_p_planes(num_heads: int, q_len: int) -> int:
    """e4m3 planes of P in the P.V MMA: 2 (hi and lo, the default) unless CUTE_MLA_P_PLANES says 1.

    One plane trades accuracy for speed where the tensor work bounds the kernel (see Numerics in the module
    docstring and docs/performance.md): relative output error ~1e-2 instead of ~1e-3, P.V half the tensor work.
    It applies to more than 16 query rows (q_len x H) only: the memory-bound 16-row ping-pong schedule measured no
    faster with it (H12 q_len 1 1M x B1, decode alone: 165.5 us with two planes, 174.8 with one)."""
    value = os.environ.get(P_PLANES_ENV, "").strip()
    if value not in ("", "1", "2"):
        raise ValueError(f"{P_PLANES_ENV} must be 1 or 2, got {value!r}")
    return 1 if value == "1" and num_heads * q_len > 16 else 2


class MLADecodeSM90:
    """Static configuration and code of the split-KV decode kernel (see the module docstring)."""

    def __init__(
        self,
        num_heads: int,
        q_len: int,
        page_size: int,
        tile_tokens: int = 64,
        causal: bool = True,
        rows_per_block: Optional[int] = None,
        num_stages: Optional[int] = None,
        pingpong: Optional[bool] = None,
        p_planes: Optional[int] = None,
        s_warpgroup: Optional[bool] = None,
        pdl: Optional[bool] = None,
    ):
        if page_size <= 0 or page_size & (page_size - 1):
            raise ValueError(f"page_size must be a power of two, got {page_size}")
        if tile_tokens <= 0 or (tile_tokens % page_size and page_size % tile_tokens):
            raise ValueError(f"tile_tokens ({tile_tokens}) and page_size ({page_size}) must divide one another")
        self.num_heads = num_heads
        self.q_len = q_len
        self.num_rows = num_heads * q_len  # R
        self.page_size = page_size
        self.tile_tokens = tile_tokens
        self.causal = bool(causal)
        self.rows = rows_per_block or default_rows_per_block(num_heads, q_len)
        if self.rows not in (16, 32, 48, 64):
            raise ValueError(f"rows_per_block must be 16, 32, 48 or 64, got {self.rows}")
        # 48- and 64-row blocks fit shared memory with 3 ring stages and one S^T buffer only (Q and the S^T
        # partials grow with the rows). One buffer is enough: the partials of chunk ci + 1 are stored after the
        # second barrier of iteration ci, which every thread passes only once its softmax of chunk ci is done.
        # Up to 32 rows keep the two buffers of the layout that was measured (they fit; one would do).
        self.s_buffers = 2 if self.rows <= 32 else 1
        num_stages = default_num_stages(self.rows) if num_stages is None else num_stages
        if num_stages < 3:
            raise ValueError(f"num_stages must be at least 3 (chunks ci, ci + 1 in use, one in flight), got {num_stages}")
        self.num_row_blocks = (self.num_rows + self.rows - 1) // self.rows
        self.chunk = CHUNK
        self.num_threads = NUM_THREADS
        self.num_stages = num_stages
        assert 4 * self.chunk == NUM_THREADS  # _load_chunk: 4 threads per token
        # Ping-pong (16-row blocks): each warpgroup runs the whole chunk pipeline (all of S^T, the softmax, P.V
        # over all 512 dims) on alternate chunks with its own softmax state, synchronising with named
        # warpgroup barriers only; the two partial results meet once per segment. 32 rows would need 128
        # fp32 O^T registers per thread, so they keep the split of the dims between the warpgroups.
        self.pingpong = (self.rows == 16 and num_stages == 4) if pingpong is None else bool(pingpong)
        if self.pingpong and (self.rows != 16 or num_stages != 4):
            raise ValueError("the ping-pong schedule needs 16-row blocks and 4 stages (2 per warpgroup)")
        # S^T warpgroup (32-, 48- and 64-row split schedule): see `kernel_sw`
        self.s_wg = (default_s_warpgroup(self.rows) if s_warpgroup is None else bool(s_warpgroup)) \
            and not self.pingpong
        if self.s_wg:
            if self.rows not in (32, 48, 64):
                raise ValueError("the S^T warpgroup needs 32-, 48- or 64-row blocks")
            self.num_threads = NUM_THREADS + NUM_THREADS // 2
            self.s_buffers = 1  # the space of one buffer of two partials holds the two buffers of full S^T
        # softmax threads per row: 16, 8 or 4 (both warpgroups on one chunk), 8 (one warpgroup per chunk); a
        # power of two for the shuffle reductions, so with 48 rows only the first 192 threads run the softmax
        threads = NUM_THREADS // 2 if self.pingpong else NUM_THREADS
        self.tpr = 1 << ((threads // self.rows).bit_length() - 1)
        self.softmax_threads = self.tpr * self.rows
        self.words_per_thread = (self.chunk // 4) // self.tpr  # P words (4 tokens) per softmax thread
        # kernel_sw with 32 rows issues P.V(ci - 1) between the words of the softmax of chunk ci (see there); every
        # thread of the two warpgroups owns a row then, so all of them reach each wgmma
        self.pv_in_softmax = self.s_wg and self.rows == 32
        assert not self.pv_in_softmax or self.softmax_threads == NUM_THREADS
        self.p_planes = default_p_planes(num_heads, q_len) if p_planes is None else int(p_planes)
        if self.p_planes not in (1, 2):
            raise ValueError(f"p_planes must be 1 (e4m3 P) or 2 (hi/lo e4m3 P), got {self.p_planes}")
        self.pdl = use_pdl() if pdl is None else bool(pdl)

    @cute.jit
    def __call__(
        self,
        p_q: cute.Pointer,
        p_kv: cute.Pointer,
        p_block_table: cute.Pointer,
        p_seq_lens: cute.Pointer,
        p_q_scale: cute.Pointer,
        p_k_scale: cute.Pointer,
        p_cta_tile_start: cute.Pointer,
        p_cta_first_request: cute.Pointer,
        p_request_tile_start: cute.Pointer,
        p_request_first_cta: cute.Pointer,
        p_num_splits: cute.Pointer,
        p_split_offset: cute.Pointer,
        p_out: cute.Pointer,
        p_lse: cute.Pointer,
        p_partial_out: cute.Pointer,
        p_partial_lse: cute.Pointer,
        batch: Int32,
        num_pages: Int32,
        kv_page_stride_16: Int32,
        block_table_stride: Int32,
        max_pages: Int32,
        num_ctas: Int32,
        max_batch: Int32,
        num_slots: Int32,
        softmax_scale: Float32,
        stream,
    ):
        R = self.num_rows
        P = self.page_size
        C = self.chunk
        ROWS = self.rows
        NS = self.num_stages

        # ---- global tensors (static inner strides; only the outer extents are runtime values) ----
        # q as (16 B piece, 36 pieces, row, request)
        mQ = cute.make_tensor(p_q, cute.make_layout((16, KV_DIM // 16, R, batch),
                                                    stride=(1, 16, KV_DIM, R * KV_DIM)))
        # 64-bit: a real KV pool is tens of GB, so page * page_stride overflows 32-bit offsets.
        page_stride = cute.assume(cutlass.Int64(kv_page_stride_16) * 16, divby=16)
        mKV = cute.make_tensor(p_kv, cute.make_layout((16, KV_DIM // 16, P, num_pages),
                                                      stride=(1, 16, KV_DIM, page_stride)))
        mBT = cute.make_tensor(p_block_table, cute.make_layout((max_pages, batch), stride=(1, block_table_stride)))
        mSeq = cute.make_tensor(p_seq_lens, cute.make_layout((batch,)))
        mQScale = cute.make_tensor(p_q_scale, cute.make_layout((1,)))
        mKScale = cute.make_tensor(p_k_scale, cute.make_layout((1,)))
        mCtaTileStart = cute.make_tensor(p_cta_tile_start, cute.make_layout((num_ctas + 1,)))
        mCtaFirstReq = cute.make_tensor(p_cta_first_request, cute.make_layout((num_ctas,)))
        mReqTileStart = cute.make_tensor(p_request_tile_start, cute.make_layout((max_batch + 1,)))
        mReqFirstCta = cute.make_tensor(p_request_first_cta, cute.make_layout((max_batch,)))
        mNumSplits = cute.make_tensor(p_num_splits, cute.make_layout((max_batch,)))
        mSplitOffset = cute.make_tensor(p_split_offset, cute.make_layout((max_batch,)))
        mOut = cute.make_tensor(p_out, cute.make_layout((V_DIM, R, batch), stride=(1, V_DIM, R * V_DIM)))
        mLse = cute.make_tensor(p_lse, cute.make_layout((R, batch), stride=(1, R)))
        mPOut = cute.make_tensor(p_partial_out, cute.make_layout((V_DIM, R, num_slots),
                                                                 stride=(1, V_DIM, R * V_DIM)))
        mPLse = cute.make_tensor(p_partial_lse, cute.make_layout((R, num_slots), stride=(1, R)))

        @cute.struct
        class SharedStorage:
            ring: cute.struct.Align[cute.struct.MemRange[FP8, NS * C * 128 * KV_BLOCKS], 1024]
            q: cute.struct.Align[cute.struct.MemRange[FP8, ROWS * 128 * KV_BLOCKS], 1024]
            s: cute.struct.Align[cute.struct.MemRange[Float32, self.s_buffers * S_K_GROUPS * ROWS * S_STRIDE], 128]
            p: cute.struct.Align[cute.struct.MemRange[FP8, 2 * 2 * ROWS * 64], 128]
            alpha: cute.struct.Align[cute.struct.MemRange[Float32, 2 * ROWS], 16]
            inv_l: cute.struct.Align[cute.struct.MemRange[Float32, ROWS], 16]
            row_ml: cute.struct.Align[cute.struct.MemRange[Float32, 2 * 2 * ROWS], 16]

        atom_cp_async = cute.make_copy_atom(
            cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), FP8, num_bits_per_copy=128)

        self.shared_storage_bytes = SharedStorage.size_in_bytes()  # recorded at trace time, for reports
        if cutlass.const_expr(self.shared_storage_bytes > SM90_SMEM_CAPACITY):
            raise ValueError(f"{self.shared_storage_bytes} B of shared memory do not fit an SM90 CTA "
                             f"({SM90_SMEM_CAPACITY} B): lower num_stages or rows_per_block")
        scale_log2 = softmax_scale * LOG2E
        kernel = self.kernel_sw if cutlass.const_expr(self.s_wg) else self.kernel
        # kernel_sw: maxntid (not the automatic reqntid) and one CTA per SM, or ptxas caps the whole kernel at
        # 65536 / 384 = 168 registers instead of giving the setmaxnreg regions their budgets
        bounds = dict(max_number_threads=[self.num_threads, 1, 1], min_blocks_per_mp=1) if self.s_wg else {}
        kernel(
            mQ, mKV, mBT, mSeq, mQScale, mKScale,
            mCtaTileStart, mCtaFirstReq, mReqTileStart, mReqFirstCta, mNumSplits, mSplitOffset,
            mOut, mLse, mPOut, mPLse, scale_log2, atom_cp_async, SharedStorage,
        ).launch(
            grid=(self.num_row_blocks, num_ctas, 1),
            block=(self.num_threads, 1, 1),
            stream=stream,
            use_pdl=self.pdl,
            **bounds,
        )

    # ------------------------------------------------------------------------------------------------
    @cute.kernel
    def kernel(
        self,
        mQ: cute.Tensor,
        mKV: cute.Tensor,
        mBT: cute.Tensor,
        mSeq: cute.Tensor,
        mQScale: cute.Tensor,
        mKScale: cute.Tensor,
        mCtaTileStart: cute.Tensor,
        mCtaFirstReq: cute.Tensor,
        mReqTileStart: cute.Tensor,
        mReqFirstCta: cute.Tensor,
        mNumSplits: cute.Tensor,
        mSplitOffset: cute.Tensor,
        mOut: cute.Tensor,
        mLse: cute.Tensor,
        mPOut: cute.Tensor,
        mPLse: cute.Tensor,
        scale_log2_base: Float32,
        atom_cp_async: cute.CopyAtom,
        SharedStorage: cutlass.Constexpr,
    ):
        R = self.num_rows
        H = self.num_heads
        T = self.tile_tokens
        C = self.chunk
        ROWS = self.rows
        NS = self.num_stages
        TPR = self.tpr
        SB = self.s_buffers
        PIECES = KV_DIM // 16  # 16-byte pieces per token row
        NA = ROWS // 2  # accumulators per m64 tile of S^T or O^T
        WGT = NUM_THREADS // 2  # threads per warpgroup

        pdl_prologue(self.pdl)
        tidx, _, _ = cute.arch.thread_idx()
        rb, cta, _ = cute.arch.block_idx()
        row0 = rb * ROWS
        warp_idx = tidx // 32
        lane = tidx % 32
        lg = lane // 4  # MMA fragment row group
        lt = lane % 4  # MMA fragment thread-in-group
        wg = warp_idx // 4
        wl = warp_idx % 4  # warp in the warpgroup: S^T rows (tokens) 16 wl + lg, + 8

        q_scale = mQScale[0]
        k_scale = mKScale[0]
        scale_log2 = scale_log2_base * q_scale * k_scale

        # ---- shared memory ----
        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(SharedStorage)
        swz = cute.make_swizzle(3, 4, 3)  # XOR byte-offset bits 4-6 (16 B piece) with bits 7-9 (row % 8)
        sRing = storage.ring.get_tensor(cute.make_composed_layout(swz, 0, cute.make_layout(
            (16, (8, KV_BLOCKS), C, NS), stride=(1, (16, C * 128), 128, C * 128 * KV_BLOCKS))))
        sQ8 = storage.q.get_tensor(cute.make_composed_layout(swz, 0, cute.make_layout(
            (16, (8, KV_BLOCKS), ROWS), stride=(1, (16, ROWS * 128), 128))))
        sInvL = storage.inv_l.get_tensor(cute.make_layout((ROWS,)))
        ring_addr = storage.ring.data_ptr().toint()
        q_addr = storage.q.data_ptr().toint()
        if cutlass.const_expr(self.pingpong):
            # S^T of each warpgroup's current chunk (all of K): (row, token, one partial, warpgroup)
            sS = storage.s.get_tensor(cute.make_layout((ROWS, C, 1, 2), stride=(S_STRIDE, 1, 0, ROWS * S_STRIDE)))
            # P words: (word w of the row = tokens pi(4w..4w+3), row, plane, warpgroup), core-matrix layout
            sPw = cute.make_tensor(cute.recast_ptr(storage.p.data_ptr(), dtype=Int32), cute.make_layout(
                ((4, 4), (8, ROWS // 8), 2, 2),
                stride=((1, P_LBO // 4), (4, P_SBO // 4), ROWS * 16, 2 * ROWS * 16)))[None, None, None, wg]
            sAlpha = storage.alpha.get_tensor(cute.make_layout((ROWS, 2), stride=(1, ROWS)))[None, wg]
            # (max or sum, row, warpgroup) at the end of a segment
            sML = storage.row_ml.get_tensor(cute.make_layout((2, ROWS, 2), stride=(1, 2, 2 * ROWS)))
            # O^T accumulators handed to the other warpgroup at the end of a segment, in the (then idle) ring:
            # (thread, accumulator, tile of the receiver's half, receiving warpgroup)
            sX = cute.make_tensor(cute.recast_ptr(storage.ring.data_ptr(), dtype=Float32), cute.make_layout(
                (WGT, NA, 4, 2), stride=(1, WGT, NA * WGT, 4 * NA * WGT)))
            p_addr = storage.p.data_ptr().toint() + wg * (2 * ROWS * 64)
            tw = tidx % WGT  # thread in the warpgroup
            wg_bar = wg + 1  # the warpgroup's named barrier (0 is the CTA's)
            soft_tid = tw
            num_o_tiles = 8  # each warpgroup accumulates all 512 dims
        else:
            # S^T partials: (row, token, k half = warpgroup, buffer = chunk % SB)
            sS = storage.s.get_tensor(cute.make_layout(
                (ROWS, C, S_K_GROUPS, SB), stride=(S_STRIDE, 1, ROWS * S_STRIDE, S_K_GROUPS * ROWS * S_STRIDE)))
            # P words: (word w of the row = tokens pi(4w..4w+3), row, plane, buffer = chunk % 2) in the core-matrix
            # layout; two buffers, because P.V of chunk ci still reads P(ci) while the softmax of ci + 1 writes
            sPw = cute.make_tensor(cute.recast_ptr(storage.p.data_ptr(), dtype=Int32), cute.make_layout(
                ((4, 4), (8, ROWS // 8), 2, 2),
                stride=((1, P_LBO // 4), (4, P_SBO // 4), ROWS * 16, 2 * ROWS * 16)))
            sAlpha = storage.alpha.get_tensor(cute.make_layout((ROWS,)))
            p_addr = storage.p.data_ptr().toint()
            soft_tid = tidx
            num_o_tiles = 4  # warpgroup wg accumulates dims [256 wg, 256 wg + 256)

        # ---- O^T = V^T.P^T on the tensor cores, in m64 tiles of dims: in tile t (dims [64 t, 64 t + 64)), warp
        # wl's 16 M rows are dims d0 = 64 t + 16 wl: rows 0-7 the even dims d0 + 2g, rows 8-15 the odd ones. Its
        # A registers come from ldmatrix.trans on tokens 32 ks + lane, 16 bytes at d0, which sit in block
        # d0 / 128, piece (d0 % 128) / 16.
        v_lane_off = lane * 128

        # ---- registers ----
        acc_S = cute.make_rmem_tensor(cute.make_layout((NA,)), Float32)
        acc_S2 = cute.make_rmem_tensor(cute.make_layout((NA,)), Float32)  # ping-pong: the second k half
        acc_O = cute.make_rmem_tensor(cute.make_layout((num_o_tiles * NA,)), Float32)

        # ---- softmax ownership: TPR consecutive threads per row ----
        srow = soft_tid // TPR
        ssub = soft_tid % TPR
        srow_g = row0 + srow
        s_t = srow_g // H  # query position t of this row (rows >= R are padding)

        # rows of this block that exist, and the last query position among them (for causal trimming)
        t_last = (cutlass.min(row0 + ROWS, R) - 1) // H

        zero16 = cute.make_rmem_tensor(cute.make_layout((16,)), FP8)
        zero16.fill(0.0)

        # ================================ segment walk ================================
        g = mCtaTileStart[cta]
        g_end = mCtaTileStart[cta + 1]
        b = mCtaFirstReq[cta]
        while g < g_end:
            b, seg_end, seq_len, tok_begin, tok_end, n_chunks = self._segment(mReqTileStart, mSeq, b, g, g_end, t_last)
            row_end = tok_end
            if cutlass.const_expr(self.causal):
                row_end = cutlass.min(tok_end, seq_len - self.q_len + s_t + 1)
            split = mNumSplits[b] != 1
            slot = mSplitOffset[b] + cta - mReqFirstCta[b]

            # ---- Q of request b: cp.async (thread t: row t / 4, pieces t % 4 + 4i), padding rows zeroed ----
            qrow = tidx // 4
            if qrow < ROWS:
                if row0 + qrow < R:
                    for i in cutlass.range_constexpr(PIECES // 4):
                        cute.copy(atom_cp_async, mQ[None, tidx % 4 + 4 * i, row0 + qrow, b],
                                  sQ8[None, tidx % 4 + 4 * i, qrow])
                else:
                    for i in cutlass.range_constexpr(PIECES // 4):
                        cute.autovec_copy(zero16, sQ8[None, tidx % 4 + 4 * i, qrow])
            cute.arch.cp_async_commit_group()

            acc_O.fill(0.0)
            row_max = -Float32.inf  # base-2, scaled
            row_sum = Float32(0.0)  # this thread's share of the row's sum (reduced over its TPR threads at the end)

            if cutlass.const_expr(self.pingpong):
                # ======== ping-pong: warpgroup wg takes the chunks 2 j + wg (ring stages wg and wg + 2) ========
                n_mine = (n_chunks + 1 - wg) // 2
                if n_mine > 0:
                    tok0 = tok_begin + wg * C
                    self._load_chunk(mKV, atom_cp_async, sRing, zero16,
                                     self._lookup_page(mBT, b, tok0, tok_end, tw), tok0, wg, tw)
                    self._load_chunk(mKV, atom_cp_async, sRing, zero16,
                                     self._lookup_page(mBT, b, tok0 + C // 2, tok_end, tw), tok0, wg, tw,
                                     C // 2)
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
                    # chunk j landed for the whole warpgroup; P.V of chunk j - 1 is done with the other stage,
                    # sS and sP
                    cute.arch.barrier(barrier_id=wg_bar, number_of_threads=WGT)
                    if j + 1 < n_mine:
                        next_stage = wg + 2 * ((j + 1) % 2)
                        self._load_chunk(mKV, atom_cp_async, sRing, zero16, next0, chunk_tok0 + 2 * C, next_stage, tw)
                        self._load_chunk(mKV, atom_cp_async, sRing, zero16, next1, chunk_tok0 + 2 * C, next_stage, tw,
                                         C // 2)
                    cute.arch.cp_async_commit_group()
                    next0 = self._lookup_page(mBT, b, chunk_tok0 + 4 * C, tok_end, tw)
                    next1 = self._lookup_page(mBT, b, chunk_tok0 + 4 * C + C // 2, tok_end, tw)

                    # all 18 k32 steps, as two chains of 9 summed in fp32: the FP8 wgmma accumulator keeps fewer
                    # mantissa bits than fp32, and one 18-step chain measured 4x the lse error of the split
                    # schedule (2.4e-3 vs 5.6e-4).
                    self._issue_s(acc_S, ring_addr, q_addr, stage, 0, KV_DIM // 64)
                    self._issue_s(acc_S2, ring_addr, q_addr, stage, KV_DIM // 64, KV_DIM // 64)
                    wgmma_wait(0)
                    for i in cutlass.range_constexpr(NA):
                        acc_S[i] = fence_operand(acc_S[i]) + fence_operand(acc_S2[i])
                    self._store_s(acc_S, sS[None, None, None, wg], 0, wl, lg, lt)
                    cute.arch.barrier(barrier_id=wg_bar, number_of_threads=WGT)

                    row_max, row_sum, alpha = self._softmax_chunk(
                        sS[None, None, None, wg], sPw, row_max, row_sum, chunk_tok0, row_end, scale_log2, srow, ssub)
                    if ssub == 0:
                        sAlpha[srow] = alpha
                    cute.arch.barrier(barrier_id=wg_bar, number_of_threads=WGT)

                    self._rescale_o(acc_O, sAlpha, lt, True)
                    stage_addr = ring_addr + stage * (C * 128 * KV_BLOCKS)
                    self._issue_pv(acc_O, stage_addr, p_addr, 0, 0, wl, lane)  # tiles 0-3, then 4-7: 32 A
                    self._issue_pv(acc_O, stage_addr, p_addr, 4, 4, wl, lane)  # registers live at a time
                    wgmma_wait(0)
                    for i in cutlass.range_constexpr(8 * NA):
                        acc_O[i] = fence_operand(acc_O[i])
                cute.arch.cp_async_wait_group(0)

                # ---- merge the warpgroups' partials: rescale each to the common max, swap halves of the dims ----
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
                        self._finish_row(m_all, l_all, k_scale, sInvL, mLse, mPLse, srow, srow_g, b, split, slot)
                cute.arch.barrier()
                for t in cutlass.range_constexpr(8):
                    if t // 4 == wg:
                        for i in cutlass.range_constexpr(NA):
                            acc_O[t * NA + i] = acc_O[t * NA + i] + sX[tw, i, t % 4, wg]
            else:
                # ======== both warpgroups on every chunk: S^T split over K, O^T over the dims ========
                for st in cutlass.range_constexpr(NS - 1):
                    if st < n_chunks:
                        page = self._lookup_page(mBT, b, tok_begin + st * C, tok_end, tidx)
                        self._load_chunk(mKV, atom_cp_async, sRing, zero16, page, tok_begin + st * C, st, tidx)
                    cute.arch.cp_async_commit_group()
                # The block-table entry of the next chunk to load is read one iteration early: a dependent global
                # read right before the cp.async would stall every warp for its L2 latency once per chunk.
                next_page = self._lookup_page(mBT, b, tok_begin + (NS - 1) * C, tok_end, tidx)
                # and the one after, two iterations before its copies: an entry read one iteration ahead still
                # waited behind that iteration's cp.async traffic (ncu, 48-row q_len 8: 5.8% of stall samples;
                # H200, decode alone, H12 q8 1M x B1: 526.0 -> 517.6 us)
                page_after = self._lookup_page(mBT, b, tok_begin + NS * C, tok_end, tidx)

                cute.arch.cp_async_wait_group(NS - 2)  # Q and chunk 0
                fence_proxy_async_smem()
                cute.arch.barrier()
                KSTEPS = KV_DIM // 32 // S_K_GROUPS  # warpgroup wg sums the k32 steps [9 wg, 9 wg + 9)
                if n_chunks > 0:
                    self._issue_s(acc_S, ring_addr, q_addr, 0, wg * KSTEPS, KSTEPS)
                    wgmma_wait(0)
                    self._store_s(acc_S, sS[None, None, None, 0], wg, wl, lg, lt)

                # Software pipeline: iteration ci issues S^T of chunk ci + 1 on the tensor cores behind P.V of chunk
                # ci - 1 (issued at the end of iteration ci - 1, not waited for), runs the softmax of chunk ci (its
                # S^T partials are in sS[ci % SB], P goes to buffer ci % 2) meanwhile, waits for both, loads the
                # V^T registers of chunk ci, and after the second barrier rescales O^T and issues P.V of chunk ci.
                for ci in range(n_chunks):
                    stage = ci % NS
                    pbuf = ci % 2
                    chunk_tok0 = tok_begin + ci * C
                    cute.arch.cp_async_wait_group(NS - 3)  # chunk ci + 1 landed
                    fence_proxy_async_smem()  # this thread's cp.async / zero-fill bytes -> visible to wgmma
                    # chunk ci + 1 landed; S^T(ci) partials written; V^T of chunk ci - 1 is in registers
                    cute.arch.barrier()
                    if ci + NS - 1 < n_chunks:
                        self._load_chunk(mKV, atom_cp_async, sRing, zero16, next_page, chunk_tok0 + (NS - 1) * C,
                                         (ci + NS - 1) % NS, tidx)
                    cute.arch.cp_async_commit_group()
                    next_page = page_after
                    page_after = self._lookup_page(mBT, b, chunk_tok0 + (NS + 1) * C, tok_end, tidx)
                    stage_addr = ring_addr + stage * (C * 128 * KV_BLOCKS)
                    if ci + 1 < n_chunks:
                        self._issue_s(acc_S, ring_addr, q_addr, (ci + 1) % NS, wg * KSTEPS, KSTEPS)

                    if srow < ROWS:  # all threads but with 48 rows (then warps 6 and 7 skip it)
                        row_max, row_sum, alpha = self._softmax_chunk(
                            sS[None, None, None, ci % SB], sPw[None, None, None, pbuf], row_max, row_sum,
                            chunk_tok0, row_end, scale_log2, srow, ssub)
                        if ssub == 0:
                            sAlpha[srow] = alpha
                    wgmma_wait(0)  # P.V of chunk ci - 1 and S^T of chunk ci + 1
                    for i in cutlass.range_constexpr(4 * NA):
                        acc_O[i] = fence_operand(acc_O[i])
                    a_regs = self._load_vt(stage_addr, wg * 4, wl, lane)
                    cute.arch.barrier()  # P(ci), alpha(ci) written; every softmax read of sS done

                    self._rescale_o(acc_O, sAlpha, lt, False)
                    self._issue_pv_regs(acc_O, a_regs, p_addr + pbuf * (2 * ROWS * 64), 0)  # waited next iteration
                    if ci + 1 < n_chunks:
                        self._store_s(acc_S, sS[None, None, None, (ci + 1) % SB], wg, wl, lg, lt)
                wgmma_wait(0)
                for i in cutlass.range_constexpr(4 * NA):
                    acc_O[i] = fence_operand(acc_O[i])

                cute.arch.cp_async_wait_group(0)
                row_sum = self._row_allreduce(row_sum, False)
                if ssub == 0 and srow < ROWS:
                    self._finish_row(row_max, row_sum, k_scale, sInvL, mLse, mPLse, srow, srow_g, b, split, slot)
                cute.arch.barrier()

            self._write_rows(acc_O, sInvL, mOut, mPOut, row0, b, split, slot, wg, wl, lg, lt, num_o_tiles)
            cute.arch.barrier()  # sInvL, sQ (and, ping-pong, sML and the ring) are reused by the next segment

            g = seg_end
            b = b + 1

    # ------------------------------------------------------------------------------------------------
    @cute.kernel
    def kernel_sw(
        self,
        mQ: cute.Tensor,
        mKV: cute.Tensor,
        mBT: cute.Tensor,
        mSeq: cute.Tensor,
        mQScale: cute.Tensor,
        mKScale: cute.Tensor,
        mCtaTileStart: cute.Tensor,
        mCtaFirstReq: cute.Tensor,
        mReqTileStart: cute.Tensor,
        mReqFirstCta: cute.Tensor,
        mNumSplits: cute.Tensor,
        mSplitOffset: cute.Tensor,
        mOut: cute.Tensor,
        mLse: cute.Tensor,
        mPOut: cute.Tensor,
        mPLse: cute.Tensor,
        scale_log2_base: Float32,
        atom_cp_async: cute.CopyAtom,
        SharedStorage: cutlass.Constexpr,
    ):
        """The split schedule with S^T and the KV loads in a third warpgroup (384 threads, 32 or 48 rows).

        Warpgroup 2 loads Q and the KV chunks (a 3-stage ring) and runs all 18 k32 steps of S^T (two chains of 9
        summed in fp32) for every chunk, storing the full S^T (no partials to add) into one of two buffers.
        Warpgroups 0 and 1 run the softmax (all 256 threads; 192 with 48 rows) and P.V (256 dims each) as in
        `kernel`. They meet through named barriers, per chunk j: S_FULL[j % 2] (S^T(j) stored, its chunk landed:
        warpgroup 2 arrives, 0 and 1 wait) and S_FREE[j % 2] (S^T(j) read and the V^T registers of chunk j
        loaded: 0 and 1 arrive; warpgroup 2 waits before it loads chunk j + 3 into that stage, which also orders
        its S^T(j + 2) store after the reads of S^T(j)). So S^T(j + 1) and the loads run under the softmax of
        chunk j, and the softmax warps no longer issue, wait for or store S^T."""
        R = self.num_rows
        H = self.num_heads
        T = self.tile_tokens
        C = self.chunk
        ROWS = self.rows
        NS = self.num_stages
        TPR = self.tpr
        PIECES = KV_DIM // 16
        NA = ROWS // 2
        NT = self.num_threads
        WGT = NUM_THREADS // 2

        pdl_prologue(self.pdl)
        tidx, _, _ = cute.arch.thread_idx()
        rb, cta, _ = cute.arch.block_idx()
        row0 = rb * ROWS
        warp_idx = tidx // 32
        lane = tidx % 32
        lg = lane // 4
        lt = lane % 4
        wg = warp_idx // 4
        wl = warp_idx % 4

        q_scale = mQScale[0]
        k_scale = mKScale[0]
        scale_log2 = scale_log2_base * q_scale * k_scale

        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(SharedStorage)
        swz = cute.make_swizzle(3, 4, 3)
        sRing = storage.ring.get_tensor(cute.make_composed_layout(swz, 0, cute.make_layout(
            (16, (8, KV_BLOCKS), C, NS), stride=(1, (16, C * 128), 128, C * 128 * KV_BLOCKS))))
        sQ8 = storage.q.get_tensor(cute.make_composed_layout(swz, 0, cute.make_layout(
            (16, (8, KV_BLOCKS), ROWS), stride=(1, (16, ROWS * 128), 128))))
        sInvL = storage.inv_l.get_tensor(cute.make_layout((ROWS,)))
        ring_addr = storage.ring.data_ptr().toint()
        q_addr = storage.q.data_ptr().toint()
        # full S^T (row, token, one part, buffer = chunk % 2); P words (word, row, plane, buffer); alpha (row, buffer)
        sS = storage.s.get_tensor(cute.make_layout((ROWS, C, 1, 2), stride=(S_STRIDE, 1, 0, ROWS * S_STRIDE)))
        sPw = cute.make_tensor(cute.recast_ptr(storage.p.data_ptr(), dtype=Int32), cute.make_layout(
            ((4, 4), (8, ROWS // 8), 2, 2),
            stride=((1, P_LBO // 4), (4, P_SBO // 4), ROWS * 16, 2 * ROWS * 16)))
        sAlpha = storage.alpha.get_tensor(cute.make_layout((ROWS, 2), stride=(1, ROWS)))
        p_addr = storage.p.data_ptr().toint()

        t_last = (cutlass.min(row0 + ROWS, R) - 1) // H
        zero16 = cute.make_rmem_tensor(cute.make_layout((16,)), FP8)
        zero16.fill(0.0)

        g = mCtaTileStart[cta]
        g_end = mCtaTileStart[cta + 1]
        b = mCtaFirstReq[cta]
        if wg == 2:
            # ================================ S^T warpgroup: loads and S^T ================================
            cute.arch.setmaxregister_decrease(sw_register_budgets(ROWS)[1])
            tw = tidx - NUM_THREADS
            acc_S = cute.make_rmem_tensor(cute.make_layout((NA,)), Float32)
            acc_S2 = cute.make_rmem_tensor(cute.make_layout((NA,)), Float32)
            while g < g_end:
                b, seg_end, seq_len, tok_begin, tok_end, n_chunks = self._segment(mReqTileStart, mSeq, b, g, g_end,
                                                                                  t_last)

                # Q (thread tw: rows tw / 4 + 32 i, pieces tw % 4 + 4 k), padding rows zeroed, and chunks 0, 1
                for i in cutlass.range_constexpr(ROWS // 32):
                    qrow = tw // 4 + 32 * i
                    if row0 + qrow < R:
                        for k in cutlass.range_constexpr(PIECES // 4):
                            cute.copy(atom_cp_async, mQ[None, tw % 4 + 4 * k, row0 + qrow, b],
                                      sQ8[None, tw % 4 + 4 * k, qrow])
                    else:
                        for k in cutlass.range_constexpr(PIECES // 4):
                            cute.autovec_copy(zero16, sQ8[None, tw % 4 + 4 * k, qrow])
                if cutlass.const_expr(ROWS % 32 != 0):
                    qrow = tw // 4 + 32 * (ROWS // 32)
                    if qrow < ROWS:
                        if row0 + qrow < R:
                            for k in cutlass.range_constexpr(PIECES // 4):
                                cute.copy(atom_cp_async, mQ[None, tw % 4 + 4 * k, row0 + qrow, b],
                                          sQ8[None, tw % 4 + 4 * k, qrow])
                        else:
                            for k in cutlass.range_constexpr(PIECES // 4):
                                cute.autovec_copy(zero16, sQ8[None, tw % 4 + 4 * k, qrow])
                for st in cutlass.range_constexpr(NS - 1):
                    if st < n_chunks:
                        self._load_chunk_wg(mBT, mKV, atom_cp_async, sRing, zero16, b, tok_begin + st * C, tok_end,
                                            st, tw)
                    cute.arch.cp_async_commit_group()
                # The block-table entries (one per half chunk) of the next chunk to load and of the one after: read
                # two iterations before their copies, or this warpgroup's chain (and so S^T of the next chunk)
                # waits one L2 round trip per chunk (ncu, q_len 8: the softmax warps then waited for S_FULL).
                next_a = self._lookup_page(mBT, b, tok_begin + (NS - 1) * C, tok_end, tw)
                next_b = self._lookup_page(mBT, b, tok_begin + (NS - 1) * C + C // 2, tok_end, tw)
                after_a = self._lookup_page(mBT, b, tok_begin + NS * C, tok_end, tw)
                after_b = self._lookup_page(mBT, b, tok_begin + NS * C + C // 2, tok_end, tw)

                for j in range(n_chunks):
                    cute.arch.cp_async_wait_group(NS - 2)  # chunk j (and Q) landed: one group younger in flight
                    fence_proxy_async_smem()
                    cute.arch.barrier(barrier_id=LOAD_BAR, number_of_threads=WGT)  # every copy of chunk j done
                    self._issue_s(acc_S, ring_addr, q_addr, j % NS, 0, KV_DIM // 64)
                    self._issue_s(acc_S2, ring_addr, q_addr, j % NS, KV_DIM // 64, KV_DIM // 64)
                    if cutlass.const_expr(self.rows == 64):
                        # 64 rows: the next chunk's copies are issued while S^T(j) runs, and S_FULL(j) follows
                        # them. H200, decode alone, one process, copies after S_FULL(j) -> under S^T(j): H128 q1
                        # 1M x B4 1948.8 -> 1908.5 us, page 64 128K x B4 259.0 -> 252.8, H128 q2 256K x B2 476.2
                        # -> 464.2, H16 q4 1M x B1 271.2 -> 267.1 (H64 q1 512K x B2 267.9 -> 275.4, min 255.2 ->
                        # 252.4); steps H128 q1 1M x B4 1767.7 / 1797.0 -> 1738.8 / 1739.9. With 32 and 48 rows it
                        # was 1-5% slower (q8 1M x B1 412.4 -> 436.5): there S_FULL(j) waiting for the copies
                        # delays the softmax.
                        self._sw_copy_next(mKV, atom_cp_async, sRing, zero16, next_a, next_b, tok_begin, j, n_chunks,
                                           S_FREE, tw)
                    wgmma_wait(0)
                    for i in cutlass.range_constexpr(NA):
                        acc_S[i] = fence_operand(acc_S[i]) + fence_operand(acc_S2[i])
                    # buffer j % 2 last held S^T(j - 2), released (S_FREE) before this warpgroup loaded chunk j + 1
                    self._store_s(acc_S, sS[None, None, None, j % 2], 0, wl, lg, lt)
                    cute.arch.barrier_arrive(barrier_id=S_FULL + j % 2, number_of_threads=NT)
                    if cutlass.const_expr(self.rows != 64):
                        self._sw_copy_next(mKV, atom_cp_async, sRing, zero16, next_a, next_b, tok_begin, j, n_chunks,
                                           S_FREE, tw)
                    next_a = after_a
                    next_b = after_b
                    after_a = self._lookup_page(mBT, b, tok_begin + (j + NS + 1) * C, tok_end, tw)
                    after_b = self._lookup_page(mBT, b, tok_begin + (j + NS + 1) * C + C // 2, tok_end, tw)
                if n_chunks > 0:
                    cute.arch.barrier(barrier_id=S_FREE + (n_chunks - 1) % 2, number_of_threads=NT)
                cute.arch.cp_async_wait_group(0)
                cute.arch.barrier()  # segment end: sQ and the ring are free, sInvL written
                cute.arch.barrier()  # the outputs are written
                g = seg_end
                b = b + 1
        else:
            # ================================ softmax and P.V warpgroups ================================
            cute.arch.setmaxregister_increase(sw_register_budgets(ROWS)[0])
            acc_O = cute.make_rmem_tensor(cute.make_layout((4 * NA,)), Float32)
            vt = cute.make_rmem_tensor(cute.make_layout((4 * 4 * (C // 32),)), Int32)  # V^T of the pending P.V
            vals = cute.make_rmem_tensor(cute.make_layout((4 * self.words_per_thread,)), Float32)
            srow = tidx // TPR
            ssub = tidx % TPR
            srow_g = row0 + srow
            s_t = srow_g // H
            while g < g_end:
                b, seg_end, seq_len, tok_begin, tok_end, n_chunks = self._segment(mReqTileStart, mSeq, b, g, g_end,
                                                                                  t_last)
                row_end = tok_end
                if cutlass.const_expr(self.causal):
                    row_end = cutlass.min(tok_end, seq_len - self.q_len + s_t + 1)
                split = mNumSplits[b] != 1
                slot = mSplitOffset[b] + cta - mReqFirstCta[b]
                acc_O.fill(0.0)
                row_max = -Float32.inf
                row_sum = Float32(0.0)
                if cutlass.const_expr(self.pv_in_softmax):
                    # 32 rows: P.V(ci - 1) is issued a dim tile at a time between the words of the softmax of chunk
                    # ci. Its wgmmas issue only as fast as the tensor pipe takes them, so issued in one block after
                    # the rescale they kept these warps from the next softmax for as long as they ran (timeline:
                    # 770-1000 cycles of a 2400-3500-cycle chunk, 300-400 with one P plane). Chunk 0 has no P.V
                    # before it: peeled, so that no wgmma is issued under a branch (ptxas then serialises them all,
                    # C7520). 48 and 64 rows keep one block after the rescale (measured: 4% slower this way, 48
                    # rows with warps 6 and 7 repeating a row so that all warps run the wgmmas).
                    if n_chunks > 0:
                        row_max, row_sum = self._sw_chunk(acc_O, vt, vals, sS, sPw, sAlpha, ring_addr, p_addr,
                                                          Int32(0), tok_begin, row_end, scale_log2, row_max, row_sum,
                                                          srow, ssub, wg, wl, lt, lane, False)
                    for ci in range(1, n_chunks):
                        row_max, row_sum = self._sw_chunk(acc_O, vt, vals, sS, sPw, sAlpha, ring_addr, p_addr, ci,
                                                          tok_begin, row_end, scale_log2, row_max, row_sum, srow,
                                                          ssub, wg, wl, lt, lane, True)
                    if n_chunks > 0:
                        self._issue_pv_part(acc_O, vt, p_addr + ((n_chunks - 1) % 2) * (2 * ROWS * 64), 0, 4, True)
                else:
                    for ci in range(n_chunks):
                        buf = ci % 2
                        cute.arch.barrier(barrier_id=S_FULL + buf, number_of_threads=NT)
                        if srow < ROWS:
                            row_max, row_sum, alpha = self._softmax_chunk(
                                sS[None, None, None, buf], sPw[None, None, None, buf], row_max, row_sum,
                                tok_begin + ci * C, row_end, scale_log2, srow, ssub)
                            if ssub == 0:
                                sAlpha[srow, buf] = alpha
                        wgmma_wait(0)  # P.V(ci - 1): its V^T registers may be reused
                        for i in cutlass.range_constexpr(4 * NA):
                            acc_O[i] = fence_operand(acc_O[i])
                        a_regs = self._load_vt(ring_addr + (ci % NS) * (C * 128 * KV_BLOCKS), wg * 4, wl, lane)
                        cute.arch.barrier_arrive(barrier_id=S_FREE + buf, number_of_threads=NT)
                        cute.arch.barrier(barrier_id=PV_BAR, number_of_threads=NUM_THREADS)  # P(ci), alpha(ci)
                        self._rescale_o(acc_O, sAlpha[None, buf], lt, False)
                        self._issue_pv_regs(acc_O, a_regs, p_addr + buf * (2 * ROWS * 64), 0)
                wgmma_wait(0)
                for i in cutlass.range_constexpr(4 * NA):
                    acc_O[i] = fence_operand(acc_O[i])
                row_sum = self._row_allreduce(row_sum, False)
                if ssub == 0 and srow < ROWS:
                    self._finish_row(row_max, row_sum, k_scale, sInvL, mLse, mPLse, srow, srow_g, b, split, slot)
                cute.arch.barrier()  # sInvL written; the S^T warpgroup is done with the segment
                self._write_rows(acc_O, sInvL, mOut, mPOut, row0, b, split, slot, wg, wl, lg, lt, 4)
                cute.arch.barrier()  # sInvL, sS, sP and sAlpha are reused by the next segment
                g = seg_end
                b = b + 1

    @cute.jit
    def _segment(self, mReqTileStart: cute.Tensor, mSeq: cute.Tensor, b: Int32, g: Int32, g_end: Int32,
                 t_last: Int32):
        """The CTA's next segment from global tile g: its request b (the first at or after b with tiles there;
        requests without tiles own an empty range), the segment's end tile, the request's length, its tokens
        [tok_begin, tok_end) (causal: no row of this block sees past L - q_len + t_last) and their chunks."""
        T = self.tile_tokens
        C = self.chunk
        while mReqTileStart[b + 1] <= g:
            b = b + 1
        req_first_tile = mReqTileStart[b]
        seg_end = cutlass.min(g_end, mReqTileStart[b + 1])
        seq_len = mSeq[b]
        tok_begin = (g - req_first_tile) * T
        tok_end = cutlass.min((seg_end - req_first_tile) * T, seq_len)
        if cutlass.const_expr(self.causal):
            tok_end = cutlass.min(tok_end, seq_len - self.q_len + t_last + 1)
        n_chunks = cutlass.max(tok_end - tok_begin + (C - 1), 0) // C
        return b, seg_end, seq_len, tok_begin, tok_end, n_chunks

    @cute.jit
    def _write_rows(self, acc_O: cute.Tensor, sInvL: cute.Tensor, mOut: cute.Tensor, mPOut: cute.Tensor, row0: Int32,
                    b: Int32, split, slot: Int32, wg: Int32, wl: Int32, lg: Int32, lt: Int32,
                    num_o_tiles: cutlass.Constexpr):
        """This thread's output rows, scaled by sInvL: the final bf16 output of request b, or the fp16 partial of
        workspace slot `slot` when the request is split."""
        R = self.num_rows
        ROWS = self.rows
        NA = ROWS // 2
        # lane (g, t) of warp wl holds, per tile and row 8j + 2 lt + e, the dims
        # (d0 + 2 lg, d0 + 2 lg + 1): one 4-byte store each (an fp16 or a bf16 pair). Ping-pong: warpgroup wg
        # writes dims [256 wg, 256 wg + 256), like the split schedule.
        o2 = cute.make_rmem_tensor(cute.make_layout((2,)), Float32)
        o2_bf16 = cute.make_rmem_tensor(cute.make_layout((2,)), BF16)
        o2_f16 = cute.make_rmem_tensor(cute.make_layout((2,)), Float16)
        for j in cutlass.range_constexpr(ROWS // 8):
            for e in cutlass.range_constexpr(2):
                orow = 8 * j + 2 * lt + e
                if row0 + orow < R:
                    inv = sInvL[orow]
                    for t in cutlass.range_constexpr(num_o_tiles):
                        if cutlass.const_expr(self.pingpong):
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

    @cute.jit
    def _load_chunk_wg(self, mBT: cute.Tensor, mKV: cute.Tensor, atom_cp_async: cute.CopyAtom, sRing: cute.Tensor,
                       zero16: cute.Tensor, b: Int32, tok0: Int32, tok_end: Int32, stage: Int32, tw: Int32):
        """One warpgroup's copies of the chunk [tok0, tok0 + C) into `stage`: two halves of 32 tokens."""
        C = self.chunk
        self._load_chunk(mKV, atom_cp_async, sRing, zero16, self._lookup_page(mBT, b, tok0, tok_end, tw), tok0,
                         stage, tw)
        self._load_chunk(mKV, atom_cp_async, sRing, zero16, self._lookup_page(mBT, b, tok0 + C // 2, tok_end, tw),
                         tok0, stage, tw, C // 2)

    @cute.jit
    def _sw_copy_next(self, mKV: cute.Tensor, atom_cp_async: cute.CopyAtom, sRing: cute.Tensor, zero16: cute.Tensor,
                      page_a: Int32, page_b: Int32, tok_begin: Int32, j: Int32, n_chunks: Int32, s_free: Int32,
                      tw: Int32):
        """kernel_sw's S^T warpgroup in iteration j: copy chunk j + NS - 1 (its two halves on pages page_a and
        page_b) into the stage that held chunk j - 1, once S_FREE(j - 1) says that chunk's V^T registers and S^T
        are read, and commit the copies as one group (an empty one past the segment's end)."""
        C = self.chunk
        NS = self.num_stages
        if j >= 1:
            cute.arch.barrier(barrier_id=s_free + (j - 1) % 2, number_of_threads=self.num_threads)
        if j + NS - 1 < n_chunks:
            tok_load = tok_begin + (j + NS - 1) * C
            self._load_chunk(mKV, atom_cp_async, sRing, zero16, page_a, tok_load, (j + NS - 1) % NS, tw)
            self._load_chunk(mKV, atom_cp_async, sRing, zero16, page_b, tok_load, (j + NS - 1) % NS, tw, C // 2)
        cute.arch.cp_async_commit_group()

    # ------------------------------------------------------------------------------------------------
    @cute.jit
    def _issue_s(self, acc_S: cute.Tensor, ring_addr: Int32, q_addr: Int32, stage: Int32, k0: Int32,
                 ksteps: cutlass.Constexpr):
        """Issue (and commit, not wait for) S^T = K.Q^T of the chunk in `stage` over the k32 steps
        [k0, k0 + ksteps) of the 576 bytes."""
        C = self.chunk
        ROWS = self.rows
        stage_addr = ring_addr + stage * (C * 128 * KV_BLOCKS)
        wgmma_fence()
        for kk in cutlass.range_constexpr(ksteps):
            ks = k0 + kk
            kb = ks // 4
            koff = (ks % 4) * 32
            d = wgmma_ss_e4m3(stage_addr + kb * (C * 128) + koff, q_addr + kb * (ROWS * 128) + koff,
                              [acc_S[i] for i in range(ROWS // 2)], 0 if kk == 0 else 1)
            for i in cutlass.range_constexpr(ROWS // 2):
                acc_S[i] = d[i]
        wgmma_commit()

    @cute.jit
    def _store_s(self, acc_S: cute.Tensor, sS_chunk: cute.Tensor, part: Int32, wl: Int32, lg: Int32, lt: Int32):
        """Write a warpgroup's S^T (partial) after wgmma_wait to sS_chunk[..., part] (row, token, part):
        acc_S[4i + 0/1] = (token 16 wl + lg, rows 8i + 2 lt + 0/1), [4i + 2/3] = token + 8."""
        ROWS = self.rows
        for i in cutlass.range_constexpr(ROWS // 2):
            acc_S[i] = fence_operand(acc_S[i])
        for i in cutlass.range_constexpr(ROWS // 8):
            tok = wl * 16 + lg
            r = i * 8 + 2 * lt
            sS_chunk[r, tok, part] = acc_S[4 * i + 0]
            sS_chunk[r + 1, tok, part] = acc_S[4 * i + 1]
            sS_chunk[r, tok + 8, part] = acc_S[4 * i + 2]
            sS_chunk[r + 1, tok + 8, part] = acc_S[4 * i + 3]

    @cute.jit
    def _rescale_o(self, acc_O: cute.Tensor, sAlpha: cute.Tensor, lt: Int32, skip_when_unit: cutlass.Constexpr):
        """O^T *= alpha of each row: acc_O[t * NA + 4j + e] = (dim d0 + 2 lg, row 8j + 2 lt + e),
        [.. + 2 + e] = (dim + 1, same row).

        skip_when_unit: skip the multiplies when every alpha of the thread is 1. alpha = exp2(old max - new max)
        is exactly 1 when a row's max did not move, which after the first chunks of a long segment is most chunks,
        so the skip changes no bit of O^T. It pays in the 16-row ping-pong schedule (H200, decode alone: H12 q1
        1M x B1 176.5 -> 165.0 us, 128K x B4 91.6 -> 88.2) and costs 3-4% in the split schedule (H12 q8 1M x B1
        526.0 -> 544.6 us, H128 q1 128K x B4 316.5 -> 328.2), where the branch sits between two wgmma waits."""
        ROWS = self.rows
        NA = ROWS // 2
        als = cute.make_rmem_tensor(cute.make_layout((ROWS // 4,)), Float32)  # this thread's rows 8j + 2 lt + e
        for j in cutlass.range_constexpr(ROWS // 8):
            for e in cutlass.range_constexpr(2):
                als[2 * j + e] = sAlpha[8 * j + 2 * lt + e]
        if cutlass.const_expr(skip_when_unit):
            al_min = Float32(1.0)
            for i in cutlass.range_constexpr(ROWS // 4):
                al_min = cute.arch.fmin(al_min, als[i])
            if al_min < Float32(1.0):
                self._scale_rows(acc_O, als)
        else:
            self._scale_rows(acc_O, als)

    @cute.jit
    def _scale_rows(self, acc_O: cute.Tensor, als: cute.Tensor):
        """acc_O rows (see _rescale_o) times this thread's row factors als[2j + e]."""
        NA = self.rows // 2
        for j in cutlass.range_constexpr(self.rows // 8):
            for e in cutlass.range_constexpr(2):
                for t in cutlass.range_constexpr(cute.size(acc_O) // NA):
                    acc_O[t * NA + 4 * j + e] = acc_O[t * NA + 4 * j + e] * als[2 * j + e]
                    acc_O[t * NA + 4 * j + 2 + e] = acc_O[t * NA + 4 * j + 2 + e] * als[2 * j + e]

    @cute.jit
    def _issue_pv(self, acc_O: cute.Tensor, stage_addr: Int32, p_addr: Int32, acc_tile0: cutlass.Constexpr,
                  dim_tile0: Int32, wl: Int32, lane: Int32):
        """Issue (and commit) O^T += V^T.P^T for 4 m64 tiles of dims: accumulator tiles [acc_tile0, + 4) are the
        dim tiles [dim_tile0, + 4). All A registers first (32 per thread), then one fence and 16 back-to-back
        wgmmas (2 k32 steps x the hi and lo planes of P)."""
        self._issue_pv_regs(acc_O, self._load_vt(stage_addr, dim_tile0, wl, lane), p_addr, acc_tile0)

    @cute.jit
    def _load_vt(self, stage_addr: Int32, dim_tile0: Int32, wl: Int32, lane: Int32):
        """The A registers of P.V for 4 m64 tiles of dims (32 per thread): V^T by ldmatrix.trans + prmt."""
        C = self.chunk
        a_regs = []
        for t in cutlass.range_constexpr(4):
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
        self._pv_wgmmas(acc_O, lambda t, ks: a_regs[t * (self.chunk // 32) + ks], p_addr, acc_tile0, 0, 4)
        wgmma_commit()

    @cute.jit
    def _pv_wgmmas(self, acc_O: cute.Tensor, a_of, p_addr: Int32, acc_tile0: cutlass.Constexpr,
                   t0: cutlass.Constexpr, t1: cutlass.Constexpr):
        """The P.V wgmmas of dim tiles [t0, t1) (2 k32 steps x the P planes each) into accumulator tiles
        acc_tile0 + t; a_of(t, ks) gives the 4 A registers."""
        C = self.chunk
        ROWS = self.rows
        NA = ROWS // 2
        for t in cutlass.range_constexpr(t0, t1):
            at = acc_tile0 + t
            for ks in cutlass.range_constexpr(C // 32):
                for plane in cutlass.range_constexpr(self.p_planes):
                    d = wgmma_rs_e4m3(a_of(t, ks), p_addr + plane * (ROWS * 64) + ks * 2 * P_LBO,
                                      P_LBO, P_SBO, [acc_O[at * NA + i] for i in range(NA)])
                    for i in cutlass.range_constexpr(NA):
                        acc_O[at * NA + i] = d[i]

    @cute.jit
    def _sw_chunk(self, acc_O: cute.Tensor, vt: cute.Tensor, vals: cute.Tensor, sS: cute.Tensor, sPw: cute.Tensor,
                  sAlpha: cute.Tensor, ring_addr: Int32, p_addr: Int32, ci: Int32, tok_begin: Int32, row_end: Int32,
                  scale_log2: Float32, row_max: Float32, row_sum: Float32, srow: Int32, ssub: Int32, wg: Int32,
                  wl: Int32, lt: Int32, lane: Int32, pv_prev: cutlass.Constexpr):
        """kernel_sw's softmax / P.V warpgroups on chunk ci: the softmax with P.V(ci - 1) issued inside it
        (pv_prev), the V^T registers of ci into vt, the O^T rescale. Returns the running max and sum."""
        C = self.chunk
        NS = self.num_stages
        ROWS = self.rows
        NA = ROWS // 2
        NT = self.num_threads
        buf = ci % 2
        p_prev = p_addr + (1 - buf) * (2 * ROWS * 64)
        cute.arch.barrier(barrier_id=S_FULL + buf, number_of_threads=NT)
        cmax = self._softmax_max(sS[None, None, None, buf], vals, tok_begin + ci * C, row_end, scale_log2, srow, ssub)
        row_max, row_sum, alpha = self._softmax_exp(vals, cmax, sPw[None, None, None, buf], row_max, row_sum, srow,
                                                    ssub, acc_O, vt, p_prev, pv_prev)
        sAlpha[srow, buf] = alpha  # the row's TPR threads write the same value
        wgmma_wait(0)  # P.V(ci - 1): its V^T registers may be reused
        for i in cutlass.range_constexpr(4 * NA):
            acc_O[i] = fence_operand(acc_O[i])
        a_regs = self._load_vt(ring_addr + (ci % NS) * (C * 128 * KV_BLOCKS), wg * 4, wl, lane)
        for t in cutlass.range_constexpr(len(a_regs)):
            for k in cutlass.range_constexpr(4):
                vt[4 * t + k] = a_regs[t][k]
        cute.arch.barrier_arrive(barrier_id=S_FREE + buf, number_of_threads=NT)
        cute.arch.barrier(barrier_id=PV_BAR, number_of_threads=NUM_THREADS)  # P(ci), alpha(ci)
        self._rescale_o(acc_O, sAlpha[None, buf], lt, False)
        return row_max, row_sum

    @cute.jit
    def _issue_pv_part(self, acc_O: cute.Tensor, vt: cute.Tensor, p_addr: Int32, t0: cutlass.Constexpr,
                       t1: cutlass.Constexpr, fence: cutlass.Constexpr):
        """Issue (and commit) the P.V wgmmas of dim tiles [t0, t1) on the V^T registers kept in vt."""
        KS = self.chunk // 32
        if cutlass.const_expr(fence):
            wgmma_fence()
        self._pv_wgmmas(acc_O, lambda t, ks: tuple(vt[4 * (t * KS + ks) + k] for k in range(4)), p_addr, 0, t0, t1)
        wgmma_commit()

    @cute.jit
    def _finish_row(self, m: Float32, l: Float32, k_scale: Float32, sInvL: cute.Tensor, mLse: cute.Tensor,
                    mPLse: cute.Tensor, srow: Int32, srow_g: Int32, b: Int32, split, slot: Int32):
        """A row's final max m and sum l (base 2, P scaled by P_SCALE): its output scale into sInvL and its
        natural-log lse into lse (single split) or the partial lse of its workspace slot. No KV: lse -inf,
        output 0."""
        inv_l = Float32(0.0)
        lse = -Float32.inf
        # A partial stays in units of the V scale (k_scale), so that fp16 holds it whatever the scale: it is a
        # convex combination of e4m3 values, |x| <= 448. The combine applies k_scale.
        v_scale = k_scale
        if split:
            v_scale = Float32(1.0)
        if l > Float32(0.0):
            inv_l = v_scale / (l * P_SCALE)
            lse = (m + cute.math.log2(l, fastmath=True)) * LN2
        sInvL[srow] = inv_l
        if srow_g < self.num_rows:
            if split:
                mPLse[srow_g, slot] = lse
            else:
                mLse[srow_g, b] = lse

    @cute.jit
    def _lookup_page(self, mBT: cute.Tensor, b: Int32, tok0: Int32, tok_end: Int32, tidx: Int32) -> Int32:
        """Block-table entry of token tok0 + tidx / 4 of request b (the token this thread copies), or -1 at or
        past tok_end. A page index past the table's width (possible inside a CUDA graph, where values go
        unchecked) is clamped to the last column: a min, where a branch around the load measured 3-7% slower.
        The entry itself is range-checked where it is used (`_load_chunk`): a check here would wait for the
        global load and undo reading the entry an iteration early."""
        tok = tok0 + tidx // 4
        page = Int32(-1)
        if tok < tok_end:
            page = mBT[cutlass.min(tok // self.page_size, cute.size(mBT, mode=[0]) - 1), b]
        return page

    @cute.jit
    def _load_chunk(self, mKV: cute.Tensor, atom_cp_async: cute.CopyAtom, sRing: cute.Tensor, zero16: cute.Tensor,
                    page: Int32, tok0: Int32, stage: Int32, tidx: Int32, token_offset: cutlass.Constexpr = 0):
        """cp.async this thread's share of the chunk [tok0, tok0 + C) of a request into ring stage `stage`: token
        tidx / 4 + token_offset of the chunk (on `page`), zero-filled in shared memory when page is not a page of
        the cache: -1 from `_lookup_page` (no KV) or a bad block-table entry, which is never read.

        Thread t copies 16-byte pieces t % 4 + 4i (i < 9): addresses that differ by constants (no per-piece
        address registers), and per instruction 64 contiguous bytes of each of a warp's 8 tokens. All 256
        threads cover a chunk; one warpgroup (ping-pong) covers it with token_offset 0 and C / 2.

        The ping-pong schedule (16 rows, memory-bound) copies with the L2::128B prefetch hint, so an L2 miss
        fetches the whole 128-byte line at once instead of the 64 bytes a warp's copy touches in each of 8
        token rows. H200, decode alone, one process: H12 q1 1M x B1 165.2 -> 161.1 us, 128K x B4 90.5 -> 86.9,
        1M x B4 610.0 -> 598.1 (L2::256B: 163.4, 87.5, 601.5); as steps (L2 emptied first) 4-13%: 1M x B1 174.0
        -> 157.5, 128K x B4 99.9 -> 88.1. The S^T warpgroup's copies with it: q_len 8 steps 3-4% slower (1M x B1
        394.8 -> 406.8), 32 and 64 rows 0-1.5% faster, so the other schedules keep CuTe's plain cp.async."""
        P = self.page_size
        PIECES = KV_DIM // 16
        n = tidx // 4 + token_offset
        tok = tok0 + n
        if page >= 0 and page < cute.size(mKV, mode=[3]):
            for i in cutlass.range_constexpr(PIECES // 4):
                pc = tidx % 4 + 4 * i
                if cutlass.const_expr(self.pingpong):
                    # the ring's swizzled byte address (module docstring), and the L2::128B prefetch hint
                    s_addr = (sRing.iterator.toint() + stage * (self.chunk * 128 * KV_BLOCKS)
                              + (pc // 8) * (self.chunk * 128) + n * 128 + (((pc % 8) ^ (n % 8)) * 16))
                    cp_async_16_l2_128(s_addr, mKV[None, pc, tok % P, page].iterator.toint())
                else:
                    cute.copy(atom_cp_async, mKV[None, pc, tok % P, page], sRing[None, pc, n, stage])
        else:
            for i in cutlass.range_constexpr(PIECES // 4):
                cute.autovec_copy(zero16, sRing[None, tidx % 4 + 4 * i, n, stage])

    @cute.jit
    def _softmax_chunk(self, sS_chunk: cute.Tensor, sPw_buf: cute.Tensor, row_max: Float32, row_sum: Float32,
                       chunk_tok0: Int32, row_end: Int32, scale_log2: Float32, srow: Int32, ssub: Int32):
        """Online softmax of one chunk for the row this thread shares with TPR - 1 others: S^T from sS_chunk
        (row, token, partial: the partials are summed), P as hi/lo e4m3 words w = ssub + TPR*i (tokens
        pi(4w .. 4w + 3)) into sPw_buf (word, row, plane), tokens >= row_end masked. Returns the new running max
        (the row's), this thread's share of the running sum (its tokens only: `_row_allreduce` at the end of a
        segment adds the shares) and the factor alpha that rescales the output accumulated so far. Fences P for
        the wgmma."""
        vals = cute.make_rmem_tensor(cute.make_layout((4 * self.words_per_thread,)), Float32)
        cmax = self._softmax_max(sS_chunk, vals, chunk_tok0, row_end, scale_log2, srow, ssub)
        return self._softmax_exp(vals, cmax, sPw_buf, row_max, row_sum, srow, ssub, None, None, Int32(0), False)

    @cute.jit
    def _softmax_max(self, sS_chunk: cute.Tensor, vals: cute.Tensor, chunk_tok0: Int32, row_end: Int32,
                     scale_log2: Float32, srow: Int32, ssub: Int32) -> Float32:
        """First half of `_softmax_chunk`: this thread's scaled, masked S values into vals and the row's max."""
        TPR = self.tpr
        WPT = self.words_per_thread
        parts = cute.size(sS_chunk, mode=[2])
        cmax = -Float32.inf
        for i in cutlass.range_constexpr(WPT):
            w = ssub + TPR * i
            n0 = (w // 4) * 16 + (w % 4) * 2  # tokens n0, n0 + 1, n0 + 8, n0 + 9 (the pi order)
            for j in cutlass.range_constexpr(4):
                n = n0 + (j // 2) * 8 + j % 2
                if cutlass.const_expr(parts == 2):
                    s = (sS_chunk[srow, n, 0] + sS_chunk[srow, n, 1]) * scale_log2
                else:
                    s = sS_chunk[srow, n, 0] * scale_log2
                if chunk_tok0 + n >= row_end:
                    s = -Float32.inf
                vals[4 * i + j] = s
                cmax = cute.arch.fmax(cmax, s)
        return self._row_allreduce(cmax, True)

    @cute.jit
    def _softmax_exp(self, vals: cute.Tensor, cmax: Float32, sPw_buf: cute.Tensor, row_max: Float32,
                     row_sum: Float32, srow: Int32, ssub: Int32, acc_O: cute.Tensor, vt: cute.Tensor, p_prev: Int32,
                     pv_prev: cutlass.Constexpr):
        """Second half of `_softmax_chunk`: P from vals and the row's chunk max; returns the new running max,
        this thread's share of the running sum and alpha. With pv_prev, the 4 dim tiles of P.V(ci - 1) are issued
        between its words (a tile before each of the first words), so that no issue waits long for the pipe."""
        TPR = self.tpr
        WPT = self.words_per_thread
        tiles_per_word = max(1, 4 // WPT)
        new_max = cute.arch.fmax(row_max, cmax)
        use_max = new_max
        if new_max == -Float32.inf:
            use_max = Float32(0.0)
        alpha = cute.math.exp2(row_max - use_max, fastmath=True)
        csum = Float32(0.0)
        for i in cutlass.range_constexpr(WPT):
            if cutlass.const_expr(pv_prev and i * tiles_per_word < 4):
                self._issue_pv_part(acc_O, vt, p_prev, i * tiles_per_word, min(4, (i + 1) * tiles_per_word), i == 0)
            w = ssub + TPR * i
            pv = [cute.math.exp2(vals[4 * i + j] - use_max, fastmath=True) for j in range(4)]
            csum = csum + (pv[0] + pv[1]) + (pv[2] + pv[3])
            if cutlass.const_expr(self.p_planes == 2):
                hi, lo = quantize_p_hi_lo(pv[0] * P_SCALE, pv[1] * P_SCALE, pv[2] * P_SCALE, pv[3] * P_SCALE)
                sPw_buf[w, srow, 0] = hi
                sPw_buf[w, srow, 1] = lo
            else:
                sPw_buf[w, srow, 0] = quantize_p_e4m3(pv[0] * P_SCALE, pv[1] * P_SCALE, pv[2] * P_SCALE,
                                                      pv[3] * P_SCALE)
        fence_proxy_async_smem()  # P is a wgmma operand
        # The sum stays per thread (alpha is the same for all the row's threads): reduced over the row's threads
        # once per segment, not per chunk, which took two shuffles off each chunk's softmax chain (H200, decode
        # alone, one process, two runs: H12 q8 1M x B1 400.7 -> 389.4 and 445.1 -> 433.8 us, H128 q1 page 64 128K x B4
        # 249.0 -> 243.2 and 273.2 -> 267.5).
        return new_max, row_sum * alpha + csum, alpha

    @cute.jit
    def _row_allreduce(self, val: Float32, is_max: cutlass.Constexpr) -> Float32:
        """Reduce over the TPR consecutive lanes that own one softmax row."""
        for i in cutlass.range_constexpr(int(math.log2(self.tpr))):
            other = cute.arch.shuffle_sync_bfly(val, offset=self.tpr >> (i + 1))
            if cutlass.const_expr(is_max):
                val = cute.arch.fmax(val, other)
            else:
                val = val + other
        return val


# ====================================================================================================
# Compilation cache and launcher
# ====================================================================================================

_COMPILED = {}


def _static_key(num_heads, q_len, page_size, tile_tokens, causal, rows_per_block, num_stages, pingpong, p_planes,
                arch, s_warpgroup=None, pdl=None):
    rows = rows_per_block or default_rows_per_block(num_heads, q_len)
    num_stages = default_num_stages(rows) if num_stages is None else num_stages
    if pingpong is None:
        pingpong = rows == 16 and num_stages == 4
    if p_planes is None:
        p_planes = default_p_planes(num_heads, q_len)
    if s_warpgroup is None:
        s_warpgroup = default_s_warpgroup(rows)
    return (int(num_heads), int(q_len), int(page_size), int(tile_tokens), bool(causal), int(rows),
            int(num_stages), bool(pingpong), int(p_planes), arch, bool(s_warpgroup) and not pingpong,
            use_pdl() if pdl is None else bool(pdl))


def compile_decode_sm90(num_heads: int, q_len: int, page_size: int, tile_tokens: int = 64, causal: bool = True,
                        rows_per_block: Optional[int] = None, num_stages: Optional[int] = None,
                        pingpong: Optional[bool] = None, p_planes: Optional[int] = None,
                        arch: str = "sm_90a", s_warpgroup: Optional[bool] = None):
    """Compile (once per static key) and return the kernel's launcher function.

    Works without a GPU: all runtime values (pointers, batch, num_pages, strides, num_ctas, num_slots,
    softmax_scale, stream) are runtime arguments of the compiled function, so one compile serves every batch
    size / cache size / plan size. `arch` is passed to the compiler (`--gpu-arch`).
    """
    key = _static_key(num_heads, q_len, page_size, tile_tokens, causal, rows_per_block, num_stages, pingpong, p_planes,
                      arch, s_warpgroup)
    fn = _COMPILED.get(key)
    if fn is not None:
        return fn
    op = MLADecodeSM90(num_heads, q_len, page_size, tile_tokens, causal, rows_per_block=key[5],
                       num_stages=key[6], pingpong=key[7], p_planes=key[8], s_warpgroup=key[10], pdl=key[11])
    ptr = gmem_ptr
    args = (
        ptr(FP8, 16), ptr(FP8, 16), ptr(Int32, 4), ptr(Int32, 4), ptr(Float32, 4), ptr(Float32, 4),
        ptr(Int32, 4), ptr(Int32, 4), ptr(Int32, 4), ptr(Int32, 4), ptr(Int32, 4), ptr(Int32, 4),
        ptr(BF16, 16), ptr(Float32, 4), ptr(Float16, 16), ptr(Float32, 4),
        Int32(1), Int32(1), Int32(1), Int32(1), Int32(1), Int32(1), Int32(1), Int32(1), Float32(1.0),
        cuda_stream(),
    )
    options = f"--gpu-arch {arch}" if arch else None
    if options:
        fn = cute.compile(op, *args, options=options)
    else:
        fn = cute.compile(op, *args)
    fn.decode_op = op  # static configuration (rows, grid, shared_storage_bytes) of what was compiled
    _COMPILED[key] = fn
    return fn


def _plan_tensors(plan):
    if hasattr(plan, "tensors"):
        return plan.tensors(), plan.tile_tokens
    raise TypeError("plan must be a mla_backend.planner.SplitPlan")


def run_decode_sm90(q, kv_cache, block_table, seq_lens, softmax_scale, q_scale, k_scale, plan, out, lse,
                    partial_out, partial_lse, *, causal: bool = True, stream=None, tile_tokens: Optional[int] = None,
                    rows_per_block: Optional[int] = None, pingpong: Optional[bool] = None,
                    p_planes: Optional[int] = None):
    """Launch the split-KV decode on torch CUDA tensors (no host sync, no allocation: CUDA-graph safe).

    q fp8 [B, q_len, H, 576] contiguous; kv_cache fp8 [num_pages, page_size, 576] (or [.., 1, 576]) with
    unit stride on the 576 bytes, row stride 576 and a page stride that is a multiple of 16 bytes;
    block_table int32 [B, max_pages] with unit column stride; seq_lens int32 [B]; q_scale/k_scale float32 [1]
    on the device; plan a `SplitPlan` (its six int32 tensors are read on the device only); out bf16
    [B, q_len, H, 512], lse fp32 [B, q_len, H], partial_out fp16 [num_slots, q_len, H, 512] (in units of
    k_scale, `_finish_row`), partial_lse fp32 [num_slots, q_len, H], all contiguous. `stream` is a
    torch.cuda.Stream (default: the current stream).
    """
    import torch

    if kv_cache.dim() == 4:
        kv_cache = kv_cache.squeeze(2)
    batch, q_len, num_heads, _ = q.shape
    num_pages, page_size, _ = kv_cache.shape
    plan_t, plan_tile = _plan_tensors(plan)
    tile = plan_tile if tile_tokens is None else tile_tokens
    cta_tile_start, cta_first_request, request_tile_start, request_first_cta, num_splits, split_offset = plan_t
    if kv_cache.stride(2) != 1 or kv_cache.stride(1) != KV_DIM or kv_cache.stride(0) % 16:
        raise ValueError(f"kv_cache strides {kv_cache.stride()} are not supported")
    if block_table.stride(1) != 1:
        raise ValueError("block_table must have unit column stride")
    if not (q.is_contiguous() and out.is_contiguous() and lse.is_contiguous() and partial_out.is_contiguous()
            and partial_lse.is_contiguous()):
        raise ValueError("q, out, lse, partial_out and partial_lse must be contiguous")
    if partial_out.numel() and partial_out.dtype != torch.float16:
        raise ValueError(f"partial_out must be float16 (DecodeWorkspace), got {partial_out.dtype}")
    fn = compile_decode_sm90(num_heads, q_len, page_size, tile, causal, rows_per_block, pingpong=pingpong,
                             p_planes=p_planes)
    num_ctas = cta_first_request.shape[0]
    max_batch = num_splits.shape[0]
    num_slots = partial_lse.shape[0]
    if stream is None:
        stream = torch.cuda.current_stream(q.device)
    fn(
        gmem_ptr(FP8, 16, q.data_ptr()),
        gmem_ptr(FP8, 16, kv_cache.data_ptr()),
        gmem_ptr(Int32, 4, block_table.data_ptr()),
        gmem_ptr(Int32, 4, seq_lens.data_ptr()),
        gmem_ptr(Float32, 4, q_scale.data_ptr()),
        gmem_ptr(Float32, 4, k_scale.data_ptr()),
        gmem_ptr(Int32, 4, cta_tile_start.data_ptr()),
        gmem_ptr(Int32, 4, cta_first_request.data_ptr()),
        gmem_ptr(Int32, 4, request_tile_start.data_ptr()),
        gmem_ptr(Int32, 4, request_first_cta.data_ptr()),
        gmem_ptr(Int32, 4, num_splits.data_ptr()),
        gmem_ptr(Int32, 4, split_offset.data_ptr()),
        gmem_ptr(BF16, 16, out.data_ptr()),
        gmem_ptr(Float32, 4, lse.data_ptr()),
        gmem_ptr(Float16, 16, partial_out.data_ptr()),
        gmem_ptr(Float32, 4, partial_lse.data_ptr()),
        Int32(batch), Int32(num_pages), Int32(kv_cache.stride(0) // 16), Int32(block_table.stride(0)),
        Int32(block_table.shape[1]),
        Int32(num_ctas), Int32(max_batch), Int32(max(num_slots, 1)), Float32(float(softmax_scale)),
        cuda_stream(stream),
    )
