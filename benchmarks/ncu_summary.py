"""Summarise an ncu source-level profile of a kernel: where the warps wait, and which instructions waste
shared-memory wavefronts.

On the GPU machine (one launch of the decode kernel, after the warm-up launches):

    ncu --clock-control none -k regex:MLADecode --launch-skip 3 --launch-count 1 \\
        --section SourceCounters --section WarpStateStats --page source --print-source sass --csv \\
        python benchmarks/bench_decode_kernel.py --reps 1 > src.csv
    python benchmarks/ncu_summary.py src.csv
"""

from __future__ import annotations

import argparse
import csv
import io
import sys

SAMPLES = "Warp Stall Sampling (All Samples)"
EXCESS = "L1 Wavefronts Shared Excessive"


def _num(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def read_source_csv(text: str):
    """The per-instruction rows of ncu's `--page source --csv` output (its banner and program output skipped)."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith('"Address"')), None)
    if start is None:
        raise ValueError("no per-instruction table (a line starting with \"Address\") in the ncu output")
    rows = list(csv.DictReader(io.StringIO("\n".join(lines[start:]))))
    if not rows or SAMPLES not in rows[0]:
        raise ValueError(f"the table has no {SAMPLES!r} column: profile with --section WarpStateStats")
    return rows


def summarise(rows, top: int = 15) -> str:
    stall_cols = [c for c in rows[0] if c.startswith("stall_") and "Not Issued" not in c]
    total = sum(_num(r[SAMPLES]) for r in rows) or 1.0
    out = [f"{len(rows)} instructions, {total:.0f} stall samples"]
    by_reason = {c: sum(_num(r[c]) for r in rows) for c in stall_cols}
    out.append("samples by reason: " + ", ".join(
        f"{c[6:]} {100 * v / total:.1f}%" for c, v in sorted(by_reason.items(), key=lambda kv: -kv[1]) if v > 0))
    out.append(f"top {top} instructions by samples:")
    for r in sorted(rows, key=lambda r: -_num(r[SAMPLES]))[:top]:
        reasons = sorted(((_num(r[c]), c[6:]) for c in stall_cols), reverse=True)[:2]
        out.append(f"  {100 * _num(r[SAMPLES]) / total:5.1f}%  {r['Source'].strip()[:64]:64}  " +
                   " ".join(f"{name} {100 * v / total:.1f}%" for v, name in reasons if v > 0))
    if EXCESS in rows[0]:
        excess = sorted((r for r in rows if _num(r[EXCESS]) > 0), key=lambda r: -_num(r[EXCESS]))
        all_wavefronts = sum(_num(r.get("L1 Wavefronts Shared", "0")) for r in rows) or 1.0
        out.append(f"shared-memory wavefronts beyond the ideal: {sum(_num(r[EXCESS]) for r in rows):.0f} of "
                   f"{all_wavefronts:.0f}; by instruction:")
        for r in excess[:top]:
            out.append(f"  {_num(r[EXCESS]):12.0f} of {_num(r.get('L1 Wavefronts Shared', '0')):12.0f}  "
                       f"{r['Source'].strip()[:64]}")
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("csv", help="ncu --page source --csv output")
    p.add_argument("--top", type=int, default=15)
    args = p.parse_args(argv)
    with open(args.csv) as f:
        print(summarise(read_source_csv(f.read()), args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
