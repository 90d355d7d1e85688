"""The public op: `mla_decode`, a thin wrapper over the `mla_backend::decode_paged` custom op.

The wrapper validates (once, here: the kernels' launchers trust it), plans the splits on the device unless given a
plan, and calls the custom op, which mutates `out` and `lse` (and the workspace's partials). On CUDA the op runs
our kernels: the split-KV decode, then the LSE combine. On CPU it runs the plain-torch reference: a documented
slow correctness path (the direct reference without a plan, the split reference with one).
"""

from __future__ import annotations

import functools
from typing import List, Optional, Tuple

import torch

from . import reference
from .config import environment, check_p_precision, combine_config, decode_config
from .plan import SplitPlan, batch_bucket, cuda_major, default_num_ctas, device_sms, plan_splits
from .shapes import LATENT_DIM, check_decode_args, quantize_q

Tensor = torch.Tensor


class DecodeWorkspace:
    """Partial outputs of split requests, sized once for (plan slots, q_len, heads) and reused.

    Allocate it before CUDA-graph capture (an engine does so at start-up) so replays never allocate. One
    workspace can serve several query shapes of no more rows (`view`), e.g. every q_len of an MTP engine.
    """

    def __init__(self, num_slots: int, q_len: int, num_heads: int, device):
        # fp16 in units of k_scale (mla_backend.hopper.combine): half the bytes the combine reads
        self.partial_out = torch.empty(num_slots, q_len, num_heads, LATENT_DIM, dtype=torch.float16, device=device)
        self.partial_lse = torch.empty(num_slots, q_len, num_heads, dtype=torch.float32, device=device)

    @classmethod
    def for_plan(cls, plan: SplitPlan, q_len: int, num_heads: int) -> "DecodeWorkspace":
        return cls(plan.num_slots, q_len, num_heads, plan.device)

    @property
    def nbytes(self) -> int:
        return self.partial_out.nbytes + self.partial_lse.nbytes

    def view(self, q_len: int, num_heads: int) -> "DecodeWorkspace":
        """This workspace's memory as the workspace of q_len x num_heads rows (no more rows than it holds): the
        slots of the same plan, shared with every other view."""
        slots, ql, heads = self.partial_lse.shape
        if q_len * num_heads > ql * heads:
            raise ValueError(f"a workspace of {ql} x {heads} rows cannot hold {q_len} x {num_heads}")
        ws = DecodeWorkspace.__new__(DecodeWorkspace)
        rows = slots * q_len * num_heads
        ws.partial_out = self.partial_out.view(-1)[:rows * LATENT_DIM].view(slots, q_len, num_heads, LATENT_DIM)
        ws.partial_lse = self.partial_lse.view(-1)[:rows].view(slots, q_len, num_heads)
        return ws

    def fits(self, plan: SplitPlan, q_len: int, num_heads: int) -> bool:
        slots, ql, heads = self.partial_lse.shape
        return (slots >= plan.num_slots and ql == q_len and heads == num_heads
                and self.partial_lse.device == plan.device)


# Per-device workspaces for callers that pass none; grown (eagerly) only when a larger one is needed.
_default_workspaces = {}


def _workspace_for(plan: SplitPlan, q_len: int, num_heads: int) -> DecodeWorkspace:
    key = (plan.device, q_len, num_heads)
    ws = _default_workspaces.get(key)
    if ws is None or not ws.fits(plan, q_len, num_heads):
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("mla_decode needs a workspace allocated before CUDA-graph capture: pass "
                               "workspace=DecodeWorkspace.for_plan(plan, q_len, num_heads), or run one eager "
                               "step of the same shape first")
        ws = DecodeWorkspace.for_plan(plan, q_len, num_heads)
        _default_workspaces[key] = ws
    return ws


# The op's own plans (callers that pass none), one per device and batch bucket, refilled by the planner on every
# call. A fresh plan per call cost six allocations and six fill kernels. Like the default workspaces, they assume
# the calls that share them are ordered on one stream; inside a CUDA-graph capture a fresh plan is made instead,
# so a graph never shares buffers with eager calls.
_default_plans = {}


def _own_plan(seq_lens: Tensor, q_len: int, num_heads: int, page_size: int, batch: int) -> SplitPlan:
    max_batch = batch_bucket(batch)
    if torch.cuda.is_current_stream_capturing():
        return plan_splits(seq_lens, q_len=q_len, num_heads=num_heads, page_size=page_size, max_batch=max_batch)
    num_ctas = default_num_ctas(seq_lens.device, num_heads, q_len)
    key = (seq_lens.device, max_batch, num_ctas)
    plan = _default_plans.get(key)
    if plan is None:
        plan = SplitPlan.empty(max_batch, num_ctas, device=seq_lens.device)
        _default_plans[key] = plan
    return plan_splits(seq_lens, q_len=q_len, num_heads=num_heads, page_size=page_size, out=plan)


# The op is defined through torch.library.Library (schema + CPU/CUDA kernels + fake) rather than the
# torch.library.custom_op decorator: the decorator's Python autograd and ADInplaceOrView layers cost ~50 us of
# host time per eager call on the H200 host (21 us against 3 us for an empty op on our CI machine), paid per
# layer per step wherever attention runs outside a CUDA graph.
_lib = torch.library.Library("mla_backend", "DEF")
_lib.define("decode_paged(Tensor q, Tensor kv_cache, Tensor block_table, Tensor seq_lens, Tensor q_scale, "
            "Tensor k_scale, Tensor[] plan_tensors, Tensor(a!) out, Tensor(b!) lse, Tensor(c!) partial_out, "
            "Tensor(d!) partial_lse, float softmax_scale, bool causal, int tile_tokens, int segment_overhead, "
            "str p_precision) -> ()")


def decode_paged(q: Tensor, kv_cache: Tensor, block_table: Tensor, seq_lens: Tensor, q_scale: Tensor,
                 k_scale: Tensor, plan_tensors: List[Tensor], out: Tensor, lse: Tensor, partial_out: Tensor,
                 partial_lse: Tensor, softmax_scale: float, causal: bool, tile_tokens: int,
                 segment_overhead: int, p_precision: str) -> None:
    """FP8 MLA decode into `out`/`lse` (the CPU and CUDA kernel of mla_backend::decode_paged). q is FP8
    [B, q_len, H, 576]; kv_cache [pages, page_size, 576]. The CPU reference computes in fp32 whatever
    p_precision says."""
    plan = SplitPlan(*plan_tensors, tile_tokens, segment_overhead) if plan_tensors else None
    if q.is_cuda:
        _decode_cuda(q, kv_cache, block_table, seq_lens, q_scale, k_scale, plan, out, lse, partial_out,
                     partial_lse, softmax_scale, causal, p_precision)
        return
    kwargs = dict(softmax_scale=softmax_scale, q_scale=q_scale, k_scale=k_scale, causal=causal, out=out, lse=lse)
    if plan is None:
        reference.mla_decode_reference(q, kv_cache, block_table, seq_lens, **kwargs)
    else:
        reference.mla_decode_split_reference(q, kv_cache, block_table, seq_lens, plan=plan, **kwargs)


_lib.impl("decode_paged", decode_paged, "CPU")
_lib.impl("decode_paged", decode_paged, "CUDA")


@torch.library.register_fake("mla_backend::decode_paged", lib=_lib)
def _decode_paged_fake(q, kv_cache, block_table, seq_lens, q_scale, k_scale, plan_tensors, out, lse,
                       partial_out, partial_lse, softmax_scale, causal, tile_tokens, segment_overhead,
                       p_precision) -> None:
    return None


# Configurations by shape, resolved once: an eager call pays a dict lookup, not the resolution.
_decode_config = functools.lru_cache(maxsize=None)(decode_config)
_combine_config = functools.lru_cache(maxsize=None)(combine_config)


def _decode_cuda(q, kv_cache, block_table, seq_lens, q_scale, k_scale, plan, out, lse, partial_out,
                 partial_lse, softmax_scale, causal, p_precision):
    major = cuda_major(q.device)
    if major != 9:
        raise RuntimeError(f"mla_decode has kernels for compute capability 9.x (Hopper) only; "
                           f"{torch.cuda.get_device_name(q.device)} is {major}.x")
    from .hopper.combine import run_combine
    from .hopper.decode import run_decode

    batch, q_len, heads, _ = q.shape
    stream = torch.cuda.current_stream(q.device)
    cfg = _decode_config(heads, q_len, kv_cache.shape[1], tile_tokens=plan.tile_tokens, causal=causal,
                         p_precision=p_precision)
    run_decode(cfg, q, kv_cache, block_table, seq_lens, softmax_scale, q_scale, k_scale, plan, out, lse,
               partial_out, partial_lse, stream)
    if batch:
        combine = _combine_config(batch, q_len * heads, device_sms(q.device), plan.num_ctas)
        run_combine(combine, plan, partial_out, partial_lse, out, lse, k_scale, stream)


def mla_decode(q: Tensor, kv_cache: Tensor, block_table: Tensor, seq_lens: Tensor, *, softmax_scale: float,
               q_scale: Tensor, k_scale: Tensor, causal: bool = True, out: Optional[Tensor] = None,
               lse: Optional[Tensor] = None, plan: Optional[SplitPlan] = None,
               workspace: Optional[DecodeWorkspace] = None, check_values: bool = True,
               p_precision: Optional[str] = None) -> Tuple[Tensor, Tensor]:
    """Paged FP8 MLA decode: returns (out bf16 [B, q_len, H, 512], lse float32 [B, q_len, H]).

    logits = softmax_scale * q_scale * k_scale * (q . k); out = k_scale * softmax(logits) @ kv[..., :512];
    lse is the natural-log log-sum-exp of the logits. With causal and q_len > 1, query row t of a request of
    length L sees KV positions [0, L - q_len + t]. A row with no KV gets out = 0 and lse = -inf; NaN in the
    inputs a row reads gives that row NaN.

    `p_precision` says how the softmax probabilities enter the FP8 P.V MMA (`config.P_PRECISIONS`): "fp8" (one
    e4m3 plane where that is faster, FlashMLA's accuracy) or "fp8x2" (two planes, the bf16 output's own
    rounding). None takes the default (README; `CUTE_MLA_P_PRECISION` overrides it). The CPU reference is fp32
    either way.

    `check_values` (eager calls only) copies seq_lens, the block table and the scales to the host and rejects
    negative or over-long lengths, lengths past the block table, page ids outside the cache and non-finite or
    non-positive scales, with an error naming the argument: a device sync and a copy per call, which engines that
    trust their own metadata skip (the adapters pass False). Unchecked bad values never make the kernels read out
    of bounds: a token whose page is past the table's width is read through its last column, a page id outside
    the cache reads as zeros, and a negative length counts as 0.
    """
    p_precision = environment().p_precision if p_precision is None else check_p_precision(p_precision)
    in_graph = torch.compiler.is_compiling() or (q.is_cuda and torch.cuda.is_current_stream_capturing())
    kv = check_decode_args(q, kv_cache, block_table, seq_lens, softmax_scale, q_scale, k_scale, out, lse,
                           read_values=check_values and not in_graph)
    batch, q_len, heads, _ = q.shape
    if out is None:
        out = torch.empty(batch, q_len, heads, LATENT_DIM, dtype=torch.bfloat16, device=q.device)
    if lse is None:
        lse = torch.empty(batch, q_len, heads, dtype=torch.float32, device=q.device)
    q8 = quantize_q(q, q_scale)
    if q.is_cuda and plan is None:
        plan = _own_plan(seq_lens, q_len, heads, kv.shape[1], batch)
    if plan is not None:
        if not isinstance(plan, SplitPlan):
            raise TypeError(f"plan must be a mla_backend.SplitPlan, got {type(plan).__name__}")
        if plan.max_batch < batch or plan.device != q.device:
            raise ValueError(f"plan holds {plan.max_batch} requests on {plan.device}; "
                             f"the batch has {batch} on {q.device}")
        if workspace is None:
            workspace = _workspace_for(plan, q_len, heads) if q.is_cuda else None
        elif not workspace.fits(plan, q_len, heads):
            raise ValueError("workspace does not fit the plan: make it with DecodeWorkspace.for_plan(plan, q_len, heads)")
    plan_tensors = list(plan.tensors()) if plan is not None else []
    tile_tokens = plan.tile_tokens if plan is not None else 0
    overhead = plan.segment_overhead if plan is not None else 0
    if workspace is None:
        partial_out = torch.empty(0, dtype=torch.float16, device=q.device)
        partial_lse = torch.empty(0, dtype=torch.float32, device=q.device)
    else:
        partial_out, partial_lse = workspace.partial_out, workspace.partial_lse
    torch.ops.mla_backend.decode_paged(q8, kv, block_table, seq_lens, q_scale, k_scale, plan_tensors, out, lse,
                                       partial_out, partial_lse, float(softmax_scale), bool(causal), tile_tokens,
                                       overhead, p_precision)
    return out, lse
