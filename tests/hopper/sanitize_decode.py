"""Small decode shapes for compute-sanitizer memcheck (run by test_mla_decode_gpu.py): the op's kernels, then the
chunk-pairs schedule (research) launched directly.

The KV pool is allocated with exactly the pages the batch uses and the block table's unused slots hold huge
page ids, so a read past any request's pages or past the pool is reported. The last two cases (the chunk-pairs
schedule with its L2 prefetch, the op) pass values the eager checks would reject (check_values=False, as engines
call it): page ids outside the pool inside the lengths, a length past the block table's width (the table
allocated exactly), a negative length.
"""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from mla_backend import mla_decode  # noqa: E402
from mla_backend.config import decode_config  # noqa: E402
from mla_backend.hopper.decode import run_decode  # noqa: E402
from mla_backend.plan import plan_splits  # noqa: E402
from mla_inputs import make_decode_inputs  # noqa: E402

# 16-row ping-pong, 64-row blocks (H16 q4: one, H128 q2: four, H12 q8: two, half of the second padding), a 48-row
# block (H12 q4)
for heads, q_len, page, lengths in [(12, 1, 32, [0, 1, 31, 33, 700]), (16, 4, 64, [1, 2, 65, 3000]),
                                    (128, 2, 32, [5, 129]), (12, 8, 32, [8, 9, 700]), (12, 4, 32, [4, 5, 700])]:
    q, kv, bt, sl, qs, ks = make_decode_inputs(lengths, q_len=q_len, num_heads=heads, page_size=page, device="cuda",
                                               extra_pages=0)
    out, lse = mla_decode(q, kv, bt, sl, softmax_scale=0.05, q_scale=qs, k_scale=ks)
    torch.cuda.synchronize()
    print(f"sanitize: checked H{heads} q{q_len} page {page} {lengths}")



def run_chunk_pairs(heads, q_len, page, options, q, kv, bt, sl, qs, ks):
    """The chunk-pairs schedule (research, `DecodeConfig.chunk_pairs`) launched directly into exactly allocated
    outputs, on 5 CTAs, so that CTAs run several segments and requests split."""
    cfg = decode_config(heads, q_len, page, chunk_pairs=True, **options)
    plan = plan_splits(sl, q_len=q_len, num_heads=heads, page_size=page, num_ctas=5)
    batch = sl.shape[0]
    out = torch.empty((batch, q_len, heads, 512), dtype=torch.bfloat16, device="cuda")
    lse = torch.empty((batch, q_len, heads), dtype=torch.float32, device="cuda")
    partial_out = torch.empty((plan.num_slots, q_len, heads, 512), dtype=torch.float16, device="cuda")
    partial_lse = torch.empty((plan.num_slots, q_len, heads), dtype=torch.float32, device="cuda")
    run_decode(cfg, q, kv, bt, sl, 0.05, qs, ks, plan, out, lse, partial_out, partial_lse,
               torch.cuda.current_stream())
    torch.cuda.synchronize()


# 64 rows, 48 rows padded to S's 64; S a pair ahead, P.V a pair behind, the chunks prefetched into L2, the rope
# in 64-byte rows with 5 stages
for heads, q_len, page, lengths, options in [(128, 1, 64, [5, 129, 700], {}),
                                             (12, 8, 32, [8, 9, 700], {"rows_per_block": 48, "s_ahead": True}),
                                             (16, 4, 64, [1, 65, 3000], {"s_ahead": True}),
                                             (16, 4, 64, [1, 65, 3000], {"pv_behind": 3, "kv_prefetch": 4}),
                                             (12, 8, 32, [8, 9, 700], {"rows_per_block": 48, "pv_behind": 2,
                                                                         "kv_prefetch": 2}),
                                             (128, 1, 64, [5, 129, 700], {"pv_behind": 3, "s_under_rescale": True}),
                                             (16, 4, 64, [1, 65, 3000], {"pv_behind": 3, "rope_rows": 64,
                                                                         "p_after_pv": True, "num_stages": 5}),
                                             (12, 8, 64, [8, 9, 700], {"rows_per_block": 48, "rope_rows": 64})]:
    run_chunk_pairs(heads, q_len, page, options,
                    *make_decode_inputs(lengths, q_len=q_len, num_heads=heads, page_size=page, device="cuda",
                                        extra_pages=0))
    print(f"sanitize: checked chunk pairs H{heads} q{q_len} page {page} {lengths} {options}")

# the L2 prefetch reads block-table entries chunks ahead of their loads: with values the eager checks would reject
# (page ids outside the pool inside the lengths, a length past the table's width) it touches no byte outside the
# pool either
q, kv, bt, sl, qs, ks = make_decode_inputs([300, 700, 90, 5], q_len=4, num_heads=16, page_size=64, device="cuda",
                                           extra_pages=0)
bad_bt = bt[:, :6].clone()  # room for 384 tokens per request, allocated exactly
bad_bt[1, 2] = -7
bad_bt[1, 4] = kv.shape[0] + 12
bad_sl = torch.tensor([300, 700, -3, 5], dtype=torch.int32, device="cuda")
run_chunk_pairs(16, 4, 64, {"kv_prefetch": 8}, q, kv, bad_bt, bad_sl, qs, ks)
print("sanitize: checked chunk pairs with the L2 prefetch on unchecked bad values")

q, kv, bt, sl, qs, ks = make_decode_inputs([100, 64, 40, 5], q_len=1, num_heads=12, page_size=32, device="cuda",
                                           extra_pages=0)
bad_bt = bt[:, :2].clone()  # 2 pages = 64 tokens of room per request, allocated exactly
bad_bt[0, 1] = -7
bad_bt[1, 0] = kv.shape[0]
bad_sl = torch.tensor([100, 64, -3, 5], dtype=torch.int32, device="cuda")  # 100 > 64 tokens of room
out, lse = mla_decode(q, kv, bad_bt, bad_sl, softmax_scale=0.05, q_scale=qs, k_scale=ks, check_values=False)
torch.cuda.synchronize()
print("sanitize: checked unchecked bad values")
