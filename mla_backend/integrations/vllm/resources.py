"""What CUTE_MLA_FP8's decode needs before serving: split plans, the workspace and the kernels, per process and device.

vLLM may hand `forward_mqa` any uniform decode query length from 1 to the builder's reorder_batch_threshold (a full
verify block, a shorter one, a step without drafts), so everything is made for every one of them, at start-up:

- the kernels (`mla_backend.prepare.prepare_kernels`: compiled, or loaded from CUTE_MLA_KERNEL_CACHE) of every
  q_len, for plans of max_num_seqs requests, on this device;
- one workspace, sized for the largest q_len and the most split slots any of the plans can need, with a view of
  it (`DecodeWorkspace.view`) per q_len. It is only used inside one `mla_decode` call, so every layer and every
  microbatch can share it: they all run attention on one stream, one call after another;
- plan sets, one SplitPlan per q_len each. A plan is written when the metadata builder builds a step and read by
  that step's layers, so each builder (vLLM makes one per microbatch) owns a set.

`reserve` runs in the impl's `reserve_workspace`, i.e. in vLLM's memory-profiling run, so the buffers are part of
the profile; the builders, made after the KV cache is sized, `claim` what was reserved. Whatever a builder finds
missing it makes itself, still before serving, and says so in the log. Nothing here runs per step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Set, Tuple

import torch

from mla_backend import DecodeWorkspace, SplitPlan
from mla_backend.plan import cuda_major, default_num_ctas
from mla_backend.prepare import Prepared, prepare_kernels

# Compute capabilities (major) with a compiled kernel: Hopper. Add 10 once a Blackwell kernel exists.
KERNEL_CAPABILITY_MAJORS = (9,)

PlanSet = Dict[int, SplitPlan]  # q_len -> plan


def canonical_device(device) -> torch.device:
    """`cuda` as the current CUDA device (`cuda:N`), so that the impl's and the builders' devices compare equal."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def kernels_run_on(device: torch.device) -> bool:
    """Whether mla_decode launches our kernels on this device (elsewhere it runs the torch reference)."""
    return device.type == "cuda" and cuda_major(device) in KERNEL_CAPABILITY_MAJORS


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.2f} MiB"


@dataclass
class DeviceBuffers:
    """The workspace and plan sets of one (device, heads, max_batch)."""

    device: torch.device
    num_heads: int
    max_batch: int
    max_q_len: int
    workspace: DecodeWorkspace
    reserved_plan_sets: int = 0  # made by `reserve` (counted by vLLM's memory profile), claimed or not
    free_plan_sets: List[PlanSet] = field(default_factory=list)

    def workspace_views(self, max_q_len: int) -> Dict[int, DecodeWorkspace]:
        return {q: self.workspace.view(q, self.num_heads) for q in range(1, max_q_len + 1)}


@dataclass
class Claim:
    """A builder's share: its own plans and the shared workspace's views, one per q_len 1..max_q_len."""

    plans: PlanSet
    workspaces: Dict[int, DecodeWorkspace]

    @property
    def max_q_len(self) -> int:
        return max(self.plans)


class DecodeResources:
    """Everything `reserve` and `claim` made in this process. `log` receives one line per event (vLLM's logger)."""

    def __init__(self) -> None:
        self._buffers: Dict[Tuple, DeviceBuffers] = {}
        self._prepared: Set[Tuple] = set()
        self.kernels: List[Prepared] = []  # every kernel prepared in this process, in order

    def clear(self) -> None:
        self.__init__()

    # ------------------------------------------------------------------------------------------- buffers
    def _num_ctas(self, device, num_heads: int, q_len: int) -> int:
        return default_num_ctas(device, num_heads, q_len)

    def _plan_set(self, device, num_heads: int, max_batch: int, max_q_len: int) -> PlanSet:
        return {q: SplitPlan.empty(max_batch, self._num_ctas(device, num_heads, q), device=device)
                for q in range(1, max_q_len + 1)}

    def _buffers_for(self, device, num_heads: int, max_batch: int, max_q_len: int, log, when: str) -> DeviceBuffers:
        key = (device, num_heads, max_batch)
        buffers = self._buffers.get(key)
        if buffers is not None and buffers.max_q_len >= max_q_len:
            return buffers
        # One workspace for every q_len: as many slots as the most any plan has, rows for the largest q_len.
        slots = max(SplitPlan.empty(max_batch, self._num_ctas(device, num_heads, q), device="meta").num_slots
                    for q in range(1, max_q_len + 1))
        workspace = DecodeWorkspace(slots, max_q_len, num_heads, device)
        buffers = DeviceBuffers(device, num_heads, max_batch, max_q_len, workspace)
        self._buffers[key] = buffers
        log(f"workspace {_mib(workspace.nbytes)} on {device} ({slots} split slots x q_len {max_q_len} x "
            f"{num_heads} heads, shared by q_len 1-{max_q_len}), {when}")
        return buffers

    def reserve(self, device, *, num_heads: int, page_size: int, max_batch: int, max_q_len: int,
                p_precision: str, plan_sets: int = 1, log: Callable[[str], None] = print) -> DeviceBuffers:
        """Make the workspace, `plan_sets` plan sets and the kernels of these decodes, once (idempotent)."""
        device = canonical_device(device)
        buffers = self._buffers_for(device, num_heads, max_batch, max_q_len, log,
                                    "reserved in the memory-profiling run")
        if buffers.reserved_plan_sets < plan_sets:
            new = [self._plan_set(device, num_heads, max_batch, max_q_len)
                   for _ in range(plan_sets - buffers.reserved_plan_sets)]
            buffers.free_plan_sets += new
            buffers.reserved_plan_sets = plan_sets
            nbytes = sum(t.nbytes for s in new for p in s.values() for t in p.tensors())
            log(f"{len(new)} plan set(s) of q_len 1-{max_q_len} for {max_batch} requests ({nbytes} bytes) on "
                f"{device}, reserved in the memory-profiling run")
        self.prepare(device, num_heads=num_heads, page_size=page_size, max_batch=max_batch, max_q_len=max_q_len,
                     p_precision=p_precision, log=log)
        return buffers

    def claim(self, device, *, num_heads: int, page_size: int, max_batch: int, max_q_len: int,
              p_precision: str, log: Callable[[str], None] = print) -> Claim:
        """A metadata builder's plans and workspace views: reserved ones if there are, else made now."""
        device = canonical_device(device)
        buffers = self._buffers_for(device, num_heads, max_batch, max_q_len, log,
                                    "made by the metadata builder, after vLLM's memory profiling")
        plans = next((s for s in buffers.free_plan_sets if max(s) >= max_q_len), None)
        if plans is not None:
            buffers.free_plan_sets.remove(plans)
        else:
            plans = self._plan_set(device, num_heads, max_batch, max_q_len)
            nbytes = sum(t.nbytes for p in plans.values() for t in p.tensors())
            log(f"plan set of q_len 1-{max_q_len} for {max_batch} requests ({nbytes} bytes) on {device}, made by "
                f"the metadata builder")
        self.prepare(device, num_heads=num_heads, page_size=page_size, max_batch=max_batch, max_q_len=max_q_len,
                     p_precision=p_precision, log=log)
        plans = {q: plans[q] for q in range(1, max_q_len + 1)}
        return Claim(plans, buffers.workspace_views(max_q_len))

    # ------------------------------------------------------------------------------------------- kernels
    def prepare(self, device, *, num_heads: int, page_size: int, max_batch: int, max_q_len: int, p_precision: str,
                log: Callable[[str], None] = print) -> List[Prepared]:
        """Compile or load every kernel mla_decode can launch for these decodes on `device` (none off Hopper)."""
        device = canonical_device(device)
        todo = [q for q in range(1, max_q_len + 1)
                if (device, num_heads, page_size, max_batch, q, p_precision) not in self._prepared]
        if not todo:
            return []
        for q in todo:
            self._prepared.add((device, num_heads, page_size, max_batch, q, p_precision))
        what = (f"{num_heads} heads, q_len {todo[0]}-{todo[-1]}, pages of {page_size}, up to {max_batch} requests, "
                f"p_precision {p_precision}")
        if not kernels_run_on(device):
            log(f"no kernels to prepare for {what}: on {device} mla_decode runs its torch reference")
            return []
        start = time.perf_counter()
        prepared = []
        for q in todo:
            prepared += prepare_kernels(num_heads, q, page_size, max_batch=max_batch, device=device,
                                        num_ctas=self._num_ctas(device, num_heads, q), p_precision=p_precision)
        self.kernels += prepared
        counts = {how: sum(p.how == how for p in prepared) for how in ("compiled", "loaded", "ready")}
        log(f"prepared {len(prepared)} kernels for {what} on {device} in {time.perf_counter() - start:.1f} s: "
            f"{counts['compiled']} compiled, {counts['loaded']} loaded from the kernel cache, {counts['ready']} "
            f"already in this process")
        return prepared


RESOURCES = DecodeResources()
