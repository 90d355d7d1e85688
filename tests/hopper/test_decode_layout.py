"""The decode's shared-memory layouts (`mla_backend.hopper.decode_layout`), on the CPU: bank arithmetic."""

from __future__ import annotations

import pytest

from mla_backend.hopper.decode_layout import CHUNK, S_STRIDE, s_logical_row

BANKS = 32


def _store_banks(rows: int, spread: bool):
    """For every 4-byte S^T store instruction of the S^T warpgroup (`decode_mma._store_s`: lane (lg, lt) of warp
    wl stores accumulator 4i + e (+2: token + 8) at query row 8i + 2 lt + e, token 16 wl + lg), the banks its 32
    lanes hit."""
    to_buffer = {s_logical_row(b): b for b in range(rows)} if spread else {r: r for r in range(rows)}
    for wl in range(4):
        for i in range(rows // 8):
            for e in range(2):
                for h in range(2):
                    yield [(to_buffer[8 * i + 2 * lt + e] * S_STRIDE + 16 * wl + lg + 8 * h) % BANKS
                           for lg in range(8) for lt in range(4)]


def _read_banks(rows: int, tpr: int):
    """For every 64-bit S^T load of the softmax (`softmax._softmax_max`: thread t reads buffer row t // tpr, token
    pairs n0 + 8 c of its words w = t % tpr + tpr i, n0 = 16 (w // 4) + 2 (w % 4)), per half warp (a 64-bit
    access is served 16 lanes at a time), the banks each lane's pair starts at."""
    for warp in range(rows * tpr // 32):
        for i in range(CHUNK // 4 // tpr):
            for c in range(2):
                for half in range(2):
                    starts = []
                    for lane in range(16 * half, 16 * half + 16):
                        t = 32 * warp + lane
                        w = t % tpr + tpr * i
                        n = 16 * (w // 4) + 2 * (w % 4) + 8 * c
                        starts.append(((t // tpr) * S_STRIDE + n) % BANKS)
                    yield starts


@pytest.mark.parametrize("rows", [32, 48, 64])
def test_s_rows_spread_is_a_permutation_within_eight(rows):
    buffer_rows = list(range(rows))
    logical = [s_logical_row(b) for b in buffer_rows]
    assert sorted(logical) == buffer_rows
    assert all(lg // 8 == b // 8 for b, lg in zip(buffer_rows, logical))


@pytest.mark.parametrize("rows,tpr", [(32, 8), (48, 4), (64, 4)])
def test_spread_s_rows_store_and_read_without_bank_conflicts(rows, tpr):
    """With the rows spread every store instruction's 32 lanes hit 32 banks (in order: two lanes a bank), and
    every half warp of the softmax's 64-bit loads covers 32 banks, as it did in order."""
    assert all(len(set(banks)) == BANKS for banks in _store_banks(rows, spread=True))
    assert not any(len(set(banks)) == BANKS for banks in _store_banks(rows, spread=False))  # 2-way in order
    for starts in _read_banks(rows, tpr):
        covered = {s % BANKS for s in starts} | {(s + 1) % BANKS for s in starts}
        assert len(covered) == BANKS
