"""Greedy generation with a real vLLM CPU engine; prints one JSON line. Run as a script, one engine per process.

usage: e2e_generate.py CHECKPOINT {vllm_cpu_mla,cute_mla_fp8,cute_mla_fp8_broken}
"""

import json
import os
import sys

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # in-process engine: the registry override applies to it

PROMPTS = [[5, 17, 250, 3, 99, 14, 7, 300], list(range(20, 90)), [900, 1, 2, 800, 33, 33, 512, 77, 640, 12, 3]]
MAX_TOKENS = 8


def main(checkpoint: str, backend: str) -> None:
    ours = backend.startswith("cute_mla_fp8")
    if ours:
        import vllm_e2e_cpu

        vllm_e2e_cpu.install(broken=backend.endswith("broken"))
    from vllm import LLM, SamplingParams

    llm = LLM(model=checkpoint, skip_tokenizer_init=True, enforce_eager=True, max_model_len=1024,
              gpu_memory_utilization=0.2, distributed_executor_backend="uni", dtype="bfloat16", seed=0,
              # Named: on a CPU with AMX, vLLM's CPU platform takes AMX_MLA (bf16 cache only) unless CPU_MLA is
              # asked for; the CPU_MLA entry is ours in the cute_mla_fp8 runs (vllm_e2e_cpu.install).
              attention_backend="CPU_MLA",
              # vLLM's CPU MLA reads a bf16 cache only; ours reads FP8.
              kv_cache_dtype="fp8" if ours else "auto")
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                           SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
    result = {"tokens": [list(o.outputs[0].token_ids) for o in outputs]}
    if ours:
        result["forward_mqa_calls"] = vllm_e2e_cpu.FORWARD_MQA_CALLS[0]
        result["max_error"] = vllm_e2e_cpu.MAX_ERROR[0]
        result["allocations"] = vllm_e2e_cpu.ALLOCATIONS[0]
        result["allocations_at_first_decode"] = vllm_e2e_cpu.ALLOCATIONS_AT_FIRST_DECODE[0]
        result["block_size"] = llm.llm_engine.vllm_config.cache_config.block_size
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
