"""The SM90 split-KV decode kernel: compiles on CPU for sm_90a without spills; matches the reference on a GPU.

The compile tests need no GPU (CUTE_DSL_ARCH=sm_90a, `compile_decode_sm90` builds its own fake arguments).
The spill check compiles in a subprocess with the PTX kept and runs `ptxas -v` on it (skipped without ptxas).
The GPU test runs the kernel on random paged inputs and checks out/lse (merging the split partials in torch)
against the plain-torch reference.
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

# (num_heads, q_len, page_size, tile_tokens, causal)
SHAPES = [
    (12, 1, 32, 64, True),
    (16, 2, 64, 64, True),
    (128, 8, 32, 64, True),
    (8, 1, 64, 64, False),
    (16, 4, 64, 32, True),
    (12, 8, 32, 64, True),  # MTP verify: 96 rows in 2 row blocks of 48
    (64, 1, 64, 64, False),
]


@pytest.mark.parametrize("num_heads,q_len,page_size,tile_tokens,causal", SHAPES)
def test_compiles(num_heads, q_len, page_size, tile_tokens, causal):
    from mla_backend.hopper.decode_sm90 import compile_decode_sm90

    fn = compile_decode_sm90(num_heads=num_heads, q_len=q_len, page_size=page_size, tile_tokens=tile_tokens,
                             causal=causal, arch="sm_90a")
    assert fn is not None
    # cached by static key
    assert compile_decode_sm90(num_heads=num_heads, q_len=q_len, page_size=page_size, tile_tokens=tile_tokens,
                               causal=causal, arch="sm_90a") is fn


def test_48_and_64_row_blocks_compile_with_three_stages():
    """48 and 64 rows fit shared memory with 3 ring stages and one S^T buffer; with 48 rows the softmax runs on
    192 threads (4 per row)."""
    from mla_backend.hopper.decode_sm90 import SM90_SMEM_CAPACITY, MLADecodeSM90, compile_decode_sm90

    op = MLADecodeSM90(12, 8, 32, rows_per_block=48)
    assert (op.num_stages, op.s_buffers, op.tpr, op.softmax_threads, op.num_row_blocks) == (3, 1, 4, 192, 2)
    assert MLADecodeSM90(128, 1, 64, rows_per_block=48).num_row_blocks == 3  # 128 rows: the last block 32
    op = MLADecodeSM90(128, 1, 64, rows_per_block=64)
    assert (op.num_stages, op.s_buffers, op.tpr, op.softmax_threads, op.num_row_blocks) == (3, 1, 4, 256, 2)
    # 32 rows keep the double-buffered partials (without the S^T warpgroup)
    assert MLADecodeSM90(12, 8, 32, rows_per_block=32, s_warpgroup=False).s_buffers == 2
    for h, q, rows in ((12, 8, 48), (128, 1, 48), (128, 1, 64), (12, 8, 64)):
        fn = compile_decode_sm90(h, q, 32, rows_per_block=rows, arch="sm_90a")
        assert fn.decode_op.rows == rows and fn.decode_op.shared_storage_bytes <= SM90_SMEM_CAPACITY
    with pytest.raises(ValueError, match="16, 32, 48 or 64"):
        MLADecodeSM90(12, 8, 32, rows_per_block=96)


def test_default_rows_per_block_takes_the_fewest_row_blocks():
    """Each row block reads the KV span again: the fewest blocks, the smallest block among equals."""
    from mla_backend.hopper.decode_sm90 import MLADecodeSM90, default_rows_per_block

    expected = {(12, 1): 16, (16, 1): 16, (8, 2): 16, (16, 2): 32, (12, 2): 32, (12, 4): 48, (16, 4): 64,
                (12, 8): 48, (16, 8): 64, (128, 1): 64, (128, 2): 64, (32, 1): 32, (40, 1): 48}
    for (h, q), rows in expected.items():
        assert default_rows_per_block(h, q) == rows, (h, q)
    op = MLADecodeSM90(12, 8, 32)
    assert (op.rows, op.num_row_blocks, op.num_stages) == (48, 2, 3)


def test_pingpong_is_the_16_row_default_and_needs_16_rows():
    from mla_backend.hopper.decode_sm90 import MLADecodeSM90, compile_decode_sm90

    assert MLADecodeSM90(12, 1, 32).pingpong and MLADecodeSM90(8, 2, 64).pingpong
    assert not MLADecodeSM90(16, 2, 32).pingpong  # 32 rows
    assert not MLADecodeSM90(12, 1, 32, pingpong=False).pingpong
    with pytest.raises(ValueError, match="16-row"):
        MLADecodeSM90(16, 2, 32, pingpong=True)
    fn = compile_decode_sm90(12, 1, 32, pingpong=False, arch="sm_90a")
    assert fn.decode_op.pingpong is False and compile_decode_sm90(12, 1, 32, arch="sm_90a") is not fn


def test_p_planes_knob(monkeypatch):
    """P in one e4m3 plane (CUTE_MLA_P_PLANES=1, more than 16 rows only) or two (hi/lo, the default): part of the
    static key, and a bad value is an error naming the variable."""
    from mla_backend.hopper.decode_sm90 import MLADecodeSM90, compile_decode_sm90, default_p_planes

    monkeypatch.delenv("CUTE_MLA_P_PLANES", raising=False)
    assert default_p_planes(12, 8) == 2 and MLADecodeSM90(12, 8, 32).p_planes == 2
    two = compile_decode_sm90(12, 8, 32, arch="sm_90a")
    monkeypatch.setenv("CUTE_MLA_P_PLANES", "1")
    assert MLADecodeSM90(12, 8, 32).p_planes == 1
    one = compile_decode_sm90(12, 8, 32, arch="sm_90a")
    assert one is not two and one.decode_op.p_planes == 1 and two.decode_op.p_planes == 2
    assert default_p_planes(12, 1) == 2 and default_p_planes(8, 2) == 2 and default_p_planes(16, 2) == 1
    assert MLADecodeSM90(12, 1, 32, pingpong=False, p_planes=1).p_planes == 1  # explicit, any schedule
    assert compile_decode_sm90(12, 8, 32, p_planes=2, arch="sm_90a") is two  # an explicit value wins
    for bad in ("3", "hi"):
        monkeypatch.setenv("CUTE_MLA_P_PLANES", bad)
        with pytest.raises(ValueError, match="CUTE_MLA_P_PLANES"):
            MLADecodeSM90(12, 8, 32)
    with pytest.raises(ValueError, match="p_planes"):
        MLADecodeSM90(12, 8, 32, p_planes=3)


_PTX_SCRIPT = """
import sys
sys.path.insert(0, {repo!r})
from mla_backend.hopper.decode_sm90 import compile_decode_sm90
compile_decode_sm90(num_heads={h}, q_len={q}, page_size={p}, causal=True, rows_per_block={rows}, p_planes={planes},
                    arch="sm_90a")
"""


@pytest.mark.parametrize("num_heads,q_len,page_size,rows,planes", [
    (12, 1, 32, None, 2), (16, 2, 64, None, 2), (12, 8, 32, None, 2), (128, 8, 32, None, 2), (12, 8, 32, 48, 2),
    (128, 1, 64, 48, 2), (128, 1, 64, 64, 2), (12, 1, 32, None, 1), (12, 8, 32, None, 1), (128, 1, 64, 64, 1)])
def test_no_spills(tmp_path, num_heads, q_len, page_size, rows, planes):
    ptxas = shutil.which("ptxas")
    assert ptxas, "ptxas (CUDA 12.8+ / 13) must be on PATH: the spill check is part of the CPU suite"
    env = dict(os.environ, CUTE_DSL_ARCH="sm_90a", CUTE_DSL_KEEP="ptx", CUTE_DSL_DUMP_DIR=str(tmp_path))
    script = _PTX_SCRIPT.format(repo=REPO, h=num_heads, q=q_len, p=page_size, rows=rows, planes=planes)
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
    assert "C7512" not in log, log  # "wgmma.mma_async instructions are serialized": too few registers
    # the 16-row (ping-pong) schedule copies the KV with the L2::128B prefetch hint; the others measured slower
    # with it and keep CuTe's plain cp.async
    from mla_backend.shapes import default_rows_per_block

    pingpong = (default_rows_per_block(num_heads, q_len) if rows is None else rows) == 16
    with open(ptx[0]) as f:
        assert ("cp.async.cg.shared.global.L2::128B" in f.read()) == pingpong


def _merge_kernel_outputs(plan, seq_lens, out, lse, partial_out, partial_lse, k_scale):
    """Final out/lse from the kernel's direct writes and (for split requests) its partials (fp16, in units of
    k_scale)."""
    from mla_backend.reference import merge_partials

    out = out.float().clone()
    lse = lse.clone()
    num_splits = plan.num_splits.cpu().tolist()
    offsets = plan.split_offset.cpu().tolist()
    for b in range(seq_lens.shape[0]):
        n = num_splits[b]
        if n > 1:
            o, l = merge_partials(partial_out[offsets[b]:offsets[b] + n].float() * k_scale,
                                  partial_lse[offsets[b]:offsets[b] + n])
            out[b] = o
            lse[b] = l
    return out, lse


PINGPONG_OFF = {"pingpong": False}
ROWS_48 = {"rows_per_block": 48}
ROWS_64 = {"rows_per_block": 64}
ROWS_32 = {"rows_per_block": 32}

GPU_CASES = [
    # (num_heads, q_len, page_size, tile_tokens, causal, lengths, num_ctas, kernel options)
    (12, 1, 32, 64, True, [1, 31, 32, 33, 65, 700, 4000, 130], 16, {}),
    (12, 1, 32, 64, True, [1, 31, 32, 33, 65, 700, 4000, 130], 16, PINGPONG_OFF),  # 16 rows, both warpgroups
    (8, 2, 64, 32, True, [2, 63, 64, 65, 129, 3000, 17, 900, 0], 11, {}),
    (16, 2, 64, 64, True, [2, 63, 64, 65, 129, 3000, 17, 900], 12, {}),
    (128, 8, 32, 64, True, [8, 100, 1000], 8, {}),
    (8, 1, 64, 64, False, [0, 1, 64, 2000, 0, 333], 7, {}),
    (16, 4, 64, 32, True, [4, 5, 64, 1500, 77], 9, {}),
    (12, 8, 32, 64, True, [8, 9, 100, 1000, 4000, 65], 9, {}),  # default: 96 rows as two full 48-row blocks
    (12, 8, 32, 64, True, [8, 9, 100, 1000, 4000, 65], 9, ROWS_32),  # 32-row blocks (3 ring stages -> 4)
    (128, 1, 64, 64, True, [1, 700, 3000, 64], 8, ROWS_32),
    (128, 1, 64, 64, True, [1, 700, 3000, 64], 8, ROWS_48),  # 128 rows: the third block has 32
    (16, 2, 32, 32, True, [2, 63, 64, 65, 1500], 6, ROWS_48),  # 32 rows in one block, 16 of them padding
    (128, 1, 64, 64, True, [1, 700, 3000, 64], 8, ROWS_64),  # 128 rows: two 64-row blocks
    (16, 4, 32, 64, True, [4, 5, 64, 1500, 77], 9, ROWS_64),  # 64 rows in one block
    (12, 8, 32, 64, True, [8, 9, 100, 1000, 4000, 65], 9, ROWS_64),  # 96 rows: 64, then 32 and 32 padding
]


@pytest.mark.gpu
@pytest.mark.parametrize("num_heads,q_len,page_size,tile_tokens,causal,lengths,num_ctas,options", GPU_CASES)
def test_matches_reference_gpu(num_heads, q_len, page_size, tile_tokens, causal, lengths, num_ctas, options):
    sys.path.insert(0, os.path.join(REPO, "tests"))
    from mla_inputs import make_decode_inputs

    from mla_backend.hopper.decode_sm90 import run_decode_sm90
    from mla_backend.planner import plan_splits
    from mla_backend.reference import mla_decode_reference

    dev = "cuda"
    q, kv, bt, seq, qs, ks = make_decode_inputs(lengths, q_len=q_len, num_heads=num_heads, page_size=page_size,
                                                device=dev, seed=1)
    softmax_scale = 576 ** -0.5
    plan = plan_splits(seq, q_len=q_len, num_heads=num_heads, page_size=page_size, tile_tokens=tile_tokens,
                       num_ctas=num_ctas)
    batch = len(lengths)
    out = torch.full((batch, q_len, num_heads, 512), float("nan"), dtype=torch.bfloat16, device=dev)
    lse = torch.full((batch, q_len, num_heads), float("nan"), dtype=torch.float32, device=dev)
    partial_out = torch.full((plan.num_slots, q_len, num_heads, 512), float("nan"), dtype=torch.float16, device=dev)
    partial_lse = torch.full((plan.num_slots, q_len, num_heads), float("nan"), device=dev)
    run_decode_sm90(q, kv, bt, seq, softmax_scale, qs, ks, plan, out, lse, partial_out, partial_lse,
                    causal=causal, **options)
    torch.cuda.synchronize()
    got_out, got_lse = _merge_kernel_outputs(plan, seq, out, lse, partial_out, partial_lse, ks)
    ref_out, ref_lse = mla_decode_reference(q, kv, bt, seq, softmax_scale=softmax_scale, q_scale=qs, k_scale=ks,
                                            causal=causal)
    busy = [b for b, n in enumerate(lengths) if n > 0]  # requests without KV are the combine kernel's job
    for b in busy:
        torch.testing.assert_close(got_lse[b], ref_lse[b], atol=2e-3, rtol=1e-3)
        torch.testing.assert_close(got_out[b], ref_out[b].float(), atol=2e-2, rtol=2e-2)


def test_s_warpgroup_schedule_for_32_48_and_64_rows(monkeypatch):
    """32-, 48- and 64-row blocks run kernel_sw (384 threads, setmaxnreg 208 / 88, 200 / 104 at 64 rows) unless
    CUTE_MLA_S_WARPGROUP=0; 16-row blocks keep the ping-pong. It compiles without spills (the spill checks
    above cover the default configurations, which include it)."""
    from mla_backend.hopper.decode_sm90 import MLADecodeSM90, _static_key, sw_register_budgets

    for rows in (32, 48, 64):
        pv, s = sw_register_budgets(rows)
        assert 2 * pv + s == 3 * 168  # what a 384-thread launch gives each thread triple
    for h, q, sw in ((12, 8, True), (16, 2, True), (12, 4, True), (12, 1, False), (128, 1, True), (16, 4, True)):
        op = MLADecodeSM90(h, q, 32)
        assert op.s_wg == sw and op.num_threads == (384 if sw else 256), (h, q)
        if sw:
            assert op.s_buffers == 1
    monkeypatch.setenv("CUTE_MLA_S_WARPGROUP", "0")
    assert not MLADecodeSM90(12, 8, 32).s_wg
    assert _static_key(12, 8, 32, 64, True, None, None, None, None, "sm_90a")[10] is False
    monkeypatch.delenv("CUTE_MLA_S_WARPGROUP")
    assert _static_key(12, 8, 32, 64, True, None, None, None, None, "sm_90a")[10] is True
    with pytest.raises(ValueError, match="32-, 48- or 64-row"):
        MLADecodeSM90(12, 1, 32, rows_per_block=16, pingpong=False, s_warpgroup=True)
