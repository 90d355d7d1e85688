"""SASS instructions per loop of the SM90 decode kernel, on the CPU: which code runs once per chunk, and how much.

    python benchmarks/sass_loops.py --case "12 8 32" --case "12 1 32"           # heads q_len page
    python benchmarks/sass_loops.py --case "12 8 32" --source /tmp/variant.py   # a copy of decode_sm90.py

Compiles the kernel for sm_90a (CUTE_DSL_KEEP=ptx), assembles the PTX with ptxas and disassembles the cubin with
nvdisasm (on the H200 machine it is installed; on a CPU machine `pip download nvidia-cuda-nvdisasm` has it), then
prints every loop (a backward branch to a label) with its instruction count and the most frequent opcodes. The
innermost loops of a few hundred instructions are the per-chunk bodies: one per warpgroup role (the S^T
warpgroup, the softmax / P.V warpgroups, or the ping-pong's). Static counts, not timings: a warp issues at most
one instruction per cycle, so a count per chunk and warp, times the warps that share a scheduler, is a lower
bound on the chunk's cycles from issue alone.
"""

from __future__ import annotations

import argparse
import collections
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile

_INSTR = re.compile(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);")
_LABEL = re.compile(r"^(\.L_x_\d+):")


def sass_loops(sass: str):
    """[(first address, last address, instruction count, Counter of opcode families)] of every loop in an
    nvdisasm listing: a branch back to a label at or before it."""
    instrs, labels = [], {}
    for line in sass.splitlines():
        m = _INSTR.match(line)
        if m:
            text = m.group(2).strip()
            op = re.sub(r"^@!?U?P\w+\s+", "", text).split()[0]  # drop the predicate
            instrs.append((int(m.group(1), 16), text, op))
            continue
        m = _LABEL.match(line.strip())
        if m:
            labels[m.group(1)] = len(instrs)
    loops = []
    for i, (_, text, op) in enumerate(instrs):
        target = re.search(r"(\.L_x_\d+)", text) if op.startswith("BRA") else None
        if target and labels.get(target.group(1), i + 1) <= i:
            start = labels[target.group(1)]
            body = instrs[start:i + 1]
            loops.append((instrs[start][0], instrs[i][0], len(body),
                          collections.Counter(o.split(".")[0] for _, _, o in body)))
    return loops


def disassemble(heads: int, q_len: int, page: int, source: str = "") -> str:
    """nvdisasm's listing of the decode kernel for (heads, q_len, page), compiled for sm_90a."""
    nvdisasm = shutil.which("nvdisasm") or os.environ.get("NVDISASM", "")
    if not nvdisasm or not shutil.which("ptxas"):
        raise SystemExit("needs ptxas and nvdisasm on PATH (or NVDISASM=/path/to/nvdisasm)")
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, CUTE_DSL_ARCH="sm_90a", CUTE_DSL_KEEP="ptx", CUTE_DSL_DUMP_DIR=tmp)
        load = (f"import sys; sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r}); "
                f"import bench_decode_kernel as bk; m = bk.load_variant({source!r}, 95)" if source
                else "from mla_backend.hopper import decode_sm90 as m")
        subprocess.run([sys.executable, "-c", f"{load}; m.compile_decode_sm90({heads}, {q_len}, {page})"],
                       env=env, check=True, capture_output=True)
        ptx = sorted(glob.glob(os.path.join(tmp, "*.ptx")))[0]
        cubin = os.path.join(tmp, "kernel.cubin")
        subprocess.run(["ptxas", "-arch=sm_90a", ptx, "-o", cubin], check=True)
        return subprocess.run([nvdisasm, "-c", "-g", cubin], check=True, capture_output=True, text=True).stdout


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--case", action="append", default=[], help='"heads q_len page" (repeatable)')
    p.add_argument("--source", default="", help="a copy of decode_sm90.py to compile instead of the installed one")
    p.add_argument("--min-instructions", type=int, default=100, help="leave out smaller loops")
    args = p.parse_args(argv)
    for text in args.case or ["12 8 32"]:
        heads, q_len, page = (int(x) for x in text.split())
        print(f"H{heads} q{q_len} page {page}:")
        for first, last, count, ops in sass_loops(disassemble(heads, q_len, page, args.source)):
            if count >= args.min_instructions:
                print(f"  loop {first:#x}-{last:#x}: {count} instructions; "
                      + ", ".join(f"{k} {v}" for k, v in ops.most_common(16)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
