"""CuTe DSL compiles real sm_90a kernels on this CPU machine: the toolchain the kernels stand on works."""

import os
import subprocess
import sys
import textwrap


def test_cute_dsl_compiles_an_sm90a_kernel_without_a_gpu(tmp_path):
    script = textwrap.dedent("""
        import cutlass, cutlass.cute as cute
        from cutlass.cute.runtime import make_fake_compact_tensor

        def fake_tensor(dtype, shape):
            return make_fake_compact_tensor(dtype, shape, stride_order=(0,), assumed_align=16)

        @cute.kernel
        def dequant_kernel(x: cute.Tensor, y: cute.Tensor, scale: cutlass.Float32):
            tidx, _, _ = cute.arch.thread_idx()
            bidx, _, _ = cute.arch.block_idx()
            i = bidx * 128 + tidx
            if i < x.shape[0]:
                y[i] = x[i].to(cutlass.Float32) * scale

        @cute.jit
        def dequant(x: cute.Tensor, y: cute.Tensor, scale: cutlass.Float32):
            dequant_kernel(x, y, scale).launch(grid=[(x.shape[0] + 127) // 128, 1, 1], block=[128, 1, 1])

        n = cute.sym_int()
        compiled = cute.compile(dequant, fake_tensor(cutlass.Float8E4M3FN, (n,)), fake_tensor(cutlass.Float32, (n,)),
                                cutlass.Float32(1.0))
        ptx = compiled.artifacts.PTX
        assert ".target sm_90a" in ptx, ptx[:400]
        assert "cvt" in ptx and "e4m3" in ptx, "expected an FP8 conversion in the kernel"
        print("compiled", len(compiled.artifacts.CUBIN or b""), "cubin bytes")
    """)
    env = dict(os.environ, CUTE_DSL_ARCH="sm_90a", CUTE_DSL_KEEP="ptx,cubin", CUTE_DSL_DUMP_DIR=str(tmp_path))
    path = tmp_path / "dequant.py"  # CuTe DSL reads the kernel's source: it must live in a file
    path.write_text(script)
    result = subprocess.run([sys.executable, str(path)], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "compiled" in result.stdout
    assert any(p.suffix == ".cubin" for p in tmp_path.iterdir())
