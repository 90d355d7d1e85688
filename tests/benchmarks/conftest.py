"""The research tools of benchmarks/ are scripts, not a package: their tests import them from that folder."""

import os
import sys

import pytest

BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "benchmarks")
if BENCHMARKS not in sys.path:
    sys.path.insert(0, BENCHMARKS)


@pytest.fixture
def empty_kernel_cache(tmp_path, monkeypatch):
    """This process's compile cache emptied (as in a fresh process) and backed by a new directory, which the test
    gets; no GPU."""
    import torch

    from mla_backend import jit_cache

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(jit_cache, "_memory", {})
    monkeypatch.setattr(jit_cache, "_origin", {})
    monkeypatch.setattr(jit_cache, "_directory", str(tmp_path))
    monkeypatch.setattr(jit_cache, "_directory_set", True)
    return tmp_path
