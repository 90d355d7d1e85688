"""Which shape of the bench's streaming-read kernel reads DRAM fastest (the read ceiling's sweep).

    python benchmarks/bench_read_bandwidth.py            # every shape, the best 25 printed
    python benchmarks/bench_read_bandwidth.py --repeat 3 # READ_SHAPES and the old single shape, 3 times each

The step bench's read ceiling (`mla_backend.bench.ceilings.measure_read_bandwidth`) takes the best of READ_SHAPES, which this sweep picked on the H200
(docs/performance.md, "The floor's read bandwidth"): a shape with too few bytes of loads in flight per SM
measures its own latency-bound rate, not the DRAM's.
"""

from __future__ import annotations

import argparse
import itertools
import sys

from mla_backend.bench.ceilings import READ_SHAPES

OLD_SHAPE = (4, 4096, 4)  # the bench's only shape until 2026-12-01 e


def sweep_shapes():
    """(programs per SM, int32 per block, warps) of the sweep: each warp's thread loads at least 4 words."""
    return [(k, block, warps) for k, block, warps in itertools.product((2, 4, 8, 16, 32), (2048, 4096, 8192, 16384),
                                                                       (4, 8, 16)) if block // (32 * warps) >= 4]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=4.0)
    parser.add_argument("--repeat", type=int, default=0, help="time only READ_SHAPES and the old shape, N times")
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args(argv)
    import torch

    from mla_backend.bench.ceilings import streaming_read_rate

    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    x = torch.randint(-100, 100, (int(args.gib * (1 << 30)) // 4,), dtype=torch.int32, device="cuda")

    def rate(shape):
        return streaming_read_rate(x, shape, rep_ms=200) / 1e12

    if args.repeat:
        shapes = [OLD_SHAPE, *READ_SHAPES]
        for _ in range(args.repeat):
            print("  ".join(f"{s[0]}/{s[1]}/{s[2]}: {rate(s):.3f} TB/s" for s in shapes))
        return 0
    results = sorted(((rate(s), s) for s in sweep_shapes()), reverse=True)
    print(f"{torch.cuda.get_device_name(0)}, {args.gib} GiB; programs per SM / int32 per block / warps")
    for tbs, (per_sm, block, warps) in results[:args.top]:
        mark = "  (READ_SHAPES)" if (per_sm, block, warps) in READ_SHAPES else ""
        print(f"  {tbs:.3f} TB/s  {per_sm}/{block}/{warps}{mark}")
    old = [tbs for tbs, s in results if s == OLD_SHAPE]
    print(f"  old shape {OLD_SHAPE[0]}/{OLD_SHAPE[1]}/{OLD_SHAPE[2]}: {old[0]:.3f} TB/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
