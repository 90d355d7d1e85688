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
FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max

# What is supported (README's table): the op, the CLI, the adapters and the kernels' tests use these limits.
SUPPORTED_PAGE_SIZES = (32, 64)
MIN_HEADS, MAX_HEADS = 8, 128  # query heads per rank: TP16 of DeepSeek's 128 heads .. all 128 (DP attention)
MAX_Q_LEN = 8  # decode plus MTP verify; a longer q block is a prefill and goes elsewhere
MAX_BATCH = 1024  # requests per call (vLLM's default max_num_seqs on an H200 is 1024)
MAX_KV_LEN = 1 << 20  # KV tokens per request


def check_shape(*, num_heads=None, q_len=None, page_size=None, batch=None, names=None) -> None:
    """Reject a shape outside the supported table with a ValueError naming the argument (`names` maps num_heads,
    q_len, page_size and batch to the caller's spelling, e.g. "--heads" or "q.shape[2]")."""
    names = {"num_heads": "num_heads", "q_len": "q_len", "page_size": "page_size", "batch": "batch",
             **(names or {})}
    limits = (("num_heads", num_heads, MIN_HEADS, MAX_HEADS), ("q_len", q_len, 1, MAX_Q_LEN),
              ("batch", batch, 1, MAX_BATCH))
    for key, value, low, high in limits:
        if value is not None and not (isinstance(value, int) and low <= value <= high):
            raise ValueError(f"{names[key]} must be in {low}..{high}, got {value}")
    if page_size is not None and page_size not in SUPPORTED_PAGE_SIZES:
        raise ValueError(f"{names['page_size']} must be one of {', '.join(map(str, SUPPORTED_PAGE_SIZES))}, "
                         f"got {page_size}")


def check_kv_lengths(lengths, name: str = "seq_lens") -> None:
    """Reject KV lengths outside 0..MAX_KV_LEN (a list of ints or a CPU tensor) with an error naming `name`."""
    values = torch.as_tensor(lengths, dtype=torch.int64)
    if values.numel() and int(values.min()) < 0:
        raise ValueError(f"{name} must be >= 0, got {int(values.min())}")
    if values.numel() and int(values.max()) > MAX_KV_LEN:
        raise ValueError(f"{name} must be at most {MAX_KV_LEN} tokens per request, got {int(values.max())}")


def default_rows_per_block(num_heads: int, q_len: int) -> int:
    """Query rows (q_len x H) per CTA of the SM90 decode kernel: 16 when they fit (the ping-pong schedule), one
    block of 32, 48 or 64 rows when one holds them (the smallest that does), otherwise blocks of 64 rows (the
    chunk-pairs schedule). Each row block reads the request's KV span once more, so more than 64 rows take the
    fewest blocks; 64 gives that count wherever 48 does, and ran faster there than 48-row blocks of the
    S^T-warpgroup schedule (65-96 rows, 10 of 11 shapes; experiments.md); within one block the smaller one is
    faster."""
    rows = num_heads * q_len
    if rows <= 16:
        return 16
    return next((size for size in (32, 48) if rows <= size), 64)


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


def _check_output(name: str, tensor, dtype, shape, device) -> None:
    """out / lse: one message per thing that is wrong, so the caller sees which."""
    if not isinstance(tensor, torch.Tensor):
        _fail(TypeError, f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype != dtype:
        _fail(TypeError, f"{name} must be {str(dtype).replace('torch.', '')}, got {tensor.dtype}")
    if tuple(tensor.shape) != shape:
        _fail(ValueError, f"{name} must have shape {shape}, got {tuple(tensor.shape)}")
    if tensor.device != device:
        _fail(ValueError, f"{name} is on {tensor.device} but q is on {device}")
    if not tensor.is_contiguous():
        _fail(ValueError, f"{name} must be contiguous, got strides {tensor.stride()} (use .contiguous() or a fresh "
                          f"tensor)")


# the op's spelling of the shape limits (check_shape)
_OP_NAMES = {"num_heads": "q.shape[2] (heads)", "q_len": "q.shape[1] (q_len)", "batch": "q.shape[0] (batch)",
             "page_size": "kv_cache page size (shape[1])"}


def check_decode_args(q, kv_cache, block_table, seq_lens, softmax_scale, q_scale, k_scale, out=None,
                      lse=None, read_values: bool = True) -> Tensor:
    """Validate the op's arguments; returns the canonical 3-D kv_cache view.

    `read_values` also checks the values of seq_lens, the block table and the scales, which reads device memory:
    callers skip it while a CUDA graph is being captured.
    """
    if not isinstance(q, torch.Tensor):
        _fail(TypeError, f"q must be a torch.Tensor, got {type(q).__name__}")
    if q.dtype not in (FP8, torch.bfloat16):
        _fail(TypeError, f"q must be float8_e4m3fn (or bfloat16, quantized with q_scale), got {q.dtype}")
    if q.dim() != 4 or q.shape[-1] != KV_DIM:
        _fail(ValueError, f"q must have shape [batch, q_len, heads, {KV_DIM}], got {tuple(q.shape)}")
    batch, q_len, heads, _ = q.shape
    check_shape(num_heads=heads, q_len=q_len, names=_OP_NAMES)
    if batch > MAX_BATCH:
        check_shape(batch=batch, names=_OP_NAMES)
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
    check_shape(page_size=kv.shape[1], names=_OP_NAMES)
    if kv.stride(-1) != 1 or kv.stride(-2) != KV_DIM or kv.stride(0) % 16:
        _fail(ValueError, "kv_cache must be contiguous within a page (token stride 576, element stride 1) with a "
                          f"page stride that is a multiple of 16 bytes, got strides {kv.stride()}")
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
        _check_output("out", out, torch.bfloat16, (batch, q_len, heads, LATENT_DIM), device)
    if lse is not None:
        _check_output("lse", lse, torch.float32, (batch, q_len, heads), device)

    if read_values:
        for name, scale in (("q_scale", q_scale), ("k_scale", k_scale)):
            value = float(scale.reshape(()).to("cpu"))
            if not (math.isfinite(value) and value > 0):
                _fail(ValueError, f"{name} must be finite and positive, got {value}")
    if read_values and batch > 0:
        lengths = seq_lens.to("cpu", torch.int64)
        check_kv_lengths(lengths)
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
