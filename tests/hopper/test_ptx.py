"""The shared-memory descriptor arithmetic of `mla_backend.hopper.ptx`, on the CPU."""

from __future__ import annotations

from mla_backend.hopper.decode_layout import CHUNK, SM90_SMEM_CAPACITY
from mla_backend.hopper.ptx import DESC_LO_SWIZZLE128, smem_desc_lo

# the byte offsets `decode_mma._issue_s` steps a 64-row operand by: k32 step ks of the 576 bytes is block ks / 4
# (CHUNK rows x 128 bytes) and 32 bytes into it
S_STEP_OFFSETS = [(ks // 4) * CHUNK * 128 + (ks % 4) * 32 for ks in range(18)]


def test_smem_desc_lo_fields():
    """Bits 0-13 hold the address / 16, bit 16 the 128B swizzle's leading-offset encoding (1), nothing else."""
    for addr in (0, 16, 1024, 0x28000, SM90_SMEM_CAPACITY - 16):
        word = smem_desc_lo(addr)
        assert word & 0x3FFF == addr >> 4
        assert word & ~0x3FFF == DESC_LO_SWIZZLE128


def test_stepped_descriptor_equals_the_descriptor_of_the_stepped_address():
    """What stepped_descriptors relies on: for every 1 KB-aligned operand in the CTA's shared memory and every S
    step that stays inside it, the word + offset / 16 is the word of the address + offset."""
    for base in range(0, SM90_SMEM_CAPACITY, 1024):
        for off in S_STEP_OFFSETS:
            if base + off + 32 <= SM90_SMEM_CAPACITY:
                assert smem_desc_lo(base) + (off >> 4) == smem_desc_lo(base + off), (base, off)
