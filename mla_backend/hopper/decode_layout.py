"""Constants and shared-memory layouts of the SM90 decode kernels (docs/design.md explains them).

- The KV ring and Q are K-major 128B-swizzled blocks of 128 bytes per row, the layout FP8 wgmma reads: byte
  (row r, 16-byte piece c16 of block kb) lives at kb * BLOCK + r * 128 + ((c16 ^ (r % 8)) * 16). 576 bytes are
  4.5 blocks (KV_BLOCKS = 5, the rope half block keeps its own 128-byte rows). With `DecodeConfig.rope_rows` 64
  (research, the chunk-pairs schedule) the rope's block has rows of its 64 bytes in the 64B swizzle instead:
  byte (row r, piece c16 < 4) at 4 * BLOCK + r * 64 + ((c16 ^ ((r // 2) % 4)) * 16), so a chunk takes 36 KB.
- P^T (rows x 64 tokens, K-major) for the P.V wgmma: 8-row x 16-byte core matrices of 128 contiguous bytes, P_LBO
  apart along the tokens and P_SBO apart along the rows; one such plane for hi and one for lo.
- S^T (rows x 64 tokens, fp32) in rows padded to S_STRIDE floats.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute

from ..shapes import KV_DIM, LATENT_DIM

V_DIM = LATENT_DIM
PIECES = KV_DIM // 16  # 16-byte pieces per token row
LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
SM90_SMEM_CAPACITY = 227 * 1024  # dynamic shared memory per CTA
KV_BLOCKS = 5
LATENT_BLOCKS = 4  # the 128-byte blocks of the 512 latent bytes (the fifth block is the rope's 64)
ROPE_OFFSET_ROWS = LATENT_BLOCKS * 128  # the rope block's offset in a stage or Q buffer, bytes per row of it
P_LBO = 128
P_SBO = 4 * 128
CHUNK = 64  # tokens per ring stage: the wgmma M of S^T
WARPGROUP = 128  # threads
SOFTMAX_THREADS = 2 * WARPGROUP  # the two warpgroups that run the softmax (ping-pong: one chunk each)
S_K_GROUPS = 2  # S^T partials: the 18 k32 steps of the 576 bytes as two chains of 9
S_STRIDE = 64 + 8  # padded fp32 row of S^T

FP8 = cutlass.Float8E4M3FN
BF16 = cutlass.BFloat16


def swizzle128():
    """XOR byte-offset bits 4-6 (the 16-byte piece) with bits 7-9 (row % 8)."""
    return cute.make_swizzle(3, 4, 3)


def swizzle64():
    """XOR byte-offset bits 4-5 (the 16-byte piece of a 64-byte row) with bits 7-8 ((row // 2) % 4)."""
    return cute.make_swizzle(2, 4, 3)


def stage_bytes(rope_rows: int = 128) -> int:
    """Bytes of one ring stage (CHUNK tokens): the four latent blocks and the rope's block of rope_rows-byte
    rows."""
    return CHUNK * (LATENT_BLOCKS * 128 + rope_rows)


def q_bytes(rows: int, rope_rows: int = 128) -> int:
    """Bytes of a Q buffer of `rows` rows, blocked like a ring stage."""
    return rows * (LATENT_BLOCKS * 128 + rope_rows)


def ring_layout(num_stages: int, rope_rows: int = 128):
    """(16 bytes, (8 pieces, blocks), CHUNK tokens, stage) over the swizzled ring: all KV_BLOCKS blocks, or with
    rope_rows 64 the four latent ones (`ring_rope_layout` has the rope's)."""
    blocks = KV_BLOCKS if rope_rows == 128 else LATENT_BLOCKS
    return cute.make_composed_layout(swizzle128(), 0, cute.make_layout(
        (16, (8, blocks), CHUNK, num_stages), stride=(1, (16, CHUNK * 128), 128, stage_bytes(rope_rows))))


def ring_rope_layout(num_stages: int):
    """(16 bytes, 4 pieces, CHUNK tokens, stage) over the rope's 64B-swizzled block of each stage (rope_rows 64),
    from the ring's address + ROPE_OFFSET_ROWS x CHUNK."""
    return cute.make_composed_layout(swizzle64(), 0, cute.make_layout(
        (16, 4, CHUNK, num_stages), stride=(1, 16, 64, stage_bytes(64))))


def q_layout(rows: int, rope_rows: int = 128):
    """(16 bytes, (8 pieces, blocks), row) over the swizzled Q block: all KV_BLOCKS blocks, or with rope_rows 64
    the four latent ones (`q_rope_layout` has the rope's)."""
    blocks = KV_BLOCKS if rope_rows == 128 else LATENT_BLOCKS
    return cute.make_composed_layout(swizzle128(), 0, cute.make_layout(
        (16, (8, blocks), rows), stride=(1, (16, rows * 128), 128)))


def q_rope_layout(rows: int):
    """(16 bytes, 4 pieces, row) over Q's 64B-swizzled rope block (rope_rows 64), from Q's address +
    ROPE_OFFSET_ROWS x rows."""
    return cute.make_composed_layout(swizzle64(), 0, cute.make_layout((16, 4, rows), stride=(1, 16, 64)))


def p_buffer_bytes(rows: int, planes: int) -> int:
    """One buffer of P^T: `planes` e4m3 planes of rows x CHUNK tokens (only the planes in use take shared
    memory)."""
    return planes * rows * CHUNK


def p_words_layout(rows: int, planes: int, buffers: int = 2):
    """P words: (word w of a row = tokens pi(4w .. 4w + 3), row, plane, buffer) as Int32, core-matrix layout."""
    return cute.make_layout(((4, 4), (8, rows // 8), planes, buffers),
                            stride=((1, P_LBO // 4), (4, P_SBO // 4), rows * 16, planes * rows * 16))


def s_logical_row(buffer_row):
    """The query row whose S^T sits in a buffer row of the S^T-warpgroup schedule, which spreads S^T's rows over
    the banks: within each 8 rows, query row 2k + e is in buffer row k + 4e. The S^T warpgroup's stores of rows
    8i + 2 lt + e (lt = 0..3, e fixed) then land in buffer rows 72 floats apart by lt, banks 8 lt + token: no two
    lanes in one bank (in order, lt and lt + 2 met in one: 2-way); the softmax threads still read their rows'
    64-bit pairs from 4 consecutive buffer rows per half warp, also without conflicts."""
    k = buffer_row % 8
    return buffer_row - k + (k % 4) * 2 + k // 4


def s_full_layout(rows: int):
    """S^T of a whole chunk: (row, token, one part, buffer or warpgroup)."""
    return cute.make_layout((rows, CHUNK, 1, 2), stride=(S_STRIDE, 1, 0, rows * S_STRIDE))


def smem_region_bytes(rows: int, num_stages: int, p_planes: int, rope_rows: int = 128) -> dict:
    """Bytes of each data region of a decode CTA's shared memory (`decode_common`'s SharedStorage, the stage
    mbarriers left out): the KV ring, Q, two chunks of S^T, two P buffers, alpha (row, buffer), the rows' output
    scales and the ping-pong's (max, sum) exchange (2 values x rows x 2 warpgroups)."""
    return {"ring": num_stages * stage_bytes(rope_rows), "q": q_bytes(rows, rope_rows), "s": 2 * rows * S_STRIDE * 4,
            "p": 2 * p_buffer_bytes(rows, p_planes), "alpha": 2 * rows * 4, "inv_l": rows * 4,
            "row_ml": 2 * 2 * rows * 4}
