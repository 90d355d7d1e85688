"""Paged KV (and Q) into shared memory for the SM90 decode kernels: block-table lookups, 16-byte cp.async copies
and TMA boxes.

KV is gathered through the block table into a ring of chunks of 64 tokens, in the K-major 128B-swizzled layout
wgmma reads (`decode_layout`), by one of two paths:

- 16-byte cp.async: thread t of a 256-thread group copies token t / 4, pieces t % 4 + 4i. Tokens past the segment
  end are zero-filled in shared memory (never loaded).
- TMA (`decode_swg_tma.py`): one thread issues, per half chunk of 32 tokens (which never crosses a page), five
  boxes of 128 bytes x 32 tokens of the cache viewed as (576 bytes, page_size tokens, pages); the fifth box starts
  at the rope (byte 512) and its last 64 bytes lie past the row, which the TMA unit fills with zeros, as it fills
  every box whose page is not a page of the cache (-1 past the segment end, or a bad entry). The box's bytes land
  in the same swizzled layout the cp.async path writes. Tokens of a loaded page past the segment end are zeroed
  by the threads after the chunk lands (`_zero_tail_tokens`), so their bytes never reach P.V.

Either way the block table is never read past ceil(L_b / page_size), and whatever the metadata (unchecked inside
CUDA graphs), page indices are clamped to the table's width and entries outside the cache are never read.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32

from cutlass import Int64
from cutlass.cute.nvgpu import cpasync

from ..shapes import KV_DIM
from .decode_layout import CHUNK, KV_BLOCKS, PIECES, swizzle128
from .ptx import cp_async_16_l2_128

HALF = CHUNK // 2  # tokens per TMA box: a half chunk, which never crosses a page (pages of 32 or 64)
TMA_BOX_BYTES = 128 * HALF
TMA_CHUNK_BYTES = 2 * KV_BLOCKS * TMA_BOX_BYTES  # what one chunk's boxes write (their zero fill included)


class PagedKVLoads:
    """Mixin of the decode kernels (`decode_common.MLADecodeSM90`): needs self.cfg and self.l2_prefetch_copies."""

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
            page = mBT[cutlass.min(tok // self.cfg.page_size, cute.size(mBT, mode=[0]) - 1), b]
        return page

    @cute.jit
    def _load_chunk(self, mKV: cute.Tensor, atom_cp_async: cute.CopyAtom, sRing: cute.Tensor, zero16: cute.Tensor,
                    page: Int32, tok0: Int32, stage: Int32, tidx: Int32, token_offset: cutlass.Constexpr = 0):
        """cp.async this thread's share of the chunk [tok0, tok0 + C) of a request into ring stage `stage`: token
        tidx / 4 + token_offset of the chunk (on `page`), zero-filled in shared memory when page is not a page of
        the cache: -1 from `_lookup_page` (no KV) or a bad block-table entry, which is never read.

        Thread t copies 16-byte pieces t % 4 + 4i (i < 9): addresses that differ by constants (no per-piece
        address registers), and per instruction 64 contiguous bytes of each of a warp's 8 tokens. 256 threads
        cover a chunk; one warpgroup covers it in two calls, with token_offset 0 and C / 2.

        The ping-pong schedule (16 rows, memory-bound) copies with the L2::128B prefetch hint, so an L2 miss
        fetches the whole 128-byte line at once instead of the 64 bytes a warp's copy touches in each of 8
        token rows. H200, decode alone, one process: H12 q1 1M x B1 165.2 -> 161.1 us, 128K x B4 90.5 -> 86.9,
        1M x B4 610.0 -> 598.1 (L2::256B: 163.4, 87.5, 601.5); as steps (L2 emptied first) 4-13%: 1M x B1 174.0
        -> 157.5, 128K x B4 99.9 -> 88.1. The S^T warpgroup's copies with it: q_len 8 steps 3-4% slower (1M x B1
        394.8 -> 406.8), 32 and 64 rows 0-1.5% faster, so that schedule keeps CuTe's plain cp.async."""
        P = self.cfg.page_size
        n = tidx // 4 + token_offset
        tok = tok0 + n
        if cutlass.const_expr(not self.cfg.runs("load")):
            self._zero_piece_rows(sRing, zero16, n, stage, tidx)  # research build: nothing read
        elif page >= 0 and page < cute.size(mKV, mode=[3]):
            for i in cutlass.range_constexpr(PIECES // 4):
                pc = tidx % 4 + 4 * i
                if cutlass.const_expr(self.l2_prefetch_copies):
                    # the ring's swizzled byte address (decode_layout), and the L2::128B prefetch hint
                    s_addr = (sRing.iterator.toint() + stage * (CHUNK * 128 * KV_BLOCKS)
                              + (pc // 8) * (CHUNK * 128) + n * 128 + (((pc % 8) ^ (n % 8)) * 16))
                    cp_async_16_l2_128(s_addr, mKV[None, pc, tok % P, page].iterator.toint())
                else:
                    cute.copy(atom_cp_async, mKV[None, pc, tok % P, page], sRing[None, pc, n, stage])
        else:
            self._zero_piece_rows(sRing, zero16, n, stage, tidx)

    @cute.jit
    def _zero_piece_rows(self, sRing: cute.Tensor, zero16: cute.Tensor, n: Int32, stage: Int32, tidx: Int32):
        """Zeros for this thread's pieces of token n of ring stage `stage` (a token that is not loaded)."""
        for i in cutlass.range_constexpr(PIECES // 4):
            cute.autovec_copy(zero16, sRing[None, tidx % 4 + 4 * i, n, stage])

    @cute.jit
    def _load_chunk_wg(self, mBT: cute.Tensor, mKV: cute.Tensor, atom_cp_async: cute.CopyAtom, sRing: cute.Tensor,
                       zero16: cute.Tensor, b: Int32, tok0: Int32, tok_end: Int32, stage: Int32, tw: Int32):
        """One warpgroup's copies of the chunk [tok0, tok0 + C) into `stage`: two halves of 32 tokens."""
        self._load_chunk(mKV, atom_cp_async, sRing, zero16, self._lookup_page(mBT, b, tok0, tok_end, tw), tok0,
                         stage, tw)
        self._load_chunk(mKV, atom_cp_async, sRing, zero16,
                         self._lookup_page(mBT, b, tok0 + CHUNK // 2, tok_end, tw), tok0, stage, tw, CHUNK // 2)

    @cute.jit
    def _load_q_rows(self, mQ: cute.Tensor, atom_cp_async: cute.CopyAtom, sQ8: cute.Tensor, zero16: cute.Tensor,
                     row0: Int32, qrow: Int32, tidx: Int32, b: Int32):
        """cp.async row qrow of this block's Q (pieces tidx % 4 + 4k of request b's row row0 + qrow), or zeros
        for a padding row past the request's query rows."""
        if row0 + qrow < self.cfg.num_rows:
            for k in cutlass.range_constexpr(PIECES // 4):
                cute.copy(atom_cp_async, mQ[None, tidx % 4 + 4 * k, row0 + qrow, b], sQ8[None, tidx % 4 + 4 * k, qrow])
        else:
            for k in cutlass.range_constexpr(PIECES // 4):
                cute.autovec_copy(zero16, sQ8[None, tidx % 4 + 4 * k, qrow])

    # ----------------------------------------------------------------------------------------------- TMA path
    @cute.jit
    def _make_kv_tma(self, p_kv: cute.Pointer, num_pages: Int32, page_stride: Int64):
        """(host side) The TMA atom and coordinate tensor of the cache viewed as (576 bytes, page_size tokens,
        pages), for boxes of 128 bytes x HALF tokens in the ring's 128B swizzle."""
        mKV3 = cute.make_tensor(p_kv, cute.make_layout((KV_DIM, self.cfg.page_size, num_pages),
                                                       stride=(1, KV_DIM, page_stride)))
        box = cute.make_composed_layout(swizzle128(), 0, cute.make_layout((128, HALF), stride=(1, 128)))
        return cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), mKV3, box, (128, HALF))

    @cute.jit
    def _kv_tma_partitions(self, tma_atom: cute.CopyAtom, tma_kv: cute.Tensor, ring_ptr: cute.Pointer):
        """(box, block, half, page) of the cache and (box, (block, half, stage)) of the ring, for `cute.copy`."""
        C = CHUNK
        ring_boxes = cute.make_tensor(ring_ptr, cute.make_composed_layout(swizzle128(), 0, cute.make_layout(
            ((128, HALF), (KV_BLOCKS, 2, self.cfg.num_stages)),
            stride=((1, 128), (C * 128, HALF * 128, C * 128 * KV_BLOCKS)))))
        g_boxes = cute.local_tile(tma_kv, (128, HALF), (None, None, None))
        t_ring, t_cache = cpasync.tma_partition(tma_atom, 0, cute.make_layout(1), cute.group_modes(ring_boxes, 0, 1),
                                                cute.group_modes(g_boxes, 0, 2))
        return t_cache, t_ring

    @cute.jit
    def _lookup_chunk_pages(self, mBT: cute.Tensor, b: Int32, tok0: Int32, tok_end: Int32):
        """(TMA path) The block-table entries of the two halves of the chunk [tok0, tok0 + C) of request b
        (`_lookup_page` of each half's first token: -1 at or past tok_end)."""
        return self._lookup_page(mBT, b, tok0, tok_end, 0), self._lookup_page(mBT, b, tok0 + HALF, tok_end, 0)

    @cute.jit
    def _issue_chunk_tma(self, tma_atom: cute.CopyAtom, t_cache: cute.Tensor, t_ring: cute.Tensor, bar: cute.Pointer,
                         page_a: Int32, page_b: Int32, tok0: Int32, stage: Int32):
        """(one whole warp: CuTe's TMA copy elects one of its lanes) The chunk [tok0, tok0 + C) into ring stage
        `stage`: its halves on page_a and page_b (-1 past the segment end: zero-filled), completing on the stage's
        mbarrier `bar`, whose one arrival (with the chunk's bytes) lane 0 makes first. (A research build without
        loads only arrives on it.)"""
        P = self.cfg.page_size
        lane = cute.arch.lane_idx()
        if cutlass.const_expr(not self.cfg.runs("load")):
            if lane == 0:
                cute.arch.mbarrier_arrive(bar)
        else:
            if lane == 0:
                cute.arch.mbarrier_arrive_and_expect_tx(bar, TMA_CHUNK_BYTES)
            for h in cutlass.range_constexpr(2):
                page = page_a if h == 0 else page_b
                y = ((tok0 + h * HALF) % P) // HALF
                for kb in cutlass.range_constexpr(KV_BLOCKS):
                    cute.copy(tma_atom, t_cache[None, kb, y, page], t_ring[None, (kb, h, stage)], tma_bar_ptr=bar)

    @cute.jit
    def _zero_tail_tokens(self, sRing: cute.Tensor, zero16: cute.Tensor, n0: Int32, stage: Int32, tidx: Int32,
                          nthreads: cutlass.Constexpr):
        """Zeros over tokens [n0, C) of ring stage `stage` (a chunk that ends inside a loaded page), by `nthreads`
        threads: 16-byte pieces of all KV_BLOCKS blocks. The caller fences them for the async proxy."""
        npieces = 8 * KV_BLOCKS
        for i in range(tidx, (CHUNK - n0) * npieces, nthreads):
            cute.autovec_copy(zero16, sRing[None, i % npieces, n0 + i // npieces, stage])
