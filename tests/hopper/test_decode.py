"""The SM90 split-KV decode (mla_backend.hopper.decode and its schedules): compiles on CPU for sm_90a without
spills; matches the reference on a GPU.

The compile tests need no GPU (`compile_decode` builds its own pointer arguments). The spill check compiles in a
subprocess with the PTX kept and runs `ptxas -v` on it: the ptxas of the test extra's nvidia-cuda-nvcc (CuTe DSL
4.8's cu13 build writes PTX 9.4, which CUDA 13.0's ptxas refuses). The GPU test runs the kernel on random paged
inputs and checks out/lse (merging the split partials in torch) against the plain-torch reference.
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

ROWS_32 = {"rows_per_block": 32}
# H12 q_len 8 (96 rows) runs two 64-row blocks by default; this keeps its 48-row forms under test
ROWS_48 = {"rows_per_block": 48}
ROWS_64 = {"rows_per_block": 64}

# (num_heads, q_len, page_size, tile_tokens, causal)
SHAPES = [
    (12, 1, 32, 64, True),
    (16, 2, 64, 64, True),
    (128, 8, 32, 64, True),
    (8, 1, 64, 64, False),
    (16, 4, 64, 32, True),
    (12, 8, 32, 64, True),  # MTP verify: 96 rows in 2 row blocks of 64
    (64, 1, 64, 64, False),
]


@pytest.mark.parametrize("num_heads,q_len,page_size,tile_tokens,causal", SHAPES)
def test_compiles(num_heads, q_len, page_size, tile_tokens, causal):
    from mla_backend.config import decode_config
    from mla_backend.hopper.decode import compile_decode

    cfg = decode_config(num_heads, q_len, page_size, tile_tokens=tile_tokens, causal=causal)
    fn = compile_decode(cfg)
    assert fn is not None
    # cached by configuration: an equal configuration built anew finds the same compiled function
    assert compile_decode(decode_config(num_heads, q_len, page_size, tile_tokens=tile_tokens, causal=causal)) is fn


def test_configurations_pick_the_schedule_stages_and_rows():
    """16-row blocks run the ping-pong schedule (4 stages), 32 and 48 rows the S^T-warpgroup schedule (48 rows fit
    shared memory with 3 ring stages), 64 rows the chunk-pairs schedule (4 stages); with 48 rows the softmax runs
    on 192 threads (4 per row)."""
    from mla_backend.config import decode_config
    from mla_backend.hopper.decode import decode_kernel

    expected = {(12, 1): (16, 4, "rows16", 1), (16, 2): (32, 4, "swg_tma", 1), (12, 4): (48, 3, "swg_tma", 1),
                (12, 8): (64, 4, "pairs", 2), (128, 1): (64, 4, "pairs", 2), (16, 4): (64, 4, "pairs", 1)}
    for (h, q), (rows, stages, schedule, blocks) in expected.items():
        cfg = decode_config(h, q, 32)
        assert (cfg.rows_per_block, cfg.num_stages, cfg.schedule, cfg.num_row_blocks) == (rows, stages, schedule,
                                                                                            blocks), (h, q)
    op = decode_kernel(decode_config(12, 4, 32))
    assert (op.tpr, op.softmax_threads, op.num_threads) == (4, 192, 384)
    op = decode_kernel(decode_config(12, 1, 32))
    assert (op.tpr, op.softmax_threads, op.num_threads) == (8, 128, 256) and op.l2_prefetch_copies
    assert decode_config(128, 1, 64, rows_per_block=48).num_row_blocks == 3  # 128 rows: the last block 32
    with pytest.raises(ValueError, match="16, 32, 48 or 64"):
        decode_config(12, 8, 32, rows_per_block=96)
    with pytest.raises(ValueError, match="4 ring stages"):
        decode_config(12, 1, 32, num_stages=3)


def test_default_rows_per_block_takes_the_fewest_row_blocks():
    """Each row block reads the KV span again: the fewest blocks; one block as small as holds the rows, and past
    one block blocks of 64 (as few as 48-row ones give, and faster)."""
    from mla_backend.shapes import default_rows_per_block

    expected = {(12, 1): 16, (16, 1): 16, (8, 2): 16, (16, 2): 32, (12, 2): 32, (12, 4): 48, (16, 4): 64,
                (12, 8): 64, (12, 6): 64, (16, 5): 64, (16, 8): 64, (128, 1): 64, (128, 2): 64, (32, 1): 32,
                (40, 1): 48, (48, 3): 64, (96, 1): 64}
    for h in range(8, 129):
        for q in range(1, 9):
            rows = h * q
            size = default_rows_per_block(h, q)
            fewest = min(-(-rows // s) for s in (16, 32, 48, 64) if s > 16 or rows <= 16)
            assert -(-rows // size) == fewest, (h, q, size)
    for (h, q), rows in expected.items():
        assert default_rows_per_block(h, q) == rows, (h, q)


def test_p_precision_sets_the_planes_per_schedule():
    """"fp8" keeps one e4m3 plane where it is faster (more than 16 rows per block), "fp8x2" two everywhere;
    part of the configuration, so both compile side by side."""
    from mla_backend.config import decode_config, read_environment
    from mla_backend.hopper.decode import compile_decode

    assert decode_config(12, 8, 32, p_precision="fp8").p_planes == 1
    assert decode_config(12, 8, 32, p_precision="fp8x2").p_planes == 2
    assert decode_config(12, 1, 32, p_precision="fp8").p_planes == 2  # 16-row blocks: no faster with one
    assert decode_config(12, 8, 32, env=read_environment({"CUTE_MLA_P_PRECISION": "fp8x2"})).p_planes == 2
    assert decode_config(12, 8, 32, env=read_environment({})).p_planes == 1  # the default: fp8
    one, two = (compile_decode(decode_config(12, 8, 32, p_precision=p)) for p in ("fp8", "fp8x2"))
    assert one is not two
    with pytest.raises(ValueError, match="p_precision must be one of"):
        decode_config(12, 8, 32, p_precision="fp16")


@pytest.mark.parametrize("skip", [frozenset({"softmax"}), frozenset({"pv", "s", "load", "store_s", "rescale"})])
@pytest.mark.parametrize("heads,q_len", [(12, 1), (16, 2), (12, 8), (128, 1)])
def test_research_builds_compile(skip, heads, q_len):
    """Ablation builds (parts of the work left out) and timeline builds compile on the CPU for every schedule."""
    from mla_backend.config import decode_config
    from mla_backend.hopper.decode import compile_decode

    assert compile_decode(decode_config(heads, q_len, 32, skip=skip)) is not None
    if heads * q_len > 16:
        assert compile_decode(decode_config(heads, q_len, 32, timeline=100)) is not None


@pytest.mark.parametrize("heads,q_len,page_size", [(12, 1, 32), (12, 8, 64), (128, 1, 64)])
def test_one_chain_s_builds_compile(heads, q_len, page_size):
    """S^T as one accumulator chain of 18 k steps (`DecodeConfig.s_chains=1`, research) compiles for the 16-row
    ping-pong and the TMA S^T-warpgroup schedule at 48 and 64 rows, as a kernel of its own."""
    from mla_backend.config import decode_config
    from mla_backend.hopper.decode import compile_decode

    one = compile_decode(decode_config(heads, q_len, page_size, s_chains=1))
    assert one is not None and one is not compile_decode(decode_config(heads, q_len, page_size))


@pytest.mark.parametrize("heads,q_len,page_size,options", [(12, 1, 32, {}), (16, 2, 64, {}), (12, 8, 32, {}),
                                                           (12, 8, 32, {"rows_per_block": 48}),
                                                           (16, 4, 64, {"kv_loads": "cp_async"})])
def test_poisoned_shared_memory_builds_compile(heads, q_len, page_size, options):
    """The shared-memory check builds (`DecodeConfig.poison_smem`) compile for every schedule and load path, and
    the regions they fill (the schedule's `smem_regions`, which also size the kernel's SharedStorage) are whole
    16-byte pieces that fit a CTA."""
    from mla_backend.config import decode_config
    from mla_backend.hopper.decode import compile_decode, decode_kernel
    from mla_backend.hopper.decode_layout import SM90_SMEM_CAPACITY

    cfg = decode_config(heads, q_len, page_size, poison_smem=True, **options)
    assert compile_decode(cfg) is not None
    regions = decode_kernel(cfg).smem_regions()
    assert all(n > 0 and n % 16 == 0 for n in regions.values()), regions
    assert sum(regions.values()) <= SM90_SMEM_CAPACITY


@pytest.mark.parametrize("heads,q_len,s_chains", [(16, 4, None), (128, 1, None), (128, 1, 2)])
def test_q_in_registers_builds_compile(heads, q_len, s_chains):
    """The schedule with Q in the S warpgroup's registers (`DecodeConfig.q_in_registers`, research) compiles at 64
    rows, with one S chain unless two are asked for (then fewer of Q's k32 steps live in registers)."""
    from mla_backend.config import decode_config
    from mla_backend.hopper.decode import compile_decode, decode_kernel
    from mla_backend.hopper.decode_swg_qregs import MLADecodeSwgQRegsSM90

    chains = {} if s_chains is None else {"s_chains": s_chains}
    cfg = decode_config(heads, q_len, 64, q_in_registers=True, **chains)
    assert (cfg.rows_per_block, cfg.s_chains, cfg.schedule) == (64, s_chains or 1, "swg_tma_qregs")
    kernel = decode_kernel(cfg)
    assert isinstance(kernel, MLADecodeSwgQRegsSM90) and kernel.k_steps_regs == (7 if s_chains == 2 else 14)
    assert compile_decode(cfg) is not None


def test_research_switches_are_checked():
    from mla_backend.config import decode_config

    with pytest.raises(ValueError, match="unknown parts"):
        decode_config(12, 8, 32, skip={"exp"})
    with pytest.raises(ValueError, match="timeline builds"):
        decode_config(12, 1, 32, timeline=0)
    with pytest.raises(ValueError, match="s_chains must be 1 or 2"):
        decode_config(128, 1, 64, s_chains=3)
    for options in ({"rows_per_block": 48}, {"kv_loads": "cp_async"}):
        with pytest.raises(ValueError, match="q_in_registers is a form of the TMA S"):
            decode_config(128, 1, 64, q_in_registers=True, **options)
    assert decode_config(12, 4, 32, unit_rescale_skip=True).pv_order == "whole"  # per_tile has no skip
    with pytest.raises(ValueError, match="without lazy_rescale or unit_rescale_skip"):
        decode_config(12, 4, 32, unit_rescale_skip=True, pv_order="per_tile")


@pytest.mark.parametrize("heads,q_len,options", [(12, 8, ROWS_48), (128, 1, {}), (16, 2, {}),
                                                 (128, 1, {"q_in_registers": True})])
def test_unit_rescale_skip_builds_compile(heads, q_len, options):
    """The exact skip of a thread's O^T rescale where its alphas are all 1 (`unit_rescale_skip`, research)
    compiles at 48, 64 and 32 rows, as kernels of their own."""
    from mla_backend.config import decode_config
    from mla_backend.hopper.decode import compile_decode

    fn = compile_decode(decode_config(heads, q_len, 64, unit_rescale_skip=True, **options))
    assert fn is not None and fn is not compile_decode(decode_config(heads, q_len, 64, **options))


@pytest.mark.parametrize("heads,q_len,options", [(12, 8, ROWS_48), (12, 4, {}), (128, 1, {"chunk_pairs": False}),
                                                 (12, 8, {**ROWS_48, "kv_loads": "cp_async"}),
                                                 (12, 8, {**ROWS_48, "p_planes": 2})])
def test_s_warpgroup_early_rescale_builds_compile(heads, q_len, options):
    """O^T rescaled beside P's exp2 in the S^T-warpgroup schedule (`early_rescale`, research) compiles at 48 and 64
    rows, with either KV load path and either P plane count, as kernels of their own (P.V then issued whole)."""
    from mla_backend.config import decode_config
    from mla_backend.hopper.decode import compile_decode

    cfg = decode_config(heads, q_len, 64, early_rescale=True, **options)
    assert cfg.early_rescale and not cfg.chunk_pairs and cfg.pv_order == "whole"
    fn = compile_decode(cfg)
    assert fn is not None and fn is not compile_decode(decode_config(heads, q_len, 64, **options))


def test_s_warpgroup_early_rescale_is_checked():
    from mla_backend.config import decode_config

    for heads, q_len, options in ((16, 2, {}), (12, 1, {}), (12, 4, {"pv_order": "per_tile"}),
                                  (12, 4, {"lazy_rescale": True}), (12, 4, {"unit_rescale_skip": True}),
                                  (128, 1, {"chunk_pairs": False, "q_in_registers": True})):
        with pytest.raises(ValueError, match="early_rescale is an order of"):
            decode_config(heads, q_len, 64, early_rescale=True, **options)
    assert not decode_config(12, 4, 64).early_rescale  # research in this schedule (48 rows)


PAIRS = {"chunk_pairs": True}
# the rope in 64-byte rows (36 KB stages) and P stored after the pair before's P.V (one pair's P buffers): 5 ring
# stages at 64 rows with P.V a pair behind
DEEP_RING = {"pv_behind": 3, "rope_rows": 64, "p_after_pv": True, "num_stages": 5}


@pytest.mark.parametrize("heads,q_len,page_size,options", [
    (128, 1, 64, {}), (64, 1, 64, {"p_planes": 2}), (16, 4, 64, {"s_chains": 1}),
    (16, 4, 32, {"tile_tokens": 32, "unit_rescale_skip": True}), (12, 8, 32, {"rows_per_block": 64}),
    (128, 1, 64, {"poison_smem": True}), (128, 1, 64, {"skip": frozenset({"softmax"})}),
    (128, 1, 64, {"skip": frozenset({"pv", "s", "load", "rescale"})}), (128, 1, 64, {"timeline": 10}),
    (128, 1, 64, {"s_ahead": True}), (16, 4, 64, {"s_ahead": True, "s_chains": 1, "p_planes": 2}),
    (128, 1, 64, {"s_ahead": True, "timeline": 0, "unit_rescale_skip": True}),
    # 48-row blocks (S's rows padded to 64), Q's first k32 steps in registers there
    (12, 8, 32, ROWS_48), (12, 4, 64, {"s_ahead": True, "p_planes": 2}), (16, 2, 32, ROWS_48),
    (12, 8, 32, {**ROWS_48, "q_in_registers": True}), (12, 4, 64, {"q_in_registers": True, "s_ahead": True, "s_chains": 1}),
    # its research orders and budgets: P's exp2 partly on the FMA pipe, the own chunk's P.V first, the rescale
    # after the P barrier (early_rescale=False; beside P is the default), the MMA warpgroups at 240 registers
    (128, 1, 64, {"p_exp2_fma": 2, "own_chunk_first": True, "early_rescale": True, "mma_registers": 240}),
    (16, 4, 64, {"p_exp2_fma": 4, "p_planes": 2}), (12, 8, 32, {**ROWS_48, "p_exp2_fma": 1, "own_chunk_first": True}),
    (12, 4, 64, {"early_rescale": False, "mma_registers": 240}),
    # P.V a pair behind, under the next pair's softmax (pv_behind: its units in flight), with the other switches
    (128, 1, 64, {"pv_behind": 3}), (12, 8, 32, {**ROWS_48, "pv_behind": 2, "q_in_registers": True}),
    (16, 4, 64, {"pv_behind": 1, "s_chains": 1, "timeline": 0}),
    (128, 1, 64, {"pv_behind": 3, "s_under_rescale": True}),
    (12, 8, 32, {**ROWS_48, "pv_behind": 4, "s_under_rescale": True, "s_chains": 1, "timeline": 2}),
    (16, 4, 32, {"tile_tokens": 32, "pv_behind": 4, "unit_rescale_skip": True, "p_exp2_fma": 1}),
    # the chunks prefetched into L2 ahead of their boxes (kv_prefetch): whole- and half-chunk boxes, 48 rows
    (128, 1, 64, {"kv_prefetch": 2}), (16, 4, 32, {"tile_tokens": 32, "kv_prefetch": 8, "pv_behind": 2}),
    (12, 8, 32, {**ROWS_48, "kv_prefetch": 1}),
    # the rope in 64-byte rows (rope_rows), P stored after the pair before's P.V (p_after_pv), 5 stages with both
    (128, 1, 64, DEEP_RING), (16, 4, 64, {**DEEP_RING, "s_under_rescale": True, "kv_prefetch": 2}),
    (12, 8, 64, {**ROWS_48, **DEEP_RING, "q_in_registers": True}), (128, 1, 64, {"rope_rows": 64}),
    (64, 1, 64, {"rope_rows": 64, "p_planes": 2, "s_ahead": True}), (128, 1, 64, {"pv_behind": 2, "p_after_pv": True}),
    (12, 4, 64, {"rope_rows": 64, "timeline": 0}), (128, 1, 64, {**DEEP_RING, "skip": frozenset({"softmax"})}),
    # the second chunk's P.V issued a dim tile at a time as its V^T loads (48 rows)
    (12, 8, 32, {**ROWS_48, "pv_second_per_tile": True}), (12, 4, 64, {"pv_second_per_tile": True, "p_planes": 2}),
    (12, 4, 64, {"pv_second_per_tile": True, "timeline": 0}),
    # the next pair's first S chain issued between this pair's two chunks' P.V (64 rows)
    (128, 1, 64, {"s_between_pv": True}), (64, 1, 64, {"s_between_pv": True, "p_planes": 2}),
    (16, 4, 32, {"s_between_pv": True, "s_chains": 1}), (12, 8, 64, {"s_between_pv": True, "timeline": 0}),
    # the next pair's S issued right behind this pair's last P.V wgmmas (64 rows)
    (128, 1, 64, {"s_after_pv": True}), (64, 1, 64, {"s_after_pv": True, "p_planes": 2}),
    (16, 4, 32, {"s_after_pv": True}), (12, 8, 64, {"s_after_pv": True, "timeline": 0}),
    # the waits for a pair's chunks under its S
    (128, 1, 64, {"stages_under_s": True}), (12, 8, 32, {**ROWS_48, "stages_under_s": True}),
    (128, 1, 64, {"stages_under_s": True, "s_after_pv": True}),
    # each chunk's boxes issued twice (kv_load_copies): whole- and half-chunk boxes
    (128, 1, 64, {"kv_load_copies": 2}), (16, 4, 32, {"tile_tokens": 32, "kv_load_copies": 2}),
    # row blocks in 2-CTA clusters, each chunk multicast into both (kv_multicast): whole- and half-chunk boxes, four
    # row blocks, a block of 32 rows and 32 of padding
    (128, 1, 64, {"kv_multicast": True}), (128, 2, 32, {"tile_tokens": 32, "kv_multicast": True}),
    (12, 8, 64, {"kv_multicast": True, "s_after_pv": True})])
def test_chunk_pairs_builds_compile(heads, q_len, page_size, options):
    """The chunk-pairs schedule (`DecodeConfig.chunk_pairs`, research) compiles at 48 and 64 rows with 4 ring
    stages, for both P precisions, one or two S chains, half- and whole-chunk boxes, padding rows, S issued a pair
    ahead (`s_ahead`), P.V a pair behind (`pv_behind`) and its research and timeline builds, the rope in 64-byte
    rows (`rope_rows`) with 5 stages, and its shared memory (Q padded to S's 64 rows, no S^T buffers, P buffers for
    one pair or two, a second mbarrier per stage) fits a CTA."""
    from mla_backend.config import decode_config, default_deep_ring
    from mla_backend.hopper.decode import compile_decode, decode_kernel
    from mla_backend.hopper.decode_layout import SM90_SMEM_CAPACITY
    from mla_backend.hopper.decode_pairs import MLADecodePairsSM90

    cfg = decode_config(heads, q_len, page_size, **PAIRS, **options)
    rows = cfg.rows_per_block
    assert (rows in (48, 64), cfg.schedule, cfg.kv_loads, cfg.pv_order) == (True, "pairs", "tma", "whole")
    deep = default_deep_ring({**PAIRS, **options}, rows, cfg.p_planes, cfg.kv_box_tokens)
    assert cfg.num_stages == options.get("num_stages", 5 if deep else 4)
    assert cfg.rope_rows == options.get("rope_rows", 64 if deep else 128)
    kernel = decode_kernel(cfg)
    assert isinstance(kernel, MLADecodePairsSM90) and kernel.q_rows == 64
    assert kernel.k_steps_regs == (8 if options.get("q_in_registers") else 0)
    regions = kernel.smem_regions()
    assert all(n > 0 and n % 16 == 0 for n in regions.values()), regions
    assert sum(regions.values()) + 8 * 2 * cfg.num_stages <= SM90_SMEM_CAPACITY
    row_bytes = 512 + cfg.rope_rows  # the rope's block of 128- or 64-byte rows
    assert regions["s"] == 2 * rows * 4 and regions["q"] == 64 * row_bytes  # the chunk maxima; Q padded to S's M
    assert regions["ring"] == cfg.num_stages * 64 * row_bytes
    assert regions["p"] == (4 if cfg.pv_behind and not cfg.p_after_pv else 2) * cfg.p_planes * rows * 64
    assert compile_decode(cfg) is not None


@pytest.mark.parametrize("heads,q_len,options", [
    (128, 1, {}), (12, 8, {}), (16, 4, {"p_planes": 2}), (64, 1, {"early_rescale": False, "timeline": 0}),
    (128, 1, {"poison_smem": True})])
def test_vt_smem_builds_compile(heads, q_len, options):
    """V^T in shared memory (`DecodeConfig.vt_smem`, research) compiles at 64 rows with one and two P planes, the
    rescale beside P or after the P barrier, and its timeline and poisoned builds; 3 ring stages of 36 KB and each
    MMA warpgroup's V^T of a pair (2 x 256 dims x 64 tokens) fit a CTA."""
    from mla_backend.config import decode_config
    from mla_backend.hopper.decode import compile_decode, decode_kernel
    from mla_backend.hopper.decode_layout import SM90_SMEM_CAPACITY

    cfg = decode_config(heads, q_len, 64, vt_smem=True, **options)
    assert (cfg.schedule, cfg.rows_per_block, cfg.num_stages, cfg.rope_rows) == ("pairs", 64, 3, 64)
    regions = decode_kernel(cfg).smem_regions()
    assert regions["ring"] == 3 * 64 * 576 + 2 * 2 * 256 * 64
    assert sum(regions.values()) + 8 * 2 * cfg.num_stages <= SM90_SMEM_CAPACITY
    assert compile_decode(cfg) is not None


def test_chunk_pairs_is_checked():
    from mla_backend.config import decode_config
    from mla_backend.config import PAIRS_MMA_REGISTERS
    from mla_backend.hopper.decode_pairs import PAIRS_REGS_LOAD, PAIRS_REGS_MMA, MLADecodePairsSM90

    for options in ({"rows_per_block": 32}, {"kv_loads": "cp_async"}, {"lazy_rescale": True},
                    {"pv_order": "per_tile"}, {"skip": frozenset({"store_s"})}):
        with pytest.raises(ValueError, match="chunk_pairs is a schedule of 48- and 64-row blocks"):
            decode_config(128, 1, 64, chunk_pairs=True, **options)
    with pytest.raises(ValueError, match="s_ahead is a form of the chunk_pairs schedule"):
        decode_config(12, 4, 32, s_ahead=True)
    with pytest.raises(ValueError, match="s_ahead is a form of the chunk_pairs schedule"):
        decode_config(128, 1, 64, s_ahead=True, chunk_pairs=False)
    with pytest.raises(ValueError, match="q_in_registers with chunk_pairs is for 48-row blocks"):
        decode_config(128, 1, 64, chunk_pairs=True, q_in_registers=True)
    for h, q, options in ((128, 1, {}), (12, 4, {"chunk_pairs": False}), (12, 4, {"s_ahead": True}),
                          (12, 4, {"own_chunk_first": True}), (12, 4, {"q_in_registers": True}),
                          (12, 4, {"pv_behind": 2, "p_planes": 1})):
        with pytest.raises(ValueError, match="pv_second_per_tile is an order of"):
            decode_config(h, q, 64, **{"chunk_pairs": True, **options}, pv_second_per_tile=True)
    # the next pair's first S chain between the chunks' P.V: 64 rows (where V^T(c1) loads around a wait for
    # P.V(c0)), phase after phase, and 4 stages (it waits for the next pair's chunk before releasing this pair's)
    for h, q, options in ((12, 8, {"rows_per_block": 48}), (128, 1, {"s_ahead": True}),
                          (128, 1, {"pv_behind": 2, "p_planes": 1, "early_rescale": False}),
                          (128, 1, {"own_chunk_first": True}), (128, 1, {"num_stages": 3}),
                          (128, 1, {"chunk_pairs": False})):
        with pytest.raises(ValueError, match="s_between_pv is an order of"):
            decode_config(h, q, 64, **{"chunk_pairs": True, **options}, s_between_pv=True)
    # the next pair's S right behind this pair's last P.V: 64 rows and two S chains (ptxas spills beside O^T and
    # V^T(c1) at 48 rows and with one chain), phase after phase
    for h, q, options in ((12, 8, {"rows_per_block": 48}), (128, 1, {"s_chains": 1}), (128, 1, {"s_ahead": True}),
                          (128, 1, {"pv_behind": 2, "p_planes": 1, "early_rescale": False}),
                          (128, 1, {"own_chunk_first": True}), (128, 1, {"s_between_pv": True, "num_stages": 4}),
                          (128, 1, {"chunk_pairs": False})):
        with pytest.raises(ValueError, match="s_after_pv is an order of"):
            decode_config(h, q, 64, **{"chunk_pairs": True, **options}, s_after_pv=True)
    assert decode_config(128, 1, 64, s_after_pv=True).num_stages == 5  # the deep ring stays
    # the waits for a pair's chunks under its S: phase after phase, where vt_smem waits there already
    for h, q, options in ((128, 1, {"s_ahead": True}), (128, 1, {"vt_smem": True}), (128, 1, {"pair_stagger": True}),
                          (128, 1, {"pv_behind": 2, "p_planes": 1, "early_rescale": False}),
                          (128, 1, {"chunk_pairs": False})):
        with pytest.raises(ValueError, match="stages_under_s is an order of"):
            decode_config(h, q, 64, **{"chunk_pairs": True, **options}, stages_under_s=True)
    # V^T in shared memory: the phase-after-phase form at 64 rows, 3 stages of 64-byte rope rows beside its buffers
    for h, q, options in ((12, 8, {"rows_per_block": 48}), (128, 1, {"s_ahead": True, "num_stages": 4}),
                          (128, 1, {"pv_behind": 2, "p_planes": 1, "early_rescale": False, "num_stages": 4}),
                          (128, 1, {"own_chunk_first": True}), (128, 1, {"s_between_pv": True, "num_stages": 4}),
                          (128, 1, {"num_stages": 4}), (128, 1, {"rope_rows": 128}),
                          (128, 1, {"chunk_pairs": False, "rope_rows": 128})):
        with pytest.raises(ValueError, match="vt_smem is a form of"):
            decode_config(h, q, 64, **{"chunk_pairs": True, **options}, vt_smem=True)
    # the rescale skipped by both warpgroups where no row's max moves: a form of the rescale beside P's exp2
    for h, q, options in ((128, 1, {"early_rescale": False}), (128, 1, {"chunk_pairs": False}),
                          (128, 1, {"p_planes": 2}), (128, 1, {"s_ahead": True, "num_stages": 4}),
                          (128, 1, {"unit_rescale_skip": True})):
        with pytest.raises(ValueError, match="pair_rescale_skip is a form of early_rescale"):
            decode_config(h, q, 64, **options, pair_rescale_skip=True)
    assert decode_config(128, 1, 64, pair_rescale_skip=True).early_rescale
    # the warpgroups a phase apart: a form of the rescale beside P's exp2 at 64 rows with one P plane
    for h, q, options in ((128, 1, {"early_rescale": False}), (128, 1, {"chunk_pairs": False}),
                          (128, 1, {"p_planes": 2, "early_rescale": True}), (12, 8, {"rows_per_block": 48}),
                          (128, 1, {"pair_rescale_skip": True}), (128, 1, {"own_chunk_first": True}),
                          (128, 1, {"unit_rescale_skip": True}), (128, 1, {"s_between_pv": True, "num_stages": 4}),
                          (128, 1, {"s_chains": 1})):
        with pytest.raises(ValueError, match="pair_stagger is a form of early_rescale"):
            decode_config(h, q, 64, **options, pair_stagger=True)
    staggered = decode_config(128, 1, 64, pair_stagger=True)
    assert staggered.schedule == "pairs_stagger" and staggered.num_stages == 5 and staggered.early_rescale
    assert decode_config(12, 4, 32, chunk_pairs=True, q_in_registers=True).s_chains == 2  # two unless asked
    # S a pair ahead waits for the next pair's chunks before it releases this pair's: 3 stages would hang
    with pytest.raises(ValueError, match="s_ahead needs 4 ring stages"):
        decode_config(128, 1, 64, chunk_pairs=True, s_ahead=True, num_stages=3)
    assert decode_config(128, 1, 64, chunk_pairs=True, num_stages=3).num_stages == 3
    # 64 rows run it by default, unless a switch of the S^T-warpgroup schedule is asked for: with one P plane and
    # whole-chunk boxes on 5 stages of 36 KB (the rope in 64-byte rows), else on 4 of 40
    assert [decode_config(h, q, 64).chunk_pairs for h, q in ((128, 1), (16, 4), (12, 8), (12, 4), (16, 2))] == [
        True, True, True, False, False]
    ring = [(c.num_stages, c.rope_rows) for c in (
        decode_config(128, 1, 64), decode_config(16, 4, 64), decode_config(12, 8, 64),
        decode_config(128, 1, 64, p_precision="fp8x2"), decode_config(128, 1, 32),
        decode_config(128, 1, 64, tile_tokens=32),
        decode_config(128, 1, 64, s_ahead=True), decode_config(128, 1, 64, pv_behind=2, early_rescale=False),
        decode_config(12, 8, 64, rows_per_block=48, chunk_pairs=True), decode_config(128, 1, 64, num_stages=4))]
    assert ring == [(5, 64)] * 3 + [(4, 128)] * 7
    assert decode_config(128, 1, 64, num_stages=3).chunk_pairs
    for options, schedule in (({"kv_loads": "cp_async"}, "swg"), ({"q_in_registers": True}, "swg_tma_qregs"),
                              ({"lazy_rescale": True}, "swg_tma"), ({"pv_order": "per_tile"}, "swg_tma"),
                              ({"skip": frozenset({"store_s"})}, "swg_tma"), ({"chunk_pairs": False}, "swg_tma"),
                              ({"tile_tokens": 16, "page_size": 16}, "swg")):
        page = options.pop("page_size", 64)
        assert decode_config(128, 1, page, **options).schedule == schedule, options
    assert 2 * PAIRS_REGS_MMA + PAIRS_REGS_LOAD == 3 * 168  # what a 384-thread launch gives each thread triple
    # the phase-after-phase form rescales O^T beside P's exp2 unless told otherwise (S ahead has no such order)
    assert [decode_config(h, q, 64).early_rescale for h, q in ((128, 1), (16, 4), (12, 8), (12, 4), (16, 2))] == [
        True, True, True, False, False]
    assert not decode_config(128, 1, 64, s_ahead=True).early_rescale
    assert not decode_config(128, 1, 64, early_rescale=False).early_rescale
    assert not decode_config(128, 1, 64, chunk_pairs=False).early_rescale
    assert not decode_config(128, 1, 64, p_planes=2).early_rescale  # ptxas spills for it beside two P planes
    for mma in PAIRS_MMA_REGISTERS:  # each budget leaves the load warpgroup a legal setmaxnreg count (>= 24, x 8)
        mma_regs, load_regs = MLADecodePairsSM90(decode_config(128, 1, 64, mma_registers=mma)).register_budgets()
        assert (mma_regs, 2 * mma_regs + load_regs) == (mma, 3 * 168) and load_regs >= 24 and load_regs % 8 == 0
    for options, message in (({"p_exp2_fma": 5}, "p_exp2_fma is 0 to 4"),
                             ({"p_exp2_fma": 1, "chunk_pairs": False}, "p_exp2_fma is 0 to 4"),
                             ({"mma_registers": 248}, "mma_registers is one of"),
                             ({"mma_registers": 240, "chunk_pairs": False}, "mma_registers is one of"),
                             ({"own_chunk_first": True, "s_ahead": True}, "own_chunk_first is an order"),
                             ({"own_chunk_first": True, "chunk_pairs": False}, "own_chunk_first is an order"),
                             ({"early_rescale": True, "s_ahead": True}, "early_rescale is an order"),
                             ({"pv_behind": 5}, "pv_behind is 0"), ({"pv_behind": -1}, "pv_behind is 0"),
                             ({"pv_behind": 2, "p_planes": 2}, "pv_behind is a form"),
                             ({"pv_behind": 2, "num_stages": 3}, "pv_behind is a form"),
                             ({"pv_behind": 2, "s_ahead": True}, "pv_behind is a form"),
                             ({"pv_behind": 2, "own_chunk_first": True}, "pv_behind is a form"),
                             ({"pv_behind": 2, "early_rescale": True}, "pv_behind is a form"),
                             ({"pv_behind": 2, "chunk_pairs": False}, "pv_behind is a form"),
                             ({"s_under_rescale": True}, "s_under_rescale is an order of pv_behind"),
                             ({"kv_prefetch": 9}, "kv_prefetch is 0"),
                             ({"kv_prefetch": 2, "chunk_pairs": False}, "kv_prefetch is 0"),
                             ({"kv_load_copies": 3}, "kv_load_copies is 1 or 2"),
                             ({"kv_load_copies": 0}, "kv_load_copies is 1 or 2"),
                             ({"kv_load_copies": 2, "chunk_pairs": False}, "kv_load_copies is 1 or 2"),
                             ({"kv_multicast": True, "kv_load_copies": 2}, "kv_multicast is a form"),
                             ({"kv_multicast": True, "kv_prefetch": 2}, "kv_multicast is a form"),
                             ({"kv_multicast": True, "chunk_pairs": False}, "kv_multicast is a form"),
                             ({"kv_multicast": True, "pair_stagger": 2}, "kv_multicast is a form"),
                             ({"rope_rows": 32}, "rope_rows is one of"),
                             ({"rope_rows": 64, "chunk_pairs": False}, "rope_rows is one of"),
                             ({"rope_rows": 64, "kv_box_tokens": 32}, "rope_rows is one of"),
                             ({"p_after_pv": True}, "p_after_pv is an order of pv_behind")):
        with pytest.raises(ValueError, match=message):
            decode_config(128, 1, 64, **options)
    # 5 stages of 40 KB, or two pairs' P buffers beside 5 of 36 KB, do not fit a CTA: the compile says so
    from mla_backend.hopper.decode import compile_decode

    for options in ({"pv_behind": 3, "num_stages": 5}, {"pv_behind": 3, "rope_rows": 64, "num_stages": 5}):
        with pytest.raises(ValueError, match="do not fit an SM90 CTA"):
            compile_decode(decode_config(128, 1, 64, **options))
    # P.V a pair behind has its own order: the rescale after P.V(p - 1), which early_rescale has no form for
    assert not decode_config(128, 1, 64, pv_behind=3).early_rescale


def ptxas_path():
    """ptxas from the test extra's nvidia-cuda-nvcc (13.4 or newer assembles the cu13 DSL's PTX 9.4), else PATH."""
    import importlib.metadata

    for dist in ("nvidia-cuda-nvcc",):
        try:
            files = importlib.metadata.files(dist) or ()
        except importlib.metadata.PackageNotFoundError:
            continue
        for f in files:
            if f.name == "ptxas":
                return str(f.locate())
    return shutil.which("ptxas")


_PTX_SCRIPT = """
import sys
sys.path.insert(0, {repo!r})
from mla_backend.config import decode_config
from mla_backend.hopper.decode import compile_decode
compile_decode(decode_config({h}, {q}, {p}, rows_per_block={rows}, p_planes={planes}, **{options!r}))
"""

QREGS = {"q_in_registers": True}


@pytest.mark.parametrize("num_heads,q_len,page_size,rows,planes,options", [
    (12, 1, 32, None, 2, {}), (16, 2, 64, None, 2, {}), (12, 8, 32, None, 2, {}), (128, 8, 32, None, 2, {}),
    (12, 8, 32, 48, 2, {}), (128, 1, 64, 48, 2, {}), (128, 1, 64, 64, 2, {}), (12, 1, 32, None, 1, {}),
    (12, 8, 32, None, 1, {}), (12, 8, 32, 48, 1, {}), (128, 1, 64, 64, 1, {}),
    # Q in the S warpgroup's registers (research): 14 k32 steps with one S chain, 7 with two
    (128, 1, 64, 64, 1, QREGS), (16, 4, 64, None, 2, {**QREGS, "s_chains": 2}),
    # the chunk-pairs schedule (research), phase after phase and with S a pair ahead
    (128, 1, 64, 64, 1, PAIRS), (16, 4, 64, None, 2, PAIRS), (128, 1, 64, 64, 1, {**PAIRS, "s_ahead": True}),
    (16, 4, 64, None, 2, {**PAIRS, "s_ahead": True}), (12, 8, 32, 48, 2, PAIRS),
    (12, 8, 32, 48, 1, {**PAIRS, "s_ahead": True}), (12, 8, 32, 48, 1, {**PAIRS, **QREGS}),
    (12, 8, 32, 48, 2, {**PAIRS, **QREGS, "s_ahead": True}),
    (12, 8, 32, 48, 1, {**PAIRS, **QREGS, "s_ahead": True, "s_chains": 1}),
    # the S^T-warpgroup schedule with O^T rescaled beside P's exp2 (research), at 48 and 64 rows
    (12, 8, 32, 48, 1, {"early_rescale": True}), (12, 8, 32, 48, 2, {"early_rescale": True}),
    (128, 1, 64, 64, 1, {"chunk_pairs": False, "early_rescale": True}),
    # its research orders and budgets
    (128, 1, 64, 64, 1, {**PAIRS, "mma_registers": 240}),
    (128, 1, 64, 64, 1, {**PAIRS, "p_exp2_fma": 2, "own_chunk_first": True, "early_rescale": True}),
    (16, 4, 64, None, 2, {**PAIRS, "p_exp2_fma": 1, "mma_registers": 240, "early_rescale": True}),
    # P.V a pair behind: at 64 rows as many units in flight as it allows, and at 48 beside Q's registers
    (128, 1, 64, 64, 1, {**PAIRS, "pv_behind": 4}), (16, 4, 64, None, 1, {**PAIRS, "pv_behind": 1, "p_exp2_fma": 2}),
    (12, 8, 32, 48, 1, {**PAIRS, **QREGS, "pv_behind": 4}),
    # the next pair's S issued before the P barrier: at 64 rows its first chain with up to 3 units in flight (4 spill
    # 8 bytes, and with the L2 prefetch one value spills 4), at 48 rows both chains with 4, the first beside Q's
    # registers with 2
    (128, 1, 64, 64, 1, {**PAIRS, "pv_behind": 3, "s_under_rescale": True}),
    (12, 8, 32, 48, 1, {**PAIRS, "pv_behind": 4, "s_under_rescale": True}),
    (12, 8, 32, 48, 1, {**PAIRS, **QREGS, "pv_behind": 2, "s_under_rescale": True}),
    # the L2 prefetch in the load warpgroup's 40 registers: its farthest, half-chunk boxes (two pages a chunk)
    (128, 1, 64, 64, 1, {**PAIRS, "kv_prefetch": 8, "pv_behind": 3}),
    (16, 4, 64, None, 2, {**PAIRS, "kv_prefetch": 8, "kv_box_tokens": 32}),
    # 5 stages of 36 KB with P stored after the pair before's P.V: its 8 words a thread held across the units
    (128, 1, 64, 64, 1, {**PAIRS, **DEEP_RING, "pv_behind": 4}),
    (128, 1, 64, 64, 1, {**PAIRS, **DEEP_RING, "s_under_rescale": True, "kv_prefetch": 2}),
    (12, 8, 64, 48, 1, {**PAIRS, **DEEP_RING, **QREGS, "pv_behind": 2}),
    # the second chunk's P.V a dim tile at a time as its V^T loads
    (12, 8, 32, 48, 1, {**PAIRS, "pv_second_per_tile": True}), (12, 8, 32, 48, 2, {**PAIRS, "pv_second_per_tile": True}),
    # V^T transposed into shared memory under S, beside S's chains and O^T
    (128, 1, 64, 64, 1, {**PAIRS, "vt_smem": True}), (16, 4, 64, 64, 2, {**PAIRS, "vt_smem": True}),
    # the O^T rescale skipped by both warpgroups where no row's max moves: two copies of P's code, one beside it
    (128, 1, 64, 64, 1, {"pair_rescale_skip": True}), (12, 8, 64, 64, 1, {"pair_rescale_skip": True}),
    # the next pair's first S chain beside O^T and V^T(c1) in flight
    (128, 1, 64, 64, 1, {"s_after_pv": True}), (12, 8, 64, 64, 1, {"s_after_pv": True}),
    (64, 1, 64, 64, 2, {"s_after_pv": True}), (16, 4, 64, None, 1, {"s_after_pv": True, "kv_box_tokens": 32}),
    # the warpgroups a phase apart: the leader's and the follower's loops, each with O^T's second rescale
    (128, 1, 64, 64, 1, {"pair_stagger": True}), (12, 8, 64, 64, 1, {"pair_stagger": True}),
    (16, 4, 64, None, 1, {"pair_stagger": True, "kv_box_tokens": 32}),
    # each chunk's boxes issued twice in the load warpgroup's 40 registers, whole- and half-chunk boxes
    (128, 1, 64, 64, 1, {"kv_load_copies": 2}), (16, 4, 64, None, 1, {"kv_load_copies": 2, "kv_box_tokens": 32}),
    # 2-CTA clusters with the KV multicast: the other CTA's arrivals beside O^T, with S's chain behind P.V too
    (128, 1, 64, 64, 1, {"kv_multicast": True}), (128, 2, 64, 64, 1, {"kv_multicast": True, "s_after_pv": True}),
    (128, 1, 64, 64, 1, {"kv_multicast": True, "kv_box_tokens": 32, "rope_rows": 128})])
def test_no_spills(tmp_path, num_heads, q_len, page_size, rows, planes, options):
    ptxas = ptxas_path()
    assert ptxas, "ptxas (pip install 'cute-mla-fp8[test]' brings it) is needed: the spill check is part of the CPU suite"
    env = dict(os.environ, CUTE_DSL_ARCH="sm_90a", CUTE_DSL_KEEP="ptx", CUTE_DSL_DUMP_DIR=str(tmp_path))
    script = _PTX_SCRIPT.format(repo=REPO, h=num_heads, q=q_len, p=page_size, rows=rows, planes=planes,
                                options=options)
    subprocess.run([sys.executable, "-c", script], env=env, check=True, cwd=str(tmp_path))
    ptx = glob.glob(str(tmp_path / "*.ptx"))
    assert ptx, "no PTX kept"
    res = subprocess.run([ptxas, "-v", "-arch=sm_90a", ptx[0], "-o", os.devnull], capture_output=True, text=True,
                         check=True)
    log = res.stdout + res.stderr
    spills = [int(x) for x in re.findall(r"(\d+) bytes spill (?:stores|loads)", log)]
    # a register array indexed at run time lands in local memory without counting as a spill
    stack = [int(x) for x in re.findall(r"(\d+) bytes stack frame", log)]
    regs = [int(x) for x in re.findall(r"Used (\d+) registers", log)]
    assert spills and all(s == 0 for s in spills), log
    assert stack and all(s == 0 for s in stack), log
    assert regs and max(regs) <= 255, log
    # "wgmma.mma_async instructions are serialized": too few registers (C7512), or for another reason
    assert "instructions are serialized" not in log, log
    # the 16-row (ping-pong) schedule copies the KV with the L2::128B prefetch hint; the others measured slower
    # with it and keep CuTe's plain cp.async
    from mla_backend.shapes import default_rows_per_block

    pingpong = (default_rows_per_block(num_heads, q_len) if rows is None else rows) == 16
    with open(ptx[0]) as f:
        assert ("cp.async.cg.shared.global.L2::128B" in f.read()) == pingpong



GPU_CASES = [
    # (num_heads, q_len, page_size, tile_tokens, causal, lengths, num_ctas, kernel options)
    (12, 1, 32, 64, True, [1, 31, 32, 33, 65, 700, 4000, 130], 16, {}),
    (12, 1, 32, 64, True, [1, 31, 32, 33, 65, 700, 4000, 130], 16, ROWS_32),  # 12 rows in a 32-row block
    (8, 2, 64, 32, True, [2, 63, 64, 65, 129, 3000, 17, 900, 0], 11, {}),
    (16, 2, 64, 64, True, [2, 63, 64, 65, 129, 3000, 17, 900], 12, {}),
    (128, 8, 32, 64, True, [8, 100, 1000], 8, {}),
    (8, 1, 64, 64, False, [0, 1, 64, 2000, 0, 333], 7, {}),
    (16, 4, 64, 32, True, [4, 5, 64, 1500, 77], 9, {}),
    (12, 8, 32, 64, True, [8, 9, 100, 1000, 4000, 65], 9, {}),  # default: 96 rows as 64, then 32 and 32 padding
    (12, 8, 32, 64, True, [8, 9, 100, 1000, 4000, 65], 9, ROWS_48),  # two full 48-row blocks (the S^T-warpgroup schedule)
    (12, 8, 32, 64, True, [8, 9, 100, 1000, 4000, 65], 9, ROWS_32),  # 32-row blocks (3 ring stages -> 4)
    (128, 1, 64, 64, True, [1, 700, 3000, 64], 8, ROWS_32),
    (128, 1, 64, 64, True, [1, 700, 3000, 64], 8, ROWS_48),  # 128 rows: the third block has 32
    (16, 2, 32, 32, True, [2, 63, 64, 65, 1500], 6, ROWS_48),  # 32 rows in one block, 16 of them padding
    (128, 1, 64, 64, True, [1, 700, 3000, 64], 8, ROWS_64),  # 128 rows: two 64-row blocks
    (16, 4, 32, 64, True, [4, 5, 64, 1500, 77], 9, ROWS_64),  # 64 rows in one block
    # the S^T-warpgroup schedule with the KV by cp.async (decode_swg; the cases above load it by TMA)
    (128, 1, 64, 64, True, [1, 700, 3000, 64], 8, {**ROWS_64, "kv_loads": "cp_async"}),
    (16, 4, 64, 32, True, [4, 5, 64, 1500, 77], 9, {**ROWS_64, "kv_loads": "cp_async"}),
    (12, 8, 32, 64, True, [8, 9, 100, 1000, 4000, 65], 9, {**ROWS_48, "kv_loads": "cp_async"}),
    (16, 2, 64, 64, True, [2, 63, 64, 65, 129, 3000, 17, 900], 12, {**ROWS_32, "kv_loads": "cp_async"}),
    # TMA refills issued after S^T is stored (kv_refill; the cases above issue them under S^T): tiles of 32, so
    # chunks that cross pages
    (16, 4, 64, 32, True, [4, 5, 64, 1500, 77], 9, {**ROWS_64, "kv_refill": "after_store"}),
    (12, 8, 32, 64, True, [8, 9, 100, 1000, 4000, 65], 9, {**ROWS_48, "kv_refill": "after_store"}),
    # half-chunk boxes on pages of 64 (the cases above with pages and tiles of 64 load whole-chunk boxes)
    (128, 1, 64, 64, True, [1, 700, 3000, 64], 8, {**ROWS_64, "kv_box_tokens": 32}),
    # O^T rescaled and P.V issued a dim tile at a time (pv_order; the default at 48 rows, "whole" at 64)
    (128, 1, 64, 64, True, [1, 700, 3000, 64], 8, {**ROWS_64, "pv_order": "per_tile"}),
    (16, 4, 64, 32, True, [4, 5, 64, 1500, 77], 9, {**ROWS_64, "pv_order": "per_tile", "p_planes": 1}),
    (12, 8, 32, 64, True, [8, 9, 100, 1000, 4000, 65], 9, {**ROWS_48, "pv_order": "whole"}),
    # the O^T rescale skipped where a thread's alphas are all 1 (unit_rescale_skip, research)
    (128, 1, 64, 64, True, [1, 700, 3000, 64], 8, {**ROWS_64, "unit_rescale_skip": True}),
    (12, 8, 32, 64, True, [8, 9, 100, 1000, 4000, 65], 9, {**ROWS_48, "unit_rescale_skip": True}),
    # the running max kept within the slack of e4m3's headroom (lazy_rescale, research)
    (12, 1, 32, 64, True, [1, 31, 32, 33, 65, 700, 4000, 130], 16, {"lazy_rescale": True}),
    (12, 8, 32, 64, True, [8, 9, 100, 1000, 4000, 65], 9, {**ROWS_48, "lazy_rescale": True}),
    (128, 1, 64, 64, True, [1, 700, 3000, 64], 8, {**ROWS_64, "lazy_rescale": True}),
    # S = Q.K^T with Q in the S warpgroup's registers and one S chain (q_in_registers, research)
    (128, 1, 64, 64, True, [1, 700, 3000, 64], 8, {**ROWS_64, "q_in_registers": True}),
    (16, 4, 64, 32, True, [4, 5, 64, 1500, 77], 9, {**ROWS_64, "q_in_registers": True}),
    (12, 8, 32, 64, True, [8, 9, 100, 1000, 4000, 65], 9, {**ROWS_64, "q_in_registers": True}),  # padding rows
    # the same with two S chains (7 of Q's k32 steps in registers)
    (128, 1, 64, 64, True, [1, 700, 3000, 64], 8, {**ROWS_64, "q_in_registers": True, "s_chains": 2}),
    (12, 8, 32, 64, True, [8, 9, 100, 1000, 4000, 65], 9, {**ROWS_64, "q_in_registers": True, "s_chains": 2}),
    # the chunk-pairs schedule (research): whole- and half-chunk boxes, padding rows, one P plane, many segments a
    # CTA with odd and even chunk counts (the ring's chunks counted across segments)
    (128, 1, 64, 64, True, [1, 700, 3000, 64], 8, PAIRS),
    (16, 4, 64, 32, True, [4, 5, 64, 1500, 77], 9, PAIRS),
    (64, 1, 64, 64, False, [1, 65, 129, 200, 64, 3, 1000, 4000, 130, 191, 257, 0], 5, {**PAIRS, "p_planes": 1}),
    # the same with S issued a pair ahead (s_ahead), two chains and one
    (128, 1, 64, 64, True, [1, 700, 3000, 64], 8, {**PAIRS, "s_ahead": True}),
    (16, 4, 64, 32, True, [4, 5, 64, 1500, 77], 9, {**PAIRS, "s_ahead": True, "s_chains": 1}),
    (12, 8, 32, 64, True, [8, 9, 100, 1000, 4000, 65], 9, {**ROWS_64, **PAIRS, "s_ahead": True}),
    (64, 1, 64, 64, False, [1, 65, 129, 200, 64, 3, 1000, 4000, 130, 191, 257, 0], 5,
     {**PAIRS, "s_ahead": True, "p_planes": 1}),
    # V^T in shared memory (vt_smem): two planes, one plane over many segments with odd and even chunk counts and
    # tails inside a page, 96 rows (the second block half padding)
    (128, 1, 64, 64, True, [1, 700, 3000, 64], 8, {"vt_smem": True}),
    (64, 1, 64, 64, False, [1, 65, 129, 200, 64, 3, 1000, 4000, 130, 191, 257, 0], 5, {"vt_smem": True, "p_planes": 1}),
    (12, 8, 64, 64, True, [8, 9, 100, 1000, 4000, 65], 9, {"vt_smem": True, "p_planes": 1}),
    # the O^T rescale skipped where no row's max moves in a pair (pair_rescale_skip)
    (64, 1, 64, 64, False, [1, 65, 129, 200, 64, 3, 1000, 4000, 130, 191, 257, 0], 5,
     {"pair_rescale_skip": True, "p_planes": 1}),
    (16, 4, 64, 32, True, [4, 5, 64, 1500, 77], 9, {"pair_rescale_skip": True, "p_planes": 1}),
    # the warpgroups a phase apart (pair_stagger): many segments with odd and even chunk counts, tiles of 32 (chunks
    # across pages), 96 rows (the second block half padding)
    (64, 1, 64, 64, False, [1, 65, 129, 200, 64, 3, 1000, 4000, 130, 191, 257, 0], 5,
     {"pair_stagger": True, "p_planes": 1}),
    (16, 4, 64, 32, True, [4, 5, 64, 1500, 77], 9, {"pair_stagger": True, "kv_box_tokens": 32, "p_planes": 1}),
    (12, 8, 64, 64, True, [8, 9, 100, 1000, 4000, 65], 9, {"pair_stagger": True, "p_planes": 1}),
    (128, 1, 64, 64, True, [1, 700, 3000, 64], 8, {"pair_stagger": 2, "p_planes": 1}),  # its S behind the leader's
    # 48-row blocks (S's rows padded to 64): two full blocks, one block, 32 rows in a block of 48
    (12, 8, 32, 64, True, [8, 9, 100, 1000, 4000, 65], 9, {**ROWS_48, **PAIRS}),
    (12, 8, 32, 64, True, [8, 9, 100, 1000, 4000, 65], 9, {**ROWS_48, **PAIRS, "s_ahead": True}),
    (12, 4, 64, 64, True, [4, 5, 64, 1500, 77, 3000], 7, {**PAIRS, "p_planes": 1}),
    (16, 2, 32, 32, True, [2, 63, 64, 65, 1500], 6, {**ROWS_48, **PAIRS}),
    # its research orders and budgets: P's exp2 on the FMA pipe (some or all), the own chunk's P.V first, the
    # rescale after the P barrier (early_rescale=False), the MMA warpgroups at 240 registers (3 of the second
    # chunk's V^T tiles under P.V)
    (128, 1, 64, 64, True, [1, 700, 3000, 64], 8, {**PAIRS, "p_exp2_fma": 4}),
    (64, 1, 64, 64, False, [1, 65, 129, 200, 64, 3, 1000, 4000, 130, 191, 257, 0], 5,
     {**PAIRS, "p_exp2_fma": 1, "own_chunk_first": True, "p_planes": 1}),
    (16, 4, 64, 32, True, [4, 5, 64, 1500, 77], 9, {**PAIRS, "early_rescale": False, "mma_registers": 240}),
    (12, 8, 32, 64, True, [8, 9, 100, 1000, 4000, 65], 9,
     {**ROWS_48, **PAIRS, "own_chunk_first": True, "early_rescale": True, "p_exp2_fma": 2}),
    # the S^T-warpgroup schedule with O^T rescaled beside P's exp2 (research): 48 rows, one block of 48 by
    # cp.async, 64 rows
    (12, 8, 32, 64, True, [8, 9, 100, 1000, 4000, 65], 9, {**ROWS_48, "early_rescale": True}),
    (12, 4, 64, 64, True, [4, 5, 64, 1500, 77, 3000], 7, {"early_rescale": True, "kv_loads": "cp_async"}),
    (128, 1, 64, 64, True, [1, 700, 3000, 64], 8, {"early_rescale": True, "chunk_pairs": False}),
    # 48-row blocks with Q's first 8 k32 steps in the MMA warpgroups' registers
    (12, 8, 32, 64, True, [8, 9, 100, 1000, 4000, 65], 9, {**ROWS_48, **PAIRS, "q_in_registers": True}),
    (12, 4, 64, 64, True, [4, 5, 64, 1500, 77, 3000], 7, {**PAIRS, "q_in_registers": True, "s_ahead": True}),
    # P.V a pair behind (one P plane): 1 to 4 units in flight, many segments a CTA, half-chunk boxes, 48 rows
    (128, 1, 64, 64, True, [1, 700, 3000, 64], 8, {**PAIRS, "pv_behind": 3, "p_planes": 1}),
    (64, 1, 64, 64, False, [1, 65, 129, 200, 64, 3, 1000, 4000, 130, 191, 257, 0], 5,
     {**PAIRS, "pv_behind": 1, "p_planes": 1}),
    (16, 4, 64, 32, True, [4, 5, 64, 1500, 77], 9, {**PAIRS, "pv_behind": 2, "p_planes": 1, "s_chains": 1}),
    (12, 8, 32, 64, True, [8, 9, 100, 1000, 4000, 65], 9, {**ROWS_48, **PAIRS, "pv_behind": 4, "p_planes": 1}),
    (64, 1, 64, 64, False, [1, 65, 129, 200, 64, 3, 1000, 4000, 130, 191, 257, 0], 5,
     {**PAIRS, "pv_behind": 3, "s_under_rescale": True, "p_planes": 1}),
    # the chunks prefetched into L2 ahead of their boxes (kv_prefetch): tiles of 32, so chunks across pages
    (16, 4, 64, 32, True, [4, 5, 64, 1500, 77], 9, {**PAIRS, "kv_prefetch": 3}),
    # the rope in 64-byte rows (rope_rows), alone and with 5 stages and P stored after the pair before's P.V; 48 rows
    (16, 4, 64, 64, True, [4, 5, 64, 1500, 77], 9, {**PAIRS, "rope_rows": 64, "p_planes": 2}),
    (64, 1, 64, 64, False, [1, 65, 129, 200, 64, 3, 1000, 4000, 130, 191, 257, 0], 5,
     {**PAIRS, **DEEP_RING, "p_planes": 1}),
    (12, 8, 64, 64, True, [8, 9, 100, 1000, 4000, 65], 9,
     {**ROWS_48, **PAIRS, **DEEP_RING, "p_planes": 1, "pv_behind": 4}),
    # the second chunk's P.V a dim tile at a time as its V^T loads (48 rows)
    (12, 8, 32, 64, True, [8, 9, 100, 1000, 4000, 65], 9, {**ROWS_48, **PAIRS, "pv_second_per_tile": True}),
]


def _decode_launch(cfg, q, kv, bt, seq, softmax_scale, qs, ks, plan):
    """One decode launch of `cfg` into NaN-filled outputs: (out, lse, partial_out, partial_lse) as it left them."""
    from mla_backend.hopper.decode import run_decode

    batch, q_len, num_heads, _ = q.shape
    dev = q.device
    out = torch.full((batch, q_len, num_heads, 512), float("nan"), dtype=torch.bfloat16, device=dev)
    lse = torch.full((batch, q_len, num_heads), float("nan"), dtype=torch.float32, device=dev)
    partial_out = torch.full((plan.num_slots, q_len, num_heads, 512), float("nan"), dtype=torch.float16, device=dev)
    partial_lse = torch.full((plan.num_slots, q_len, num_heads), float("nan"), device=dev)
    run_decode(cfg, q, kv, bt, seq, softmax_scale, qs, ks, plan, out, lse, partial_out, partial_lse,
               torch.cuda.current_stream())
    torch.cuda.synchronize()
    return out, lse, partial_out, partial_lse


def _decode_merged(cfg, q, kv, bt, seq, softmax_scale, qs, ks, plan):
    """`_decode_launch`, then its final out / lse (partials merged: `reference.merge_decode_outputs`)."""
    from mla_backend.reference import merge_decode_outputs

    return merge_decode_outputs(plan, *_decode_launch(cfg, q, kv, bt, seq, softmax_scale, qs, ks, plan), ks)


def _assert_launches_agree(first, second, lengths, seed, num_ctas, tile_tokens=None, q_scale=None):
    """`first` and `second` (decode configurations of one shape) launched on the same inputs and plan: every
    output, lse and partial bit the same, NaN in the same places. q_scale (a number) replaces the inputs' query
    scale: 0 makes every score 0, so that no row's max moves past each segment's first chunk."""
    sys.path.insert(0, os.path.join(REPO, "tests"))
    from mla_inputs import make_decode_inputs

    from mla_backend.plan import plan_splits

    num_heads, q_len, page_size = first.num_heads, first.q_len, first.page_size
    assert (second.num_heads, second.q_len, second.page_size) == (num_heads, q_len, page_size)
    q, kv, bt, seq, qs, ks = make_decode_inputs(lengths, q_len=q_len, num_heads=num_heads, page_size=page_size,
                                                device="cuda", seed=seed)
    if q_scale is not None:
        qs = torch.full_like(qs, q_scale)
    plan = plan_splits(seq, q_len=q_len, num_heads=num_heads, page_size=page_size, tile_tokens=tile_tokens,
                       num_ctas=num_ctas)
    for a, b in zip(_decode_launch(first, q, kv, bt, seq, 576 ** -0.5, qs, ks, plan),
                    _decode_launch(second, q, kv, bt, seq, 576 ** -0.5, qs, ks, plan)):
        assert _same_bits(a, b)


def _options_id(options) -> str:
    """A case's kernel options in its test id (`-k chunk_pairs` selects those cases): 'default' or k=v+k=v."""
    return "+".join(f"{k}={int(v) if isinstance(v, bool) else v}" for k, v in options.items()) or "default"


@pytest.mark.gpu
@pytest.mark.parametrize("options", [{}, {"p_exp2_fma": 4}, {"pv_behind": 3}, DEEP_RING, {"vt_smem": True},
                                     {"pair_rescale_skip": True}, {"pair_stagger": True}], ids=_options_id)
def test_nan_in_the_kv_reaches_its_rows_gpu(options):
    """A NaN in one token's latent is NaN in every output row and lse of its request (each row's S of that token
    is NaN, and so its p, whichever pipe takes the exp2: `p_exp2_fma=4` takes them all on the FMA pipe), never an
    empty or finite row; the other request's rows stay finite."""
    sys.path.insert(0, os.path.join(REPO, "tests"))
    from mla_inputs import make_decode_inputs

    from mla_backend.config import decode_config
    from mla_backend.plan import plan_splits

    q, kv, bt, seq, qs, ks = make_decode_inputs([700, 300], q_len=1, num_heads=128, page_size=64, device="cuda",
                                                seed=3)
    kv = kv.float()
    kv[int(bt[0, 3]), 5, 100] = float("nan")  # token 197 of request 0
    kv = kv.to(torch.float8_e4m3fn)
    plan = plan_splits(seq, q_len=1, num_heads=128, page_size=64, num_ctas=4)
    cfg = decode_config(128, 1, 64, **options)
    assert cfg.chunk_pairs
    out, lse = _decode_merged(cfg, q, kv, bt, seq, 576 ** -0.5, qs, ks, plan)
    assert torch.isnan(out[0].float()).all() and torch.isnan(lse[0]).all()
    assert torch.isfinite(out[1].float()).all() and torch.isfinite(lse[1]).all()


@pytest.mark.gpu
@pytest.mark.parametrize("num_heads,q_len,page_size,tile_tokens,causal,lengths,num_ctas,options", GPU_CASES,
                         ids=[f"{c[0]}-{c[1]}-{c[2]}-{c[3]}-{c[4]}-{_options_id(c[7])}" for c in GPU_CASES])
def test_matches_reference_gpu(num_heads, q_len, page_size, tile_tokens, causal, lengths, num_ctas, options):
    sys.path.insert(0, os.path.join(REPO, "tests"))
    from mla_inputs import make_decode_inputs

    from mla_backend.config import decode_config
    from mla_backend.plan import plan_splits
    from mla_backend.reference import mla_decode_reference, relative_l2_error

    dev = "cuda"
    q, kv, bt, seq, qs, ks = make_decode_inputs(lengths, q_len=q_len, num_heads=num_heads, page_size=page_size,
                                                device=dev, seed=1)
    softmax_scale = 576 ** -0.5
    plan = plan_splits(seq, q_len=q_len, num_heads=num_heads, page_size=page_size, tile_tokens=tile_tokens,
                       num_ctas=num_ctas)
    cfg = decode_config(num_heads, q_len, page_size, tile_tokens=tile_tokens, causal=causal, p_precision="fp8x2",
                        **options)
    got_out, got_lse = _decode_merged(cfg, q, kv, bt, seq, softmax_scale, qs, ks, plan)
    ref_out, ref_lse = mla_decode_reference(q, kv, bt, seq, softmax_scale=softmax_scale, q_scale=qs, k_scale=ks,
                                            causal=causal)
    busy = [b for b, n in enumerate(lengths) if n > 0]  # requests without KV are the combine kernel's job
    for b in busy:
        torch.testing.assert_close(got_lse[b], ref_lse[b], atol=2e-3, rtol=1e-3)
        if cfg.p_planes == 2:
            torch.testing.assert_close(got_out[b], ref_out[b].float(), atol=2e-2, rtol=2e-2)
        else:  # one e4m3 plane: e4m3's own rounding of P (test_mla_decode_gpu.TOLERANCES)
            assert relative_l2_error(got_out[b], ref_out[b]) < 3e-2


@pytest.mark.gpu
@pytest.mark.parametrize("num_heads,q_len,page_size,options", [(12, 8, 64, {}), (12, 8, 32, ROWS_48),
                                                               (16, 2, 64, {}), (12, 8, 64, {"causal": False})])
def test_zero_query_scale_matches_reference_gpu(num_heads, q_len, page_size, options):
    """q_scale 0 makes every score 0: each row's output is the mean of the V it sees and its lse the log of their
    count, as the reference's; rows whose segment lies past their causal end (requests shorter than q_len, the
    lower row block of a cluster) see nothing (output 0, lse -inf), never NaN from 0 x -inf."""
    sys.path.insert(0, os.path.join(REPO, "tests"))
    from mla_inputs import make_decode_inputs

    from mla_backend.config import decode_config
    from mla_backend.plan import plan_splits
    from mla_backend.reference import mla_decode_reference, relative_l2_error

    lengths = [3, 700, 4097, 63, 20000, 1]
    q, kv, bt, seq, qs, ks = make_decode_inputs(lengths, q_len=q_len, num_heads=num_heads, page_size=page_size,
                                                device="cuda", seed=59)
    qs = torch.zeros_like(qs)
    causal = options.get("causal", True)
    cfg = decode_config(num_heads, q_len, page_size, **options)
    plan = plan_splits(seq, q_len=q_len, num_heads=num_heads, page_size=page_size, num_ctas=12)
    got_out, got_lse = _decode_merged(cfg, q, kv, bt, seq, 576 ** -0.5, qs, ks, plan)
    ref_out, ref_lse = mla_decode_reference(q, kv, bt, seq, softmax_scale=576 ** -0.5, q_scale=qs, k_scale=ks,
                                            causal=causal)
    assert not got_out.float().isnan().any() and not got_lse.isnan().any()
    torch.testing.assert_close(got_lse, ref_lse, atol=2e-3, rtol=1e-3)
    assert relative_l2_error(got_out, ref_out) < 3e-2


@pytest.mark.gpu
@pytest.mark.parametrize("num_heads,q_len,page_size,options", [(128, 1, 64, {}), (16, 4, 64, {"s_chains": 1}),
                                                               (12, 8, 32, {**ROWS_48, **PAIRS}), (12, 8, 32, ROWS_48),
                                                               (12, 4, 64, {"kv_loads": "cp_async"}),
                                                               (128, 1, 64, {"chunk_pairs": False})])
def test_early_rescale_changes_no_bit_gpu(num_heads, q_len, page_size, options):
    """O^T rescaled beside P's exp2 (`early_rescale`: the chunk-pairs default, research in the S^T-warpgroup
    schedule) instead of after the P barrier multiplies the same values by the same alphas: every output and lse
    bit equals the other order's (in the S^T-warpgroup schedule at 48 rows, the default per-tile order's)."""
    from mla_backend.config import decode_config

    early, late = (decode_config(num_heads, q_len, page_size, early_rescale=e, **options) for e in (True, False))
    assert early.chunk_pairs == late.chunk_pairs == options.get("chunk_pairs", late.rows_per_block == 64)
    _assert_launches_agree(early, late, [1, 700, 3000, 64, 20000], seed=13, num_ctas=12)


@pytest.mark.gpu
@pytest.mark.parametrize("num_heads,q_len,page_size,options", [(128, 1, 64, {}), (12, 8, 32, ROWS_48), (16, 2, 64, {}),
                                                               (16, 4, 64, {"q_in_registers": True}),
                                                               (128, 1, 64, PAIRS),
                                                               (16, 4, 64, {**PAIRS, "s_ahead": True})])
def test_unit_rescale_skip_changes_no_bit_gpu(num_heads, q_len, page_size, options):
    """Skipping a thread's O^T rescale where all its alphas are 1 (`unit_rescale_skip`) multiplies nothing by
    anything but 1 less: every output and lse bit equals the build that rescales every chunk (48 rows compared
    with the same P.V order, which the skip needs)."""
    from mla_backend.config import decode_config

    every = decode_config(num_heads, q_len, page_size, pv_order="whole", **options)
    skip = decode_config(num_heads, q_len, page_size, unit_rescale_skip=True, **options)
    assert skip.pv_order == "whole"
    _assert_launches_agree(every, skip, [1, 700, 3000, 64, 20000], seed=11, num_ctas=12)


@pytest.mark.gpu
@pytest.mark.parametrize("num_heads,q_len,page_size,tile_tokens,options", [
    (12, 8, 32, 64, ROWS_48), (12, 4, 64, 32, {"p_planes": 2}), (12, 8, 64, 64, {**ROWS_48, "early_rescale": False})])
def test_pv_second_per_tile_changes_no_bit_gpu(num_heads, q_len, page_size, tile_tokens, options):
    """The second chunk's P.V issued a dim tile at a time as its V^T loads (`pv_second_per_tile`) runs the same
    wgmmas on the same accumulators in the same order: every output and lse bit equals the build that issues them
    after the last tile, over segments of odd and even chunk counts."""
    from mla_backend.config import decode_config

    whole, per_tile = (decode_config(num_heads, q_len, page_size, tile_tokens=tile_tokens, pv_second_per_tile=t,
                                     **PAIRS, **options) for t in (False, True))
    assert whole.rows_per_block == per_tile.rows_per_block == 48
    _assert_launches_agree(whole, per_tile, [1, 700, 3000, 64, 20000, 129, 0, 4100], seed=37, num_ctas=10,
                           tile_tokens=tile_tokens)


@pytest.mark.gpu
@pytest.mark.parametrize("num_heads,q_len,page_size,tile_tokens,options", [
    (128, 1, 64, 64, {}), (16, 4, 64, 32, {"s_chains": 1}), (64, 1, 64, 64, {"p_planes": 2}),
    (12, 8, 32, 64, ROWS_48), (12, 8, 32, 64, {**ROWS_48, "q_in_registers": True})])
def test_s_ahead_changes_no_bit_gpu(num_heads, q_len, page_size, tile_tokens, options):
    """The chunk-pairs schedule with S issued a pair ahead (`s_ahead`) does the same arithmetic in the same order
    as phase after phase: every output and lse bit is the same, over segments of odd and even chunk counts."""
    from mla_backend.config import decode_config

    phases, ahead = (decode_config(num_heads, q_len, page_size, tile_tokens=tile_tokens, s_ahead=s_ahead,
                                   **PAIRS, **options) for s_ahead in (False, True))
    _assert_launches_agree(phases, ahead, [1, 700, 3000, 64, 20000, 129, 0, 4100], seed=13, num_ctas=10,
                           tile_tokens=tile_tokens)


@pytest.mark.gpu
@pytest.mark.parametrize("num_heads,q_len,page_size,tile_tokens,options", [
    (128, 1, 64, 64, {}), (16, 4, 64, 32, {"s_chains": 1}), (64, 1, 64, 64, {"p_planes": 2}), (12, 8, 64, 64, {}),
    (16, 4, 32, 64, {})])
def test_s_between_pv_changes_no_bit_gpu(num_heads, q_len, page_size, tile_tokens, options):
    """The next pair's first S chain issued between this pair's two chunks' P.V (`s_between_pv`) computes the
    same S and sums it the same way: every output and lse bit equals phase after phase's, over segments of odd and
    even chunk counts (the chain past a segment's last pair on Q's own rows), with 5 ring stages and 4."""
    from mla_backend.config import decode_config

    phases, between = (decode_config(num_heads, q_len, page_size, tile_tokens=tile_tokens, s_between_pv=b,
                                     **PAIRS, **options) for b in (False, True))
    assert between.rows_per_block == 64 and between.s_between_pv
    _assert_launches_agree(phases, between, [1, 700, 3000, 64, 20000, 129, 0, 4100], seed=41, num_ctas=10,
                           tile_tokens=tile_tokens)


@pytest.mark.gpu
@pytest.mark.parametrize("num_heads,q_len,page_size,tile_tokens,options", [
    (128, 1, 64, 64, {}), (16, 4, 64, 32, {}), (64, 1, 64, 64, {"p_planes": 2}), (12, 8, 64, 64, {}),
    (12, 8, 32, 64, ROWS_48), (128, 1, 64, 64, {"s_after_pv": True})])
def test_stages_under_s_changes_no_bit_gpu(num_heads, q_len, page_size, tile_tokens, options):
    """The waits for a pair's chunks to land moved under its S (`stages_under_s`) change no arithmetic: every
    output and lse bit equals the waits past the maxima barrier, over segments of odd and even chunk counts, with
    whole- and half-chunk boxes, 48 rows and the next pair's S behind P.V."""
    from mla_backend.config import decode_config

    later, under = (decode_config(num_heads, q_len, page_size, tile_tokens=tile_tokens, stages_under_s=u,
                                  **PAIRS, **options) for u in (False, True))
    assert under.stages_under_s and not later.stages_under_s
    _assert_launches_agree(later, under, [1, 700, 3000, 64, 20000, 129, 0, 4100], seed=61, num_ctas=10,
                           tile_tokens=tile_tokens)


@pytest.mark.gpu
@pytest.mark.parametrize("num_heads,q_len,page_size,tile_tokens,options", [
    (128, 1, 64, 64, {}), (16, 4, 64, 32, {}), (64, 1, 64, 64, {"p_planes": 2}), (12, 8, 64, 64, {}),
    (16, 4, 32, 64, {}), (128, 2, 64, 64, {"num_stages": 4})])
def test_s_after_pv_changes_no_bit_gpu(num_heads, q_len, page_size, tile_tokens, options):
    """The next pair's S issued right behind this pair's last P.V wgmmas (`s_after_pv`) computes the same S and
    sums it the same way: every output and lse bit equals phase after phase's, over segments of odd and even chunk
    counts (the S past a segment's last pair on Q's own rows) and segments of one chunk, with 5 ring stages and 4,
    whole- and half-chunk boxes."""
    from mla_backend.config import decode_config

    phases, after = (decode_config(num_heads, q_len, page_size, tile_tokens=tile_tokens, s_after_pv=a,
                                   **PAIRS, **options) for a in (False, True))
    assert after.rows_per_block == 64 and after.s_after_pv
    _assert_launches_agree(phases, after, [1, 700, 3000, 64, 20000, 129, 0, 4100], seed=43, num_ctas=10,
                           tile_tokens=tile_tokens)


@pytest.mark.gpu
@pytest.mark.parametrize("num_heads,q_len,options", [
    (128, 1, {}), (16, 4, {}), (64, 1, {"p_planes": 2}), (12, 8, {}), (16, 4, {"early_rescale": False})])
def test_vt_smem_changes_no_bit_gpu(num_heads, q_len, options):
    """P.V on V^T that each MMA warpgroup transposed into shared memory under its S (`vt_smem`) multiplies the same
    bytes in the same order as P.V on V^T in registers: every output and lse bit equals phase after phase's (5 or
    4 ring stages there, 3 here), over segments of odd and even chunk counts and tails inside a page."""
    from mla_backend.config import decode_config

    phases, vt = (decode_config(num_heads, q_len, 64, vt_smem=v, **PAIRS, **options) for v in (False, True))
    assert vt.num_stages == 3 and not phases.vt_smem
    _assert_launches_agree(phases, vt, [1, 700, 3000, 64, 20000, 129, 0, 4100, 4097, 63], seed=43, num_ctas=10)


@pytest.mark.gpu
@pytest.mark.parametrize("num_heads,q_len,options", [
    (128, 1, {}), (16, 4, {}), (64, 1, {"num_stages": 4, "rope_rows": 128}), (12, 8, {"rows_per_block": 64}),
    (12, 8, {**ROWS_48, **PAIRS, "p_planes": 1})])
@pytest.mark.parametrize("q_scale", [None, 0.0])
def test_pair_rescale_skip_changes_no_bit_gpu(num_heads, q_len, options, q_scale):
    """Skipping O^T's rescale in the pairs where no row's max moves (`pair_rescale_skip`) changes no bit of any
    output or lse: there every alpha is 1, or 0 on a row that has seen no token and whose O^T is still 0. On random
    scores both branches run (the max moves less often along a segment); with every score 0 (q_scale 0) the
    max moves in a segment's first pair only."""
    from mla_backend.config import decode_config

    every, skipping = (decode_config(num_heads, q_len, 64, pair_rescale_skip=v, **options) for v in (False, True))
    assert skipping.pair_rescale_skip and skipping.early_rescale and not every.pair_rescale_skip
    _assert_launches_agree(every, skipping, [1, 700, 3000, 64, 20000, 129, 0, 4100, 4097, 63], seed=47,
                           num_ctas=10, q_scale=q_scale)


@pytest.mark.gpu
@pytest.mark.parametrize("num_heads,q_len,stagger,options", [(128, 1, 1, {}), (12, 8, 1, {}),
                                                            (16, 4, 1, {"kv_box_tokens": 32}), (128, 1, 2, {})])
def test_pair_stagger_on_equal_scores_changes_no_bit_gpu(num_heads, q_len, stagger, options):
    """With every score 0 (q_scale 0) no chunk moves a row's max past a segment's first, so the warpgroups a phase
    apart (`pair_stagger`) take P of both chunks against the same max as phase after phase, and skip the second
    rescale: every output and lse bit is the first form's, over segments of odd and even chunk counts. (On random
    scores P of the leader's chunk is taken against its own max where the follower's moves it: the reference
    cases bound that.)"""
    from mla_backend.config import decode_config

    phases, staggered = (decode_config(num_heads, q_len, 64, pair_stagger=v, **options) for v in (0, stagger))
    assert staggered.schedule == "pairs_stagger" and phases.schedule == "pairs"
    _assert_launches_agree(phases, staggered, [1, 700, 3000, 64, 20000, 129, 0, 4100, 4097, 63], seed=53,
                           num_ctas=10, q_scale=0.0)


@pytest.mark.gpu
@pytest.mark.parametrize("behind_options", [{"pv_behind": n} for n in (1, 2, 3, 4)]
                         + [{"pv_behind": 2, "s_under_rescale": True}], ids=_options_id)
@pytest.mark.parametrize("num_heads,q_len,page_size,tile_tokens,options", [
    (128, 1, 64, 64, {}), (16, 4, 64, 32, {"s_chains": 1}), (64, 1, 64, 64, {}), (12, 8, 32, 64, ROWS_48),
    (12, 8, 32, 64, {**ROWS_48, "q_in_registers": True})])
def test_pv_behind_changes_no_bit_gpu(num_heads, q_len, page_size, tile_tokens, options, behind_options):
    """P.V a pair behind (`pv_behind`, one P plane) adds each pair's P.V and rescales O^T in the same order on the
    same values as phase after phase, one pair later: every output and lse bit is the same, over segments of odd
    and even chunk counts, whatever number of its units are in flight, and with the next pair's S issued before
    the P barrier (`s_under_rescale`)."""
    from mla_backend.config import decode_config

    phases, behind = (decode_config(num_heads, q_len, page_size, tile_tokens=tile_tokens, p_planes=1, **PAIRS,
                                    **options, **extra) for extra in ({}, behind_options))
    _assert_launches_agree(phases, behind, [1, 700, 3000, 64, 20000, 129, 0, 4100], seed=19, num_ctas=10,
                           tile_tokens=tile_tokens)


@pytest.mark.gpu
@pytest.mark.parametrize("num_heads,q_len,page_size,options", [
    (128, 1, 64, {}), (16, 4, 64, {"s_chains": 1, "p_planes": 2}), (12, 8, 64, {**ROWS_48, "q_in_registers": True}),
    (128, 1, 64, {"s_ahead": True}), (64, 1, 64, {"pv_behind": 2, "p_planes": 1})])
def test_rope_rows_change_no_bit_gpu(num_heads, q_len, page_size, options):
    """The rope in 64-byte rows (`rope_rows`: its TMA box, Q's copies, S's descriptors and the zeroed tails in the
    64B swizzle) feeds S the same bytes: every output and lse bit equals the 128-byte rows' build, over segments
    of odd and even chunk counts."""
    from mla_backend.config import decode_config

    rows128, rows64 = (decode_config(num_heads, q_len, page_size, rope_rows=rope_rows, **PAIRS, **options)
                       for rope_rows in (128, 64))
    _assert_launches_agree(rows128, rows64, [1, 700, 3000, 64, 20000, 129, 0, 4100], seed=29, num_ctas=10)


@pytest.mark.gpu
@pytest.mark.parametrize("num_heads,q_len,page_size,options", [(128, 1, 64, DEEP_RING), (16, 4, 64, DEEP_RING),
                                                               (12, 8, 64, {**ROWS_48, **DEEP_RING, "pv_behind": 4}),
                                                               (64, 1, 64, {"pv_behind": 2, "p_after_pv": True})])
def test_p_after_pv_changes_no_bit_gpu(num_heads, q_len, page_size, options):
    """P stored once the pair before's P.V is done (`p_after_pv`, one pair's P buffers), with 5 stages of 36 KB
    where given: the same arithmetic as phase after phase, one pair later, so every output and lse bit is the same
    over segments of odd and even chunk counts."""
    from mla_backend.config import decode_config

    phases, late = (decode_config(num_heads, q_len, page_size, p_planes=1, **PAIRS, **extra)
                    for extra in ({}, options))
    _assert_launches_agree(phases, late, [1, 700, 3000, 64, 20000, 129, 0, 4100], seed=31, num_ctas=10)


@pytest.mark.gpu
@pytest.mark.parametrize("num_heads,q_len,page_size,tile_tokens,options", [
    (128, 1, 64, 64, {"kv_prefetch": 2}), (16, 4, 64, 32, {"kv_prefetch": 8}), (12, 8, 32, 64, {**ROWS_48, "kv_prefetch": 3}),
    (64, 1, 64, 64, {"kv_prefetch": 4, "pv_behind": 3, "p_planes": 1})])
def test_kv_prefetch_changes_no_bit_gpu(num_heads, q_len, page_size, tile_tokens, options):
    """The chunks prefetched into L2 ahead of their TMA loads (`kv_prefetch`) change when bytes arrive, not which:
    every output and lse bit equals the build without it, over segments of odd and even chunk counts."""
    from mla_backend.config import decode_config

    base = {k: v for k, v in options.items() if k != "kv_prefetch"}
    plain, ahead = (decode_config(num_heads, q_len, page_size, tile_tokens=tile_tokens, **PAIRS, **base, **extra)
                    for extra in ({}, {"kv_prefetch": options["kv_prefetch"]}))
    _assert_launches_agree(plain, ahead, [1, 700, 3000, 64, 20000, 129, 0, 4100], seed=23, num_ctas=10,
                           tile_tokens=tile_tokens)


def test_kv_multicast_is_checked():
    """`kv_multicast` pairs row blocks 2k and 2k + 1 in a cluster and loads each chunk once for both: only where
    there is an even number of row blocks; the default there with one P plane (`default_kv_multicast`), not with
    two, one row block or an odd number, nor with the loads a research build changes."""
    from mla_backend.config import decode_config

    for heads, q_len in ((128, 1), (128, 2), (128, 8), (12, 8), (64, 2)):
        cfg = decode_config(heads, q_len, 64, kv_multicast=True)
        assert cfg.kv_multicast and cfg.num_row_blocks % 2 == 0
    for heads, q_len in ((64, 1), (16, 4), (96, 2)):  # one block of 64 rows; three
        with pytest.raises(ValueError, match="kv_multicast is a form"):
            decode_config(heads, q_len, 64, kv_multicast=True)
    for heads, q_len in ((128, 1), (128, 2), (12, 8), (64, 2), (16, 8)):
        assert decode_config(heads, q_len, 64).kv_multicast
    for heads, q_len, options in ((64, 1, {}), (16, 4, {}), (96, 2, {}), (12, 1, {}),
                                  (128, 1, {"p_precision": "fp8x2"}), (128, 1, {"chunk_pairs": False}),
                                  (128, 1, {"kv_load_copies": 2}), (128, 1, {"kv_prefetch": 2}),
                                  (128, 1, {"pair_stagger": 2}),
                                  (128, 1, {"vt_smem": True}), (128, 1, {"skip": frozenset({"load"})})):
        assert not decode_config(heads, q_len, 64, **options).kv_multicast, (heads, q_len, options)


@pytest.mark.gpu
@pytest.mark.parametrize("num_heads,q_len,page_size,tile_tokens,options", [
    (128, 1, 64, 64, {}), (128, 2, 64, 32, {"kv_box_tokens": 32}), (128, 1, 64, 64, {"poison_smem": True}),
    (12, 8, 64, 64, {"s_after_pv": True}), (12, 8, 64, 64, {"causal": False})])
def test_kv_multicast_changes_no_bit_gpu(num_heads, q_len, page_size, tile_tokens, options):
    """Row blocks in 2-CTA clusters whose load warps take turns multicasting each chunk into both (`kv_multicast`, the
    default at these shapes) read the same bytes into the same stages: every output and lse bit equals the build whose
    CTAs load their own, over segments of odd and even chunk counts, chunks past a segment's end, empty plan CTAs (10
    plan CTAs for 8 requests), at H12 q_len 8 causal the lower block's extra chunks (the pair's last query position,
    every token past its rows' ends) and, with poisoned shared memory, no byte read before a multicast wrote it."""
    from mla_backend.config import decode_config

    own, shared = (decode_config(num_heads, q_len, page_size, tile_tokens=tile_tokens, **PAIRS, **options, **extra)
                   for extra in ({"kv_multicast": False}, {"kv_multicast": True}))
    _assert_launches_agree(own, shared, [1, 700, 3000, 64, 20000, 129, 0, 4100], seed=37, num_ctas=10,
                           tile_tokens=tile_tokens)


@pytest.mark.gpu
@pytest.mark.parametrize("num_heads,q_len,page_size,tile_tokens,options", [
    (128, 1, 64, 64, {}), (16, 4, 64, 32, {"kv_box_tokens": 32}), (12, 8, 64, 64, {"s_after_pv": True})])
def test_kv_load_copies_change_no_bit_gpu(num_heads, q_len, page_size, tile_tokens, options):
    """Each chunk's boxes issued twice (`kv_load_copies`, research) write the same bytes into the same stage and the
    stage waits for both: every output and lse bit equals the build that issues them once, over segments of odd and
    even chunk counts and chunks past the segment's end (zero-filled boxes)."""
    from mla_backend.config import decode_config

    once, twice = (decode_config(num_heads, q_len, page_size, tile_tokens=tile_tokens, **PAIRS, **options, **extra)
                   for extra in ({}, {"kv_load_copies": 2}))
    _assert_launches_agree(once, twice, [1, 700, 3000, 64, 20000, 129, 0, 4100], seed=29, num_ctas=10,
                           tile_tokens=tile_tokens)


@pytest.mark.gpu
@pytest.mark.parametrize("num_heads,q_len,page_size,options", [(12, 8, 32, ROWS_48), (12, 4, 64, {"s_ahead": True})])
def test_chunk_pairs_q_in_registers_matches_q_from_shared_memory_gpu(num_heads, q_len, page_size, options):
    """Q's first k32 steps as the register A operand (48 rows) compute the same S as from shared memory: outputs
    and lse within a few fp32 roundings of the build that reads all of Q from shared memory, far tighter than the
    reference's tolerance, so that a fragment or address error in Q's registers shows."""
    sys.path.insert(0, os.path.join(REPO, "tests"))
    from mla_inputs import make_decode_inputs

    from mla_backend.config import decode_config
    from mla_backend.plan import plan_splits
    from mla_backend.reference import relative_l2_error

    lengths = [8, 700, 3000, 64, 20000, 129]
    q, kv, bt, seq, qs, ks = make_decode_inputs(lengths, q_len=q_len, num_heads=num_heads, page_size=page_size,
                                                device="cuda", seed=17)
    plan = plan_splits(seq, q_len=q_len, num_heads=num_heads, page_size=page_size, num_ctas=10)
    smem, regs = (decode_config(num_heads, q_len, page_size, q_in_registers=q_regs, **PAIRS, **options)
                  for q_regs in (False, True))
    assert (smem.rows_per_block, regs.rows_per_block) == (48, 48)
    out_a, lse_a = _decode_merged(smem, q, kv, bt, seq, 576 ** -0.5, qs, ks, plan)
    out_b, lse_b = _decode_merged(regs, q, kv, bt, seq, 576 ** -0.5, qs, ks, plan)
    torch.testing.assert_close(lse_b, lse_a, atol=1e-5, rtol=1e-6)
    assert relative_l2_error(out_b, out_a) < 1e-3


@pytest.mark.gpu
@pytest.mark.parametrize("num_heads,q_len,options", [(16, 4, {}), (16, 4, {"s_ahead": True}), (12, 8, ROWS_48),
                                                     (128, 1, {"s_ahead": True}), (16, 4, {"pv_behind": 2}),
                                                     (128, 1, {"pv_behind": 4}), (128, 1, DEEP_RING)])
def test_chunk_pairs_launches_on_kv_held_in_l2_are_bit_identical_gpu(num_heads, q_len, options):
    """The chunk-pairs schedule's own ring protocol (landed / read mbarriers, refills by a load warpgroup) under the
    test that caught a refill racing the V^T reads (test_mla_decode_gpu.py): 100 launches on KV that fits in L2,
    where a refill lands within a few hundred cycles of its stage's release, give the same bits."""
    sys.path.insert(0, os.path.join(REPO, "tests"))
    from mla_inputs import make_decode_inputs

    from mla_backend.config import decode_config
    from mla_backend.plan import plan_splits

    gen = torch.Generator().manual_seed(num_heads * 100 + q_len)
    lengths = torch.randint(1, 3000, (32,), generator=gen).tolist()
    q, kv, bt, seq, qs, ks = make_decode_inputs(lengths, q_len=q_len, num_heads=num_heads, page_size=64,
                                                device="cuda", seed=num_heads)
    plan = plan_splits(seq, q_len=q_len, num_heads=num_heads, page_size=64,
                       num_ctas=torch.cuda.get_device_properties(0).multi_processor_count)
    cfg = decode_config(num_heads, q_len, 64, **PAIRS, **options)
    first = _decode_launch(cfg, q, kv, bt, seq, 576 ** -0.5, qs, ks, plan)
    differ = sum(not all(_same_bits(a, b) for a, b in zip(first, _decode_launch(cfg, q, kv, bt, seq, 576 ** -0.5,
                                                                                 qs, ks, plan)))
                 for _ in range(100))
    assert differ == 0, f"{differ} of 100 launches differ from the first"


@pytest.mark.gpu
@pytest.mark.parametrize("options", [{"q_in_registers": True, "s_chains": 2}, PAIRS, {**PAIRS, "s_ahead": True}])
@pytest.mark.parametrize("num_heads,q_len,page_size,lengths,seed", [
    (64, 1, 32, [0, 1, 31, 32, 33, 4095, 131072], 64), (128, 8, 64, [1, 33, 3000], 136),
    (16, 4, 64, [0, 1, 31, 32, 33, 4095, 5000], 464)])
def test_two_s_chains_with_the_rows_as_m_keep_the_lse_bound_gpu(num_heads, q_len, page_size, lengths, seed, options):
    """S = Q.K^T as two chains summed in fp32, with Q in registers or in the chunk-pairs schedule (research),
    holds the op's lse bound (within 2e-3 of the fp32 reference, tests/hopper/test_mla_decode_gpu.py) on the
    inputs of the op's tests where one chain with Q in registers did not (experiments.md: 2.4e-3 to 5.2e-3 at a
    few rows)."""
    sys.path.insert(0, os.path.join(REPO, "tests"))
    from mla_inputs import make_decode_inputs

    from mla_backend.config import decode_config
    from mla_backend.plan import plan_splits
    from mla_backend.reference import mla_decode_reference

    q, kv, bt, seq, qs, ks = make_decode_inputs(lengths, q_len=q_len, num_heads=num_heads, page_size=page_size,
                                                device="cuda", seed=seed)
    plan = plan_splits(seq, q_len=q_len, num_heads=num_heads, page_size=page_size, num_ctas=16)
    cfg = decode_config(num_heads, q_len, page_size, rows_per_block=64, **options)
    _, got_lse = _decode_merged(cfg, q, kv, bt, seq, 576 ** -0.5, qs, ks, plan)
    _, ref_lse = mla_decode_reference(q, kv, bt, seq, softmax_scale=576 ** -0.5, q_scale=qs, k_scale=ks)
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(got_lse), finite)
    torch.testing.assert_close(got_lse[finite], ref_lse[finite], atol=2e-3, rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("num_heads,q_len,page_size,rows", [(12, 1, 32, 16), (12, 8, 64, 48), (128, 1, 64, 64)])
@pytest.mark.parametrize("lazy", [True, False])
def test_rising_scores_move_the_reference_max_gpu(num_heads, q_len, page_size, rows, lazy):
    """Keys that grow along the sequence (scores rising by several times the lazy rescale's slack per chunk, and
    a few tokens that jump far above the rest) match the reference with the running max kept lazily or exactly."""
    sys.path.insert(0, os.path.join(REPO, "tests"))
    from mla_inputs import make_decode_inputs

    from mla_backend.config import decode_config
    from mla_backend.plan import plan_splits
    from mla_backend.reference import mla_decode_reference, relative_l2_error

    dev = "cuda"
    lengths = [3000, 700]
    q, kv, bt, seq, qs, ks = make_decode_inputs(lengths, q_len=q_len, num_heads=num_heads, page_size=page_size,
                                                device=dev, seed=3)
    for b, n in enumerate(lengths):
        tok = torch.arange(n, device=dev)
        pages, slots = bt[b, tok // page_size].long(), tok % page_size
        gain = 0.5 + 3.0 * tok.float() / n
        gain[tok % 997 == 500] = 6.0
        kv[pages, slots] = (kv[pages, slots].float() * gain[:, None]).to(kv.dtype)
    plan = plan_splits(seq, q_len=q_len, num_heads=num_heads, page_size=page_size, num_ctas=8)
    cfg = decode_config(num_heads, q_len, page_size, rows_per_block=rows, lazy_rescale=lazy)
    got_out, got_lse = _decode_merged(cfg, q, kv, bt, seq, 576 ** -0.5, qs, ks, plan)
    ref_out, ref_lse = mla_decode_reference(q, kv, bt, seq, softmax_scale=576 ** -0.5, q_scale=qs, k_scale=ks)
    for b in range(len(lengths)):
        torch.testing.assert_close(got_lse[b], ref_lse[b], atol=2e-3, rtol=1e-3)
        assert relative_l2_error(got_out[b], ref_out[b]) < 2e-2


# every schedule and load path, with requests that end inside a chunk and a page, split requests and one without KV
POISON_CASES = [
    (12, 1, 32, 64, [0, 1, 31, 33, 700, 4000, 130], 16, {}),  # 16 rows, the ping-pong
    (16, 2, 64, 64, [2, 63, 65, 129, 3000, 17, 900], 12, {}),  # 32 rows, TMA whole-chunk boxes
    (12, 8, 32, 64, [8, 9, 100, 1000, 4000, 65], 9, ROWS_48),  # 48 rows, TMA half-chunk boxes
    (16, 4, 64, 64, [0, 4, 5, 64, 1500, 77, 10779, 238], 24, {}),  # 64 rows, whole-chunk boxes
    (128, 1, 64, 64, [1, 700, 3000, 64], 8, {"kv_loads": "cp_async"}),  # 64 rows, cp.async
    (16, 4, 64, 32, [4, 5, 64, 1500, 77], 9, {"kv_refill": "after_store"}),  # tiles of 32: chunks across pages
    (16, 4, 64, 64, [0, 4, 5, 64, 1500, 77, 10779, 238], 24, {"q_in_registers": True}),  # S stored by rows
    (16, 4, 64, 64, [0, 4, 5, 64, 1500, 77, 10779, 238], 24, PAIRS),  # chunk pairs, a segment's zero P
    (16, 4, 64, 64, [0, 4, 5, 64, 1500, 77, 10779, 238], 24, {**PAIRS, "s_ahead": True}),
    (12, 8, 32, 64, [8, 9, 100, 1000, 4000, 65], 9, {}),  # 64-row pairs, 96 rows: the second block half padding
    (12, 8, 32, 64, [8, 9, 100, 1000, 4000, 65], 9, {**ROWS_48, **PAIRS}),  # 48 rows: S's padding rows
    (12, 8, 32, 64, [8, 9, 100, 1000, 4000, 65], 9, {**ROWS_48, **PAIRS, "q_in_registers": True}),  # Q's first steps in registers
    (16, 4, 64, 64, [0, 4, 5, 64, 1500, 77, 10779, 238], 24, {**PAIRS, "pv_behind": 3}),  # two pairs' P buffers
    (12, 8, 32, 64, [8, 9, 100, 1000, 4000, 65], 9, {**ROWS_48, **PAIRS, "pv_behind": 2}),
    (16, 4, 64, 64, [0, 4, 5, 64, 1500, 77, 10779, 238], 24, {**PAIRS, **DEEP_RING}),  # the rope's 64-byte rows
    (16, 4, 64, 64, [0, 4, 5, 64, 1500, 77, 10779, 238], 24, {"vt_smem": True}),  # V^T buffers, a missing c1
    (16, 4, 64, 64, [0, 4, 5, 64, 1500, 77, 10779, 238], 24, {"pair_rescale_skip": True}),  # stale alphas
    (16, 4, 64, 64, [0, 4, 5, 64, 1500, 77, 10779, 238], 24, {"pair_stagger": 2}),  # the follower's flag, betas
    (16, 4, 64, 64, [0, 4, 5, 64, 1500, 77, 10779, 238], 24, {"s_after_pv": True}),  # S past a segment's end
    (16, 4, 64, 64, [0, 4, 5, 64, 1500, 77, 10779, 238], 24, {"stages_under_s": True}),  # tails after the waits
    (12, 8, 64, 64, [8, 9, 100, 1000, 4000, 65], 9, {**ROWS_48, **PAIRS, **DEEP_RING, "q_in_registers": True}),
]


def _same_bits(a, b) -> bool:
    """Equal values and NaN in the same places."""
    nan_a, nan_b = torch.isnan(a.float()), torch.isnan(b.float())
    return torch.equal(nan_a, nan_b) and torch.equal(a[~nan_a], b[~nan_b])


@pytest.mark.gpu
@pytest.mark.parametrize("num_heads,q_len,page_size,tile_tokens,lengths,num_ctas,options", POISON_CASES,
                         ids=[f"{c[0]}-{c[1]}-{c[2]}-{c[3]}-{_options_id(c[6])}" for c in POISON_CASES])
def test_reads_no_shared_memory_it_did_not_write_gpu(num_heads, q_len, page_size, tile_tokens, lengths, num_ctas,
                                                     options):
    """A launch whose shared memory starts as 0xFF bytes (NaN; `DecodeConfig.poison_smem`) writes the same bits
    as a plain launch, final rows and partials: no value comes from shared memory that the launch did not write,
    which would otherwise be whatever the SM's previous kernel left there."""
    sys.path.insert(0, os.path.join(REPO, "tests"))
    from mla_inputs import make_decode_inputs

    from mla_backend.config import decode_config
    from mla_backend.plan import plan_splits

    q, kv, bt, seq, qs, ks = make_decode_inputs(lengths, q_len=q_len, num_heads=num_heads, page_size=page_size,
                                                device="cuda", seed=5)
    plan = plan_splits(seq, q_len=q_len, num_heads=num_heads, page_size=page_size, tile_tokens=tile_tokens,
                       num_ctas=num_ctas)
    outputs = {}
    for poison in (False, True):
        cfg = decode_config(num_heads, q_len, page_size, tile_tokens=tile_tokens, poison_smem=poison, **options)
        outputs[poison] = _decode_launch(cfg, q, kv, bt, seq, 576 ** -0.5, qs, ks, plan)
    names = ("out", "lse", "partial_out", "partial_lse")
    differ = [n for n, a, b in zip(names, outputs[False], outputs[True]) if not _same_bits(a, b)]
    assert not differ, f"poisoned shared memory changed {differ}"


@pytest.mark.gpu
@pytest.mark.parametrize("num_heads,q_len,page_size", [(12, 1, 32), (12, 8, 32), (16, 4, 64)])
def test_poisoned_shared_memory_reaches_the_outputs_gpu(num_heads, q_len, page_size):
    """The check's own control: with S^T's stores left out (research build skip={"store_s"}) the softmax reads
    only what the poison wrote, and every row with KV comes out NaN."""
    sys.path.insert(0, os.path.join(REPO, "tests"))
    from mla_inputs import make_decode_inputs

    from mla_backend.config import decode_config
    from mla_backend.plan import plan_splits

    lengths = [700, 65]
    q, kv, bt, seq, qs, ks = make_decode_inputs(lengths, q_len=q_len, num_heads=num_heads, page_size=page_size,
                                                device="cuda", seed=5)
    plan = plan_splits(seq, q_len=q_len, num_heads=num_heads, page_size=page_size, num_ctas=4)
    cfg = decode_config(num_heads, q_len, page_size, poison_smem=True, skip={"store_s"})
    out, _ = _decode_merged(cfg, q, kv, bt, seq, 576 ** -0.5, qs, ks, plan)
    assert bool(torch.isnan(out.float()).all())


def test_s_warpgroup_register_budgets_add_up():
    """The S^T-warpgroup schedule's setmaxnreg budgets give each thread triple what a 384-thread launch has."""
    from mla_backend.hopper.decode_swg import sw_register_budgets

    for rows in (32, 48, 64):
        pv, s = sw_register_budgets(rows)
        assert 2 * pv + s == 3 * 168
    from mla_backend.hopper.decode_swg_qregs import QREGS_PV, QREGS_S

    assert 2 * QREGS_PV + QREGS_S == 3 * 168
