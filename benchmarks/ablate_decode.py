"""Where the decode schedules' time goes: time the SM90 decode kernel with parts of its per-chunk work left out.

Each ablation is a research build of the decode configuration (`config.DecodeConfig.skip`, parts from
config.DECODE_PARTS; the outputs are wrong, only the timing means something), timed against the kernel itself by
bench_decode_kernel.py in one process, as its `--variant skip=...`:

    python benchmarks/ablate_decode.py --case "12 8 32 1048576 1"
    python benchmarks/ablate_decode.py --case "16 2 32 1048576 2" --only nosoftmax,nostore
    python benchmarks/ablate_decode.py --case "12 1 32 1048576 4" --rows-per-block 32 --only nopv,nos

The kernel's code holds the switches; an ablation here only names them. An ablated build keeps the case's schedule
(`chunk_pairs` as the case has it): an ablation a schedule has no switch for (the chunk-pairs schedule stores no
S^T, so `nostore`) is left out of that case with a note, instead of timing another schedule.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_decode_kernel  # noqa: E402

# name -> the parts of config.DECODE_PARTS it leaves out
ABLATIONS = {
    "noload": ("load",),  # no KV copies: the ring is zero-filled
    "nos": ("s",),  # no S^T wgmmas
    "nostore": ("store_s",),  # S^T not stored to shared memory
    "nosoftmax": ("softmax",),  # S^T not read, no P written, alpha 1
    "norescale": ("rescale",),  # O^T not rescaled
    "nopv": ("pv",),  # no P.V wgmmas
    "nomath": ("softmax", "pv", "s"),
}


def ablation_spec(name: str) -> str:
    """The bench_decode_kernel.py --variant SPEC of an ablation: 'skip=PART+PART'."""
    if name not in ABLATIONS:
        raise ValueError(f"unknown ablation {name!r} (ablations: {', '.join(ABLATIONS)})")
    return "skip=" + "+".join(ABLATIONS[name])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="ablate_decode.py", description=__doc__.splitlines()[0])
    p.add_argument("--case", action="append", default=[], help='"heads q_len page kv batch" (repeatable)')
    p.add_argument("--only", default=",".join(ABLATIONS), help="comma-separated ablations")
    p.add_argument("--rows-per-block", type=int, default=None, help="query rows per CTA (default: the runtime's)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--per-round", type=int, default=4)
    args = p.parse_args(argv)
    try:
        cases = [bench_decode_kernel.parse_case(c) for c in args.case or ["12 8 32 1048576 1"]]
        specs = [(name, ablation_spec(name)) for name in args.only.split(",")]
        per_case = [(case, case_ablations(case, specs, args.rows_per_block)) for case in cases]
    except ValueError as err:
        return bench_decode_kernel.error(p.prog, err)
    for case, variants in per_case:
        status = bench_decode_kernel.run([case], variants, args.rounds, args.per_round, args.rows_per_block,
                                         prog=p.prog)
        if status:
            return status
    return 0


def case_ablations(case, specs, rows_per_block=None):
    """The (name, overrides) variants of one case: each ablation's skip with the case's own schedule kept; those
    the schedule cannot build are named on stderr and left out."""
    base = bench_decode_kernel.case_config(case, None, rows_per_block)
    variants = []
    for name, spec in specs:
        overrides = {**bench_decode_kernel.parse_variant(spec), "chunk_pairs": base.chunk_pairs}
        try:
            bench_decode_kernel.case_config(case, overrides, rows_per_block)
        except ValueError as err:
            print(f"ablate_decode.py: case {' '.join(map(str, case))!r}: {name} left out, the {base.schedule} "
                  f"schedule has no such build ({err})", file=sys.stderr)
            continue
        variants.append((f"{name} ({spec})", overrides))
    return variants


if __name__ == "__main__":
    sys.exit(main())
