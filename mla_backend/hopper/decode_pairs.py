"""The SM90 decode for 64-row blocks (the runtime's there) and 48-row ones (research) with S and the softmax in the
P.V warpgroups' registers, two chunks at a time (`DecodeConfig.chunk_pairs`, `config.default_chunk_pairs`).

Why. In the S^T-warpgroup schedule (`decode_swg.py`) a third warpgroup computes S^T and hands it over through
shared memory; the two P.V warpgroups then read it back, run the softmax, load V^T and issue P.V, one chunk after
the other. At 64 rows that chain paces the chunk: ~2900 cycles (timeline, H128), against ~1100 of tensor work and
~1600 of shared-memory traffic (S^T's 16 KB stored and read back included), so neither pipe is busy.

Here warpgroups 0 and 1 take the chunks in pairs, (2p, 2p + 1): warpgroup w computes S = Q.K^T of chunk 2p + w with
the 64 query rows as M (both operands in shared memory unless `q_in_registers`, below; two chains of 9 k32 steps
summed in fp32), and runs its softmax on the accumulators, where a row's 16 values of a thread and its quad's 3
others are the whole row (two shuffles). The two warpgroups then exchange their chunks' row maxima (shared memory,
one 256-thread barrier), so that both take the same new max m(p) = max(m(p - 1), max S(2p), max S(2p + 1)) and both
chunks' P are relative to it; each rescales its O^T once for the pair (alpha = exp2(m(p - 1) - m(p)); the
alphas published first, past a barrier of the warpgroup alone, so that the rescale's multiplies run beside P's
exp2: `early_rescale`; with `pair_rescale_skip`, research, not at all in a pair where no row's max moves, which
the maxima barrier tells every thread alike), writes its chunk's P (e4m3 words, the P.V B operand; P's scale 256
inside the exp2, so the sums are in its units until the segment's end) and, after a second barrier, accumulates
both chunks into its 256 dims: V^T of the chunks by ldmatrix.trans into registers, 8 (16 with two P planes)
wgmmas a chunk. S never goes through shared memory, the softmax reads none, and one rescale serves two chunks.
Per chunk that moves ~176 KB through shared memory (the KV's 36 KB landing, S's 72 KB of operands, V^T's 32 KB,
P^T's 32 KB as P.V's B operand, P's 4 KB) against ~208 KB in the S^T-warpgroup schedule.

Three forms (`DecodeConfig.s_ahead`, `DecodeConfig.pv_behind`):
- phase after phase (the default of the switch): S(p), the softmax and the exchanges, then P.V of both chunks,
  V^T of the first loaded under P's computation and of the second under the first's P.V (`_pair`); S(p + 1) is
  issued once P.V(p) is done (its 64 accumulators do not fit beside O^T and V^T), so the tensor pipe idles
  through each softmax; the waits for both chunks to land run while S(p) does (`stages_under_s`, the default),
  not in P's window. With `s_between_pv` (research, 64 rows) S(p + 1)'s first chain is issued once P.V of the
  pair's first chunk is done, into the registers S(p) left, ahead of the second chunk's P.V, so that the tensor
  pipe has it while the rest of that chunk's V^T loads (the pipe otherwise idle); its second chain is issued as
  pair p + 1 starts. The same arithmetic in the same order (bit-identical outputs); on an H100 2-7% slower where
  the tensor cores bound the step: the chain then sits ahead of P.V(c1) (experiments.md). With `s_after_pv`
  (research, 64 rows) S(p + 1)'s first chain is issued right behind P.V(c1), beside O^T and V^T(c1) in flight,
  and its second once P.V(c1) is done, so that the tensor pipe goes from P.V to S with no wait and issue between
  them; the same arithmetic in the same order, and on an H100 as fast as phase after phase within the runs'
  spread (experiments.md). With `vt_smem`
  (research, 64 rows, 3 stages) each warpgroup transposes both chunks in its dims into shared memory while its S
  runs, and P.V reads V^T from there (`_pair_vt_smem`): no V^T registers or loads between the P barrier and P.V;
  on an H100 4-24% slower, S twice as long beside the transposes' shared-memory traffic (experiments.md).
- S a pair ahead: S(p + 1)'s first chain (or its only chain, `s_chains=1`) is issued before the softmax of pair
  p and runs under it, P.V(p) runs a chunk at a time (V^T of one chunk, 32 registers, beside that chain; at 48
  rows the second chunk's V^T loads under the first's P.V), and S(p + 1)'s second chain is issued once P.V(p) is
  done. The same arithmetic in the same order: the outputs are bit-identical to the first form's. Its chain's
  registers keep V^T's loads after the P barrier, and it measured slower than the first form (experiments.md).
- P.V a pair behind (research, one P plane): P.V of pair p - 1 is issued during pair p, a dim tile of a chunk at a
  time (its V^T's 8 registers and 2 wgmmas, a commit group each; one before the maxima barrier, the others between
  P's words, at most `pv_behind` in flight), so that the tensor pipe runs it while the softmax of pair p does not
  need it; once it is done O^T is rescaled for pair p (`_pair_pv_behind`). O^T += P.V(p - 1), O^T *= alpha(p) is
  the first form's order one pair later. P is double-buffered by pair, and a pair's stages are released during
  the next pair, as its P.V loads their V^T: the load of pair p + 1 then has less than a pair to land. With
  `s_under_rescale` S(p + 1) is issued once O^T is rescaled, before the P barrier (at 64 rows its first chain
  only; past the segment's last pair on Q's own rows, masked whole, as with S ahead), so that the tensor pipe is
  not idle through that barrier and the next pair's start. On an H100 both measured slower than the first form
  (experiments.md): each unit's wait holds the softmax's instructions behind it, so the chain grows.

A fourth form, the two MMA warpgroups a phase apart instead of in step (`DecodeConfig.pair_stagger`, research),
is a subclass in `decode_pairs_stagger.py`, which gives each warpgroup its own pair loop (`_mma_roles`).

The third warpgroup only loads. Its warp 0 issues each chunk's TMA boxes onto the stage's "landed" mbarrier once the
stage's "read" mbarrier says both P.V warpgroups are done with the chunk it held (every thread of both arrives after
its V^T loads of that chunk; the owner's S was waited for before); its 128 threads copy Q by cp.async at a segment's
start and arrive on PAIR_Q_BAR once it landed. With `kv_prefetch` (research, measured slower) warp 0 also prefetches
the chunk that many ahead into L2 before each wait for a stage, so that a load issued late (P.V a pair behind
releases a pair's stages during the next pair) finds its bytes in L2 rather than in DRAM. With `kv_multicast` (the
default for an even number of row blocks with one P plane, `config.default_kv_multicast`) row blocks 2k and 2k + 1 of a
plan CTA run as a 2-CTA cluster, which reads the same chunks in both CTAs (causal: both trim at the pair's last query
position, `_last_query_position`): the P.V threads of both arrive on both CTAs' "read" mbarriers (`_arrive_read`), and
the two load warps take turns, by chunk, issuing its boxes multicast into both CTAs' stage, each expecting the bytes on
its own "landed" mbarrier: one L2 read of each chunk for the two row blocks instead of two. The chunks are counted
over the CTA's segments, so each stage's mbarrier phases follow from the count. A segment's last chunk is zeroed
past its end by the warpgroup that computes its S, before that S (both warpgroups read its V^T only after the P
barrier). A chunk past the segment's end (warpgroup 1's in a pair that has one chunk, and with S ahead the pair
after the last) still has its S issued, with Q's own rows as the B operand (no wgmma is issued under a branch, which
would make ptxas serialise them all) and every token masked: its P is zero and its maxima -inf, and its P.V pairs
that zero P with the first chunk's V^T. The ring has 4 stages (one pair computed while the next lands), or 5 with
the deeper ring below.

Deeper ring. `rope_rows` 64 keeps the rope's block of a stage and of Q in 64-byte rows in the 64B swizzle (its own
TMA box, Q's copies, S's two rope k32 steps with 64B-swizzled descriptors, the zeroed tails): 36 KB a stage
instead of 40, so that 5 stages fit at 64 rows beside Q (36 KB) and one pair's P buffers (8 KB, one P plane):
`config.default_deep_ring`, the phase-after-phase form's default there, where three chunks then load while a
pair computes instead of two (2-3% faster where the memory bounds the step, experiments.md). P.V a pair behind needs P
buffers for two pairs; `p_after_pv` keeps a pair's P words (8 registers a thread) until P.V of the pair before is
done in both warpgroups (`PAIR_PV_DONE_BAR`, which also orders the alphas) and stores them then, so one pair's P
buffers serve there too. With 4 stages and P.V a pair behind the chunks of pair p + 2 are loaded into the stages
pair p's P.V releases during pair p + 1, so they have less than a pair to land (the second chunk about 0.4 of
one); with 5 a stage is refilled with a chunk of the pair after next or later. On an H100 that removed the waits
for chunks to land and took 1-3% off where the memory bounds the step, but P.V a pair behind stays 8-17% slower
where the tensor cores do (experiments.md).

48-row blocks (H12 q_len 4 and 8): S keeps wgmma's 64 rows as M, Q padded with zero rows (its buffer holds 64,
`q_rows`); warp 3 of each MMA warpgroup holds only padding rows, which see no token and store no maxima, P,
alphas or sums; P.V and O^T have the block's 48 rows (N = 48). S's tensor work is then 4/3 of the S^T-warpgroup
schedule's at 48 rows. There the registers O^T leaves hold Q's first 8 k32 steps for a segment
(`DecodeConfig.q_in_registers`, research): those wgmmas take Q as their register A operand, so S reads 16 of its
72 KB a chunk less from shared memory.

Issue slots. Each scheduler runs two MMA warps, so a pair costs it twice a warp's instructions, against ~2180
cycles of tensor work at 64 rows: the loop is kept lean. The warpgroup index is made warp-uniform, so a chunk's
stage address and S's descriptors live in uniform registers and each k32 step moves them by one add
(`decode_mma._issue_s` with stepped_descriptors); the rows' maxima are taken on S before its scale, which enters
P's exp2 through one FMA. ptxas's pair loop (H128, one plane): 878 instructions a warp, both softmax paths counted.

Registers (setmaxnreg): 232 for the P.V warpgroups (at 64 rows O^T 128 beside S's two chains, or both chunks' V^T,
or with S ahead one chain, one chunk's V^T and the softmax's values, or with P.V behind S summed beside up to 4
dim tiles' V^T; O^T 96 at 48 rows) and 40 for the load warpgroup, the 3 x 168 a 384-thread launch gives each
thread triple.

On the H200 (experiments.md) the phase-after-phase form at 64 rows takes 0.81-0.87 of the S^T-warpgroup
schedule's time (H128, H64, H16 q_len 4) and at 48 rows 1.11-1.15; ncu at H128 puts the shared-memory pipe at ~52%
and the tensor pipe at ~48%: its chain of phases, run by both warpgroups at once, sets the pace.
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from ..shapes import KV_DIM
from .barriers import (PAIR_MAX_BAR, PAIR_P_BAR, PAIR_PV_DONE_BAR, PAIR_Q_BAR, PAIR_SUM_BAR, PAIR_TAIL_BAR,
                       PAIR_WG_BAR)
from .decode_common import CTAContext, MLADecodeSM90
from .decode_layout import (CHUNK, SOFTMAX_THREADS, WARPGROUP, p_buffer_bytes, p_words_layout, q_bytes,
                            smem_region_bytes, stage_bytes)
from .decode_mma import VT_HALF_BYTES
from .ptx import (barrier_any, exp2_fma, fence_operand, fence_proxy_async_smem, mbarrier_arrive_peer, quantize_p_e4m3,
                  quantize_p_hi_lo, wgmma_commit, wgmma_fence, wgmma_wait)
from .softmax import max_tree

PAIRS_REGS_MMA, PAIRS_REGS_LOAD = 232, 40
# A launch's registers a thread triple (3 x 168): what the MMA warpgroups' budget (`DecodeConfig.mma_registers`)
# leaves the load warpgroup
PAIRS_REGS_TRIPLE = 2 * PAIRS_REGS_MMA + PAIRS_REGS_LOAD
QUAD = 4  # the lanes of a quad hold one accumulator row
S_ROWS = 64  # wgmma's M: S's rows, the block's (48 or 64) and zero padding
# Q's blocks of S_ROWS rows and the ring's of CHUNK tokens share one stride, so S's B operand may be either (the
# S of a chunk past a segment's end reads Q's own rows): `decode_mma._issue_s` steps both by CHUNK rows
assert S_ROWS == CHUNK
# With q_in_registers (48-row blocks), the k32 steps of S's first chain whose Q fragments (4 registers each) the MMA
# warpgroups keep for a segment (the rest read Q from sQ): beside O^T's 96 registers and S's two chains, ptxas
# (sm_90a, 232 / 40) fits 8 without spills or serialised wgmmas in both forms (9, the whole chain, spills 8 bytes
# with S ahead); at 64 rows (O^T 128) even 2 spill, 20 bytes (68 with S ahead).
PAIRS_Q_STEPS_REGS = 8
# In the phase-after-phase form, the dim tiles of V^T of a pair's second chunk (8 registers a thread each) loaded
# under the first chunk's P.V, by (rows, MMA warpgroups' registers, P planes) (the rest once it is done): as many
# as ptxas (sm_90a) fits beside O^T without spills (at 64 rows and 232, 3 spill 4 bytes and all 4 spill 32; at 240
# all 4 spill 32, and 3 with two P planes 8).
PAIRS_VT_TILES_UNDER_PV = {(48, 232, 1): 4, (64, 232, 1): 2, (48, 240, 1): 4, (64, 240, 1): 3,
                           (48, 232, 2): 4, (64, 232, 2): 2, (48, 240, 2): 4, (64, 240, 2): 2}
# With P.V a pair behind (`DecodeConfig.pv_behind`: at most that many of its units, a dim tile of a chunk each with
# 8 V^T registers a thread, in flight; a new one first waits for the rest to drop below it), the units issued before
# the maxima barrier: 2 there make ptxas serialise the wgmmas at 64 rows (C7512, too few registers), 1 leaves it
# clean with up to 4 in flight
PV_UNITS_BEFORE_MAXIMA = 1
PV_UNITS = 8  # a pair's P.V for this warpgroup's 4 dim tiles: 2 chunks x 4 tiles


class PairSegment:
    """What a segment's pairs read: the CTA's chunks before it (`done`), its chunks and tokens, and the ends of
    this thread's two rows' tokens (causal); also what a pending P.V reads (`_pending_pv`)."""

    def __init__(self, **values):
        self.__dict__.update(values)


class MLADecodePairsSM90(MLADecodeSM90):
    """The chunk-pairs schedule (module docstring): 48- and 64-row blocks, KV by TMA."""

    num_threads = SOFTMAX_THREADS + WARPGROUP
    # maxntid and one CTA per SM, so that ptxas gives the setmaxnreg regions their budgets (`decode_swg.py`)
    launch_bounds = dict(max_number_threads=[SOFTMAX_THREADS + WARPGROUP, 1, 1], min_blocks_per_mp=1)
    ring_mbarriers = 2  # per stage "landed" (TMA) and "read" (both P.V warpgroups; with kv_multicast both CTAs')

    @property
    def launch_cluster(self) -> dict:
        """With `kv_multicast` row blocks 2k and 2k + 1 of a plan CTA (the grid's first dimension) as a cluster."""
        return {"cluster": [2, 1, 1]} if self.cfg.kv_multicast else {}

    def __init__(self, cfg):
        super().__init__(cfg)
        self.q_rows = S_ROWS  # S's M: a 48-row block's Q is padded with zero rows
        # Q's first k32 steps in the MMA warpgroups' registers (`DecodeConfig.q_in_registers`, research)
        self.k_steps_regs = PAIRS_Q_STEPS_REGS if cfg.q_in_registers else 0

    def register_budgets(self):
        """(P.V warpgroups, load warpgroup) setmaxnreg budgets."""
        mma = self.cfg.mma_registers or PAIRS_REGS_MMA
        return mma, PAIRS_REGS_TRIPLE - 2 * mma

    def smem_regions(self) -> dict:
        """As the other schedules', with Q padded to S's 64 rows and the S^T region holding only the two
        warpgroups' chunk maxima (row, warpgroup)."""
        regions = smem_region_bytes(self.rows, self.cfg.num_stages, self.cfg.p_planes, self.cfg.rope_rows)
        regions["q"] = q_bytes(S_ROWS, self.cfg.rope_rows)
        regions["s"] = 2 * self.rows * 4
        regions["p"] = self.p_buffers * p_buffer_bytes(self.rows, self.cfg.p_planes)
        if self.cfg.vt_smem:
            regions["ring"] += 4 * VT_HALF_BYTES  # each P.V warpgroup's V^T of a pair after the stages (`_pair`)
        return regions

    @property
    def p_buffers(self) -> int:
        """P buffers of a chunk each: a pair's two, or with P.V a pair behind two pairs' (`pv_behind`): the P a
        pair's softmax writes while the previous pair's P.V reads its own; with `p_after_pv` one pair's again (P
        stored once that P.V is done)."""
        return 4 if self.cfg.pv_behind and not self.cfg.p_after_pv else 2

    @property
    def stage_bytes(self) -> int:
        """Bytes of a ring stage (`decode_layout.stage_bytes`, `DecodeConfig.rope_rows`)."""
        return stage_bytes(self.cfg.rope_rows)

    def _p_buffer(self, c: int, pr: Int32):
        """The P buffer of pair pr's chunk c (0, 1): a pair's own pair of buffers, or of two alternating
        (`p_buffers`)."""
        return c + 2 * (pr % 2) if self.p_buffers == 4 else c

    @cute.jit
    def _schedule(self, cta: CTAContext):
        NS = self.cfg.num_stages
        bars = cta.storage.kv_full.data_ptr()
        if cta.tidx == SOFTMAX_THREADS:
            for st in cutlass.range_constexpr(NS):
                cute.arch.mbarrier_init(bars + st, 1)  # landed: the issuing lane's expect-tx arrival
                # read: every P.V thread (`_arrive_read`), with kv_multicast those of both CTAs of the cluster
                cute.arch.mbarrier_init(bars + NS + st, SOFTMAX_THREADS * (2 if self.cfg.kv_multicast else 1))
            cute.arch.mbarrier_init_fence()
        if cutlass.const_expr(self.cfg.kv_multicast):
            # both CTAs' mbarriers initialised before either multicasts into or arrives at the other's
            cute.arch.cluster_arrive()
            cute.arch.cluster_wait()
        else:
            cute.arch.barrier()  # the mbarriers are initialised before anyone waits on or arrives at them
        g = cta.mCtaTileStart[cta.cta]
        g_end = cta.mCtaTileStart[cta.cta + 1]
        b = cta.mCtaFirstReq[cta.cta]
        if cta.wg == 2:
            self._load_warpgroup(cta, g, g_end, b)
            self._leave_cluster()
        else:
            self._mma_warpgroups(cta, g, g_end, b)
            self._leave_cluster()

    @cute.jit
    def _last_query_position(self, rb: Int32) -> Int32:
        """With `kv_multicast` both row blocks of a cluster trim their segments at the pair's last query position, so
        that both read the same chunks (the lower block's rows mask the tokens past their own ends, as a block's rows
        do past theirs); else the block's own."""
        if cutlass.const_expr(self.cfg.kv_multicast):
            rb = rb - rb % 2 + 1
        return MLADecodeSM90._last_query_position(self, rb)

    @cute.jit
    def _leave_cluster(self):
        """With `kv_multicast`: neither CTA of the cluster leaves while the other may still multicast into it or arrive
        at its mbarriers (in each warpgroup's own branch, under its own register budget)."""
        if cutlass.const_expr(self.cfg.kv_multicast):
            cute.arch.cluster_arrive()
            cute.arch.cluster_wait()

    # ------------------------------------------------------------------------------ warpgroup 2: the loads
    @cute.jit
    def _load_warpgroup(self, cta: CTAContext, g: Int32, g_end: Int32, b: Int32):
        cute.arch.setmaxregister_decrease(self.register_budgets()[1])
        C = CHUNK
        NS = self.cfg.num_stages
        tw = cta.tidx - SOFTMAX_THREADS
        # CuTe's TMA copy elects one lane of the warp that reaches it: warp 0 issues the boxes
        issuer = tw < 32
        bars = cta.storage.kv_full.data_ptr()
        boxes = self._kv_tma_partitions(cta, cta.storage.ring.data_ptr())
        done = Int32(0)  # chunks of the CTA's earlier segments
        while g < g_end:
            b, seg_end, seq_len, tok_begin, tok_end, n_chunks = self._segment(cta.mReqTileStart, cta.mSeq, b, g,
                                                                              g_end, cta.t_last)
            self._load_q_block(cta, tw, b)
            cute.arch.cp_async_commit_group()
            if issuer:
                # the first NS chunks: their stages were all read in the earlier segments (the P.V threads
                # arrive before the segment-end barrier), so their waits return at once; their pages read together
                pages = [self._lookup_chunk_pages(cta.mBT, b, tok_begin + st * C, tok_end) for st in range(NS)]
                for st in cutlass.range_constexpr(NS):
                    if st < n_chunks:
                        self._refill_stage(cta, boxes, bars, done + st, pages[st][0], pages[st][1],
                                           tok_begin + st * C, st)
            cute.arch.cp_async_wait_group(0)
            fence_proxy_async_smem()  # Q is a wgmma operand
            cute.arch.barrier_arrive(barrier_id=PAIR_Q_BAR, number_of_threads=self.num_threads)
            if issuer:
                page_a, page_b = self._lookup_chunk_pages(cta.mBT, b, tok_begin + NS * C, tok_end)
                D = self.cfg.kv_prefetch  # research: chunk j + D into L2 before the wait for chunk j's stage
                if cutlass.const_expr(D > 0):
                    lead = cute.arch.lane_idx() == 0
                    ahead = [self._lookup_chunk_pages(cta.mBT, b, tok_begin + (NS + d) * C, tok_end)
                             for d in range(D + 1)]
                    for d in cutlass.range_constexpr(D):
                        if lead:
                            self._prefetch_chunk_l2(cta, ahead[d][0], ahead[d][1], tok_begin + (NS + d) * C)
                    ahead_a, ahead_b = ahead[D]
                for j in range(NS, n_chunks):
                    if cutlass.const_expr(D > 0):
                        if lead:
                            self._prefetch_chunk_l2(cta, ahead_a, ahead_b, tok_begin + (j + D) * C)
                        ahead_a, ahead_b = self._lookup_chunk_pages(cta.mBT, b, tok_begin + (j + D + 1) * C,
                                                                    tok_end)
                    self._refill_stage(cta, boxes, bars, done + j, page_a, page_b, tok_begin + j * C, j)
                    # the next chunk's page, read while this warp waits for its stage
                    page_a, page_b = self._lookup_chunk_pages(cta.mBT, b, tok_begin + (j + 1) * C, tok_end)
            cute.arch.barrier()  # segment end: every S of the segment is done, sQ may be refilled
            done = done + n_chunks
            g = seg_end
            b = b + 1

    @cute.jit
    def _refill_stage(self, cta: CTAContext, boxes, bars: cute.Pointer, v: Int32, page_a: Int32, page_b: Int32,
                      tok0: Int32, j: Int32):
        """The CTA's chunk v (chunk j of the segment, counted over the CTA's segments; tokens [tok0, tok0 + C) on
        page_a / page_b) into stage v % NS, once both P.V warpgroups read the chunk v - NS it held."""
        NS = self.cfg.num_stages
        lead = cute.arch.lane_idx() == 0
        stage = v % NS
        if v >= NS:
            cute.arch.mbarrier_wait(bars + NS + stage, (v // NS + 1) % 2)
        self._stamp(cta, lead, j, 0)  # "stage read"
        # the P.V threads read the stage by ldmatrix (the generic proxy) and TMA (the async proxy) writes it
        # next: a proxy fence on the path from those reads to these writes (`decode_swg_tma._refill`)
        fence_proxy_async_smem()
        issue = True
        if cutlass.const_expr(self.cfg.kv_multicast):
            # the chunk's boxes land in both CTAs' stage, which the wait above found read in both (`_arrive_read`):
            # the CTAs of the cluster take turns issuing them, by chunk; each expects them on its own mbarrier
            issue = v % 2 == cute.arch.block_idx()[0] % 2
        self._issue_chunk_tma(cta, boxes, bars + stage, page_a, page_b, tok0, stage, issue)
        self._stamp(cta, lead, j, 1)  # "boxes issued"

    # ----------------------------------------------------------------- warpgroups 0 and 1: S, softmax, P.V
    @cute.jit
    def _mma_warpgroups(self, cta: CTAContext, g: Int32, g_end: Int32, b: Int32):
        cute.arch.setmaxregister_increase(self.register_budgets()[0])
        # the warpgroup index warp-uniform to ptxas, so that what derives from it (a chunk's stage, S's
        # descriptors) takes uniform registers (module docstring, issue slots); here only: in the opening, before
        # the roles part, it makes ptxas spill in the load warpgroup's 40 registers
        cta = CTAContext(**dict(cta.__dict__, wg=cute.arch.make_warp_uniform(cta.wg)))
        self._mma_roles(cta, g, g_end, b)

    @cute.jit
    def _mma_roles(self, cta: CTAContext, g: Int32, g_end: Int32, b: Int32):
        """Both MMA warpgroups run the same code (role 0); `decode_pairs_stagger` gives each a role of its own."""
        self._mma_segments(cta, g, g_end, b, 0)

    @cute.jit
    def _mma_segments(self, cta: CTAContext, g: Int32, g_end: Int32, b: Int32, role: cutlass.Constexpr):
        """An MMA warpgroup's segments of the CTA: each one's pairs (`_pair` or a form's), then its rows."""
        ROWS = self.rows
        NA = ROWS // 2
        NT = self.num_threads
        r0 = 16 * cta.wl + cta.lg  # this thread's accumulator rows of S: r0 and r0 + 8
        sPw = cute.make_tensor(cute.recast_ptr(cta.storage.p.data_ptr(), dtype=Int32),
                               p_words_layout(ROWS, self.cfg.p_planes, self.p_buffers))
        sMax = cta.storage.s.get_tensor(cute.make_layout((ROWS, 2), stride=(1, ROWS)))
        sAlpha = cta.storage.alpha.get_tensor(cute.make_layout((ROWS, 2), stride=(1, ROWS)))
        sSum = cta.storage.row_ml.get_tensor(cute.make_layout((ROWS,)))
        acc_O = cute.make_rmem_tensor(cute.make_layout((4 * NA,)), Float32)
        acc_S = cute.make_rmem_tensor(cute.make_layout((CHUNK // 2,)), Float32)  # S (summed), the softmax's values
        acc_A = cute.make_rmem_tensor(cute.make_layout((CHUNK // 2,)), Float32)  # S's first chain
        acc_B = cute.make_rmem_tensor(cute.make_layout((CHUNK // 2,)), Float32)  # S's second chain
        q_regs = cute.make_rmem_tensor(cute.make_layout((4 * max(self.k_steps_regs, 1),)), Int32)
        done = Int32(0)  # chunks of the CTA's earlier segments
        while g < g_end:
            b, seg_end, seq_len, tok_begin, tok_end, n_chunks = self._segment(cta.mReqTileStart, cta.mSeq, b, g,
                                                                              g_end, cta.t_last)
            row_end0 = self._row_end(tok_end, seq_len, cta.row0 + r0)
            row_end1 = self._row_end(tok_end, seq_len, cta.row0 + r0 + 8)
            if cutlass.const_expr(ROWS < S_ROWS):
                if not self._block_rows(cta):  # S's padding rows (warp 3 at 48 rows) see no token
                    row_end0 = Int32(0)
                    row_end1 = Int32(0)
            seg = PairSegment(done=done, n_chunks=n_chunks, tok_begin=tok_begin, tok_end=tok_end,
                              row_end0=row_end0, row_end1=row_end1)
            split = cta.mNumSplits[b] != 1
            slot = cta.mSplitOffset[b] + cta.cta - cta.mReqFirstCta[b]
            acc_O.fill(0.0)
            m0 = -Float32.inf
            m1 = -Float32.inf
            l0 = Float32(0.0)
            l1 = Float32(0.0)
            cute.arch.barrier(barrier_id=PAIR_Q_BAR, number_of_threads=NT)  # Q of the segment landed
            if cutlass.const_expr(self.k_steps_regs > 0):
                self._load_q_registers(cta, q_regs, self.k_steps_regs)
            n_pairs = (n_chunks + 1) // 2
            if cutlass.const_expr(self.cfg.s_ahead):
                # S of pair 0 (this warpgroup's chunk, or Q's own rows where there is none)
                self._issue_qk_chains(acc_A, acc_B, q_regs, self._own_chunk_k_base(cta, seg, cta.wg), cta.q_addr)
                for pr in range(n_pairs):
                    m0, m1, l0, l1 = self._pair_s_ahead(cta, seg, acc_O, acc_S, acc_A, acc_B, q_regs, sPw, sMax,
                                                        sAlpha, pr, m0, m1, l0, l1)
                wgmma_wait(0)  # the S issued past the last pair (all masked, on Q) is done with sQ
            elif cutlass.const_expr(self.cfg.pv_behind):
                # pair 0 has no P.V before it: peeled, so that no wgmma is issued under a branch inside the loop
                k_cur = cta.q_addr  # with s_under_rescale, the chunk whose S's first chain the pair before issued
                if n_pairs > 0:
                    if cutlass.const_expr(self.cfg.s_under_rescale):  # (later pairs': the pair before issues it)
                        k_cur = self._own_chunk_k_base(cta, seg, cta.wg)
                        self._issue_s_under_rescale(acc_A, acc_B, q_regs, k_cur, cta.q_addr)
                    m0, m1, l0, l1, k_cur = self._pair_pv_behind(cta, seg, acc_O, acc_S, acc_A, acc_B, q_regs, sPw,
                                                                 sMax, sAlpha, Int32(0), m0, m1, l0, l1, k_cur,
                                                                 False)
                for pr in range(1, n_pairs):
                    m0, m1, l0, l1, k_cur = self._pair_pv_behind(cta, seg, acc_O, acc_S, acc_A, acc_B, q_regs, sPw,
                                                                 sMax, sAlpha, pr, m0, m1, l0, l1, k_cur, True)
                if n_pairs > 0:  # the last pair's P.V
                    pending = self._pending_pv(cta, seg, n_pairs - 1)
                    for u in cutlass.range_constexpr(PV_UNITS):
                        self._pv_behind_unit(cta, acc_O, pending, u)
                    self._wait_mma(acc_O)  # inside the branch: no wgmma in flight where its paths join
                    # (with s_under_rescale, also the S issued past the last pair, on Q's own rows: done with sQ)
            elif cutlass.const_expr(self.cfg.s_between_pv):
                # S(0)'s first chain here, each later one during the pair before, between its chunks' P.V. Waited
                # for at once: in flight across the loop's entry, where O^T's zeros are moved into its registers,
                # it makes ptxas serialise every wgmma (C7515)
                k_cur = self._own_chunk_k_base(cta, seg, cta.wg)
                self._issue_qk_first(acc_A, q_regs, k_cur, cta.q_addr, self._s_first_steps())
                wgmma_wait(0)
                for pr in range(n_pairs):
                    m0, m1, l0, l1, k_cur = self._pair(cta, seg, acc_O, acc_S, acc_A, acc_B, q_regs, sPw, sMax,
                                                       sAlpha, pr, m0, m1, l0, l1, k_cur)
                wgmma_wait(0)  # the chain issued past the last pair (on Q's own rows, masked) is done with sQ
            elif cutlass.const_expr(self.cfg.s_after_pv):
                # S(0) here, each later one at the end of the pair before, right behind its last P.V wgmmas
                self._issue_qk_chains(acc_A, acc_B, q_regs, self._own_chunk_k_base(cta, seg, cta.wg), cta.q_addr)
                for pr in range(n_pairs):
                    m0, m1, l0, l1 = self._pair(cta, seg, acc_O, acc_S, acc_A, acc_B, q_regs, sPw, sMax, sAlpha,
                                                pr, m0, m1, l0, l1, None, role)
                wgmma_wait(0)  # the S issued past the last pair (on Q's own rows, masked) is done with sQ
            else:
                for pr in range(n_pairs):
                    m0, m1, l0, l1 = self._pair(cta, seg, acc_O, acc_S, acc_A, acc_B, q_regs, sPw, sMax, sAlpha,
                                                pr, m0, m1, l0, l1, None, role)
            cute.arch.barrier()  # segment end: every S of the segment is done, sQ may be refilled
            self._wait_mma(acc_O)
            self._end_segment(cta, acc_O, sSum, m0, m1, l0, l1, b, split, slot)
            done = done + n_chunks
            g = seg_end
            b = b + 1

    @cute.jit
    def _pair(self, cta: CTAContext, seg, acc_O: cute.Tensor, acc_S: cute.Tensor, acc_A: cute.Tensor,
              acc_B: cute.Tensor, q_regs: cute.Tensor, sPw: cute.Tensor, sMax: cute.Tensor, sAlpha: cute.Tensor,
              pr: Int32, m0: Float32, m1: Float32, l0: Float32, l1: Float32, k_cur=None,
              role: cutlass.Constexpr = 0):
        """Pair pr of the segment, one phase after the other: S and the softmax of this warpgroup's chunk, the
        maxima exchange, P, then P.V of both chunks into this warpgroup's dims (module docstring). Returns the
        rows' new maxima and this thread's shares of their sums; with `s_between_pv` (S's first chain of this
        warpgroup's chunk at k_cur issued during the pair before) also where the next pair's chunk is read from."""
        lead = cta.tidx % WARPGROUP == 0
        between = self.cfg.s_between_pv
        if cutlass.const_expr(not self.cfg.s_after_pv):  # (else S(pr) was issued at the end of the pair before)
            k_base = k_cur if between else self._own_chunk_k_base(cta, seg, 2 * pr + cta.wg)
            # the previous pair's P.V is done: its V^T registers are free and its P buffers may be rewritten
            self._wait_mma(acc_O)
            self._stamp(cta, lead, pr, 8 + 8 * cta.wg + 0)  # "chunk landed"
            if cutlass.const_expr(between):
                if cutlass.const_expr(self.cfg.s_chains == 2):
                    self._issue_qk_second(acc_B, k_base, cta.q_addr)
            else:
                self._issue_qk_chains(acc_A, acc_B, q_regs, k_base, cta.q_addr)
        if cutlass.const_expr(self.cfg.vt_smem):
            # (research) both chunks' V^T in this warpgroup's dims into its own buffers while its S runs (the
            # warps wait for the tensor pipe there); only this warpgroup reads them, after its P barrier, and
            # rewrites them after its wait for this pair's P.V
            stage0, stage1, has_c1 = self._pair_stages(cta, seg, pr)
            self._store_pair_vt(cta, seg, pr, stage0, stage1, has_c1)
        elif cutlass.const_expr(self.cfg.stages_under_s):
            # the waits for both chunks' "landed" mbarriers while S runs, where the warps wait for the tensor pipe
            # anyway, instead of inside P's window (`config.default_stages_under_s`)
            stage0, stage1, has_c1 = self._pair_stages(cta, seg, pr)
        self._sum_qk_chains(acc_S, acc_A, acc_B)
        self._stamp(cta, lead, pr, 8 + 8 * cta.wg + 1)  # "S done"
        if cutlass.const_expr(self.cfg.vt_smem):
            self._release_pair_stages(cta, stage0, stage1, has_c1)  # S and the transposes were their readers
        new0, new1, use0, use1, alpha0, alpha1, moved = self._exchange_maxima(cta, seg, acc_S, sMax, pr, m0, m1)
        # both chunks into this warpgroup's 256 dims (a missing second chunk: zero P against chunk c0's V^T). V^T of
        # the first is loaded here, past the maxima barrier (so both chunks' zeroed tails are visible), to run
        # under P's exp2 and conversions, and the second's under P.V of the first (PAIRS_VT_TILES_UNDER_PV): ldmatrix
        # takes the shared-memory pipe, which neither of those needs (both loads sat between the P barrier and
        # P.V, ~900 cycles of a ~4980-cycle pair at H128: experiments.md). The same arithmetic in the same order.
        if cutlass.const_expr(self.cfg.vt_smem):
            return self._pair_vt_smem(cta, seg, acc_O, acc_S, sPw, sAlpha, pr, l0, l1, new0, new1, use0, use1,
                                      alpha0, alpha1, moved)
        if cutlass.const_expr(not self.cfg.stages_under_s):
            stage0, stage1, has_c1 = self._pair_stages(cta, seg, pr)
        # own_chunk_first (research): this warpgroup's chunk first, whose P and alphas only it wrote, so that its
        # P.V needs no wait for the other warpgroup and runs under the P barrier's wait; else chunk 2p first
        first = cta.wg if self.cfg.own_chunk_first else 0
        stage_a = stage0 + first * (stage1 - stage0)
        stage_b = stage1 + first * (stage0 - stage1)
        a0 = self._load_vt(cta.ring_addr + stage_a * self.stage_bytes, cta.wg * 4, cta.wl, cta.lane)
        csum0, csum1 = self._rescale_early_publish_p(cta, acc_O, acc_S, sPw, sAlpha, use0, use1, alpha0, alpha1,
                                                     moved)
        if cutlass.const_expr(self.cfg.own_chunk_first):
            cute.arch.barrier(barrier_id=PAIR_WG_BAR + cta.wg, number_of_threads=WARPGROUP)
        else:
            self._pass_p_barrier(cta, pr)
        if cutlass.const_expr(not self.cfg.early_rescale):
            self._rescale_o(acc_O, sAlpha[None, cta.wg], cta.lt, self.cfg.unit_rescale_skip)
        p_addr = cta.storage.p.data_ptr().toint()
        p_bytes = p_buffer_bytes(self.rows, self.cfg.p_planes)
        self._issue_pv_regs(acc_O, a0, p_addr + first * p_bytes, 0)
        stage_b_addr = cta.ring_addr + stage_b * self.stage_bytes
        if cutlass.const_expr(self.cfg.pv_second_per_tile):
            # (research, 48 rows) a dim tile of the second chunk's V^T, then its wgmmas, behind P.V(c0) on the same
            # accumulators: the tensor pipe gets the second chunk's first tile once its ldmatrix are in, not the
            # last's (ncu at H12 q_len 8: the byte permutes after the ldmatrix waited 9% of the stall samples); on an
            # H100 no faster than the other order (experiments.md)
            for t in cutlass.range_constexpr(4):
                a_t = self._load_vt(stage_b_addr, cta.wg * 4 + t, cta.wl, cta.lane, 1)
                wgmma_fence()  # this tile's A registers are written
                self._pv_wgmmas(acc_O, lambda _, ks: a_t[ks], p_addr + (1 - first) * p_bytes, 0, t, t + 1)
            wgmma_commit()
            self._release_pair_stages(cta, stage0, stage1, has_c1)
            self._stamp(cta, lead, pr, 8 + 8 * cta.wg + 4)  # "V^T loaded" (the second chunk's, after its issue)
        else:
            under = PAIRS_VT_TILES_UNDER_PV[self.rows, self.register_budgets()[0], self.cfg.p_planes]
            assert under < 4 or not between, "s_between_pv issues its chain at the wait for P.V(c0), which 64 rows have"
            a1 = self._load_vt(stage_b_addr, cta.wg * 4, cta.wl, cta.lane, under)
            if cutlass.const_expr(self.cfg.own_chunk_first):
                self._pass_p_barrier(cta, pr)
            if cutlass.const_expr(under < 4):
                self._wait_mma(acc_O)
                if cutlass.const_expr(between):
                    # S(p + 1)'s first chain into the registers S(p) left, ahead of P.V(c1) in the tensor pipe, so
                    # that the pipe has it while the rest of V^T(c1) loads (past the last pair: Q's own rows)
                    k_base = self._own_chunk_k_base(cta, seg, 2 * pr + 2 + cta.wg)
                    self._issue_qk_first(acc_A, q_regs, k_base, cta.q_addr, self._s_first_steps())
                a1 = a1 + self._load_vt(stage_b_addr, cta.wg * 4 + under, cta.wl, cta.lane, 4 - under)
            self._release_pair_stages(cta, stage0, stage1, has_c1)
            self._stamp(cta, lead, pr, 8 + 8 * cta.wg + 4)  # "V^T loaded" (the second chunk's)
            self._issue_pv_regs(acc_O, a1, p_addr + (1 - first) * p_bytes, 0)
        self._stamp(cta, lead, pr, 8 + 8 * cta.wg + 5)  # "P.V issued"
        if cutlass.const_expr(self.cfg.s_after_pv):
            # S(pr + 1) right behind P.V(c1) in the tensor pipe (past the segment's last pair on Q's own rows,
            # masked whole): its first chain beside O^T and V^T(c1), in flight; its second once P.V(c1) is done and
            # V^T(c1)'s registers are free
            k_next = self._own_chunk_k_base(cta, seg, 2 * pr + 2 + cta.wg)
            self._stamp(cta, lead, pr + 1, 8 + 8 * cta.wg + 0)  # "chunk landed" (the next pair's)
            self._issue_qk_first(acc_A, q_regs, k_next, cta.q_addr, self._s_first_steps())
            wgmma_wait(1)  # P.V(c1) (the next S's first chain may still run)
            for i in cutlass.range_constexpr(cute.size(acc_O)):
                acc_O[i] = fence_operand(acc_O[i])
            self._issue_qk_second(acc_B, k_next, cta.q_addr)  # (two chains: `DecodeConfig` refuses one)
        if cutlass.const_expr(between):
            return new0, new1, l0 * alpha0 + csum0, l1 * alpha1 + csum1, k_base
        return new0, new1, l0 * alpha0 + csum0, l1 * alpha1 + csum1

    @cute.jit
    def _pair_vt_smem(self, cta: CTAContext, seg, acc_O: cute.Tensor, acc_S: cute.Tensor, sPw: cute.Tensor,
                      sAlpha: cute.Tensor, pr: Int32, l0: Float32, l1: Float32, new0: Float32, new1: Float32,
                      use0: Float32, use1: Float32, alpha0: Float32, alpha1: Float32, moved: Int32):
        """The rest of pair pr with V^T in shared memory (`DecodeConfig.vt_smem`), past the maxima exchange: the
        rescale and P as in `_pair`, then P.V of both chunks as 16 wgmmas on the V^T buffers, no V^T loads
        between the P barrier and P.V. A missing second chunk: zero P against the first chunk's V^T, as there."""
        lead = cta.tidx % WARPGROUP == 0
        csum0, csum1 = self._rescale_early_publish_p(cta, acc_O, acc_S, sPw, sAlpha, use0, use1, alpha0, alpha1,
                                                     moved)
        self._pass_p_barrier(cta, pr)
        if cutlass.const_expr(not self.cfg.early_rescale):
            self._rescale_o(acc_O, sAlpha[None, cta.wg], cta.lt, self.cfg.unit_rescale_skip)
        p_addr = cta.storage.p.data_ptr().toint()
        p_bytes = p_buffer_bytes(self.rows, self.cfg.p_planes)
        vt_addr = self._vt_addr(cta, 0)
        vt_second = vt_addr
        if 2 * pr + 1 < seg.n_chunks:
            vt_second = self._vt_addr(cta, 1)
        self._stamp(cta, lead, pr, 8 + 8 * cta.wg + 4)  # "V^T loaded" (none to load: P.V issue starts)
        wgmma_fence()
        self._pv_wgmmas_smem(acc_O, vt_addr, p_addr)
        self._pv_wgmmas_smem(acc_O, vt_second, p_addr + p_bytes)
        wgmma_commit()
        self._stamp(cta, lead, pr, 8 + 8 * cta.wg + 5)  # "P.V issued"
        return new0, new1, l0 * alpha0 + csum0, l1 * alpha1 + csum1

    @cute.jit
    def _rescale_early_publish_p(self, cta: CTAContext, acc_O: cute.Tensor, acc_S: cute.Tensor, sPw: cute.Tensor,
                                 sAlpha: cute.Tensor, use0: Float32, use1: Float32, alpha0: Float32, alpha1: Float32,
                                 moved: Int32):
        """With `early_rescale` O^T rescaled first, then `_publish_p` (the phase-after-phase forms, before their
        P barrier); with `pair_rescale_skip` only where a row's max moves in the pair (moved, the same in every
        thread: no divergence), else P alone. Returns its sums."""
        if cutlass.const_expr(self.cfg.pair_rescale_skip):
            csum0 = Float32(0.0)
            csum1 = Float32(0.0)
            if moved != 0:
                csum0, csum1 = self._rescale_before_publish_p(cta, acc_O, acc_S, sPw, sAlpha, use0, use1, alpha0,
                                                              alpha1)
            else:
                # every alpha is 1 (a max that did not move), or 0 where a row has seen no token, whose O^T is
                # still the zeros it started as (NaN where its zero P met a NaN V): the rescale would change no bit
                csum0, csum1 = self._publish_p(cta, acc_S, sPw, sAlpha, use0, use1, alpha0, alpha1)
            return csum0, csum1
        elif cutlass.const_expr(self.cfg.early_rescale):
            return self._rescale_before_publish_p(cta, acc_O, acc_S, sPw, sAlpha, use0, use1, alpha0, alpha1)
        else:
            return self._publish_p(cta, acc_S, sPw, sAlpha, use0, use1, alpha0, alpha1)

    @cute.jit
    def _rescale_before_publish_p(self, cta: CTAContext, acc_O: cute.Tensor, acc_S: cute.Tensor, sPw: cute.Tensor,
                                  sAlpha: cute.Tensor, use0: Float32, use1: Float32, alpha0: Float32,
                                  alpha1: Float32):
        """`early_rescale`: the alphas first, past a barrier of this warpgroup alone (its O^T rows are other
        threads' S rows), so that O^T's rescale (FMA pipe) runs beside P's exp2 (MUFU) instead of between the P
        barrier and P.V (H200, decode alone, 3-5% faster at 64 rows: `config.default_early_rescale`); then
        `_publish_p`. Returns its sums."""
        self._publish_alphas(cta, sAlpha, alpha0, alpha1)
        cute.arch.barrier(barrier_id=PAIR_WG_BAR + cta.wg, number_of_threads=WARPGROUP)
        self._rescale_o(acc_O, sAlpha[None, cta.wg], cta.lt, self.cfg.unit_rescale_skip)
        return self._publish_p(cta, acc_S, sPw, sAlpha, use0, use1, alpha0, alpha1)

    def _vt_offset(self, cta: CTAContext, c: int) -> Int32:
        """Bytes from the ring's start to this warpgroup's V^T buffer of a pair's chunk c (after the stages)."""
        return self.cfg.num_stages * self.stage_bytes + (2 * cta.wg + c) * VT_HALF_BYTES

    def _vt_addr(self, cta: CTAContext, c: int) -> Int32:
        """The shared address of this warpgroup's V^T buffer of a pair's chunk c."""
        return cta.ring_addr + self._vt_offset(cta, c)

    @cute.jit
    def _store_pair_vt(self, cta: CTAContext, seg, pr: Int32, stage0: Int32, stage1: Int32, has_c1):
        """Both chunks of pair pr (landed: `_pair_stages`) as V^T in this warpgroup's 256 dims into its buffers
        (`decode_mma._store_vt`), fenced for the wgmma; in the pair of a segment's last chunk, if that chunk ends
        inside its page, past the barrier on its zeroed tail (each warpgroup zeroes its own chunk's)."""
        C = CHUNK
        if 2 * pr + 2 >= seg.n_chunks:  # the segment's last chunk, whose tail its owner zeroed (`_own_chunk_k_base`)
            if seg.tok_end - (seg.tok_begin + (seg.n_chunks - 1) * C) < C:
                cute.arch.barrier(barrier_id=PAIR_TAIL_BAR, number_of_threads=SOFTMAX_THREADS)
        for c in cutlass.range_constexpr(2):
            stage = stage0 if c == 0 else stage1
            words = cute.make_tensor(cute.recast_ptr(cta.storage.ring.data_ptr() + self._vt_offset(cta, c),
                                                     dtype=Int32), cute.make_layout((VT_HALF_BYTES // 4,)))
            if c == 0 or has_c1:
                self._store_vt(cta.ring_addr + stage * self.stage_bytes, words, cta.wg * 4, cta.wl, cta.lane)
        fence_proxy_async_smem()  # V^T is a wgmma operand

    @cute.jit
    def _pair_s_ahead(self, cta: CTAContext, seg, acc_O: cute.Tensor, acc_S: cute.Tensor, acc_A: cute.Tensor,
                      acc_B: cute.Tensor, q_regs: cute.Tensor, sPw: cute.Tensor, sMax: cute.Tensor,
                      sAlpha: cute.Tensor, pr: Int32, m0: Float32, m1: Float32, l0: Float32, l1: Float32):
        """Pair pr with S of the next pair issued early (`DecodeConfig.s_ahead`): its first chain (or its one
        chain) under this pair's softmax, its second once this pair's P.V is done; P.V a chunk at a time (V^T of
        one chunk in registers beside the next S's first chain). Returns as `_pair`."""
        lead = cta.tidx % WARPGROUP == 0
        two = self.cfg.s_chains == 2
        self._sum_qk_chains(acc_S, acc_A, acc_B)  # S(pr), issued during the previous pair
        self._stamp(cta, lead, pr, 8 + 8 * cta.wg + 1)  # "S done"
        # With 4 stages, this warpgroup's chunk of pair pr + 1 went into the stage pair pr - 1 released during its
        # P.V: a shorter window for its load than the other form's whole pair (the stage of c0 is released as
        # soon as its V^T is in registers, below, to widen it).
        k_next = self._own_chunk_k_base(cta, seg, 2 * pr + 2 + cta.wg)
        self._stamp(cta, lead, pr, 8 + 8 * cta.wg + 0)  # "chunk landed" (the next pair's)
        self._issue_qk_first(acc_A, q_regs, k_next, cta.q_addr, self._s_first_steps())
        new0, new1, alpha0, alpha1, csum0, csum1 = self._softmax_pair(cta, seg, acc_S, sPw, sMax, sAlpha, pr, m0,
                                                                      m1)
        stage0, stage1, has_c1 = self._pair_stages(cta, seg, pr)
        p_addr = cta.storage.p.data_ptr().toint()
        a0 = self._load_vt(cta.ring_addr + stage0 * self.stage_bytes, cta.wg * 4, cta.wl, cta.lane)
        if has_c1:  # (a missing second chunk reads chunk c0's V^T again below)
            self._arrive_read(cta, stage0)
        self._stamp(cta, lead, pr, 8 + 8 * cta.wg + 4)  # "V^T loaded" (the first chunk's)
        self._rescale_o(acc_O, sAlpha[None, cta.wg], cta.lt, self.cfg.unit_rescale_skip)
        self._issue_pv_regs(acc_O, a0, p_addr, 0)
        if cutlass.const_expr(self.rows < S_ROWS and self.k_steps_regs == 0):
            # 48 rows: beside O^T's 96 registers the second chunk's V^T fits while the first's is in flight, so it
            # loads under P.V(c0) (ptxas spills for it at 64 rows, 52 bytes, and with Q in registers, 60)
            a1 = self._load_vt(cta.ring_addr + stage1 * self.stage_bytes, cta.wg * 4, cta.wl, cta.lane)
            self._arrive_read(cta, stage1)  # stage0 where the second chunk is missing
            self._wait_mma(acc_O)  # the next S's first chain and P.V(c0)
        else:
            self._wait_mma(acc_O)  # the next S's first chain and P.V(c0): a0's registers are free
            a1 = self._load_vt(cta.ring_addr + stage1 * self.stage_bytes, cta.wg * 4, cta.wl, cta.lane)
            self._arrive_read(cta, stage1)  # stage0 where the second chunk is missing
        self._issue_pv_regs(acc_O, a1, p_addr + p_buffer_bytes(self.rows, self.cfg.p_planes), 0)
        self._stamp(cta, lead, pr, 8 + 8 * cta.wg + 5)  # "P.V issued"
        self._wait_mma(acc_O)  # P.V(c1): a1's registers are free for the next S's second chain
        if cutlass.const_expr(two):
            self._issue_qk_second(acc_B, k_next, cta.q_addr)
        return new0, new1, l0 * alpha0 + csum0, l1 * alpha1 + csum1

    @cute.jit
    def _pair_pv_behind(self, cta: CTAContext, seg, acc_O: cute.Tensor, acc_S: cute.Tensor, acc_A: cute.Tensor,
                        acc_B: cute.Tensor, q_regs: cute.Tensor, sPw: cute.Tensor, sMax: cute.Tensor,
                        sAlpha: cute.Tensor, pr: Int32, m0: Float32, m1: Float32, l0: Float32, l1: Float32,
                        k_cur: Int32, behind: cutlass.Constexpr):
        """Pair pr with P.V a pair behind (`DecodeConfig.pv_behind`): S and the softmax of this warpgroup's chunk,
        with P.V of pair pr - 1 (behind) issued a dim tile of a chunk at a time between P's words, so that the
        tensor pipe runs it while the softmax does not need it; then, once it is done, O^T's rescale for pair pr
        (whose P.V the next pair issues). O^T += P.V(pr - 1) followed by O^T *= alpha(pr) is the other forms'
        O^T *= alpha(pr - 1) followed by O^T += P.V(pr - 1), one pair later: the same operations on the same
        values. With `s_under_rescale` the pair before (or the segment's start) issued S's first chain on the chunk
        at k_cur, and this pair issues the next pair's once O^T is rescaled. Returns as `_pair`, and the address of
        the next pair's chunk (k_cur where that chain is not issued here)."""
        lead = cta.tidx % WARPGROUP == 0
        if cutlass.const_expr(self.cfg.s_under_rescale):
            if cutlass.const_expr(self.cfg.s_chains == 2 and not self._both_chains_under_rescale()):
                self._issue_s(acc_B, k_cur, cta.q_addr, KV_DIM // 64, KV_DIM // 64, True, stepped_descriptors=True)
        else:
            k_cur = self._own_chunk_k_base(cta, seg, 2 * pr + cta.wg)
            self._stamp(cta, lead, pr, 8 + 8 * cta.wg + 0)  # "chunk landed"
            self._issue_qk_chains(acc_A, acc_B, q_regs, k_cur, cta.q_addr)
        self._sum_qk_chains(acc_S, acc_A, acc_B)
        self._stamp(cta, lead, pr, 8 + 8 * cta.wg + 1)  # "S done"
        pending = None
        if cutlass.const_expr(behind):
            # the first units run under the masking, the maxima and their barrier
            pending = self._pending_pv(cta, seg, pr - 1)
            for u in cutlass.range_constexpr(PV_UNITS_BEFORE_MAXIMA):
                self._pv_behind_unit(cta, acc_O, pending, u)
        new0, new1, use0, use1, alpha0, alpha1, _ = self._exchange_maxima(cta, seg, acc_S, sMax, pr, m0, m1)
        self._publish_alphas(cta, sAlpha, alpha0, alpha1)
        # the rest between P's words: after word i, unit i + PV_UNITS_BEFORE_MAXIMA. S's padding rows (48-row
        # blocks) compute their (zero) P without storing it, so that every warp issues the same wgmmas
        between = (lambda i: self._pv_behind_unit(cta, acc_O, pending, i + PV_UNITS_BEFORE_MAXIMA)) if behind \
            else None
        late = self.cfg.p_after_pv  # P's words kept in registers, stored once P.V(pr - 1) is done in both
        words = [] if late else None
        r0 = 16 * cta.wl + cta.lg
        buf = self._p_buffer(cta.wg, pr)
        csum0, csum1 = self._write_p(acc_S, sPw, cta.scale_log2, use0, use1, r0, cta.lt, buf, between,
                                     False if late else self._block_rows(cta), words)
        # P.V(pr - 1) done: O^T may be rescaled (its rows' alphas, written by other threads of the warpgroup)
        self._wait_mma(acc_O)
        if cutlass.const_expr(late):
            # ... in both warpgroups: the P buffers it read are this pair's (the barrier also orders the alphas)
            cute.arch.barrier(barrier_id=PAIR_PV_DONE_BAR, number_of_threads=SOFTMAX_THREADS)
            if cutlass.const_expr(len(words) > 0):  # (a research build without the softmax computes none)
                if self._block_rows(cta):
                    for k in cutlass.range_constexpr(CHUNK // 16):
                        for h in cutlass.range_constexpr(2):
                            sPw[4 * k + cta.lt, r0 + 8 * h, 0, buf] = words[2 * k + h]
            fence_proxy_async_smem()  # P is a wgmma operand
        else:
            cute.arch.barrier(barrier_id=PAIR_WG_BAR + cta.wg, number_of_threads=WARPGROUP)
        self._rescale_o(acc_O, sAlpha[None, cta.wg], cta.lt, self.cfg.unit_rescale_skip)
        if cutlass.const_expr(self.cfg.s_under_rescale):
            # the next pair's S (past the segment's last pair: on Q's own rows, masked whole), so that the tensor
            # pipe runs it under the P barrier and the next pair's start; its chunk must have landed by now
            k_cur = self._own_chunk_k_base(cta, seg, 2 * pr + 2 + cta.wg)
            self._stamp(cta, lead, pr + 1, 8 + 8 * cta.wg + 0)  # "chunk landed" (the next pair's)
            self._issue_s_under_rescale(acc_A, acc_B, q_regs, k_cur, cta.q_addr)
        self._pass_p_barrier(cta, pr)
        return new0, new1, l0 * alpha0 + csum0, l1 * alpha1 + csum1, k_cur

    def _both_chains_under_rescale(self) -> bool:
        """With `s_under_rescale`, whether both of the next S's chains are issued before the P barrier: at 48 rows
        (O^T 96 registers) without Q in registers; at 64 rows their 64 registers beside O^T across the loop's edge
        make ptxas spill 40 bytes and serialise the wgmmas, and beside Q's registers at 48 rows serialise them, so
        there the first chain only (the second at the next pair's start)."""
        return self.rows < S_ROWS and self.k_steps_regs == 0 and self.cfg.s_chains == 2

    @cute.jit
    def _issue_s_under_rescale(self, acc_A: cute.Tensor, acc_B: cute.Tensor, q_regs: cute.Tensor, k_base: Int32,
                               q_addr: Int32):
        """What `s_under_rescale` issues of the S of the chunk at k_base before the P barrier: both chains, or the
        first (`_both_chains_under_rescale`)."""
        if cutlass.const_expr(self._both_chains_under_rescale()):
            self._issue_qk_chains(acc_A, acc_B, q_regs, k_base, q_addr)
        else:
            self._issue_qk_first(acc_A, q_regs, k_base, q_addr, self._s_first_steps())

    def _s_first_steps(self) -> int:
        """k32 steps of S's first chain: 9 of 18 with two chains, all with one (`DecodeConfig.s_chains`)."""
        return KV_DIM // 64 * (3 - self.cfg.s_chains)

    @cute.jit
    def _pending_pv(self, cta: CTAContext, seg, pr: Int32):
        """What P.V of pair pr reads when it runs a pair behind: its chunks' stages (landed: the waits return) and
        its P buffers (2 (pr % 2) and + 1); its timeline stamps are those of pair pr + 1, which issues it."""
        stage0, stage1, has_c1 = self._pair_stages(cta, seg, pr)
        p_bytes = p_buffer_bytes(self.rows, self.cfg.p_planes)
        p_addr = cta.storage.p.data_ptr().toint() + self._p_buffer(0, pr) * p_bytes
        return PairSegment(stamp_pair=pr + 1, stage0=stage0, stage1=stage1, has_c1=has_c1, p0=p_addr,
                           p1=p_addr + p_bytes)

    @cute.jit
    def _pv_behind_unit(self, cta: CTAContext, acc_O: cute.Tensor, pending, u: cutlass.Constexpr):
        """Unit u of a pending P.V (`_pending_pv`): dim tile u % 4 of this warpgroup's 4, chunk u // 4 (a missing
        second chunk: zero P against the first's V^T); its V^T registers, loaded once at most pv_behind - 1 commit
        groups are in flight (the units' before it but the newest: their registers are then free; an S issued
        before them counts too), and its wgmmas as a commit group of their own. Each chunk's stage is released once
        its last V^T is loaded."""
        if cutlass.const_expr(u < PV_UNITS):
            c, t = u // 4, u % 4
            stage = pending.stage0 if c == 0 else pending.stage1
            if cutlass.const_expr(u >= self.cfg.pv_behind):
                wgmma_wait(self.cfg.pv_behind - 1)
            a = self._load_vt(cta.ring_addr + stage * self.stage_bytes, cta.wg * 4 + t, cta.wl, cta.lane, 1)
            if cutlass.const_expr(u == 3):
                if pending.has_c1:  # (else the second chunk reads the first's stage again)
                    self._arrive_read(cta, pending.stage0)
            if cutlass.const_expr(u == PV_UNITS - 1):
                self._arrive_read(cta, pending.stage1)  # stage0 where the second chunk is missing
                self._stamp(cta, cta.tidx % WARPGROUP == 0, pending.stamp_pair, 8 + 8 * cta.wg + 4)  # "V^T loaded"
            wgmma_fence()
            self._pv_wgmmas(acc_O, lambda tt, ks: a[ks], pending.p0 if c == 0 else pending.p1, t, 0, 1)
            wgmma_commit()
            if cutlass.const_expr(u == PV_UNITS - 1):
                self._stamp(cta, cta.tidx % WARPGROUP == 0, pending.stamp_pair, 8 + 8 * cta.wg + 5)  # "P.V issued"

    @cute.jit
    def _own_chunk_k_base(self, cta: CTAContext, seg, c: Int32, zero_tail: cutlass.Constexpr = True) -> Int32:
        """The shared address S reads this warpgroup's chunk c of the segment from (its B operand): the chunk's
        ring stage once it landed, its tail past the segment's end zeroed (unless zero_tail is false: another
        warpgroup zeroes it); for a chunk past the segment's end Q's own rows (same layout; the S is masked
        whole), which nothing rewrites within the segment."""
        C = CHUNK
        NS = self.cfg.num_stages
        bars = cta.storage.kv_full.data_ptr()
        k_base = cta.q_addr
        if c < seg.n_chunks:
            v = seg.done + c
            stage = v % NS
            cute.arch.mbarrier_wait(bars + stage, (v // NS) % 2)
            if cutlass.const_expr(zero_tail):
                n_valid = seg.tok_end - (seg.tok_begin + c * C)
                if n_valid < C:
                    # the segment's last chunk ends inside a loaded page: zero the rest before S and V^T read it
                    self._zero_tail_tokens(cta.sRing, cta.zero16, n_valid, stage, cta.tidx % WARPGROUP, WARPGROUP,
                                           cta.sRingRope)
                    fence_proxy_async_smem()
                    cute.arch.barrier(barrier_id=PAIR_WG_BAR + cta.wg, number_of_threads=WARPGROUP)
            k_base = cta.ring_addr + stage * self.stage_bytes
        return k_base

    @cute.jit
    def _issue_qk_first(self, acc: cute.Tensor, q_regs: cute.Tensor, k_base: Int32, q_addr: Int32,
                        ksteps: cutlass.Constexpr):
        """Issue (and commit) S's k32 steps [0, ksteps) of the chunk at k_base into acc, from zero: the first
        k_steps_regs with Q from registers, the rest from sQ."""
        KR = min(self.k_steps_regs, ksteps)
        if cutlass.const_expr(KR == 0):
            self._issue_s(acc, k_base, q_addr, 0, ksteps, True, stepped_descriptors=True)
        else:
            wgmma_fence()
            self._issue_s_q_registers(acc, q_regs, k_base, KR, True)
            if cutlass.const_expr(KR < ksteps):
                self._issue_s(acc, k_base, q_addr, KR, ksteps - KR, True, False, True)
            else:
                wgmma_commit()

    @cute.jit
    def _issue_qk_chains(self, acc_A: cute.Tensor, acc_B: cute.Tensor, q_regs: cute.Tensor, k_base: Int32,
                         q_addr: Int32):
        """Issue S of the chunk at k_base: two chains of 9 k32 steps (or one of 18, `DecodeConfig.s_chains`)."""
        half = KV_DIM // 64
        if cutlass.const_expr(self.cfg.s_chains == 1):
            self._issue_qk_first(acc_A, q_regs, k_base, q_addr, 2 * half)
        else:
            self._issue_qk_first(acc_A, q_regs, k_base, q_addr, half)
            self._issue_qk_second(acc_B, k_base, q_addr)

    @cute.jit
    def _issue_qk_second(self, acc_B: cute.Tensor, k_base: Int32, q_addr: Int32):
        """Issue (and commit) S's second chain of the chunk at k_base: k32 steps [9, 18), from zero."""
        half = KV_DIM // 64
        self._issue_s(acc_B, k_base, q_addr, half, half, True, stepped_descriptors=True)

    @cute.jit
    def _sum_qk_chains(self, acc_S: cute.Tensor, acc_A: cute.Tensor, acc_B: cute.Tensor):
        """Wait for S and add its chains in fp32 into acc_S."""
        wgmma_wait(0)
        for i in cutlass.range_constexpr(CHUNK // 2):
            if cutlass.const_expr(self.cfg.s_chains == 1):
                acc_S[i] = fence_operand(acc_A[i])
            else:
                acc_S[i] = fence_operand(acc_A[i]) + fence_operand(acc_B[i])

    @cute.jit
    def _softmax_pair(self, cta: CTAContext, seg, acc_S: cute.Tensor, sPw: cute.Tensor, sMax: cute.Tensor,
                      sAlpha: cute.Tensor, pr: Int32, m0: Float32, m1: Float32):
        """The softmax of this warpgroup's chunk of pair pr: `_exchange_maxima`, then `_publish_p`. Returns the
        rows' new maxima, alphas and this thread's sums of their p."""
        new0, new1, use0, use1, alpha0, alpha1, _ = self._exchange_maxima(cta, seg, acc_S, sMax, pr, m0, m1)
        csum0, csum1 = self._publish_p(cta, acc_S, sPw, sAlpha, use0, use1, alpha0, alpha1)
        self._pass_p_barrier(cta, pr)
        return new0, new1, alpha0, alpha1, csum0, csum1

    @cute.jit
    def _exchange_maxima(self, cta: CTAContext, seg, acc_S: cute.Tensor, sMax: cute.Tensor, pr: Int32,
                         m0: Float32, m1: Float32):
        """The first half of the softmax of this warpgroup's chunk of pair pr on S's accumulators (acc_S[4i + e] =
        (row r0, token 8i + 2lt + e), acc_S[4i + 2 + e] = (row r0 + 8, same token)): masking, the rows' chunk
        maxima, their exchange with the other warpgroup (ends past the maxima barrier). S's padding rows (48-row
        blocks) store no maxima. Returns the rows' new maxima, the maxima P is taken against (0 for a row that has
        seen no token), the alphas, and with `pair_rescale_skip` whether any row's max moves in the pair (the
        same in every thread of both warpgroups; else 1)."""
        wg, lt = cta.wg, cta.lt
        r0 = 16 * cta.wl + cta.lg
        lead = cta.tidx % WARPGROUP == 0
        cmax0, cmax1 = self._chunk_maxima(cta, seg, acc_S, 2 * pr + wg)
        block_rows = self._block_rows(cta)  # else S's padding rows: no maxima, P or alphas of theirs are stored
        if lt == 0 and block_rows:
            sMax[r0, wg] = cmax0
            sMax[r0 + 8, wg] = cmax1
        moved = Int32(1)
        if cutlass.const_expr(self.cfg.pair_rescale_skip):
            # a row's max moves in this pair iff one of the warpgroups' chunk maxima passes it, which a thread of
            # each holding the row sees (m0, m1 are both warpgroups' running maxima; a NaN chunk max moves none, as
            # fmax drops it below)
            mine = Int32(0)
            if cmax0 > m0:
                mine = Int32(1)
            if cmax1 > m1:
                mine = Int32(1)
            moved = barrier_any(PAIR_MAX_BAR, SOFTMAX_THREADS, mine)
        else:
            cute.arch.barrier(barrier_id=PAIR_MAX_BAR, number_of_threads=SOFTMAX_THREADS)
        self._stamp(cta, lead, pr, 8 + 8 * wg + 2)  # "maxima passed"
        other0 = -Float32.inf
        other1 = -Float32.inf
        if block_rows:
            other0 = sMax[r0, 1 - wg]
            other1 = sMax[r0 + 8, 1 - wg]
        # both warpgroups take the same max (fmax is exact and commutative)
        new0 = cute.arch.fmax(m0, cute.arch.fmax(cmax0, other0))
        new1 = cute.arch.fmax(m1, cute.arch.fmax(cmax1, other1))
        use0, use1, alpha0, alpha1 = self._reference_maxima(m0, m1, new0, new1)
        return new0, new1, use0, use1, alpha0, alpha1, moved

    @cute.jit
    def _reference_maxima(self, old0: Float32, old1: Float32, new0: Float32, new1: Float32):
        """The maxima P is taken against (0 for a row that has seen no token) and the factors exp2(old - new)
        that move O^T and the sums from the old maxima to them (0 while old is -inf: O^T is still 0)."""
        use0 = new0
        use1 = new1
        if new0 == -Float32.inf:
            use0 = Float32(0.0)
        if new1 == -Float32.inf:
            use1 = Float32(0.0)
        return (use0, use1, cute.math.exp2(old0 - use0, fastmath=True),
                cute.math.exp2(old1 - use1, fastmath=True))

    @cute.jit
    def _chunk_maxima(self, cta: CTAContext, seg, acc_S: cute.Tensor, c: Int32):
        """S of the segment's chunk c (in acc_S) masked past each row's end, and this thread's two rows' maxima
        over the chunk, in base 2."""
        C = CHUNK
        tok0 = seg.tok_begin + c * C  # past the segment's end: every token masked
        cmax0 = -Float32.inf
        cmax1 = -Float32.inf
        # both rows see the whole chunk (all chunks but a segment's last and the causal edge): no compares
        if tok0 + C <= cutlass.min(seg.row_end0, seg.row_end1):
            cmax0, cmax1 = self._mask_max(cta, acc_S, tok0, None)
        else:
            cmax0, cmax1 = self._mask_max(cta, acc_S, tok0, seg)
        # the rows' maxima in base 2: rounding is monotone, so max(s) x scale_log2 is the max of the s x scale_log2
        # (scale_log2 > 0), with 2 multiplies a row instead of 16 (`_write_p` scales inside its FMA)
        cmax0 = self._row_allreduce(cmax0, True, QUAD) * cta.scale_log2
        cmax1 = self._row_allreduce(cmax1, True, QUAD) * cta.scale_log2
        return cmax0, cmax1

    @cute.jit
    def _publish_p(self, cta: CTAContext, acc_S: cute.Tensor, sPw: cute.Tensor, sAlpha: cute.Tensor, use0: Float32,
                   use1: Float32, alpha0: Float32, alpha1: Float32):
        """The second half: P of this warpgroup's chunk into P buffer wg and, unless `early_rescale` published
        them before, the pair's alphas into sAlpha[:, wg] (none for S's padding rows), before the P barrier
        (`_pass_p_barrier`). Returns this thread's sums of its rows' p."""
        wg, lt = cta.wg, cta.lt
        r0 = 16 * cta.wl + cta.lg
        if cutlass.const_expr(self.k_steps_regs == 0):
            # S's padding rows (warp 3 at 48 rows, every token masked: p = 0) compute P too and store none: under
            # a branch P's exp2 could not interleave with the rescale before it (`early_rescale`)
            csum0, csum1 = self._write_p(acc_S, sPw, cta.scale_log2, use0, use1, r0, lt, wg,
                                         store=self._block_rows(cta))
        else:
            # beside Q's registers that form spills (44 bytes): the padding rows skip P
            csum0 = Float32(0.0)
            csum1 = Float32(0.0)
            if self._block_rows(cta):
                csum0, csum1 = self._write_p(acc_S, sPw, cta.scale_log2, use0, use1, r0, lt, wg)
        if cutlass.const_expr(not self.cfg.early_rescale):
            self._publish_alphas(cta, sAlpha, alpha0, alpha1)
        return csum0, csum1

    @cute.jit
    def _publish_alphas(self, cta: CTAContext, sAlpha: cute.Tensor, alpha0: Float32, alpha1: Float32):
        """This thread's rows' alphas into sAlpha[:, wg] (one thread a quad; none for S's padding rows)."""
        r0 = 16 * cta.wl + cta.lg
        if cta.lt == 0 and self._block_rows(cta):
            sAlpha[r0, cta.wg] = alpha0
            sAlpha[r0 + 8, cta.wg] = alpha1

    @cute.jit
    def _pass_p_barrier(self, cta: CTAContext, pr: Int32):
        """Both warpgroups' P and alphas of pair pr written (`_publish_p`)."""
        cute.arch.barrier(barrier_id=PAIR_P_BAR, number_of_threads=SOFTMAX_THREADS)
        self._stamp(cta, cta.tidx % WARPGROUP == 0, pr, 8 + 8 * cta.wg + 3)  # "P barrier passed"

    @cute.jit
    def _mask_max(self, cta: CTAContext, acc_S: cute.Tensor, tok0: Int32, masked_by):
        """S's accumulators with each row's tokens at or past its end -inf where masked_by (the segment) is
        given, and this thread's maxima of its two rows (of S, not yet in base 2)."""
        C = CHUNK
        row0, row1 = [], []
        for i in cutlass.range_constexpr(C // 8):
            for e in cutlass.range_constexpr(2):
                n = 8 * i + 2 * cta.lt + e
                s0 = acc_S[4 * i + e]
                s1 = acc_S[4 * i + 2 + e]
                if cutlass.const_expr(masked_by is not None):
                    if tok0 + n >= masked_by.row_end0:
                        s0 = -Float32.inf
                    if tok0 + n >= masked_by.row_end1:
                        s1 = -Float32.inf
                acc_S[4 * i + e] = s0
                acc_S[4 * i + 2 + e] = s1
                row0.append(s0)
                row1.append(s1)
        return max_tree(row0), max_tree(row1)

    @cute.jit
    def _pair_stages(self, cta: CTAContext, seg, pr: Int32):
        """The ring stages of pair pr's chunks, both landed (the other warpgroup's chunk: its owner waited, so
        the wait returns), and whether the second exists (else its stage is the first's)."""
        NS = self.cfg.num_stages
        bars = cta.storage.kv_full.data_ptr()
        v0 = seg.done + 2 * pr
        stage0 = v0 % NS
        stage1 = stage0
        phase1 = (v0 // NS) % 2
        has_c1 = 2 * pr + 1 < seg.n_chunks
        if has_c1:
            stage1 = (v0 + 1) % NS
            phase1 = ((v0 + 1) // NS) % 2
        cute.arch.mbarrier_wait(bars + stage0, (v0 // NS) % 2)
        cute.arch.mbarrier_wait(bars + stage1, phase1)
        return stage0, stage1, has_c1

    @cute.jit
    def _arrive_read(self, cta: CTAContext, stage: Int32):
        """This thread's reads of a ring stage are done: an arrival on its "read" mbarrier, and with `kv_multicast`
        on the other CTA's of the cluster as well, whose load warp multicasts into this CTA's stage in its turn."""
        bar = cta.storage.kv_full.data_ptr() + self.cfg.num_stages + stage
        cute.arch.mbarrier_arrive(bar)
        if cutlass.const_expr(self.cfg.kv_multicast):
            mbarrier_arrive_peer(bar.toint(), 1 - cute.arch.block_idx()[0] % 2)

    @cute.jit
    def _release_pair_stages(self, cta: CTAContext, stage0: Int32, stage1: Int32, has_c1):
        """This thread's reads of pair pr's chunks are done (their S waited for, V^T in registers): arrive on the
        stages' "read" mbarriers."""
        self._arrive_read(cta, stage0)
        if has_c1:
            self._arrive_read(cta, stage1)

    @cute.jit
    def _write_p(self, acc_S: cute.Tensor, sPw: cute.Tensor, scale_log2: Float32, use0: Float32, use1: Float32,
                 r0: Int32, lt: Int32, buf: Int32, between=None, store=True, words=None):
        """P = exp2(s x scale_log2 - max) of this thread's values of rows r0 and r0 + 8 as e4m3 words (x p_scale;
        one plane, or hi and lo) into P buffer buf: word 4k + lt of a row is tokens 16k + 2lt + (0, 1, 8, 9), the
        pi order of the P.V A registers (`decode_mma`), which are this thread's acc_S[8k + (0, 1, 4, 5)] (row r0)
        and [8k + (2, 3, 6, 7)] (row r0 + 8); nothing is stored where store is false, and the words (one plane) are
        appended to the list `words` where given (word 2k + h: row r0 + 8h, word 4k + lt of the row). between(i),
        where given, is traced after word i of the thread's 8 (`_pair_pv_behind`). Returns the thread's sums of the
        two rows' p x p_scale."""
        # p * p_scale = exp2(s x scale_log2 - max + log2(p_scale)), one FMA and the exp2: P's scale inside the exp2
        # (p_scale is a power of two), so the sums are in units of p_scale too (`_end_segment` takes it out)
        shift = math.log2(self.cfg.p_scale)
        n_mufu = 4 - self.cfg.p_exp2_fma  # of each 4 values, the rest on the FMA pipe (`p_exp2_fma`, research)
        csum0 = Float32(0.0)
        csum1 = Float32(0.0)
        if cutlass.const_expr(self.cfg.runs("softmax")):  # else a research build: P is not written
            for k in cutlass.range_constexpr(CHUNK // 16):
                for h in cutlass.range_constexpr(2):
                    use = (use0 if h == 0 else use1) - shift
                    pv = [cute.math.exp2(acc_S[8 * k + 2 * h + d] * scale_log2 - use, fastmath=True) if j < n_mufu
                          else exp2_fma(acc_S[8 * k + 2 * h + d] * scale_log2 - use)
                          for j, d in enumerate((0, 1, 4, 5))]
                    part = (pv[0] + pv[1]) + (pv[2] + pv[3])
                    if h == 0:
                        csum0 = csum0 + part
                    else:
                        csum1 = csum1 + part
                    row = r0 + 8 * h
                    if cutlass.const_expr(self.cfg.p_planes == 2):
                        hi, lo = quantize_p_hi_lo(pv[0], pv[1], pv[2], pv[3])
                        if store:
                            sPw[4 * k + lt, row, 0, buf] = hi
                            sPw[4 * k + lt, row, 1, buf] = lo
                    else:
                        word = quantize_p_e4m3(pv[0], pv[1], pv[2], pv[3])
                        if store:
                            sPw[4 * k + lt, row, 0, buf] = word
                        if cutlass.const_expr(words is not None):
                            words.append(word)
                    if cutlass.const_expr(between is not None):
                        between(2 * k + h)
            if cutlass.const_expr(store is not False):  # (nothing stored: the caller stores the words and fences)
                fence_proxy_async_smem()  # P is a wgmma operand
        elif cutlass.const_expr(between is not None):
            for i in cutlass.range_constexpr(8):
                between(i)
        return csum0, csum1

    def _block_rows(self, cta: CTAContext):
        """Whether this thread's two S rows (16 wl + lg, + 8) are rows of the block, not S's padding (warp 3 of
        each MMA warpgroup at 48 rows)."""
        return True if self.rows == S_ROWS else 16 * cta.wl < self.rows

    @cute.jit
    def _end_segment(self, cta: CTAContext, acc_O: cute.Tensor, sSum: cute.Tensor, m0: Float32, m1: Float32,
                     l0: Float32, l1: Float32, b: Int32, split, slot: Int32):
        """A segment's rows: each row's sum over its quad and both warpgroups, its lse and output scale
        (warpgroup 0), then both warpgroups' dims of the output or partial."""
        wg, wl, lg, lt = cta.wg, cta.wl, cta.lg, cta.lt
        r0 = 16 * wl + lg
        l0 = self._row_allreduce(l0, False, QUAD)
        l1 = self._row_allreduce(l1, False, QUAD)
        block_rows = self._block_rows(cta)
        if wg == 1 and lt == 0 and block_rows:
            sSum[r0] = l0
            sSum[r0 + 8] = l1
        cute.arch.barrier(barrier_id=PAIR_SUM_BAR, number_of_threads=SOFTMAX_THREADS)
        if wg == 0 and lt == 0 and block_rows:
            unit = 1.0 / self.cfg.p_scale  # the sums are in units of p_scale (`_write_p`); exact, a power of two
            self._finish_row(m0, (l0 + sSum[r0]) * unit, cta.k_scale, cta.sInvL, cta.mLse, cta.mPLse, r0,
                             cta.row0 + r0, b, split, slot)
            self._finish_row(m1, (l1 + sSum[r0 + 8]) * unit, cta.k_scale, cta.sInvL, cta.mLse, cta.mPLse, r0 + 8,
                             cta.row0 + r0 + 8, b, split, slot)
        cute.arch.barrier(barrier_id=PAIR_SUM_BAR, number_of_threads=SOFTMAX_THREADS)  # sInvL written
        self._write_rows(acc_O, cta.sInvL, cta.mOut, cta.mPOut, cta.row0, b, split, slot, wg, wl, lg, lt, 4)
