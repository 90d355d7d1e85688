"""TensorRT-LLM integration: our FP8 MLA decode kernels as the `cute_mla_fp8` FMHA library.

Importing this module makes `cute_mla_fp8` a known FMHA library name in this process: at once if
TensorRT-LLM's FMHA registry is loaded, else the moment it is. It does not enable anything: TensorRT-LLM
uses it only when `TLLM_FMHA_LIBS` names it (`TLLM_FMHA_LIBS=+cute_mla_fp8`). Remove the variable and
TensorRT-LLM builds the libraries it always did. See docs/trtllm.md.
"""

from .library import (LIBRARY_NAME, StepPlans, call_refusal, layer_refusal, make_library_class,
                      make_unavailable_class, run_generation)
from .registry import (SUPPORTED_REVISIONS, capability_refusal, is_registered, register, register_when_imported,
                       remove_import_hook, unregister)
from .serve import ENABLE_VALUE, PTH_LINE, serve_config, serve_yaml, shell_command
from .translate import DecodeArgs, LayoutRefused, ScaleBuffers, decode_args, kv_pool_view

TESTED_AGAINST = "NVIDIA/TensorRT-LLM main, registry.py @ 241e6ec8e400abef3c9971fc036d6f2cd1cec103"

register_when_imported()

__all__ = [
    "LIBRARY_NAME", "ENABLE_VALUE", "PTH_LINE", "SUPPORTED_REVISIONS", "TESTED_AGAINST", "DecodeArgs",
    "LayoutRefused", "ScaleBuffers", "StepPlans", "call_refusal", "capability_refusal", "decode_args",
    "is_registered", "kv_pool_view", "layer_refusal", "make_library_class", "make_unavailable_class", "register",
    "register_when_imported", "remove_import_hook", "run_generation", "serve_config", "serve_yaml",
    "shell_command", "unregister",
]
