"""mla_backend.bench.timing: a profiler trace of graph replays, cut into steps at the L2 flush, gives each of our
kernels' median duration and the step's span without its graph launch; the kernel kinds' markers match the
entry names the kernels are compiled to (what CUPTI reports as the kernel's name)."""

import json
import os
import re
import subprocess
import sys

from mla_backend.bench import timing

# entry names as CuTe DSL 4.8 compiles them (the schedule's module and class, then the arguments), shortened
PLAN = "kernel_cutlass_kernel_mla_backendhopperplannerWarpPlanSplitsSM90_object_at__tensorptri32gmemo1_0"
DECODE = "kernel_cutlass_kernel_mla_backendhopperdecode_swgMLADecodeSwgSM90_object_at__tensorptrf8E4M3FN_0"
COMBINE = "kernel_cutlass_kernel_mla_backendhoppercombineCombineSplitsSM90_object_at__tensorptrf16gmem_0"
FLUSH = "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<unsigned char>>"


def trace(steps):
    """(name, start, end) events: a flush, then planner, decode, combine with the given durations, per step."""
    events, t = [], 0.0
    for plan_us, decode_us, combine_us in steps:
        events.append((FLUSH, t, t + 50.0))
        t += 60.0
        for name, us in ((PLAN, plan_us), (DECODE, decode_us), (COMBINE, combine_us)):
            events.append((name, t, t + us))
            t += us + 0.5  # the gap between kernels
    return events


def test_medians_per_kernel_and_step_span():
    got = timing.step_kernel_durations(trace([(3.0, 100.0, 6.0), (2.0, 110.0, 5.0), (4.0, 90.0, 7.0)]))
    assert got["planner"] == 3.0 and got["decode"] == 100.0 and got["combine"] == 6.0
    # each step spans its three kernels plus two 0.5-us gaps; median of 110.0, 118.0, 102.0
    assert abs(got["step"] - 110.0) < 1e-9


def test_flush_separates_steps_and_other_kernels_are_ignored():
    # a second step with the decode kernel only (a batch of single-split requests still runs all three; this
    # checks the grouping), then an unrelated kernel, which ends the step like the flush does
    events = trace([(3.0, 100.0, 6.0)]) + [(FLUSH, 1000.0, 1050.0), (DECODE, 1060.0, 1160.0),
                                           ("sm90_xmma_gemm_e4m3", 1161.0, 1300.0)]
    got = timing.step_kernel_durations(events)
    assert got["decode"] == 100.0 and got["planner"] == 3.0 and got["combine"] == 6.0
    assert got["step"] == 105.0  # median of the spans 110 and 100


def test_back_to_back_replays_of_one_kernel_give_its_median_duration():
    # --kernel-times traces the planner's and the combine's own graphs replayed without a flush between them:
    # all their kernels fall in one run, and the median is over the kernels, not over steps
    events, t = [], 0.0
    for us in (2.0, 1.5, 9.0, 1.6, 1.7):
        events.append((COMBINE, t, t + us))
        t += us + 3.0  # the graph launch between replays
    assert abs(timing.step_kernel_durations(events)["combine"] - 1.7) < 1e-9


# compiled in a subprocess, so that CUTE_DSL_KEEP applies to a fresh DSL; one PTX file per kernel class
_COMPILE = """
import sys
from mla_backend import config
from mla_backend.hopper.combine import compile_combine
from mla_backend.hopper.decode import compile_decode
from mla_backend.hopper.planner import compile_planner
compile_decode(config.decode_config(12, 1, 32))  # 16 rows: the ping-pong schedule
compile_decode(config.decode_config(12, 4, 32))  # 48 rows: the S^T warpgroup schedule
compile_decode(config.decode_config(12, 8, 32))  # two 64-row blocks: the chunk-pairs schedule
compile_planner(config.PlannerConfig(16, 132, 64, 4, form="warp"))
compile_planner(config.PlannerConfig(512, 132, 64, 4, form="cta"))
compile_combine(config.combine_config(4, 12, 132, 132))  # (both modes are one class: one entry name)
"""


def test_each_compiled_kernel_is_found_by_its_own_kind_only(tmp_path):
    import mla_backend

    root = os.path.dirname(os.path.dirname(os.path.abspath(mla_backend.__file__)))
    env = dict(os.environ, CUTE_DSL_ARCH="sm_90a", CUTE_DSL_KEEP="ptx", CUTE_DSL_DUMP_DIR=str(tmp_path),
               PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p))
    env.pop("CUTE_MLA_KERNEL_CACHE", None)  # a kernel loaded from a cache directory leaves no PTX
    subprocess.run([sys.executable, "-c", _COMPILE], env=env, check=True, capture_output=True)
    entries = sorted(e for path in tmp_path.glob("*.ptx") for e in re.findall(r"\.entry (\w+)\(", path.read_text()))
    kinds = {e: [kind for kind, marker in timing.KERNEL_KINDS if marker in e] for e in entries}
    assert sorted(k for ks in kinds.values() for k in ks) == ["combine"] + ["decode"] * 3 + ["planner"] * 2, \
        json.dumps(kinds, indent=1)
    assert all(len(ks) == 1 for ks in kinds.values())
    # and a trace of those names is cut into steps by kind
    by_kind = {ks[0]: e for e, ks in kinds.items()}
    events = [(FLUSH, 0.0, 50.0), (by_kind["planner"], 60.0, 62.0), (by_kind["decode"], 62.5, 162.5),
              (by_kind["combine"], 163.0, 168.0)]
    assert timing.step_kernel_durations(events) == {"planner": 2.0, "decode": 100.0, "combine": 5.0, "step": 108.0}


class _CountingGraph:
    def __init__(self, log, name):
        self.log, self.name = log, name

    def replay(self):
        self.log.append(self.name)


def test_settle_waits_then_replays_each_graph_after_a_flush(monkeypatch):
    import time

    import torch

    log, waits = [], []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: log.append("sync"))
    monkeypatch.setattr(time, "sleep", lambda s: waits.append(s))
    monkeypatch.setattr(timing, "flush_l2", lambda buf, mode="read": log.append(f"flush {mode}"))
    monkeypatch.setattr(timing, "WARM_UP_SECONDS", 0.02)
    timing.settle((_CountingGraph(log, "a"), None, _CountingGraph(log, "b")), torch.zeros(8), "write")
    assert waits == [timing.SETTLE_SECONDS] and log[0] == "sync" and log[-1] == "sync"
    rounds = [r for r in " ".join(log[1:-1]).split(" sync") if r.strip()]
    assert rounds and all(r.split() == ["flush", "write", "a", "flush", "write", "b"] for r in rounds)
    log.clear()
    timing.settle()  # nothing to replay: the wait alone
    assert log == ["sync", "sync"] and waits == [timing.SETTLE_SECONDS] * 2
