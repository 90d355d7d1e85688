"""mla_backend.bench.cases: each case's KV pages are a view of the run's one pool, and the block tables hand out
the pool's pages in random or in-order order."""

import pytest
import torch

from mla_backend.bench import cases


def test_case_kv_views_the_pool():
    """Each case's pages are the first bytes of the run's one KV pool (as in an engine's cache), shaped
    [pages, page_size, 576]; a pool too small for a case is an error, and without a pool a case allocates."""
    small = cases.Case("a", [33, 64], page_size=32)  # 2 + 2 pages + 1 spare
    large = cases.Case("b", [1000], page_size=64)  # 16 pages + 1 spare
    assert cases.case_kv_bytes(small) == 5 * 32 * 576
    assert cases.case_kv_bytes(large) == 17 * 64 * 576
    pool = torch.zeros(max(cases.case_kv_bytes(c) for c in (small, large)), dtype=torch.uint8)
    kv = cases.case_kv(pool, small, device="cpu")
    assert kv.shape == (5, 32, 576) and kv.data_ptr() == pool.data_ptr()
    kv.fill_(7)
    assert int(pool[:5 * 32 * 576].sum()) == 7 * 5 * 32 * 576 and int(pool[5 * 32 * 576:].sum()) == 0
    assert cases.case_kv(pool, large, device="cpu").shape == (17, 64, 576)
    with pytest.raises(ValueError, match="KV pool"):
        cases.case_kv(pool[:100], large, device="cpu")
    fresh = cases.case_kv(None, small, device="cpu")
    assert fresh.shape == (5, 32, 576) and fresh.data_ptr() != pool.data_ptr()


def test_page_permutation_orders():
    in_order = cases.page_permutation(10, "in-order")
    assert in_order.tolist() == list(range(10))
    shuffled = cases.page_permutation(1000, "random")
    assert sorted(shuffled.tolist()) == list(range(1000)) and shuffled.tolist() != list(range(1000))
    with pytest.raises(ValueError, match="page order"):
        cases.page_permutation(4, "sorted")


def test_case_names_are_unique_per_set():
    for make in (cases.default_cases, cases.extended_cases, cases.many_rows_cases):
        names = [c.name for c in make()]
        assert len(names) == len(set(names)), make.__name__
