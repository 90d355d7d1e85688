"""The oracle itself: checked against a float64 per-row computation, then the split reference against it."""

import itertools
import math
import zlib

import pytest
import torch

from mla_backend import mla_decode_reference, mla_decode_split_reference, plan_splits
from mla_backend.shapes import FP8, LATENT_DIM
from mla_inputs import make_decode_inputs, make_lengths


def naive_decode(q, kv, block_table, seq_lens, softmax_scale, q_scale, k_scale, causal):
    """Row by row in float64, straight from the op contract."""
    batch, q_len, heads, _ = q.shape
    page = kv.shape[1]
    out = torch.zeros(batch, q_len, heads, LATENT_DIM, dtype=torch.float64)
    lse = torch.full((batch, q_len, heads), -math.inf, dtype=torch.float64)
    scale = softmax_scale * float(q_scale) * float(k_scale)
    for b in range(batch):
        length = int(seq_lens[b])
        keys = torch.stack([kv[int(block_table[b, j // page]), j % page].double() for j in range(length)]) \
            if length else torch.zeros(0, kv.shape[-1], dtype=torch.float64)
        for t in range(q_len):
            visible = length - q_len + t + 1 if causal else length
            visible = max(0, min(visible, length))
            if visible == 0:
                continue
            for h in range(heads):
                logits = scale * (keys[:visible] @ q[b, t, h].double())
                lse[b, t, h] = torch.logsumexp(logits, 0)
                p = torch.softmax(logits, 0)
                out[b, t, h] = float(k_scale) * (p @ keys[:visible, :LATENT_DIM])
    return out, lse


def assert_lse_close(a, b, **tol):
    assert torch.equal(torch.isinf(a), torch.isinf(b)), "rows without KV must have lse -inf on both sides"
    finite = ~torch.isinf(a)
    torch.testing.assert_close(a[finite].double(), b[finite].double(), **tol)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("q_len", [1, 3])
def test_reference_matches_float64_rows(causal, q_len):
    lengths = [0, 1, 2, 31, 33, 70]
    q, kv, bt, sl, qs, ks = make_decode_inputs(lengths, q_len=q_len, num_heads=3, page_size=32, seed=q_len)
    out, lse = mla_decode_reference(q, kv, bt, sl, softmax_scale=0.07, q_scale=qs, k_scale=ks, causal=causal)
    want_out, want_lse = naive_decode(q.float(), kv, bt, sl, 0.07, qs, ks, causal)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    torch.testing.assert_close(out.double(), want_out, atol=2e-2, rtol=1e-2)  # bf16 output
    assert_lse_close(lse, want_lse, atol=1e-4, rtol=1e-5)
    assert torch.all(out[0] == 0) and torch.all(torch.isinf(lse[0]))  # empty request


def test_reference_bf16_q_is_quantized_with_q_scale():
    q, kv, bt, sl, qs, ks = make_decode_inputs([40, 90], q_len=1, num_heads=4, page_size=32, q_dtype=torch.bfloat16)
    out_bf16, lse_bf16 = mla_decode_reference(q, kv, bt, sl, softmax_scale=0.1, q_scale=qs, k_scale=ks)
    q8 = (q.float() / qs).to(FP8)
    out_fp8, lse_fp8 = mla_decode_reference(q8, kv, bt, sl, softmax_scale=0.1, q_scale=qs, k_scale=ks)
    assert torch.equal(out_bf16, out_fp8) and torch.equal(lse_bf16, lse_fp8)


def test_reference_accepts_vllm_4d_cache_view():
    q, kv, bt, sl, qs, ks = make_decode_inputs([50, 7], q_len=2, num_heads=2, page_size=64)
    a = mla_decode_reference(q, kv, bt, sl, softmax_scale=0.1, q_scale=qs, k_scale=ks)
    b = mla_decode_reference(q, kv.unsqueeze(2), bt, sl, softmax_scale=0.1, q_scale=qs, k_scale=ks)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


CASES = list(itertools.product([8, 12, 16, 64, 128], [1, 2, 4, 8], [32, 64], [True, False],
                               ["random", "uniform", "skewed"]))


@pytest.mark.parametrize("heads,q_len,page,causal,kind", CASES)
def test_split_reference_matches_reference(heads, q_len, page, causal, kind):
    seed = zlib.crc32(repr((heads, q_len, page, causal, kind)).encode())
    g = torch.Generator().manual_seed(seed)
    batch = int(torch.randint(1, 7, (1,), generator=g))
    lengths = make_lengths(kind, batch, g, page_size=page, long=1500 if heads >= 64 else 4000)
    q, kv, bt, sl, qs, ks = make_decode_inputs(lengths, q_len=q_len, num_heads=heads, page_size=page, seed=seed)
    # More CTAs than requests but few enough that CTAs also hold several requests: long requests are cut
    # into several splits and merged.
    num_ctas = batch + 1 + int(torch.randint(0, 8, (1,), generator=g))
    plan = plan_splits(sl, q_len=q_len, num_heads=heads, page_size=page, num_ctas=num_ctas, max_batch=batch + 2)
    kwargs = dict(softmax_scale=0.0417, q_scale=qs, k_scale=ks, causal=causal)
    # fp32 outputs, so the two are compared before the bf16 rounding: they must agree to fp32 rounding.
    out = torch.empty(batch, q_len, heads, LATENT_DIM)
    split_out = torch.empty_like(out)
    out, lse = mla_decode_reference(q, kv, bt, sl, out=out, **kwargs)
    split_out, split_lse = mla_decode_split_reference(q, kv, bt, sl, plan=plan, out=split_out, **kwargs)
    if kind != "random":
        assert plan.num_splits.max() > 1, "the case should exercise the merge"
    assert_lse_close(split_lse, lse, atol=2e-5, rtol=1e-6)
    torch.testing.assert_close(split_out, out, atol=2e-5, rtol=1e-5)


def test_gather_reads_tokens_without_a_valid_page_as_zeros():
    """The kernels' contract for values that only eager calls check: entries outside the cache read as zeros,
    pages past the table's width are read through its last column; the other tokens come from their pages."""
    from mla_backend.reference import gather_request_kv

    kv = torch.arange(5 * 4 * 576, dtype=torch.float32).reshape(5, 4, 576).to(torch.float8_e4m3fn)
    table = torch.tensor([[3, -1, 7]], dtype=torch.int32)  # page 1 negative, page 2 outside 5 pages
    rows = gather_request_kv(kv, table, 0, 15)  # 15 tokens: pages 0-2 of the table, then past its width
    assert rows.shape == (15, 576)
    assert torch.equal(rows[:4], kv[3].float())
    assert torch.all(rows[4:] == 0)  # pages 1, 2 and, past the width, the last column's page 7 again
    table = torch.tensor([[3, 2]], dtype=torch.int32)
    rows = gather_request_kv(kv, table, 0, 14)
    assert torch.equal(rows[4:8], kv[2].float())
    assert torch.equal(rows[8:12], kv[2].float()) and torch.equal(rows[12:], kv[2, :2].float())
    assert torch.equal(gather_request_kv(kv, table, 0, 3, 1), kv[3, 1:3].float())


def test_merge_decode_outputs_rebuilds_the_reference_from_a_launchs_writes():
    """A launch's writes laid out as the decode kernel lays them (single-split requests' rows directly, the others'
    segments as fp16 partials in units of k_scale in their workspace slots) merge back to the reference."""
    from mla_backend.reference import (_prepare, attend, gather_request_kv, merge_decode_outputs,
                                       relative_l2_error, visible_tokens)

    lengths, q_len, heads, page = [3000, 40, 0, 1500], 2, 16, 32
    q, kv, bt, sl, qs, ks = make_decode_inputs(lengths, q_len=q_len, num_heads=heads, page_size=page, seed=5)
    plan = plan_splits(sl, q_len=q_len, num_heads=heads, page_size=page, num_ctas=9)
    assert plan.num_splits.max() > 1 and (plan.num_splits[:len(lengths)] == 1).any()
    qf, kvc, logit_scale, v_scale = _prepare(q, kv, qs, ks, 0.0417)
    out = torch.zeros(len(lengths), q_len, heads, LATENT_DIM, dtype=torch.bfloat16)
    lse = torch.full((len(lengths), q_len, heads), -math.inf)
    partial_out = torch.full((plan.num_slots, q_len, heads, LATENT_DIM), float("nan"), dtype=torch.float16)
    partial_lse = torch.full((plan.num_slots, q_len, heads), float("nan"))
    tile = plan.tile_tokens
    for cta, b, first_tile, end_tile in plan.segments().tolist():
        first, end = first_tile * tile, min(end_tile * tile, lengths[b])
        o, l = attend(qf[b], gather_request_kv(kvc, bt, b, end, first), first,
                      visible_tokens(lengths[b], q_len, True, q.device), logit_scale, v_scale)
        if int(plan.num_splits[b]) == 1:
            out[b], lse[b] = o.to(out.dtype), l
        else:
            slot = int(plan.split_offset[b]) + cta - int(plan.request_first_cta[b])
            partial_out[slot], partial_lse[slot] = (o / float(ks)).to(partial_out.dtype), l
    got_out, got_lse = merge_decode_outputs(plan, out, lse, partial_out, partial_lse, ks)
    ref_out, ref_lse = mla_decode_reference(q, kv, bt, sl, softmax_scale=0.0417, q_scale=qs, k_scale=ks,
                                            out=torch.empty(len(lengths), q_len, heads, LATENT_DIM))
    assert_lse_close(got_lse, ref_lse, atol=2e-5, rtol=1e-6)
    busy = [b for b, n in enumerate(lengths) if n > 0]
    assert relative_l2_error(got_out[busy], ref_out[busy]) < 2e-3  # bf16 rows and fp16 partials
    assert relative_l2_error(ref_out[busy] * 1.01, ref_out[busy]) > 9e-3  # and the measure sees a 1% change


def test_lse_max_error_is_the_largest_difference_over_rows_with_kv():
    from mla_backend.reference import lse_max_error

    ref = torch.tensor([[1.0, -math.inf], [2.5, 0.0]])
    assert lse_max_error(ref.clone(), ref) == 0.0
    assert lse_max_error(ref + torch.tensor([[0.0, 0.0], [-0.25, 0.125]]), ref) == 0.25  # -inf - 0 stays -inf
    nan_row = ref.clone()
    nan_row[1, 0] = float("nan")
    assert lse_max_error(nan_row, ref) == math.inf
    filled = ref.clone()
    filled[0, 1] = 0.0  # a row without KV given a finite lse
    assert lse_max_error(filled, ref) == math.inf
    assert lse_max_error(torch.full((2,), -math.inf), torch.full((2,), -math.inf)) == 0.0
