"""Prepare every kernel the runtime can launch for a decode shape: compile it, or load it from the kernel cache.

`python -m mla_backend compile` runs this with `--cache-dir` (no GPU needed), so that a server's start-up loads its
kernels instead of compiling them; the engine adapters run it at start-up, before serving, for every q_len their
engine can hand them (README, "Kernel cache").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

from . import jit_cache
from .config import environment, CombineConfig, DecodeConfig, PlannerConfig, decode_shape_configs
from .plan import DEFAULT_SEGMENT_OVERHEAD, DEFAULT_TILE_TOKENS, default_num_ctas, device_sms


@dataclass
class Prepared:
    config: object
    how: str  # "compiled" or "loaded" (this call), "ready" (already in this process)
    seconds: float

    @property
    def kind(self) -> str:
        return {DecodeConfig: "decode", CombineConfig: "combine", PlannerConfig: "planner"}[type(self.config)]

    def describe(self) -> str:
        c = self.config
        if isinstance(c, DecodeConfig):
            what = (f"heads={c.num_heads} q_len={c.q_len} page={c.page_size} rows={c.rows_per_block} "
                    f"schedule={c.schedule} p_planes={c.p_planes} causal={c.causal}")
        elif isinstance(c, CombineConfig):
            mode = "row" if c.heavy_slots < 0 else f"warp (heavy slots {c.heavy_slots})"
            what = f"rows={c.rows} mode={mode} column parts={c.dim_splits} prefetch_all={c.prefetch_all}"
        else:
            what = f"max_batch={c.max_batch} ctas={c.num_ctas} form={c.form}"
        return f"{self.kind:<7} {c.arch} {what}: {self.how} in {self.seconds:.2f} s"


def _compile(config):
    if isinstance(config, DecodeConfig):
        from .hopper.decode import compile_decode as compile_fn
    elif isinstance(config, CombineConfig):
        from .hopper.combine import compile_combine as compile_fn
    else:
        from .hopper.planner import compile_planner as compile_fn
    return compile_fn(config)


def prepare_kernels(num_heads: int, q_len: int, page_size: int, *, max_batch: int, device=None,
                    num_ctas: Optional[int] = None, p_precision: Optional[str] = None, causal: bool = True,
                    tile_tokens: int = DEFAULT_TILE_TOKENS,
                    segment_overhead: int = DEFAULT_SEGMENT_OVERHEAD) -> List[Prepared]:
    """Compile (or load) the decode, the planner and every combine that calls of this shape with plans of
    max_batch requests can launch on `device` (None: an H200's SM count, for compiling on another machine)."""
    num_sms = device_sms(device)
    if num_ctas is None:
        num_ctas = default_num_ctas(device, num_heads, q_len)
    configs = decode_shape_configs(num_heads, q_len, page_size, max_batch=max_batch, num_sms=num_sms,
                                   num_ctas=num_ctas, tile_tokens=tile_tokens, segment_overhead=segment_overhead,
                                   causal=causal, p_precision=p_precision)
    prepared = []
    for config in configs:
        before = jit_cache.origin(config)
        _compile(config)
        how, seconds = jit_cache.origin(config)
        prepared.append(Prepared(config, "ready" if before else how, 0.0 if before else seconds))
    return prepared
