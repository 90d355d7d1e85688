"""One compile cache for every kernel, keyed by its frozen configuration (`config.py`), optionally backed by a
directory of compiled kernels.

`compiled(config, make)` returns the compiled launcher of a configuration: from this process's cache, else from
the kernel-cache directory (`CUTE_MLA_KERNEL_CACHE`, or `use_directory`), else by compiling `make()`'s kernel
object and compile arguments with CuTe DSL, writing the result to the directory when there is one. A file there is
named by a digest of the configuration, this package's kernel sources and the CuTe DSL version, so a changed
kernel or DSL never loads a stale binary. `python -m mla_backend compile --cache-dir DIR` fills such a directory
ahead of time (no GPU needed); a server started with the variable set then loads its kernels in milliseconds
instead of compiling them (a few seconds each).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import logging
import os
import tempfile
import time
import warnings
from typing import Callable, Dict, Optional, Tuple

from .config import environment

_log = logging.getLogger("mla_backend")

_memory: Dict[object, object] = {}
_directory: Optional[str] = None
_directory_set = False  # until use_directory is called, CUTE_MLA_KERNEL_CACHE says
# how each configuration of this process got its kernel: "compiled" or "loaded", and the seconds it took
_origin: Dict[object, Tuple[str, float]] = {}


def use_directory(path: Optional[str]) -> None:
    """Read and write compiled kernels in `path` from now on (None: this process's memory only)."""
    global _directory, _directory_set
    _directory, _directory_set = path, True


def directory() -> Optional[str]:
    return _directory if _directory_set else environment().kernel_cache


def origin(config) -> Optional[Tuple[str, float]]:
    """("compiled" or "loaded", seconds) for a configuration this process has prepared, else None."""
    return _origin.get(config)


@functools.lru_cache(maxsize=None)
def _sources_digest() -> str:
    """A digest of every source file that shapes a kernel: the package's Python files but the engine adapters,
    benchmarks and command line."""
    root = os.path.dirname(os.path.abspath(__file__))
    h = hashlib.sha256()
    for folder, dirs, files in sorted(os.walk(root)):
        dirs[:] = sorted(d for d in dirs if d not in ("integrations", "bench", "__pycache__"))
        for name in sorted(files):
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                h.update(os.path.relpath(path, root).encode())
                with open(path, "rb") as f:
                    h.update(f.read())
    import cutlass

    h.update(getattr(cutlass, "__version__", "unknown").encode())
    return h.hexdigest()


def kernel_name(config) -> str:
    """The file and symbol name of a configuration's compiled kernel in a cache directory."""
    fields = [(f.name, getattr(config, f.name)) for f in dataclasses.fields(config)]
    canonical = repr([(k, sorted(v) if isinstance(v, frozenset) else v) for k, v in fields])  # set order varies
    digest = hashlib.sha256((type(config).__name__ + canonical + _sources_digest()).encode()).hexdigest()[:24]
    return f"{type(config).__name__.lower()}_{digest}"


def compiled(config, make: Callable[[], Tuple[object, tuple]]):
    """The compiled launcher of `config`; make() gives (kernel object, compile arguments) when it must be built."""
    fn = _memory.get(config)
    if fn is None:
        start = time.perf_counter()
        fn = _load(config)
        how = "loaded"
        if fn is None:
            fn = _compile(config, *make())
            how = "compiled"
            _store(config, fn)
        _memory[config] = fn
        _origin[config] = (how, time.perf_counter() - start)
    return fn


def _compile(config, kernel, args):
    return compile_kernel(kernel, args, config.arch)


def compile_kernel(kernel, args, arch: str):
    """cute.compile for `arch`, without the DSL's note on long unrolled loops (also for benchmarks' own kernels)."""
    import cutlass.cute as cute

    with warnings.catch_warnings():
        # CuTe DSL notes that a fully unrolled loop of many iterations compiles slowly; the kernels unroll theirs on
        # purpose (a register array indexed at run time would go to local memory), so the note says nothing new
        warnings.filterwarnings("ignore", message="This static loop has")
        return cute.compile(kernel, *args, options=f"--gpu-arch {arch}")


def _load(config):
    folder = directory()
    if folder is None:
        return None
    name = kernel_name(config)
    path = os.path.join(folder, name + ".o")
    if not os.path.exists(path):
        return None
    try:
        from cutlass.cute.runtime import load_module

        return getattr(load_module(path), name)
    except Exception as err:  # a file another DSL build wrote, or a partial one: compile instead
        _log.warning("mla_backend: could not load %s (%s); compiling it instead", path, err)
        return None


def _store(config, fn) -> None:
    folder = directory()
    if folder is None:
        return
    name = kernel_name(config)
    try:
        os.makedirs(folder, exist_ok=True)
        # written beside the cache and renamed into it, so that ranks compiling at once never read half a file
        with tempfile.TemporaryDirectory(dir=folder) as tmp:
            fn.export_to_c(tmp, name, name)
            for suffix in (".h", ".o"):
                os.replace(os.path.join(tmp, name + suffix), os.path.join(folder, name + suffix))
    except OSError as err:  # the kernel works; only the next process will compile it again
        _log.warning("mla_backend: could not write %s to the kernel cache %s (%s)", name, folder, err)


def clear_memory() -> None:
    """Forget this process's compiled kernels (tests of the directory cache)."""
    _memory.clear()
    _origin.clear()
