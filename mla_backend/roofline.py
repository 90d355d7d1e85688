"""The fewest bytes and operations a decode step needs, and the time they imply on a GPU: the floor every benchmark
and the `plan` command compare against."""

from __future__ import annotations

from typing import Sequence, Tuple

from .shapes import KV_DIM, LATENT_DIM

# H200 ceilings measured by `python -m mla_backend bench` (docs/performance.md): streaming read 4.38-4.57 TB/s,
# cuBLAS FP8 GEMM 1325-1460 TFLOP/s. The bench measures its own; these are for estimates without a GPU.
H200_READ_BYTES_PER_S = 4.4e12
H200_FP8_FLOPS = 1.3e15


def step_bytes_and_flops(lengths: Sequence[int], num_heads: int, q_len: int) -> Tuple[int, int]:
    """DRAM bytes (each KV token read once; q read, out and lse written once per query row) and FP8 tensor FLOPs
    (Q.K over 576 and P.V over 512 per query row and visible token) of one decode step."""
    tokens = sum(lengths)
    rows = q_len * num_heads
    batch = len(lengths)
    bytes_moved = tokens * KV_DIM + batch * rows * (KV_DIM + LATENT_DIM * 2 + 4)
    flops = 2 * tokens * rows * (KV_DIM + LATENT_DIM)
    return bytes_moved, flops


def floor_seconds(bytes_moved: int, flops: int, read_bytes_per_s: float = H200_READ_BYTES_PER_S,
                  fp8_flops: float = H200_FP8_FLOPS) -> Tuple[float, str]:
    """The larger of the memory time and the tensor time, and which one it is ("memory" or "fp8 compute")."""
    memory, compute = bytes_moved / read_bytes_per_s, flops / fp8_flops
    return (memory, "memory") if memory >= compute else (compute, "fp8 compute")
