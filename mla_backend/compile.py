"""Ahead-of-time compilation of the whole decode path for one static shape, with or without a GPU.

`python -m mla_backend compile --arch sm_90a --heads 12 --q-len 1 --page-size 32` runs this. CI uses it so a
kernel that no longer compiles fails on a CPU machine.
"""

from __future__ import annotations

import os
import time

from .planner import DEFAULT_TILE_TOKENS

SUPPORTED_ARCHS = ("sm_90a",)


def compile_decode_path(*, arch: str, num_heads: int, q_len: int, page_size: int, causal: bool = True,
                        tile_tokens: int = DEFAULT_TILE_TOKENS, max_batch: int = 256):
    """Compile the decode and combine kernels for a static key; returns report lines."""
    if arch not in SUPPORTED_ARCHS:
        raise ValueError(f"arch must be one of {SUPPORTED_ARCHS}, got {arch!r}")
    # CuTe DSL picks code paths from the target arch, and on a machine without a GPU defaults to sm_100a.
    os.environ["CUTE_DSL_ARCH"] = arch
    from .hopper.combine_sm90 import compile_combine_sm90
    from .hopper.decode_sm90 import compile_decode_sm90
    from .hopper.plan_splits_sm90 import compile_plan_splits_sm90
    from .planner import DEFAULT_SEGMENT_OVERHEAD, H200_SMS

    lines = []
    start = time.perf_counter()
    compile_decode_sm90(num_heads, q_len, page_size, tile_tokens, causal, arch=arch)
    lines.append(f"decode  {arch} heads={num_heads} q_len={q_len} page={page_size} tile={tile_tokens} "
                 f"causal={causal}: {time.perf_counter() - start:.1f} s")
    start = time.perf_counter()
    compile_combine_sm90(q_len * num_heads)
    lines.append(f"combine {arch} rows={q_len * num_heads}: {time.perf_counter() - start:.1f} s")
    start = time.perf_counter()
    compile_plan_splits_sm90(max_batch, H200_SMS, tile_tokens, DEFAULT_SEGMENT_OVERHEAD)
    lines.append(f"planner {arch} max_batch={max_batch} ctas={H200_SMS}: {time.perf_counter() - start:.1f} s")
    return lines
