"""What the SM90 decode schedules share: the launch, the kernel's opening, and the walk over a CTA's segments.

Grid (num_row_blocks, num_ctas). CTA (rb, c) walks the global KV tiles [cta_tile_start[c], cta_tile_start[c+1]) of
the split plan (`mla_backend.plan`), cut into segments = (request b, local tiles [t0, t1)). For each segment it
attends the query rows [rb*ROWS, rb*ROWS + ROWS) of request b (row r = t*H + h of q[b].view(R, 576)) over the tokens
[t0*T, min(t1*T, L_b)), with causal masking j <= L_b - q_len + t, and writes either the final bf16 output and
natural-log lse (num_splits[b] == 1) or an fp16 partial (in units of k_scale) into workspace slot
split_offset[b] + c - request_first_cta[b] (the combine kernel merges those). The row block is the fastest grid
index so that the row blocks of one plan CTA run side by side and read each KV tile from L2 after the first.

A schedule (`decode_rows16.py`, `decode_swg.py`) subclasses `MLADecodeSM90` and implements `_schedule(cta)`, the
CTA's work after the common opening; `cta` (a `CTAContext`) holds the values every schedule reads.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.memory
from cutlass import Float32, Int32, Int64
from cutlass.cute.nvgpu import cpasync

from ..config import TIMELINE_CHUNKS, DecodeConfig
from ..shapes import KV_DIM
from .decode_layout import (CHUNK, FP8, LOG2E, ROPE_OFFSET_ROWS, SM90_SMEM_CAPACITY, SOFTMAX_THREADS, V_DIM,
                            q_layout, q_rope_layout, ring_layout, ring_rope_layout, smem_region_bytes)
from .decode_mma import DecodeMMA
from .epilogue import DecodeEpilogue
from .launch import pdl_prologue
from .paged_kv import PagedKVLoads
from .ptx import fence_proxy_async_smem, sm_clock, store_global_u32
from .softmax import OnlineSoftmax

SMALLEST_NORMAL_F32 = 1.1754943508222875e-38

# timeline builds (config.DecodeConfig.timeline): stamps per chunk, and the plan CTAs (of every row block) stamped
TIMELINE_SLOTS = 32
TIMELINE_CTAS = 4


class CTAContext:
    """The values a schedule reads, made once by the kernel's opening: thread and block indices, the global
    tensors, the scales, the shared-memory storage and the views both schedules use."""

    def __init__(self, **values):
        self.__dict__.update(values)


class MLADecodeSM90(PagedKVLoads, OnlineSoftmax, DecodeMMA, DecodeEpilogue):
    """A decode schedule's static configuration and launch; subclasses set the class attributes below and
    implement `_schedule`."""

    num_threads = SOFTMAX_THREADS
    softmax_pool = SOFTMAX_THREADS  # threads that share one chunk's softmax (a power of two per row is used)
    l2_prefetch_copies = False  # KV copies with the L2::128B prefetch hint (`paged_kv`)
    all_dims_per_warpgroup = False  # each softmax warpgroup accumulates all 512 dims (else half of them)
    s_rows_spread = False  # S^T's buffer rows spread over the banks (`decode_layout.s_logical_row`)
    ring_mbarriers = 1  # mbarriers per ring stage: "chunk landed" (TMA loads), and where 2 also "chunk read"
    launch_bounds: dict = {}
    launch_cluster: dict = {}  # a schedule that runs its CTAs in clusters gives `cluster=` here

    def __init__(self, cfg: DecodeConfig):
        self.cfg = cfg
        self.rows = cfg.rows_per_block
        self.q_rows = self.rows  # rows of the block's Q buffer (a schedule that pads Q to wgmma's M sets more)
        # softmax threads per row: a power of two for the shuffle reductions, so with 48 rows only the first 192
        # threads run the softmax
        self.tpr = 1 << ((self.softmax_pool // self.rows).bit_length() - 1)
        self.softmax_threads = self.tpr * self.rows
        self.words_per_thread = (CHUNK // 4) // self.tpr  # P words (4 tokens) per softmax thread

    def smem_regions(self) -> dict:
        """Bytes of each data region of the CTA's shared memory (`decode_layout.smem_region_bytes`)."""
        return smem_region_bytes(self.rows, self.cfg.num_stages, self.cfg.p_planes)

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
        stream: cuda.CUstream,
    ):
        R = self.cfg.num_rows
        P = self.cfg.page_size
        ROWS = self.rows
        NS = self.cfg.num_stages

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

        region = self.smem_regions()

        @cute.struct
        class SharedStorage:
            ring: cute.struct.Align[cute.struct.MemRange[FP8, region["ring"]], 1024]
            q: cute.struct.Align[cute.struct.MemRange[FP8, region["q"]], 1024]
            # two chunks of full S^T: one per warpgroup (ping-pong) or per buffer (S^T warpgroup)
            s: cute.struct.Align[cute.struct.MemRange[Float32, region["s"] // 4], 128]
            p: cute.struct.Align[cute.struct.MemRange[FP8, region["p"]], 128]
            alpha: cute.struct.Align[cute.struct.MemRange[Float32, region["alpha"] // 4], 16]
            inv_l: cute.struct.Align[cute.struct.MemRange[Float32, region["inv_l"] // 4], 16]
            row_ml: cute.struct.Align[cute.struct.MemRange[Float32, region["row_ml"] // 4], 16]
            # (TMA loads only) a "chunk landed" mbarrier per ring stage, and with ring_mbarriers 2 a "chunk read"
            # one per stage after them
            kv_full: cute.struct.Align[cute.struct.MemRange[Int64, NS * self.ring_mbarriers], 8]

        atom_cp_async = cute.make_copy_atom(
            cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), FP8, num_bits_per_copy=128)

        smem_bytes = SharedStorage.size_in_bytes()
        if cutlass.const_expr(smem_bytes > SM90_SMEM_CAPACITY):
            raise ValueError(f"{smem_bytes} B of shared memory do not fit an SM90 CTA ({SM90_SMEM_CAPACITY} B): "
                             f"lower num_stages or rows_per_block")
        scale_log2 = softmax_scale * LOG2E
        tma_atom, tma_kv, tma_atom_latent, tma_latent = None, None, None, None
        if cutlass.const_expr(self.cfg.kv_loads == "tma"):
            tma_atom, tma_kv, tma_atom_latent, tma_latent = self._make_kv_tma(p_kv, num_pages, page_stride)
        self.kernel(
            mQ, mKV, mBT, mSeq, mQScale, mKScale,
            mCtaTileStart, mCtaFirstReq, mReqTileStart, mReqFirstCta, mNumSplits, mSplitOffset,
            mOut, mLse, mPOut, mPLse, scale_log2, atom_cp_async, tma_atom, tma_kv, tma_atom_latent, tma_latent,
            SharedStorage,
        ).launch(
            grid=(self.cfg.num_row_blocks, num_ctas, 1),
            block=(self.num_threads, 1, 1),
            stream=stream,
            use_pdl=self.cfg.pdl,
            **self.launch_bounds,
            **self.launch_cluster,
        )

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
        tma_atom,
        tma_kv,
        tma_atom_latent,
        tma_latent,
        SharedStorage: cutlass.Constexpr,
    ):
        pdl_prologue(self.cfg.pdl)
        tidx, _, _ = cute.arch.thread_idx()
        rb, cta, _ = cute.arch.block_idx()
        row0 = rb * self.rows
        warp_idx = tidx // 32
        lane = tidx % 32

        q_scale = mQScale[0]
        k_scale = mKScale[0]
        scale_log2 = scale_log2_base * q_scale * k_scale
        # a zero scale (q_scale or k_scale 0: every score 0) would turn a masked score's -inf into 0 x -inf = NaN in
        # the base-2 maxima and in P; the smallest normal float keeps every visible score's P at exp2(~0) = 1 and
        # a masked one's at 0, as the reference's uniform softmax (a NaN scale stays NaN: NaN == 0 is false)
        if scale_log2 == Float32(0.0):
            scale_log2 = Float32(SMALLEST_NORMAL_F32)

        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(SharedStorage)
        if cutlass.const_expr(self.cfg.poison_smem):
            self._poison_smem(storage, tidx)
        zero16 = cute.make_rmem_tensor(cute.make_layout((16,)), FP8)
        zero16.fill(0.0)
        rope_ring = None  # the rope's 64B-swizzled blocks of the ring and Q (`DecodeConfig.rope_rows` 64)
        rope_q = None
        if cutlass.const_expr(self.cfg.rope_rows != 128):
            rope_ring = cute.make_tensor(storage.ring.data_ptr() + CHUNK * ROPE_OFFSET_ROWS,
                                         ring_rope_layout(self.cfg.num_stages))
            rope_q = cute.make_tensor(storage.q.data_ptr() + self.q_rows * ROPE_OFFSET_ROWS,
                                      q_rope_layout(self.q_rows))
        tl_base = None
        tl_on = None
        if cutlass.const_expr(self.cfg.timeline is not None):
            # the stamps go to the workspace's last slot (the timeline tool allocates one spare)
            tl_base = (mPOut.iterator.toint()
                       + Int64(cute.size(mPOut, mode=[2]) - 1) * Int64(self.cfg.num_rows * V_DIM * 2)
                       + Int64((rb * TIMELINE_CTAS + cta) * (TIMELINE_CHUNKS * TIMELINE_SLOTS * 4)))
            tl_on = cta < TIMELINE_CTAS
        self._schedule(CTAContext(
            mQ=mQ, mKV=mKV, mBT=mBT, mSeq=mSeq, mCtaTileStart=mCtaTileStart, mCtaFirstReq=mCtaFirstReq,
            mReqTileStart=mReqTileStart, mReqFirstCta=mReqFirstCta, mNumSplits=mNumSplits, mSplitOffset=mSplitOffset,
            mOut=mOut, mLse=mLse, mPOut=mPOut, mPLse=mPLse, atom_cp_async=atom_cp_async,
            tma_atom=tma_atom, tma_kv=tma_kv, tma_atom_latent=tma_atom_latent, tma_latent=tma_latent,
            tidx=tidx, cta=cta, row0=row0, lane=lane, lg=lane // 4, lt=lane % 4, wg=warp_idx // 4,
            wl=warp_idx % 4, k_scale=k_scale, scale_log2=scale_log2, storage=storage,
            sRing=storage.ring.get_tensor(ring_layout(self.cfg.num_stages, self.cfg.rope_rows)),
            sQ8=storage.q.get_tensor(q_layout(self.q_rows, self.cfg.rope_rows)),
            sRingRope=rope_ring, sQRope=rope_q,
            sInvL=storage.inv_l.get_tensor(cute.make_layout((self.rows,))),
            ring_addr=storage.ring.data_ptr().toint(), q_addr=storage.q.data_ptr().toint(),
            t_last=self._last_query_position(rb),
            zero16=zero16, tl_base=tl_base, tl_on=tl_on))

    @cute.jit
    def _last_query_position(self, rb: Int32) -> Int32:
        """The last query position among row block rb's rows that exist: no row of the block sees a token past
        L - q_len + it (causal trimming of a segment's tokens, `_segment`)."""
        return (cutlass.min((rb + 1) * self.rows, self.cfg.num_rows) - 1) // self.cfg.num_heads

    @cute.jit
    def _poison_smem(self, storage, tidx: Int32):
        """`DecodeConfig.poison_smem`: every data region of the CTA's shared memory filled with 0xFF bytes by all
        its threads, fenced for the async proxy (the TMA copies and wgmmas that come after), before any other
        use."""
        for name, nbytes in self.smem_regions().items():
            words = cute.make_tensor(cute.recast_ptr(getattr(storage, name).data_ptr(), dtype=Int32),
                                     cute.make_layout((nbytes // 4,)))
            for i in range(tidx, nbytes // 4, self.num_threads):
                words[i] = Int32(-1)
        fence_proxy_async_smem()
        cute.arch.barrier()

    @cute.jit
    def _segment(self, mReqTileStart: cute.Tensor, mSeq: cute.Tensor, b: Int32, g: Int32, g_end: Int32,
                 t_last: Int32):
        """The CTA's next segment from global tile g: its request b (the first at or after b with tiles there;
        requests without tiles own an empty range), the segment's end tile, the request's length, its tokens
        [tok_begin, tok_end) (causal: no row of this block sees past L - q_len + t_last) and their chunks."""
        T = self.cfg.tile_tokens
        C = CHUNK
        while mReqTileStart[b + 1] <= g:
            b = b + 1
        req_first_tile = mReqTileStart[b]
        seg_end = cutlass.min(g_end, mReqTileStart[b + 1])
        seq_len = mSeq[b]
        tok_begin = (g - req_first_tile) * T
        tok_end = cutlass.min((seg_end - req_first_tile) * T, seq_len)
        if cutlass.const_expr(self.cfg.causal):
            tok_end = cutlass.min(tok_end, seq_len - self.cfg.q_len + t_last + 1)
        n_chunks = cutlass.max(tok_end - tok_begin + (C - 1), 0) // C
        return b, seg_end, seq_len, tok_begin, tok_end, n_chunks

    @cute.jit
    def _segment_of_row(self, cta: CTAContext, b: Int32, g: Int32, g_end: Int32, srow_g: Int32):
        """`_segment`, and what the softmax row srow_g needs of it: the end of its tokens (`_row_end`), whether the
        request is split, and the workspace slot of this CTA's partial. Returns (b, seg_end, tok_begin, tok_end,
        n_chunks, row_end, split, slot)."""
        b, seg_end, seq_len, tok_begin, tok_end, n_chunks = self._segment(cta.mReqTileStart, cta.mSeq, b, g, g_end,
                                                                          cta.t_last)
        row_end = self._row_end(tok_end, seq_len, srow_g)
        split = cta.mNumSplits[b] != 1
        slot = cta.mSplitOffset[b] + cta.cta - cta.mReqFirstCta[b]
        return b, seg_end, tok_begin, tok_end, n_chunks, row_end, split, slot

    @cute.jit
    def _row_end(self, tok_end: Int32, seq_len: Int32, srow_g: Int32) -> Int32:
        """The end of the tokens query row srow_g sees in its segment (causal: L - q_len + t + 1)."""
        row_end = tok_end
        if cutlass.const_expr(self.cfg.causal):
            row_end = cutlass.min(tok_end, seq_len - self.cfg.q_len + srow_g // self.cfg.num_heads + 1)
        return row_end

    @cute.jit
    def _stamp(self, cta: CTAContext, lead, it: Int32, slot: Int32):
        """Timeline builds only: thread `lead` of a stamped CTA stores the SM clock as event `slot` of chunk `it`
        (chunks [timeline, timeline + TIMELINE_CHUNKS) of the segment)."""
        if cutlass.const_expr(self.cfg.timeline is not None):
            first = self.cfg.timeline
            if cta.tl_on and lead and it >= first and it < first + TIMELINE_CHUNKS:
                store_global_u32(cta.tl_base + Int64(((it - first) * TIMELINE_SLOTS + slot) * 4), sm_clock())
