"""The SM90 decode path (planner + decode + combine) on the GPU against the fp32 reference."""

import os
import shutil
import subprocess
import sys

import pytest
import torch

from mla_backend import DecodeWorkspace, SplitPlan, mla_decode, mla_decode_reference, plan_splits

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
from mla_inputs import make_decode_inputs  # noqa: E402

pytestmark = pytest.mark.gpu

M = 1 << 20


# Error bounds per precision mode (relative L2 against the fp32 reference, worst row's max error): FP8 inputs
# enter the FP8 MMAs exactly, so the error comes from P, the fp32 accumulation order and the bf16 output. Two
# planes carry P to ~2^-8 relative; one plane to 2^-4 per p (measured on these inputs, H200: relative L2 up to
# 1.5e-2, rows up to 4.6e-2; docs/performance.md, Numerics). The lse does not depend on P's rounding.
TOLERANCES = {2: dict(rel_tol=5e-3, row_tol=5e-2), 1: dict(rel_tol=3e-2, row_tol=1e-1)}


def planes_of(heads, q_len, p_precision=None):
    """e4m3 planes of P the op uses for this shape and mode (None: the default mode)."""
    from mla_backend.config import environment, p_planes_for
    from mla_backend.shapes import default_rows_per_block

    return p_planes_for(p_precision or environment().p_precision, default_rows_per_block(heads, q_len))


def check_against_reference(out, lse, ref_out, ref_lse, rel_tol=5e-3, row_tol=5e-2):
    """Relative L2 error under rel_tol, every row's max error under row_tol, lse within 2e-3; rows without KV are
    exactly those with lse -inf and out 0; no NaN anywhere."""
    assert not torch.isnan(out).any(), "unwritten or NaN output"
    assert not torch.isnan(lse).any(), "unwritten or NaN lse"
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse)), "rows without KV must be exactly those with lse -inf"
    empty = torch.isinf(ref_lse)
    assert torch.all(out[empty] == 0), "rows without KV must be 0"
    ref = ref_out.float()
    err = (out.float() - ref).norm() / ref.norm().clamp(min=1e-30)
    assert err < rel_tol, f"relative error {err:.2e}"
    finite = ~empty
    torch.testing.assert_close(lse[finite], ref_lse[finite], atol=2e-3, rtol=1e-4)
    per_row = (out.float() - ref).abs().amax(-1) / ref.abs().amax(-1).clamp(min=1e-6)
    assert per_row.max() < row_tol, f"worst row error {per_row.max():.2e}"


def run_and_check(lengths, heads, q_len, page, causal=True, seed=0, p_precision=None):
    """The op (its own plan) on random inputs against the reference, with the bounds of the mode it runs."""
    q, kv, bt, sl, qs, ks = make_decode_inputs(lengths, q_len=q_len, num_heads=heads, page_size=page,
                                               device="cuda", seed=seed)
    out = torch.full((len(lengths), q_len, heads, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
    lse = torch.full((len(lengths), q_len, heads), float("nan"), device="cuda")
    kwargs = dict(softmax_scale=576 ** -0.5, q_scale=qs, k_scale=ks, causal=causal)
    mla_decode(q, kv, bt, sl, out=out, lse=lse, p_precision=p_precision, **kwargs)
    ref_out, ref_lse = mla_decode_reference(q, kv, bt, sl, **kwargs)
    check_against_reference(out, lse, ref_out, ref_lse, **TOLERANCES[planes_of(heads, q_len, p_precision)])
    ref = ref_out.float()
    return float((out.float() - ref).norm() / ref.norm())


EDGE = [0, 1, 31, 32, 33, 4095]


@pytest.mark.parametrize("heads", [8, 12, 16, 32, 64, 128])
def test_heads_edge_lengths(heads):
    run_and_check(EDGE + [131072], heads, 1, 32, seed=heads)


@pytest.mark.parametrize("q_len", [1, 2, 4, 8])
@pytest.mark.parametrize("heads", [12, 16])
@pytest.mark.parametrize("page", [32, 64])
def test_q_len_pages(q_len, heads, page):
    run_and_check(EDGE + [5000], heads, q_len, page, seed=q_len * 100 + page)


@pytest.mark.parametrize("heads,q_len", [(128, 2), (64, 8), (128, 8)])
def test_many_rows(heads, q_len):
    run_and_check([1, 33, 3000], heads, q_len, 64, seed=heads + q_len)


@pytest.mark.parametrize("causal", [False])
@pytest.mark.parametrize("q_len", [1, 4])
def test_not_causal(q_len, causal):
    run_and_check(EDGE, 12, q_len, 32, causal=causal, seed=7)


@pytest.mark.parametrize("heads,q_len", [(12, 1), (12, 8)])
def test_split_partials_hold_a_large_v_scale(heads, q_len):
    """The split partials are fp16 in units of k_scale (the combine applies it): with k_scale 2^19 the outputs
    go past fp16's 65504 and still come out right. q_scale shrinks by as much, so the logits are those of the
    usual inputs."""
    lengths = [20000, 700, 3000]
    q, kv, bt, sl, qs, ks = make_decode_inputs(lengths, q_len=q_len, num_heads=heads, page_size=32, device="cuda",
                                               seed=5)
    qs, ks = qs / (1 << 20), ks * (1 << 20)
    plan = plan_splits(sl, q_len=q_len, num_heads=heads, page_size=32, num_ctas=16)
    assert plan.num_splits.max().item() > 1  # what this test is for: the partials and the combine
    out = torch.full((len(lengths), q_len, heads, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
    lse = torch.full((len(lengths), q_len, heads), float("nan"), device="cuda")
    kwargs = dict(softmax_scale=576 ** -0.5, q_scale=qs, k_scale=ks)
    mla_decode(q, kv, bt, sl, out=out, lse=lse, plan=plan, **kwargs)
    ref_out, ref_lse = mla_decode_reference(q, kv, bt, sl, **kwargs)
    assert ref_out.float().abs().max() > 65504
    check_against_reference(out, lse, ref_out, ref_lse, **TOLERANCES[planes_of(heads, q_len)])


def test_one_million_tokens_skewed():
    run_and_check([M] + [4096] * 15, 12, 1, 32, seed=11)


def test_one_million_tokens_mtp():
    run_and_check([M, 33], 16, 8, 64, seed=12)


@pytest.mark.parametrize("batch", [1, 17, 64, 1024])
def test_batch_sizes(batch):
    """Up to MAX_BATCH (1024, vLLM's default max_num_seqs on an H200) requests in one call."""
    g = torch.Generator().manual_seed(batch)
    lengths = torch.randint(0, 20000 if batch < 1024 else 1500, (batch,), generator=g).tolist()
    run_and_check(lengths, 12, 2, 32, seed=batch)


@pytest.mark.parametrize("heads,page", [(12, 32), (16, 64)])
def test_many_short_requests_per_cta(heads, page):
    """200 requests of 0-3000 tokens on 132 CTAs at q_len 1: the ping-pong schedule's CTAs walk several
    segments each (Q, pipeline fill, merge and output per segment)."""
    g = torch.Generator().manual_seed(heads + page)
    lengths = torch.randint(0, 3000, (200,), generator=g).tolist()
    plan = plan_splits(torch.tensor(lengths, dtype=torch.int32), q_len=1, num_heads=heads, page_size=page,
                       num_ctas=132, max_batch=256)
    assert torch.bincount(plan.segments()[:, 0]).max() >= 3  # what this test is for
    run_and_check(lengths, heads, 1, page, seed=heads + page)


@pytest.mark.parametrize("heads,q_len,page,lengths", [(32, 1, 32, EDGE + [131072]), (12, 8, 32, EDGE + [5000]),
                                                      (16, 2, 64, EDGE + [5000]), (128, 1, 32, [1, 33, 3000]),
                                                      (16, 8, 64, [M, 33])])
def test_both_p_precisions(heads, q_len, page, lengths):
    """p_precision "fp8" (one e4m3 plane above 16 rows per block) and "fp8x2" (two planes): each within its
    bounds, and two planes the more accurate where one plane is used."""
    one = run_and_check(lengths, heads, q_len, page, seed=heads + q_len, p_precision="fp8")
    two = run_and_check(lengths, heads, q_len, page, seed=heads + q_len, p_precision="fp8x2")
    assert planes_of(heads, q_len, "fp8") == 1 and two < one


def test_bf16_q_is_quantized_on_the_device():
    q, kv, bt, sl, qs, ks = make_decode_inputs([100, 2000], q_len=1, num_heads=12, page_size=32, device="cuda",
                                               q_dtype=torch.bfloat16)
    kwargs = dict(softmax_scale=0.05, q_scale=qs, k_scale=ks)
    out, lse = mla_decode(q, kv, bt, sl, **kwargs)
    ref_out, ref_lse = mla_decode_reference(q, kv, bt, sl, **kwargs)
    check_against_reference(out, lse, ref_out, ref_lse)


def use_environment(monkeypatch, **variables):
    """Run the op as a process started with these switches would (the environment is read once per process)."""
    from mla_backend import api, config
    from mla_backend.hopper import planner

    monkeypatch.setattr(config, "_environment", config.read_environment(variables))
    for cache in (api._decode_config, api._combine_config, planner._planner_config):
        cache.cache_clear()


# ------------------------------------------------------------------------------------------ CUDA graphs
def graph_batches(max_batch, page, gen):
    yield "uniform", [8000] * max_batch
    yield "skewed", [300000] + torch.randint(1, 3000, (max_batch - 1,), generator=gen).tolist()
    yield "all zero", [0] * max_batch
    yield "one request fills the GPU", [400000] + [0] * (max_batch - 1)
    yield "ragged", torch.randint(0, 15000, (max_batch,), generator=gen).tolist()


@pytest.mark.parametrize("heads,q_len,page", [(12, 1, 32), (16, 4, 64)])
def test_cuda_graph_replays_new_lengths(heads, q_len, page):
    """Capture once at the largest batch, replay with new seq_lens and block tables, check every replay."""
    max_batch = 32
    max_pages = 400000 // page + 1
    num_pages = max_batch * 8000 // page + 400000 // page + 64
    gen = torch.Generator().manual_seed(heads)
    kv = (torch.randn(num_pages, page, 576, device="cuda") * 2).to(torch.float8_e4m3fn)
    q = (torch.randn(max_batch, q_len, heads, 576, device="cuda") * 2).to(torch.float8_e4m3fn)
    block_table = torch.zeros(max_batch, max_pages, dtype=torch.int32, device="cuda")
    seq_lens = torch.zeros(max_batch, dtype=torch.int32, device="cuda")
    q_scale = torch.tensor([0.6], device="cuda")
    k_scale = torch.tensor([0.4], device="cuda")
    out = torch.empty(max_batch, q_len, heads, 512, dtype=torch.bfloat16, device="cuda")
    lse = torch.empty(max_batch, q_len, heads, device="cuda")
    plan = SplitPlan.empty(max_batch, torch.cuda.get_device_properties(0).multi_processor_count, device="cuda")
    ws = DecodeWorkspace.for_plan(plan, q_len, heads)
    kwargs = dict(softmax_scale=0.04, q_scale=q_scale, k_scale=k_scale)

    def step():
        plan_splits(seq_lens, q_len=q_len, num_heads=heads, page_size=page, out=plan)
        mla_decode(q, kv, block_table, seq_lens, out=out, lse=lse, plan=plan, workspace=ws, **kwargs)

    seq_lens.fill_(100)
    step()  # compile outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()

    for name, lengths in graph_batches(max_batch, page, gen):
        pages = [-(-n // page) for n in lengths]
        ids = torch.randperm(num_pages, generator=gen)
        table = torch.zeros(max_batch, max_pages, dtype=torch.int32)
        used = 0
        for b, n in enumerate(pages):
            table[b, :n] = ids[used:used + n].int()
            used += n
        assert used <= num_pages
        block_table.copy_(table)
        seq_lens.copy_(torch.tensor(lengths, dtype=torch.int32))
        q.copy_((torch.randn(q.shape, generator=gen) * 2).to(torch.float8_e4m3fn))
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
        graph.replay()
        ref_out, ref_lse = mla_decode_reference(q, kv, block_table, seq_lens, **kwargs)
        check_against_reference(out, lse, ref_out, ref_lse, **TOLERANCES[planes_of(heads, q_len)])
        # Determinism: the same inputs give bit-identical outputs across replays.
        first_out, first_lse = out.clone(), lse.clone()
        graph.replay()
        assert torch.equal(out, first_out) and torch.equal(lse.nan_to_num(), first_lse.nan_to_num()), \
            f"{name}: {replay_difference(first_out, out, first_lse, lse, lengths)}"


def replay_difference(out_a, out_b, lse_a, lse_b, lengths) -> str:
    """Where two replays' outputs differ: how many values, the requests (and their lengths), query positions and
    heads, the largest difference and the NaNs of each."""
    diff = (out_a != out_b) & ~(torch.isnan(out_a) & torch.isnan(out_b))
    where = diff.nonzero()
    reqs = sorted(set(where[:, 0].tolist()))
    big = (out_a.float() - out_b.float()).abs()[diff].nan_to_num(float("inf"))
    return (f"{int(diff.sum())} output values differ (max {float(big.max()) if big.numel() else 0.0:.3g}), "
            f"requests {reqs[:8]} of lengths {[lengths[b] for b in reqs[:8]]}, positions "
            f"{sorted(set(where[:, 1].tolist()))}, heads {sorted(set(where[:, 2].tolist()))[:16]}; NaN in out "
            f"{int(torch.isnan(out_a).sum())} / {int(torch.isnan(out_b).sum())}; lse values differing "
            f"{int((lse_a.nan_to_num() != lse_b.nan_to_num()).sum())}")


@pytest.mark.parametrize("heads,q_len", [(16, 4), (128, 1), (12, 8), (16, 2)])
def test_launches_on_kv_held_in_l2_are_bit_identical(heads, q_len):
    """200 launches of one step on a batch whose KV fits in L2 give the same bits. With the KV in L2 a ring stage's
    TMA refill lands within a few hundred cycles of S_FREE, so a refill not ordered after the softmax warpgroups'
    ldmatrix reads of that stage overwrites V^T they have not read yet (H200, without the proxy fence in
    `decode_swg_tma._refill`: 208 of 400 launches at H16 q4 differed from the first, in dims 64-127)."""
    gen = torch.Generator().manual_seed(heads * 100 + q_len)
    lengths = torch.randint(1, 3000, (32,), generator=gen).tolist()
    q, kv, bt, sl, qs, ks = make_decode_inputs(lengths, q_len=q_len, num_heads=heads, page_size=64, device="cuda",
                                               seed=heads)
    plan = SplitPlan.empty(len(lengths), torch.cuda.get_device_properties(0).multi_processor_count, device="cuda")
    ws = DecodeWorkspace.for_plan(plan, q_len, heads)
    out = torch.empty(len(lengths), q_len, heads, 512, dtype=torch.bfloat16, device="cuda")
    lse = torch.empty(len(lengths), q_len, heads, device="cuda")

    def step():
        plan_splits(sl, q_len=q_len, num_heads=heads, page_size=64, out=plan)
        mla_decode(q, kv, bt, sl, out=out, lse=lse, plan=plan, workspace=ws, softmax_scale=576 ** -0.5, q_scale=qs,
                   k_scale=ks)

    step()
    ref_out, ref_lse = mla_decode_reference(q, kv, bt, sl, softmax_scale=576 ** -0.5, q_scale=qs, k_scale=ks)
    check_against_reference(out, lse, ref_out, ref_lse, **TOLERANCES[planes_of(heads, q_len)])
    first_out, first_lse = out.clone(), lse.clone()
    differ = 0
    for _ in range(200):
        step()
        differ += int(not (torch.equal(out, first_out) and torch.equal(lse, first_lse)))
    assert differ == 0, f"{differ} of 200 launches differ from the first"


def test_planner_runs_inside_capture_without_host_sync():
    seq_lens = torch.tensor([5, 70000, 0, 3], dtype=torch.int32, device="cuda")
    plan = SplitPlan.empty(8, 132, device="cuda")
    plan_splits(seq_lens, q_len=1, num_heads=12, page_size=32, out=plan)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    torch.cuda.set_sync_debug_mode("error")  # any host sync inside raises
    try:
        with torch.cuda.graph(graph):
            plan_splits(seq_lens, q_len=1, num_heads=12, page_size=32, out=plan)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    seq_lens.copy_(torch.tensor([1 << 20, 1, 2, 3], dtype=torch.int32))
    graph.replay()
    fresh = plan_splits(seq_lens.cpu(), q_len=1, num_heads=12, page_size=32, num_ctas=132, max_batch=8)
    for a, b in zip(plan.tensors(), fresh.tensors()):
        assert torch.equal(a.cpu(), b)


@pytest.mark.skipif(shutil.which("compute-sanitizer") is None, reason="compute-sanitizer is not installed")
def test_kernels_under_compute_sanitizer_memcheck():
    script = os.path.join(os.path.dirname(__file__), "sanitize_decode.py")
    env = dict(os.environ, PYTORCH_NO_CUDA_MEMORY_CACHING="1")  # exact allocation bounds for memcheck
    # --report-api-errors no: host API errors are not what this checks (on the H200 image of 2026-12-01 every
    # run reports 34 failed cuGetProcAddress_v2 lookups, before and after our kernels; no memory error)
    result = subprocess.run(["compute-sanitizer", "--tool", "memcheck", "--report-api-errors", "no", "--error-exitcode",
                             "3", sys.executable, script],
                            capture_output=True, text=True, timeout=900, env=env)
    tail = (result.stdout + result.stderr)[-4000:]
    assert result.returncode == 0, tail
    assert "ERROR SUMMARY: 0 errors" in result.stdout + result.stderr, tail
    assert "sanitize: checked" in result.stdout, tail


def bad_metadata(page):
    """A batch whose block table and lengths the eager checks would reject: page ids outside the pool inside
    the lengths, a length past the table's width, a negative length."""
    q, kv, bt, sl, qs, ks = make_decode_inputs([3000, 700, 90, 5, 0], q_len=2, num_heads=16, page_size=page,
                                               device="cuda", seed=21)
    width = -(-1000 // page)  # room for 1000 tokens: request 0 runs past it
    bad_bt = bt[:, :width].clone()
    bad_bt[1, 3] = -1
    bad_bt[1, 5] = kv.shape[0] + 12
    bad_sl = torch.tensor([3000, 700, -40, 5, 0], dtype=torch.int32, device="cuda")
    return q, kv, bad_bt, bad_sl, qs, ks


@pytest.mark.parametrize("page", [32, 64])
def test_unchecked_bad_metadata_reads_zeros_eager_and_in_graph(page):
    """check_values=False (the engines' call): no error, no out-of-bounds read (the sanitizer test covers
    that), and the result the reference defines: tokens without a valid page read as zeros."""
    q, kv, bt, sl, qs, ks = bad_metadata(page)
    kwargs = dict(softmax_scale=576 ** -0.5, q_scale=qs, k_scale=ks)
    with pytest.raises(ValueError, match="seq_lens|block_table"):
        mla_decode(q, kv, bt, sl, **kwargs)
    ref_out, ref_lse = mla_decode_reference(q, kv, bt, sl, **kwargs)
    out, lse = mla_decode(q, kv, bt, sl, check_values=False, **kwargs)
    tolerances = TOLERANCES[planes_of(16, 2)]
    check_against_reference(out, lse, ref_out, ref_lse, **tolerances)

    plan = plan_splits(sl, q_len=2, num_heads=16, page_size=page)
    ws = DecodeWorkspace.for_plan(plan, 2, 16)
    g_out, g_lse = torch.empty_like(out), torch.empty_like(lse)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        plan_splits(sl, q_len=2, num_heads=16, page_size=page, out=plan)
        mla_decode(q, kv, bt, sl, out=g_out, lse=g_lse, plan=plan, workspace=ws, **kwargs)
    graph.replay()
    torch.cuda.synchronize()
    check_against_reference(g_out, g_lse, ref_out, ref_lse, **tolerances)


def test_own_plan_is_reused_across_eager_calls_and_refilled():
    """Without a plan the op plans into a cached one per batch bucket: the same buffers, refilled each call."""
    from mla_backend import api
    from mla_backend.plan import default_num_ctas

    results = []
    for seed, lengths in enumerate([[5000, 3, 0, 70000, 64], [1, 9000, 33]]):  # both in the bucket of 8
        q, kv, bt, sl, qs, ks = make_decode_inputs(lengths, q_len=1, num_heads=12, page_size=32, device="cuda",
                                                   seed=40 + seed)
        kwargs = dict(softmax_scale=576 ** -0.5, q_scale=qs, k_scale=ks)
        out, lse = mla_decode(q, kv, bt, sl, **kwargs)
        check_against_reference(out, lse, *mla_decode_reference(q, kv, bt, sl, **kwargs))
        results.append(api._default_plans[(sl.device, 8, default_num_ctas(sl.device, 12, 1))])
    assert results[0] is results[1]


def test_pages_beyond_two_gib_of_pool():
    """A real KV pool is tens of GB: page offsets past 2^31 bytes must not wrap (64-bit addressing)."""
    page = 32
    num_pages = (5 << 30) // (page * 576)  # a 5 GiB pool
    kv = torch.empty(num_pages, page, 576, dtype=torch.float8_e4m3fn, device="cuda")
    lengths = [3000, 77]
    pages = [-(-n // page) for n in lengths]
    ids = torch.arange(num_pages - sum(pages), num_pages, dtype=torch.int32)  # the last pages of the pool
    block_table = torch.zeros(2, max(pages), dtype=torch.int32)
    block_table[0, :pages[0]] = ids[:pages[0]]
    block_table[1, :pages[1]] = ids[pages[0]:]
    block_table = block_table.cuda()
    kv[ids.long().cuda()] = (torch.randn(len(ids), page, 576, device="cuda") * 2).to(torch.float8_e4m3fn)
    seq_lens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    q = (torch.randn(2, 1, 12, 576, device="cuda") * 2).to(torch.float8_e4m3fn)
    kwargs = dict(softmax_scale=0.05, q_scale=torch.tensor([0.5], device="cuda"),
                  k_scale=torch.tensor([0.5], device="cuda"))
    out, lse = mla_decode(q, kv, block_table, seq_lens, **kwargs)
    ref_out, ref_lse = mla_decode_reference(q, kv, block_table, seq_lens, **kwargs)
    check_against_reference(out, lse, ref_out, ref_lse)


@pytest.mark.parametrize("heads,q_len", [(12, 1), (12, 8)])
def test_pdl_on_and_off_give_the_same_step_in_a_graph(monkeypatch, heads, q_len):
    """Programmatic dependent launch (the default) changes when the planner, decode and combine kernels start,
    not what they compute: a captured step gives bit-identical outputs with CUTE_MLA_PDL=1 and 0, and matches
    the reference (a skewed batch, so the combine merges splits and single-split requests skip it)."""
    page = 32
    lengths = [200000, 3000, 0, 77, 4096]
    q, kv, bt, sl, qs, ks = make_decode_inputs(lengths, q_len=q_len, num_heads=heads, page_size=page,
                                               device="cuda", seed=3)
    kwargs = dict(softmax_scale=576 ** -0.5, q_scale=qs, k_scale=ks)
    results = {}
    for value in ("1", "0"):
        use_environment(monkeypatch, CUTE_MLA_PDL=value)
        plan = SplitPlan.empty(len(lengths), torch.cuda.get_device_properties(0).multi_processor_count,
                               device="cuda")
        ws = DecodeWorkspace.for_plan(plan, q_len, heads)
        out = torch.full((len(lengths), q_len, heads, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
        lse = torch.full((len(lengths), q_len, heads), float("nan"), device="cuda")

        def step():
            plan_splits(sl, q_len=q_len, num_heads=heads, page_size=page, out=plan)
            mla_decode(q, kv, bt, sl, out=out, lse=lse, plan=plan, workspace=ws, **kwargs)

        step()  # compile outside capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        results[value] = (out.clone(), lse.clone())
    ref_out, ref_lse = mla_decode_reference(q, kv, bt, sl, causal=True, **kwargs)
    check_against_reference(*results["1"], ref_out, ref_lse, **TOLERANCES[planes_of(heads, q_len)])
    assert torch.equal(results["1"][0], results["0"][0])
    assert torch.equal(results["1"][1].nan_to_num(), results["0"][1].nan_to_num())


@pytest.fixture(autouse=True)
def _fresh_configurations():
    """Tests that change the switches leave no configuration resolved under them behind."""
    yield
    from mla_backend import api, config
    from mla_backend.hopper import planner

    config._environment = None
    for cache in (api._decode_config, api._combine_config, planner._planner_config):
        cache.cache_clear()


_CACHE_RUN = """
import sys, torch
sys.path.insert(0, {tests!r})
from mla_inputs import make_decode_inputs
from mla_backend import jit_cache, mla_decode
from mla_backend.config import decode_config
q, kv, bt, sl, qs, ks = make_decode_inputs([70000, 3000, 5], q_len=2, num_heads=16, page_size=64, device="cuda", seed=9)
out, lse = mla_decode(q, kv, bt, sl, softmax_scale=0.05, q_scale=qs, k_scale=ks)
torch.save((out.cpu(), lse.cpu()), {path!r})
print(jit_cache.origin(decode_config(16, 2, 64))[0])
"""


def test_kernels_loaded_from_the_kernel_cache_compute_what_compiled_ones_do(tmp_path):
    """A process that loads the decode, planner and combine from CUTE_MLA_KERNEL_CACHE (written by an earlier
    process) gives bit-identical outputs."""
    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, CUTE_MLA_KERNEL_CACHE=str(tmp_path / "kernels"))
    runs = []
    for i in range(2):
        path = str(tmp_path / f"out{i}.pt")
        result = subprocess.run([sys.executable, "-c", _CACHE_RUN.format(tests=tests, path=path)], env=env,
                                capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, result.stderr[-3000:]
        runs.append((result.stdout.split()[-1], torch.load(path)))
    assert [how for how, _ in runs] == ["compiled", "loaded"]
    assert torch.equal(runs[0][1][0], runs[1][1][0]) and torch.equal(runs[0][1][1], runs[1][1][1])


@pytest.mark.parametrize("heads,q_len,num_ctas", [(12, 1, 132), (16, 2, 132), (12, 8, 66), (128, 1, 66)])
def test_nan_in_q_or_kv_gives_nan_rows_not_empty_rows(heads, q_len, num_ctas):
    """NaN input shows as NaN output, never as an empty row (out = 0): a NaN in one query row's q poisons that
    row; a NaN in a KV token poisons every row that sees it. Requests 0 and 1 are split over many CTAs (the
    combine merges them), request 2 is not; the rows that read no NaN stay finite."""
    lengths = [200000, 150000, 300]
    q, kv, bt, sl, qs, ks = make_decode_inputs(lengths, q_len=q_len, num_heads=heads, page_size=32, device="cuda",
                                               seed=77)
    q, kv = q.float(), kv.float()
    q[0, 0, 3, 17] = float("nan")  # request 0, query position 0, head 3
    q[2, q_len - 1, 1, 5] = float("nan")  # the unsplit request, its last query position, head 1
    kv[int(bt[1, 100]), 7, 3] = float("nan")  # token 3207 of request 1: every row of it sees that token
    q, kv = q.to(torch.float8_e4m3fn), kv.to(torch.float8_e4m3fn)
    plan = plan_splits(sl, q_len=q_len, num_heads=heads, page_size=32, num_ctas=num_ctas)
    assert plan.num_splits[0].item() > 1 and plan.num_splits[1].item() > 1 and plan.num_splits[2].item() == 1
    out, lse = mla_decode(q, kv, bt, sl, softmax_scale=576 ** -0.5, q_scale=qs, k_scale=ks, plan=plan,
                          workspace=DecodeWorkspace.for_plan(plan, q_len, heads))
    nan_rows = torch.zeros(len(lengths), q_len, heads, dtype=torch.bool, device="cuda")
    nan_rows[0, 0, 3] = True
    nan_rows[2, q_len - 1, 1] = True
    nan_rows[1] = True
    assert torch.equal(torch.isnan(lse), nan_rows)
    assert torch.isnan(out.float()).all(-1).eq(nan_rows).all()
    assert torch.isfinite(out.float()[~nan_rows]).all()
