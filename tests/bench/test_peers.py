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
