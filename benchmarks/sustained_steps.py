"""Decode steps replayed back to back for seconds at a time, with the SM clock and the board power sampled
meanwhile: the regime of a busy engine, which on an H100 runs at its power limit, where the step bench's flushed,
spin-led replays (`python -m mla_backend bench`) start every step from an idle, full-clock GPU.

    python benchmarks/sustained_steps.py --case "128 1 64 1048576 4" --case "12 8 64 1048576 1" \\
        --peer flashmla --peer-path FLASHMLA --decode --variant kv_load_copies=2

For each case: our step (planner, decode, combine) in one CUDA graph, as the step bench captures it; with
`--peer flashmla` FlashMLA's step on the same inputs (its metadata kernel and decode, in a graph of its own;
`mla_backend.bench.peers`, `--peer-path` as the bench's); with `--decode` our decode kernel alone, and each
`--variant SPEC` of it (bench_decode_kernel.py's SPECs). Each is replayed with nothing between the replays (no L2
flush, no spin kernel) for `--seconds`, while `nvidia-smi` samples the SM clock, the board power and the throttle
reasons every 50 ms; the versions take turns, `--rounds` times, so that temperature drift hits all of them alike.
Reported per version: microseconds a replay (GPU time by CUDA events over the whole run, divided by the replays),
and over the samples with the GPU busy (power above `BUSY_WATTS`) the median and lowest SM clock, the median
power, the share of samples with the software power cap among the throttle reasons, and the energy a replay (the
median power times the time a replay); with a peer, ours / the peer's time and energy.

The KV of the long cases is far larger than the L2, so back-to-back replays read it from DRAM as flushed ones do;
short cases whose KV fits the L2 (50 MB on an H100) read it from there after the first replay.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

PROG = "sustained_steps.py"
BUSY_WATTS = 150.0  # samples above this are the GPU at work (an idle H100 or H200 draws 70-130 W)
SAMPLE_MS = 50
SW_POWER_CAP = 0x4  # nvidia-smi's clocks_throttle_reasons bit for the software power cap
SMI_QUERY = "timestamp,clocks.sm,power.draw,clocks_throttle_reasons.active"


def error(message) -> int:
    print(f"{PROG}: error: {message}", file=sys.stderr)
    return 2


def summarize_samples(lines):
    """nvidia-smi CSV lines (`SMI_QUERY`, noheader, nounits) -> a dict over the busy samples: count, clock_median
    and clock_min (MHz), power_median (W), capped (the share with the software power cap); None where no sample
    was busy. Lines that are not samples (a warning, a cut-off last line) are left out."""
    busy = []
    for line in lines:
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 4:
            continue
        try:
            clock, power, reasons = float(parts[1]), float(parts[2]), int(parts[3], 16)
        except ValueError:
            continue
        if power > BUSY_WATTS:
            busy.append((clock, power, reasons))
    if not busy:
        return None
    return {"count": len(busy), "clock_median": statistics.median(c for c, _, _ in busy),
            "clock_min": min(c for c, _, _ in busy), "power_median": statistics.median(p for _, p, _ in busy),
            "capped": sum(1 for _, _, r in busy if r & SW_POWER_CAP) / len(busy)}


def run_sustained(fn, seconds: float, smi: str, folder: str, tag: str):
    """Replay fn() back to back for `seconds` while nvidia-smi samples into a file; (us a replay, samples dict)."""
    import torch

    path = os.path.join(folder, f"{tag}.csv")
    with open(path, "w") as out:
        sampler = subprocess.Popen([smi, f"--query-gpu={SMI_QUERY}", "--format=csv,noheader,nounits",
                                    "-lms", str(SAMPLE_MS)], stdout=out, stderr=subprocess.DEVNULL)
        try:
            time.sleep(0.3)  # the sampler's first samples are of the idle GPU: left out as not busy
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            n = 0
            t0 = time.time()
            start.record()
            while time.time() - t0 < seconds:
                for _ in range(10):
                    fn()
                n += 10
                if n % 100 == 0:
                    torch.cuda.synchronize()  # the host stays at most 100 replays ahead
            end.record()
            end.synchronize()
            time.sleep(0.2)
        finally:
            sampler.terminate()
            sampler.wait()
    with open(path) as f:
        samples = summarize_samples(f)
    return start.elapsed_time(end) * 1e3 / n, samples


def case_versions(case, peer, peer_path, decode, variants):
    """[(name, callable)] of one case: our step as a graph replay, the peer's, our decode alone and its variants."""
    import bench_decode_kernel as bk

    import torch

    from mla_backend.bench.cases import case_inputs
    from mla_backend.bench.timing import capture
    from mla_backend.hopper.decode import compile_decode

    bench_case = bk.step_case(*case)
    inp = case_inputs(bench_case)

    def step():
        inp.plan_step(bench_case)
        inp.decode_step()

    step()  # compile and warm up outside the graph
    versions = [("ours", capture(step).replay)]
    if peer is not None:
        from mla_backend.bench.peers import peer_step

        peer_fn = peer_step(peer, peer_path, inp, bench_case)
        peer_fn()
        versions.append((peer, capture(peer_fn).replay))
    if decode:
        inp.plan_step(bench_case)
        for name, overrides in [("decode", None), *variants]:
            cfg = bk.case_config(case, overrides)
            compile_decode(cfg)
            versions.append((name if overrides is None else f"decode {name}", bk.decode_fn(cfg, inp)))
    for _, fn in versions:
        fn()
    torch.cuda.synchronize()
    return versions


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    p.add_argument("--case", action="append", default=[], help='"heads q_len page kv batch" (repeatable)')
    p.add_argument("--peer", choices=["flashmla"], default=None, help="also the peer's step on the same inputs")
    p.add_argument("--peer-path", default=None, help="where the peer is (as the step bench's --peer-path)")
    p.add_argument("--decode", action="store_true", help="also our decode kernel alone")
    p.add_argument("--variant", action="append", default=[], help="a decode variant (with --decode; repeatable)")
    p.add_argument("--seconds", type=float, default=4.0, help="seconds of replays a version and round")
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args(argv)
    import bench_decode_kernel as bk

    try:
        cases = [bk.parse_case(c) for c in args.case or ["128 1 64 1048576 4"]]
        variants = [(spec, bk.parse_variant(spec)) for spec in args.variant]
        for case in cases:
            for spec, overrides in variants:
                bk.case_config(case, overrides)
    except ValueError as err:
        return error(err)
    if variants and not args.decode:
        return error("--variant times a decode variant: give --decode too")
    if not 0 < args.seconds <= 60:
        return error(f"--seconds must be in (0, 60], got {args.seconds}")
    if args.rounds < 1:
        return error(f"--rounds must be at least 1, got {args.rounds}")
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return error("needs nvidia-smi on PATH (it samples the clock and the power)")
    import torch

    if not torch.cuda.is_available():
        return error("needs a CUDA GPU (Hopper)")
    print(f"{torch.cuda.get_device_name(0)}: back-to-back replays, {args.seconds:g} s a version and round, "
          f"{args.rounds} rounds")
    with tempfile.TemporaryDirectory() as folder:
        for case in cases:
            label = "H{} q{} page {} {} x B{}".format(*case)
            versions = case_versions(case, args.peer, args.peer_path, args.decode, variants)
            results = {name: [] for name, _ in versions}
            for r in range(args.rounds):
                for i, (name, fn) in enumerate(versions):
                    results[name].append(run_sustained(fn, args.seconds, smi, folder, f"r{r}_{i}"))
            summary = {}
            for name, runs in results.items():
                us = statistics.median(u for u, _ in runs)
                samples = [s for _, s in runs if s is not None]
                if not samples:
                    print(f"  {label} {name}: {us:.1f} us a replay; no busy samples")
                    continue
                clock = statistics.median(s["clock_median"] for s in samples)
                power = statistics.median(s["power_median"] for s in samples)
                summary[name] = (us, power * us * 1e-3)
                print(f"  {label} {name}: {us:.1f} us a replay (rounds {', '.join(f'{u:.1f}' for u, _ in runs)}); "
                      f"SM clock median {clock:.0f} MHz, lowest {min(s['clock_min'] for s in samples):.0f}; "
                      f"power median {power:.0f} W; power-capped {statistics.median(s['capped'] for s in samples):.0%}"
                      f"; {power * us * 1e-3:.1f} mJ a replay")
            if args.peer in summary and "ours" in summary:
                (ours, e_ours), (peer, e_peer) = summary["ours"], summary[args.peer]
                print(f"  {label}: ours / {args.peer} {ours / peer:.2f} in time, {e_ours / e_peer:.2f} in energy")
    return 0


if __name__ == "__main__":
    sys.exit(main())
