"""The LSE combine kernel (mla_backend.hopper.combine): compiles for sm_90a on CPU in every mode; on the GPU it merges
partials like the reference. Which mode a batch gets is config.combine_config's (tests/test_config.py)."""

import glob
import os
import re
import subprocess
import sys

import pytest
import torch

from mla_backend import DecodeWorkspace, plan_splits
from mla_backend.config import COMBINE_DIM_SPLITS, HEAVY_SPLITS, CombineConfig, combine_config
from mla_backend.hopper.combine import compile_combine, run_combine
from mla_backend.reference import merge_partials


@pytest.mark.parametrize("rows", [12, 16, 96, 1024])
@pytest.mark.parametrize("dim_splits", [1, 2, COMBINE_DIM_SPLITS])
def test_row_mode_compiles_for_sm90a(rows, dim_splits):
    assert compile_combine(CombineConfig(rows, dim_splits)) is not None


@pytest.mark.parametrize("rows", [12, 32])
def test_prefetching_every_split_compiles_for_sm90a(rows):
    assert compile_combine(CombineConfig(rows, COMBINE_DIM_SPLITS, prefetch_all=True)) is not \
        compile_combine(CombineConfig(rows, COMBINE_DIM_SPLITS))


@pytest.mark.parametrize("rows,dim_splits,heavy_slots", [(12, COMBINE_DIM_SPLITS, 4), (12, 1, 0), (96, 1, 2),
                                                         (128, 1, 4)])
def test_warp_mode_compiles_for_sm90a(rows, dim_splits, heavy_slots):
    assert compile_combine(CombineConfig(rows, dim_splits, heavy_slots=heavy_slots)) is not \
        compile_combine(CombineConfig(rows, dim_splits))


_COMBINE_PTX_SCRIPT = """
from mla_backend.config import CombineConfig
from mla_backend.hopper.combine import compile_combine
compile_combine(CombineConfig({rows}, {dim_splits}, pdl={pdl}, heavy_slots={heavy_slots}))
"""


@pytest.mark.parametrize("dim_splits,pdl,heavy_slots", [(COMBINE_DIM_SPLITS, True, -1), (1, True, -1), (1, False, -1),
                                                        (1, True, 4)])
def test_only_the_plan_and_scale_are_read_before_the_wait(tmp_path, dim_splits, pdl, heavy_slots):
    """With PDL, the combine loads what it reads of the plan and the V scale (from the L2) before
    `griddepcontrol.wait`, and nothing else touches global memory before it: no store, no partial, no LSE. Row
    mode: its row's split count and workspace offset; warp mode: those of its request, or (heavy CTAs) every
    request's, in the search for the heavy ones. A build without PDL has no wait at all."""
    env = dict(os.environ, CUTE_DSL_ARCH="sm_90a", CUTE_DSL_KEEP="ptx", CUTE_DSL_DUMP_DIR=str(tmp_path))
    env.pop("CUTE_MLA_KERNEL_CACHE", None)  # a kernel loaded from a cache directory leaves no PTX
    script = _COMBINE_PTX_SCRIPT.format(rows=12, dim_splits=dim_splits, pdl=pdl, heavy_slots=heavy_slots)
    subprocess.run([sys.executable, "-c", script], env=env, check=True, cwd=str(tmp_path))
    ptx = glob.glob(str(tmp_path / "*.ptx"))
    assert len(ptx) == 1, ptx
    body = open(ptx[0]).read()
    body = body[body.index(".entry"):]
    if not pdl:
        assert "griddepcontrol" not in body
        return
    head = body[:body.index("griddepcontrol.wait")]
    global_ops = re.findall(r"\b(?:ld|st|red|atom|cp\.async)\.global[.\w]*", head)
    if heavy_slots >= 0:
        assert global_ops.count("ld.global.cg.f32") == 1, global_ops
        assert set(global_ops) == {"ld.global.cg.u32", "ld.global.cg.f32"}, global_ops
    else:
        assert global_ops == ["ld.global.cg.u32", "ld.global.cg.u32", "ld.global.cg.f32"], global_ops


def _run(plan, ws, out, lse, v_scale, batch, heads, q_len):
    cfg = combine_config(batch, q_len * heads, 132, plan.num_ctas)
    run_combine(cfg, plan, ws.partial_out, ws.partial_lse, out, lse, v_scale, torch.cuda.current_stream())
    return cfg


MIXED_LENGTHS = [0, 1, 50000, 64, 300000]


@pytest.mark.gpu
@pytest.mark.parametrize("heads,q_len,num_ctas,lengths", [
    (12, 1, 40, MIXED_LENGTHS), (12, 1, 132, MIXED_LENGTHS), (16, 4, 40, MIXED_LENGTHS), (128, 2, 40, MIXED_LENGTHS),
    (12, 1, 132, [300000, 64]), (12, 1, 132, [1 << 20]),
    # warp mode: one heavy request among 63 short ones, three heavy ones, more requests than a CTA has threads
    (12, 1, 132, [1 << 17] + [2048] * 63), (12, 1, 132, [300000] * 3 + [2048] * 61 + [0, 1]),
    (12, 8, 66, [300000] * 2 + [700] * 40), (12, 1, 132, [1 << 17] + [300] * 300)])
def test_combine_matches_reference_merge(heads, q_len, num_ctas, lengths):
    """num_ctas 132 gives the 5 x 12 rows four CTAs each (quarters of the columns), the others one. One or two
    requests at 12 heads make a grid of at most one CTA per SM, whose warps load every split up front (the long
    request has ~130 splits, so the prefetch, not the loop after it, merges them)."""
    torch.manual_seed(heads)
    batch = len(lengths)
    seq_lens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    plan = plan_splits(seq_lens, q_len=q_len, num_heads=heads, page_size=32, num_ctas=num_ctas)
    ws = DecodeWorkspace.for_plan(plan, q_len, heads)
    ws.partial_out.normal_()
    ws.partial_lse.normal_(mean=3.0, std=4.0)
    ws.partial_lse[ws.partial_lse < -3] = float("-inf")  # some splits saw no token for some rows
    out = torch.full((batch, q_len, heads, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
    lse = torch.full((batch, q_len, heads), float("nan"), device="cuda")
    v_scale = torch.tensor([0.37], device="cuda")  # the partials are in units of the V scale
    cfg = _run(plan, ws, out, lse, v_scale, batch, heads, q_len)
    if batch <= 2:
        assert cfg.prefetch_all and max(plan.num_splits.tolist()) > 120
    splits, offsets = plan.num_splits.tolist(), plan.split_offset.tolist()
    for b in range(batch):
        if splits[b] == 0:
            assert torch.all(out[b] == 0) and torch.all(torch.isneginf(lse[b]))
        elif splits[b] == 1:
            assert torch.isnan(lse[b]).all(), "single-split requests are the decode kernel's to write"
        else:
            sl = slice(offsets[b], offsets[b] + splits[b])
            want_out, want_lse = merge_partials(ws.partial_out[sl].float() * 0.37, ws.partial_lse[sl])
            torch.testing.assert_close(out[b].float(), want_out, atol=1e-2, rtol=1e-2)
            torch.testing.assert_close(lse[b], want_lse, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("dim_splits", [1, 2, COMBINE_DIM_SPLITS])
@pytest.mark.parametrize("prefetch_all", [False, True])
def test_every_row_mode_config_merges_like_the_reference(dim_splits, prefetch_all):
    """Whatever combine_config picks for a batch, every row-mode configuration (CTAs per row, prefetch) merges the
    same plan alike (research tools time the others: benchmarks/bench_step_parts.py --combine-variant)."""
    torch.manual_seed(dim_splits)
    lengths = [50000, 131072, 0, 64]
    seq_lens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    plan = plan_splits(seq_lens, q_len=1, num_heads=12, page_size=64, num_ctas=132)
    ws = DecodeWorkspace.for_plan(plan, 1, 12)
    ws.partial_out.normal_()
    ws.partial_lse.normal_(mean=3.0, std=4.0)
    out = torch.full((4, 1, 12, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
    lse = torch.full((4, 1, 12), float("nan"), device="cuda")
    cfg = CombineConfig(12, dim_splits, prefetch_all=prefetch_all)
    run_combine(cfg, plan, ws.partial_out, ws.partial_lse, out, lse, torch.ones(1, device="cuda"),
                torch.cuda.current_stream())
    splits, offsets = plan.num_splits.tolist(), plan.split_offset.tolist()
    assert splits[0] > 1 and splits[1] > 1 and splits[2] == 0
    assert torch.all(out[2] == 0) and torch.all(torch.isneginf(lse[2]))
    for b in (0, 1):
        sl = slice(offsets[b], offsets[b] + splits[b])
        want_out, want_lse = merge_partials(ws.partial_out[sl].float(), ws.partial_lse[sl])
        torch.testing.assert_close(out[b].float(), want_out, atol=1e-2, rtol=1e-2)
        torch.testing.assert_close(lse[b], want_lse, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("lengths", [[300000, 64], [1 << 17] + [2048] * 63, [50000] * 8])
def test_a_nan_partial_gives_a_nan_row_not_an_empty_one(lengths):
    """NaN in the decode's inputs reaches the combine as a NaN partial lse: that row's merged output and lse are
    NaN (never out = 0, which reads as an empty row); other rows are unaffected. Row, quarter and warp modes."""
    batch = len(lengths)
    seq_lens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    plan = plan_splits(seq_lens, q_len=1, num_heads=12, page_size=32, num_ctas=132)
    ws = DecodeWorkspace.for_plan(plan, 1, 12)
    ws.partial_out.normal_()
    ws.partial_lse.normal_(mean=3.0, std=1.0)
    b = next(i for i, n in enumerate(plan.num_splits.tolist()) if n > 1)
    first = int(plan.split_offset[b])
    ws.partial_lse[first + 1, 0, 5] = float("nan")
    out = torch.zeros(batch, 1, 12, 512, dtype=torch.bfloat16, device="cuda")
    lse = torch.zeros(batch, 1, 12, device="cuda")
    _run(plan, ws, out, lse, torch.ones(1, device="cuda"), batch, 12, 1)
    assert torch.isnan(lse[b, 0, 5]) and torch.isnan(out[b, 0, 5].float()).all()
    assert torch.isfinite(lse[b, 0, :5]).all() and torch.isfinite(out[b, 0, 6:].float()).all()


@pytest.mark.gpu
def test_warp_mode_merges_only_the_outputs_requests_of_a_larger_plan():
    """A plan may hold more requests than the output (plan.max_batch >= batch): the heavy request past the
    output's last one is not merged, and the row after `out` (a guard) is never written."""
    lengths = [2048] * 63 + [1 << 17]  # the last request, with ~66 splits, is heavy
    seq_lens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    plan = plan_splits(seq_lens, q_len=1, num_heads=12, page_size=32, num_ctas=132)
    batch = len(lengths) - 1
    assert combine_config(batch, 12, 132, plan.num_ctas).heavy_slots > 0
    assert plan.num_splits[-1].item() > HEAVY_SPLITS
    ws = DecodeWorkspace.for_plan(plan, 1, 12)
    ws.partial_out.normal_()
    ws.partial_lse.normal_(mean=3.0, std=4.0)
    out_all = torch.full((batch + 1, 1, 12, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
    lse_all = torch.full((batch + 1, 1, 12), float("nan"), device="cuda")
    _run(plan, ws, out_all[:batch], lse_all[:batch], torch.ones(1, device="cuda"), batch, 12, 1)
    assert torch.isnan(out_all[batch].float()).all() and torch.isnan(lse_all[batch]).all()
    splits, offsets = plan.num_splits.tolist(), plan.split_offset.tolist()
    for b in range(batch):
        if splits[b] > 1:
            sl = slice(offsets[b], offsets[b] + splits[b])
            want_out, want_lse = merge_partials(ws.partial_out[sl].float(), ws.partial_lse[sl])
            torch.testing.assert_close(out_all[b].float(), want_out, atol=1e-2, rtol=1e-2)
            torch.testing.assert_close(lse_all[b], want_lse, atol=1e-5, rtol=1e-5)
