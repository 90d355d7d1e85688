"""Paged KV (and Q) into shared memory for the SM90 decode kernels: block-table lookups and 16-byte cp.async copies.

KV is gathered through the block table with 16-byte cp.async into a ring of chunks of 64 tokens, in the K-major
128B-swizzled layout wgmma reads (`decode_layout`). Thread t of a 256-thread group copies token t / 4, pieces
t % 4 + 4i. Tokens past the segment end are zero-filled in shared memory (never loaded), so the block table is
never read past ceil(L_b / page_size); whatever the metadata (unchecked inside CUDA graphs), page indices are
clamped to the table's width and entries outside the cache zero-fill instead of loading.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32

from .decode_layout import CHUNK, KV_BLOCKS, PIECES
from .ptx import cp_async_16_l2_128


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
