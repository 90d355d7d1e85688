"""SASS instructions per loop of the SM90 decode kernel, on the CPU: which code runs once per chunk, and how much.

    python benchmarks/sass_loops.py --case "12 8 32" --case "12 1 32"           # heads q_len page
    python benchmarks/sass_loops.py --case "12 8 32" --variant p_planes=2       # a configuration's overrides
    python benchmarks/sass_loops.py --case "12 1 32" --rows-per-block 32 --p-planes 1
    python benchmarks/sass_loops.py --case "128 1 64" --windows                 # and each loop between its waits

Compiles the decode kernel of a configuration for sm_90a as the runtime does (`config.decode_config` with the
overrides of `--variant SPEC`, bench_decode_kernel.py's, and of --rows-per-block / --p-planes, the SPEC's
winning; `hopper.decode.compile_decode`) in a subprocess with CUTE_DSL_KEEP=ptx, assembles the PTX with ptxas and
disassembles the cubin with nvdisasm (on the H200 machine it is installed; on a CPU machine `pip download
nvidia-cuda-nvdisasm` has it; PTXAS and NVDISASM name them, else they are looked up on PATH), then prints every loop (a
backward branch to a label) with its instruction count and the most frequent opcodes. The innermost loops of a
few hundred instructions are the per-chunk bodies: one per warpgroup role (the S^T warpgroup, the softmax / P.V
warpgroups, or the ping-pong's). Static counts, not timings: a warp issues at most one instruction per cycle, so
a count per chunk and warp, times the warps that share a scheduler, is a lower bound on the chunk's cycles from
issue alone.
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_decode_kernel import error, format_overrides, parse_variant  # noqa: E402

_INSTR = re.compile(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);")
_LABEL = re.compile(r"^(\.L_x_\d+):")


def _instructions(sass: str):
    """[(address, text, opcode)] of an nvdisasm listing, and {label: index of the instruction after it}."""
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
    return instrs, labels


def sass_loops(sass: str):
    """[(first address, last address, instruction count, Counter of opcode families)] of every loop in an
    nvdisasm listing: a branch back to a label at or before it."""
    instrs, labels = _instructions(sass)
    loops = []
    for i, (_, text, op) in enumerate(instrs):
        target = re.search(r"(\.L_x_\d+)", text) if op.startswith("BRA") else None
        if target and labels.get(target.group(1), i + 1) <= i:
            start = labels[target.group(1)]
            body = instrs[start:i + 1]
            loops.append((instrs[start][0], instrs[i][0], len(body),
                          collections.Counter(o.split(".")[0] for _, _, o in body)))
    return loops


# where a warp waits: a CTA or named barrier, a wgmma wait, an mbarrier wait
_WAITS = ("BAR.SYNC", "BAR.RED", "WARPGROUP.DEPBAR", "SYNCS.PHASECHK")  # BAR.RED: a barrier that also reduces


def loop_windows(sass: str, first: int, last: int):
    """The loop [first, last] (addresses, as `sass_loops` gives them) cut after each wait instruction (_WAITS):
    [(the wait ending the window or "back edge", instruction count, Counter of opcode families)], in listing
    order. A window's instructions run between two waits, so its count per warp, times the warps of a scheduler,
    bounds that stretch of the loop from issue alone (what ncu's `selected` / `not_selected` samples show)."""
    body = [(text, op) for address, text, op in _instructions(sass)[0] if first <= address <= last]
    windows, ops = [], collections.Counter()
    for text, op in body:
        ops[op.split(".")[0]] += 1
        if op.startswith(_WAITS):
            windows.append((text, sum(ops.values()), ops))
            ops = collections.Counter()
    if ops:
        windows.append(("back edge", sum(ops.values()), ops))
    return windows


# run in a subprocess, so that CUTE_DSL_KEEP applies to a fresh DSL: compile one configuration like the runtime
_COMPILE = """
import json, sys
from mla_backend.config import decode_config
from mla_backend.hopper.decode import compile_decode
case, kw = json.loads(sys.argv[1])
if "skip" in kw:
    kw["skip"] = frozenset(kw["skip"])
compile_decode(decode_config(*case, **kw))
"""


def compile_ptx(heads: int, q_len: int, page: int, overrides: dict, folder: str) -> str:
    """The PTX file of the decode kernel of (heads, q_len, page) with decode_config overrides, compiled for
    sm_90a into `folder` by a subprocess that imports the same mla_backend as this one."""
    import mla_backend

    root = os.path.dirname(os.path.dirname(os.path.abspath(mla_backend.__file__)))
    env = dict(os.environ, CUTE_DSL_ARCH="sm_90a", CUTE_DSL_KEEP="ptx", CUTE_DSL_DUMP_DIR=folder,
               PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p))
    env.pop("CUTE_MLA_KERNEL_CACHE", None)  # a kernel loaded from a cache directory leaves no PTX
    kw = {k: sorted(v) if isinstance(v, frozenset) else v for k, v in overrides.items()}
    os.makedirs(folder, exist_ok=True)  # the DSL writes its PTX only into a folder that exists
    done = subprocess.run([sys.executable, "-c", _COMPILE, json.dumps([[heads, q_len, page], kw])], env=env,
                          capture_output=True, text=True)
    if done.returncode:
        last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise SystemExit(f"sass_loops.py: error: compiling H{heads} q{q_len} page {page} "
                         f"{format_overrides(overrides)}: {last}")
    return sorted(glob.glob(os.path.join(folder, "*.ptx")))[0]


def disassemble(heads: int, q_len: int, page: int, overrides=None) -> str:
    """nvdisasm's listing of the decode kernel for (heads, q_len, page) and decode_config overrides, compiled for
    sm_90a."""
    ptxas = os.environ.get("PTXAS") or shutil.which("ptxas")
    nvdisasm = os.environ.get("NVDISASM") or shutil.which("nvdisasm")
    if not nvdisasm or not ptxas:
        raise SystemExit("sass_loops.py: error: needs ptxas and nvdisasm (PTXAS=..., NVDISASM=..., or on PATH)")
    with tempfile.TemporaryDirectory() as tmp:
        ptx = compile_ptx(heads, q_len, page, overrides or {}, tmp)
        cubin = os.path.join(tmp, "kernel.cubin")
        subprocess.run([ptxas, "-arch=sm_90a", ptx, "-o", cubin], check=True)
        return subprocess.run([nvdisasm, "-c", "-g", cubin], check=True, capture_output=True, text=True).stdout


def run_overrides(variant: str = "", p_planes=None, rows_per_block=None) -> dict:
    """decode_config overrides of the command line: --rows-per-block, --p-planes, then --variant's (ValueError for
    a bad SPEC, bench_decode_kernel.parse_variant)."""
    overrides = {k: v for k, v in (("rows_per_block", rows_per_block), ("p_planes", p_planes)) if v is not None}
    if variant:
        overrides.update(parse_variant(variant))
    return overrides


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="sass_loops.py", description=__doc__.splitlines()[0])
    p.add_argument("--case", action="append", default=[], help='"heads q_len page" (repeatable)')
    p.add_argument("--variant", default="", metavar="SPEC",
                   help="configuration overrides, e.g. p_planes=2 or skip=softmax (bench_decode_kernel.py's)")
    p.add_argument("--rows-per-block", type=int, default=None, help="query rows per CTA (default: the runtime's)")
    p.add_argument("--p-planes", type=int, default=None, help="e4m3 planes of P (default: the runtime's)")
    p.add_argument("--min-instructions", type=int, default=100, help="leave out smaller loops")
    p.add_argument("--windows", action="store_true",
                   help="also each loop's stretches between waits (barriers, wgmma and mbarrier waits)")
    args = p.parse_args(argv)
    try:
        overrides = run_overrides(args.variant, args.p_planes, args.rows_per_block)
    except ValueError as err:
        return error(p.prog, err)
    for text in args.case or ["12 8 32"]:
        heads, q_len, page = (int(x) for x in text.split())
        print(f"H{heads} q{q_len} page {page}" + (f", {format_overrides(overrides)}" if overrides else "") + ":")
        sass = disassemble(heads, q_len, page, overrides)
        for first, last, count, ops in sass_loops(sass):
            if count >= args.min_instructions:
                print(f"  loop {first:#x}-{last:#x}: {count} instructions; "
                      + ", ".join(f"{k} {v}" for k, v in ops.most_common(16)))
                if args.windows:
                    for wait, n, w_ops in loop_windows(sass, first, last):
                        print(f"    {n:4d} up to {wait[:48]}: " + ", ".join(f"{k} {v}" for k, v in
                                                                      w_ops.most_common(8)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
