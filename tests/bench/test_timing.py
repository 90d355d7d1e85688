"""benchmarks/bench_decode.py --kernel-times: a profiler trace of graph replays, cut into steps at the L2 flush,
gives each of our kernels' median duration and the step's span without its graph launch."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

import bench_decode  # noqa: E402

PLAN = "kernel_cutlass_kernel_mla_backendhopperplan_splits_sm90PlanSplitsSM90_object_at_0"
DECODE = "kernel_cutlass_kernel_mla_backendhopperdecode_sm90MLADecodeSM90_object_at_0"
COMBINE = "kernel_cutlass_kernel_mla_backendhoppercombine_sm90CombineSplitsSM90_object_at_0"
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
    got = bench_decode.step_kernel_durations(trace([(3.0, 100.0, 6.0), (2.0, 110.0, 5.0), (4.0, 90.0, 7.0)]))
    assert got["planner"] == 3.0 and got["decode"] == 100.0 and got["combine"] == 6.0
    # each step spans its three kernels plus two 0.5-us gaps; median of 110.0, 118.0, 102.0
    assert abs(got["step"] - 110.0) < 1e-9


def test_flush_separates_steps_and_other_kernels_are_ignored():
    # a second step with the decode kernel only (a batch of single-split requests still runs all three; this
    # checks the grouping), then an unrelated kernel, which ends the step like the flush does
    events = trace([(3.0, 100.0, 6.0)]) + [(FLUSH, 1000.0, 1050.0), (DECODE, 1060.0, 1160.0),
                                           ("sm90_xmma_gemm_e4m3", 1161.0, 1300.0)]
    got = bench_decode.step_kernel_durations(events)
    assert got["decode"] == 100.0 and got["planner"] == 3.0 and got["combine"] == 6.0
    assert got["step"] == 105.0  # median of the spans 110 and 100


def test_case_kv_views_the_pool():
    """Each case's pages are the first bytes of the run's one KV pool (as in an engine's cache), shaped
    [pages, page_size, 576]; a pool too small for a case is an error, and without a pool a case allocates."""
    import pytest
    import torch

    small = bench_decode.Case("a", [33, 64], page_size=32)  # 2 + 2 pages + 1 spare
    large = bench_decode.Case("b", [1000], page_size=64)  # 16 pages + 1 spare
    assert bench_decode.case_kv_bytes(small) == 5 * 32 * 576
    assert bench_decode.case_kv_bytes(large) == 17 * 64 * 576
    pool = torch.zeros(max(bench_decode.case_kv_bytes(c) for c in (small, large)), dtype=torch.uint8)
    kv = bench_decode.case_kv(pool, small, device="cpu")
    assert kv.shape == (5, 32, 576) and kv.data_ptr() == pool.data_ptr()
    kv.fill_(7)
    assert int(pool[:5 * 32 * 576].sum()) == 7 * 5 * 32 * 576 and int(pool[5 * 32 * 576:].sum()) == 0
    assert bench_decode.case_kv(pool, large, device="cpu").shape == (17, 64, 576)
    with pytest.raises(ValueError, match="KV pool"):
        bench_decode.case_kv(pool[:100], large, device="cpu")
    fresh = bench_decode.case_kv(None, small, device="cpu")
    assert fresh.shape == (5, 32, 576) and fresh.data_ptr() != pool.data_ptr()


def test_back_to_back_replays_of_one_kernel_give_its_median_duration():
    # --kernel-times traces the planner's and the combine's own graphs replayed without a flush between them:
    # all their kernels fall in one run, and the median is over the kernels, not over steps
    events, t = [], 0.0
    for us in (2.0, 1.5, 9.0, 1.6, 1.7):
        events.append((COMBINE, t, t + us))
        t += us + 3.0  # the graph launch between replays
    assert abs(bench_decode.step_kernel_durations(events)["combine"] - 1.7) < 1e-9
