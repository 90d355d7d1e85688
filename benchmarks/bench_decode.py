"""Decode-step time against the floor measured in the same run (`python -m mla_backend bench`).

For each case: one decode step (the device planner, the split-KV decode and the combine) is captured in a CUDA
graph and replayed; the L2 is emptied before every timed replay (by reading a 256 MB buffer, `flush_l2`) so the
KV comes from DRAM. The floor is
max(bytes / measured DRAM read bandwidth, FLOPs / measured FP8 tensor throughput), both ceilings measured at
the start of the run. Output: a table, a CSV and a plot of time / floor per case.

The KV cache is one pool allocated at the start of the run, before anything else, as an engine allocates its
cache once; each case's pages are the first pages of that pool (`case_kv`). `--kv-alloc per-case` gives each
case its own allocation, made after the previous case's memory went back to the driver (the bench before
2026-12-01 c).

A step is timed by CUDA events around one graph replay, after the L2 flush and a spin kernel that keeps the GPU
busy while the host enqueues the replay (`run_case`); the "no spin" column is the same without it, which also
catches any time the GPU waits for the host's graph launch (docs/performance.md, "Step time by events").

`--kernel-times` adds each kernel's duration from a profiler trace and the span from the first kernel's start to
the last one's end ("step kernel"), and the planner's and the combine's durations in graphs of their own ("planner
alone", "combine alone": the "planner" and "combine" columns time those replays by events, graph launches
included). With programmatic dependent launch (the default, `CUTE_MLA_PDL`) the decode
and combine kernels start before the kernel ahead of them ends and wait for it on the GPU, so their durations
include that wait; the span does not double count it.
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import sys
import time
from dataclasses import dataclass, field, replace
from typing import List, Optional

import torch

KV_DIM, LATENT_DIM = 576, 512


@dataclass
class Case:
    name: str
    lengths: List[int]
    heads: int = 12
    q_len: int = 1
    page_size: int = 32
    segment_overhead: Optional[int] = None  # the planner's default unless set
    results: dict = field(default_factory=dict)


def default_cases(heads=12, page_size=32):
    cases = []
    for q_len in (1, 8):
        for kv in (131072, 1 << 20):
            for batch in (1, 2, 4, 8, 16):
                label = f"{kv // 1024}K" if kv < (1 << 20) else "1M"
                cases.append(Case(f"H{heads} q{q_len} {label} x B{batch}", [kv] * batch, heads, q_len, page_size))
    cases.append(Case(f"H{heads} q1 1M + 15 x 4K", [1 << 20] + [4096] * 15, heads, 1, page_size))
    cases.append(Case(f"H{heads} q1 128K + 63 x 2K", [131072] + [2048] * 63, heads, 1, page_size))
    return cases


def extended_cases():
    cases = []
    for heads in (16, 128):
        for q_len in (1, 2):
            cases.append(Case(f"H{heads} q{q_len} 1M x B4", [1 << 20] * 4, heads, q_len, 32))
    cases.append(Case("H12 q1 1M x B4 page 64", [1 << 20] * 4, 12, 1, 64))
    cases.append(Case("H12 q1 (1M-17) x B4", [(1 << 20) - 17] * 4, 12, 1, 32))
    for batch, kv in ((32, 8192), (32, 32768), (64, 8192), (64, 32768), (128, 8192), (128, 32768)):
        cases.append(Case(f"H12 q1 {kv // 1024}K x B{batch}", [kv] * batch, 12, 1, 32))
    return cases


# ---------------------------------------------------------------------------------------------- ceilings
# Streaming-read shapes tried by measure_read_bandwidth: (programs per SM, int32 per block, warps). The one the
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


# ------------------------------------------------------------------------------------------------- cases
def case_kv_bytes(case: Case) -> int:
    """Bytes of the KV pages a case uses: its requests' pages plus one spare page (run_case)."""
    return (sum(-(-n // case.page_size) for n in case.lengths) + 1) * case.page_size * KV_DIM


def case_kv(pool: Optional[torch.Tensor], case: Case, device="cuda") -> torch.Tensor:
    """The case's paged cache [num_pages, page_size, 576] (uint8): the first bytes of `pool`, or a new
    allocation when pool is None."""
    num_pages = case_kv_bytes(case) // (case.page_size * KV_DIM)
    if pool is None:
        return torch.empty(num_pages, case.page_size, KV_DIM, dtype=torch.uint8, device=device)
    if pool.numel() < case_kv_bytes(case):
        raise ValueError(f"the KV pool holds {pool.numel()} bytes, case {case.name!r} needs {case_kv_bytes(case)}")
    return pool[:case_kv_bytes(case)].view(num_pages, case.page_size, KV_DIM)


def case_bytes_and_flops(case: Case):
    tokens = sum(case.lengths)
    rows = case.q_len * case.heads
    batch = len(case.lengths)
    bytes_moved = tokens * KV_DIM + batch * rows * (KV_DIM + LATENT_DIM * 2 + 4)
    flops = 2 * tokens * rows * (KV_DIM + LATENT_DIM)
    return bytes_moved, flops


KERNEL_KINDS = (("planner", "PlanSplits"), ("decode", "MLADecode"), ("combine", "CombineSplits"))
KERNEL_NAMES = [kind for kind, _ in KERNEL_KINDS] + ["step"]
# `--kernel-times`: the planner's and the combine's durations in graphs of their own, replayed back to back (the
# "planner" / "combine" columns time those replays by events, so they include each replay's graph launch)
ALONE_NAMES = ["planner_alone", "combine_alone"]


def step_kernel_durations(kernels):
    """Median duration (us) of each of our kernels in a traced sequence of replays.

    kernels: (name, start_us, end_us) of every GPU kernel, in start order. Each replay is preceded by the L2
    flush (a memset / fill kernel), which starts a new step; a step's kernels are named by KERNEL_KINDS. Also
    returns the median span from the first kernel of a step to its last ("step": the step without the
    graph launch before it)."""
    steps, current = [], None
    for name, start, end in kernels:
        if not any(marker in name for _, marker in KERNEL_KINDS):
            current = None  # the flush (or anything else) between steps
            continue
        if current is None:
            current = []
            steps.append(current)
        current.append((name, start, end))
    found = {}
    for step in steps:
        for kind, marker in KERNEL_KINDS:
            for name, start, end in step:
                if marker in name:
                    found.setdefault(kind, []).append(end - start)
        found.setdefault("step", []).append(step[-1][2] - step[0][1])
    return {kind: statistics.median(values) for kind, values in found.items()}


L2_FLUSH_BYTES = 256 << 20  # 5x the H200's 50 MB L2
SPIN_CYCLES = 400_000  # ~200 us at the H200's clock: longer than the host's graph launch (run_case)


def flush_l2(buf: torch.Tensor, mode: str = "read") -> None:
    """Evict the L2 before a timed replay, so that the step reads its KV from DRAM.

    "read" (the default) sums `buf`, leaving the L2 full of clean lines. "write" (`buf.zero_()`, the usual
    benchmark flush and this bench's before 2026-12-01) leaves it full of dirty lines, whose write-back (up to
    the L2's 50 MB, a sixth of a 128K x B4 step's KV) then competes with the step's own DRAM reads: q_len 1
    steps measured 2-8 us slower that way. A decode step in an engine follows kernels that mostly read
    (weights), so "read" is the representative start; docs/performance.md has both for the same kernels."""
    if mode == "read":
        buf.view(torch.int64).sum()
    elif mode == "write":
        buf.zero_()
    else:
        raise ValueError(f"flush mode must be 'read' or 'write', got {mode!r}")


def trace_kernel_durations(graph, flush, reps: int, flush_mode: str = "read"):
    """Replay `graph` reps times under torch.profiler (CUPTI traces kernels inside graph replays) and return
    step_kernel_durations of the trace. flush None: back-to-back replays, the L2 left as the last one left it."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            if flush is not None:
                flush_l2(flush, flush_mode)
            graph.replay()
        torch.cuda.synchronize()
    events = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                    key=lambda e: e.time_range.start)
    return step_kernel_durations([(e.name, e.time_range.start, e.time_range.end) for e in events])


def page_permutation(num_pages: int, order: str, device="cpu") -> torch.Tensor:
    """The pool pages the block tables hand out, in order: a random permutation (an engine's cache after a while,
    the default) or the pages in order (`--page-order in-order`: the KV as one stream, which the decode reads 2-3%
    faster at 1M tokens, docs/performance.md "The floor's read bandwidth")."""
    if order == "random":
        return torch.randperm(num_pages, device=device).int()
    if order == "in-order":
        return torch.arange(num_pages, device=device, dtype=torch.int32)
    raise ValueError(f"page order must be 'random' or 'in-order', got {order!r}")


@dataclass
class CaseInputs:
    """One case's tensors on the GPU: its inputs, outputs, plan and workspace (`case_inputs`)."""
    q: torch.Tensor
    kv: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    q_scale: torch.Tensor
    k_scale: torch.Tensor
    out: torch.Tensor
    lse: torch.Tensor
    plan: object
    ws: object
    softmax_scale: float

    def plan_step(self, case: Case):
        from mla_backend import plan_splits

        plan_splits(self.seq_lens, q_len=case.q_len, num_heads=case.heads, page_size=case.page_size, out=self.plan)

    def decode_step(self):
        """The decode and the combine (`mla_decode` with the plan as it stands)."""
        from mla_backend import mla_decode

        mla_decode(self.q, self.kv, self.block_table, self.seq_lens, softmax_scale=self.softmax_scale,
                   q_scale=self.q_scale, k_scale=self.k_scale, out=self.out, lse=self.lse, plan=self.plan,
                   workspace=self.ws)


def case_inputs(case: Case, kv_pool: Optional[torch.Tensor] = None, page_order: str = "random") -> CaseInputs:
    """Random FP8 q and KV for a case (seed 0), its block tables over the pool's pages in `page_order`, and an
    empty plan and workspace of the bench's default shape."""
    from mla_backend import DecodeWorkspace, SplitPlan
    from mla_backend.planner import default_num_ctas

    torch.manual_seed(0)
    batch, page = len(case.lengths), case.page_size
    pages_per = [-(-n // page) for n in case.lengths]
    kv = case_kv(kv_pool, case)
    num_pages = kv.shape[0]  # the requests' pages and one spare
    kv.random_(0, 256)
    kv[(kv & 0x7F) == 0x7F] = 0  # random bytes include the E4M3 NaN codes
    kv = kv.view(torch.float8_e4m3fn)
    max_pages = max(pages_per)
    block_table = torch.zeros(batch, max_pages, dtype=torch.int32, device="cuda")
    perm = page_permutation(num_pages - 1, page_order, "cuda")
    used = 0
    for b, n in enumerate(pages_per):
        block_table[b, :n] = perm[used:used + n]
        used += n
    seq_lens = torch.tensor(case.lengths, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, case.q_len, case.heads, KV_DIM, device="cuda").to(torch.float8_e4m3fn)
    out = torch.empty(batch, case.q_len, case.heads, LATENT_DIM, dtype=torch.bfloat16, device="cuda")
    lse = torch.empty(batch, case.q_len, case.heads, dtype=torch.float32, device="cuda")
    overhead = {} if case.segment_overhead is None else {"segment_overhead": case.segment_overhead}
    plan = SplitPlan.empty(batch, default_num_ctas("cuda", case.heads, case.q_len), device="cuda", **overhead)
    ws = DecodeWorkspace.for_plan(plan, case.q_len, case.heads)
    return CaseInputs(q, kv, block_table, seq_lens, torch.tensor([0.05], device="cuda"),
                      torch.tensor([0.05], device="cuda"), out, lse, plan, ws, 1.0 / (KV_DIM ** 0.5))


def capture(*fns) -> "torch.cuda.CUDAGraph":
    """A CUDA graph of fns called in order."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in fns:
            fn()
    return graph


def time_replay(graph, flush: torch.Tensor, flush_mode: str = "read", spin: bool = True) -> float:
    """Seconds of one replay of `graph` by CUDA events, after the L2 flush and (spin) the spin kernel that keeps
    the GPU busy while the host enqueues the start event, the launch and the end event (run_case)."""
    flush_l2(flush, flush_mode)
    if spin:
        torch.cuda._sleep(SPIN_CYCLES)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e-3


def run_case(case: Case, bandwidth: float, fp8_flops: float, reps: int, check: bool, kernel_times: bool = False,
             flush_mode: str = "read", kv_pool: Optional[torch.Tensor] = None, page_order: str = "random"):
    from mla_backend import mla_decode_reference

    inp = case_inputs(case, kv_pool, page_order)
    q, kv, block_table, seq_lens, plan, ws = inp.q, inp.kv, inp.block_table, inp.seq_lens, inp.plan, inp.ws
    q_scale, k_scale, out, lse, scale = inp.q_scale, inp.k_scale, inp.out, inp.lse, inp.softmax_scale

    def step():
        inp.plan_step(case)
        inp.decode_step()

    step()  # compile and warm up outside the graph
    torch.cuda.synchronize()
    if check:
        ref_out, ref_lse = mla_decode_reference(q, kv, block_table, seq_lens, softmax_scale=scale,
                                                q_scale=q_scale, k_scale=k_scale)
        err = ((out.float() - ref_out.float()).norm() / ref_out.float().norm()).item()
        case.results["rel_err"] = err
    graph = capture(step)
    flush = torch.zeros(L2_FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    # Each timed replay follows the flush and a spin kernel (no memory traffic) that keeps the GPU busy while the
    # host enqueues the start event, the graph launch and the end event. Without it the events also caught GPU
    # idle time whenever the host's graph launch fell behind the flush: the same decode kernel (558-560 us in
    # the profiler trace) measured 565-645 us as a 1M x B4 step depending on the process (docs/performance.md,
    # "Step time by events"). In an engine the step's kernels follow other GPU work inside one graph.
    # Both are recorded: time_us (spin first, the table) and exposed_us (the old timing).
    times, exposed = [], []
    for rep in range(2 * reps):
        spin = rep % 2 == 0
        (times if spin else exposed).append(time_replay(graph, flush, flush_mode, spin))
    if kernel_times:
        for kind, us in trace_kernel_durations(graph, flush, reps, flush_mode).items():
            case.results[f"{kind}_kernel_us"] = us
    # The planner and the combine alone (graph replays, L2 warm: their inputs are small). The spin kernel first:
    # 20 replays of a few-us graph are enqueued while it runs, so the events time the GPU (each kernel plus the
    # gap between graph launches), not the host's launch rate.
    from mla_backend.hopper.combine_sm90 import run_combine_sm90

    def combine_only():
        run_combine_sm90(plan, ws.partial_out, ws.partial_lse, out, lse, k_scale, torch.cuda.current_stream())

    for key, fn in (("planner_us", lambda: inp.plan_step(case)), ("combine_us", combine_only)):
        part = capture(fn)
        part.replay()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(SPIN_CYCLES)
        start.record()
        for _ in range(20):
            part.replay()
        end.record()
        end.synchronize()
        case.results[key] = start.elapsed_time(end) * 1e3 / 20
        if kernel_times:
            # the kernel's own duration in those replays, without the graph launch that each replay pays
            kind = key[:-len("_us")]
            case.results[f"{kind}_alone_kernel_us"] = trace_kernel_durations(part, None, 20)[kind]
    bytes_moved, flops = case_bytes_and_flops(case)
    floor = max(bytes_moved / bandwidth, flops / fp8_flops)
    t = statistics.median(times)
    case.results.update(time_us=t * 1e6, floor_us=floor * 1e6, ratio=t / floor, kv_mb=bytes_moved / 1e6,
                        bound="memory" if bytes_moved / bandwidth >= flops / fp8_flops else "fp8 compute",
                        spread=(max(times) - min(times)) / t, exposed_us=statistics.median(exposed) * 1e6)
    del kv, inp, graph, flush
    if kv_pool is None:
        torch.cuda.empty_cache()  # the per-case allocations go back to the driver (the old bench's behaviour)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mla_backend bench", description=__doc__)
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--extended", action="store_true", help="also H16/H128, page 64, ragged and serving mixes")
    parser.add_argument("--only", default="", help="run only cases whose name contains this text ('a|b': either)")
    parser.add_argument("--check", action="store_true", help="compare each case with the reference")
    parser.add_argument("--segment-overhead", type=int, action="append", default=None,
                        help="the planner's per-segment cost in tiles (default: the planner's); repeat to compare")
    parser.add_argument("--kernel-times", action="store_true",
                        help="also trace the replays (torch.profiler) for each kernel's own duration in the step")
    parser.add_argument("--p-planes", type=int, choices=(1, 2), default=None,
                        help="e4m3 planes of P in the P.V MMA (sets CUTE_MLA_P_PLANES; default: 2, hi/lo)")
    parser.add_argument("--l2-flush", choices=("read", "write"), default="read",
                        help="how the L2 is emptied before each timed replay: read a 256 MB buffer (default) or "
                             "write it, which leaves up to 50 MB of dirty lines to write back during the step")
    parser.add_argument("--kv-alloc", choices=("pool", "per-case"), default="pool",
                        help="one KV pool allocated at the start, as an engine does (default), or an allocation "
                             "per case after the previous case's memory was freed")
    parser.add_argument("--page-order", choices=("random", "in-order"), default="random",
                        help="the pages the block tables point at: a random permutation of the pool (default) or "
                             "the pool's pages in order")
    parser.add_argument("--out-dir", default=os.environ.get("OUT", "bench-results"))
    args = parser.parse_args(argv)
    if args.p_planes is not None:
        os.environ["CUTE_MLA_P_PLANES"] = str(args.p_planes)
    if not torch.cuda.is_available():
        print("bench needs a CUDA GPU (Hopper)", file=sys.stderr)
        return 2

    cases = default_cases() + (extended_cases() if args.extended else [])
    cases = [c for c in cases if any(part in c.name for part in args.only.split("|"))]
    if args.segment_overhead:  # one row per (case, overhead), named by the overhead
        cases = [replace(c, name=f"{c.name} overhead {o}", segment_overhead=o, results={})
                 for c in cases for o in args.segment_overhead]
    # the KV pool first, before any other large allocation is made and freed (module docstring)
    kv_pool = None
    if args.kv_alloc == "pool" and cases:
        kv_pool = torch.empty(max(case_kv_bytes(c) for c in cases), dtype=torch.uint8, device="cuda")

    bandwidth = measure_read_bandwidth()
    fp8 = measure_fp8_flops()
    from mla_backend.hopper.decode_sm90 import default_p_planes

    print(f"{torch.cuda.get_device_name(0)}: read bandwidth {bandwidth / 1e12:.2f} TB/s, "
          f"FP8 GEMM {fp8 / 1e12:.0f} TFLOP/s, P in {default_p_planes(12, 8)} e4m3 plane(s) above 16 query rows, "
          f"L2 flush by {args.l2_flush}, KV {'one pool' if kv_pool is not None else 'allocated per case'}, "
          f"pages {args.page_order}")
    for case in cases:
        t0 = time.perf_counter()
        run_case(case, bandwidth, fp8, args.reps, args.check, args.kernel_times, args.l2_flush, kv_pool,
                 args.page_order)
        r = case.results
        kernels = "".join(f"  {kind} kernel {r[kind + '_kernel_us']:.1f} us" for kind in KERNEL_NAMES + ALONE_NAMES
                          if kind + "_kernel_us" in r)
        print(f"  {case.name:<28} {r['time_us']:9.1f} us  floor {r['floor_us']:8.1f} us  ratio {r['ratio']:5.2f}"
              + f"  planner {r['planner_us']:5.1f} us  combine {r['combine_us']:5.1f} us" + kernels
              + (f"  err {r['rel_err']:.1e}" if "rel_err" in r else "") + f"  ({time.perf_counter() - t0:.0f} s)",
              flush=True)

    os.makedirs(args.out_dir, exist_ok=True)
    csv_path = os.path.join(args.out_dir, "bench_decode.csv")
    keys = (["time_us", "floor_us", "ratio", "kv_mb", "bound", "spread", "planner_us", "combine_us", "exposed_us"]
            + ([f"{kind}_kernel_us" for kind in KERNEL_NAMES + ALONE_NAMES] if args.kernel_times else [])
            + (["rel_err"] if args.check else []))
    with open(csv_path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["case", "heads", "q_len", "page", "batch"] + keys)
        for c in cases:
            w.writerow([c.name, c.heads, c.q_len, c.page_size, len(c.lengths)] + [c.results.get(k, "") for k in keys])
    print()
    extra = KERNEL_NAMES + ALONE_NAMES if args.kernel_times else []
    print("| case | time (us) | floor (us) | time / floor | bound | planner (us) | combine (us) | no spin (us) |"
          + "".join(f" {kind} kernel (us) |" for kind in extra))
    print("| --- | ---: | ---: | ---: | --- | ---: | ---: | ---: |" + " ---: |" * len(extra))
    for c in cases:
        r = c.results
        print(f"| {c.name} | {r['time_us']:.1f} | {r['floor_us']:.1f} | {r['ratio']:.2f} | {r['bound']} "
              f"| {r['planner_us']:.1f} | {r['combine_us']:.1f} | {r['exposed_us']:.1f} |"
              + "".join(f" {r.get(kind + '_kernel_us', float('nan')):.1f} |" for kind in extra))
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(10, 0.3 * len(cases) + 1.5))
        ax.barh([c.name for c in cases][::-1], [c.results["ratio"] for c in cases][::-1])
        ax.axvline(1.0, color="k", lw=0.8)
        ax.set_xlabel("step time / floor")
        fig.tight_layout()
        fig.savefig(os.path.join(args.out_dir, "bench_decode.png"), dpi=100)
    except ImportError:
        print("(matplotlib not installed: no plot; pip install cute-mla-fp8[bench])")
    print(f"wrote {csv_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
