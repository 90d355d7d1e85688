"""Launch-argument helpers: pointer and stream objects are built once per value and the caches stay bounded."""

import cutlass
import pytest

from mla_backend.hopper import cute_utils


def test_pointers_are_shared_per_value():
    a = cute_utils.gmem_ptr(cutlass.Int32, 4, 4096)
    assert cute_utils.gmem_ptr(cutlass.Int32, 4, 4096) is a
    assert cute_utils.gmem_ptr(cutlass.Int32, 4, 8192) is not a
    assert cute_utils.gmem_ptr(cutlass.Float32, 4, 4096) is not a
    assert cute_utils.gmem_ptr(cutlass.Int32, 16, 4096) is not a
    b = cute_utils.gmem_ptr(cutlass.Int32, 4, 8192)
    assert b.dtype is cutlass.Int32 and b.__c_pointers__() and int(b._pointer) == 8192


def test_pointer_cache_is_bounded():
    for i in range(cute_utils._CACHE_LIMIT + 10):
        cute_utils.gmem_ptr(cutlass.Int32, 16, (i + 1) * 16)
    assert len(cute_utils._pointers) <= cute_utils._CACHE_LIMIT


def test_streams_are_shared_per_handle():
    assert cute_utils.cuda_stream() is cute_utils.cuda_stream()
    assert int(cute_utils.cuda_stream()) == 0


def test_pdl_is_on_by_default_and_the_environment_can_turn_it_off(monkeypatch):
    monkeypatch.delenv(cute_utils.PDL_ENV, raising=False)
    assert cute_utils.use_pdl() is True
    monkeypatch.setenv(cute_utils.PDL_ENV, "0")
    assert cute_utils.use_pdl() is False
    monkeypatch.setenv(cute_utils.PDL_ENV, "yes")
    with pytest.raises(ValueError, match="CUTE_MLA_PDL"):
        cute_utils.use_pdl()


def test_pdl_is_part_of_every_compile_key(monkeypatch):
    from mla_backend.hopper import combine_sm90, decode_sm90, plan_splits_sm90

    keys = {}
    for value in ("0", "1"):
        monkeypatch.setenv(cute_utils.PDL_ENV, value)
        keys[value] = decode_sm90._static_key(12, 1, 32, 64, True, None, None, None, None, "sm_90a")
        plan_splits_sm90.compile_plan_splits_sm90(4, 8, 64, 5)
        combine_sm90.compile_combine_sm90(12, 1)
    assert keys["0"] != keys["1"] and keys["0"][-1] is False and keys["1"][-1] is True
    assert {k[-1] for k in plan_splits_sm90._compiled if k[:4] == (4, 8, 64, 5)} == {False, True}
    assert {k[2] for k in combine_sm90._compiled if k[:2] == (12, 1)} == {False, True}  # (rows, dims, pdl, prefetch)
