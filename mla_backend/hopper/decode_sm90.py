"""Split-KV decode step of paged FP8 MLA for Hopper (sm_90a), in CuTe DSL.

What one CTA does
-----------------
Grid (num_ctas, num_row_blocks). CTA (c, rb) walks the global KV tiles [cta_tile_start[c], cta_tile_start[c+1])
of the split plan (`mla_backend.planner`), cut into segments = (request b, local tiles [t0, t1)). For each segment
it attends the query rows [rb*ROWS, rb*ROWS + ROWS) of request b (row r = t*H + h of q[b].view(R, 576)) over the
tokens [t0*T, min(t1*T, L_b)), with causal masking j <= L_b - q_len + t, and writes either the final bf16 output
and natural-log lse (num_splits[b] == 1) or an fp32 partial into workspace slot
split_offset[b] + c - request_first_cta[b] (the combine kernel merges those).

Data path (first version: Ampere-style warp MMA, proven CuTe DSL building blocks)
--------------------------------------------------------------------------------
- KV is gathered through the block table with 16-byte cp.async into an FP8 staging ring of NUM_STAGES chunks
  (CHUNK tokens x 576 B each). Tokens past the segment end are zero-filled in shared memory (never loaded), so
  the block table is never read past ceil(L_b / page_size) entries and no page past the request's last one is
  touched.
- Each chunk is converted once, FP8 E4M3 -> F16, into a swizzled shared tile (cvt.rn.f16x2.e4m3x2: one
  instruction per two values). E4M3 is exact in f16 (and f16 keeps P = exp(s - m) with 10 mantissa bits instead
  of bf16's 7), so f16 MMA with fp32 accumulation equals FP8 MMA up to accumulation order. The f16 tile serves
  as K (all 576 columns) for S = Q.K^T and, read with ldmatrix.trans, as V (first 512 columns) for O += P.V:
  the latent is read from DRAM once per chunk per CTA.
- Q (ROWS x 576) is gathered once per segment the same way (staged through the f16 KV buffer) and kept in
  shared memory as f16.
- S: warps are split as (S_WARPS_N token groups of 16) x (S_K_GROUPS slices of the 576-wide K); each group
  writes its fp32 partial S to shared memory and the softmax threads sum them. This halves (CHUNK 64) the
  shared-memory reads of Q compared with every warp walking all of K.
- Online softmax in base 2 with the scale folded (scale_log2 = softmax_scale * q_scale * k_scale * log2 e):
  NUM_THREADS / ROWS threads per row, shuffle reductions, P stored as f16 in shared memory, the per-row
  rescale factor in shared memory.
- O (ROWS x 512, fp32) lives in registers: 8 warps split the 512 columns (16 columns per warp per 128-column
  block), ROWS*512/256 fp32 per thread (32 for ROWS 16, 64 for ROWS 32).

Rows per block
--------------
ROWS is 16 when R = q_len * H <= 16 (one MMA M tile) and 32 otherwise; R > ROWS uses several row blocks
(blockIdx.y). Each row block re-reads the KV of its segments: R = 1024 (H 128, q_len 8) with ROWS 32 means 32
reads of every tile (from L2 when the row blocks of a CTA column run together, which the fixed grid does not
guarantee). That is the price of this first version; see the report for the wgmma design that removes it.

Shared memory per CTA (CHUNK 64, 2 stages): 72 KiB FP8 ring + 72 KiB f16 KV + ROWS*1152 B f16 Q + S partials
(2 x ROWS x 72 x 4 B) + P (ROWS x 128 B): 178,176 B for ROWS 16, 207,872 B for ROWS 32 (one CTA per SM).
Registers (ptxas, sm_90a): 184 (ROWS 16) / 222 (ROWS 32), no spills.

Measured on an H200 (first version): 64 requests x 8192 tokens, 132 CTAs: H 12 q 1 page 32: 182 us (1.66 TB/s of
KV); H 16 q 2 page 64: 214 us (1.41 TB/s). A third ring stage changes nothing: the CTA is bound by its own
shared-memory traffic (FP8 -> f16 conversion, ldmatrix of Q/K/V) and barriers, not by load latency.
"""

from __future__ import annotations

import math
from typing import Optional

import cutlass
import cutlass.memory
import cutlass.cute as cute
from cutlass import Float16, Float32, Int32
from cutlass.cute.nvgpu import cpasync, warp

KV_DIM = 576
V_DIM = 512
LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
SM90_SMEM_CAPACITY = 227 * 1024  # dynamic shared memory per CTA

FP8 = cutlass.Float8E4M3FN
BF16 = cutlass.BFloat16


def default_rows_per_block(num_heads: int, q_len: int) -> int:
    return 16 if num_heads * q_len <= 16 else 32


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
        chunk_tokens: int = 64,
        num_warps: int = 8,
        num_stages: int = 2,
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
        self.num_row_blocks = (self.num_rows + self.rows - 1) // self.rows
        self.chunk = chunk_tokens
        self.num_warps = num_warps
        self.num_threads = 32 * num_warps
        self.num_stages = num_stages
        if self.rows % 16 or self.rows > 64:
            raise ValueError(f"rows_per_block must be 16, 32, 48 or 64, got {self.rows}")
        if self.chunk not in (32, 64):
            raise ValueError(f"chunk_tokens must be 32 or 64, got {self.chunk}")
        # S = Q.K^T: S_WARPS_N warps over the chunk's tokens (16 each) x S_K_GROUPS slices of K = 576.
        self.s_warps_n = self.chunk // 16
        if self.num_warps % self.s_warps_n:
            raise ValueError("num_warps must be a multiple of chunk_tokens / 16")
        self.s_k_groups = self.num_warps // self.s_warps_n
        self.k_steps = KV_DIM // 16  # 36
        if self.k_steps % self.s_k_groups:
            raise ValueError(f"{self.s_k_groups} K groups do not divide the 36 K steps")
        # O += P.V: all warps over the 512 output columns, 16 columns per warp per block.
        if V_DIM % (16 * self.num_warps):
            raise ValueError("512 must be a multiple of 16 * num_warps")
        # Softmax: THREADS_PER_ROW consecutive threads own one row.
        self.tpr = self.num_threads // self.rows
        if self.tpr > 32 or self.tpr & (self.tpr - 1) or self.chunk % self.tpr:
            raise ValueError(f"unsupported rows_per_block {self.rows} for {self.num_threads} threads")
        # Q's FP8 staging is aliased onto the f16 KV buffer.
        if self.rows > 2 * self.chunk:
            raise ValueError("rows_per_block must be at most 2 * chunk_tokens")
        self.s_stride = self.chunk + 8  # padded fp32 row of the S partials (bank-conflict-free fragment stores)

    def _swizzled_f16_layout(self, rows: int, cols: int):
        # 8 rows x 64 f16 (128 B) atoms, XOR-swizzled by 16-byte chunk: conflict-free ldmatrix and 16 B stores.
        if cols % 64 == 0:
            atom = cute.make_composed_layout(cute.make_swizzle(3, 3, 3), 0,
                                             cute.make_layout((8, 64), stride=(64, 1)))
        else:
            atom = cute.make_composed_layout(cute.make_swizzle(2, 3, 3), 0,
                                             cute.make_layout((8, 32), stride=(32, 1)))
        return cute.tile_to_shape(atom, (rows, cols), (0, 1))

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
        mBT = cute.make_tensor(p_block_table, cute.make_layout((block_table_stride, batch),
                                                               stride=(1, block_table_stride)))
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

        # ---- shared memory ----
        sKV16_layout = self._swizzled_f16_layout(C, KV_DIM)
        sQ16_layout = self._swizzled_f16_layout(ROWS, KV_DIM)
        sP_layout = self._swizzled_f16_layout(ROWS, C)

        @cute.struct
        class SharedStorage:
            ring: cute.struct.Align[cute.struct.MemRange[FP8, NS * C * KV_DIM], 128]
            kv16: cute.struct.Align[cute.struct.MemRange[Float16, cute.cosize(sKV16_layout)], 1024]
            q16: cute.struct.Align[cute.struct.MemRange[Float16, cute.cosize(sQ16_layout)], 1024]
            s: cute.struct.Align[cute.struct.MemRange[Float32, self.s_k_groups * ROWS * self.s_stride], 128]
            p: cute.struct.Align[cute.struct.MemRange[Float16, cute.cosize(sP_layout)], 1024]
            alpha: cute.struct.Align[cute.struct.MemRange[Float32, ROWS], 16]
            inv_l: cute.struct.Align[cute.struct.MemRange[Float32, ROWS], 16]

        # ---- copies ----
        atom_cp_async = cute.make_copy_atom(
            cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), FP8, num_bits_per_copy=128)
        # FP8 ring -> f16 tile conversion: 8 values per thread per step, (NT/8, 8) threads.
        conv_thr = cute.make_layout((self.num_threads // 8, 8), stride=(8, 1))
        conv_val = cute.make_layout((1, 8))
        conv_copy_f8 = cute.make_tiled_copy_tv(
            cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), FP8, num_bits_per_copy=64), conv_thr, conv_val)
        conv_copy_f16 = cute.make_tiled_copy_tv(
            cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Float16, num_bits_per_copy=128), conv_thr, conv_val)
        q_conv_rows = min(ROWS, self.num_threads // 8)
        qconv_thr = cute.make_layout((q_conv_rows, 8), stride=(8, 1))
        qconv_copy_f8 = cute.make_tiled_copy_tv(
            cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), FP8, num_bits_per_copy=64), qconv_thr, conv_val)
        qconv_copy_f16 = cute.make_tiled_copy_tv(
            cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Float16, num_bits_per_copy=128), qconv_thr, conv_val)

        # ---- MMAs (f16 x f16 -> f32, m16n8k16) ----
        tiled_mma_s = cute.make_tiled_mma(
            warp.MmaF16BF16Op(Float16, Float32, (16, 8, 16)),
            (1, self.s_warps_n, 1),
            permutation_mnk=(16, self.s_warps_n * 16, 16),
        )
        tiled_mma_o = cute.make_tiled_mma(
            warp.MmaF16BF16Op(Float16, Float32, (16, 8, 16)),
            (1, self.num_warps, 1),
            permutation_mnk=(16, self.num_warps * 16, 16),
        )

        self.shared_storage_bytes = SharedStorage.size_in_bytes()  # recorded at trace time, for reports
        if cutlass.const_expr(self.shared_storage_bytes > SM90_SMEM_CAPACITY):
            raise ValueError(f"{self.shared_storage_bytes} B of shared memory do not fit an SM90 CTA "
                             f"({SM90_SMEM_CAPACITY} B): lower num_stages, chunk_tokens or rows_per_block")
        scale_log2 = softmax_scale * LOG2E
        self.kernel(
            mQ, mKV, mBT, mSeq, mQScale, mKScale,
            mCtaTileStart, mCtaFirstReq, mReqTileStart, mReqFirstCta, mNumSplits, mSplitOffset,
            mOut, mLse, mPOut, mPLse, scale_log2,
            sKV16_layout, sQ16_layout, sP_layout,
            atom_cp_async, conv_copy_f8, conv_copy_f16, qconv_copy_f8, qconv_copy_f16,
            tiled_mma_s, tiled_mma_o, SharedStorage,
        ).launch(
            grid=(num_ctas, self.num_row_blocks, 1),
            block=(self.num_threads, 1, 1),
            stream=stream,
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
        sKV16_layout: cute.ComposedLayout,
        sQ16_layout: cute.ComposedLayout,
        sP_layout: cute.ComposedLayout,
        atom_cp_async: cute.CopyAtom,
        conv_copy_f8: cute.TiledCopy,
        conv_copy_f16: cute.TiledCopy,
        qconv_copy_f8: cute.TiledCopy,
        qconv_copy_f16: cute.TiledCopy,
        tiled_mma_s: cute.TiledMma,
        tiled_mma_o: cute.TiledMma,
        SharedStorage: cutlass.Constexpr,
    ):
        R = self.num_rows
        H = self.num_heads
        P = self.page_size
        T = self.tile_tokens
        C = self.chunk
        ROWS = self.rows
        NS = self.num_stages
        NT = self.num_threads
        TPR = self.tpr
        KG = self.s_k_groups
        PIECES = KV_DIM // 16  # 16-byte pieces per token row

        tidx, _, _ = cute.arch.thread_idx()
        cta, rb, _ = cute.arch.block_idx()
        row0 = rb * ROWS

        q_scale = mQScale[0]
        k_scale = mKScale[0]
        scale_log2 = scale_log2_base * q_scale * k_scale

        # ---- shared memory ----
        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(SharedStorage)
        sRing = storage.ring.get_tensor(
            cute.make_layout((16, PIECES, C, NS), stride=(1, 16, KV_DIM, C * KV_DIM)))
        sRingMN = storage.ring.get_tensor(
            cute.make_layout((C, KV_DIM, NS), stride=(KV_DIM, 1, C * KV_DIM)))
        sKV = storage.kv16.get_tensor(sKV16_layout)  # (C, 576) f16
        sQ = storage.q16.get_tensor(sQ16_layout)  # (ROWS, 576) f16
        # Q's FP8 staging aliases the f16 KV tile (ROWS x 576 B <= C x 1152 B); used only between segments.
        q8_ptr = cute.recast_ptr(storage.kv16.data_ptr(), dtype=FP8)
        sQ8 = cute.make_tensor(q8_ptr, cute.make_layout((16, PIECES, ROWS), stride=(1, 16, KV_DIM)))
        sQ8MN = cute.make_tensor(q8_ptr, cute.make_layout((ROWS, KV_DIM), stride=(KV_DIM, 1)))
        sS = storage.s.get_tensor(
            cute.make_layout((ROWS, C, KG), stride=(self.s_stride, 1, ROWS * self.s_stride)))
        sP = storage.p.get_tensor(sP_layout)  # (ROWS, C) f16
        sAlpha = storage.alpha.get_tensor(cute.make_layout((ROWS,)))
        sInvL = storage.inv_l.get_tensor(cute.make_layout((ROWS,)))
        # V^T view of the f16 tile: (512, C), element (d, n) = sKV[n, d].
        sVt = cute.composition(sKV, cute.make_layout((V_DIM, C), stride=(C, 1)))

        # ---- conversion partitions ----
        thr_conv8 = conv_copy_f8.get_slice(tidx)
        thr_conv16 = conv_copy_f16.get_slice(tidx)
        tCsKV = thr_conv16.partition_D(sKV)
        tCrKV = cute.make_fragment_like(tCsKV, Float16)
        q_conv_threads = min(ROWS, NT // 8) * 8
        qtid = tidx % q_conv_threads
        thr_qconv8 = qconv_copy_f8.get_slice(qtid)
        thr_qconv16 = qconv_copy_f16.get_slice(qtid)
        tQCs8 = thr_qconv8.partition_S(sQ8MN)
        tQCs16 = thr_qconv16.partition_D(sQ)
        tQCr = cute.make_fragment_like(tQCs16, Float16)

        # ---- S = Q.K^T partitions: group kg of S_WARPS_N warps handles K steps [kg*KPG, (kg+1)*KPG) ----
        s_group_threads = self.s_warps_n * 32
        gtid = tidx % s_group_threads
        kg = tidx // s_group_threads
        thr_mma_s = tiled_mma_s.get_slice(gtid)
        tSrQ = thr_mma_s.make_fragment_A(thr_mma_s.partition_A(sQ))
        tSrK = thr_mma_s.make_fragment_B(thr_mma_s.partition_B(sKV))
        acc_shape_S = thr_mma_s.partition_shape_C((ROWS, C))
        ldsm_q = cute.make_tiled_copy_A(
            cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=False, num_matrices=4), Float16), tiled_mma_s)
        ldsm_k = cute.make_tiled_copy_B(
            cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=False, num_matrices=4), Float16), tiled_mma_s)
        thr_ldsm_q = ldsm_q.get_slice(gtid)
        thr_ldsm_k = ldsm_k.get_slice(gtid)
        tSsQ = thr_ldsm_q.partition_S(sQ)
        tSrQ_v = thr_ldsm_q.retile(tSrQ)
        tSsK = thr_ldsm_k.partition_S(sKV)
        tSrK_v = thr_ldsm_k.retile(tSrK)

        # ---- O += P.V partitions ----
        thr_mma_o = tiled_mma_o.get_slice(tidx)
        tOrP = thr_mma_o.make_fragment_A(thr_mma_o.partition_A(sP))
        tOrV = thr_mma_o.make_fragment_B(thr_mma_o.partition_B(sVt))
        acc_O = cute.make_rmem_tensor(thr_mma_o.partition_shape_C((ROWS, V_DIM)), Float32)
        ldsm_p = cute.make_tiled_copy_A(
            cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=False, num_matrices=4), Float16), tiled_mma_o)
        ldsm_v = cute.make_tiled_copy_B(
            cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=True, num_matrices=4), Float16), tiled_mma_o)
        thr_ldsm_p = ldsm_p.get_slice(tidx)
        thr_ldsm_v = ldsm_v.get_slice(tidx)
        tOsP = thr_ldsm_p.partition_S(sP)
        tOrP_v = thr_ldsm_p.retile(tOrP)
        tOsV = thr_ldsm_v.partition_S(sVt)
        tOrV_v = thr_ldsm_v.retile(tOrV)
        # row/column coordinates of this thread's O accumulators
        cO = cute.make_identity_tensor((ROWS, V_DIM))
        tOcO = thr_mma_o.partition_C(cO)
        acc_O_mn = self._mn_view(acc_O)
        tOcO_mn = self._mn_view(tOcO)

        # ---- softmax ownership: TPR consecutive threads per row ----
        srow = tidx // TPR
        ssub = tidx % TPR
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
            while mReqTileStart[b + 1] <= g:  # requests without tiles own an empty range
                b = b + 1
            req_first_tile = mReqTileStart[b]
            seg_end = cutlass.min(g_end, mReqTileStart[b + 1])
            seq_len = mSeq[b]
            tok_begin = (g - req_first_tile) * T
            tok_end = cutlass.min((seg_end - req_first_tile) * T, seq_len)
            if cutlass.const_expr(self.causal):
                # no row of this block sees past L - q_len + t_last
                tok_end = cutlass.min(tok_end, seq_len - self.q_len + t_last + 1)
            n_chunks = cutlass.max(tok_end - tok_begin + (C - 1), 0) // C

            # ---- Q of request b: cp.async into the FP8 staging (aliases sKV), padding rows zeroed ----
            for i in cutlass.range_constexpr((ROWS * PIECES + NT - 1) // NT):
                idx = tidx + i * NT
                qrow = idx // PIECES
                qpc = idx % PIECES
                if idx < ROWS * PIECES:
                    if row0 + qrow < R:
                        cute.copy(atom_cp_async, mQ[None, qpc, row0 + qrow, b], sQ8[None, qpc, qrow])
                    else:
                        cute.autovec_copy(zero16, sQ8[None, qpc, qrow])
            cute.arch.cp_async_commit_group()

            # ---- prologue: the first NS chunks ----
            for st in cutlass.range_constexpr(NS):
                if st < n_chunks:
                    self._load_chunk(mKV, mBT, atom_cp_async, sRing, zero16, b, tok_begin + st * C, tok_end,
                                     st, tidx)
                cute.arch.cp_async_commit_group()

            # ---- Q: FP8 -> f16 ----
            cute.arch.cp_async_wait_group(NS)
            cute.arch.barrier()
            if tidx < q_conv_threads:
                tQCr.store(tQCs8.load().to(Float16))
                cute.copy(qconv_copy_f16, tQCr, tQCs16)

            # ---- per-segment state ----
            acc_O.fill(0.0)
            row_max = -Float32.inf  # base-2, scaled
            row_sum = Float32(0.0)  # this thread's copy, identical across the row's TPR threads

            for ci in range(n_chunks):
                stage = ci % NS
                chunk_tok0 = tok_begin + ci * C
                cute.arch.cp_async_wait_group(NS - 1)
                cute.arch.barrier()  # chunk landed; previous P.V done with sKV/sP
                # ---- FP8 ring stage -> f16 tile ----
                tCsR = thr_conv8.partition_S(sRingMN[None, None, stage])
                tCrKV.store(tCsR.load().to(Float16))
                cute.copy(conv_copy_f16, tCrKV, tCsKV)
                cute.arch.barrier()  # f16 tile ready; the ring stage is free
                if ci + NS < n_chunks:
                    self._load_chunk(mKV, mBT, atom_cp_async, sRing, zero16, b, chunk_tok0 + NS * C, tok_end,
                                     stage, tidx)
                cute.arch.cp_async_commit_group()

                # ---- S partials: group kg covers its K slice ----
                acc_S = cute.make_rmem_tensor(acc_shape_S, Float32)
                acc_S.fill(0.0)
                kpg = self.k_steps // KG
                for grp in cutlass.range_constexpr(KG):
                    if kg == grp:
                        for kk in cutlass.range_constexpr(kpg):
                            k = grp * kpg + kk
                            cute.copy(ldsm_q, tSsQ[None, None, k], tSrQ_v[None, None, k])
                            cute.copy(ldsm_k, tSsK[None, None, k], tSrK_v[None, None, k])
                            cute.gemm(tiled_mma_s, acc_S, tSrQ[None, None, k], tSrK[None, None, k], acc_S)
                tSsS = thr_mma_s.partition_C(sS[None, None, kg])
                cute.autovec_copy(acc_S, tSsS)
                cute.arch.barrier()

                # ---- online softmax over the chunk ----
                row_end = tok_end
                if cutlass.const_expr(self.causal):
                    row_end = cutlass.min(tok_end, seq_len - self.q_len + s_t + 1)
                vals = cute.make_rmem_tensor(cute.make_layout((C // TPR,)), Float32)
                cmax = -Float32.inf
                for i in cutlass.range_constexpr(C // TPR):
                    n = i * TPR + ssub
                    s = sS[srow, n, 0]
                    for grp in cutlass.range_constexpr(1, KG):
                        s = s + sS[srow, n, grp]
                    s = s * scale_log2
                    if chunk_tok0 + n >= row_end:
                        s = -Float32.inf
                    vals[i] = s
                    cmax = cute.arch.fmax(cmax, s)
                cmax = self._row_allreduce(cmax, True)
                new_max = cute.arch.fmax(row_max, cmax)
                use_max = new_max
                if new_max == -Float32.inf:
                    use_max = Float32(0.0)
                alpha = cute.math.exp2(row_max - use_max, fastmath=True)
                csum = Float32(0.0)
                for i in cutlass.range_constexpr(C // TPR):
                    n = i * TPR + ssub
                    pv = cute.math.exp2(vals[i] - use_max, fastmath=True)
                    csum = csum + pv
                    sP[srow, n] = pv.to(Float16)
                csum = self._row_allreduce(csum, False)
                row_sum = row_sum * alpha + csum
                row_max = new_max
                if ssub == 0:
                    sAlpha[srow] = alpha
                cute.arch.barrier()

                # ---- O = alpha * O + P.V ----
                for r in cutlass.range_constexpr(cute.size(acc_O_mn, mode=[0])):
                    a = sAlpha[tOcO_mn[r, 0][0]]
                    acc_O_mn[r, None] = acc_O_mn[r, None].load() * a
                cute.copy(ldsm_p, tOsP[None, None, 0], tOrP_v[None, None, 0])
                cute.copy(ldsm_v, tOsV[None, None, 0], tOrV_v[None, None, 0])
                for k in cutlass.range_constexpr(cute.size(tOsP.shape[2])):
                    if cutlass.const_expr(k + 1 < cute.size(tOsP.shape[2])):
                        cute.copy(ldsm_p, tOsP[None, None, k + 1], tOrP_v[None, None, k + 1])
                        cute.copy(ldsm_v, tOsV[None, None, k + 1], tOrV_v[None, None, k + 1])
                    cute.gemm(tiled_mma_o, acc_O, tOrP[None, None, k], tOrV[None, None, k], acc_O)

            cute.arch.cp_async_wait_group(0)

            # ---- epilogue of the segment ----
            split = mNumSplits[b] != 1
            slot = mSplitOffset[b] + cta - mReqFirstCta[b]
            if ssub == 0:
                inv_l = Float32(0.0)
                lse = -Float32.inf
                if row_sum > Float32(0.0):
                    inv_l = k_scale / row_sum
                    lse = (row_max + cute.math.log2(row_sum, fastmath=True)) * LN2
                sInvL[srow] = inv_l
                if srow_g < R:
                    if split:
                        mPLse[srow_g, slot] = lse
                    else:
                        mLse[srow_g, b] = lse
            cute.arch.barrier()
            for r in cutlass.range_constexpr(cute.size(acc_O_mn, mode=[0])):
                orow = tOcO_mn[r, 0][0]
                if row0 + orow < R:
                    inv = sInvL[orow]
                    if split:
                        for cc in cutlass.range_constexpr(cute.size(acc_O_mn, mode=[1])):
                            mPOut[tOcO_mn[r, cc][1], row0 + orow, slot] = acc_O_mn[r, cc] * inv
                    else:
                        for cc in cutlass.range_constexpr(cute.size(acc_O_mn, mode=[1])):
                            mOut[tOcO_mn[r, cc][1], row0 + orow, b] = (acc_O_mn[r, cc] * inv).to(BF16)
            cute.arch.barrier()  # sInvL / sQ8 staging reused by the next segment

            g = seg_end
            b = b + 1

    # ------------------------------------------------------------------------------------------------
    @cute.jit
    def _load_chunk(self, mKV: cute.Tensor, mBT: cute.Tensor, atom_cp_async: cute.CopyAtom, sRing: cute.Tensor,
                    zero16: cute.Tensor, b: Int32, tok0: Int32, tok_end: Int32, stage: Int32, tidx: Int32):
        """cp.async the tokens [tok0, tok0 + C) of request b into ring stage `stage`; tokens >= tok_end are
        zero-filled in shared memory and their block-table entries are never read."""
        C = self.chunk
        NT = self.num_threads
        P = self.page_size
        PIECES = KV_DIM // 16
        for i in cutlass.range_constexpr((C * PIECES + NT - 1) // NT):
            idx = tidx + i * NT
            n = idx // PIECES
            pc = idx % PIECES
            if cutlass.const_expr((C * PIECES) % NT == 0):
                self._load_piece(mKV, mBT, atom_cp_async, sRing, zero16, b, tok0 + n, tok_end, n, pc, stage)
            else:
                if idx < C * PIECES:
                    self._load_piece(mKV, mBT, atom_cp_async, sRing, zero16, b, tok0 + n, tok_end, n, pc,
                                     stage)

    @cute.jit
    def _load_piece(self, mKV: cute.Tensor, mBT: cute.Tensor, atom_cp_async: cute.CopyAtom, sRing: cute.Tensor,
                    zero16: cute.Tensor, b: Int32, tok: Int32, tok_end: Int32, n: Int32, pc: Int32, stage: Int32):
        P = self.page_size
        if tok < tok_end:
            page = mBT[tok // P, b]
            cute.copy(atom_cp_async, mKV[None, pc, tok % P, page], sRing[None, pc, n, stage])
        else:
            cute.autovec_copy(zero16, sRing[None, pc, n, stage])

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

    def _mn_view(self, acc: cute.Tensor) -> cute.Tensor:
        """((2 vals, 2 rows), M, N) accumulator fragment of m16n8 MMAs as a (rows, cols) view."""
        col_major = cute.make_layout(acc.layout.shape)
        mn = cute.make_layout(
            ((col_major.shape[0][1], col_major.shape[1]), (col_major.shape[0][0], col_major.shape[2])),
            stride=((col_major.stride[0][1], col_major.stride[1]), (col_major.stride[0][0], col_major.stride[2])),
        )
        return cute.make_tensor(acc.iterator, cute.composition(acc.layout, mn))


# ====================================================================================================
# Compilation cache and launcher
# ====================================================================================================

_COMPILED = {}


def _static_key(num_heads, q_len, page_size, tile_tokens, causal, rows_per_block, chunk_tokens, num_warps,
                num_stages, arch):
    rows = rows_per_block or default_rows_per_block(num_heads, q_len)
    return (int(num_heads), int(q_len), int(page_size), int(tile_tokens), bool(causal), int(rows),
            int(chunk_tokens), int(num_warps), int(num_stages), arch)


def compile_decode_sm90(num_heads: int, q_len: int, page_size: int, tile_tokens: int = 64, causal: bool = True,
                        rows_per_block: Optional[int] = None, chunk_tokens: int = 64, num_warps: int = 8,
                        num_stages: int = 2, arch: str = "sm_90a"):
    """Compile (once per static key) and return the kernel's launcher function.

    Works without a GPU: all runtime values (pointers, batch, num_pages, strides, num_ctas, num_slots,
    softmax_scale, stream) are runtime arguments of the compiled function, so one compile serves every batch
    size / cache size / plan size. `arch` is passed to the compiler (`--gpu-arch`).
    """
    key = _static_key(num_heads, q_len, page_size, tile_tokens, causal, rows_per_block, chunk_tokens, num_warps,
                      num_stages, arch)
    fn = _COMPILED.get(key)
    if fn is not None:
        return fn
    import cuda.bindings.driver as cuda
    from cutlass.cute.runtime import make_ptr

    op = MLADecodeSM90(num_heads, q_len, page_size, tile_tokens, causal, rows_per_block=key[5],
                       chunk_tokens=chunk_tokens, num_warps=num_warps, num_stages=num_stages)
    gmem = cute.AddressSpace.gmem
    base = 1 << 20

    def ptr(dtype, align):
        return make_ptr(dtype, base, gmem, assumed_align=align)

    args = (
        ptr(FP8, 16), ptr(FP8, 16), ptr(Int32, 4), ptr(Int32, 4), ptr(Float32, 4), ptr(Float32, 4),
        ptr(Int32, 4), ptr(Int32, 4), ptr(Int32, 4), ptr(Int32, 4), ptr(Int32, 4), ptr(Int32, 4),
        ptr(BF16, 16), ptr(Float32, 4), ptr(Float32, 16), ptr(Float32, 4),
        Int32(1), Int32(1), Int32(1), Int32(1), Int32(1), Int32(1), Int32(1), Float32(1.0),
        cuda.CUstream(0),
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
                    rows_per_block: Optional[int] = None):
    """Launch the split-KV decode on torch CUDA tensors (no host sync, no allocation: CUDA-graph safe).

    q fp8 [B, q_len, H, 576] contiguous; kv_cache fp8 [num_pages, page_size, 576] (or [.., 1, 576]) with
    unit stride on the 576 bytes, row stride 576 and a page stride that is a multiple of 16 bytes;
    block_table int32 [B, max_pages] with unit column stride; seq_lens int32 [B]; q_scale/k_scale float32 [1]
    on the device; plan a `SplitPlan` (its six int32 tensors are read on the device only); out bf16
    [B, q_len, H, 512], lse fp32 [B, q_len, H], partial_out fp32 [num_slots, q_len, H, 512], partial_lse fp32
    [num_slots, q_len, H], all contiguous. `stream` is a torch.cuda.Stream (default: the current stream).
    """
    import torch
    import cuda.bindings.driver as cuda
    from cutlass.cute.runtime import make_ptr

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
    fn = compile_decode_sm90(num_heads, q_len, page_size, tile, causal, rows_per_block)
    num_ctas = cta_first_request.shape[0]
    max_batch = num_splits.shape[0]
    num_slots = partial_lse.shape[0]
    if stream is None:
        stream = torch.cuda.current_stream(q.device)
    gmem = cute.AddressSpace.gmem
    fn(
        make_ptr(FP8, q.data_ptr(), gmem, assumed_align=16),
        make_ptr(FP8, kv_cache.data_ptr(), gmem, assumed_align=16),
        make_ptr(Int32, block_table.data_ptr(), gmem, assumed_align=4),
        make_ptr(Int32, seq_lens.data_ptr(), gmem, assumed_align=4),
        make_ptr(Float32, q_scale.data_ptr(), gmem, assumed_align=4),
        make_ptr(Float32, k_scale.data_ptr(), gmem, assumed_align=4),
        make_ptr(Int32, cta_tile_start.data_ptr(), gmem, assumed_align=4),
        make_ptr(Int32, cta_first_request.data_ptr(), gmem, assumed_align=4),
        make_ptr(Int32, request_tile_start.data_ptr(), gmem, assumed_align=4),
        make_ptr(Int32, request_first_cta.data_ptr(), gmem, assumed_align=4),
        make_ptr(Int32, num_splits.data_ptr(), gmem, assumed_align=4),
        make_ptr(Int32, split_offset.data_ptr(), gmem, assumed_align=4),
        make_ptr(BF16, out.data_ptr(), gmem, assumed_align=16),
        make_ptr(Float32, lse.data_ptr(), gmem, assumed_align=4),
        make_ptr(Float32, partial_out.data_ptr(), gmem, assumed_align=16),
        make_ptr(Float32, partial_lse.data_ptr(), gmem, assumed_align=4),
        Int32(batch), Int32(num_pages), Int32(kv_cache.stride(0) // 16), Int32(block_table.stride(0)),
        Int32(num_ctas), Int32(max_batch), Int32(max(num_slots, 1)), Float32(float(softmax_scale)),
        cuda.CUstream(stream.cuda_stream),
    )
