"""The two ceilings of a GPU, measured in the bench's own run: streaming DRAM read bandwidth and FP8 GEMM rate."""

from __future__ import annotations

import torch

# bench used until 2026-12-01 e (4, 4096, 4) reads at 4.16 TB/s on the H200, while these three read at 4.47-4.48
# (a sweep of 150 shapes, docs/performance.md "The floor's read bandwidth"), and the decode kernel itself read the
# KV of the largest steps at ~4.42: a ceiling below what a kernel achieves is not a ceiling.
READ_SHAPES = ((8, 4096, 4), (4, 8192, 8), (2, 16384, 16))


_READ_KERNEL = []


def _read_kernel():
    """A Triton kernel summing int32 words of x, grid-strided (built once, on first use: Triton is imported only
    where a GPU runs the bench)."""
    if not _READ_KERNEL:
        import triton
        import triton.language as tl

        @triton.jit
        def read_all(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
            pid = tl.program_id(0)
            step = tl.num_programs(0) * BLOCK
            acc = tl.zeros([BLOCK], dtype=tl.int32)
            for start in range(pid * BLOCK, n, step):
                offs = start + tl.arange(0, BLOCK)
                acc += tl.load(x_ptr + offs, mask=offs < n, other=0, cache_modifier=".cg")
            tl.store(out_ptr + pid * BLOCK + tl.arange(0, BLOCK), acc)

        _READ_KERNEL.append(read_all)
    return _READ_KERNEL[0]


def streaming_read(x: torch.Tensor, shape):
    """A function that launches the streaming-read kernel of `shape` = (programs per SM, int32 per block, warps)
    over the int32 tensor x (its output buffer allocated here, once)."""
    per_sm, block, warps = shape
    read_all = _read_kernel()
    grid = torch.cuda.get_device_properties(x.device).multi_processor_count * per_sm
    out = torch.empty(grid * block, dtype=torch.int32, device=x.device)
    n = x.numel()
    return lambda: read_all[(grid,)](x, out, n, BLOCK=block, num_warps=warps)


def streaming_read_rate(x: torch.Tensor, shape, rep_ms: int = 300) -> float:
    """Bytes per second at which the streaming-read kernel of `shape` reads the int32 tensor x (median of
    triton's do_bench)."""
    import triton

    ms = triton.testing.do_bench(streaming_read(x, shape), warmup=50, rep=rep_ms, return_mode="median")
    return x.numel() * 4 / (ms * 1e-3)


def measure_read_bandwidth(gib: float = 4.0) -> float:
    """Bytes per second of a streaming read over a buffer >> L2: the best of READ_SHAPES."""
    x = torch.randint(-100, 100, (int(gib * (1 << 30)) // 4,), dtype=torch.int32, device="cuda")
    best = max(streaming_read_rate(x, shape) for shape in READ_SHAPES)
    del x
    return best


def measure_fp8_flops(size: int = 8192) -> float:
    """FP8 E4M3 GEMM FLOP/s through torch._scaled_mm on random data, the better of cuBLAS's two accumulation modes
    (fast accumulation skips the periodic fp32 promotion: 1284 against 1256 TFLOP/s in one H200 run)."""
    import triton

    a = torch.randn(size, size, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(size, size, device="cuda").to(torch.float8_e4m3fn).t()
    one = torch.ones((), device="cuda")
    best = 0.0
    for fast_accum in (False, True):
        ms = triton.testing.do_bench(lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16,
                                                              use_fast_accum=fast_accum),
                                     warmup=50, rep=300, return_mode="median")
        best = max(best, 2 * size ** 3 / (ms * 1e-3))
    return best
