"""The `cute_mla_fp8` FMHA library for TensorRT-LLM's `TrtllmAttention`: when to take an MLA generation call,
and how to run it with `mla_decode`.

TensorRT-LLM's `FmhaManager` asks each enabled library, in registry order, `is_available(attn)` once per
attention layer and `is_supported(..., phase=...)` per selection; the first that says yes runs the phase.
Everything we say no to goes to the next library (the built-in CuTe DSL or TRTLLM-Gen kernels), and the
reason is logged once. The rules are plain functions over TensorRT-LLM's objects (attribute access only) so
the CPU tests can call them with stand-ins; `make_library_class` binds them to TensorRT-LLM's `PhasedFmha`.
"""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Set, Tuple

import torch

from mla_backend.config import environment
from mla_backend.shapes import KV_DIM, LATENT_DIM, MAX_HEADS, MAX_Q_LEN, MIN_HEADS, ROPE_DIM, SUPPORTED_PAGE_SIZES

from .translate import LayoutRefused, ScaleBuffers, decode_args, kv_pool_view

LIBRARY_NAME = "cute_mla_fp8"
CLASS_NAME = "CuteMlaFp8Fmha"

_python_logger = logging.getLogger("mla_backend.integrations.trtllm")
_logged_reasons: Set[str] = set()


def _trtllm_logger():
    try:
        from tensorrt_llm.logger import logger
        return logger
    except ImportError:
        return _python_logger


def log_refusal_once(reason: str) -> None:
    """Warn the first time a reason keeps us off a call; the same reason (any layer) is not repeated."""
    if reason in _logged_reasons:
        return
    _logged_reasons.add(reason)
    _trtllm_logger().warning(f"{LIBRARY_NAME} declines MLA generation, falling back to the next FMHA library: "
                             f"{reason}")


def _enum_name(value: Any) -> Optional[str]:
    # TensorRT-LLM's enums are compared by name so this module never imports them (and the tests can pass
    # stand-ins): AttentionInputType.generation_only, CustomAttentionMask.CUSTOM, FmhaPhase.GENERATION.
    return getattr(value, "name", None)


# --------------------------------------------------------------------------- static (per layer) rules


def device_refusal(device: Optional[torch.device] = None) -> Optional[str]:
    """Why this process cannot run our kernels, or None. The kernels are Hopper (SM90) CuTe DSL kernels."""
    if not torch.cuda.is_available():
        return "no CUDA device"
    major, minor = torch.cuda.get_device_capability(device)
    if major != 9:
        return f"the kernels need an SM90 (Hopper) GPU, this is SM{major}{minor}"
    if importlib.util.find_spec("cutlass") is None:
        return "nvidia-cutlass-dsl is not installed"
    return None


def layer_refusal(attn: Any) -> Optional[str]:
    """Why this attention layer can never use us (checked once per layer by `is_available`), or None."""
    if not getattr(attn, "is_mla_enable", False):
        return "not an MLA layer"
    if getattr(attn, "sparse_params", None) is not None:
        return f"sparse attention ({type(attn.sparse_params).__name__}) needs its sparse indices honoured"
    if getattr(attn, "flashinfer_mla_backend", None) is not None:
        return "an explicit flashinfer_mla_backend owns MLA generation"
    if getattr(attn, "kv_lora_rank", None) != LATENT_DIM or getattr(attn, "qk_rope_head_dim", None) != ROPE_DIM:
        return (f"the kernels need kv_lora_rank={LATENT_DIM} and qk_rope_head_dim={ROPE_DIM}, got "
                f"{getattr(attn, 'kv_lora_rank', None)} and {getattr(attn, 'qk_rope_head_dim', None)}")
    if not getattr(attn, "has_fp8_kv_cache", False):
        return "the KV cache is not FP8 (set kv_cache_config.dtype: fp8)"
    num_heads = getattr(attn, "num_heads", 0)
    if not MIN_HEADS <= num_heads <= MAX_HEADS:
        return f"num_heads (per rank) must be in {MIN_HEADS}..{MAX_HEADS}, got {num_heads}"
    try:
        environment()  # CUTE_MLA_P_PRECISION and the other switches, read once per process
    except ValueError as error:
        return str(error)
    return device_refusal()


# --------------------------------------------------------------------------- per-call rules


def call_refusal(attn: Any, q: torch.Tensor, metadata: Any, forward_args: Any, phase: Any = None) -> Optional[str]:
    """Why this MLA call cannot use us, or None. Only what `FmhaManager`'s selection cache keys on (phase,
    batch buckets, generation q_len, mask, spec decoding, output dtype) or what is fixed for the layer
    may decide here, so a cached choice stays right for every call that hits it."""
    if phase is not None and _enum_name(phase) != "GENERATION":
        return "context phase (only generation is implemented)"
    if _enum_name(getattr(forward_args, "attention_input_type", None)) != "generation_only":
        return "not a generation-only MLA call"
    num_generations = getattr(metadata, "num_generations", 0)
    if num_generations <= 0:
        return "no generation requests"
    if getattr(metadata, "beam_width", 1) != 1:
        return f"beam search (beam_width={metadata.beam_width})"
    if (_enum_name(getattr(forward_args, "attention_mask", None)) == "CUSTOM"
            or getattr(forward_args, "attention_mask_data", None) is not None
            or getattr(metadata, "is_spec_dec_tree", False) or getattr(metadata, "is_spec_dec_dynamic_tree", False)):
        return "custom or tree speculative-decoding mask (only the linear causal MTP mask is implemented)"
    if getattr(metadata, "helix_position_offsets", None) is not None:
        return "Helix context parallelism"
    if q.shape[0] % num_generations:
        return f"{q.shape[0]} query tokens do not split evenly over {num_generations} requests"
    q_len = q.shape[0] // num_generations
    if not 1 <= q_len <= MAX_Q_LEN:
        return f"q_len {q_len} is outside 1..{MAX_Q_LEN}"
    page_size = getattr(metadata, "tokens_per_block", None)
    if page_size not in SUPPORTED_PAGE_SIZES:
        return f"tokens_per_block must be one of {SUPPORTED_PAGE_SIZES}, got {page_size}"
    if getattr(metadata, "kv_cache_manager", None) is None:
        return "no paged KV cache"
    quant_q = getattr(forward_args, "quant_q_buffer", None)
    if (quant_q is None or getattr(forward_args, "mla_bmm1_scale", None) is None
            or getattr(forward_args, "mla_bmm2_scale", None) is None):
        return "FP8 generation inputs missing (quant_q_buffer, mla_bmm1_scale, mla_bmm2_scale)"
    if quant_q.element_size() != 1 or quant_q.numel() < q_len * num_generations * attn.num_heads * KV_DIM:
        return f"quant_q_buffer is not an FP8 copy of q ({quant_q.dtype}, {quant_q.numel()} elements)"
    output = getattr(forward_args, "output", None)
    if output is None or output.dtype != torch.bfloat16:
        return f"output must be bfloat16, got {getattr(output, 'dtype', None)}"
    return None


def kv_pool_refusal(kv_pool: torch.Tensor) -> Optional[str]:
    """Why the layer's KV pool cannot be viewed as our [num_pages, page_size, 576] cache, or None."""
    try:
        kv_pool_view(kv_pool)
    except LayoutRefused as refused:
        return str(refused)
    return None


# --------------------------------------------------------------------------- split plan shared by layers


@dataclass
class _PlanEntry:
    plan: Any
    owner_layer: int


class StepPlans:
    """One split plan per step, computed by the first of our layers to run and reused by the others.

    Every layer of a step reads the same `kv_lens_cuda`, so its plan (device tensors, CUDA-graph safe) is
    computed once, by the layer that first created it (the first layer of the forward), into persistent
    buffers that the other layers read. Under CUDA graphs the computing layer's planner kernels are part of
    the graph, so every replay replans from that step's lengths.

    Speculative decoding (MTP) changes `kv_lens_cuda` in place between the target model's layers and the
    draft layers of the same forward, which the layer order cannot see. When the metadata says speculative
    decoding is on, each layer therefore plans for itself: correct, and a few small kernels per layer.
    """

    def __init__(self) -> None:
        self._entries: Dict[Tuple, _PlanEntry] = {}

    def get(self, seq_lens: torch.Tensor, *, layer: int, q_len: int, num_heads: int, page_size: int,
            max_batch: Optional[int] = None, per_layer: bool = False):
        """The plan for this step. `max_batch` (TensorRT-LLM's max_num_requests) sizes the buffers once for
        every batch size, so the op's workspace, sized from the plan, is allocated once before graph capture."""
        from mla_backend.plan import plan_splits

        plan_batch = max(max_batch or 0, seq_lens.shape[0])
        key = (seq_lens.device, seq_lens.untyped_storage().data_ptr(), seq_lens.storage_offset(), plan_batch,
               q_len, num_heads, page_size)
        entry = self._entries.get(key)
        if entry is None:
            plan = plan_splits(seq_lens, q_len=q_len, num_heads=num_heads, page_size=page_size,
                               max_batch=plan_batch)
            self._entries[key] = _PlanEntry(plan, layer)
            return plan
        if per_layer or layer == entry.owner_layer:
            plan_splits(seq_lens, q_len=q_len, num_heads=num_heads, page_size=page_size, out=entry.plan)
        return entry.plan

    def clear(self) -> None:
        self._entries.clear()


STEP_PLANS = StepPlans()
SCALES = ScaleBuffers()


# --------------------------------------------------------------------------- the run


def run_generation(params: Any, *, plans: StepPlans = STEP_PLANS, scales: ScaleBuffers = SCALES,
                   decode: Optional[Callable] = None) -> None:
    """Run one generation phase from TensorRT-LLM's `FmhaParams`, writing into its output buffer, at the
    p_precision of CUTE_MLA_P_PRECISION (default "fp8"; the launch exports it to every rank)."""
    if decode is None:
        from mla_backend import mla_decode as decode
    fwd, meta = params.fwd, params.meta
    num_seqs = params.num_seqs
    pool_index = int(params.host_kv_cache_pool_mapping[params.local_layer_idx, 0])
    args = decode_args(
        quant_q_buffer=fwd.quant_q_buffer, output=params.output, kv_pool=params.kv_pool,
        kv_cache_block_offsets=params.kv_cache_block_offsets, pool_index=pool_index,
        seq_offset=params.seq_offset, sequence_length=params.sequence_length, num_seqs=num_seqs,
        num_tokens=params.num_tokens, num_heads=params.num_heads, mla_bmm1_scale=fwd.mla_bmm1_scale,
        mla_bmm2_scale=fwd.mla_bmm2_scale, scales=scales)
    spec_decoding = bool(getattr(meta, "is_spec_decoding_enabled", False)
                         or getattr(meta, "use_spec_decoding", False))
    plan = plans.get(args.seq_lens, layer=params.layer_idx, q_len=args.q_len, num_heads=args.num_heads,
                     page_size=args.page_size, max_batch=getattr(params, "max_num_requests", None),
                     per_layer=spec_decoding)
    decode(args.q, args.kv_cache, args.block_table, args.seq_lens, softmax_scale=args.softmax_scale,
           q_scale=args.q_scale, k_scale=args.k_scale, causal=True, out=args.out, plan=plan,
           check_values=False,  # TensorRT-LLM's own metadata: no device sync per layer
           p_precision=environment().p_precision)


# --------------------------------------------------------------------------- binding to TensorRT-LLM


def make_library_class(phased_fmha_base: type) -> type:
    """Our FMHA library as a subclass of TensorRT-LLM's `PhasedFmha` (passed in: it is imported lazily)."""

    class CuteMlaFp8Fmha(phased_fmha_base):
        """FP8 MLA generation with mla_backend's split-KV kernels (cute-mla-fp8)."""

        # PhasedFmha._build_params resolves kv_cache_manager.get_buffers(layer_idx) into params.kv_pool.
        NEEDS_KV_POOL = True

        def __init__(self, attn):
            super().__init__(attn)
            # The pool's layout is fixed for a KV cache manager's lifetime: check it once per manager.
            self._pool_verdict: Optional[Tuple[int, Optional[str]]] = None

        @classmethod
        def _is_available(cls, attn) -> bool:
            reason = layer_refusal(attn)
            if reason is not None:
                log_refusal_once(reason)
                return False
            return True

        def _is_supported(self, q, k, v, metadata, forward_args, *, phase=None) -> bool:
            attn = self.attn
            reason = call_refusal(attn, q, metadata, forward_args, phase)
            if reason is None:
                manager = metadata.kv_cache_manager
                if self._pool_verdict is None or self._pool_verdict[0] != id(manager):
                    self._pool_verdict = (id(manager), kv_pool_refusal(manager.get_buffers(attn.layer_idx)))
                reason = self._pool_verdict[1]
            if reason is not None:
                log_refusal_once(reason)
                return False
            return True

        def run_mla_generation(self, params) -> None:
            run_generation(params)

    if not hasattr(phased_fmha_base, "_is_available"):
        # Revisions before the `_is_available` / `_is_supported` hooks call these two directly.
        CuteMlaFp8Fmha.is_available = classmethod(CuteMlaFp8Fmha._is_available.__func__)
        CuteMlaFp8Fmha.is_supported = CuteMlaFp8Fmha._is_supported

    CuteMlaFp8Fmha.__qualname__ = CLASS_NAME
    return CuteMlaFp8Fmha


def make_unavailable_class(base: type, reason: str) -> type:
    """Our library's name for a TensorRT-LLM that cannot run it (`registry.capability_refusal`): registered, so
    that `TLLM_FMHA_LIBS=+cute_mla_fp8` is still a valid choice, but never available, so every layer falls back
    to TensorRT-LLM's own libraries; the reason is logged once."""

    def is_available(cls, attn) -> bool:
        log_refusal_once(reason)
        return False

    # Both the hook and the public check: whichever this revision's FmhaManager calls.
    cls = type(CLASS_NAME, (base,), {"__doc__": f"{LIBRARY_NAME}, unavailable here: {reason}",
                                      "UNAVAILABLE_REASON": reason, "is_available": classmethod(is_available),
                                      "_is_available": classmethod(is_available)})
    cls.__module__ = __name__
    return cls
