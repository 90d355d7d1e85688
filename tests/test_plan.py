"""Invariants of the device-side split planner, as property tests."""

import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from mla_backend import SplitPlan, plan_splits
from mla_backend.plan import batch_bucket, default_num_ctas

TILE = 64
EDGE_LENGTHS = [0, 1, TILE - 1, TILE, TILE + 1, 4096, 131072, 1 << 20]


def check_plan(lengths, num_ctas, overhead=5, max_batch=None):
    seq_lens = torch.tensor(lengths, dtype=torch.int32)
    plan = plan_splits(seq_lens, q_len=1, num_heads=12, page_size=32, tile_tokens=TILE, num_ctas=num_ctas,
                       max_batch=max_batch, segment_overhead=overhead)
    segs = plan.segments().tolist()
    tiles = [-(-n // TILE) for n in lengths]

    # Every tile of every request is covered exactly once, in order, by segments of >= 1 tile.
    covered = {b: [] for b in range(len(lengths))}
    for cta, b, t0, t1 in segs:
        assert 0 <= cta < num_ctas
        assert t1 - t0 >= 1, "a segment holds at least one tile"
        covered[b].append((t0, t1))
    for b, ranges in covered.items():
        expect = 0
        for t0, t1 in ranges:
            assert t0 == expect, f"request {b}: tiles not contiguous/in order: {ranges}"
            expect = t1
        assert expect == tiles[b], f"request {b}: covered {expect} of {tiles[b]} tiles"
    # Segments run in (cta, request) order: each CTA walks a contiguous run of the batch.
    assert segs == sorted(segs)

    # num_splits and the workspace slots agree with the segments.
    splits = plan.num_splits.tolist()
    for b in range(len(lengths)):
        assert splits[b] == len(covered[b])
        if covered[b]:
            first_cta = [c for c, rb, _, _ in segs if rb == b][0]
            assert int(plan.request_first_cta[b]) == first_cta
    offsets = plan.split_offset.tolist()
    slots = set()
    for cta, b, _, _ in segs:
        if splits[b] > 1:
            slot = offsets[b] + cta - int(plan.request_first_cta[b])
            assert 0 <= slot < plan.num_slots and slot not in slots
            slots.add(slot)

    # Balance: the busiest CTA costs at most ceil(total / num_ctas) + one segment overhead + one tile.
    total = sum(t + overhead * (t > 0) for t in tiles)
    costs = plan.cta_costs().tolist()
    assert sum(1 for c in costs if c) <= num_ctas
    assert max(costs) <= math.ceil(total / num_ctas) + overhead + 1, (max(costs), total, num_ctas)

    # Deterministic.
    again = plan_splits(seq_lens, q_len=1, num_heads=12, page_size=32, tile_tokens=TILE, num_ctas=num_ctas,
                        max_batch=max_batch, segment_overhead=overhead)
    for a, b in zip(plan.tensors(), again.tensors()):
        assert torch.equal(a, b)
    return plan


lengths_strategy = st.one_of(
    st.lists(st.sampled_from(EDGE_LENGTHS), min_size=1, max_size=256),  # edges, including 1M
    st.lists(st.integers(0, 70_000), min_size=1, max_size=256),  # random
    st.builds(lambda n, b: [n] * b, st.integers(0, 1 << 20), st.integers(1, 256)),  # uniform
    st.builds(lambda long, short, b: [long] + [short] * b,  # heavily skewed
              st.integers(100_000, 1 << 20), st.integers(0, 4096), st.integers(0, 255)),
)


@settings(max_examples=300, deadline=None)
@given(lengths=lengths_strategy, num_ctas=st.sampled_from([1, 2, 7, 66, 132, 264]), overhead=st.integers(0, 8))
def test_plan_invariants(lengths, num_ctas, overhead):
    check_plan(lengths, num_ctas, overhead)


@pytest.mark.parametrize("lengths", [[0], [0] * 256, [1], [1 << 20], [1 << 20] + [4096] * 15,
                                     [131072] + [2048] * 63, EDGE_LENGTHS * 32])
def test_plan_named_batches(lengths):
    check_plan(lengths, 132)


def test_workspace_slots_are_bounded_by_two_per_cta():
    """A CTA holds pieces of at most two split requests (those crossing its first and last boundary), so a plan
    needs at most num_ctas + min(max_batch, num_ctas) workspace slots, far fewer than max_batch + num_ctas for
    an engine's 1024-request plans."""
    plan = SplitPlan.empty(max_batch=1024, num_ctas=132)
    assert plan.num_slots == 264
    assert SplitPlan.empty(max_batch=8, num_ctas=132).num_slots == 140
    # the worst case: every CTA boundary inside a request, and short requests that split across a boundary
    for lengths in ([130] * 1024, [64 * 7] * 300, [64 * 3, 64 * 200] * 60):
        check_plan(lengths, 132, overhead=4, max_batch=1024)


def test_all_empty_batch_leaves_every_cta_idle():
    plan = check_plan([0] * 8, 132)
    assert plan.segments().shape == (0, 4)
    assert torch.all(plan.num_splits == 0)


def test_one_long_request_fills_the_gpu():
    plan = check_plan([1 << 20], 132)
    assert int(plan.num_splits[0]) == 132
    costs = plan.cta_costs()
    assert int(costs.max()) - int(costs.min()) <= 1 + 5


def test_padding_to_max_batch_and_refilling_buffers_in_place():
    plan = SplitPlan.empty(max_batch=16, num_ctas=32, tile_tokens=TILE)
    buffers = [t.data_ptr() for t in plan.tensors()]
    for lengths in ([5000, 3], [1 << 20] * 16, [0, 0, 0]):
        seq_lens = torch.tensor(lengths, dtype=torch.int32)
        again = plan_splits(seq_lens, q_len=1, num_heads=12, page_size=32, out=plan)
        assert again is plan and [t.data_ptr() for t in plan.tensors()] == buffers
        fresh = plan_splits(seq_lens, q_len=1, num_heads=12, page_size=32, tile_tokens=TILE, num_ctas=32,
                            max_batch=16)
        for a, b in zip(plan.tensors(), fresh.tensors()):
            assert torch.equal(a, b)
        assert torch.all(plan.num_splits[len(lengths):] == 0)


def test_default_num_ctas_makes_one_wave_of_decode_ctas():
    # no GPU here: an H200's 132 SMs; the decode runs row blocks x plan CTAs
    assert default_num_ctas() == 132
    assert default_num_ctas(None, 12, 1) == 132  # 12 rows: one 16-row block
    assert default_num_ctas(None, 16, 4) == 132  # 64 rows: one block
    assert default_num_ctas(None, 12, 8) == 66  # 96 rows: two blocks of 48
    assert default_num_ctas(None, 128, 1) == 66  # two blocks of 64
    assert default_num_ctas(None, 24, 8) == 44  # 192 rows: three blocks of 64
    assert default_num_ctas(None, 128, 4) == 132  # eight blocks do not divide 132: one plan CTA per SM
    plan = plan_splits(torch.tensor([5000, 70], dtype=torch.int32), q_len=8, num_heads=12, page_size=32)
    assert plan.num_ctas == 66


def test_batch_bucket_is_the_next_power_of_two_from_8():
    assert [batch_bucket(b) for b in (0, 1, 7, 8, 9, 16, 17, 200, 256, 257)] == [8, 8, 8, 8, 16, 16, 32, 256, 256,
                                                                                 512]
    with pytest.raises(ValueError, match="batch"):
        batch_bucket(-1)


@pytest.mark.parametrize("lengths", [[5000, 3, 0], [1 << 20] + [4096] * 8, [1], [131072] * 5])
def test_bucketed_plan_cuts_the_batch_like_an_exact_one(lengths):
    """The op plans for batch_bucket(batch) requests when given no plan: the padding requests must not change a
    single segment, split count or workspace slot of the real ones."""
    seq_lens = torch.tensor(lengths, dtype=torch.int32)
    kw = dict(q_len=1, num_heads=12, page_size=32, tile_tokens=TILE, num_ctas=40)
    exact = plan_splits(seq_lens, max_batch=len(lengths), **kw)
    bucketed = plan_splits(seq_lens, max_batch=batch_bucket(len(lengths)), **kw)
    assert bucketed.max_batch == batch_bucket(len(lengths))
    assert torch.equal(exact.segments(), bucketed.segments())
    n = len(lengths)
    for name in ("num_splits", "split_offset", "request_first_cta"):
        assert torch.equal(getattr(exact, name), getattr(bucketed, name)[:n]), name
    assert torch.all(bucketed.num_splits[n:] == 0)


def test_planner_has_fixed_shapes_and_no_host_reads():
    """The plan's shapes depend only on (max_batch, num_ctas): one captured graph serves any lengths.
    Run under a meta device, where any .item()/.tolist() or value-dependent shape would fail."""
    seq_lens = torch.empty(10, dtype=torch.int32, device="meta")
    plan = plan_splits(seq_lens, q_len=2, num_heads=16, page_size=64, tile_tokens=TILE, num_ctas=132, max_batch=64)
    assert [tuple(t.shape) for t in plan.tensors()] == [(133,), (132,), (65,), (64,), (64,), (64,)]


def test_planner_rejects_bad_arguments():
    with pytest.raises(TypeError, match="seq_lens"):
        plan_splits(torch.zeros(3, dtype=torch.int64), q_len=1, num_heads=12, page_size=32)
    with pytest.raises(ValueError, match="max_batch"):
        plan_splits(torch.zeros(3, dtype=torch.int32), q_len=1, num_heads=12, page_size=32, max_batch=2)
    with pytest.raises(ValueError, match="tile_tokens"):
        plan_splits(torch.zeros(3, dtype=torch.int32), q_len=1, num_heads=12, page_size=32, tile_tokens=48)
    with pytest.raises(ValueError, match="num_ctas"):
        plan_splits(torch.zeros(3, dtype=torch.int32), q_len=1, num_heads=12, page_size=32, num_ctas=4096)
    with pytest.raises(ValueError, match="num_heads must be in 8..128"):
        plan_splits(torch.zeros(3, dtype=torch.int32), q_len=1, num_heads=4, page_size=32)
    with pytest.raises(ValueError, match="segment_overhead"):
        plan_splits(torch.zeros(3, dtype=torch.int32), q_len=1, num_heads=12, page_size=32, segment_overhead=-1)
    with pytest.raises(ValueError, match="overflow int32"):
        plan_splits(torch.zeros(3, dtype=torch.int32), q_len=1, num_heads=12, page_size=32, tile_tokens=32,
                    max_batch=5000)


def test_lengths_are_planned_clamped_to_zero_and_the_planned_maximum():
    """Inside a CUDA graph nothing checks seq_lens: negative lengths plan as 0 and huge ones as
    MAX_PLANNED_KV_LEN, so the plan's int32 sums cannot overflow."""
    from mla_backend.plan import MAX_PLANNED_KV_LEN

    garbage = torch.tensor([2 ** 31 - 1, -5, 3, -(2 ** 31)], dtype=torch.int32)
    clamped = torch.tensor([MAX_PLANNED_KV_LEN, 0, 3, 0], dtype=torch.int32)
    got = plan_splits(garbage, q_len=1, num_heads=12, page_size=32, num_ctas=132)
    want = plan_splits(clamped, q_len=1, num_heads=12, page_size=32, num_ctas=132)
    assert all(torch.equal(a, b) for a, b in zip(got.tensors(), want.tensors()))
    assert int(got.request_tile_start[-1]) == MAX_PLANNED_KV_LEN // 64 + 1
