"""FP8 wgmma throughput on one Hopper GPU as a function of N, with A from shared memory (SS) or registers (RS).

    python benchmarks/bench_wgmma_sm90.py                  # N in 16..256, SS and RS, 1 and 2 warpgroups
    python benchmarks/bench_wgmma_sm90.py --n 48 --n 96 --iters 4000
    python benchmarks/bench_wgmma_sm90.py --uninitialized   # operands: whatever shared memory holds

The decode kernel's MMAs are m64 x N x k32 with N = the query rows of a block (16-64): S^T = K.Q^T from shared
memory (SS) and O^T += V^T.P^T with V^T in registers (RS). Whether such narrow wgmmas reach the tensor cores' peak
decides between keeping the rows in N and moving them to M (docs/performance.md). Each CTA (one per SM) runs
`iters` groups of `ksteps` back-to-back wgmmas on one accumulator per warpgroup, one commit and wait per group.
The operands are pseudo-random e4m3 bytes (a hash of the position, no NaN codes): tensor-core power, and with it
the clock the GPU holds, depends on how many operand bits toggle, so zeros would overstate the rate that random
data (the GEMM ceiling, real KV) gets; `--uninitialized` skips the fill. Reported: TFLOP/s over
all SMs, the share of the dense FP8 peak measured in the same run (`torch._scaled_mm`, 8192^3, the step bench's
ceiling: `mla_backend.bench.ceilings.measure_fp8_flops`), and SM cycles
per wgmma per warpgroup at the clock the caller gives (`--clock-ghz`, default 1.755).
"""

from __future__ import annotations

import argparse
import sys

import cutlass
import cutlass.cute as cute
import cutlass.memory
from cutlass import Float32, Int32

from mla_backend.hopper.launch import cuda_stream, gmem_ptr
from mla_backend.hopper.ptx import (fence_operand, fence_proxy_async_smem, wgmma_commit, wgmma_fence, wgmma_rs_e4m3,
                                    wgmma_ss_e4m3, wgmma_wait)
from mla_backend.jit_cache import compile_kernel

FP8 = cutlass.Float8E4M3FN
N_VALUES = (16, 24, 32, 48, 64, 96, 128, 256)


class WgmmaThroughput:
    """m64 x n x k32 e4m3 wgmmas in a loop: `warpgroups` warpgroups per CTA, A from shared memory or registers."""

    def __init__(self, n: int, rs: bool, warpgroups: int, ksteps: int = 16, fill: bool = True):
        if n % 8 or not 8 <= n <= 256:
            raise ValueError(f"n must be a multiple of 8 in [8, 256], got {n}")
        if warpgroups not in (1, 2):
            raise ValueError(f"warpgroups must be 1 or 2, got {warpgroups}")
        self.n, self.rs, self.warpgroups, self.ksteps, self.fill = n, bool(rs), warpgroups, ksteps, bool(fill)

    @cute.jit
    def __call__(self, p_out: cute.Pointer, iters: Int32, num_ctas: Int32, stream):
        threads = 128 * self.warpgroups
        mOut = cute.make_tensor(p_out, cute.make_layout((threads, num_ctas)))

        @cute.struct
        class SharedStorage:
            a: cute.struct.Align[cute.struct.MemRange[FP8, 64 * 128], 1024]  # A: 64 rows x 128 bytes
            b: cute.struct.Align[cute.struct.MemRange[FP8, 256 * 128], 1024]  # B: up to 256 rows x 128 bytes

        self.kernel(mOut, iters, SharedStorage).launch(grid=(num_ctas, 1, 1), block=(threads, 1, 1), stream=stream)

    @cute.kernel
    def kernel(self, mOut: cute.Tensor, iters: Int32, SharedStorage: cutlass.Constexpr):
        NA = self.n // 2
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        storage = cutlass.memory.SmemAllocator().allocate(SharedStorage)
        a_addr = storage.a.data_ptr().toint()
        b_addr = storage.b.data_ptr().toint()
        # pseudo-random operands: byte i = bits 24-31 of i * 2654435761, with the NaN codes 0x7F / 0xFF cleared
        sA = storage.a.get_tensor(cute.make_layout((64 * 128,)))
        sB = storage.b.get_tensor(cute.make_layout((256 * 128,)))
        sA32 = cute.make_tensor(cute.recast_ptr(sA.iterator, dtype=Int32), cute.make_layout((64 * 32,)))
        sB32 = cute.make_tensor(cute.recast_ptr(sB.iterator, dtype=Int32), cute.make_layout((256 * 32,)))
        if cutlass.const_expr(self.fill):
            threads = 128 * self.warpgroups
            for w in range(tidx, 64 * 32 + 256 * 32, threads):
                word = Int32(0)
                for byte in cutlass.range_constexpr(4):
                    v = ((w * 4 + byte) * Int32(-1640531535)) >> 24  # 2654435761 as int32
                    v = v & 0x77  # never 0x7F / 0xFF (e4m3 NaN)
                    word = word | (v << (8 * byte))
                if w < 64 * 32:
                    sA32[w] = word
                else:
                    sB32[w - 64 * 32] = word
            fence_proxy_async_smem()  # generic-proxy writes -> the wgmma operand reads
            cute.arch.barrier()
        acc = cute.make_rmem_tensor(cute.make_layout((NA,)), Float32)
        acc.fill(0.0)
        a_regs = tuple(((tidx * 4 + j) * Int32(-1640531535)) & 0x77777777 for j in range(4))  # A from registers
        for _ in range(iters):
            wgmma_fence()
            for k in cutlass.range_constexpr(self.ksteps):
                koff = (k % 4) * 32  # the k32 steps of one 128-byte swizzled row block
                if cutlass.const_expr(self.rs):
                    d = wgmma_rs_e4m3(a_regs, b_addr + (k % 2) * 256, 128, 512, [acc[i] for i in range(NA)])
                else:
                    d = wgmma_ss_e4m3(a_addr + koff, b_addr + koff, [acc[i] for i in range(NA)], 1)
                for i in cutlass.range_constexpr(NA):
                    acc[i] = d[i]
            wgmma_commit()
            wgmma_wait(0)
            for i in cutlass.range_constexpr(NA):
                acc[i] = fence_operand(acc[i])
        total = Float32(0.0)
        for i in cutlass.range_constexpr(NA):
            total = total + acc[i]
        mOut[tidx, bidx] = total


def compile_wgmma_throughput(n: int, rs: bool, warpgroups: int, ksteps: int = 16, fill: bool = True,
                             arch: str = "sm_90a"):
    """Compile (no GPU needed) and return the launcher: fn(out_ptr, iters, num_ctas, stream)."""
    op = WgmmaThroughput(n, rs, warpgroups, ksteps, fill)
    return compile_kernel(op, (gmem_ptr(Float32, 4), Int32(1), Int32(1), cuda_stream()), arch)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, action="append", default=[], help="N of the wgmma (repeatable)")
    p.add_argument("--iters", type=int, default=2000)
    p.add_argument("--ksteps", type=int, default=16, help="wgmmas per commit / wait group")
    p.add_argument("--clock-ghz", type=float, default=1.755, help="SM clock for the cycles column")
    p.add_argument("--uninitialized", action="store_true", help="leave the operands as shared memory holds them")
    args = p.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("needs a CUDA GPU (Hopper)", file=sys.stderr)
        return 2
    from mla_backend.bench.ceilings import measure_fp8_flops

    peak = measure_fp8_flops()
    num_ctas = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"FP8 GEMM {peak / 1e12:.0f} TFLOP/s; {num_ctas} CTAs, {args.ksteps} wgmmas per group, {args.iters} groups, "
          f"operands {'uninitialized' if args.uninitialized else 'pseudo-random'}")
    print("| N | A | warpgroups | TFLOP/s | share of the GEMM | SM cycles per wgmma per warpgroup |")
    print("| ---: | --- | ---: | ---: | ---: | ---: |")
    for n in args.n or N_VALUES:
        for rs in (False, True):
            for wgs in (1, 2):
                fn = compile_wgmma_throughput(n, rs, wgs, args.ksteps, fill=not args.uninitialized)
                out = torch.empty(128 * wgs, num_ctas, device="cuda")
                launch = lambda: fn(gmem_ptr(Float32, 4, out.data_ptr()), Int32(args.iters), Int32(num_ctas),  # noqa
                                    cuda_stream(torch.cuda.current_stream()))
                launch()
                torch.cuda.synchronize()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                launch()
                end.record()
                end.synchronize()
                seconds = start.elapsed_time(end) * 1e-3
                wgmmas = args.iters * args.ksteps  # per warpgroup
                flops = num_ctas * wgs * wgmmas * 64 * n * 32 * 2
                cycles = seconds * args.clock_ghz * 1e9 / (wgmmas * wgs)
                print(f"| {n} | {'registers' if rs else 'shared'} | {wgs} | {flops / seconds / 1e12:.0f} "
                      f"| {flops / seconds / peak:.2f} | {cycles:.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
