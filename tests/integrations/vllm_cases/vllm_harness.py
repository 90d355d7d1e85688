"""Shared pieces of the vLLM tests: a Hopper-looking CUDA platform for backend selection, and spawned-worker
entry points (they must live in an importable module, as a spawned process imports its target by name)."""

from __future__ import annotations

import os


def use_hopper_platform():
    """Install a stand-in for vLLM's CUDA platform on an H200 (compute capability 9.0) as the current platform.

    vLLM's real CUDA platform cannot even be imported without libcuda. The stand-in keeps the part of its
    contract that backend selection depends on: an explicitly selected backend is validated with
    `validate_configuration` and rejected with its reasons; with no selection the platform picks its own
    (here `PlatformDefaultMLA`). Call it before anything reads `vllm.platforms.current_platform`.
    """
    import vllm.platforms
    from vllm.platforms.interface import DeviceCapability, Platform, PlatformEnum

    class HopperForTests(Platform):
        _enum = PlatformEnum.OOT
        device_name = "hopper-for-tests"
        device_type = "cpu"  # tensors of these tests live on the CPU
        dispatch_key = "CPU"

        @classmethod
        def get_device_capability(cls, device_id: int = 0):
            return DeviceCapability(major=9, minor=0)

        @classmethod
        def get_attn_backend_cls(cls, selected_backend, attn_selector_config, num_heads=None):
            if selected_backend is None:
                return f"{__name__}.PlatformDefaultMLA"
            reasons = selected_backend.get_class().validate_configuration(
                device_capability=cls.get_device_capability(), **attn_selector_config._asdict())
            if reasons:
                raise ValueError(f"Selected backend {selected_backend} is not valid for this configuration. "
                                 f"Reason: {reasons}")
            return selected_backend.get_path()

    vllm.platforms.current_platform = HopperForTests()
    return vllm.platforms.current_platform


def _mla_backend_named(name):
    from vllm.model_executor.layers.attention.mla_attention import MLACommonBackend

    return type(name, (MLACommonBackend,), {"get_name": staticmethod(lambda: name.upper()),
                                            "supported_kv_cache_dtypes": ["auto", "fp8", "fp8_e4m3"]})


# PlatformDefaultMLA: what the platform chooses by itself; ExplicitMLA: a second backend a user can name.


def __getattr__(name):  # built on first use: defining them imports vLLM
    if name in ("PlatformDefaultMLA", "ExplicitMLA"):
        cls = _mla_backend_named(name)
        cls.__module__ = __name__
        globals()[name] = cls
        return cls
    raise AttributeError(name)


def select_mla_backend(config_kwargs=None, kv_cache_dtype="fp8", block_size=64, dtype="bfloat16", model=None,
                       num_speculative_tokens=0):
    """The class vLLM's selector gives a dense MLA layer (head size 576) under a config made of kwargs: the
    attention config, the cache, the model dtype and, with `model` (a config.json folder), n-gram speculative
    decoding."""
    import torch
    from vllm.config import (AttentionConfig, CacheConfig, ModelConfig, SpeculativeConfig, VllmConfig,
                             set_current_vllm_config)
    from vllm.v1.attention.selector import get_attn_backend

    engine = {}
    if model is not None:
        engine["model_config"] = ModelConfig(model=model, skip_tokenizer_init=True, dtype=dtype, max_model_len=1024)
    if num_speculative_tokens:
        engine["speculative_config"] = SpeculativeConfig(method="ngram", num_speculative_tokens=num_speculative_tokens,
                                                         prompt_lookup_max=3, prompt_lookup_min=1)
    config = VllmConfig(attention_config=AttentionConfig(**(config_kwargs or {})),
                        cache_config=CacheConfig(block_size=block_size, cache_dtype=kv_cache_dtype), **engine)
    with set_current_vllm_config(config):
        return get_attn_backend(576, getattr(torch, dtype), kv_cache_dtype, use_mla=True, num_heads=16)


def _class_path(cls) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def worker_resolve_pickled_config(attention_config, result_queue):
    """Spawned-worker target: the config was unpickled before this runs, as in a vLLM worker."""
    result_queue.put(_class_path(attention_config.backend.get_class()))


def worker_resolve_from_environment(result_queue):
    """Spawned-worker target: start like a vLLM worker (load general plugins), then select for an MLA layer."""
    use_hopper_platform()
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    result_queue.put((os.environ.get("VLLM_ATTENTION_BACKEND"), _class_path(select_mla_backend())))
