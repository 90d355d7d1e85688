"""The SM90 decode kernel alone (no planner, no combine, no graph), and interleaved A/B runs of kernel versions.

    python benchmarks/bench_decode_kernel.py --heads 12 --q-len 1 --page 32 --kv 1048576 --batch 4

    git show HEAD~1:mla_backend/hopper/decode_sm90.py > /tmp/before.py
    python benchmarks/bench_decode_kernel.py --case "12 1 32 1048576 4" --case "16 2 32 1048576 2" \\
        --variant /tmp/before.py

Each --variant is a copy of mla_backend/hopper/decode_sm90.py; it is loaded as a module of mla_backend.hopper
(so its relative imports resolve) and timed next to the installed kernel ("current"), in rounds that alternate
between the versions, so that clock and thermal drift hit all of them alike, and each variant's outputs (final
rows and partials, one call on the same inputs and plan) are compared with the current kernel's: "identical"
or the largest difference. A one-off change is measured by editing a copy and passing it as a variant: no
rebuild, one process, one comparison.

Timing: one launch per sample, CUDA events around it, after a ~200 us spin kernel, so that the GPU is still
busy while the host enqueues the start event, the launch and the end event (without it the host's launch path,
~70-80 us at 1M x B4, is timed too). The floor is the KV bytes over the read bandwidth measured at the start of
the same run (benchmarks/bench_decode.py's streaming-read kernel). `python -m mla_backend bench` is the
decode-step benchmark (planner and combine included, CUDA graphs).

The L2 is not emptied between launches here. A change to how the KV reaches shared memory can measure
differently as a step: the ping-pong's L2::128B copy hint gained 2-4% here and 4-13% in the step
(docs/performance.md), so confirm such changes with the step benchmark.
"""

from __future__ import annotations

import argparse
import atexit
import importlib.util
import os
import statistics
import sys

import torch

KV_DIM, LATENT_DIM = 576, 512
SPIN_CYCLES = 400_000  # ~200 us at the H200's clock: longer than the host's launch path


def _time_once(fn) -> float:
    """GPU seconds of one fn() call (see the module docstring for why the spin kernel goes first)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(SPIN_CYCLES)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e-3


def load_variant(path: str, index: int):
    """Import a copy of a module of mla_backend.hopper (decode_sm90.py, plan_splits_sm90.py) as
    mla_backend.hopper._variant_<index>."""
    import mla_backend.hopper as hopper

    name = f"_variant_{index}"
    dst = os.path.join(os.path.dirname(hopper.__file__), name + ".py")
    with open(path) as src, open(dst, "w") as out:
        out.write(src.read())
    # removed at exit, not before: the DSL reads the kernel's source when it first compiles it
    atexit.register(lambda: os.path.exists(dst) and os.remove(dst))
    spec = importlib.util.spec_from_file_location(f"mla_backend.hopper.{name}", dst)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def make_inputs(heads, q_len, page, kv_len, batch, seed=0):
    torch.manual_seed(seed)
    lengths = [kv_len] * batch
    pages_per = [-(-n // page) for n in lengths]
    num_pages = sum(pages_per) + 1
    kv = torch.empty(num_pages, page, KV_DIM, dtype=torch.uint8, device="cuda")
    kv.random_(0, 256)
    kv[(kv & 0x7F) == 0x7F] = 0  # no E4M3 NaN codes
    kv = kv.view(torch.float8_e4m3fn)
    block_table = torch.zeros(batch, max(pages_per), dtype=torch.int32, device="cuda")
    perm = torch.randperm(num_pages - 1, device="cuda").int()
    used = 0
    for b, n in enumerate(pages_per):
        block_table[b, :n] = perm[used:used + n]
        used += n
    seq_lens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, q_len, heads, KV_DIM, device="cuda").to(torch.float8_e4m3fn)
    scales = torch.tensor([0.05], device="cuda"), torch.tensor([0.05], device="cuda")
    inp = dict(q=q, kv=kv, block_table=block_table, seq_lens=seq_lens, scales=scales,
               kv_bytes=sum(lengths) * KV_DIM)
    from mla_backend.planner import default_num_ctas

    return with_plan(inp, default_num_ctas("cuda", heads, q_len))


def with_plan(inp, num_ctas):
    """inp (same tensors) with a plan of num_ctas CTAs and its workspace."""
    from mla_backend import DecodeWorkspace, SplitPlan, plan_splits

    batch, q_len, heads, _ = inp["q"].shape
    page = inp["kv"].shape[1]
    plan = SplitPlan.empty(batch, num_ctas, device="cuda")
    plan_splits(inp["seq_lens"], q_len=q_len, num_heads=heads, page_size=page, out=plan)
    return dict(inp, plan=plan, ws=DecodeWorkspace.for_plan(plan, q_len, heads))


def decode_fn(module, inp, rows_per_block=None):
    batch, q_len, heads, _ = inp["q"].shape
    out = torch.empty(batch, q_len, heads, LATENT_DIM, dtype=torch.bfloat16, device="cuda")
    lse = torch.empty(batch, q_len, heads, device="cuda")

    def decode():
        module.run_decode_sm90(inp["q"], inp["kv"], inp["block_table"], inp["seq_lens"], KV_DIM ** -0.5,
                               *inp["scales"], inp["plan"], out, lse, inp["ws"].partial_out, inp["ws"].partial_lse,
                               rows_per_block=rows_per_block)
    # what one call writes: the final rows of single-split requests and the partials of the others
    decode.outputs = (out, lse, inp["ws"].partial_out, inp["ws"].partial_lse)
    return decode


def outputs_of(fn):
    """Run fn once on zeroed outputs and return copies of everything it wrote (rows it does not own stay 0)."""
    for t in fn.outputs:
        t.zero_()
    fn()
    torch.cuda.synchronize()
    return [t.clone() for t in fn.outputs]


def compare_outputs(ref, got) -> str:
    """'identical' when every tensor matches bit for bit, else the largest absolute difference (NaN-aware)."""
    if all(torch.equal(a, b) for a, b in zip(ref, got)):
        return "identical"
    worst = 0.0
    for a, b in zip(ref, got):
        diff = (a.float() - b.float()).abs()
        bad = torch.isnan(a.float()) != torch.isnan(b.float())
        worst = max(worst, float("inf") if bool(bad.any()) else float(diff.nan_to_num(0.0).max()))
    return f"DIFFERENT (max |diff| {worst:.3g})"


def run_case(case, versions, rounds, per_round, bandwidth, rows_per_block=None, ctas=()):
    """Time every version on one case; with `ctas`, the current kernel also on plans of those CTA counts."""
    inp = make_inputs(*case)
    fns = [decode_fn(m, inp, rows_per_block) for _, m in versions]
    versions = list(versions)
    for n in ctas:
        fns.append(decode_fn(versions[0][1], with_plan(inp, n), rows_per_block))
        versions.append((f"{versions[0][0]}, {n} plan CTAs", versions[0][1]))
    for fn in fns:  # compile, then ~0.3 s of warm-up: an idle H200 sits at 345 MHz
        fn()
    torch.cuda.synchronize()
    for fn in fns:
        for _ in range(max(1, int(0.3 / len(fns) / max(_time_once(fn), 1e-6)))):
            fn()
    torch.cuda.synchronize()
    times = [[] for _ in fns]
    for _ in range(rounds):
        for t, fn in zip(times, fns):
            t.extend(_time_once(fn) for _ in range(per_round))
    floor = inp["kv_bytes"] / bandwidth
    heads, q_len, page, kv_len, batch = case
    # the variants' outputs against the current kernel's, same inputs and plan (the timing loop checks nothing)
    ref = outputs_of(fns[0])
    same = ["(reference)"] + [compare_outputs(ref, outputs_of(fn)) for fn in fns[1:len(fns) - len(ctas)]]
    print(f"H{heads} q{q_len} page {page} {kv_len} x B{batch} (KV floor {floor * 1e6:.1f} us):")
    for i, ((name, _), t) in enumerate(zip(versions, times)):
        med = statistics.median(t)
        spread = (max(t) - min(t)) / med
        check = f"  outputs {same[i]}" if i < len(same) and i > 0 else ""
        print(f"  {name:>24}: {med * 1e6:8.1f} us  {med / floor:5.3f} x floor  {inp['kv_bytes'] / med / 1e12:.2f} TB/s "
              f"of KV  (min {min(t) * 1e6:.1f}, spread {spread:.1%}){check}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--q-len", type=int, default=1)
    p.add_argument("--page", type=int, default=32)
    p.add_argument("--kv", type=int, default=1 << 20, help="KV tokens per request")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--case", action="append", default=[],
                   help='"heads q_len page kv batch"; repeatable; replaces --heads/--q-len/--page/--kv/--batch')
    p.add_argument("--variant", action="append", default=[], help="a copy of decode_sm90.py to time as well")
    p.add_argument("--rows-per-block", type=int, default=None,
                   help="query rows per CTA (16, 32, 48 or 64; default: decode_sm90.default_rows_per_block)")
    p.add_argument("--ctas", type=int, action="append", default=[],
                   help="also time the current kernel on a plan of this many CTAs (default: planner.default_num_ctas)")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--per-round", type=int, default=5)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU (Hopper)", file=sys.stderr)
        return 2
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_decode import measure_read_bandwidth
    from mla_backend.hopper import decode_sm90

    cases = [tuple(int(x) for x in c.split()) for c in args.case] or [
        (args.heads, args.q_len, args.page, args.kv, args.batch)]
    for c in cases:
        if len(c) != 5:
            raise SystemExit(f"--case needs 5 numbers (heads q_len page kv batch), got {c}")
    versions = [("current", decode_sm90)] + [(os.path.basename(v), load_variant(v, i))
                                             for i, v in enumerate(args.variant)]
    bandwidth = measure_read_bandwidth()
    print(f"read bandwidth {bandwidth / 1e12:.2f} TB/s")
    for c in cases:
        run_case(c, versions, args.rounds, args.per_round, bandwidth, args.rows_per_block, args.ctas)
    return 0


if __name__ == "__main__":
    sys.exit(main())
