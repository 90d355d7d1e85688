"""Serve a DeepSeek-V3/R1 checkpoint: tensor parallel 8, FP8 KV cache, MLA decode by cute-mla-fp8.

    python examples/serve_deepseek_tp8.py /models/DeepSeek-R1 --num-speculative-tokens 1
    python examples/serve_deepseek_tp8.py /models/DeepSeek-R1 --dry-run   # no GPU needed
    python examples/serve_deepseek_tp8.py deepseek-ai/DeepSeek-V3 --engine trtllm --dry-run

With --engine vllm (the default):
The real run hands over to `vllm serve` with the flags printed by --dry-run. --dry-run resolves, with vLLM's
own classes, what the engine will use: the backend class behind the name, the KV-cache block size, whether
the backend accepts the configuration on an H200 (with vLLM's reasons if not), and the CUDA-graph mode of
decode steps. Any other flag is passed on to `vllm serve` unchanged.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys

BACKEND = "CUTE_MLA_FP8"
TARGET_CAPABILITY = (9, 0)  # H200


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="path (or hub id) of a DeepSeek-V3/R1 checkpoint")
    parser.add_argument("--engine", choices=["vllm", "trtllm"], default="vllm")
    parser.add_argument("--tensor-parallel-size", type=int, default=8)
    parser.add_argument("--num-speculative-tokens", type=int, default=0,
                        help="MTP draft tokens per step (0: no speculative decoding)")
    parser.add_argument("--block-size", type=int, default=None, choices=[32, 64],
                        help="KV-cache page size (default: the backend's preference)")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--p-planes", type=int, choices=[1, 2], default=None,
                        help="e4m3 planes of the softmax probabilities in the P.V MMA where a request has more than "
                             "16 query rows (MTP, many heads per GPU): 1 is 7-13%% faster there for ~1e-2 relative "
                             "error instead of ~1e-3 (sets CUTE_MLA_P_PLANES; default 2)")
    parser.add_argument("--dry-run", action="store_true", help="print the resolved configuration and exit")
    return parser.parse_known_args(argv)


def backend_env(args):
    """Environment variables our kernels read in every rank process."""
    return {"CUTE_MLA_P_PLANES": str(args.p_planes)} if args.p_planes else {}


def serve_command(args, extra):
    command = ["vllm", "serve", args.model,
               "--tensor-parallel-size", str(args.tensor_parallel_size),
               "--kv-cache-dtype", "fp8",
               "--attention-backend", BACKEND,
               "--max-num-seqs", str(args.max_num_seqs)]
    if args.block_size:
        command += ["--block-size", str(args.block_size)]
    if args.num_speculative_tokens:
        command += ["--speculative-config",
                    json.dumps({"method": "mtp", "num_speculative_tokens": args.num_speculative_tokens})]
    return command + list(extra)


def resolve(args):
    """The engine configuration as vLLM will resolve it, without touching a GPU."""
    from vllm.config import AttentionConfig, CacheConfig, ModelConfig
    from vllm.platforms.interface import DeviceCapability
    from vllm.plugins import load_general_plugins

    load_general_plugins()  # what `vllm serve` does first: registers CUTE_MLA_FP8
    backend = AttentionConfig.validate_backend_before(BACKEND).get_class()
    model = ModelConfig(model=args.model, skip_tokenizer_init=True)
    block_size = args.block_size or backend.get_preferred_block_size(CacheConfig.DEFAULT_BLOCK_SIZE)
    reasons = backend.validate_configuration(
        head_size=model.get_head_size(), dtype=model.dtype, kv_cache_dtype="fp8", block_size=block_size,
        use_mla=model.use_mla, has_sink=False, use_sparse=False, use_mm_prefix=False,
        use_per_head_quant_scales=False, device_capability=DeviceCapability(*TARGET_CAPABILITY),
        attn_type="decoder")
    graph_support = backend.get_builder_cls()._cudagraph_support
    q_len = 1 + args.num_speculative_tokens
    return {
        "backend": f"{backend.__module__}.{backend.__qualname__}",
        "backend_name": backend.get_name(),
        "model": args.model,
        "heads_per_gpu": model.hf_text_config.num_attention_heads // args.tensor_parallel_size,
        "head_size": model.get_head_size(),
        "kv_cache_dtype": "fp8",
        "block_size": block_size,
        "tensor_parallel_size": args.tensor_parallel_size,
        "speculative": {"method": "mtp", "num_speculative_tokens": args.num_speculative_tokens}
        if args.num_speculative_tokens else None,
        "cudagraph_mode": "FULL_AND_PIECEWISE",
        "decode_graphs": f"full CUDA graphs for uniform decode batches of q_len {q_len} "
                         f"(builder support {graph_support.name})",
        "valid_on_sm90": not reasons,
        "invalid_reasons": reasons,
    }


def serve_trtllm(args) -> int:
    """trtllm-serve with TLLM_FMHA_LIBS=+cute_mla_fp8: the YAML it reads and the command line."""
    from mla_backend.integrations import trtllm

    config = trtllm.serve_config(args.model, tp_size=args.tensor_parallel_size,
                                 mtp_layers=args.num_speculative_tokens, max_batch_size=args.max_num_seqs,
                                 page_size=args.block_size or 64)
    config["env"].update(backend_env(args))
    yaml_text = trtllm.serve_yaml(config)
    if args.dry_run:
        print(trtllm.shell_command(config, yaml_text))
        return 0
    with open(config["config_path"], "w") as f:
        f.write(yaml_text)
    os.execvpe(config["command"][0], config["command"], {**os.environ, **config["env"]})


def main(argv=None) -> int:
    args, extra = parse_args(argv)
    if args.engine == "trtllm":
        return serve_trtllm(args)
    command = serve_command(args, extra)
    env = backend_env(args)
    if args.dry_run:
        config = resolve(args)
        print(json.dumps(config, indent=2))
        print("command: " + "".join(f"{key}={value} " for key, value in env.items()) + shlex.join(command))
        return 0 if config["valid_on_sm90"] else 1
    os.execvpe(command[0], command, {**os.environ, **env})


if __name__ == "__main__":
    sys.exit(main())
