"""Device-side split planner: cut a batch's KV tiles into balanced, contiguous per-CTA chunks.

Why on the device: under CUDA graphs the host does not know the KV lengths of the step being replayed.
Everything below is fixed-shape torch work on `seq_lens` (no `.item()`, no value-dependent shapes), so it can
be captured once and replayed for any mix of lengths.

The cut. Lay the batch out on one cost axis, request after request: request b costs `overhead` (loading q,
writing a partial) followed by one unit per KV tile. Split the axis into `num_ctas` intervals of
S = floor or ceil(total / num_ctas) units; a tile belongs to the CTA whose interval holds the tile's start. Each CTA
so gets a contiguous run of tiles in request order; a (CTA, request) piece is a segment, i.e. one split of
that request. A CTA's tiles plus the overheads of the requests that start inside its interval fit in S, and
only its first segment may bring an overhead from outside, so the busiest CTA costs at most S + overhead.

The plan is consumed as:
- CTA c processes global tiles [cta_tile_start[c], cta_tile_start[c+1]); the first belongs to request
  cta_first_request[c]; an empty range means the CTA exits at once.
- request b owns global tiles [request_tile_start[b], request_tile_start[b+1]); it has num_splits[b]
  segments held by CTAs request_first_cta[b] .. + num_splits[b] - 1. With one split the kernel writes the
  final output; with more, CTA c writes its partial to workspace slot split_offset[b] + c - request_first_cta[b]
  and the combine kernel merges them.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import torch

from .config import MAX_PLAN_CTAS, MAX_PLANNED_KV_LEN
from .shapes import check_shape, decode_row_blocks

Tensor = torch.Tensor

DEFAULT_TILE_TOKENS = 64
# Per-segment overhead in tile units: loading the q block and writing one partial (plus its share of the
# merge) costs about as much as streaming a few KV tiles. FlashMLA uses the equivalent of 5. On our kernel 4
# measured best on the H200 (docs/experiments.md, Planner): 8K x B64 0.5-0.8 us faster than 5, equal or
# within 0.3 us elsewhere; 3 and 7 lose 1.2 us on 128K + 63 x 2K.
DEFAULT_SEGMENT_OVERHEAD = 4
H200_SMS = 132


def device_sms(device=None) -> int:
    """The SM count of a CUDA device, or an H200's 132 where there is no GPU."""
    if device is not None and torch.device(device).type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return H200_SMS


def default_num_ctas(device=None, num_heads: Optional[int] = None, q_len: Optional[int] = None) -> int:
    """Plan CTAs for one wave of decode CTAs: the SM count, divided by the decode's row blocks per plan CTA
    (`shapes.decode_row_blocks`) when the shape is given and they divide it.

    The decode launches (row blocks x plan CTAs) CTAs, one per SM at a time. With 132 plan CTAs and two row
    blocks (H12 q_len 8, H128) that is two waves of equally long CTAs; 66 plan CTAs give one wave of CTAs twice
    as long: half the segments (Q loads, pipeline fills, partials to merge). H200, decode alone, one process:
    H12 q8 1M x B1 534.2 -> 527.4 us, q8 128K x B4 275.0 -> 269.6, q8 128K x B1 79.2 -> 74.0, H128 q1 128K x B4
    325.3 -> 317.9 (docs/experiments.md). A count that does not divide the SMs keeps one plan CTA per SM: one
    wave would leave SMs idle."""
    sms = device_sms(device)
    if num_heads is None or q_len is None:
        return sms
    blocks = decode_row_blocks(num_heads, q_len)
    return sms // blocks if sms % blocks == 0 else sms


@dataclass
class SplitPlan:
    """A split plan on the device. All tensors int32 with shapes fixed by (max_batch, num_ctas)."""

    cta_tile_start: Tensor  # [num_ctas + 1]
    cta_first_request: Tensor  # [num_ctas]
    request_tile_start: Tensor  # [max_batch + 1]
    request_first_cta: Tensor  # [max_batch]
    num_splits: Tensor  # [max_batch]
    split_offset: Tensor  # [max_batch]
    tile_tokens: int
    segment_overhead: int

    @property
    def num_ctas(self) -> int:
        return self.cta_first_request.shape[0]

    @property
    def max_batch(self) -> int:
        return self.num_splits.shape[0]

    @property
    def num_slots(self) -> int:
        """Workspace partials needed in the worst case: the splits of the requests with more than one. Each CTA
        boundary adds at most one split (max_batch + num_ctas in all), and each CTA holds pieces of at most two
        split requests, those that cross its first and its last boundary (2 num_ctas in all)."""
        return self.num_ctas + min(self.max_batch, self.num_ctas)

    @property
    def device(self) -> torch.device:
        return self.num_splits.device

    def tensors(self):
        return (self.cta_tile_start, self.cta_first_request, self.request_tile_start,
                self.request_first_cta, self.num_splits, self.split_offset)

    @classmethod
    def empty(cls, max_batch: int, num_ctas: int, tile_tokens: int = DEFAULT_TILE_TOKENS,
              segment_overhead: int = DEFAULT_SEGMENT_OVERHEAD, device=None) -> "SplitPlan":
        """Buffers for `plan_splits(..., out=plan)`: allocate once at start-up, refill every step."""
        def zeros(n):
            return torch.zeros(n, dtype=torch.int32, device=device)
        return cls(zeros(num_ctas + 1), zeros(num_ctas), zeros(max_batch + 1), zeros(max_batch),
                   zeros(max_batch), zeros(max_batch), tile_tokens, segment_overhead)

    def segments(self) -> Tensor:
        """CPU int32 [n, 4] rows of (cta, request, first_tile, end_tile), tiles local to the request.

        For tests, the CLI and debugging: this reads the plan back to the host.
        """
        cta_start = self.cta_tile_start.cpu().tolist()
        req_start = self.request_tile_start.cpu().tolist()
        rows = []
        for c in range(self.num_ctas):
            g, g_end = cta_start[c], cta_start[c + 1]
            b = int(self.cta_first_request[c])
            while g < g_end:
                while req_start[b + 1] <= g:  # skip requests without tiles
                    b += 1
                end = min(g_end, req_start[b + 1])
                rows.append((c, b, g - req_start[b], end - req_start[b]))
                g = end
        return torch.tensor(rows, dtype=torch.int32).reshape(-1, 4)

    def cta_costs(self) -> Tensor:
        """CPU int64 [num_ctas]: tiles plus segment overheads per CTA, as the planner counts cost."""
        cost = torch.zeros(self.num_ctas, dtype=torch.int64)
        for c, _b, t0, t1 in self.segments().tolist():
            cost[c] += (t1 - t0) + self.segment_overhead
        return cost


def batch_bucket(batch: int) -> int:
    """The max_batch of a plan the op makes for itself: the next power of two, at least 8. The device planner is
    compiled per max_batch (~0.2 s each), so an eager caller whose batch size changes every step compiles it
    once per bucket, not once per size; a plan may hold more requests than the batch."""
    if batch < 0:
        raise ValueError(f"batch must be >= 0, got {batch}")
    return max(8, 1 << max(batch - 1, 0).bit_length())


def plan_splits(seq_lens: Tensor, *, q_len: int, num_heads: int, page_size: int,
                tile_tokens: Optional[int] = None, num_ctas: Optional[int] = None,
                max_batch: Optional[int] = None, segment_overhead: int = DEFAULT_SEGMENT_OVERHEAD,
                out: Optional[SplitPlan] = None) -> SplitPlan:
    """Plan the split-KV decode of a batch on the device (CUDA-graph safe).

    seq_lens: int32 [B] KV lengths (0 = padded row). q_len and num_heads are part of the static key the
    kernels are compiled for and are checked here; the cost model counts KV tiles. Pass `out=` (from
    `SplitPlan.empty` or an earlier call) to refill persistent buffers, as a CUDA-graph step must.
    """
    if not isinstance(seq_lens, torch.Tensor) or seq_lens.dim() != 1 or seq_lens.dtype != torch.int32:
        raise TypeError(f"seq_lens must be a 1-D int32 tensor, got {getattr(seq_lens, 'dtype', type(seq_lens))} "
                        f"{tuple(getattr(seq_lens, 'shape', ()))}")
    check_shape(num_heads=num_heads, q_len=q_len, page_size=page_size)
    if segment_overhead < 0:
        raise ValueError(f"segment_overhead must be >= 0, got {segment_overhead}")
    if out is not None:
        tile_tokens = out.tile_tokens if tile_tokens is None else tile_tokens
        num_ctas = out.num_ctas if num_ctas is None else num_ctas
        max_batch = out.max_batch if max_batch is None else max_batch
        segment_overhead = out.segment_overhead
        if (tile_tokens, num_ctas, max_batch) != (out.tile_tokens, out.num_ctas, out.max_batch):
            raise ValueError("plan_splits(out=...) must keep the plan's tile_tokens, num_ctas and max_batch")
        if out.device != seq_lens.device:
            raise ValueError(f"out plan is on {out.device} but seq_lens is on {seq_lens.device}")
    tile_tokens = DEFAULT_TILE_TOKENS if tile_tokens is None else tile_tokens
    if tile_tokens < 1 or (tile_tokens % page_size and page_size % tile_tokens):
        raise ValueError(f"tile_tokens ({tile_tokens}) and page_size ({page_size}) must divide one another")
    num_ctas = default_num_ctas(seq_lens.device, num_heads, q_len) if num_ctas is None else num_ctas
    batch = seq_lens.shape[0]
    max_batch = batch if max_batch is None else max_batch
    if batch > max_batch:
        raise ValueError(f"seq_lens has {batch} requests but the plan holds max_batch={max_batch}")
    if not 1 <= num_ctas <= MAX_PLAN_CTAS or max_batch < 1:
        raise ValueError(f"num_ctas must be in 1..{MAX_PLAN_CTAS} and max_batch >= 1, got {num_ctas}, {max_batch}")
    if max_batch * (MAX_PLANNED_KV_LEN // tile_tokens + segment_overhead) >= 1 << 31:
        raise ValueError(f"max_batch={max_batch} is too large for tile_tokens={tile_tokens}: the plan's sums "
                         f"would overflow int32")

    plan = out if out is not None else SplitPlan.empty(max_batch, num_ctas, tile_tokens, segment_overhead,
                                                       seq_lens.device)
    if _planner_kernel_available(seq_lens):
        # One CTA instead of ~25 small torch launches (~67 us per step on the H200); same plan, bit for bit.
        from .hopper.planner import run_planner

        run_planner(seq_lens, plan, torch.cuda.current_stream(seq_lens.device))
        return plan
    _plan_with_torch(seq_lens, plan)
    return plan


@functools.lru_cache(maxsize=None)
def cuda_major(device: torch.device) -> int:
    """Compute capability major of a CUDA device, looked up once (eager calls ask on every step)."""
    return torch.cuda.get_device_capability(device)[0]


def _planner_kernel_available(seq_lens: Tensor) -> bool:
    return seq_lens.is_cuda and not torch.compiler.is_compiling() and cuda_major(seq_lens.device) == 9


def _plan_with_torch(seq_lens: Tensor, plan: SplitPlan) -> None:
    """The plan's definition in fixed-shape torch ops (CPU, meta, torch.compile, GPUs without our kernel)."""
    tile_tokens, segment_overhead = plan.tile_tokens, plan.segment_overhead
    num_ctas, max_batch, batch = plan.num_ctas, plan.max_batch, seq_lens.shape[0]
    device = seq_lens.device
    lengths = torch.nn.functional.pad(seq_lens.to(torch.int64), (0, max_batch - batch)).clamp(0, MAX_PLANNED_KV_LEN)
    tiles = (lengths + tile_tokens - 1) // tile_tokens
    cost = tiles + segment_overhead * (tiles > 0)
    cost_start = torch.cumsum(cost, 0) - cost
    # Interval c is [c * total // num_ctas, (c + 1) * total // num_ctas): each holds floor or ceil of the mean.
    # Every interval must hold at least one unit, or a request could skip a CTA and its split slots
    # (numbered by CTA) would have holes: with less work than CTAs, use unit intervals.
    total = torch.clamp(cost.sum(), min=num_ctas)
    bounds = torch.arange(num_ctas + 1, device=device, dtype=torch.int64) * total // num_ctas
    # Tiles of request b whose start lies before each bound: [num_ctas + 1, max_batch], summed over b.
    before = (bounds[:, None] - cost_start[None, :] - segment_overhead).clamp(min=0)
    cta_tile_start = torch.minimum(before, tiles[None, :]).sum(1)

    request_tile_start = torch.nn.functional.pad(torch.cumsum(tiles, 0), (1, 0))
    # The first request whose range extends past a CTA's first tile (empty requests never do).
    cta_first_request = torch.searchsorted(request_tile_start[1:], cta_tile_start[:-1], right=True)
    cta_first_request = cta_first_request.clamp(max=max_batch - 1)

    def cta_of(tile):  # the CTA holding a global tile: the last one whose range starts at or before it
        return torch.searchsorted(cta_tile_start, tile, right=True) - 1

    busy = tiles > 0
    first_cta = cta_of(request_tile_start[:-1]).clamp(0, num_ctas - 1)
    last_cta = cta_of(request_tile_start[1:] - 1).clamp(0, num_ctas - 1)
    num_splits = torch.where(busy, last_cta - first_cta + 1, torch.zeros_like(first_cta))
    merged = num_splits * (num_splits > 1)
    split_offset = torch.cumsum(merged, 0) - merged

    for dst, src in zip(plan.tensors(), (cta_tile_start, cta_first_request, request_tile_start, first_cta,
                                         num_splits, split_offset)):
        dst.copy_(src)
