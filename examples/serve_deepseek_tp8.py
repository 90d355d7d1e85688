"""Serve a DeepSeek-V3/R1 checkpoint: tensor parallel 8, FP8 KV cache, MLA decode by cute-mla-fp8.

    python examples/serve_deepseek_tp8.py /models/DeepSeek-R1 --num-speculative-tokens 1
    python examples/serve_deepseek_tp8.py /models/DeepSeek-R1 --dry-run   # no GPU needed
    python examples/serve_deepseek_tp8.py deepseek-ai/DeepSeek-V3 --engine trtllm --dry-run

With --engine vllm (the default):
The real run hands over to `vllm serve` with the flags printed by --dry-run. Both first resolve, with vLLM's own
classes, what the engine will use: the backend class behind the name, the KV-cache block size, whether the backend
accepts the configuration on an H200 (the checks vLLM's selector runs, inside the engine configuration), and the
CUDA-graph mode of decode steps (vLLM's own resolver, for our metadata builder's graph support and the decode
query length). Any other flag is passed on to `vllm serve` unchanged.

What cannot run is refused with one line per reason and exit status 2: a model whose heads per GPU fall outside
8-128 or do not divide by the tensor-parallel size, block sizes other than 32 and 64, more than 7 draft tokens,
and whatever else the backend refuses (its own words).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys

from mla_backend.config import P_PRECISIONS
from mla_backend.shapes import MAX_HEADS, MIN_HEADS

BACKEND = "CUTE_MLA_FP8"
TARGET_CAPABILITY = (9, 0)  # H200
PROG = os.path.basename(__file__)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    parser.add_argument("model", help="path (or hub id) of a DeepSeek-V3/R1 checkpoint")
    parser.add_argument("--engine", choices=["vllm", "trtllm"], default="vllm")
    parser.add_argument("--tensor-parallel-size", type=int, default=8)
    parser.add_argument("--num-speculative-tokens", type=int, default=0,
                        help="MTP draft tokens per step (0: no speculative decoding; at most 7)")
    parser.add_argument("--block-size", type=int, default=None,
                        help="KV-cache page size, 32 or 64 (default: the backend's preference, 64)")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--p-precision", choices=P_PRECISIONS, default=None,
                        help="how the softmax probabilities enter the FP8 P.V MMA: fp8 (the default) keeps one e4m3 "
                             "plane where a request has more than 16 query rows (MTP, many heads per GPU), ~3-9e-3 "
                             "relative error; fp8x2 two planes everywhere, the bf16 output's own rounding, up to "
                             "twice the P.V work (vLLM: --additional-config; TensorRT-LLM: CUTE_MLA_P_PRECISION)")
    parser.add_argument("--dry-run", action="store_true", help="print the resolved configuration and exit")
    return parser.parse_known_args(argv)


def refuse(reasons) -> int:
    for reason in reasons:
        print(f"{PROG}: {reason}", file=sys.stderr)
    return 2


def heads_refusals(args, total_heads: int):
    """What our kernels cannot run of this model at this tensor-parallel size."""
    tp = args.tensor_parallel_size
    if tp < 1 or total_heads % tp:
        return [f"--tensor-parallel-size {tp} does not divide the model's {total_heads} attention heads"]
    per_gpu = total_heads // tp
    if not MIN_HEADS <= per_gpu <= MAX_HEADS:
        return [f"{per_gpu} attention heads per GPU ({total_heads} over --tensor-parallel-size {tp}): the kernels take "
                f"{MIN_HEADS} to {MAX_HEADS} heads per GPU"]
    return []


# ------------------------------------------------------------------------------------------------------ vLLM
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
    if args.p_precision:
        command += ["--additional-config", json.dumps({"cute_mla_fp8": {"p_precision": args.p_precision}})]
    return command + list(extra)


def optimization_level(extra, default):
    """vLLM's -O level among the flags passed through (-O3, -O 3, --optimization-level[=]3), else `default`."""
    from vllm.config.vllm import OptimizationLevel

    for i, flag in enumerate(extra):
        value = None
        if flag.startswith("-O") and flag[2:].isdigit():
            value = flag[2:]
        elif flag in ("-O", "--optimization-level") and i + 1 < len(extra):
            value = extra[i + 1]
        elif flag.startswith("--optimization-level="):
            value = flag.split("=", 1)[1]
        if value is not None and value.isdigit():
            return OptimizationLevel(int(value))
    return default


def resolve_cudagraph_mode(backend, q_len, extra):
    """(requested, resolved) CUDA-graph modes, by vLLM's resolver (CompilationConfig.resolve_cudagraph_mode_and_sizes,
    as Model Runner V2 calls it after the KV cache exists) for our builder's graph support and decode q_len. The
    request is vLLM's default for the -O level, or NONE with --enforce-eager."""
    import vllm.envs as envs
    from vllm.config import CompilationConfig, ParallelConfig, VllmConfig
    from vllm.config.compilation import CompilationMode, CUDAGraphMode
    from vllm.config.vllm import OPTIMIZATION_LEVEL_TO_CONFIG, OptimizationLevel

    level = optimization_level(extra, VllmConfig.__dataclass_fields__["optimization_level"].default)
    requested = OPTIMIZATION_LEVEL_TO_CONFIG[level]["compilation_config"]["cudagraph_mode"]
    if "--enforce-eager" in extra:
        requested = CUDAGraphMode.NONE
    mode = CompilationMode.VLLM_COMPILE if level > OptimizationLevel.O0 else CompilationMode.NONE
    compilation = CompilationConfig(mode=mode, cudagraph_mode=requested)
    compilation.set_splitting_ops_for_v1(all2all_backend=ParallelConfig().all2all_backend)
    use_v2 = envs.VLLM_USE_V2_MODEL_RUNNER is not False  # the default runner of vLLM 0.33 on a GPU host
    resolved = compilation.resolve_cudagraph_mode_and_sizes(
        backend.get_builder_cls()._cudagraph_support, backend.get_name(), uniform_decode_query_len=q_len,
        use_v2_model_runner=use_v2, piecewise_capture_available=mode == CompilationMode.VLLM_COMPILE)
    return requested, resolved, "V2" if use_v2 else "V1"


def resolve(args, extra):
    """(the engine configuration as vLLM will resolve it, reasons it cannot run), without touching a GPU."""
    from vllm.config import (AttentionConfig, CacheConfig, DeviceConfig, ModelConfig, ParallelConfig,
                             SpeculativeConfig, VllmConfig, set_current_vllm_config)
    from vllm.platforms.interface import DeviceCapability
    from vllm.plugins import load_general_plugins

    from mla_backend.integrations.vllm.backend import configured_p_precision, decode_query_len

    load_general_plugins()  # what `vllm serve` does first: registers CUTE_MLA_FP8
    backend = AttentionConfig.validate_backend_before(BACKEND).get_class()
    model = ModelConfig(model=args.model, skip_tokenizer_init=True)
    total_heads = model.model_arch_config.total_num_attention_heads
    reasons = heads_refusals(args, total_heads)
    if reasons:
        return None, reasons
    block_size = args.block_size or backend.get_preferred_block_size(CacheConfig.DEFAULT_BLOCK_SIZE)
    parallel = ParallelConfig(tensor_parallel_size=args.tensor_parallel_size)
    speculative = None
    if args.num_speculative_tokens:
        speculative = SpeculativeConfig(method="mtp", num_speculative_tokens=args.num_speculative_tokens,
                                        target_model_config=model, target_parallel_config=parallel)
    additional = {"cute_mla_fp8": {"p_precision": args.p_precision}} if args.p_precision else {}
    try:
        device = DeviceConfig()
    except RuntimeError:  # no GPU platform here: name a device, so the configuration can be built (checks: H200's)
        device = DeviceConfig(device="cpu")
    engine = VllmConfig(model_config=model, cache_config=CacheConfig(block_size=block_size, cache_dtype="fp8"),
                        parallel_config=parallel, speculative_config=speculative, additional_config=additional,
                        device_config=device)
    with set_current_vllm_config(engine):  # as vLLM's selector validates
        reasons = backend.validate_configuration(
            head_size=model.get_head_size(), dtype=model.dtype, kv_cache_dtype="fp8", block_size=block_size,
            use_mla=model.use_mla, has_sink=False, use_sparse=False, use_mm_prefix=False,
            use_per_head_quant_scales=False, device_capability=DeviceCapability(*TARGET_CAPABILITY),
            attn_type="decoder")
    if reasons:
        return None, reasons
    q_len = decode_query_len(engine)
    requested, resolved, runner = resolve_cudagraph_mode(backend, q_len, extra)
    graph_support = backend.get_builder_cls()._cudagraph_support
    return {
        "backend": f"{backend.__module__}.{backend.__qualname__}",
        "backend_name": backend.get_name(),
        "model": args.model,
        "heads_per_gpu": total_heads // args.tensor_parallel_size,
        "head_size": model.get_head_size(),
        "kv_cache_dtype": "fp8",
        "block_size": block_size,
        "tensor_parallel_size": args.tensor_parallel_size,
        "speculative": {"method": "mtp", "num_speculative_tokens": args.num_speculative_tokens}
        if args.num_speculative_tokens else None,
        "decode_q_lens": list(range(1, q_len + 1)),
        "p_precision": configured_p_precision(engine),
        "model_runner": runner,
        "cudagraph_mode_requested": requested.name,
        "cudagraph_mode": resolved.name,
        "decode_graphs": f"{resolved.decode_mode().name} CUDA graphs for uniform decode batches of q_len {q_len} "
                         f"(builder support {graph_support.name})",
    }, []


def serve_vllm(args, extra) -> int:
    command = serve_command(args, extra)
    config, reasons = resolve(args, extra)
    if reasons:
        return refuse(reasons)
    if args.dry_run:
        print(json.dumps(config, indent=2))
        print("command: " + shlex.join(command))
        return 0
    os.execvp(command[0], command)


# ------------------------------------------------------------------------------------------------ TensorRT-LLM
def local_heads(model):
    """num_attention_heads of a local checkpoint's config.json (None for a hub id: nothing is downloaded)."""
    path = os.path.join(model, "config.json")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f).get("num_attention_heads")


def serve_trtllm(args) -> int:
    """trtllm-serve with TLLM_FMHA_LIBS=+cute_mla_fp8: the YAML it reads and the command line."""
    from mla_backend.integrations import trtllm

    total_heads = local_heads(args.model)
    reasons = heads_refusals(args, total_heads) if total_heads is not None else []
    if reasons:
        return refuse(reasons)
    try:
        config = trtllm.serve_config(args.model, tp_size=args.tensor_parallel_size,
                                     mtp_layers=args.num_speculative_tokens, max_batch_size=args.max_num_seqs,
                                     page_size=args.block_size or 64, p_precision=args.p_precision)
    except ValueError as error:
        return refuse([str(error)])
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
    return serve_vllm(args, extra)


if __name__ == "__main__":
    sys.exit(main())
