"""Command line: `python -m mla_backend plan | compile | bench` (also installed as `cute-mla-fp8`).

plan     how a batch is split across the GPU, and the step time that implies (any machine: the planner is torch)
compile  compile every kernel a decode shape can launch, no GPU needed; with --cache-dir, keep them for start-up
bench    time decode steps on a Hopper GPU against the memory / FP8 tensor floor (python -m mla_backend bench --help)
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter

SUPPORTED = "supported: heads 8..128, q_len 1..8, page size 32 or 64, 0..1048576 KV tokens, 1..1024 requests"


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (exit 2, no usage block)."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def parse_seq_lens(text: str):
    """'1048576,4096x15' -> [1048576] + [4096] * 15."""
    lengths = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        value, sep, count = part.partition("x")
        try:
            length, repeat = int(value), int(count) if sep else 1
        except ValueError:
            raise argparse.ArgumentTypeError(f"cannot read {part!r}; use lengths and LENxCOUNT repeats, e.g. "
                                             f"1048576,4096x15")
        if repeat < 1:
            raise argparse.ArgumentTypeError(f"the count in {part!r} must be at least 1")
        lengths += [length] * repeat
    if not lengths:
        raise argparse.ArgumentTypeError("needs one or more lengths, e.g. 1048576,4096x15")
    return lengths


def parse_q_lens(text: str):
    """'1' or '1,2,4' -> [1] or [1, 2, 4]."""
    try:
        values = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"cannot read {text!r}; use a q_len or a list such as 1,2,4")
    if not values:
        raise argparse.ArgumentTypeError("needs one or more q_len values")
    return values


def _runs(values):
    """Run-length text of a sequence: '3 x4, 1, 2 x2'."""
    out, i = [], 0
    while i < len(values):
        j = i
        while j < len(values) and values[j] == values[i]:
            j += 1
        out.append(f"{values[i]}" + (f" x{j - i}" if j - i > 1 else ""))
        i = j
    return ", ".join(out)


def _histogram(costs, width=40):
    counts = Counter(costs)
    top = max(counts.values())
    lines = []
    for cost in sorted(counts):
        bar = "#" * max(1, round(width * counts[cost] / top))
        lines.append(f"  {cost:>8} | {bar} {counts[cost]}")
    return "\n".join(lines)


def _tokens(n: int) -> str:
    if n >= 1 << 20 and n % (1 << 20) == 0:
        return f"{n >> 20}M"
    if n >= 1024 and n % 1024 == 0:
        return f"{n >> 10}K"
    return str(n)


def _check_plan_args(args):
    from .shapes import check_kv_lengths, check_shape

    check_shape(num_heads=args.heads, q_len=args.q_len, page_size=args.page_size, batch=len(args.seq_lens),
                names={"num_heads": "--heads", "q_len": "--q-len", "page_size": "--page-size",
                       "batch": "the number of --seq-lens (requests)"})
    check_kv_lengths(args.seq_lens, "--seq-lens")
    if args.tile_tokens is not None and (args.tile_tokens < 1 or (args.tile_tokens % args.page_size
                                                                  and args.page_size % args.tile_tokens)):
        raise ValueError(f"--tile-tokens must be a positive multiple or divisor of the page size "
                         f"({args.page_size}), got {args.tile_tokens}")
    if args.ctas is not None and args.ctas < 1:
        raise ValueError(f"--ctas must be at least 1, got {args.ctas}")
    if args.overhead < 0:
        raise ValueError(f"--overhead must be >= 0 (tiles of cost per segment), got {args.overhead}")


def cmd_plan(args) -> int:
    import torch

    from .plan import plan_splits
    from .roofline import H200_FP8_FLOPS, H200_READ_BYTES_PER_S, floor_seconds, step_bytes_and_flops

    _check_plan_args(args)
    seq_lens = torch.tensor(args.seq_lens, dtype=torch.int32)
    plan = plan_splits(seq_lens, q_len=args.q_len, num_heads=args.heads, page_size=args.page_size,
                       tile_tokens=args.tile_tokens, num_ctas=args.ctas, segment_overhead=args.overhead)
    splits = plan.num_splits.tolist()
    costs = plan.cta_costs().tolist()
    tiles = (seq_lens.long() + plan.tile_tokens - 1) // plan.tile_tokens
    total = int(tiles.sum() + plan.segment_overhead * (tiles > 0).sum())
    ideal = total / plan.num_ctas
    busy = sum(1 for c in costs if c > 0)
    balance = max(costs) / max(ideal, 1e-9)
    bytes_moved, flops = step_bytes_and_flops(args.seq_lens, args.heads, args.q_len)
    floor, bound = floor_seconds(bytes_moved, flops)

    # what a serving engineer asks first: how the batch is split, how even the work is, what the step costs
    print(f"{len(splits)} requests, {int(seq_lens.sum())} KV tokens, {args.heads} heads x q_len {args.q_len}, "
          f"page {args.page_size}: split over {plan.num_ctas} CTAs (an H200's 132 SMs"
          + (f" / {132 // plan.num_ctas} row blocks" if plan.num_ctas < 132 and 132 % plan.num_ctas == 0 else "")
          + ")")
    groups = Counter(zip(args.seq_lens, splits))
    for (length, n), count in sorted(groups.items(), key=lambda item: (-item[0][0], item[0][1])):
        how = "no KV (out = 0)" if n == 0 else ("whole on one CTA" if n == 1 else f"{n} splits, merged by the combine")
        print(f"  {count} x {_tokens(length)} tokens: {how}")
    print(f"balance: the busiest CTA has {balance:.2f}x the average work ({busy} of {plan.num_ctas} CTAs busy)")
    print(f"floor on an H200: {floor * 1e6:.1f} us ({bound}-bound: {bytes_moved / 1e6:.1f} MB at "
          f"{H200_READ_BYTES_PER_S / 1e12:.1f} TB/s, {flops / 1e12:.2f} TFLOP at {H200_FP8_FLOPS / 1e15:.1f} "
          f"PFLOP/s FP8); the busiest CTA alone implies >= {floor * balance * 1e6:.1f} us")
    print()
    print("detail (kernel terms):")
    print(f"  tiles of {plan.tile_tokens} tokens: {int(tiles.sum())}, segment overhead {plan.segment_overhead} tiles")
    print(f"  splits per request: {_runs(splits)}")
    print(f"  segments: {plan.segments().shape[0]}, partials to merge: "
          f"{int(plan.num_splits[plan.num_splits > 1].sum())}")
    print(f"  busy CTAs: {busy} of {plan.num_ctas}")
    print("  per-CTA cost (tiles + overheads) | CTAs:")
    print(_histogram(costs))
    print(f"  balance: busiest CTA {max(costs)} vs ideal {ideal:.1f} = {balance:.3f}x")
    return 0


def cmd_compile(args) -> int:
    from . import jit_cache
    from .prepare import prepare_kernels
    from .shapes import check_shape

    for q_len in args.q_len:
        check_shape(num_heads=args.heads, q_len=q_len, page_size=args.page_size, batch=args.max_batch,
                    names={"num_heads": "--heads", "q_len": "--q-len", "page_size": "--page-size",
                           "batch": "--max-batch"})
    if args.cache_dir:
        jit_cache.use_directory(args.cache_dir)
    count = 0
    for q_len in args.q_len:
        for item in prepare_kernels(args.heads, q_len, args.page_size, max_batch=args.max_batch,
                                    p_precision=args.p_precision, causal=not args.no_causal):
            print(item.describe())
            count += 1
    where = jit_cache.directory()
    print(f"{count} kernels " + (f"in {where} (CUTE_MLA_KERNEL_CACHE={where} loads them)" if where else
                                 "compiled and not kept (--cache-dir DIR keeps them for a server's start-up)"))
    return 0


def build_parser() -> argparse.ArgumentParser:
    from .config import P_PRECISIONS
    from .plan import DEFAULT_SEGMENT_OVERHEAD

    parser = _Parser(prog="python -m mla_backend", description=__doc__,
                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=SUPPORTED)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    plan = sub.add_parser("plan", help="how a batch is split across the GPU, and the step time that implies",
                          epilog=SUPPORTED)
    plan.add_argument("--seq-lens", type=parse_seq_lens, required=True,
                      help="comma-separated KV lengths, LENxCOUNT repeats (e.g. 1048576,4096x15)")
    plan.add_argument("--heads", type=int, default=12, help="query heads per GPU (default 12)")
    plan.add_argument("--q-len", type=int, default=1, help="query tokens per request: 1, or 2-8 with MTP")
    plan.add_argument("--page-size", type=int, default=32, help="KV-cache page size: 32 or 64")
    plan.add_argument("--tile-tokens", type=int, default=None, help="tokens per plan tile (default 64)")
    plan.add_argument("--ctas", type=int, default=None,
                      help="plan CTAs (default: an H200's 132 SMs over the decode's row blocks)")
    plan.add_argument("--overhead", type=int, default=DEFAULT_SEGMENT_OVERHEAD,
                      help=f"per-segment cost in tiles (default {DEFAULT_SEGMENT_OVERHEAD})")
    plan.set_defaults(func=cmd_plan)

    comp = sub.add_parser("compile", help="compile every kernel of a decode shape (no GPU needed)", epilog=SUPPORTED)
    comp.add_argument("--arch", default="sm_90a", choices=["sm_90a"])
    comp.add_argument("--heads", type=int, default=12)
    comp.add_argument("--q-len", type=parse_q_lens, default=[1], help="a q_len or a list (1,2,4: MTP with 3 drafts)")
    comp.add_argument("--page-size", type=int, default=32)
    comp.add_argument("--max-batch", type=int, default=256, help="requests per plan (the engine's max_num_seqs)")
    comp.add_argument("--p-precision", choices=P_PRECISIONS, default=None, help="see README (default: fp8)")
    comp.add_argument("--no-causal", action="store_true")
    comp.add_argument("--cache-dir", default=None,
                      help="write the compiled kernels here (a server with CUTE_MLA_KERNEL_CACHE=DIR loads them)")
    comp.set_defaults(func=cmd_compile)

    sub.add_parser("bench", help="time decode steps on a Hopper GPU (python -m mla_backend bench --help)",
                   add_help=False)  # never parsed here: main hands `bench ...` to the benchmark
    return parser


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    command = argv[0] if argv else ""
    try:
        from .config import environment

        environment()  # a bad switch is reported here, once, like a bad argument
        if command == "bench":  # the benchmark parses its own options
            from .bench.step import main as bench_main

            return bench_main(argv[1:])
        args = build_parser().parse_args(argv)
        return args.func(args)
    except (ValueError, TypeError) as err:  # a bad value that parsed: one line, no traceback
        print(f"python -m mla_backend {command}: error: {err}".replace(" : ", ": "), file=sys.stderr)
        return 2
    except BrokenPipeError:  # the reader went away (`... | head`): nothing more to say
        sys.stderr.close()
        return 0
