"""The public op (mla_backend.api) on CPU: the custom op plumbing, its fake implementation, torch.compile
tracing, the workspace, p_precision and non-finite inputs."""

import pytest
import torch

from mla_backend import DecodeWorkspace, SplitPlan, mla_decode, mla_decode_reference, plan_splits
from mla_inputs import make_decode_inputs


def test_op_cpu_path_is_the_reference():
    q, kv, bt, sl, qs, ks = make_decode_inputs([0, 1, 100, 700], q_len=4, num_heads=12, page_size=64)
    out, lse = mla_decode(q, kv, bt, sl, softmax_scale=0.05, q_scale=qs, k_scale=ks)
    ref_out, ref_lse = mla_decode_reference(q, kv, bt, sl, softmax_scale=0.05, q_scale=qs, k_scale=ks)
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)


def test_op_with_plan_writes_into_given_buffers():
    q, kv, bt, sl, qs, ks = make_decode_inputs([3000, 5, 0], q_len=2, num_heads=16, page_size=32)
    plan = plan_splits(sl, q_len=2, num_heads=16, page_size=32, num_ctas=9, max_batch=8)
    ws = DecodeWorkspace.for_plan(plan, 2, 16)
    out = torch.full((3, 2, 16, 512), float("nan"), dtype=torch.bfloat16)
    lse = torch.full((3, 2, 16), float("nan"))
    got_out, got_lse = mla_decode(q, kv, bt, sl, softmax_scale=0.05, q_scale=qs, k_scale=ks, plan=plan,
                                  workspace=ws, out=out, lse=lse)
    assert got_out is out and got_lse is lse
    ref_out, ref_lse = mla_decode_reference(q, kv, bt, sl, softmax_scale=0.05, q_scale=qs, k_scale=ks)
    torch.testing.assert_close(out.float(), ref_out.float(), atol=1e-2, rtol=1e-2)
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse)) and not torch.isnan(lse).any()


def test_custom_op_passes_opcheck():
    q, kv, bt, sl, qs, ks = make_decode_inputs([70, 9], q_len=1, num_heads=8, page_size=32)
    out = torch.empty(2, 1, 8, 512, dtype=torch.bfloat16)
    lse = torch.empty(2, 1, 8)
    empty = torch.empty(0)
    torch.library.opcheck(torch.ops.mla_backend.decode_paged.default,
                          (q, kv, bt, sl, qs, ks, [], out, lse, empty, empty.clone(), 0.1, True, 0, 0, "fp8"),
                          test_utils=("test_faketensor", "test_aot_dispatch_dynamic"))


def test_torch_compile_traces_the_op():
    q, kv, bt, sl, qs, ks = make_decode_inputs([40, 90], q_len=2, num_heads=8, page_size=32)

    def step(q, kv, bt, sl):
        out, lse = mla_decode(q, kv, bt, sl, softmax_scale=0.1, q_scale=qs, k_scale=ks)
        return out.float().sum(-1), lse

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    got = compiled(q, kv, bt, sl)
    want = step(q, kv, bt, sl)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_p_precision_is_checked_and_the_cpu_reference_ignores_it():
    q, kv, bt, sl, qs, ks = make_decode_inputs([40, 300], q_len=2, num_heads=8, page_size=32)
    a = mla_decode(q, kv, bt, sl, softmax_scale=0.1, q_scale=qs, k_scale=ks, p_precision="fp8")
    b = mla_decode(q, kv, bt, sl, softmax_scale=0.1, q_scale=qs, k_scale=ks, p_precision="fp8x2")
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    with pytest.raises(ValueError, match="p_precision must be one of 'fp8', 'fp8x2', got 'bf16'"):
        mla_decode(q, kv, bt, sl, softmax_scale=0.1, q_scale=qs, k_scale=ks, p_precision="bf16")


@pytest.mark.parametrize("where", ["q", "kv"])
def test_nan_input_gives_nan_rows_not_empty_rows(where):
    """A NaN the row reads shows as NaN in its output and lse (never out = 0, which reads as an empty row); the
    other requests are unaffected."""
    q, kv, bt, sl, qs, ks = make_decode_inputs([50, 70], q_len=1, num_heads=8, page_size=32)
    q, kv = q.float(), kv.float()
    if where == "q":
        q[0, 0, 3, 10] = float("nan")
    else:
        kv[int(bt[0, 1]), 5, 100] = float("nan")  # token 37 of request 0
    q, kv = q.to(torch.float8_e4m3fn), kv.to(torch.float8_e4m3fn)
    for plan in (None, plan_splits(sl, q_len=1, num_heads=8, page_size=32, num_ctas=4)):
        out, lse = mla_decode(q, kv, bt, sl, softmax_scale=0.1, q_scale=qs, k_scale=ks, plan=plan,
                              workspace=None if plan is None else DecodeWorkspace.for_plan(plan, 1, 8))
        bad_heads = [3] if where == "q" else list(range(8))
        assert torch.isnan(lse[0, 0, bad_heads]).all() and torch.isnan(out[0, 0, bad_heads]).all()
        assert torch.isfinite(out[1]).all() and torch.isfinite(lse[1]).all()


def test_workspace_views_share_one_buffer():
    plan = SplitPlan.empty(max_batch=16, num_ctas=8)
    ws = DecodeWorkspace.for_plan(plan, 4, 16)
    one = ws.view(1, 16)
    two = ws.view(2, 16)
    assert one.fits(plan, 1, 16) and two.fits(plan, 2, 16) and not one.fits(plan, 2, 16)
    assert one.partial_out.data_ptr() == ws.partial_out.data_ptr() == two.partial_out.data_ptr()
    assert one.partial_lse.shape == (plan.num_slots, 1, 16) and two.partial_out.shape == (plan.num_slots, 2, 16, 512)
    with pytest.raises(ValueError, match="cannot hold"):
        ws.view(8, 16)
