"""Paged KV (and Q) into shared memory for the SM90 decode kernels: block-table lookups, 16-byte cp.async copies
and TMA boxes.

KV is gathered through the block table into a ring of chunks of 64 tokens, in the K-major 128B-swizzled layout
wgmma reads (`decode_layout`), by one of two paths:

- 16-byte cp.async: thread t of a 256-thread group copies token t / 4, pieces t % 4 + 4i. Tokens past the segment
  end are zero-filled in shared memory (never loaded).
- TMA (`decode_swg_tma.py`): one warp issues boxes of the cache viewed as (576 bytes, page_size tokens, pages):
  with `kv_box_tokens` 32, per half chunk of 32 tokens (which never crosses a page), five boxes of 128 bytes x
  32 tokens; with 64 (pages and tiles of 64, so a chunk is one page's 64 tokens), the four latent blocks as one
  box of 128 bytes x 64 tokens x 4 blocks of the cache viewed as (128 bytes, page_size, 4 blocks, pages), and the
  rope as one 128 x 64 box (with `DecodeConfig.rope_rows` 64 a 64 x 64 box in the 64B swizzle, into the rope's
  block of 64-byte rows). A rope box starts at byte 512; a 128-byte one's last 64 bytes lie past the row, which
  the TMA unit fills with zeros, as it fills every box whose page is not a page of the cache (-1 past the segment
  end, or a bad entry). The boxes' bytes land in the same swizzled layout the cp.async path writes. Tokens of a loaded
  page past the segment end are zeroed by the threads after the chunk lands (`_zero_tail_tokens`), so their
  bytes never reach P.V. Boxes start at chunk starts, which are tile starts: tiles of fewer than 32 tokens load
  by cp.async (`config.default_kv_loads`). The chunk-pairs schedule may also prefetch the chunks a few ahead of
  their boxes into L2 (`DecodeConfig.kv_prefetch`, research; `_prefetch_chunk_l2`), pages of the cache only.

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
from .decode_layout import (CHUNK, KV_BLOCKS, LATENT_BLOCKS, PIECES, ROPE_OFFSET_ROWS, stage_bytes, swizzle64,
                            swizzle128)
from .ptx import cp_async_16_l2_128, prefetch_l2_bulk

HALF = CHUNK // 2  # tokens of a half-chunk TMA box, which never crosses a page (pages of 32 or 64)


class KVBoxes:
    """The TMA boxes' partitioned sources and destinations (`PagedKVLoads._kv_tma_partitions`)."""

    def __init__(self, **values):
        self.__dict__.update(values)


class PagedKVLoads:
    """Mixin of the decode kernels (`decode_common.MLADecodeSM90`): needs self.cfg, self.rows, self.q_rows and
    self.l2_prefetch_copies."""

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
                     row0: Int32, qrow: Int32, tidx: Int32, b: Int32, sQRope=None):
        """cp.async row qrow of this block's Q (pieces tidx % 4 + 4k of request b's row row0 + qrow), or zeros
        for a padding row past the request's query rows; the rope's pieces into sQRope where given
        (`DecodeConfig.rope_rows` 64)."""
        if row0 + qrow < self.cfg.num_rows:
            for k in cutlass.range_constexpr(PIECES // 4):
                cute.copy(atom_cp_async, mQ[None, tidx % 4 + 4 * k, row0 + qrow, b],
                          self._q_piece(sQ8, sQRope, tidx, k, qrow))
        else:
            for k in cutlass.range_constexpr(PIECES // 4):
                cute.autovec_copy(zero16, self._q_piece(sQ8, sQRope, tidx, k, qrow))

    def _q_piece(self, sQ8: cute.Tensor, sQRope, tidx: Int32, k: int, qrow: Int32):
        """Q's 16-byte piece tidx % 4 + 4k of row qrow (the k-th of this thread's 9): in sQ8, or, where the rope
        has a block of 64-byte rows (sQRope given, `DecodeConfig.rope_rows`), the rope's (k = 8) in sQRope."""
        if sQRope is not None and k == PIECES // 4 - 1:
            return sQRope[None, tidx % 4, qrow]
        return sQ8[None, tidx % 4 + 4 * k, qrow]

    @cute.jit
    def _load_q_block(self, cta, tw: Int32, b: Int32):
        """A warpgroup's cp.async of the block's Q rows of request b (thread tw: rows tw / 4 + 32 i, pieces
        tw % 4 + 4 k), padding rows zeroed (past the request's rows, and past the block's rows up to the Q
        buffer's q_rows); the caller commits them."""
        ROWS = self.rows
        QR = self.q_rows
        assert QR == ROWS or QR % 32 == 0, "a padded Q buffer holds whole 32-row groups"
        for i in cutlass.range_constexpr(QR // 32):
            qrow = tw // 4 + 32 * i
            if cutlass.const_expr(32 * (i + 1) <= ROWS):
                self._load_q_rows(cta.mQ, cta.atom_cp_async, cta.sQ8, cta.zero16, cta.row0, qrow, tw, b, cta.sQRope)
            else:
                if qrow < ROWS:
                    self._load_q_rows(cta.mQ, cta.atom_cp_async, cta.sQ8, cta.zero16, cta.row0, qrow, tw, b,
                                      cta.sQRope)
                else:
                    for k in cutlass.range_constexpr(PIECES // 4):
                        cute.autovec_copy(cta.zero16, self._q_piece(cta.sQ8, cta.sQRope, tw, k, qrow))
        if cutlass.const_expr(QR % 32 != 0):
            qrow = tw // 4 + 32 * (QR // 32)
            if qrow < ROWS:
                self._load_q_rows(cta.mQ, cta.atom_cp_async, cta.sQ8, cta.zero16, cta.row0, qrow, tw, b, cta.sQRope)

    # ----------------------------------------------------------------------------------------------- TMA path
    @cute.jit
    def _make_kv_tma(self, p_kv: cute.Pointer, num_pages: Int32, page_stride: Int64):
        """(host side) The TMA atoms and coordinate tensors of the cache, for boxes in the ring's 128B swizzle:
        the cache as (576 bytes, page_size tokens, pages) in boxes of 128 bytes x kv_box_tokens tokens (every
        block with half-chunk boxes, the rope alone with whole-chunk ones; with rope_rows 64 the rope's boxes are 64
        bytes wide, in the 64B swizzle), and for whole-chunk boxes also the
        cache as (128 bytes, page_size tokens, 4 latent blocks, pages) in one box of 128 bytes x 64 tokens x 4
        blocks, which lands in the ring's block-after-block layout (else None, None)."""
        BT = self.cfg.kv_box_tokens
        RR = self.cfg.rope_rows  # 64: the rope's boxes (whole chunks) are 64 bytes wide, in the 64B swizzle
        # with kv_multicast a box lands in both CTAs of the cluster (the issuing one names them in `mcast_mask`)
        op = cpasync.CopyBulkTensorTileG2SMulticastOp() if self.cfg.kv_multicast else cpasync.CopyBulkTensorTileG2SOp()
        mKV3 = cute.make_tensor(p_kv, cute.make_layout((KV_DIM, self.cfg.page_size, num_pages),
                                                       stride=(1, KV_DIM, page_stride)))
        box = cute.make_composed_layout(swizzle128() if RR == 128 else swizzle64(), 0,
                                        cute.make_layout((RR, BT), stride=(1, RR)))
        atom, tensor = cpasync.make_tiled_tma_atom(op, mKV3, box, (RR, BT))
        atom_latent, tensor_latent = None, None
        if cutlass.const_expr(BT == CHUNK):
            mKV4 = cute.make_tensor(p_kv, cute.make_layout((128, self.cfg.page_size, LATENT_BLOCKS, num_pages),
                                                           stride=(1, KV_DIM, 128, page_stride)))
            box4 = cute.make_composed_layout(swizzle128(), 0, cute.make_layout(
                (128, CHUNK, LATENT_BLOCKS), stride=(1, 128, CHUNK * 128)))
            atom_latent, tensor_latent = cpasync.make_tiled_tma_atom(op, mKV4, box4, (128, CHUNK, LATENT_BLOCKS))
        return atom, tensor, atom_latent, tensor_latent

    @cute.jit
    def _kv_tma_partitions(self, cta, ring_ptr: cute.Pointer):
        """The boxes' sources and destinations for `cute.copy`: (box, block, box row, page) of the cache and (box,
        (block, box of the chunk, stage)) of the ring; with whole-chunk boxes also (box, 0, box row, 0, page) of
        the latent view and (box, stage) of the ring."""
        C = CHUNK
        BT = self.cfg.kv_box_tokens
        RR = self.cfg.rope_rows
        if cutlass.const_expr(RR == 128):
            ring_boxes = cute.make_tensor(ring_ptr, cute.make_composed_layout(swizzle128(), 0, cute.make_layout(
                ((128, BT), (KV_BLOCKS, C // BT, self.cfg.num_stages)),
                stride=((1, 128), (C * 128, BT * 128, C * 128 * KV_BLOCKS)))))
        else:  # the rope's box alone (whole chunks): its 64B-swizzled block of each stage
            ring_boxes = cute.make_tensor(ring_ptr + C * ROPE_OFFSET_ROWS, cute.make_composed_layout(
                swizzle64(), 0, cute.make_layout(((RR, BT), (1, 1, self.cfg.num_stages)),
                                                 stride=((1, RR), (0, 0, stage_bytes(RR))))))
        g_boxes = cute.local_tile(cta.tma_kv, (RR, BT), (None, None, None))
        t_ring, t_cache = cpasync.tma_partition(cta.tma_atom, 0, cute.make_layout(1),
                                                cute.group_modes(ring_boxes, 0, 1), cute.group_modes(g_boxes, 0, 2))
        t_ring_latent, t_cache_latent = None, None
        if cutlass.const_expr(BT == CHUNK):
            ring_latent = cute.make_tensor(ring_ptr, cute.make_composed_layout(swizzle128(), 0, cute.make_layout(
                ((128, C, LATENT_BLOCKS), (self.cfg.num_stages,)),
                stride=((1, 128, C * 128), (stage_bytes(RR),)))))
            g_latent = cute.local_tile(cta.tma_latent, (128, C, LATENT_BLOCKS), (None, None, None, None))
            t_ring_latent, t_cache_latent = cpasync.tma_partition(cta.tma_atom_latent, 0, cute.make_layout(1),
                                                                  cute.group_modes(ring_latent, 0, 1),
                                                                  cute.group_modes(g_latent, 0, 3))
        return KVBoxes(t_cache=t_cache, t_ring=t_ring, t_cache_latent=t_cache_latent, t_ring_latent=t_ring_latent)

    @cute.jit
    def _lookup_chunk_pages(self, mBT: cute.Tensor, b: Int32, tok0: Int32, tok_end: Int32):
        """(TMA path) The block-table entries of the two halves of the chunk [tok0, tok0 + C) of request b
        (`_lookup_page` of each half's first token: -1 at or past tok_end); whole-chunk boxes need one page."""
        page_a = self._lookup_page(mBT, b, tok0, tok_end, 0)
        page_b = page_a
        if cutlass.const_expr(self.cfg.kv_box_tokens != CHUNK):
            page_b = self._lookup_page(mBT, b, tok0 + HALF, tok_end, 0)
        return page_a, page_b

    @cute.jit
    def _prefetch_chunk_l2(self, cta, page_a: Int32, page_b: Int32, tok0: Int32):
        """(one thread) The chunk [tok0, tok0 + C) into L2 ahead of its TMA load (`DecodeConfig.kv_prefetch`): its
        tokens on page_a (whole-chunk boxes), or its halves on page_a and page_b, each a contiguous run of the
        cache; nothing for a page that is not one of the cache's (-1 past the segment's end, or a bad entry), so
        no byte outside the cache is touched."""
        P = self.cfg.page_size
        n_pages = cute.size(cta.mKV, mode=[3])
        halves = 1 if self.cfg.kv_box_tokens == CHUNK else 2
        for h in cutlass.range_constexpr(halves):
            page = page_a if h == 0 else page_b
            if page >= 0 and page < n_pages:
                tok = tok0 + h * HALF
                prefetch_l2_bulk(cta.mKV[None, 0, tok % P, page].iterator.toint(), (CHUNK // halves) * KV_DIM)

    @cute.jit
    def _issue_chunk_tma(self, cta, boxes, bar: cute.Pointer, page_a: Int32, page_b: Int32, tok0: Int32,
                         stage: Int32, issue=True):
        """(one whole warp: CuTe's TMA copy elects one of its lanes) The chunk [tok0, tok0 + C) into ring stage
        `stage`: its halves on page_a and page_b (-1 past the segment end: zero-filled; whole-chunk boxes read
        page_a only), completing on the stage's mbarrier `bar`, whose one arrival (with the chunk's bytes) lane 0
        makes first. (A research build without loads only arrives on it; one with `kv_load_copies` 2 issues the
        boxes twice, the same bytes into the same place, and expects both copies' bytes; with `kv_multicast` the
        stage's bytes come from the CTA of the cluster whose turn it is, `issue` in that one: this one only expects
        them.)"""
        copies = self.cfg.kv_load_copies
        lane = cute.arch.lane_idx()
        if cutlass.const_expr(not self.cfg.runs("load")):
            if lane == 0:
                cute.arch.mbarrier_arrive(bar)
        else:
            if lane == 0:
                # what the chunk's boxes write, zero fill included: a ring stage (a copy)
                cute.arch.mbarrier_arrive_and_expect_tx(bar, copies * stage_bytes(self.cfg.rope_rows))
            if issue:
                for _ in cutlass.range_constexpr(copies):
                    self._issue_chunk_boxes(cta, boxes, bar, page_a, page_b, tok0, stage)

    @cute.jit
    def _issue_chunk_boxes(self, cta, boxes, bar: cute.Pointer, page_a: Int32, page_b: Int32, tok0: Int32,
                           stage: Int32):
        """(`_issue_chunk_tma`) The chunk's boxes, once, without the arrival (with `kv_multicast` into both CTAs of
        the cluster, completing on each one's mbarrier at `bar`'s offset)."""
        P = self.cfg.page_size
        BT = self.cfg.kv_box_tokens
        mc = {"mcast_mask": cutlass.Int16(0b11)} if self.cfg.kv_multicast else {}
        if cutlass.const_expr(BT == CHUNK):
            y = (tok0 % P) // CHUNK
            cute.copy(cta.tma_atom_latent, boxes.t_cache_latent[None, 0, y, 0, page_a],
                      boxes.t_ring_latent[None, stage], tma_bar_ptr=bar, **mc)
            if cutlass.const_expr(self.cfg.rope_rows == 128):
                cute.copy(cta.tma_atom, boxes.t_cache[None, KV_BLOCKS - 1, y, page_a],
                          boxes.t_ring[None, (KV_BLOCKS - 1, 0, stage)], tma_bar_ptr=bar, **mc)
            else:  # the rope as the ninth 64-byte box of the row
                cute.copy(cta.tma_atom, boxes.t_cache[None, LATENT_BLOCKS * 2, y, page_a],
                          boxes.t_ring[None, (0, 0, stage)], tma_bar_ptr=bar, **mc)
        else:
            for h in cutlass.range_constexpr(2):
                page = page_a if h == 0 else page_b
                y = ((tok0 + h * HALF) % P) // HALF
                for kb in cutlass.range_constexpr(KV_BLOCKS):
                    cute.copy(cta.tma_atom, boxes.t_cache[None, kb, y, page], boxes.t_ring[None, (kb, h, stage)],
                              tma_bar_ptr=bar, **mc)

    @cute.jit
    def _zero_tail_tokens(self, sRing: cute.Tensor, zero16: cute.Tensor, n0: Int32, stage: Int32, tidx: Int32,
                          nthreads: cutlass.Constexpr, sRingRope=None):
        """Zeros over tokens [n0, C) of ring stage `stage` (a chunk that ends inside a loaded page), by `nthreads`
        threads: 16-byte pieces of all KV_BLOCKS blocks, or where the rope has a block of 64-byte rows
        (`DecodeConfig.rope_rows`) the latent's 32 pieces in sRing and the rope's 4 in sRingRope. The caller fences
        them for the async proxy."""
        if cutlass.const_expr(sRingRope is None):
            npieces = 8 * KV_BLOCKS
            for i in range(tidx, (CHUNK - n0) * npieces, nthreads):
                cute.autovec_copy(zero16, sRing[None, i % npieces, n0 + i // npieces, stage])
        else:
            for i in range(tidx, (CHUNK - n0) * PIECES, nthreads):
                pc = i % PIECES
                if pc < LATENT_BLOCKS * 8:
                    cute.autovec_copy(zero16, sRing[None, pc, n0 + i // PIECES, stage])
                else:
                    cute.autovec_copy(zero16, sRingRope[None, pc - LATENT_BLOCKS * 8, n0 + i // PIECES, stage])
