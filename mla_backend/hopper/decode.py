"""The SM90 split-KV decode: the schedule a configuration runs, its compile, and its launch on torch tensors.

docs/design.md explains the kernels; `decode_rows16.py` (16-row blocks, q_len x H <= 16), `decode_swg.py` (32 and 48
rows, 64 on request; `decode_swg_tma.py` its TMA form) and `decode_pairs.py` (64 rows; 48 research) are the
runtime's schedules, `decode_pairs_stagger.py` (64 rows) a research form of the last and `decode_swg_qregs.py` (64
rows) a research one, over the shared pieces `decode_common`, `paged_kv`, `softmax`, `decode_mma` and `epilogue`.
"""

from __future__ import annotations

from cutlass import Float16, Float32, Int32

from .. import jit_cache
from ..config import DecodeConfig
from .decode_layout import BF16, FP8
from .decode_pairs import MLADecodePairsSM90
from .decode_pairs_stagger import MLADecodePairsStaggerSM90
from .decode_rows16 import MLADecodeRows16SM90
from .decode_swg import MLADecodeSwgSM90
from .decode_swg_qregs import MLADecodeSwgQRegsSM90
from .decode_swg_tma import MLADecodeSwgTmaSM90
from .launch import cuda_stream, gmem_ptr

SCHEDULES = {"rows16": MLADecodeRows16SM90, "swg": MLADecodeSwgSM90, "swg_tma": MLADecodeSwgTmaSM90,
             "swg_tma_qregs": MLADecodeSwgQRegsSM90, "pairs": MLADecodePairsSM90,
             "pairs_stagger": MLADecodePairsStaggerSM90}


def decode_kernel(cfg: DecodeConfig):
    """The kernel object (static configuration and code) of a configuration."""
    return SCHEDULES[cfg.schedule](cfg)


def _compile_args():
    ptr = gmem_ptr
    return (
        ptr(FP8, 16), ptr(FP8, 16), ptr(Int32, 4), ptr(Int32, 4), ptr(Float32, 4), ptr(Float32, 4),
        ptr(Int32, 4), ptr(Int32, 4), ptr(Int32, 4), ptr(Int32, 4), ptr(Int32, 4), ptr(Int32, 4),
        ptr(BF16, 16), ptr(Float32, 4), ptr(Float16, 16), ptr(Float32, 4),
        Int32(1), Int32(1), Int32(1), Int32(1), Int32(1), Int32(1), Int32(1), Int32(1), Float32(1.0),
        cuda_stream(),
    )


def compile_decode(cfg: DecodeConfig):
    """The compiled launcher of a configuration (once per configuration: `jit_cache`). Every run-time value
    (pointers, batch, num_pages, strides, num_ctas, num_slots, softmax_scale, stream) is an argument of the
    compiled function, so one compile serves every batch, cache and plan size, and compiling needs no GPU."""
    return jit_cache.compiled(cfg, lambda: (decode_kernel(cfg), _compile_args()))


def run_decode(cfg: DecodeConfig, q, kv_cache, block_table, seq_lens, softmax_scale, q_scale, k_scale, plan, out,
               lse, partial_out, partial_lse, stream):
    """Launch the decode on torch CUDA tensors (no host sync, no allocation: CUDA-graph safe). The op
    (`mla_backend.api`) has validated them: q fp8 [B, q_len, H, 576] contiguous; kv_cache fp8
    [num_pages, page_size, 576] with unit stride on the 576 bytes, row stride 576 and a page stride that is a
    multiple of 16 bytes; block_table int32 [B, max_pages] with unit column stride; seq_lens int32 [B]; q_scale /
    k_scale float32 [1] on the device; plan a `SplitPlan`; out bf16 [B, q_len, H, 512], lse fp32 [B, q_len, H],
    partial_out fp16 [num_slots, q_len, H, 512] (in units of k_scale), partial_lse fp32 [num_slots, q_len, H],
    all contiguous; `stream` a torch.cuda.Stream."""
    fn = compile_decode(cfg)
    batch = q.shape[0]
    num_pages = kv_cache.shape[0]
    cta_tile_start, cta_first_request, request_tile_start, request_first_cta, num_splits, split_offset = \
        plan.tensors()
    fn(
        gmem_ptr(FP8, 16, q.data_ptr()),
        gmem_ptr(FP8, 16, kv_cache.data_ptr()),
        gmem_ptr(Int32, 4, block_table.data_ptr()),
        gmem_ptr(Int32, 4, seq_lens.data_ptr()),
        gmem_ptr(Float32, 4, q_scale.data_ptr()),
        gmem_ptr(Float32, 4, k_scale.data_ptr()),
        gmem_ptr(Int32, 4, cta_tile_start.data_ptr()),
        gmem_ptr(Int32, 4, cta_first_request.data_ptr()),
        gmem_ptr(Int32, 4, request_tile_start.data_ptr()),
        gmem_ptr(Int32, 4, request_first_cta.data_ptr()),
        gmem_ptr(Int32, 4, num_splits.data_ptr()),
        gmem_ptr(Int32, 4, split_offset.data_ptr()),
        gmem_ptr(BF16, 16, out.data_ptr()),
        gmem_ptr(Float32, 4, lse.data_ptr()),
        gmem_ptr(Float16, 16, partial_out.data_ptr()),
        gmem_ptr(Float32, 4, partial_lse.data_ptr()),
        Int32(batch), Int32(num_pages), Int32(kv_cache.stride(0) // 16), Int32(block_table.stride(0)),
        Int32(block_table.shape[1]),
        Int32(cta_first_request.shape[0]), Int32(num_splits.shape[0]), Int32(max(partial_lse.shape[0], 1)),
        Float32(float(softmax_scale)),
        cuda_stream(stream),
    )
