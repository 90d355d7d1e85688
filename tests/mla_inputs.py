"""Random paged MLA decode inputs shared by the tests and the benchmark."""

from __future__ import annotations

import torch

from mla_backend.shapes import FP8, KV_DIM


def make_lengths(kind: str, batch: int, generator: torch.Generator, page_size: int = 32, long: int = 4000):
    """Batches of KV lengths: 'uniform', 'random' (0..long), 'skewed' (one long request among short ones),
    'edges' (0, 1, page-1, page, page+1 ...)."""
    if kind == "uniform":
        return [long] * batch
    if kind == "random":
        return torch.randint(0, long + 1, (batch,), generator=generator).tolist()
    if kind == "skewed":
        short = torch.randint(1, max(2, long // 16), (batch,), generator=generator).tolist()
        short[int(torch.randint(0, batch, (1,), generator=generator))] = long
        return short
    if kind == "edges":
        edges = [0, 1, page_size - 1, page_size, page_size + 1, 2 * page_size + 1, 63, 64, 65]
        return [edges[i % len(edges)] for i in range(batch)]
    raise ValueError(kind)


def make_decode_inputs(lengths, *, q_len: int, num_heads: int, page_size: int, device="cpu", seed: int = 0,
                       extra_pages: int = 3, q_dtype=FP8):
    """q, kv_cache, block_table, seq_lens, q_scale, k_scale for a batch; pages are shuffled over the pool,
    and unused block-table slots hold out-of-range ids so any read past seq_lens shows up."""
    g = torch.Generator().manual_seed(seed)
    batch = len(lengths)
    pages_per = [-(-n // page_size) for n in lengths]
    max_pages = max(pages_per + [1]) + 1
    num_pages = sum(pages_per) + extra_pages
    kv = (torch.randn(num_pages, page_size, KV_DIM, generator=g) * 2).to(FP8)
    perm = torch.randperm(num_pages, generator=g)
    block_table = torch.full((batch, max_pages), 2**30, dtype=torch.int32)
    used = 0
    for b, n in enumerate(pages_per):
        block_table[b, :n] = perm[used:used + n].int()
        used += n
    q = torch.randn(batch, q_len, num_heads, KV_DIM, generator=g) * 2
    q = q.to(FP8) if q_dtype == FP8 else q.to(q_dtype)
    seq_lens = torch.tensor(lengths, dtype=torch.int32)
    q_scale = torch.tensor([0.75], dtype=torch.float32)
    k_scale = torch.tensor([0.5], dtype=torch.float32)
    tensors = [q, kv, block_table, seq_lens, q_scale, k_scale]
    return [t.to(device) for t in tensors]
