"""Static configuration of every kernel, the policies that pick one for a shape, and the environment switches.

A kernel is compiled once per configuration: a frozen dataclass (`DecodeConfig`, `CombineConfig`, `PlannerConfig`)
that holds every compile-time choice, resolved here and nowhere else. `jit_cache` keys its cache by these
objects, and the kernels read their static choices from them.

The environment switches are read once, on first use (`environment()`), and only become defaults of the
configurations built afterwards; no launch path reads the environment. README lists them:

| variable | values | effect |
| --- | --- | --- |
| `CUTE_MLA_P_PRECISION` | `fp8`, `fp8x2` | default of the op's `p_precision` (an explicit argument wins) |
| `CUTE_MLA_PDL` | `1` (default), `0` | programmatic dependent launch of the planner, decode and combine kernels |
| `CUTE_MLA_KERNEL_CACHE` | a directory | compiled kernels are loaded from there, and written there when compiled |
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from typing import FrozenSet, Mapping, Optional

from .shapes import SUPPORTED_PAGE_SIZES, check_shape, default_rows_per_block

# ---------------------------------------------------------------------------------------------- precision
# How the softmax probabilities P enter the FP8 P.V MMA (README, docs/performance.md "Numerics"):
# - "fp8": one e4m3 plane wherever that is faster (blocks of more than 16 query rows); relative L2 error against
#   the fp32 reference 3-9e-3, the level of FlashMLA's dense FP8 kernel on the same inputs;
# - "fp8x2": two planes, hi = e4m3(p) and lo = e4m3(p - hi), everywhere: the bf16 output's own rounding
#   (1.6-1.9e-3), at up to twice the P.V tensor work.
# 16-row blocks (the memory-bound TP8 decode) take two planes in either mode: one measured no faster there.
P_PRECISIONS = ("fp8", "fp8x2")
DEFAULT_P_PRECISION = "fp8"
# P is stored as e4m3(p * P_SCALE): p in [2^-14, 1] stays in e4m3's normal range, p * 256 <= 448
P_SCALE = 256.0


def check_p_precision(value, name: str = "p_precision") -> str:
    if value not in P_PRECISIONS:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, P_PRECISIONS))}, got {value!r}")
    return value


# --------------------------------------------------------------------------------------------- environment
P_PRECISION_ENV = "CUTE_MLA_P_PRECISION"
PDL_ENV = "CUTE_MLA_PDL"
KERNEL_CACHE_ENV = "CUTE_MLA_KERNEL_CACHE"


@dataclass(frozen=True)
class Environment:
    p_precision: str = DEFAULT_P_PRECISION
    pdl: bool = True
    kernel_cache: Optional[str] = None


def read_environment(environ: Mapping[str, str] = os.environ) -> Environment:
    """The switches of `environ` (README's table), each checked with an error naming the variable."""
    p_precision = environ.get(P_PRECISION_ENV, "").strip() or DEFAULT_P_PRECISION
    check_p_precision(p_precision, P_PRECISION_ENV)
    pdl = environ.get(PDL_ENV, "1").strip()
    if pdl not in ("0", "1"):
        raise ValueError(f"{PDL_ENV} must be 0 or 1, got {pdl!r}")
    cache = environ.get(KERNEL_CACHE_ENV, "").strip() or None
    return Environment(p_precision=p_precision, pdl=pdl == "1", kernel_cache=cache)


_environment: Optional[Environment] = None


def environment() -> Environment:
    """The process's switches, read from os.environ the first time they are needed."""
    global _environment
    if _environment is None:
        _environment = read_environment()
    return _environment

# ------------------------------------------------------------------------------------------------- decode
DECODE_ARCHS = ("sm_90a",)
# Research switches of the decode kernel (benchmarks/ablate_decode.py): parts of each chunk's work left out, so
# that timing the rest says what they cost. The outputs are then wrong.
DECODE_PARTS = ("load", "s", "store_s", "softmax", "rescale", "pv")
# How the S^T-warpgroup schedule brings the KV chunks into shared memory: 16-byte cp.async by its 128 threads, or
# TMA boxes issued by one thread and completed on per-stage mbarriers (`hopper/decode_swg_tma.py`).
KV_LOADS = ("cp_async", "tma")
# setmaxnreg budgets the chunk-pairs schedule's two MMA warpgroups may take (`DecodeConfig.mma_registers`): 232
# leaves its load warpgroup 40 of a 384-thread launch's 3 x 168, 240 leaves it 24 (setmaxnreg's least)
PAIRS_MMA_REGISTERS = (232, 240)
# Where that TMA schedule waits S_FREE(j - 1) and issues chunk j + NS - 1: while S^T(j) runs (the default), or
# after S^T(j) is stored and S_FULL(j) arrived (`decode_swg_tma.py`).
KV_REFILLS = ("under_s", "after_store")
# Tokens per TMA box of the KV: 32 (a half chunk; five boxes of 128 bytes per half, ten per chunk), or 64 (a whole
# chunk on one page: the four latent blocks as one box and the rope as another). Boxes start where chunks do, at
# the segments' tile starts, so TMA needs tiles of a multiple of 32 tokens (64 for the whole-chunk boxes, which
# also need pages of 64).
KV_BOX_TOKENS = (32, 64)
# How the softmax / P.V warpgroups of 48 and 64 rows rescale O^T and issue P.V: all of O^T, then every wgmma
# ("whole"), or a dim tile at a time, the multiplies of the next tile under the wgmmas of this one ("per_tile";
# `default_pv_order`).
PV_ORDERS = ("whole", "per_tile")
# Bytes a row of the rope's block in the ring and Q (`DecodeConfig.rope_rows`): 128 (its own 128B-swizzled rows, the
# last 64 bytes zero, like the latent's four blocks) or 64 (64B-swizzled rows of its 64 bytes).
ROPE_ROWS = (128, 64)
# The chunk-pairs schedule's MMA warpgroups a phase apart (`DecodeConfig.pair_stagger`): when the follower issues
# its S, by value
PAIR_STAGGERS = {0: "off", 1: "once the leader's S is done", 2: "once the leader's S is issued"}
TIMELINE_CHUNKS = 40  # chunks stamped per CTA by a timeline build (benchmarks/timeline_decode.py)


@dataclass(frozen=True)
class DecodeConfig:
    """Everything the SM90 decode kernel is compiled for.

    rows_per_block 16 runs the ping-pong schedule (`hopper/decode_rows16.py`), 64 the chunk-pairs schedule
    (`chunk_pairs`, below; `default_chunk_pairs`), 32 and 48 (and 64 with chunk_pairs=False) the S^T-warpgroup
    schedule, its KV by TMA (`hopper/decode_swg_tma.py`, the default) or by cp.async (`kv_loads="cp_async"`,
    `hopper/decode_swg.py`); `kv_refill` orders the TMA schedule's refills and `kv_box_tokens` sizes its boxes
    (KV_BOX_TOKENS). `lazy_rescale` (research) keeps each row's reference max until a chunk's max passes it by
    more than P's headroom in e4m3 (`softmax.rescale_slack`), so that most chunks rescale no row and the O^T
    rescale of a thread whose alphas are all 1 is skipped; the default moves it with every new max, which keeps
    the top token's p exactly 1 (lazily it lies in [1, 1.7) and takes e4m3's rounding like the others).
    `unit_rescale_skip` (research) keeps the default's max and skips the O^T rescale of a thread whose alphas are
    all 1 (exact: alpha is 1 where a row's max did not move), as the 16-row ping-pong always does.
    `s_chains` (research) is the number of wgmma accumulator chains S^T's 18 k32 steps run as: 2 (the default, two
    chains of 9 summed in fp32, for the accuracy of FP8 accumulation) or 1 (one chain of 18); `q_in_registers`
    (research, 64 rows, TMA; one S chain unless s_chains=2 is asked for) runs S = Q.K^T with Q in the S warpgroup's
    registers (`hopper/decode_swg_qregs.py`). `chunk_pairs` (64 rows' default, research at 48; TMA, 4 ring stages, 5
    with `default_deep_ring`, unless asked otherwise) runs the chunk-pairs schedule (`hopper/decode_pairs.py`): S
    and the softmax in the P.V warpgroups' registers, two chunks a pair; `s_ahead` (research, 4 stages) issues each
    pair's S during the previous pair there, and `q_in_registers` there (48 rows) keeps Q's first 8 k32 steps in the
    MMA warpgroups' registers (two S chains unless asked otherwise); `p_exp2_fma` (research, 0-4) computes that many
    of each 4 P values' exp2 by a polynomial on the FMA pipe (`ptx.exp2_fma`) instead of MUFU, and `mma_registers`
    (research, PAIRS_MMA_REGISTERS) sets its MMA warpgroups' register budget; `own_chunk_first` (research) has each
    warpgroup run P.V of its own chunk of a pair before the other's, ahead of the barrier on the other's P, and
    `early_rescale` (the phase-after-phase form's default with one P plane, `default_early_rescale`; research in the
    S^T-warpgroup schedule at 48 and 64 rows) rescales O^T beside P's exp2 instead of after the P barrier, and
    with it `pair_rescale_skip` (research) has the maxima barrier also tell both warpgroups whether any row's max
    moves in the pair (`ptx.barrier_any`), and where none does skips the alphas' publication, its barrier and O^T's
    rescale in every thread alike (exact: every alpha is then 1, or 0 on an O^T that is still 0; on an H100 5-13%
    slower: P's window is not shortened by its multiplies, experiments.md), and with it `pair_stagger` (research,
    64 rows, one P plane; PAIR_STAGGERS) runs the two MMA warpgroups a phase apart
    (`hopper/decode_pairs_stagger.py`), so that each one's softmax runs under the other's MMAs;
    `pv_behind` (research, 1-4; one P plane, 4 stages) runs each pair's P.V during the next pair, a dim tile of a
    chunk at a time between its P's words with at most that many in flight, so that the tensor pipe has work while
    the softmax runs (the same arithmetic in the same order), and with `s_under_rescale` (research) issues the next
    pair's S (at 64 rows its first chain) before the P barrier instead of after it; `kv_prefetch` (research, 0-8)
    has its load warp prefetch the chunk that many ahead of each TMA load into L2 (`ptx.prefetch_l2_bulk`), before
    it waits for that load's stage; `kv_load_copies` (research, 1 or 2) issues each chunk's boxes that many times into
    its stage (the same bytes again, from L2): what another pass of the KV from L2 into the SMs costs, the traffic a
    second row block adds and TMA multicast would save; `kv_multicast` (an even number of row blocks;
    `default_kv_multicast`) launches the row blocks in 2-CTA clusters, each pair of the same plan CTA and trimming its
    segments (causal) at the pair's last query position, whose load warps take turns issuing a chunk's boxes, multicast
    into both CTAs' stages: one L2 read of each chunk for two row blocks. `rope_rows` (64 with `default_deep_ring`; the
    chunk_pairs schedule with whole-chunk boxes) keeps the rope of the ring's chunks and of Q in 64-byte rows in the 64B
    swizzle instead of 128-byte rows half zero (36 KB stages instead of 40), and `p_after_pv` (research, with pv_behind)
    keeps each pair's P words in registers until P.V of the pair before is done in both MMA warpgroups and stores them
    then, into one pair's P buffers instead of two pairs': with both, 5 ring stages fit at 64 rows with P.V a pair
    behind.
    `pv_second_per_tile` (research; the phase-after-phase form at 48 rows, where all of the second chunk's V^T loads
    under the first chunk's P.V) loads that V^T a dim tile at a time and issues each tile's P.V wgmmas as soon as
    its registers are there, instead of after the last tile (the same wgmmas in the same order). `s_between_pv`
    (research; the phase-after-phase form at 64 rows) issues the next pair's first S chain (its only one with
    `s_chains=1`) between this pair's two chunks' P.V, once the first chunk's is done, so that the tensor pipe
    runs it while the rest of the second chunk's V^T loads (the same arithmetic in the same order). `s_after_pv`
    (research; the phase-after-phase form at 64 rows, two S chains) issues the next pair's first S chain right
    behind this pair's last P.V wgmmas, and its second once that P.V is done, so that the tensor pipe goes from P.V
    to S without a wait and an issue between them (the same arithmetic in the same order). `stages_under_s` (the
    phase-after-phase form's default, `default_stages_under_s`) waits for both chunks of a pair to land while its
    S runs instead of past the maxima barrier. `vt_smem`
    (research; the phase-after-phase form at 64 rows, 3 ring stages of 36 KB) has each MMA warpgroup transpose its
    own chunk of a pair into a V^T buffer in shared memory while its S runs, so that P.V reads V^T as a
    shared-memory operand: no V^T loads between the P barrier and P.V, and no V^T registers (the same arithmetic in
    the same order). `poison_smem` (a
    check for tests) sets every byte of the CTA's shared memory to 0xFF (NaN as e4m3, fp16 and fp32) before the
    kernel uses it: a read of shared memory that the launch did not write, whose value would otherwise be whatever
    the SM's previous kernel left there, then shows in the outputs. `skip` and `timeline` are research builds
    (benchmarks/): `skip` leaves parts of the work out, `timeline` stores SM clock stamps of chunks [timeline,
    timeline + TIMELINE_CHUNKS) of each stamped CTA into the workspace's last slot."""

    num_heads: int
    q_len: int
    page_size: int
    tile_tokens: int
    causal: bool
    rows_per_block: int
    num_stages: int
    p_planes: int
    pdl: bool
    arch: str = "sm_90a"
    p_scale: float = P_SCALE
    skip: FrozenSet[str] = field(default_factory=frozenset)
    timeline: Optional[int] = None
    kv_loads: str = "cp_async"
    kv_refill: str = KV_REFILLS[0]
    kv_box_tokens: int = 32
    pv_order: str = PV_ORDERS[0]
    lazy_rescale: bool = False
    unit_rescale_skip: bool = False
    poison_smem: bool = False
    s_chains: int = 2
    q_in_registers: bool = False
    chunk_pairs: bool = False
    s_ahead: bool = False
    p_exp2_fma: int = 0
    mma_registers: int = 0
    own_chunk_first: bool = False
    early_rescale: bool = False
    pv_behind: int = 0
    s_under_rescale: bool = False
    kv_prefetch: int = 0
    kv_load_copies: int = 1
    kv_multicast: bool = False
    rope_rows: int = 128
    p_after_pv: bool = False
    pv_second_per_tile: bool = False
    s_between_pv: bool = False
    s_after_pv: bool = False
    stages_under_s: bool = False
    vt_smem: bool = False
    pair_rescale_skip: bool = False
    pair_stagger: int = 0

    def __post_init__(self):
        if self.page_size <= 0 or self.page_size & (self.page_size - 1):
            raise ValueError(f"page_size must be a power of two, got {self.page_size}")
        if self.tile_tokens <= 0 or (self.tile_tokens % self.page_size and self.page_size % self.tile_tokens):
            raise ValueError(f"tile_tokens ({self.tile_tokens}) and page_size ({self.page_size}) must divide one "
                             f"another")
        if self.rows_per_block not in (16, 32, 48, 64):
            raise ValueError(f"rows_per_block must be 16, 32, 48 or 64, got {self.rows_per_block}")
        if self.rows_per_block == 16 and self.num_stages != 4:
            raise ValueError("16-row blocks (the ping-pong schedule) run 4 ring stages, 2 per warpgroup")
        if self.num_stages < 3:
            raise ValueError(f"num_stages must be at least 3 (chunks ci, ci + 1 in use, one in flight), got "
                             f"{self.num_stages}")
        if self.p_planes not in (1, 2):
            raise ValueError(f"p_planes must be 1 (e4m3 P) or 2 (hi/lo e4m3 P), got {self.p_planes}")
        if self.arch not in DECODE_ARCHS:
            raise ValueError(f"arch must be one of {DECODE_ARCHS}, got {self.arch!r}")
        if self.timeline is not None and (self.rows_per_block == 16 or self.timeline < 0):
            raise ValueError("timeline builds stamp the S^T-warpgroup schedule (32-64 rows) from a chunk >= 0")
        if self.kv_loads not in KV_LOADS:
            raise ValueError(f"kv_loads must be one of {KV_LOADS}, got {self.kv_loads!r}")
        if self.kv_loads == "tma" and self.rows_per_block == 16:
            raise ValueError("kv_loads='tma' is a load path of the S^T-warpgroup schedule (32-64 rows)")
        if self.kv_loads == "tma" and self.tile_tokens % KV_BOX_TOKENS[0]:
            raise ValueError(f"kv_loads='tma' needs tile_tokens a multiple of {KV_BOX_TOKENS[0]} (chunks start at "
                             f"tile starts, the TMA boxes with them), got {self.tile_tokens}")
        if self.kv_box_tokens not in KV_BOX_TOKENS:
            raise ValueError(f"kv_box_tokens must be one of {KV_BOX_TOKENS}, got {self.kv_box_tokens}")
        if self.kv_box_tokens == 64 and (self.page_size % 64 or self.tile_tokens % 64):
            raise ValueError(f"kv_box_tokens=64 needs pages and tiles of a multiple of 64 tokens, got page_size "
                             f"{self.page_size}, tile_tokens {self.tile_tokens}")
        if self.kv_refill not in KV_REFILLS:
            raise ValueError(f"kv_refill must be one of {KV_REFILLS}, got {self.kv_refill!r}")
        if self.pv_order not in PV_ORDERS:
            raise ValueError(f"pv_order must be one of {PV_ORDERS}, got {self.pv_order!r}")
        if self.pv_order == "per_tile" and (self.rows_per_block not in (48, 64) or self.skips_unit_rescale):
            raise ValueError("pv_order='per_tile' is an order of 48- and 64-row blocks without lazy_rescale or "
                             "unit_rescale_skip")
        if self.s_chains not in (1, 2):
            raise ValueError(f"s_chains must be 1 or 2 (accumulator chains of S^T's k steps), got {self.s_chains}")
        if self.q_in_registers and not self.chunk_pairs and (self.rows_per_block != 64 or self.kv_loads != "tma"):
            raise ValueError("q_in_registers is a form of the TMA S^T-warpgroup schedule for 64-row blocks (and of "
                             "chunk_pairs)")
        if self.chunk_pairs and (self.rows_per_block not in (48, 64) or self.kv_loads != "tma"
                                 or self.lazy_rescale or self.pv_order != "whole" or self.skip & {"store_s"}):
            raise ValueError("chunk_pairs is a schedule of 48- and 64-row blocks with the KV by TMA, without "
                             "lazy_rescale, pv_order='per_tile' or skip={'store_s'}")
        if self.chunk_pairs and self.q_in_registers and self.rows_per_block != 48:
            raise ValueError("q_in_registers with chunk_pairs is for 48-row blocks (at 64 rows Q's fragments do not "
                             "fit beside O^T)")
        if self.s_ahead and not self.chunk_pairs:
            raise ValueError("s_ahead is a form of the chunk_pairs schedule")
        if self.s_ahead and self.num_stages < 4:
            # the next pair's chunks must land before this pair releases its own (`hopper/decode_pairs.py`)
            raise ValueError(f"s_ahead needs 4 ring stages (two pairs), got num_stages={self.num_stages}")
        if not 0 <= self.p_exp2_fma <= 4 or (self.p_exp2_fma and not self.chunk_pairs):
            raise ValueError(f"p_exp2_fma is 0 to 4 (of each 4 P values, those whose exp2 runs on the FMA pipe) in "
                             f"the chunk_pairs schedule, got {self.p_exp2_fma}")
        if self.mma_registers and (not self.chunk_pairs or self.mma_registers not in PAIRS_MMA_REGISTERS):
            raise ValueError(f"mma_registers is one of {PAIRS_MMA_REGISTERS} (the chunk_pairs schedule's MMA "
                             f"warpgroups' setmaxnreg budget; 0: the schedule's own), got {self.mma_registers}")
        if self.own_chunk_first and (not self.chunk_pairs or self.s_ahead):
            raise ValueError("own_chunk_first is an order of the chunk_pairs schedule's phase-after-phase form")
        if self.early_rescale and (self.s_ahead if self.chunk_pairs else
                                   (self.rows_per_block not in (48, 64) or self.pv_order != "whole"
                                    or self.lazy_rescale or self.unit_rescale_skip or self.q_in_registers)):
            raise ValueError("early_rescale is an order of the chunk_pairs schedule's phase-after-phase form and of "
                             "the S^T-warpgroup schedule at 48 and 64 rows (P.V issued whole, without lazy_rescale, "
                             "unit_rescale_skip or q_in_registers)")
        if not 0 <= self.pv_behind <= 4:
            raise ValueError(f"pv_behind is 0 (off) or 1 to 4 (P.V units in flight under the softmax), got "
                             f"{self.pv_behind}")
        if self.pv_behind and (not self.chunk_pairs or self.s_ahead or self.own_chunk_first or self.early_rescale
                               or self.p_planes != 1 or self.num_stages < 4):
            # 4 stages: a pair's chunks are read by its P.V during the next pair, whose own chunks must be loaded
            # meanwhile; one plane: the P buffers of two pairs (`hopper/decode_pairs.py`)
            raise ValueError("pv_behind is a form of the chunk_pairs schedule with one P plane and 4 ring stages, "
                             "without s_ahead, own_chunk_first or early_rescale")
        if self.s_under_rescale and not self.pv_behind:
            raise ValueError("s_under_rescale is an order of pv_behind")
        if not 0 <= self.kv_prefetch <= 8 or (self.kv_prefetch and not self.chunk_pairs):
            raise ValueError(f"kv_prefetch is 0 (off) to 8 (chunks ahead of its TMA load prefetched into L2) in the "
                             f"chunk_pairs schedule, got {self.kv_prefetch}")
        if self.kv_load_copies not in (1, 2) or (self.kv_load_copies != 1 and not self.chunk_pairs):
            raise ValueError(f"kv_load_copies is 1 or 2 (times each chunk's boxes are issued) in the chunk_pairs "
                             f"schedule, got {self.kv_load_copies}")
        if self.kv_multicast and not self.loads_can_multicast:
            raise ValueError("kv_multicast is a form of the chunk_pairs schedule's loads for an even number of row "
                             "blocks, without kv_load_copies, kv_prefetch, pair_stagger, vt_smem or skip={'load'}")
        if self.rope_rows not in ROPE_ROWS or (self.rope_rows != ROPE_ROWS[0] and not (self.chunk_pairs and
                                                                                    self.kv_box_tokens == 64)):
            raise ValueError(f"rope_rows is one of {ROPE_ROWS} (bytes a row of the rope's block), and 64 a layout of "
                             f"the chunk_pairs schedule with whole-chunk boxes (kv_box_tokens=64), got "
                             f"{self.rope_rows}")
        if self.p_after_pv and not self.pv_behind:
            raise ValueError("p_after_pv is an order of pv_behind")
        if self.pv_second_per_tile and (not self.chunk_pairs or self.rows_per_block != 48 or self.s_ahead
                                        or self.pv_behind or self.own_chunk_first or self.q_in_registers):
            raise ValueError("pv_second_per_tile is an order of the chunk_pairs schedule's phase-after-phase form at "
                             "48 rows, without own_chunk_first or q_in_registers")
        if self.s_between_pv and (not self.chunk_pairs or self.rows_per_block != 64 or self.s_ahead
                                  or self.pv_behind or self.own_chunk_first or self.num_stages < 4):
            # 64 rows: there the second chunk's V^T loads in two parts with a wait for P.V(c0) between, where the
            # chain goes; 4 stages: the next pair's chunk must land before this pair releases its own
            raise ValueError("s_between_pv is an order of the chunk_pairs schedule's phase-after-phase form at 64 "
                             "rows with 4 or more ring stages, without own_chunk_first")
        if self.s_after_pv and (not self.chunk_pairs or self.rows_per_block != 64 or self.s_ahead or self.pv_behind
                                or self.own_chunk_first or self.s_between_pv or self.s_chains != 2):
            # ptxas spills beside O^T and V^T(c1) with one chain (all of S's 64 registers), 84 bytes, and at 48 rows,
            # where both chunks' V^T are in flight there, 28
            raise ValueError("s_after_pv is an order of the chunk_pairs schedule's phase-after-phase form at 64 rows "
                             "with two S chains, without own_chunk_first or s_between_pv")
        if self.stages_under_s and (not self.chunk_pairs or self.s_ahead or self.pv_behind or self.pair_stagger
                                    or self.vt_smem):
            raise ValueError("stages_under_s is an order of the chunk_pairs schedule's phase-after-phase form, without "
                             "vt_smem (which waits there already)")
        if self.vt_smem and (not self.chunk_pairs or self.rows_per_block != 64 or self.s_ahead or self.pv_behind
                             or self.own_chunk_first or self.s_between_pv or self.s_after_pv
                             or self.q_in_registers or self.num_stages != 3 or self.rope_rows != 64):
            # 3 stages of 36 KB: the two chunks' V^T buffers (64 KB) take the room of two more
            raise ValueError("vt_smem is a form of the chunk_pairs schedule's phase-after-phase form at 64 rows with "
                             "3 ring stages of 64-byte rope rows (rope_rows=64), without own_chunk_first, "
                             "s_between_pv, s_after_pv or q_in_registers")
        if self.pair_rescale_skip and (not self.chunk_pairs or not self.early_rescale or self.unit_rescale_skip):
            raise ValueError("pair_rescale_skip is a form of early_rescale in the chunk_pairs schedule, without "
                             "unit_rescale_skip")
        if self.pair_stagger not in PAIR_STAGGERS:
            forms = "; ".join(f"{k}: {v}" for k, v in PAIR_STAGGERS.items())
            raise ValueError(f"pair_stagger is one of {tuple(PAIR_STAGGERS)} ({forms}), got {self.pair_stagger}")
        if self.pair_stagger and (not self.chunk_pairs or self.rows_per_block != 64 or not self.early_rescale
                                  or self.p_planes != 1 or self.s_chains != 2 or self.unit_rescale_skip
                                  or self.pair_rescale_skip or self.own_chunk_first or self.s_between_pv
                                  or self.s_after_pv or self.vt_smem):
            raise ValueError("pair_stagger is a form of early_rescale in the chunk_pairs schedule at 64 rows with one "
                             "P plane and two S chains, without unit_rescale_skip, pair_rescale_skip, "
                             "own_chunk_first, s_between_pv, s_after_pv or vt_smem")
        unknown = set(self.skip) - set(DECODE_PARTS)
        if unknown:
            raise ValueError(f"skip names unknown parts {sorted(unknown)}; known: {', '.join(DECODE_PARTS)}")
        object.__setattr__(self, "skip", frozenset(self.skip))

    @property
    def schedule(self) -> str:
        if self.rows_per_block == 16:
            return "rows16"
        if self.chunk_pairs:
            return "pairs_stagger" if self.pair_stagger else "pairs"
        if self.q_in_registers:
            return "swg_tma_qregs"
        return "swg_tma" if self.kv_loads == "tma" else "swg"

    @property
    def num_rows(self) -> int:
        return self.num_heads * self.q_len

    @property
    def num_row_blocks(self) -> int:
        return -(-self.num_rows // self.rows_per_block)

    @property
    def loads_can_multicast(self) -> bool:
        """Whether `kv_multicast` is a form of this configuration: the chunk_pairs schedule's own loads (without
        kv_load_copies, kv_prefetch, pair_stagger, vt_smem or skip={'load'}) for an even number of row blocks."""
        return (self.chunk_pairs and self.kv_load_copies == 1 and not self.kv_prefetch and self.runs("load")
                and not self.pair_stagger and not self.vt_smem and self.num_row_blocks % 2 == 0)

    @property
    def skips_unit_rescale(self) -> bool:
        """Whether the S^T-warpgroup schedule skips the O^T rescale of a thread whose alphas are all 1."""
        return self.lazy_rescale or self.unit_rescale_skip

    def runs(self, part: str) -> bool:
        """Whether the kernel does this part of its work (False only in ablation builds)."""
        return part not in self.skip


def default_kv_loads(rows_per_block: int, tile_tokens: int) -> str:
    """TMA for the S^T-warpgroup schedule (32-64 rows), cp.async for the 16-row ping-pong and for tiles that are
    not a multiple of the TMA boxes' 32 tokens. H200, decode alone, one process, cp.async -> TMA (minimum of 4
    rounds, outputs identical): H128 q1 page 64 128K x B4 228.2 -> 221.4 us, H12 q8 1M x B1 393.8 -> 363.2, q8
    128K x B4 200.2 -> 185.6, H16 q2 1M x B2 356.2 -> 323.4, H16 q4 page 64 1M x B2 446.7 -> 432.8, H64 page 64 1M
    x B2 497.5 -> 483.1."""
    return "cp_async" if rows_per_block == 16 or tile_tokens % KV_BOX_TOKENS[0] else "tma"


def default_kv_box_tokens(page_size: int, tile_tokens: int) -> int:
    """Whole-chunk boxes (64 tokens) wherever pages and tiles allow them, else half-chunk boxes (KV_BOX_TOKENS)."""
    return 64 if page_size % 64 == 0 and tile_tokens % 64 == 0 else 32


def default_pv_order(rows_per_block: int, whole_only: bool = False) -> str:
    """"per_tile" for 48 rows (unless whole_only: the research switches lazy_rescale and unit_rescale_skip, whose
    skip it has no form for, the chunk_pairs schedule, which rescales once a pair, and early_rescale, which
    rescales before the P barrier), "whole" otherwise. H200, decode alone, one process, outputs identical, whole -> per_tile: H12 q8 page 64 128K x B4 179.8 -> 169.0 and
    180.1 -> 167.5 us, 1M x B1 338.2 -> 316.7 and 348.4 -> 324.5 (two runs); at 64 rows no faster (H128 q1 page 64
    128K x B4 201.1 -> 206.2, H16 q4 page 64 1M x B2 404.0 -> 413.9), and ptxas spills 12 bytes there."""
    return "per_tile" if rows_per_block == 48 and not whole_only else "whole"


def default_num_stages(rows_per_block: int) -> int:
    """KV ring stages: 4 up to 32 rows; 48 and 64 rows fit shared memory with 3 (Q and S^T grow with the rows)."""
    return 4 if rows_per_block <= 32 else 3


def default_chunk_pairs(rows_per_block: int, kv_loads: str, pv_order: Optional[str], research: dict) -> bool:
    """The chunk-pairs schedule (`hopper/decode_pairs.py`) for 64-row blocks with the KV by TMA, unless a switch
    of the S^T-warpgroup schedule is asked for (Q in registers, lazy_rescale, per-tile P.V, no S^T stores). H200,
    decode alone, one process, 5 rounds, S^T-warpgroup schedule -> chunk pairs, errors equal: H128 q1 page 64 128K
    x B4 213.4 -> 185.6 us, H128 q2 128K x B4 378.6 -> 330.6, H128 1M x B4 1510.3 -> 1294.6, H64 1M x B2 469.1 ->
    409.6, H16 q4 1M x B2 455.6 -> 367.6. At 48 rows (S padded to 64) it is slower: H12 q8 page 64 1M x B1 339.0 ->
    376.5, 128K x B4 172.7 -> 199.0."""
    return (rows_per_block == 64 and kv_loads == "tma" and pv_order in (None, "whole")
            and not research.get("q_in_registers") and not research.get("lazy_rescale")
            and "store_s" not in research.get("skip", ()))


def default_early_rescale(research: dict, p_planes: int) -> bool:
    """O^T rescaled beside P's exp2 (`DecodeConfig.early_rescale`) wherever the chunk-pairs schedule runs phase
    after phase with one P plane: the same arithmetic in the same order (outputs bit-identical), off the chain
    between the P barrier and P.V. H200, decode alone, one process, 3 rounds, medians (minimums): H128 q1 page 64
    128K x B4 178.1 (174.8) -> 169.5 (168.5) us, H64 1M x B2 386.4 (310.0) -> 326.7 (301.2), H16 q4 1M x B2 348.4
    (315.2) -> 337.7 (305.9). With two P planes (`fp8x2`) ptxas spills 36 bytes for it at 64 rows. The forms with S
    a pair ahead or P.V a pair behind have orders of their own."""
    return (bool(research.get("chunk_pairs")) and not research.get("s_ahead") and not research.get("pv_behind")
            and p_planes == 1)


def default_stages_under_s(research: dict) -> bool:
    """The waits for a pair's chunks to land while its S runs (`DecodeConfig.stages_under_s`) wherever the
    chunk-pairs schedule runs phase after phase (vt_smem waits there already): the same arithmetic (outputs
    bit-identical), off P's window, where ncu put 5% of its stall samples on them. H100, decode alone, 9 rounds, two
    runs, medians, past the maxima barrier -> under S: H128 q1 page 64 128K x B4 161.7 -> 160.6 and 163.5 -> 162.0 us,
    1M x B4 1156.0 -> 1148.3 and 1201.5 -> 1185.4, q2 128K x B4 281.3 -> 275.8 and 295.3 -> 289.6, H12 q8 1M x B1
    296.4 -> 290.7 and 327.6 -> 320.3, 128K x B4 155.9 -> 153.5 and 160.8 -> 158.1; H64 / H16 q4 1M x B2 (the
    memory bounds them) unchanged."""
    return (bool(research.get("chunk_pairs")) and not research.get("s_ahead") and not research.get("pv_behind")
            and not research.get("pair_stagger") and not research.get("vt_smem"))


def default_deep_ring(research: dict, rows_per_block: int, p_planes: int, kv_box_tokens: int) -> bool:
    """Five ring stages of 36 KB (the rope in 64-byte rows, `DecodeConfig.rope_rows` 64) instead of four of 40
    wherever they fit: the chunk-pairs schedule's phase-after-phase form at 64 rows with one P plane (two need
    16 KB of P buffers, 8 more than the CTA has left) and whole-chunk boxes (the rope's 64-byte rows are a layout
    of those). The same arithmetic (outputs bit-identical); three chunks load while a pair computes instead of two,
    which the steps that the memory bounds feel. H100, decode alone, one process, 5 rounds, medians (minimums), 4 -> 5
    stages: H64 1M x B2 429.0 (425.4) -> 416.2 (412.4) us, H16 q4 1M x B2 426.1 (421.0) -> 417.1 (411.4), H128 q1
    1M x B4 1258.2 (1181.3) -> 1223.0 (1185.3), 128K x B4 172.2 (171.4) -> 172.4 (160.2), H12 q8 128K x B4 175.8
    (162.2) -> 174.9 (168.4), 1M x B1 302.2 (299.8) -> 300.7 (298.4)."""
    return (bool(research.get("chunk_pairs")) and rows_per_block == 64 and p_planes == 1 and kv_box_tokens == 64
            and not research.get("s_ahead") and not research.get("pv_behind") and "rope_rows" not in research)


def default_kv_multicast(cfg: DecodeConfig) -> bool:
    """Row blocks 2k and 2k + 1 of a plan CTA as a 2-CTA cluster sharing each chunk's load (`DecodeConfig.kv_multicast`)
    wherever it is a form of the configuration (`loads_can_multicast`: the chunk-pairs schedule's own loads, an even
    number of row blocks) with one P plane (two not measured): the same arithmetic (outputs bit-identical), one L2 read
    of each chunk into the SMs for two row blocks. H100, decode alone: in the flushed bench (5 rounds, medians) own
    loads -> multicast H128 q1 page 64 1M x B4 1148.2 -> 1142.6 us, 128K x B4 168.7 -> 169.6, q2 128K x B4 293.7 ->
    295.6, H12 q8 1M x B1 288.5 -> 289.2 (within the run's spread); replayed back to back, where the GPU runs at its
    power cap, H128 1M x B4 1316.5 -> 1271.6 us (SM clock 1455 -> 1508 MHz, energy a replay 918 -> 887 mJ), H12 q8 1M x
    B1 326.3 -> 315.5."""
    return cfg.loads_can_multicast and cfg.p_planes == 1


def p_planes_for(p_precision: str, rows_per_block: int) -> int:
    """e4m3 planes of P for a precision mode: one only where it is faster, above 16 rows (see P_PRECISIONS)."""
    check_p_precision(p_precision)
    return 1 if p_precision == "fp8" and rows_per_block > 16 else 2


def decode_config(num_heads: int, q_len: int, page_size: int, *, tile_tokens: int = 64, causal: bool = True,
                  p_precision: Optional[str] = None, rows_per_block: Optional[int] = None,
                  num_stages: Optional[int] = None, p_planes: Optional[int] = None,
                  kv_loads: Optional[str] = None, kv_box_tokens: Optional[int] = None,
                  pv_order: Optional[str] = None, arch: str = "sm_90a",
                  env: Optional[Environment] = None,
                  **research) -> DecodeConfig:
    """The decode configuration the runtime uses for a shape; keyword overrides are for tests and benchmarks."""
    env = env or environment()
    rows = default_rows_per_block(num_heads, q_len) if rows_per_block is None else rows_per_block
    if p_planes is None:
        p_planes = p_planes_for(env.p_precision if p_precision is None else p_precision, rows)
    if kv_loads is None:
        kv_loads = default_kv_loads(rows, tile_tokens)
    if "chunk_pairs" not in research:
        research = {**research, "chunk_pairs": default_chunk_pairs(rows, kv_loads, pv_order, research)}
    if research.get("q_in_registers") and not research.get("chunk_pairs"):
        research = {"s_chains": 1, **research}  # one chain leaves the most of Q in registers
    if kv_box_tokens is None:
        kv_box_tokens = default_kv_box_tokens(page_size, tile_tokens)
    if num_stages is None and research.get("vt_smem"):
        num_stages = 3  # beside the V^T buffers
        research = {"rope_rows": 64, **research}
    if num_stages is None and default_deep_ring(research, rows, p_planes, kv_box_tokens):
        num_stages = 5
        research = {**research, "rope_rows": 64}
    if research.get("chunk_pairs") and num_stages is None:
        num_stages = 4  # one pair computed while the next lands (`hopper/decode_pairs.py`)
    if "early_rescale" not in research:
        research = {**research, "early_rescale": default_early_rescale(research, p_planes)}
    if "stages_under_s" not in research:
        research = {**research, "stages_under_s": default_stages_under_s(research)}
    cfg = DecodeConfig(num_heads=num_heads, q_len=q_len, page_size=page_size, tile_tokens=tile_tokens,
                       causal=bool(causal), rows_per_block=rows,
                       num_stages=default_num_stages(rows) if num_stages is None else num_stages,
                       p_planes=p_planes,
                       kv_loads=kv_loads,
                       kv_box_tokens=kv_box_tokens,
                       pv_order=(default_pv_order(rows, bool(research.get("lazy_rescale")
                                                              or research.get("unit_rescale_skip")
                                                              or research.get("chunk_pairs")
                                                              or research.get("early_rescale")))
                                 if pv_order is None
                                 else pv_order),
                       pdl=env.pdl, arch=arch, **research)
    if "kv_multicast" not in research and default_kv_multicast(cfg):
        cfg = replace(cfg, kv_multicast=True)
    return cfg


# ------------------------------------------------------------------------------------------------ combine
# Small batches merge each row with COMBINE_DIM_SPLITS CTAs, each over a quarter of the 512 output columns (each
# recomputes the split weights: a few hundred floats). One CTA per (request, row) gave B1 12 CTAs on 132 SMs,
# each reading all of the row's ~130 partials: ~8 us of a 1M-token step. With more rows than SMs the quarters
# only multiply the weight work (measured: 8K x B128 combine 7.6 -> 12.1 us), so those keep one CTA per row.
COMBINE_DIM_SPLITS = 4
# Warp mode: a warp merges a row of a request with at most HEAVY_SPLITS splits; a request with more is "heavy".
HEAVY_SPLITS = 32
# warp mode only above this many rows per SM and below this many plan CTAs per request (`combine_config`)
WARP_MODE_ROWS_PER_SM = 4
WARP_MODE_CTAS_PER_REQUEST = 6


@dataclass(frozen=True)
class CombineConfig:
    """The combine kernel (`hopper/combine.py`): query rows per request (q_len x heads), CTAs sharing a row's 512
    columns (1 or COMBINE_DIM_SPLITS), whether each warp loads its first partials before the LSE reductions
    (`prefetch_all`, which also keeps the grid to one CTA per SM), and the mode: heavy_slots -1 for row mode, else
    warp mode with room for that many heavy requests."""

    rows: int
    dim_splits: int = 1
    pdl: bool = True
    prefetch_all: bool = False
    heavy_slots: int = -1
    arch: str = "sm_90a"


def combine_config(batch: int, rows: int, num_sms: int, num_ctas: int, env: Optional[Environment] = None) -> CombineConfig:
    """The combine the runtime launches for a batch (`batch` requests of `rows` query rows, a plan of num_ctas CTAs
    on num_sms SMs).

    Row mode (a CTA, or COMBINE_DIM_SPLITS CTAs, per row) unless the batch has more than WARP_MODE_ROWS_PER_SM rows
    per SM and fewer than WARP_MODE_CTAS_PER_REQUEST plan CTAs per request: a warp merges its row's splits one after
    the other, which beats a CTA per row only for many rows of few splits. H200, combine alone, row -> warp mode:
    8K x B64 3.8 -> 2.7 us, 8K x B128 5.8 -> 2.6, q_len 8 128K x B16 (66 plan CTAs) 6.2 -> 4.0-4.3, 128K + 63 x 2K
    4.9-5.0 -> 2.8; but q_len 1 128K x B16 (8 splits a request) 2.4 -> 3.0, 1M x B16 2.5 -> 3.1, q_len 8 128K x B4
    4.1 -> 5.7, and 8K x B32 (384 rows) the same alone with steps 1.3-1.7 us slower. Warp mode keeps CTAs for as many
    heavy requests as the plan can hold: consecutive requests share at most one CTA, so n of them hold at least
    32 n + 1.

    In row mode, the quarters while all rows fit one wave of CTAs, and the prefetch of every split (with one CTA
    per SM) while the quartered grid does: the small batches whose requests have the most splits. H200, steps in
    alternating runs: H12 q_len 1 128K x B1 34.1-34.5 -> 31.9-32.3 us, 1M x B1 155.0-158.6 -> 153.4-156.5; one CTA
    per SM: 128K x B1 31.8-32.0 -> 31.4-31.5 us, 128K x B2 49.7-50.0 -> 49.2-49.5, 1M x B1 154.4-154.7 ->
    153.8-153.9."""
    env = env or environment()
    many_rows = batch * rows > WARP_MODE_ROWS_PER_SM * num_sms
    if many_rows and num_ctas < WARP_MODE_CTAS_PER_REQUEST * batch:
        # the heavy rows in quarters of their columns while those CTAs (rows x quarters) fit one per SM
        dims = COMBINE_DIM_SPLITS if rows * COMBINE_DIM_SPLITS <= num_sms else 1
        return CombineConfig(rows, dims, env.pdl, False, num_ctas // HEAVY_SPLITS)
    dims = COMBINE_DIM_SPLITS if batch * rows <= num_sms else 1
    return CombineConfig(rows, dims, env.pdl, batch * rows * COMBINE_DIM_SPLITS <= num_sms, -1)


# ------------------------------------------------------------------------------------------------ planner
# CTAs of a plan at most: the combine keeps one weight per split of a request in shared memory, and a request
# has at most one split per plan CTA
MAX_PLAN_CTAS = 2048
# Lengths are planned as min(max(L, 0), MAX_PLANNED_KV_LEN): 16x the longest context we serve, and small enough
# that a plan's tile and cost sums stay in int32 whatever garbage a CUDA graph is replayed with (the kernel
# clamps page indices to the block table's width, so a clamped length never reads out of bounds either).
MAX_PLANNED_KV_LEN = 1 << 24
# the planner's barrier-free warp form up to this max_batch, its 512-thread form above (hopper/planner.py)
WARP_PLANNER_MAX_BATCH = 64
PLANNER_FORMS = ("warp", "cta")


@dataclass(frozen=True)
class PlannerConfig:
    """The device planner (`hopper/planner.py`), compiled for a plan's fixed shape."""

    max_batch: int
    num_ctas: int
    tile_tokens: int
    segment_overhead: int
    pdl: bool = True
    form: str = "warp"
    arch: str = "sm_90a"

    def __post_init__(self):
        if self.form not in PLANNER_FORMS:
            raise ValueError(f"form must be one of {PLANNER_FORMS}, got {self.form!r}")


def planner_config(max_batch: int, num_ctas: int, tile_tokens: int, segment_overhead: int,
                   env: Optional[Environment] = None, form: Optional[str] = None) -> PlannerConfig:
    env = env or environment()
    if form is None:
        form = "warp" if max_batch <= WARP_PLANNER_MAX_BATCH else "cta"
    return PlannerConfig(max_batch, num_ctas, tile_tokens, segment_overhead, env.pdl, form)


# ------------------------------------------------------------------------------------- a shape's variants
def decode_shape_configs(num_heads: int, q_len: int, page_size: int, *, max_batch: int, num_sms: int,
                         num_ctas: int, tile_tokens: int = 64, segment_overhead: int, causal: bool = True,
                         p_precision: Optional[str] = None, env: Optional[Environment] = None):
    """Every kernel configuration the runtime can launch for decodes of this shape with plans of max_batch
    requests and num_ctas CTAs: the decode, one planner, and each combine a batch of 1..max_batch can pick.
    What `python -m mla_backend compile` builds and the engine adapters prepare at start-up."""
    env = env or environment()
    check_shape(num_heads=num_heads, q_len=q_len, page_size=page_size, batch=max_batch)
    if page_size not in SUPPORTED_PAGE_SIZES:
        raise ValueError(f"page_size must be one of {SUPPORTED_PAGE_SIZES}, got {page_size}")
    decode = decode_config(num_heads, q_len, page_size, tile_tokens=tile_tokens, causal=causal,
                           p_precision=p_precision, env=env)
    planner = planner_config(max_batch, num_ctas, tile_tokens, segment_overhead, env)
    rows = num_heads * q_len
    combines = sorted({combine_config(b, rows, num_sms, num_ctas, env) for b in range(1, max_batch + 1)},
                      key=lambda c: (c.heavy_slots, c.dim_splits, c.prefetch_all))
    return [decode, planner, *combines]
