"""The CUTE_MLA_FP8 backend for vLLM: dense MLA decode over an FP8 latent cache through `mla_decode`.

Prefill (and any request longer than a verify block) stays on vLLM's MLA prefill path, which
`MLACommonImpl` provides; this module only replaces the decode (`forward_mqa`) and plans it.

Start-up (`resources`): in vLLM's memory-profiling run the impl's `reserve_workspace` makes the workspace, the
plans and the kernels of every decode query length the engine can hand us (1 to the reorder threshold); the
metadata builder claims them. Per step, the builder plans the split-KV decode once, on the device, into its plan
of the step's q_len; every layer of the step and every CUDA-graph replay reads that plan. That is what makes the
builder's UNIFORM_BATCH CUDA-graph support true: nothing in the decode path allocates, compiles or reads device
values back to the host.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, List, Optional

import torch

from vllm.config import get_current_vllm_config, get_current_vllm_config_or_none
from vllm.logger import init_logger
from vllm.model_executor.layers.attention.mla_attention import (
    MLACommonBackend,
    MLACommonDecodeMetadata,
    MLACommonImpl,
    MLACommonMetadata,
    MLACommonMetadataBuilder,
    QueryLenSupport,
)
from vllm.v1.attention.backend import AttentionCGSupport, AttentionType, max_decode_query_len

from mla_backend import DecodeWorkspace, SplitPlan, mla_decode, plan_splits
from mla_backend.config import check_p_precision, environment
from mla_backend.shapes import KV_DIM, LATENT_DIM, MAX_Q_LEN, SUPPORTED_PAGE_SIZES, check_shape

from .registration import BACKEND_NAME
from .resources import KERNEL_CAPABILITY_MAJORS, RESOURCES, canonical_device

# Under "vllm." so that vLLM's logging configuration shows our info lines with its own.
logger = init_logger("vllm.cute_mla_fp8")

FP8_CACHE_DTYPES = ("fp8", "fp8_e4m3")
PREFERRED_PAGE_SIZE = 64
# --additional-config '{"cute_mla_fp8": {"p_precision": "fp8x2"}}'
ADDITIONAL_CONFIG_KEY = "cute_mla_fp8"
ADDITIONAL_CONFIG_FIELDS = ("p_precision",)


# ------------------------------------------------------------------------------------------ engine settings
def our_additional_config(vllm_config) -> dict:
    """The `cute_mla_fp8` entry of vLLM's --additional-config ({} when absent)."""
    additional = getattr(vllm_config, "additional_config", None) or {}
    return additional.get(ADDITIONAL_CONFIG_KEY) or {}


def additional_config_refusals(vllm_config) -> List[str]:
    ours = our_additional_config(vllm_config)
    where = f"--additional-config {ADDITIONAL_CONFIG_KEY}"
    if not isinstance(ours, dict):
        return [f"{where} must be a JSON object such as {{\"p_precision\": \"fp8x2\"}}, got {ours!r}"]
    reasons = [f"{where}.{key} is not a setting of {BACKEND_NAME} (settings: {', '.join(ADDITIONAL_CONFIG_FIELDS)})"
               for key in ours if key not in ADDITIONAL_CONFIG_FIELDS]
    if "p_precision" in ours:
        try:
            check_p_precision(ours["p_precision"], f"{where}.p_precision")
        except ValueError as error:
            reasons.append(str(error))
    return reasons


def configured_p_precision(vllm_config) -> str:
    """--additional-config's p_precision, else CUTE_MLA_P_PRECISION, else mla_backend's default ("fp8")."""
    value = our_additional_config(vllm_config).get("p_precision") if vllm_config is not None else None
    if value is None:
        return environment().p_precision
    return check_p_precision(value, f"--additional-config {ADDITIONAL_CONFIG_KEY}.p_precision")


def decode_query_len(vllm_config) -> int:
    """The longest decode query vLLM hands the backend: 1, or a verify block (1 + drafts, more with V1's parallel
    drafting). The builder's reorder_batch_threshold is the same number."""
    return max_decode_query_len(vllm_config)


def speculative_refusal(vllm_config) -> Optional[str]:
    q_len = decode_query_len(vllm_config)
    if q_len <= MAX_Q_LEN:
        return None
    drafts = vllm_config.speculative_config.num_speculative_tokens
    parallel = " with parallel drafting" if q_len > 1 + drafts else ""
    return (f"speculative decoding with {drafts} draft tokens{parallel} makes decode queries of {q_len} tokens: "
            f"{BACKEND_NAME} decodes at most {MAX_Q_LEN} query tokens per request (num_speculative_tokens <= "
            f"{MAX_Q_LEN - 1})")


def config_refusals(vllm_config) -> List[str]:
    """What the engine configuration asks of the decode that the kernels cannot do."""
    if vllm_config is None:
        return []
    reasons = additional_config_refusals(vllm_config)
    speculative = speculative_refusal(vllm_config)
    return reasons + ([speculative] if speculative else [])


def plan_sets_to_reserve(vllm_config) -> int:
    """One plan set per metadata builder of the group: vLLM makes one builder per microbatch."""
    return max(1, int(getattr(vllm_config.parallel_config, "num_ubatches", 1) or 1))


# ------------------------------------------------------------------------------------------------ backend
class CuteMLAFP8Backend(MLACommonBackend):
    # bf16 only: the op's output is bf16, and vLLM's MLA layer multiplies it into an output of the model dtype.
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.bfloat16]
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
        """vLLM's generic checks, with our own words for the limits users hit: model dtype, cache dtype, head size,
        page size, GPU, decode context parallelism; and, from the engine configuration that vLLM's selector has
        made current, speculative decoding and our --additional-config."""
        generic = super().validate_configuration(
            head_size=head_size, dtype=dtype, kv_cache_dtype=kv_cache_dtype, block_size=block_size,
            use_mla=use_mla, has_sink=has_sink, use_sparse=use_sparse, use_mm_prefix=use_mm_prefix,
            use_per_head_quant_scales=use_per_head_quant_scales, device_capability=device_capability,
            attn_type=attn_type, **more)
        reworded = {"dtype not supported", "kv_cache_dtype not supported", "head_size not supported",
                    "block_size not supported", "compute capability not supported", "DCP not supported"}
        reasons = []
        if dtype is not None and not cls.supports_dtype(dtype):
            reasons.append(f"dtype {str(dtype).replace('torch.', '')} is not supported: {BACKEND_NAME} returns its "
                           f"decode output in bfloat16, which vLLM's MLA layer multiplies into an output of the model "
                           f"dtype; serve with --dtype bfloat16")
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
        if "DCP not supported" in generic:
            reasons.append(f"decode context parallelism (--decode-context-parallel-size > 1) is not supported: "
                           f"{BACKEND_NAME} does not return the decode LSE that DCP merges")
        # vLLM's selector validates inside the engine's configuration context (v1/attention/selector.py).
        reasons += config_refusals(get_current_vllm_config_or_none())
        return reasons + [r for r in generic if r not in reworded]


@dataclass
class CuteMLAFP8DecodeMetadata(MLACommonDecodeMetadata):
    q_len: int  # uniform query length of the decode requests (1, or 1 + speculative tokens)
    split_plan: SplitPlan  # persistent buffers owned by the builder, refilled every step
    workspace: DecodeWorkspace  # partial outputs of split requests, shared by the process's decodes
    p_precision: str  # how P enters the P.V MMA (`mla_backend.config.P_PRECISIONS`)


@dataclass
class CuteMLAFP8Metadata(MLACommonMetadata[CuteMLAFP8DecodeMetadata]):
    pass


class CuteMLAFP8MetadataBuilder(MLACommonMetadataBuilder[CuteMLAFP8Metadata]):
    # Uniform decode batches (plain decode, or verify blocks of 1 + k tokens) replay as full CUDA graphs.
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_BATCH
    query_len_support: ClassVar[QueryLenSupport] = QueryLenSupport.UNIFORM

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device, CuteMLAFP8Metadata)
        max_q_len = self.reorder_batch_threshold or 1
        speculative = speculative_refusal(vllm_config)
        if max_q_len > MAX_Q_LEN:
            raise ValueError(speculative or f"{BACKEND_NAME} decodes at most {MAX_Q_LEN} query tokens per request, "
                                            f"the engine's decode threshold is {max_q_len}")
        self._p_precision = configured_p_precision(vllm_config)
        # The plans and workspaces of every q_len the engine can hand us: made now (before any step or graph
        # capture), normally reserved by the impl during memory profiling.
        claim = RESOURCES.claim(device, num_heads=self.num_heads, page_size=self.page_size,
                                max_batch=vllm_config.scheduler_config.max_num_seqs, max_q_len=max_q_len,
                                p_precision=self._p_precision, log=logger.info)
        self._plans, self._workspaces = claim.plans, claim.workspaces

    def _build_decode(self, block_table_tensor, seq_lens_device, max_seq_len, query_start_loc_cpu,
                      query_start_loc_device, num_decode_tokens, max_query_len, dcp_tot_seq_lens_device):
        num_decodes = seq_lens_device.shape[0]
        # The base class keeps decodes uniform (QueryLenSupport.UNIFORM), so the host-side token count gives
        # q_len without reading device memory.
        q_len, remainder = divmod(num_decode_tokens, num_decodes)
        if remainder or q_len not in self._plans:
            raise ValueError(f"{BACKEND_NAME} decodes uniform query blocks of 1..{max(self._plans)} tokens; got "
                             f"{num_decode_tokens} tokens over {num_decodes} requests")
        plan = self._plans[q_len]
        plan_splits(seq_lens_device, q_len=q_len, num_heads=self.num_heads, page_size=self.page_size, out=plan)
        return CuteMLAFP8DecodeMetadata(
            block_table=block_table_tensor,
            seq_lens=seq_lens_device,
            dcp_tot_seq_lens=dcp_tot_seq_lens_device,
            q_len=q_len,
            split_plan=plan,
            workspace=self._workspaces[q_len],
            p_precision=self._p_precision,
        )


class CuteMLAFP8Impl(MLACommonImpl[CuteMLAFP8Metadata]):
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
        try:
            check_shape(num_heads=num_heads, names={"num_heads": "query heads per GPU"})
        except ValueError as error:
            raise NotImplementedError(f"{BACKEND_NAME}: {error} (tensor parallel size over the model's heads)") \
                from None
        self._vllm_config = get_current_vllm_config()

    def reserve_workspace(self) -> None:
        """vLLM's memory-profiling run (MLAAttention.forward_impl without metadata): make this process's plans,
        workspace and kernels now, so that the KV cache is sized around them. After load_model, so the block size
        is final. Idempotent: every layer calls it."""
        config = self._vllm_config
        RESOURCES.reserve(canonical_device(config.device_config.device_type), num_heads=self.num_heads,
                          page_size=config.cache_config.block_size,
                          max_batch=config.scheduler_config.max_num_seqs, max_q_len=decode_query_len(config),
                          p_precision=configured_p_precision(config), plan_sets=plan_sets_to_reserve(config),
                          log=logger.info)

    def forward_mqa(self, q, kv_c_and_k_pe_cache, attn_metadata, layer):
        """q: [T, H, 576] (FP8, quantized by the layer with `layer._q_scale`, when the cache is FP8) or the
        (q_nope, q_pe) pair; T = num_decodes * q_len. Returns ([T, H, 512] bf16, None): no LSE, as without DCP
        (which we refuse) vLLM reads none."""
        decode = attn_metadata.decode
        assert decode is not None
        if isinstance(q, tuple):
            q = torch.cat(q, dim=-1)  # bf16 path; mla_decode quantizes it with q_scale
        num_tokens, num_heads, _ = q.shape
        out, _ = mla_decode(
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
            p_precision=decode.p_precision,
        )
        return out.view(num_tokens, num_heads, LATENT_DIM), None
