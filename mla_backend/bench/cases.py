"""The bench's cases: named batches of KV lengths, and their random FP8 inputs on the GPU."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

import torch

from ..roofline import step_bytes_and_flops
from ..shapes import KV_DIM, LATENT_DIM


@dataclass
class Case:
    name: str
    lengths: List[int]
    heads: int = 12
    q_len: int = 1
    page_size: int = 32
    segment_overhead: Optional[int] = None  # the planner's default unless set
    p_precision: Optional[str] = None  # the op's default unless set
    results: dict = field(default_factory=dict)


def default_cases(heads=12, page_size=32):
    cases = []
    for q_len in (1, 8):
        for kv in (131072, 1 << 20):
            for batch in (1, 2, 4, 8, 16):
                label = f"{kv // 1024}K" if kv < (1 << 20) else "1M"
                cases.append(Case(f"H{heads} q{q_len} {label} x B{batch}", [kv] * batch, heads, q_len, page_size))
    cases.append(Case(f"H{heads} q1 1M + 15 x 4K", [1 << 20] + [4096] * 15, heads, 1, page_size))
    cases.append(Case(f"H{heads} q1 128K + 63 x 2K", [131072] + [2048] * 63, heads, 1, page_size))
    return cases


def extended_cases():
    cases = []
    for heads in (16, 128):
        for q_len in (1, 2):
            cases.append(Case(f"H{heads} q{q_len} 1M x B4", [1 << 20] * 4, heads, q_len, 32))
    cases.append(Case("H12 q1 1M x B4 page 64", [1 << 20] * 4, 12, 1, 64))
    cases.append(Case("H12 q1 (1M-17) x B4", [(1 << 20) - 17] * 4, 12, 1, 32))
    for batch, kv in ((32, 8192), (32, 32768), (64, 8192), (64, 32768), (128, 8192), (128, 32768)):
        cases.append(Case(f"H12 q1 {kv // 1024}K x B{batch}", [kv] * batch, 12, 1, 32))
    return cases


def many_rows_cases():
    """Where decode is compute-bound (data-parallel attention with 64-128 heads per GPU, MTP verify with q_len 2-8),
    and the TP8 shapes around them, at page 64: FlashMLA's page size, so `--peer flashmla` times both."""
    M, K = 1 << 20, 1024
    shapes = [(128, 1, [128 * K] * 4, "128K x B4"), (128, 1, [32 * K] * 32, "32K x B32"), (128, 1, [M] * 4, "1M x B4"),
              (128, 2, [128 * K] * 4, "128K x B4"), (64, 1, [M] * 2, "1M x B2"), (12, 8, [M], "1M x B1"),
              (12, 8, [128 * K] * 4, "128K x B4"), (16, 4, [M] * 2, "1M x B2"), (12, 1, [128 * K], "128K x B1"),
              (12, 1, [128 * K] * 4, "128K x B4"), (12, 1, [M] * 4, "1M x B4"), (16, 2, [M] * 4, "1M x B4"),
              (12, 1, [M] + [4 * K] * 15, "1M + 15 x 4K"), (12, 1, [128 * K] + [2 * K] * 63, "128K + 63 x 2K")]
    return [Case(f"H{h} q{q} {label} page 64", lengths, h, q, 64) for h, q, lengths, label in shapes]


def case_kv_bytes(case: Case) -> int:
    """Bytes of the KV pages a case uses: its requests' pages plus one spare page (run_case)."""
    return (sum(-(-n // case.page_size) for n in case.lengths) + 1) * case.page_size * KV_DIM


def case_kv(pool: Optional[torch.Tensor], case: Case, device="cuda") -> torch.Tensor:
    """The case's paged cache [num_pages, page_size, 576] (uint8): the first bytes of `pool`, or a new
    allocation when pool is None."""
    num_pages = case_kv_bytes(case) // (case.page_size * KV_DIM)
    if pool is None:
        return torch.empty(num_pages, case.page_size, KV_DIM, dtype=torch.uint8, device=device)
    if pool.numel() < case_kv_bytes(case):
        raise ValueError(f"the KV pool holds {pool.numel()} bytes, case {case.name!r} needs {case_kv_bytes(case)}")
    return pool[:case_kv_bytes(case)].view(num_pages, case.page_size, KV_DIM)


def case_bytes_and_flops(case: Case):
    return step_bytes_and_flops(case.lengths, case.heads, case.q_len)


def page_permutation(num_pages: int, order: str, device="cpu") -> torch.Tensor:
    """The pool pages the block tables hand out, in order: a random permutation (an engine's cache after a while,
    the default) or the pages in order (`--page-order in-order`: the KV as one stream, which the decode reads 2-3%
    faster at 1M tokens, docs/performance.md "The floor's read bandwidth")."""
    if order == "random":
        return torch.randperm(num_pages, device=device).int()
    if order == "in-order":
        return torch.arange(num_pages, device=device, dtype=torch.int32)
    raise ValueError(f"page order must be 'random' or 'in-order', got {order!r}")


@dataclass
class CaseInputs:
    """One case's tensors on the GPU: its inputs, outputs, plan and workspace (`case_inputs`)."""
    q: torch.Tensor
    kv: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    q_scale: torch.Tensor
    k_scale: torch.Tensor
    out: torch.Tensor
    lse: torch.Tensor
    plan: object
    ws: object
    softmax_scale: float
    p_precision: Optional[str] = None

    def plan_step(self, case: Case):
        from ..plan import plan_splits

        plan_splits(self.seq_lens, q_len=case.q_len, num_heads=case.heads, page_size=case.page_size, out=self.plan)

    def decode_step(self):
        """The decode and the combine (`mla_decode` with the plan as it stands)."""
        from ..api import mla_decode

        mla_decode(self.q, self.kv, self.block_table, self.seq_lens, softmax_scale=self.softmax_scale,
                   q_scale=self.q_scale, k_scale=self.k_scale, out=self.out, lse=self.lse, plan=self.plan,
                   workspace=self.ws, p_precision=self.p_precision)


def case_inputs(case: Case, kv_pool: Optional[torch.Tensor] = None, page_order: str = "random") -> CaseInputs:
    """Random FP8 q and KV for a case (seed 0), its block tables over the pool's pages in `page_order`, and an
    empty plan and workspace of the bench's default shape."""
    from ..api import DecodeWorkspace
    from ..plan import SplitPlan, default_num_ctas

    torch.manual_seed(0)
    batch, page = len(case.lengths), case.page_size
    pages_per = [-(-n // page) for n in case.lengths]
    kv = case_kv(kv_pool, case)
    num_pages = kv.shape[0]  # the requests' pages and one spare
    kv.random_(0, 256)
    kv[(kv & 0x7F) == 0x7F] = 0  # random bytes include the E4M3 NaN codes
    kv = kv.view(torch.float8_e4m3fn)
    max_pages = max(pages_per)
    block_table = torch.zeros(batch, max_pages, dtype=torch.int32, device="cuda")
    perm = page_permutation(num_pages - 1, page_order, "cuda")
    used = 0
    for b, n in enumerate(pages_per):
        block_table[b, :n] = perm[used:used + n]
        used += n
    seq_lens = torch.tensor(case.lengths, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, case.q_len, case.heads, KV_DIM, device="cuda").to(torch.float8_e4m3fn)
    out = torch.empty(batch, case.q_len, case.heads, LATENT_DIM, dtype=torch.bfloat16, device="cuda")
    lse = torch.empty(batch, case.q_len, case.heads, dtype=torch.float32, device="cuda")
    overhead = {} if case.segment_overhead is None else {"segment_overhead": case.segment_overhead}
    plan = SplitPlan.empty(batch, default_num_ctas("cuda", case.heads, case.q_len), device="cuda", **overhead)
    ws = DecodeWorkspace.for_plan(plan, case.q_len, case.heads)
    return CaseInputs(q, kv, block_table, seq_lens, torch.tensor([0.05], device="cuda"),
                      torch.tensor([0.05], device="cuda"), out, lse, plan, ws, 1.0 / (KV_DIM ** 0.5), case.p_precision)
