"""TensorRT-LLM's MLA generation tensors as `mla_decode` arguments, as views (no KV or page-table copies).

Pure torch: nothing here imports TensorRT-LLM, so the CPU tests run it on tensors laid out the way
TensorRT-LLM lays them out. The layouts, read at NVIDIA/TensorRT-LLM (commits in docs/trtllm.md):

- KV pool of one layer (`kv_cache_manager.get_buffers(layer_idx)`, also `FmhaParams.kv_pool`):
  [num_blocks, kv_factor=1, tokens_per_block, num_kv_heads=1, 576], one byte per element for an FP8 cache.
  KV cache manager V1 interleaves the layers of a pool along dim 0, so the per-layer view steps
  `layers_in_pool` blocks at a time (its stride(0) is layers_in_pool * page_elems); V2, and V1's
  layer-first layout, give a dense per-layer pool (stride(0) == page_elems).
- Page table: `kv_cache_block_offsets`, int32 [num_pools, max_num_sequences, 2, max_blocks_per_seq]; this
  layer's rows are [pool_idx, seq, 0, :] with pool_idx = host_kv_cache_pool_mapping[local_layer_idx, 0].
  A V1 entry is (block * layers_in_pool + 0) * kv_factor + 0, i.e. it counts pages of page_elems from the
  pool base where this layer's slot sits at offset 0 (BlockManager::setOffsets, flat_index3).
- Sequence lengths: `kv_lens_cuda` = cached tokens + this step's tokens, int32, which is our seq_lens.
- q: the FP8 query that `mla_rope_generation` wrote into `quant_q_buffer` (uint8 bytes of E4M3),
  [num_tokens, heads * 576] in request-major token order; output: bf16 [num_tokens, heads, 512].
- Scales, written on the device by `mla_rope_generation`: mla_bmm1_scale[0] = dequant_q * dequant_kv *
  softmax_scale (natural-log domain; [1] is the same times log2(e)); mla_bmm2_scale[0] = quant_o * dequant_kv.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from mla_backend.shapes import FP8, KV_DIM, LATENT_DIM, MAX_Q_LEN, SUPPORTED_PAGE_SIZES

Tensor = torch.Tensor


class LayoutRefused(ValueError):
    """TensorRT-LLM handed us a layout `mla_decode` cannot read without a copy; the message says which."""


def kv_pool_view(kv_pool: Tensor) -> Tensor:
    """This layer's pages as [num_pages, page_size, 576] FP8, indexed directly by TensorRT-LLM's block offsets.

    For a dense pool that is the pool itself. For V1's interleaved pool the offsets count pages across all
    layers of the pool (block * layers_in_pool), so the view keeps this layer's first page at row 0 and steps
    one page per row: row block * layers_in_pool is this layer's page of `block`, and the rows in between
    (other layers' pages) are never addressed. Same storage, no copy.
    """
    if kv_pool.dim() != 5 or kv_pool.shape[1] != 1 or kv_pool.shape[3] != 1:
        raise LayoutRefused(f"KV pool must be [num_blocks, 1, page_size, 1, {KV_DIM}] (MLA, one latent head), "
                            f"got {tuple(kv_pool.shape)}")
    if kv_pool.element_size() != 1:
        raise LayoutRefused(f"KV pool must hold one-byte FP8 elements, got {kv_pool.dtype}")
    num_blocks, _, page_size, _, head_dim = kv_pool.shape
    if head_dim != KV_DIM:
        raise LayoutRefused(f"KV pool head dim must be {KV_DIM} (kv_lora_rank 512 + rope 64), got {head_dim}")
    if page_size not in SUPPORTED_PAGE_SIZES:
        raise LayoutRefused(f"tokens_per_block must be one of {SUPPORTED_PAGE_SIZES}, got {page_size}")
    if kv_pool.stride(4) != 1 or kv_pool.stride(2) != KV_DIM:
        raise LayoutRefused(f"KV pool pages must be token-major with {KV_DIM} contiguous bytes per token, "
                            f"got strides {kv_pool.stride()}")
    page_elems = page_size * KV_DIM
    block_stride = kv_pool.stride(0)
    if num_blocks > 1 and (block_stride <= 0 or block_stride % page_elems):
        raise LayoutRefused(f"KV pool block stride {block_stride} is not a whole number of {page_elems}-byte pages")
    layers_in_pool = block_stride // page_elems if num_blocks > 1 else 1
    num_rows = (num_blocks - 1) * layers_in_pool + 1
    pages = kv_pool.view(FP8) if kv_pool.dtype != FP8 else kv_pool
    return pages.as_strided((num_rows, page_size, KV_DIM), (page_elems, KV_DIM, 1), pages.storage_offset())


def block_table_view(kv_cache_block_offsets: Tensor, pool_index: int, first_seq: int, num_seqs: int) -> Tensor:
    """This layer's page table for sequences [first_seq, first_seq + num_seqs): int32 [num_seqs, max_blocks].

    A view of the K row (index 0 of the K/V axis; MLA has no separate V). Rows are 2 * max_blocks apart,
    which `mla_decode` accepts: it only needs each row contiguous.
    """
    if kv_cache_block_offsets.dim() != 4 or kv_cache_block_offsets.shape[2] != 2:
        raise LayoutRefused("kv_cache_block_offsets must be [num_pools, max_num_sequences, 2, max_blocks], "
                            f"got {tuple(kv_cache_block_offsets.shape)}")
    if kv_cache_block_offsets.dtype != torch.int32:
        raise LayoutRefused(f"kv_cache_block_offsets must be int32, got {kv_cache_block_offsets.dtype}")
    if first_seq + num_seqs > kv_cache_block_offsets.shape[1]:
        raise LayoutRefused(f"sequences [{first_seq}, {first_seq + num_seqs}) exceed the page table's "
                            f"{kv_cache_block_offsets.shape[1]} rows")
    return kv_cache_block_offsets[pool_index, first_seq:first_seq + num_seqs, 0, :]


def query_view(quant_q_buffer: Tensor, num_seqs: int, q_len: int, num_heads: int) -> Tensor:
    """The FP8 query `mla_rope_generation` wrote, as [num_seqs, q_len, heads, 576] (tokens are request-major)."""
    numel = num_seqs * q_len * num_heads * KV_DIM
    if quant_q_buffer.element_size() != 1 or not quant_q_buffer.is_contiguous():
        raise LayoutRefused(f"quant_q_buffer must be contiguous one-byte FP8, got {quant_q_buffer.dtype}")
    if quant_q_buffer.numel() < numel:
        raise LayoutRefused(f"quant_q_buffer holds {quant_q_buffer.numel()} bytes, the query needs {numel}")
    q = quant_q_buffer.view(FP8) if quant_q_buffer.dtype != FP8 else quant_q_buffer
    return q.reshape(-1)[:numel].view(num_seqs, q_len, num_heads, KV_DIM)


def output_view(output: Tensor, num_seqs: int, q_len: int, num_heads: int) -> Tensor:
    """TensorRT-LLM's generation output [num_tokens, heads, 512] (or flat) as [num_seqs, q_len, heads, 512]."""
    if output.dtype != torch.bfloat16 or not output.is_contiguous():
        raise LayoutRefused(f"output must be contiguous bfloat16, got {output.dtype}")
    return output.view(num_seqs, q_len, num_heads, LATENT_DIM)


class ScaleBuffers:
    """Split TensorRT-LLM's folded FP8 scales into the op's q_scale / k_scale, on the device, without a sync.

    The op computes logits = softmax_scale * q_scale * k_scale * (q . k) and out = k_scale * P @ V.
    TensorRT-LLM folds softmax scale and both dequant factors into bmm1[0] and the V (and output) factor into
    bmm2[0]. So: k_scale = bmm2[0] (a view), softmax_scale = 1, q_scale = bmm1[0] / bmm2[0], written into a
    persistent one-element buffer so that CUDA-graph replays recompute it from the step's scales.
    """

    def __init__(self) -> None:
        self._q_scale: dict = {}

    def split(self, mla_bmm1_scale: Tensor, mla_bmm2_scale: Tensor) -> Tuple[float, Tensor, Tensor]:
        if mla_bmm1_scale.dtype != torch.float32 or mla_bmm2_scale.dtype != torch.float32:
            raise LayoutRefused(f"mla_bmm1_scale / mla_bmm2_scale must be float32, got "
                                f"{mla_bmm1_scale.dtype} / {mla_bmm2_scale.dtype}")
        logit_scale = mla_bmm1_scale.reshape(-1)[0:1]
        k_scale = mla_bmm2_scale.reshape(-1)[0:1]
        device = logit_scale.device
        q_scale = self._q_scale.get(device)
        if q_scale is None:
            q_scale = self._q_scale[device] = torch.empty(1, dtype=torch.float32, device=device)
        torch.div(logit_scale, k_scale, out=q_scale)
        return 1.0, q_scale, k_scale


@dataclass
class DecodeArgs:
    """Everything `mla_decode` takes, as views of TensorRT-LLM's buffers."""

    q: Tensor
    kv_cache: Tensor
    block_table: Tensor
    seq_lens: Tensor
    softmax_scale: float
    q_scale: Tensor
    k_scale: Tensor
    out: Tensor

    @property
    def batch(self) -> int:
        return self.q.shape[0]

    @property
    def q_len(self) -> int:
        return self.q.shape[1]

    @property
    def num_heads(self) -> int:
        return self.q.shape[2]

    @property
    def page_size(self) -> int:
        return self.kv_cache.shape[1]


def decode_args(*, quant_q_buffer: Tensor, output: Tensor, kv_pool: Tensor, kv_cache_block_offsets: Tensor,
                pool_index: int, seq_offset: int, sequence_length: Tensor, num_seqs: int, num_tokens: int,
                num_heads: int, mla_bmm1_scale: Tensor, mla_bmm2_scale: Tensor,
                scales: Optional[ScaleBuffers] = None) -> DecodeArgs:
    """Translate one generation-phase call. `sequence_length` is already the phase's slice (starts at
    sequence `seq_offset`), as PhasedFmha.forward hands it over; the page table is whole-batch."""
    if num_seqs <= 0 or num_tokens % num_seqs:
        raise LayoutRefused(f"{num_tokens} generation tokens do not split evenly over {num_seqs} sequences")
    q_len = num_tokens // num_seqs
    if not 1 <= q_len <= MAX_Q_LEN:
        raise LayoutRefused(f"q_len must be in 1..{MAX_Q_LEN}, got {q_len}")
    if sequence_length.dtype != torch.int32 or sequence_length.dim() != 1 or sequence_length.shape[0] < num_seqs:
        raise LayoutRefused(f"sequence lengths must be int32 [>= {num_seqs}], got {sequence_length.dtype} "
                            f"{tuple(sequence_length.shape)}")
    softmax_scale, q_scale, k_scale = (scales or ScaleBuffers()).split(mla_bmm1_scale, mla_bmm2_scale)
    return DecodeArgs(
        q=query_view(quant_q_buffer, num_seqs, q_len, num_heads),
        kv_cache=kv_pool_view(kv_pool),
        block_table=block_table_view(kv_cache_block_offsets, pool_index, seq_offset, num_seqs),
        seq_lens=sequence_length[:num_seqs],
        softmax_scale=softmax_scale,
        q_scale=q_scale,
        k_scale=k_scale,
        out=output_view(output, num_seqs, q_len, num_heads),
    )
