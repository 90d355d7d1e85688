"""Bad input to the op gets a one-line error that names the argument and what is allowed (mla_backend.shapes)."""

import os

import pytest
import torch

from mla_backend import mla_decode
from mla_inputs import make_decode_inputs


def args(**override):
    q, kv, bt, sl, qs, ks = make_decode_inputs([40, 70], q_len=2, num_heads=8, page_size=32)
    base = dict(q=q, kv_cache=kv, block_table=bt, seq_lens=sl, softmax_scale=0.1, q_scale=qs, k_scale=ks)
    base.update(override)
    return base


def call(a):
    return mla_decode(a.pop("q"), a.pop("kv_cache"), a.pop("block_table"), a.pop("seq_lens"), **a)


def test_good_input_runs():
    out, lse = call(args())
    assert out.shape == (2, 2, 8, 512) and lse.shape == (2, 2, 8)


BAD = [
    ("q dtype", lambda a: dict(q=a["q"].float()), TypeError, "q must be float8_e4m3fn"),
    ("q shape", lambda a: dict(q=a["q"][..., :512]), ValueError, "q must have shape"),
    ("q_len", lambda a: dict(q=torch.zeros(2, 9, 8, 576).to(torch.float8_e4m3fn)), ValueError,
     r"q.shape\[1\] \(q_len\) must be in 1..8, got 9"),
    ("heads 7", lambda a: dict(q=torch.zeros(2, 2, 7, 576).to(torch.float8_e4m3fn)), ValueError,
     r"q.shape\[2\] \(heads\) must be in 8..128, got 7"),
    ("heads 129", lambda a: dict(q=torch.zeros(2, 1, 129, 576).to(torch.float8_e4m3fn)), ValueError,
     r"q.shape\[2\] \(heads\) must be in 8..128, got 129"),
    ("batch 1025", lambda a: dict(q=torch.zeros(1025, 1, 8, 576).to(torch.float8_e4m3fn),
                                  block_table=torch.zeros(1025, 1, dtype=torch.int32),
                                  seq_lens=torch.zeros(1025, dtype=torch.int32)), ValueError,
     r"q.shape\[0\] \(batch\) must be in 1..1024, got 1025"),
    ("q last dim", lambda a: dict(q=torch.zeros(2, 2, 576, 8).to(torch.float8_e4m3fn).transpose(2, 3)), ValueError,
     "q must be contiguous"),
    ("kv dtype", lambda a: dict(kv_cache=a["kv_cache"].to(torch.bfloat16)), TypeError, "kv_cache must be float8"),
    ("kv shape", lambda a: dict(kv_cache=a["kv_cache"][..., :512]), ValueError, "kv_cache must have shape"),
    ("page size", lambda a: dict(kv_cache=a["kv_cache"].reshape(-1, 16, 576)), ValueError, "page size"),
    ("kv strides", lambda a: dict(kv_cache=torch.zeros(4, 32, 600).to(torch.float8_e4m3fn)[..., :576]), ValueError,
     "contiguous within a page"),
    ("table dtype", lambda a: dict(block_table=a["block_table"].long()), TypeError, "block_table must be an int32"),
    ("table rows", lambda a: dict(block_table=a["block_table"][:1]), ValueError, "block_table must have shape"),
    ("table width 0", lambda a: dict(block_table=a["block_table"][:, :0]), ValueError, "max_pages >= 1"),
    ("table short", lambda a: dict(block_table=a["block_table"][:, :2]), ValueError, "block_table is too short"),
    ("page ids", lambda a: dict(block_table=a["block_table"] + 1000), ValueError, "page ids outside"),
    ("lens dtype", lambda a: dict(seq_lens=a["seq_lens"].long()), TypeError, "seq_lens must be an int32"),
    ("lens shape", lambda a: dict(seq_lens=a["seq_lens"][:1]), ValueError, "seq_lens must have shape"),
    ("lens negative", lambda a: dict(seq_lens=torch.tensor([-1, 3], dtype=torch.int32)), ValueError, "seq_lens must be >= 0"),
    ("softmax scale", lambda a: dict(softmax_scale=torch.tensor(0.1)), TypeError, "softmax_scale must be a Python float"),
    ("softmax value", lambda a: dict(softmax_scale=float("nan")), ValueError, "softmax_scale must be finite"),
    ("q_scale float", lambda a: dict(q_scale=0.5), TypeError, "q_scale must be a float32 tensor"),
    ("q_scale dtype", lambda a: dict(q_scale=a["q_scale"].double()), TypeError, "q_scale must be float32"),
    ("k_scale shape", lambda a: dict(k_scale=torch.ones(2)), ValueError, "k_scale must have exactly one element"),
    ("out dtype", lambda a: dict(out=torch.empty(2, 2, 8, 512)), TypeError, "out must be bfloat16, got torch.float32"),
    ("out strides", lambda a: dict(out=torch.empty(2, 8, 2, 512, dtype=torch.bfloat16).transpose(1, 2)), ValueError,
     r"out must be contiguous, got strides \(8192, 512, 1024, 1\)"),
    ("out shape", lambda a: dict(out=torch.empty(2, 2, 8, 576, dtype=torch.bfloat16)), ValueError,
     r"out must have shape \(2, 2, 8, 512\), got \(2, 2, 8, 576\)"),
    ("lse shape", lambda a: dict(lse=torch.empty(2, 2)), ValueError, r"lse must have shape \(2, 2, 8\)"),
    ("lens too long", lambda a: dict(seq_lens=torch.tensor([40, (1 << 20) + 1], dtype=torch.int32)), ValueError,
     "seq_lens must be at most 1048576 tokens per request"),
    ("k_scale nan", lambda a: dict(k_scale=torch.tensor([float("nan")])), ValueError,
     "k_scale must be finite and positive, got nan"),
    ("q_scale zero", lambda a: dict(q_scale=torch.tensor([0.0])), ValueError, "q_scale must be finite and positive"),
    ("q_scale inf", lambda a: dict(q_scale=torch.tensor([float("inf")])), ValueError,
     "q_scale must be finite and positive, got inf"),
    ("plan type", lambda a: dict(plan="a plan"), TypeError, "plan must be a mla_backend.SplitPlan"),
    ("device", lambda a: dict(block_table=a["block_table"].to("meta")), ValueError, "block_table is on meta"),
]


@pytest.mark.parametrize("name,make,kind,words", BAD)
def test_bad_input_names_the_argument(name, make, kind, words):
    a = args()
    a.update(make(a))
    with pytest.raises(kind, match=words):
        call(a)


@pytest.mark.parametrize("name,override", [
    ("table short", lambda a: dict(block_table=a["block_table"][:, :1].contiguous())),
    ("page ids", lambda a: dict(block_table=a["block_table"] + 1000)),
    ("lens negative", lambda a: dict(seq_lens=torch.tensor([-1, 3], dtype=torch.int32))),
])
def test_check_values_false_skips_value_checks_with_defined_results(name, override):
    """Engines pass check_values=False (no device sync per layer); the values the checks would reject then
    give the result the reference defines (tokens without a valid page read as zeros, a negative length is 0),
    not an error."""
    from mla_backend import mla_decode_reference

    a = args()
    a.update(override(a))
    out, lse = call(dict(a, check_values=False))
    ref_out, ref_lse = mla_decode_reference(a["q"], a["kv_cache"], a["block_table"], a["seq_lens"],
                                            softmax_scale=a["softmax_scale"], q_scale=a["q_scale"],
                                            k_scale=a["k_scale"])
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)
    assert torch.isfinite(lse).any()


def test_every_error_is_one_line():
    """Each rejection is one line that starts with the argument's name."""
    for name, make, kind, words in BAD:
        a = args()
        a.update(make(a))
        with pytest.raises(kind) as info:
            call(a)
        assert "\n" not in str(info.value), name


def test_shape_limits_are_those_of_readme():
    from mla_backend.shapes import MAX_BATCH, MAX_HEADS, MAX_KV_LEN, MAX_Q_LEN, MIN_HEADS, SUPPORTED_PAGE_SIZES

    readme = open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")).read()
    assert f"| heads per rank | {MIN_HEADS} to {MAX_HEADS}" in readme
    assert f"| q_len | 1 (decode) and 2-{MAX_Q_LEN}" in readme
    assert f"| page size | {SUPPORTED_PAGE_SIZES[0]} and {SUPPORTED_PAGE_SIZES[1]} tokens" in readme
    assert f"| KV length | 0 to {MAX_KV_LEN // (1 << 20)}M ({MAX_KV_LEN}) tokens per request" in readme
    assert f"| batch | 1 to {MAX_BATCH} requests" in readme
