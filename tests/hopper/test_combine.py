"""The LSE combine kernel: compiles for sm_90a on CPU; on the GPU it merges partials like the reference."""

import pytest
import torch

from mla_backend import DecodeWorkspace, plan_splits
from mla_backend.hopper.combine_sm90 import (DIM_SPLITS, HEAVY_SPLITS, combine_dim_splits, combine_heavy_slots,
                                             combine_prefetch_all, compile_combine_sm90, run_combine_sm90)
from mla_backend.reference import merge_partials


@pytest.mark.parametrize("rows", [12, 16, 96, 1024])
@pytest.mark.parametrize("dim_splits", [1, DIM_SPLITS])
def test_combine_compiles_for_sm90a(rows, dim_splits):
    assert compile_combine_sm90(rows, dim_splits) is not None


@pytest.mark.parametrize("rows", [12, 32])
def test_combine_prefetching_every_split_compiles_for_sm90a(rows):
    assert compile_combine_sm90(rows, DIM_SPLITS, prefetch_all=True) is not compile_combine_sm90(rows, DIM_SPLITS)


@pytest.mark.parametrize("rows,dim_splits,heavy_slots", [(12, DIM_SPLITS, 4), (12, 1, 0), (96, 1, 2), (128, 1, 4)])
def test_warp_mode_compiles_for_sm90a(rows, dim_splits, heavy_slots):
    assert compile_combine_sm90(rows, dim_splits, False, heavy_slots) is not compile_combine_sm90(rows, dim_splits)


def test_warp_mode_takes_over_for_many_rows_of_few_splits():
    assert combine_heavy_slots(batch=2, rows=12, num_sms=132, num_ctas=132) == -1  # 24 rows
    assert combine_heavy_slots(batch=32, rows=12, num_sms=132, num_ctas=132) == -1  # 384 rows
    assert combine_heavy_slots(batch=64, rows=12, num_sms=132, num_ctas=132) == 4  # 768 rows, ~3 splits each
    assert combine_heavy_slots(batch=16, rows=96, num_sms=132, num_ctas=66) == 2
    assert combine_heavy_slots(batch=8, rows=96, num_sms=132, num_ctas=66) == -1  # 768 rows, ~9 splits each
    assert combine_heavy_slots(batch=64, rows=12, num_sms=132, num_ctas=31) == 0  # no request can pass 31 splits


@pytest.mark.parametrize("lengths", [[1 << 20] * 3 + [2048] * 61, [1 << 17] + [4096] * 200 + [0] * 99])
def test_a_plan_holds_no_more_heavy_requests_than_the_warp_mode_has_room_for(lengths):
    seq_lens = torch.tensor(lengths, dtype=torch.int32)
    for num_ctas in (66, 132):
        plan = plan_splits(seq_lens, q_len=1, num_heads=12, page_size=32, num_ctas=num_ctas)
        heavy = sum(1 for s in plan.num_splits.tolist() if s > HEAVY_SPLITS)
        assert heavy <= combine_heavy_slots(len(lengths), 12, 132, num_ctas)


def test_every_split_is_prefetched_only_while_the_grid_is_one_cta_per_sm():
    assert combine_prefetch_all(batch=1, rows=12, num_sms=132)  # 48 CTAs
    assert combine_prefetch_all(batch=2, rows=16, num_sms=132)  # 128 CTAs
    assert not combine_prefetch_all(batch=3, rows=12, num_sms=132)  # 144 CTAs
    assert not combine_prefetch_all(batch=1, rows=96, num_sms=132)  # q_len 8: 384 CTAs


def test_rows_share_ctas_only_while_they_fit_one_wave():
    assert combine_dim_splits(batch=1, rows=12, num_sms=132) == DIM_SPLITS
    assert combine_dim_splits(batch=11, rows=12, num_sms=132) == DIM_SPLITS
    assert combine_dim_splits(batch=12, rows=12, num_sms=132) == 1
    assert combine_dim_splits(batch=128, rows=12, num_sms=132) == 1


def test_launcher_rejects_strided_buffers_before_launching():
    """The launcher passes raw pointers with compile-time inner strides, so a strided view must be refused."""
    seq_lens = torch.tensor([50000, 64], dtype=torch.int32)
    plan = plan_splits(seq_lens, q_len=1, num_heads=12, page_size=32, num_ctas=40)
    ws = DecodeWorkspace.for_plan(plan, 1, 12)
    out = torch.zeros(2, 1, 24, 512, dtype=torch.bfloat16)[:, :, ::2]
    lse = torch.zeros(2, 1, 12)
    with pytest.raises(ValueError, match="contiguous"):
        run_combine_sm90(plan, ws.partial_out, ws.partial_lse, out, lse, torch.ones(1), None)


def test_launcher_rejects_fp32_partials_and_a_bad_v_scale():
    """The kernel reads the partials as fp16 and the V scale as one fp32 on the device; anything else would be
    read as garbage, so the launcher refuses it by name."""
    seq_lens = torch.tensor([50000, 64], dtype=torch.int32)
    plan = plan_splits(seq_lens, q_len=1, num_heads=12, page_size=32, num_ctas=40)
    ws = DecodeWorkspace.for_plan(plan, 1, 12)
    assert ws.partial_out.dtype == torch.float16
    out = torch.zeros(2, 1, 12, 512, dtype=torch.bfloat16)
    lse = torch.zeros(2, 1, 12)
    with pytest.raises(ValueError, match="partial_out must be float16"):
        run_combine_sm90(plan, ws.partial_out.float(), ws.partial_lse, out, lse, torch.ones(1), None)
    for bad in (torch.ones(1, dtype=torch.float16), torch.ones(2)):
        with pytest.raises(ValueError, match="v_scale"):
            run_combine_sm90(plan, ws.partial_out, ws.partial_lse, out, lse, bad, None)


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
    if batch <= 2:
        assert combine_prefetch_all(batch, q_len * heads, 132) and max(plan.num_splits.tolist()) > 120
    ws = DecodeWorkspace.for_plan(plan, q_len, heads)
    ws.partial_out.normal_()
    ws.partial_lse.normal_(mean=3.0, std=4.0)
    ws.partial_lse[ws.partial_lse < -3] = float("-inf")  # some splits saw no token for some rows
    out = torch.full((batch, q_len, heads, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
    lse = torch.full((batch, q_len, heads), float("nan"), device="cuda")
    v_scale = torch.tensor([0.37], device="cuda")  # the partials are in units of the V scale
    run_combine_sm90(plan, ws.partial_out, ws.partial_lse, out, lse, v_scale, torch.cuda.current_stream())
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
def test_warp_mode_merges_only_the_outputs_requests_of_a_larger_plan():
    """A plan may hold more requests than the output (plan.max_batch >= batch): the heavy request past the
    output's last one is not merged, and the row after `out` (a guard) is never written."""
    lengths = [2048] * 63 + [1 << 17]  # the last request, with ~66 splits, is heavy
    seq_lens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    plan = plan_splits(seq_lens, q_len=1, num_heads=12, page_size=32, num_ctas=132)
    batch = len(lengths) - 1
    assert combine_heavy_slots(batch, 12, 132, plan.num_ctas) > 0 and plan.num_splits[-1].item() > HEAVY_SPLITS
    ws = DecodeWorkspace.for_plan(plan, 1, 12)
    ws.partial_out.normal_()
    ws.partial_lse.normal_(mean=3.0, std=4.0)
    out_all = torch.full((batch + 1, 1, 12, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
    lse_all = torch.full((batch + 1, 1, 12), float("nan"), device="cuda")
    run_combine_sm90(plan, ws.partial_out, ws.partial_lse, out_all[:batch], lse_all[:batch],
                     torch.ones(1, device="cuda"), torch.cuda.current_stream())
    assert torch.isnan(out_all[batch].float()).all() and torch.isnan(lse_all[batch]).all()
    splits, offsets = plan.num_splits.tolist(), plan.split_offset.tolist()
    for b in range(batch):
        if splits[b] > 1:
            sl = slice(offsets[b], offsets[b] + splits[b])
            want_out, want_lse = merge_partials(ws.partial_out[sl].float(), ws.partial_lse[sl])
            torch.testing.assert_close(out_all[b].float(), want_out, atol=1e-2, rtol=1e-2)
            torch.testing.assert_close(lse_all[b], want_lse, atol=1e-5, rtol=1e-5)
