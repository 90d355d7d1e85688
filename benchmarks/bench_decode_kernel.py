"""The SM90 decode kernel alone (no planner, no combine, no graph): one case, median of CUDA-event timings.

    python benchmarks/bench_decode_kernel.py --heads 12 --q-len 1 --page 32 --kv 1048576 --batch 4

For A/B experiments on the kernel itself; `python -m mla_backend bench` is the step-time benchmark.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

KV_DIM, LATENT_DIM = 576, 512


def _time_once(fn) -> float:
    """GPU seconds of one fn() call. A ~200 us spin kernel goes first so that the GPU is still busy while the host
    enqueues the start event, the launch and the end event: otherwise the host's launch overhead (tens to
    hundreds of us of Python before the kernel reaches the GPU) would be timed too."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(400_000)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e-3


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--q-len", type=int, default=1)
    p.add_argument("--page", type=int, default=32)
    p.add_argument("--kv", type=int, default=1 << 20, help="KV tokens per request")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--reps", type=int, default=50)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU (Hopper)", file=sys.stderr)
        return 2
    from mla_backend import DecodeWorkspace, SplitPlan, plan_splits
    from mla_backend.hopper.decode_sm90 import run_decode_sm90

    torch.manual_seed(0)
    lengths = [args.kv] * args.batch
    pages_per = [-(-n // args.page) for n in lengths]
    num_pages = sum(pages_per) + 1
    kv = torch.empty(num_pages, args.page, KV_DIM, dtype=torch.uint8, device="cuda")
    kv.random_(0, 256)
    kv[(kv & 0x7F) == 0x7F] = 0  # no E4M3 NaN codes
    kv = kv.view(torch.float8_e4m3fn)
    block_table = torch.zeros(args.batch, max(pages_per), dtype=torch.int32, device="cuda")
    perm = torch.randperm(num_pages - 1, device="cuda").int()
    used = 0
    for b, n in enumerate(pages_per):
        block_table[b, :n] = perm[used:used + n]
        used += n
    seq_lens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    q = torch.randn(args.batch, args.q_len, args.heads, KV_DIM, device="cuda").to(torch.float8_e4m3fn)
    q_scale = torch.tensor([0.05], device="cuda")
    k_scale = torch.tensor([0.05], device="cuda")
    out = torch.empty(args.batch, args.q_len, args.heads, LATENT_DIM, dtype=torch.bfloat16, device="cuda")
    lse = torch.empty(args.batch, args.q_len, args.heads, device="cuda")
    plan = SplitPlan.empty(args.batch, torch.cuda.get_device_properties(0).multi_processor_count, device="cuda")
    plan_splits(seq_lens, q_len=args.q_len, num_heads=args.heads, page_size=args.page, out=plan)
    ws = DecodeWorkspace.for_plan(plan, args.q_len, args.heads)

    def decode():
        run_decode_sm90(q, kv, block_table, seq_lens, KV_DIM ** -0.5, q_scale, k_scale, plan, out, lse,
                        ws.partial_out, ws.partial_lse)

    # Warm up for ~0.3 s: an idle H200 sits at 345 MHz and needs a few milliseconds to reach its full clock.
    decode()
    torch.cuda.synchronize()
    for _ in range(max(1, int(0.3 / max(_time_once(decode), 1e-6)))):
        decode()
    torch.cuda.synchronize()
    times = [_time_once(decode) for _ in range(args.reps)]
    t = statistics.median(times)
    kv_bytes = sum(lengths) * KV_DIM
    print(f"H{args.heads} q{args.q_len} page {args.page} {args.kv} x B{args.batch}: decode {t * 1e6:.1f} us, "
          f"{kv_bytes / t / 1e12:.2f} TB/s of KV")
    return 0


if __name__ == "__main__":
    sys.exit(main())
