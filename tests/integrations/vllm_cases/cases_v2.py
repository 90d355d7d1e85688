"""CUTE_MLA_FP8 on the metadata path of vLLM 0.33's Model Runner V2, the default runner of 0.33.

V2 makes the builders through `AttentionGroup.create_metadata_builders` and builds every step's metadata with
`v1/worker/gpu/attn_utils.build_attn_metadata`, as `DefaultModelState.prepare_attn` calls it: padded sizes for
FULL CUDA graphs (padding requests have 0 query tokens and seq_len 0), the real sizes otherwise, and
`InputBatch.make_dummy` batches for graph capture and warm-up. These tests run those functions on the CPU with our
builder and check the decode metadata they produce: the query lengths vLLM can hand forward_mqa (any of
1..reorder_batch_threshold, not only 1 and the full verify block), plans and workspaces only from start-up, and
padded replays decoding to zeros for the padding.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import vllm_engine
from vllm_engine import (LAYER, NUM_HEADS, LayerScales, engine_config, kv_cache_spec, make_impl,
                         no_plan_or_workspace_allocation, plan_pointers)

import vllm.model_executor.layers.attention.mla_attention as mla_attention
import vllm.utils.torch_utils as torch_utils
from vllm.config import set_current_vllm_config
from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec
from vllm.v1.worker.gpu.attn_utils import build_attn_metadata
from vllm.v1.worker.gpu.input_batch import InputBatch, InputBuffers
from vllm.v1.worker.utils import AttentionGroup

from mla_backend.integrations.vllm.backend import CuteMLAFP8Backend
from mla_backend.reference import mla_decode_reference

PAGE = 64
NUM_PAGES = 64
MAX_BLOCKS = 16


@pytest.fixture(autouse=True)
def v2_on_the_cpu(monkeypatch):
    # Mixed batches stage host copies in pinned memory, which needs an accelerator.
    monkeypatch.setattr(torch_utils, "PIN_MEMORY", False)
    monkeypatch.setattr(mla_attention, "PIN_MEMORY", False)
    vllm_engine.clear_resources()
    yield
    vllm_engine.clear_resources()


class V2Worker:
    """The attention side of a V2 worker: our impl reserved in the profiling run, then the KV-cache group's
    attention group with its builders made by vLLM's own create_metadata_builders."""

    def __init__(self, tmp_path, drafts):
        self.config = engine_config(tmp_path, PAGE, num_speculative_tokens=drafts)
        self.impl = make_impl(self.config)
        with set_current_vllm_config(self.config):
            self.impl.reserve_workspace()
            spec = kv_cache_spec(PAGE)
            self.group = AttentionGroup(CuteMLAFP8Backend, [LAYER], spec, 0)
            self.group.create_metadata_builders(self.config, torch.device("cpu"))
        (self.builder,) = self.group.metadata_builders
        self.kv_cache_config = KVCacheConfig(num_blocks=NUM_PAGES, kv_cache_tensors=[],
                                             kv_cache_groups=[KVCacheGroupSpec([LAYER], spec)])
        self.threshold = self.builder.reorder_batch_threshold

    def build(self, *, num_reqs, num_tokens, query_start_loc, seq_lens, max_query_len, for_capture=False,
              block_table=None):
        """build_attn_metadata as DefaultModelState.prepare_attn calls it; our layer's metadata."""
        qsl = torch.from_numpy(np.asarray(query_start_loc, dtype=np.int32).copy())
        if block_table is None:
            block_table = torch.zeros(num_reqs, MAX_BLOCKS, dtype=torch.int32)
        seq_lens = torch.as_tensor(seq_lens, dtype=torch.int32)
        max_seq_len = self.config.model_config.max_model_len if for_capture else int(seq_lens.max())
        with set_current_vllm_config(self.config):
            metadata = build_attn_metadata(
                attn_groups=[[self.group]], num_reqs=num_reqs, num_tokens=num_tokens, query_start_loc_gpu=qsl,
                query_start_loc_cpu=qsl.clone(), max_query_len=max_query_len, seq_lens=seq_lens,
                max_seq_len=max_seq_len, block_tables=[block_table],
                slot_mappings=torch.zeros(1, num_tokens, dtype=torch.int64), kv_cache_config=self.kv_cache_config,
                seq_lens_cpu_upper_bound=seq_lens.clone(), is_prefilling=torch.zeros(num_reqs, dtype=torch.bool),
                for_cudagraph_capture=for_capture)
        return metadata[LAYER]

    def build_dummy(self, num_reqs, num_tokens, max_query_len=None, for_capture=False):
        """A capture or warm-up batch: InputBatch.make_dummy, as the V2 CUDA-graph manager makes them."""
        batch = InputBatch.make_dummy(num_reqs, num_tokens, InputBuffers(256, 8192, torch.device("cpu")),
                                      max_query_len=max_query_len)
        if max_query_len is None:
            max_query_len = int(batch.num_scheduled_tokens.max())
        return self.build(num_reqs=batch.num_reqs, num_tokens=batch.num_tokens,
                          query_start_loc=batch.query_start_loc_np[:batch.num_reqs + 1],
                          seq_lens=batch.seq_lens, max_query_len=max_query_len, for_capture=for_capture)


def decode_shape(metadata):
    return metadata.num_decodes, metadata.num_decode_tokens, metadata.num_prefills, \
        metadata.decode.q_len if metadata.decode is not None else None


@pytest.mark.parametrize("drafts", [0, 3, 7])
def test_full_graph_capture_batches_decode_the_verify_block(tmp_path, drafts):
    worker = V2Worker(tmp_path, drafts)
    q = drafts + 1
    assert worker.threshold == q
    with no_plan_or_workspace_allocation():
        metadata = worker.build_dummy(8, 8 * q, max_query_len=q, for_capture=True)
    assert decode_shape(metadata) == (8, 8 * q, 0, q)
    assert metadata.decode.split_plan is worker.builder._plans[q]


@pytest.mark.parametrize("drafts", [3, 7])
def test_piecewise_warm_up_batches_hand_us_shorter_query_lengths(tmp_path, drafts):
    """The V2 capture and warm-up batches alone already reach q_len 1, 2 and 4 besides 1 + drafts: every q_len up
    to the threshold must be ready before serving."""
    worker = V2Worker(tmp_path, drafts)
    pointers = plan_pointers(worker.builder)
    with no_plan_or_workspace_allocation():
        shapes = {tokens: decode_shape(worker.build_dummy(2, tokens)) for tokens in (3, 5)}
        many = decode_shape(worker.build_dummy(128, 520))
    assert shapes == {3: (1, 1, 1, 1), 5: (1, 2, 1, 2)}  # one decode of q_len 1 or 2, beside a prefill
    # 520 tokens over 128 requests: 120 of 4 tokens, then 8 of 5; the uniform run of 4 are the decodes
    assert many[:2] == (120, 480) and many[3] == 4
    assert plan_pointers(worker.builder) == pointers


@pytest.mark.parametrize("drafts", [3, 7])
def test_eager_steps_of_every_query_length_use_the_start_up_plans(tmp_path, drafts):
    """Steps sorted as the V2 runner sorts them (decodes first): uniform decodes of any q_len in 1..threshold,
    with a prefill behind them."""
    worker = V2Worker(tmp_path, drafts)
    pointers = plan_pointers(worker.builder)
    for q_len in range(1, worker.threshold + 1):
        lens = [q_len, q_len, q_len, worker.threshold + 30]
        qsl = np.concatenate([[0], np.cumsum(lens)])
        with no_plan_or_workspace_allocation():
            metadata = worker.build(num_reqs=4, num_tokens=int(qsl[-1]), query_start_loc=qsl,
                                    seq_lens=[300, 301, 302, lens[-1]], max_query_len=max(lens))
        assert decode_shape(metadata) == (3, 3 * q_len, 1, q_len)
        assert metadata.decode.split_plan is worker.builder._plans[q_len]
        assert metadata.decode.workspace is worker.builder._workspaces[q_len]
    assert plan_pointers(worker.builder) == pointers


def test_padded_full_graph_replay_decodes_the_padding_to_zeros(tmp_path):
    """A FULL-graph replay of 5 requests padded to the 8-request graph: the padding requests have no query tokens,
    seq_len 0 and zeroed block-table rows; the real rows match the reference and the padding rows are zeros."""
    worker = V2Worker(tmp_path, 3)
    q = worker.threshold
    generator = torch.Generator().manual_seed(11)
    seq_lens = [100, 200, 300, 400, 500, 0, 0, 0]
    block_table = torch.zeros(8, MAX_BLOCKS, dtype=torch.int32)
    block_table[:5, :8] = torch.randperm(NUM_PAGES, generator=generator)[:40].view(5, 8).to(torch.int32)
    qsl = [0] + [q * (i + 1) for i in range(5)] + [5 * q] * 3
    with no_plan_or_workspace_allocation():
        metadata = worker.build(num_reqs=8, num_tokens=8 * q, query_start_loc=qsl, seq_lens=seq_lens,
                                max_query_len=q, block_table=block_table)
        assert decode_shape(metadata) == (8, 8 * q, 0, q)
        scales = LayerScales(q_scale=0.05, k_scale=0.02)
        mqa_q = (torch.randn(8 * q, NUM_HEADS, 576, generator=generator) * 4).to(torch.float8_e4m3fn)
        kv_cache = (torch.randn(NUM_PAGES, PAGE, 576, generator=generator) * 8).to(torch.float8_e4m3fn)
        out, lse = worker.impl.forward_mqa(mqa_q, kv_cache, metadata, scales)
    assert lse is None
    ref, _ = mla_decode_reference(mqa_q[:5 * q].view(5, q, NUM_HEADS, 576), kv_cache, block_table[:5],
                                  torch.tensor(seq_lens[:5], dtype=torch.int32), softmax_scale=worker.impl.scale,
                                  q_scale=scales._q_scale, k_scale=scales._k_scale)
    torch.testing.assert_close(out[:5 * q].float(), ref.reshape(-1, NUM_HEADS, 512).float(), atol=2e-2,
                               rtol=2e-2)
    assert torch.count_nonzero(out[5 * q:]) == 0


def test_microbatch_builders_each_plan_into_their_own_buffers(tmp_path):
    """With two microbatches V2 makes two builders per group, and both metadata are built before either runs."""
    config = engine_config(tmp_path, PAGE, num_speculative_tokens=1)
    config.parallel_config.enable_dbo = True
    impl = make_impl(config)
    with set_current_vllm_config(config):
        impl.reserve_workspace()
        group = AttentionGroup(CuteMLAFP8Backend, [LAYER], kv_cache_spec(PAGE), 0)
        with no_plan_or_workspace_allocation():
            group.create_metadata_builders(config, torch.device("cpu"), num_metadata_builders=2)
    first, second = group.metadata_builders
    assert all(first._plans[q] is not second._plans[q] for q in (1, 2))
    assert first._workspaces[2].partial_out.data_ptr() == second._workspaces[2].partial_out.data_ptr()
    assert NUM_HEADS == first.num_heads
