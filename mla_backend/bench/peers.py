"""Peers the bench times side by side with our step on the same inputs (`bench --peer flashmla`).

FlashMLA's dense FP8 decode for Hopper (vllm-project/FlashMLA, what vLLM's FLASHMLA backend runs for an FP8 cache)
is never a dependency of this package: the bench uses it when it can be imported. `--peer-path` names either a
built extension module (a `.so` exposing `get_mla_decoding_metadata_dense_fp8` and `fwd_kvcache_mla_fp8`) or a
Python file whose `load_flashmla()` builds and returns one; without it, a module named `flashmla_dense_fp8` on
sys.path is used. Its step is the metadata kernel plus the decode (which merges its own splits); page size 64.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from typing import Optional

PEERS = ("flashmla",)
FLASHMLA_MODULE = "flashmla_dense_fp8"
FLASHMLA_PAGE_SIZE = 64


class PeerUnavailable(RuntimeError):
    pass


def load_flashmla(path: Optional[str] = None):
    """The FlashMLA dense FP8 extension module (module docstring), or PeerUnavailable saying why not."""
    try:
        if path is None:
            return importlib.import_module(FLASHMLA_MODULE)
        if path.endswith(".py"):
            spec = importlib.util.spec_from_file_location("_flashmla_build", path)
            builder = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(builder)
            return builder.load_flashmla()
        spec = importlib.util.spec_from_file_location(FLASHMLA_MODULE, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    except Exception as err:
        where = path or f"a module named {FLASHMLA_MODULE}"
        raise PeerUnavailable(f"FlashMLA's dense FP8 kernel could not be loaded from {where}: {err}") from err


class FlashMLAStep:
    """One FlashMLA decode step on a case's inputs (`cases.CaseInputs`), into outputs of its own."""

    def __init__(self, ext, inp, q_len: int, causal: bool = True):
        if inp.kv.shape[1] != FLASHMLA_PAGE_SIZE:
            raise PeerUnavailable(f"FlashMLA's dense FP8 kernel takes pages of {FLASHMLA_PAGE_SIZE} tokens, the "
                                  f"case has {inp.kv.shape[1]}")
        self.ext, self.inp, self.causal = ext, inp, causal
        heads = inp.q.shape[2]
        self.kv = inp.kv.view(inp.kv.shape[0], inp.kv.shape[1], 1, inp.kv.shape[2])
        self.rows = q_len * heads
        self.out = None
        self.lse = None

    def lse_rows(self):
        """The lse of the last call as ours is laid out, (batch, q_len, heads): FlashMLA returns it as (batch,
        heads, q_len), in natural log as ours."""
        return self.lse.transpose(1, 2)

    def __call__(self):
        inp = self.inp
        meta, num_splits = self.ext.get_mla_decoding_metadata_dense_fp8(inp.seq_lens, self.rows, 1)
        self.out, self.lse = self.ext.fwd_kvcache_mla_fp8(
            inp.q, self.kv, 512, inp.seq_lens, inp.block_table, inp.softmax_scale, self.causal, meta, num_splits,
            inp.q_scale, inp.k_scale)


def peer_step(name: str, path: Optional[str], inp, case):
    """The callable step of peer `name` for a case, loaded once per process."""
    if name != "flashmla":
        raise ValueError(f"peer must be one of {PEERS}, got {name!r}")
    if "flashmla" not in _loaded:
        _loaded["flashmla"] = load_flashmla(path if path is None else os.path.abspath(path))
    return FlashMLAStep(_loaded["flashmla"], inp, case.q_len)


_loaded = {}
