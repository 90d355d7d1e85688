"""The public op on CPU: the custom op plumbing, its fake implementation, and torch.compile tracing."""

import torch

from mla_backend import DecodeWorkspace, mla_decode, mla_decode_reference, plan_splits
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
                          (q, kv, bt, sl, qs, ks, [], out, lse, empty, empty.clone(), 0.1, True, 0, 0),
                          test_utils=("test_faketensor", "test_aot_dispatch_dynamic"))


def test_torch_compile_traces_the_op():
    q, kv, bt, sl, qs, ks = make_decode_inputs([40, 90], q_len=2, num_heads=4, page_size=32)

    def step(q, kv, bt, sl):
        out, lse = mla_decode(q, kv, bt, sl, softmax_scale=0.1, q_scale=qs, k_scale=ks)
        return out.float().sum(-1), lse

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    got = compiled(q, kv, bt, sl)
    want = step(q, kv, bt, sl)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
