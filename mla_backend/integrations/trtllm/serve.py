"""The trtllm-serve configuration for DeepSeek with our MLA decode: what examples/serve_deepseek_tp8.py
prints for `--engine trtllm --dry-run`, and what docs/trtllm.md shows.

The switch is one environment variable, spelled the way TensorRT-LLM spells FMHA library choices. It goes
in the launching shell (every MPI rank inherits it, and our package's startup line imports the
integration in each rank that has it) and, for the record in the config file, in `env_overrides`, which
TensorRT-LLM's worker_main applies in every rank before the model is built.
"""

from __future__ import annotations

import shlex
from typing import Any, Dict, List, Optional

from mla_backend.config import P_PRECISION_ENV, check_p_precision
from mla_backend.shapes import MAX_Q_LEN, SUPPORTED_PAGE_SIZES

from .library import LIBRARY_NAME

ENV_VAR = "TLLM_FMHA_LIBS"
ENABLE_VALUE = "+" + LIBRARY_NAME
# One line for a `cute_mla_fp8.pth` in site-packages: runs at every interpreter start, imports nothing
# unless the switch is set, so MPI-spawned TensorRT-LLM ranks register the library before building a model.
PTH_LINE = ('import os; "' + LIBRARY_NAME + '" in os.environ.get("' + ENV_VAR
            + '", "") and __import__("mla_backend.integrations.trtllm")')


def serve_config(model: str = "deepseek-ai/DeepSeek-V3", *, tp_size: int = 8, mtp_layers: int = 0,
                 max_batch_size: int = 128, max_num_tokens: int = 8192, page_size: int = 64,
                 free_gpu_memory_fraction: float = 0.85, config_path: str = "cute_mla_fp8_trtllm.yaml",
                 host: str = "0.0.0.0", port: int = 8000, enable: bool = True,
                 p_precision: Optional[str] = None) -> Dict[str, Any]:
    """The trtllm-serve invocation for DeepSeek (PyTorch backend, FP8 KV cache, TP, optional MTP).

    Returns {"env": {...}, "yaml": {...}, "config_path": str, "command": [argv]}. With enable=False it is the
    same server on TensorRT-LLM's own kernels: the only difference is the `TLLM_FMHA_LIBS` entry. `p_precision`
    ("fp8", "fp8x2"; None: the kernels' default) is exported as CUTE_MLA_P_PRECISION, which every rank reads.
    Raises ValueError, in one line, for what our library would decline on every generation step.
    """
    if page_size not in SUPPORTED_PAGE_SIZES:
        raise ValueError(f"tokens_per_block {page_size} is not supported: {LIBRARY_NAME} pages hold "
                         f"{' or '.join(map(str, SUPPORTED_PAGE_SIZES))} tokens")
    if not 0 <= mtp_layers < MAX_Q_LEN:
        raise ValueError(f"{mtp_layers} MTP layers make generation queries of {mtp_layers + 1} tokens: "
                         f"{LIBRARY_NAME} decodes at most {MAX_Q_LEN} query tokens per request (at most "
                         f"{MAX_Q_LEN - 1} MTP layers)")
    if p_precision is not None:
        check_p_precision(p_precision, P_PRECISION_ENV)
    yaml_config: Dict[str, Any] = {
        "kv_cache_config": {
            "dtype": "fp8",
            "tokens_per_block": page_size,
            "free_gpu_memory_fraction": free_gpu_memory_fraction,
        },
        "cuda_graph_config": {"enable_padding": True, "max_batch_size": max_batch_size},
        "enable_attention_dp": False,
    }
    if mtp_layers:
        yaml_config["speculative_config"] = {"decoding_type": "MTP", "num_nextn_predict_layers": mtp_layers}
    env: Dict[str, str] = {}
    if enable:
        env[ENV_VAR] = ENABLE_VALUE
        if p_precision is not None:
            env[P_PRECISION_ENV] = p_precision
        yaml_config["env_overrides"] = dict(env)
    command: List[str] = [
        "trtllm-serve", model,
        "--backend", "pytorch",
        "--tp_size", str(tp_size),
        "--max_batch_size", str(max_batch_size),
        "--max_num_tokens", str(max_num_tokens),
        "--host", host, "--port", str(port),
        "--extra_llm_api_options", config_path,
    ]
    return {"env": env, "yaml": yaml_config, "config_path": config_path, "command": command}


def serve_yaml(config: Dict[str, Any]) -> str:
    """The YAML file text for `serve_config(...)["yaml"]` (no PyYAML needed: the values are plain)."""
    lines: List[str] = []

    def emit(mapping: Dict[str, Any], indent: int) -> None:
        for key, value in mapping.items():
            if isinstance(value, dict):
                lines.append(" " * indent + f"{key}:")
                emit(value, indent + 2)
            else:
                lines.append(" " * indent + f"{key}: {_scalar(value)}")

    emit(config["yaml"], 0)
    return "\n".join(lines) + "\n"


def _scalar(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return str(value)
    text = str(value)
    return f'"{text}"' if not text.replace("_", "").replace("-", "").isalnum() else text


def shell_command(config: Dict[str, Any], yaml_text: Optional[str] = None) -> str:
    """A copy-pasteable shell snippet: write the YAML, export the switch, start the server."""
    parts = []
    if yaml_text is not None:
        parts.append(f"cat > {shlex.quote(config['config_path'])} <<'EOF'\n{yaml_text}EOF")
    env = " ".join(f"{key}={shlex.quote(value)}" for key, value in config["env"].items())
    parts.append((env + " " if env else "") + " ".join(shlex.quote(arg) for arg in config["command"]))
    return "\n".join(parts)
