"""The one-CTA planner kernel (mla_backend.hopper.planner): compiles for sm_90a on CPU in both forms; on the GPU its
plan equals the torch planner's."""

import pytest
import torch

from mla_backend import SplitPlan, plan_splits
from mla_backend.config import WARP_PLANNER_MAX_BATCH, PlannerConfig, planner_config
from mla_backend.hopper.planner import compile_planner


@pytest.mark.parametrize("max_batch,num_ctas", [(1, 1), (16, 132), (64, 66), (65, 132), (256, 132), (1024, 264),
                                                (3000, 7)])
def test_planner_kernel_compiles_for_sm90a(max_batch, num_ctas):
    assert compile_planner(planner_config(max_batch, num_ctas, 64, 5)) is not None


def test_small_plans_use_the_barrier_free_warp_form():
    from mla_backend.hopper import planner as m

    def form(*key, kind="warp"):
        return m.FORMS[kind](PlannerConfig(*key, form=kind))

    warp_form = form(WARP_PLANNER_MAX_BATCH, 132, 64, 4)
    assert (warp_form.per_lane, warp_form.boundary_warps, warp_form.threads) == (2, 5, 192)
    assert form(8, 66, 64, 4).threads == 4 * 32  # 67 boundaries: 3 warps, and the request warp
    assert form(256, 132, 64, 4, kind="cta").threads == m.THREADS
    # (p + 1) * N in int32 where no total can overflow it, else chosen per total at run time
    assert not form(16, 132, 64, 4).wide_cta_of_cost
    assert form(64, 132, 64, 4).wide_cta_of_cost


def batches(gen):
    yield [0]
    yield [1]
    yield [1 << 20]
    yield [1 << 20] + [4096] * 15
    yield [131072] + [2048] * 63
    yield [0] * 200
    yield [0, 1, 63, 64, 65, 4096, 131072, 1 << 20] * 20
    yield [2 ** 31 - 1, -5, 3, (1 << 24) + 1, -(2 ** 31)]  # garbage a graph may be replayed with: clamped
    for n in (59, 60):  # max_batch 64 and 65: the largest plan of the warp form, the smallest of the CTA form
        yield [(4096 * b + 33) % 70000 for b in range(n)]
    for _ in range(40):
        n = int(torch.randint(1, 300, (1,), generator=gen))
        top = int(torch.randint(1, 1 << 20, (1,), generator=gen))
        yield torch.randint(0, top, (n,), generator=gen).tolist()


@pytest.mark.gpu
@pytest.mark.parametrize("num_ctas,overhead,tile", [(132, 5, 64), (7, 0, 64), (264, 3, 32), (1, 5, 64)])
def test_planner_kernel_equals_torch_planner(num_ctas, overhead, tile):
    gen = torch.Generator().manual_seed(num_ctas + overhead)
    for lengths in batches(gen):
        max_batch = len(lengths) + 5
        seq_lens = torch.tensor(lengths, dtype=torch.int32)
        want = plan_splits(seq_lens, q_len=1, num_heads=12, page_size=32, tile_tokens=tile, num_ctas=num_ctas,
                           max_batch=max_batch, segment_overhead=overhead)
        plan = SplitPlan.empty(max_batch, num_ctas, tile, overhead, device="cuda")
        for t in plan.tensors():
            t.fill_(-7)  # every entry must be written
        got = plan_splits(seq_lens.cuda(), q_len=1, num_heads=12, page_size=32, out=plan)
        names = ["cta_tile_start", "cta_first_request", "request_tile_start", "request_first_cta", "num_splits",
                 "split_offset"]
        for name, a, b in zip(names, got.tensors(), want.tensors()):
            assert torch.equal(a.cpu(), b), (name, lengths[:8], a.cpu()[:16], b[:16])
