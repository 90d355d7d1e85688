"""Launch-argument helpers (mla_backend.hopper.launch): pointer and stream objects are built once per value and
the caches stay bounded. (PDL is a configuration switch: tests/test_config.py.)"""

import cutlass

from mla_backend.hopper import launch


def test_pointers_are_shared_per_value():
    a = launch.gmem_ptr(cutlass.Int32, 4, 4096)
    assert launch.gmem_ptr(cutlass.Int32, 4, 4096) is a
    assert launch.gmem_ptr(cutlass.Int32, 4, 8192) is not a
    assert launch.gmem_ptr(cutlass.Float32, 4, 4096) is not a
    assert launch.gmem_ptr(cutlass.Int32, 16, 4096) is not a
    b = launch.gmem_ptr(cutlass.Int32, 4, 8192)
    assert b.dtype is cutlass.Int32 and b.__c_pointers__() and int(b._pointer) == 8192


def test_pointer_cache_is_bounded():
    for i in range(launch._CACHE_LIMIT + 10):
        launch.gmem_ptr(cutlass.Int32, 16, (i + 1) * 16)
    assert len(launch._pointers) <= launch._CACHE_LIMIT


def test_streams_are_shared_per_handle():
    assert launch.cuda_stream() is launch.cuda_stream()
    assert int(launch.cuda_stream()) == 0
