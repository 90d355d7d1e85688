"""The CUTE_MLA_FP8 backend for vLLM: dense MLA decode over an FP8 latent cache through `mla_decode`.

Prefill (and any request longer than a verify block) stays on vLLM's MLA prefill path, which
`MLACommonImpl` provides; this module only replaces the decode (`forward_mqa`) and plans it.

Per step, the metadata builder plans the split-KV decode once, on the device, into buffers allocated at
start-up (sized by max_num_seqs and the SM count); every layer of the step and every CUDA-graph replay reads
the same plan. That is what makes the builder's UNIFORM_BATCH CUDA-graph support true: nothing in the
decode path allocates or reads device values back to the host.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from vllm.model_executor.layers.attention.mla_attention import (
    MLACommonBackend,
    MLACommonDecodeMetadata,
    MLACommonImpl,
    MLACommonMetadata,
    MLACommonMetadataBuilder,
    QueryLenSupport,
)
from vllm.v1.attention.backend import AttentionCGSupport, AttentionType

from mla_backend import DecodeWorkspace, SplitPlan, mla_decode, plan_splits
from mla_backend.planner import default_num_ctas
from mla_backend.shapes import KV_DIM, LATENT_DIM, MAX_Q_LEN, SUPPORTED_PAGE_SIZES

from .registration import BACKEND_NAME

FP8_CACHE_DTYPES = ("fp8", "fp8_e4m3")
# Compute capabilities (major) with a compiled kernel: Hopper. Add 10 once a Blackwell kernel exists.
KERNEL_CAPABILITY_MAJORS = (9,)
PREFERRED_PAGE_SIZE = 64


class CuteMLAFP8Backend(MLACommonBackend):
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16]
    supported_kv_cache_dtypes: ClassVar[list[str]] = list(FP8_CACHE_DTYPES)

    @staticmethod
    def get_name() -> str:
        return BACKEND_NAME

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list:
        return list(SUPPORTED_PAGE_SIZES)

    @staticmethod
    def get_builder_cls() -> type["CuteMLAFP8MetadataBuilder"]:
        return CuteMLAFP8MetadataBuilder

    @staticmethod
    def get_impl_cls() -> type["CuteMLAFP8Impl"]:
        return CuteMLAFP8Impl

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return [KV_DIM]

    @classmethod
    def supports_block_size(cls, block_size: int | None) -> bool:
        # Exact page sizes only: the kernel indexes pages of the cache block size itself.
        return block_size is None or block_size in SUPPORTED_PAGE_SIZES

    @classmethod
    def get_preferred_block_size(cls, default_block_size: int) -> int:
        return default_block_size if cls.supports_block_size(default_block_size) else PREFERRED_PAGE_SIZE

    @classmethod
    def supports_compute_capability(cls, capability) -> bool:
        return capability is not None and capability.major in KERNEL_CAPABILITY_MAJORS

    @classmethod
    def validate_configuration(cls, head_size, dtype, kv_cache_dtype, block_size, use_mla, has_sink, use_sparse,
                               use_mm_prefix, use_per_head_quant_scales, device_capability, attn_type,
                               **more) -> list[str]:
        """vLLM's generic checks, with our own words for the limits users hit: cache dtype, head size,
        page size, GPU."""
        generic = super().validate_configuration(
            head_size=head_size, dtype=dtype, kv_cache_dtype=kv_cache_dtype, block_size=block_size,
            use_mla=use_mla, has_sink=has_sink, use_sparse=use_sparse, use_mm_prefix=use_mm_prefix,
            use_per_head_quant_scales=use_per_head_quant_scales, device_capability=device_capability,
            attn_type=attn_type, **more)
        reworded = {"kv_cache_dtype not supported", "head_size not supported", "block_size not supported",
                    "compute capability not supported"}
        reasons = []
        if kv_cache_dtype is not None and not cls.supports_kv_cache_dtype(kv_cache_dtype):
            reasons.append(f"kv_cache_dtype {kv_cache_dtype!r} is not supported: {BACKEND_NAME} reads an FP8 "
                           f"(e4m3) latent cache only; start vLLM with --kv-cache-dtype fp8")
        if not cls.supports_head_size(head_size):
            reasons.append(f"head size {head_size} is not supported: {BACKEND_NAME} needs the DeepSeek MLA "
                           f"latent of {KV_DIM} (kv_lora_rank {LATENT_DIM} + rope {KV_DIM - LATENT_DIM})")
        if not cls.supports_block_size(block_size):
            reasons.append(f"block size {block_size} is not supported: {BACKEND_NAME} pages hold "
                           f"{' or '.join(map(str, SUPPORTED_PAGE_SIZES))} tokens (--block-size)")
        if not cls.supports_compute_capability(device_capability):
            found = "no GPU" if device_capability is None else \
                f"compute capability {device_capability.major}.{device_capability.minor}"
            wanted = " or ".join(f"{m}.x" for m in KERNEL_CAPABILITY_MAJORS)
            reasons.append(f"{found}: {BACKEND_NAME} has kernels for compute capability {wanted} (Hopper) only")
        return reasons + [r for r in generic if r not in reworded]


@dataclass
class CuteMLAFP8DecodeMetadata(MLACommonDecodeMetadata):
    q_len: int  # uniform query length of the decode requests (1, or 1 + speculative tokens)
    split_plan: SplitPlan  # persistent buffers owned by the builder, refilled every step
    workspace: DecodeWorkspace  # partial outputs of split requests, persistent as well


@dataclass
class CuteMLAFP8Metadata(MLACommonMetadata[CuteMLAFP8DecodeMetadata]):
    pass


class CuteMLAFP8MetadataBuilder(MLACommonMetadataBuilder[CuteMLAFP8Metadata]):
    # Uniform decode batches (plain decode, or verify blocks of 1 + k tokens) replay as full CUDA graphs.
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_BATCH
    query_len_support: ClassVar[QueryLenSupport] = QueryLenSupport.UNIFORM

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device, CuteMLAFP8Metadata)
        self._max_batch = vllm_config.scheduler_config.max_num_seqs
        self._device = device
        # Allocated now, before any graph capture: the decode q_len of this engine, and 1 (steps without
        # drafts, and the drafter's own decode). A plan per q_len: its CTA count depends on the query rows.
        self._plans: dict[int, tuple[SplitPlan, DecodeWorkspace]] = {}
        for q_len in sorted({1, min(self.reorder_batch_threshold, MAX_Q_LEN)}):
            self._plan_and_workspace(q_len)

    def _plan_and_workspace(self, q_len: int) -> tuple[SplitPlan, DecodeWorkspace]:
        """The persistent split plan and workspace for decodes of q_len tokens (refilled every step)."""
        entry = self._plans.get(q_len)
        if entry is None:
            plan = SplitPlan.empty(self._max_batch, default_num_ctas(self._device, self.num_heads, q_len),
                                   device=self._device)
            entry = (plan, DecodeWorkspace.for_plan(plan, q_len, self.num_heads))
            self._plans[q_len] = entry
        return entry

    def _build_decode(self, block_table_tensor, seq_lens_device, max_seq_len, query_start_loc_cpu,
                      query_start_loc_device, num_decode_tokens, max_query_len, dcp_tot_seq_lens_device):
        num_decodes = seq_lens_device.shape[0]
        # The base class keeps decodes uniform (QueryLenSupport.UNIFORM), so the host-side token count gives
        # q_len without reading device memory.
        q_len, remainder = divmod(num_decode_tokens, num_decodes)
        if remainder or not 1 <= q_len <= MAX_Q_LEN:
            raise ValueError(f"{BACKEND_NAME} decodes uniform query blocks of 1..{MAX_Q_LEN} tokens; got "
                             f"{num_decode_tokens} tokens over {num_decodes} requests")
        plan, workspace = self._plan_and_workspace(q_len)
        plan_splits(seq_lens_device, q_len=q_len, num_heads=self.num_heads, page_size=self.page_size, out=plan)
        return CuteMLAFP8DecodeMetadata(
            block_table=block_table_tensor,
            seq_lens=seq_lens_device,
            dcp_tot_seq_lens=dcp_tot_seq_lens_device,
            q_len=q_len,
            split_plan=plan,
            workspace=workspace,
        )


class CuteMLAFP8Impl(MLACommonImpl[CuteMLAFP8Metadata]):
    # The op returns the natural-log LSE, which is what vLLM's LSE consumers (DCP combine) expect.
    can_return_lse_for_decode: bool = True
    lse_base_on_e: bool = True

    def __init__(self, num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window, kv_cache_dtype,
                 logits_soft_cap, attn_type, kv_sharing_target_layer_name, **mla_args) -> None:
        super().__init__(num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window, kv_cache_dtype,
                         logits_soft_cap, attn_type, kv_sharing_target_layer_name, **mla_args)
        unsupported = [name for name, value in (("alibi_slopes", alibi_slopes), ("sliding_window", sliding_window),
                                                ("logits_soft_cap", logits_soft_cap)) if value]
        if unsupported:
            raise NotImplementedError(f"{BACKEND_NAME} does not support {', '.join(unsupported)}")
        if attn_type != AttentionType.DECODER:
            raise NotImplementedError(f"{BACKEND_NAME} implements decoder self-attention only, not {attn_type}")

    def forward_mqa(self, q, kv_c_and_k_pe_cache, attn_metadata, layer):
        """q: [T, H, 576] (FP8, quantized by the layer with `layer._q_scale`, when the cache is FP8) or the
        (q_nope, q_pe) pair; T = num_decodes * q_len. Returns ([T, H, 512], LSE [T, H] or None)."""
        decode = attn_metadata.decode
        assert decode is not None
        if isinstance(q, tuple):
            q = torch.cat(q, dim=-1)  # bf16 path; mla_decode quantizes it with q_scale
        num_tokens, num_heads, _ = q.shape
        out, lse = mla_decode(
            q.view(-1, decode.q_len, num_heads, KV_DIM),
            kv_c_and_k_pe_cache,
            decode.block_table,
            decode.seq_lens,
            softmax_scale=self.scale,
            q_scale=layer._q_scale,
            k_scale=layer._k_scale,
            causal=True,
            plan=decode.split_plan,
            workspace=decode.workspace,
            check_values=False,  # vLLM's own block table and lengths: no device sync per layer
        )
        out = out.view(num_tokens, num_heads, LATENT_DIM)
        if not self.need_to_return_lse_for_decode:
            return out, None
        return out, lse.view(num_tokens, num_heads)
