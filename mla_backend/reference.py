"""Plain-torch FP8 MLA decode: the oracle every kernel and adapter is tested against.

Everything here is fp32 math on the dequantized FP8 values, one request at a time. It runs on CPU or GPU
and is slow on purpose: it is written to be obviously right, not fast.

`mla_decode_reference` computes the op's contract directly. `mla_decode_split_reference` computes the same
thing the way the kernels do (one partial output and LSE per plan segment, then the LSE merge), so the plan
and the merge arithmetic can be checked without a GPU.
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch

from .shapes import KV_DIM, LATENT_DIM, quantize_q, canonical_kv_cache

Tensor = torch.Tensor


def gather_request_kv(kv_cache: Tensor, block_table: Tensor, request: int, end: int, first: int = 0) -> Tensor:
    """KV rows [first, end) of one request, in token order, as fp32 [end - first, 576].

    A token whose page lies past the block table's width is read through the table's last column, and a token
    whose block-table entry is not a page of the cache reads as zeros: the kernels never read outside the cache
    or the table, even for such input inside a CUDA graph, where the op cannot check values (eager calls reject
    it by default)."""
    num_pages, page_size = kv_cache.shape[0], kv_cache.shape[1]
    width = block_table.shape[1]
    if width < 1:
        raise ValueError("block_table must have at least one column")
    tokens = torch.arange(first, max(first, end), device=kv_cache.device)
    entries = block_table[request].long()[(tokens // page_size).clamp(max=width - 1)]
    valid = (entries >= 0) & (entries < num_pages)
    rows = kv_cache[entries.clamp(0, max(num_pages - 1, 0)), tokens % page_size].float()
    return torch.where(valid[:, None], rows, torch.zeros_like(rows))


def visible_tokens(length: int, q_len: int, causal: bool, device) -> Tensor:
    """How many KV positions each query row t sees: L - q_len + t + 1 when causal, L otherwise (>= 0)."""
    t = torch.arange(q_len, device=device)
    if causal:
        return (length - q_len + t + 1).clamp(min=0, max=length)
    return torch.full((q_len,), length, device=device, dtype=torch.long)


def attend(q_rows: Tensor, kv: Tensor, first_token: int, visible: Tensor, logit_scale: float,
           v_scale: float) -> Tuple[Tensor, Tensor]:
    """Softmax attention of q_rows [q_len, H, 576] over kv [n, 576] holding tokens first_token.. .

    Token first_token + j is visible to query row t when first_token + j < visible[t]. Returns the
    normalized output [q_len, H, 512] (times v_scale) and the natural-log LSE [q_len, H]; a row that
    sees nothing gets output 0 and LSE -inf, and a row that reads a NaN (in q or a visible token) gets NaN.
    """
    logits = torch.einsum("thd,nd->thn", q_rows, kv) * logit_scale
    positions = first_token + torch.arange(kv.shape[0], device=kv.device)
    mask = positions[None, :] < visible[:, None]  # [q_len, n]
    logits = logits.masked_fill(~mask[:, None, :], float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)  # -inf where the row sees nothing, NaN where it reads a NaN
    probs = torch.exp(logits - lse[..., None].clamp(min=torch.finfo(torch.float32).min))
    probs = torch.where(torch.isneginf(lse)[..., None], torch.zeros_like(probs), probs)  # no KV: out = 0
    out = torch.einsum("thn,nd->thd", probs, kv[:, :LATENT_DIM]) * v_scale
    return out, lse


def merge_partials(partial_out: Tensor, partial_lse: Tensor) -> Tuple[Tensor, Tensor]:
    """LSE merge of S partials: partial_out [S, ..., 512] normalized, partial_lse [S, ...] natural log."""
    lse = torch.logsumexp(partial_lse, dim=0)
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    weights = torch.exp(partial_lse - safe[None])  # 0 for partials with lse -inf
    weights = torch.where(torch.isinf(lse)[None], torch.zeros_like(weights), weights)
    out = (weights[..., None] * partial_out).sum(dim=0)
    return out, lse


def merge_decode_outputs(plan, out: Tensor, lse: Tensor, partial_out: Tensor, partial_lse: Tensor,
                         k_scale: Tensor) -> Tuple[Tensor, Tensor]:
    """The final (fp32) out and lse of one decode kernel launch: its direct writes for requests of one split, the
    LSE merge of its partials (fp16, in units of k_scale) for the others, as the combine kernel computes it."""
    out = out.float().clone()
    lse = lse.clone()
    num_splits = plan.num_splits.cpu().tolist()
    offsets = plan.split_offset.cpu().tolist()
    for b in range(out.shape[0]):
        n = num_splits[b]
        if n > 1:
            o, l = merge_partials(partial_out[offsets[b]:offsets[b] + n].float() * k_scale,
                                  partial_lse[offsets[b]:offsets[b] + n])
            out[b] = o
            lse[b] = l
    return out, lse


def relative_l2_error(out: Tensor, ref: Tensor) -> float:
    """||out - ref|| / ||ref|| in fp32."""
    ref = ref.float()
    return ((out.float() - ref).norm() / ref.norm()).item()


def lse_max_error(lse: Tensor, ref: Tensor) -> float:
    """The largest |lse - ref| over the rows with KV (finite ref); inf where a row's lse is not finite while the
    reference's is, or finite while the reference's is -inf (a row without KV)."""
    finite = torch.isfinite(ref)
    if not torch.equal(torch.isfinite(lse), finite):
        return math.inf
    if not bool(finite.any()):
        return 0.0
    return (lse[finite].float() - ref[finite].float()).abs().max().item()


def _prepare(q, kv_cache, q_scale, k_scale, softmax_scale):
    kv = canonical_kv_cache(kv_cache)
    qf = quantize_q(q, q_scale).float()
    qs = float(q_scale.reshape(-1)[0])
    ks = float(k_scale.reshape(-1)[0])
    return qf, kv, softmax_scale * qs * ks, ks


def _outputs(q, out, lse):
    batch, q_len, heads = q.shape[:3]
    if out is None:
        out = torch.empty(batch, q_len, heads, LATENT_DIM, dtype=torch.bfloat16, device=q.device)
    if lse is None:
        lse = torch.empty(batch, q_len, heads, dtype=torch.float32, device=q.device)
    return out, lse


def mla_decode_reference(q: Tensor, kv_cache: Tensor, block_table: Tensor, seq_lens: Tensor, *,
                         softmax_scale: float, q_scale: Tensor, k_scale: Tensor, causal: bool = True,
                         out: Optional[Tensor] = None, lse: Optional[Tensor] = None,
                         plan=None) -> Tuple[Tensor, Tensor]:
    """The op's contract, computed directly in fp32 (`plan` is accepted and ignored)."""
    qf, kv, logit_scale, v_scale = _prepare(q, kv_cache, q_scale, k_scale, softmax_scale)
    out, lse = _outputs(q, out, lse)
    q_len = q.shape[1]
    for b, length in enumerate(seq_lens.tolist()):
        keys = gather_request_kv(kv, block_table, b, length)
        o, l = attend(qf[b], keys, 0, visible_tokens(length, q_len, causal, q.device), logit_scale, v_scale)
        out[b] = o.to(out.dtype)
        lse[b] = l
    return out, lse


def mla_decode_split_reference(q: Tensor, kv_cache: Tensor, block_table: Tensor, seq_lens: Tensor, *,
                               softmax_scale: float, q_scale: Tensor, k_scale: Tensor, plan,
                               causal: bool = True, out: Optional[Tensor] = None,
                               lse: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """The op computed as the kernels compute it: a partial per plan segment, then the LSE merge.

    Requests with one split take their segment's result directly, as the decode kernel writes it.
    """
    qf, kv, logit_scale, v_scale = _prepare(q, kv_cache, q_scale, k_scale, softmax_scale)
    out, lse = _outputs(q, out, lse)
    batch, q_len, heads = q.shape[:3]
    tile = plan.tile_tokens
    lengths = seq_lens.tolist()
    partials = [[] for _ in range(batch)]
    for _cta, b, first_tile, end_tile in plan.segments().tolist():
        length = lengths[b]
        first, end = first_tile * tile, min(end_tile * tile, length)
        keys = gather_request_kv(kv, block_table, b, end, first)
        partials[b].append(attend(qf[b], keys, first, visible_tokens(length, q_len, causal, q.device),
                                  logit_scale, v_scale))
    for b in range(batch):
        if not partials[b]:  # no KV at all
            out[b] = 0
            lse[b] = -math.inf
            continue
        o, l = merge_partials(torch.stack([p[0] for p in partials[b]]), torch.stack([p[1] for p in partials[b]]))
        out[b] = o.to(out.dtype)
        lse[b] = l
    return out, lse
