"""mla_backend.bench.peers: FlashMLA is never a dependency; where it cannot be loaded the bench gets
PeerUnavailable with a message that says from where and why."""

import pytest

from mla_backend.bench import peers


def test_no_importable_module_is_peer_unavailable():
    with pytest.raises(peers.PeerUnavailable, match="could not be loaded from a module named flashmla_dense_fp8: "
                                                    "No module named 'flashmla_dense_fp8'"):
        peers.load_flashmla()


def test_a_missing_extension_or_a_failing_builder_is_peer_unavailable(tmp_path):
    missing = str(tmp_path / "flashmla_dense_fp8.so")
    with pytest.raises(peers.PeerUnavailable, match="could not be loaded from " + missing):
        peers.load_flashmla(missing)
    builder = tmp_path / "build_flashmla.py"
    builder.write_text("def load_flashmla():\n    raise RuntimeError('no CUDA toolkit here')\n")
    with pytest.raises(peers.PeerUnavailable, match="build_flashmla.py: no CUDA toolkit here"):
        peers.load_flashmla(str(builder))
    builder.write_text("def load_flashmla():\n    return 'the extension'\n")
    assert peers.load_flashmla(str(builder)) == "the extension"


def test_an_unknown_peer_is_an_error():
    with pytest.raises(ValueError, match="peer must be one of"):
        peers.peer_step("flashinfer", None, None, None)


def test_flashmla_lse_is_read_in_our_row_order():
    """FlashMLA's fwd_kvcache_mla_fp8 returns lse as (batch, heads, q_len) (its pybind reshape); the bench compares
    it with the reference's (batch, q_len, heads), so a head's and a position's values must not trade places."""
    from types import SimpleNamespace

    import torch

    batch, q_len, heads = 2, 3, 4
    ours = torch.arange(batch * q_len * heads, dtype=torch.float32).reshape(batch, q_len, heads)
    theirs = torch.empty(batch, heads, q_len)
    for b in range(batch):
        for t in range(q_len):
            for h in range(heads):
                theirs[b, h, t] = ours[b, t, h]

    class FakeExtension:
        def get_mla_decoding_metadata_dense_fp8(self, seq_lens, rows, heads_k):
            return None, None

        def fwd_kvcache_mla_fp8(self, *args):
            return torch.zeros(batch, q_len, heads, 512), theirs

    inp = SimpleNamespace(q=torch.zeros(batch, q_len, heads, 576), kv=torch.zeros(3, peers.FLASHMLA_PAGE_SIZE, 576),
                          seq_lens=None, block_table=None, softmax_scale=1.0, q_scale=None, k_scale=None)
    step = peers.FlashMLAStep(FakeExtension(), inp, q_len)
    step()
    assert torch.equal(step.lse_rows(), ours)
