"""The compile cache (mla_backend.jit_cache): one compile per configuration in a process, and a directory of
compiled kernels that a later process loads instead of compiling."""

import subprocess
import sys
import textwrap

from mla_backend import jit_cache
from mla_backend.config import PlannerConfig, decode_config


def test_kernel_names_depend_on_the_configuration_only():
    a, b = PlannerConfig(16, 132, 64, 4), PlannerConfig(16, 132, 64, 5)
    assert jit_cache.kernel_name(a) == jit_cache.kernel_name(PlannerConfig(16, 132, 64, 4))
    assert jit_cache.kernel_name(a) != jit_cache.kernel_name(b)
    assert jit_cache.kernel_name(a).startswith("plannerconfig_")
    # a set field is named the same whatever its iteration order in this process
    assert jit_cache.kernel_name(decode_config(12, 8, 32, skip={"pv", "s", "load"})) == \
        jit_cache.kernel_name(decode_config(12, 8, 32, skip={"load", "s", "pv"}))


_LOAD = """
import os, sys
sys.path.insert(0, {repo!r})
from mla_backend import jit_cache
from mla_backend.config import PlannerConfig
from mla_backend.hopper.planner import compile_planner
cfg = PlannerConfig(16, 132, 64, 4)
fn = compile_planner(cfg)
print(jit_cache.origin(cfg)[0], callable(fn))
"""


def _in_fresh_process(cache, repo):
    import os

    env = dict(os.environ, CUTE_MLA_KERNEL_CACHE=str(cache), CUTE_DSL_ARCH="sm_90a")
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(_LOAD.format(repo=repo))], env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout.split(), result.stderr


def test_a_directory_cache_is_written_once_and_loaded_by_the_next_process(tmp_path):
    import os

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cache = tmp_path / "kernels"
    assert _in_fresh_process(cache, repo)[0] == ["compiled", "True"]
    files = sorted(p.name for p in cache.iterdir())
    name = jit_cache.kernel_name(PlannerConfig(16, 132, 64, 4))
    assert files == [name + ".h", name + ".o"]
    assert _in_fresh_process(cache, repo)[0] == ["loaded", "True"]
    # a damaged file is compiled again (with a warning), not trusted
    (cache / (name + ".o")).write_bytes(b"not an object file")
    words, err = _in_fresh_process(cache, repo)
    assert words == ["compiled", "True"] and "could not load" in err


def test_one_compile_per_configuration_in_a_process(monkeypatch):
    calls = []
    cfg = PlannerConfig(3, 7, 64, 4)

    def make():
        calls.append(1)
        from mla_backend.hopper.planner import FORMS
        from mla_backend.hopper.launch import cuda_stream, gmem_ptr
        from cutlass import Int32

        return FORMS[cfg.form](cfg), (*(gmem_ptr(Int32, 4) for _ in range(7)), Int32(1), cuda_stream())

    monkeypatch.setattr(jit_cache, "_directory_set", True)
    monkeypatch.setattr(jit_cache, "_directory", None)
    first = jit_cache.compiled(cfg, make)
    assert jit_cache.compiled(cfg, make) is first and calls == [1]
    assert jit_cache.origin(cfg)[0] == "compiled"


def test_an_unwritable_directory_is_a_warning_not_a_failure(monkeypatch, caplog):
    monkeypatch.setattr(jit_cache, "_directory_set", True)
    monkeypatch.setattr(jit_cache, "_directory", "/proc/definitely/not/writable")
    from mla_backend.hopper.planner import compile_planner

    assert callable(compile_planner(PlannerConfig(5, 9, 64, 4)))
    assert "could not write" in caplog.text
