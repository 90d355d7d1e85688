"""MLA decode shapes, dtypes and the argument checks of the public op.

One place defines what a valid call looks like, so the op, the reference and the engine adapters all
reject bad input with the same words: the argument's name and what was expected.
"""

from __future__ import annotations

import math

import torch

LATENT_DIM = 512  # kv_lora_rank: the latent is both K (with the rope part) and V
ROPE_DIM = 64
KV_DIM = LATENT_DIM + ROPE_DIM  # 576 FP8 bytes per token
SUPPORTED_PAGE_SIZES = (32, 64)
MAX_Q_LEN = 8  # decode plus MTP verify; a longer q block is a prefill and goes elsewhere
FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max


def default_rows_per_block(num_heads: int, q_len: int) -> int:
    """Query rows (q_len x H) per CTA of the SM90 decode kernel: 16 when they fit (the ping-pong schedule),
    otherwise the fewest row blocks of 32, 48 or 64 rows, the smallest block on a tie. Each row block reads
    the request's KV span once more (fewer padded rows and more free registers decide the tie)."""
    rows = num_heads * q_len
    if rows <= 16:
        return 16
    return min((32, 48, 64), key=lambda size: (-(-rows // size), size))


def decode_row_blocks(num_heads: int, q_len: int) -> int:
    """CTAs the decode kernel runs per plan CTA: ceil(q_len x H / rows per block)."""
    rows = num_heads * q_len
    return -(-rows // default_rows_per_block(num_heads, q_len))

Tensor = torch.Tensor


def canonical_kv_cache(kv_cache: Tensor) -> Tensor:
    """[num_pages, page_size, 576], accepting vLLM's [num_pages, page_size, 1, 576] view (no copy)."""
    if kv_cache.dim() == 4 and kv_cache.shape[2] == 1:
        return kv_cache.squeeze(2)
    return kv_cache


def quantize_q(q: Tensor, q_scale: Tensor) -> Tensor:
    """q as FP8: bf16 q is divided by q_scale and saturated to the E4M3 range (what vLLM's quant op does)."""
    if q.dtype == FP8:
        return q
    scaled = q.float() / q_scale.reshape(()).float()
    return scaled.clamp(-FP8_MAX, FP8_MAX).to(FP8)


def _fail(kind, message):
    raise kind(message)


def _check_scale(name: str, scale, device) -> None:
    if not isinstance(scale, torch.Tensor):
        _fail(TypeError, f"{name} must be a float32 tensor with one element on the device, got {type(scale).__name__}")
    if scale.dtype != torch.float32:
        _fail(TypeError, f"{name} must be float32, got {scale.dtype}")
    if scale.numel() != 1:
        _fail(ValueError, f"{name} must have exactly one element, got shape {tuple(scale.shape)}")
    if scale.device != device:
        _fail(ValueError, f"{name} is on {scale.device} but q is on {device}")


def check_decode_args(q, kv_cache, block_table, seq_lens, softmax_scale, q_scale, k_scale, out=None,
                      lse=None, read_values: bool = True) -> Tensor:
    """Validate the op's arguments; returns the canonical 3-D kv_cache view.

    `read_values` also checks seq_lens against the block table, which reads device memory: callers skip it
    while a CUDA graph is being captured.
    """
    if not isinstance(q, torch.Tensor):
        _fail(TypeError, f"q must be a torch.Tensor, got {type(q).__name__}")
    if q.dtype not in (FP8, torch.bfloat16):
        _fail(TypeError, f"q must be float8_e4m3fn (or bfloat16, quantized with q_scale), got {q.dtype}")
    if q.dim() != 4 or q.shape[-1] != KV_DIM:
        _fail(ValueError, f"q must have shape [batch, q_len, heads, {KV_DIM}], got {tuple(q.shape)}")
    batch, q_len, heads, _ = q.shape
    if not 1 <= q_len <= MAX_Q_LEN:
        _fail(ValueError, f"q_len (q.shape[1]) must be in 1..{MAX_Q_LEN}, got {q_len}")
    if heads < 1:
        _fail(ValueError, f"q must have at least one head, got shape {tuple(q.shape)}")
    if q.stride(-1) != 1:
        _fail(ValueError, "q must be contiguous in its last dimension")
    device = q.device

    if not isinstance(kv_cache, torch.Tensor):
        _fail(TypeError, f"kv_cache must be a torch.Tensor, got {type(kv_cache).__name__}")
    if kv_cache.dtype != FP8:
        _fail(TypeError, f"kv_cache must be float8_e4m3fn, got {kv_cache.dtype}")
    kv = canonical_kv_cache(kv_cache)
    if kv.dim() != 3 or kv.shape[-1] != KV_DIM:
        _fail(ValueError, f"kv_cache must have shape [num_pages, page_size, {KV_DIM}] "
                          f"(or [num_pages, page_size, 1, {KV_DIM}]), got {tuple(kv_cache.shape)}")
    if kv.shape[1] not in SUPPORTED_PAGE_SIZES:
        _fail(ValueError, f"kv_cache page size (shape[1]) must be one of {SUPPORTED_PAGE_SIZES}, got {kv.shape[1]}")
    if kv.stride(-1) != 1 or kv.stride(-2) != KV_DIM:
        _fail(ValueError, "kv_cache must be contiguous within a page (token stride 576, element stride 1)")
    if kv.device != device:
        _fail(ValueError, f"kv_cache is on {kv.device} but q is on {device}")

    if not isinstance(block_table, torch.Tensor) or block_table.dtype != torch.int32:
        _fail(TypeError, f"block_table must be an int32 tensor, got {getattr(block_table, 'dtype', type(block_table))}")
    if block_table.dim() != 2 or block_table.shape[0] != batch or block_table.shape[1] < 1:
        _fail(ValueError, f"block_table must have shape [batch={batch}, max_pages >= 1], got {tuple(block_table.shape)}")
    if block_table.stride(-1) != 1:
        _fail(ValueError, "block_table must be contiguous in its last dimension")
    if block_table.device != device:
        _fail(ValueError, f"block_table is on {block_table.device} but q is on {device}")

    if not isinstance(seq_lens, torch.Tensor) or seq_lens.dtype != torch.int32:
        _fail(TypeError, f"seq_lens must be an int32 tensor, got {getattr(seq_lens, 'dtype', type(seq_lens))}")
    if seq_lens.shape != (batch,):
        _fail(ValueError, f"seq_lens must have shape [batch={batch}], got {tuple(seq_lens.shape)}")
    if seq_lens.device != device:
        _fail(ValueError, f"seq_lens is on {seq_lens.device} but q is on {device}")

    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (float, int)):
        _fail(TypeError, f"softmax_scale must be a Python float, got {type(softmax_scale).__name__}")
    if not math.isfinite(softmax_scale) or softmax_scale <= 0:
        _fail(ValueError, f"softmax_scale must be finite and positive, got {softmax_scale}")
    _check_scale("q_scale", q_scale, device)
    _check_scale("k_scale", k_scale, device)

    if out is not None:
        want = (batch, q_len, heads, LATENT_DIM)
        if out.dtype != torch.bfloat16 or tuple(out.shape) != want or not out.is_contiguous() or out.device != device:
            _fail(ValueError, f"out must be a contiguous bfloat16 tensor of shape {want} on {device}, "
                              f"got {out.dtype} {tuple(out.shape)} on {out.device}")
    if lse is not None:
        want = (batch, q_len, heads)
        if lse.dtype != torch.float32 or tuple(lse.shape) != want or not lse.is_contiguous() or lse.device != device:
            _fail(ValueError, f"lse must be a contiguous float32 tensor of shape {want} on {device}, "
                              f"got {lse.dtype} {tuple(lse.shape)} on {lse.device}")

    if read_values and batch > 0:
        lengths = seq_lens.to("cpu", torch.int64)
        if int(lengths.min()) < 0:
            _fail(ValueError, f"seq_lens must be >= 0, got min {int(lengths.min())}")
        capacity = block_table.shape[1] * kv.shape[1]
        if int(lengths.max()) > capacity:
            _fail(ValueError, f"block_table is too short for seq_lens: {block_table.shape[1]} pages of "
                              f"{kv.shape[1]} tokens hold {capacity}, but seq_lens has {int(lengths.max())}")
        pages_needed = (lengths + kv.shape[1] - 1) // kv.shape[1]
        used = torch.arange(block_table.shape[1])[None, :] < pages_needed[:, None]
        ids = block_table.to("cpu", torch.int64)[used]
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= kv.shape[0]):
            _fail(ValueError, f"block_table holds page ids outside [0, {kv.shape[0]}) within seq_lens")
    return kv
