"""FP8 tensor-core building blocks for the SM90 decode kernels, as inline PTX on raw 32-bit registers.

CuTe's tiled-copy machinery has no 8-bit transposed shared-memory load for sm_90 (ldmatrix transposes 16-bit
elements only), and the P.V wgmma takes its A operand from registers in an order we choose, so the decode
kernel addresses its FP8 tiles itself and uses these primitives:

- `ldmatrix_x4`: four 8x8 b16 matrices (each 8 rows x 16 bytes) from shared memory, optionally transposed. With
  transpose, lane (g = lane / 4, t = lane % 4) receives the byte pairs (row 2t, 2t + 1) x (bytes 2g, 2g + 1);
  `prmt` regroups them into e4m3 A registers of a token-major V tile (see decode_mma.py for the order).
- `quantize_p_hi_lo`: four fp32 probabilities -> two e4m3x4 words, hi = e4m3(p) and lo = e4m3(p - hi), so that
  hi + lo carries ~7 mantissa bits of p instead of 3.
- `wgmma_ss_e4m3` / `wgmma_rs_e4m3`: warpgroup MMA m64nNk32 e4m3 -> f32 with both operands in shared memory
  (128B-swizzled K-major) or A in registers (B in the no-swizzle K-major core-matrix layout), plus the fences,
  commit and wait around them; `wgmma_ss_e4m3_desc` takes the operands' descriptor words (`smem_desc_lo`), made
  once and stepped by a schedule.
- `exp2_fma`: 2^x by a polynomial on the FMA pipe, for P values taken off MUFU (`DecodeConfig.p_exp2_fma`).
- `cp_async_16_l2_128`: a 16-byte cp.async with the L2::128B prefetch hint, which CuTe's copy atom cannot express;
  `prefetch_l2_bulk`: a bulk prefetch of global bytes into L2 (`DecodeConfig.kv_prefetch`).
- `barrier_any`: a named barrier that also ORs a predicate over the threads that pass it.
- `mbarrier_arrive_peer`: an arrival on the mbarrier at the same shared-memory offset in another CTA of the
  cluster (`DecodeConfig.kv_multicast`).
- `sm_clock` / `store_global_u32`: the SM's cycle counter and a plain global store, for the timeline builds of the
  decode (config.DecodeConfig.timeline); `store_shared_v2_f32`: an 8-byte shared store of two floats.
- `load_global_cg_u32` / `load_global_cg_f32`: global loads from the L2, for the combine's reads of the plan ahead
  of its wait for the decode (`combine.py`).

Shared-memory reads and the wgmma issue are marked side-effecting so LLVM keeps them in order with the barriers
and waits that guard them; accumulators are pinned after `wgmma_wait` with `fence_operand`.
"""

from __future__ import annotations

import struct

from cutlass import Float32, Int32, Int64
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op


def _struct(n, ty):
    return llvm.StructType.get_literal([ty] * n)


def _asm(result_type, operands, text, constraints, side_effects, loc, ip):
    return llvm.inline_asm(result_type, operands, text, constraints, has_side_effects=side_effects,
                           is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)


@dsl_user_op
def ldmatrix_x4(smem_addr, transpose: bool = False, *, loc=None, ip=None):
    """ldmatrix.m8n8.x4.b16: lanes 8j..8j+7 give the row addresses (shared window, 32-bit) of matrix j."""
    trans = ".trans" if transpose else ""
    res = _asm(
        _struct(4, T.i32()),
        [Int32(smem_addr).ir_value(loc=loc, ip=ip)],
        f"ldmatrix.sync.aligned.m8n8.x4{trans}.shared.b16 {{$0, $1, $2, $3}}, [$4];",
        "=r,=r,=r,=r,r",
        True, loc, ip)
    return tuple(Int32(llvm.extractvalue(T.i32(), res, [i], loc=loc, ip=ip)) for i in range(4))


@dsl_user_op
def prmt(a, b, selector: int, *, loc=None, ip=None):
    """Byte i of the result is byte (selector >> 4i) & 7 of the 8-byte value {b, a}."""
    return Int32(_asm(
        T.i32(),
        [Int32(a).ir_value(loc=loc, ip=ip), Int32(b).ir_value(loc=loc, ip=ip)],
        f"prmt.b32 $0, $1, $2, {selector:#06x};",
        "=r,r,r",
        False, loc, ip))


@dsl_user_op
def quantize_p_e4m3(p0, p1, p2, p3, *, loc=None, ip=None):
    """One e4m3x4 word, byte i from p_i (round to nearest, saturating)."""
    return Int32(_asm(
        T.i32(),
        [Float32(x).ir_value(loc=loc, ip=ip) for x in (p0, p1, p2, p3)],
        "{\n"
        ".reg .b16 h0, h1;\n"
        "cvt.rn.satfinite.e4m3x2.f32 h0, $2, $1;\n"
        "cvt.rn.satfinite.e4m3x2.f32 h1, $4, $3;\n"
        "mov.b32 $0, {h0, h1};\n"
        "}",
        "=r,f,f,f,f",
        False, loc, ip))


# exp2_fma's polynomial: 2^f on [0, 1) as 1 + f (c1 + f (c2 + f c3)), fitted for the least largest relative error
# (8.6e-5; e4m3's rounding of P is 2^-4)
EXP2_FMA_COEFFS = (0.6951172, 0.2276452, 0.07706616)


@dsl_user_op
def exp2_fma(x, *, loc=None, ip=None):
    """2^x for x <= 127 on the FMA pipe instead of MUFU (an SM's MUFU does 16 exp2 a cycle): x clamped to -126
    (below it the result is 2^-126, which P's e4m3 rounds to 0), floor(x) by an add rounding down onto a magic
    number (which also holds 2^floor(x)'s biased exponent), the fraction's polynomial (EXP2_FMA_COEFFS) times that
    power of two. NaN stays NaN (max.NaN and the arithmetic after it carry it)."""
    c1, c2, c3 = (f"0f{_f32_bits(c):08X}" for c in EXP2_FMA_COEFFS)
    return Float32(_asm(
        T.f32(),
        [Float32(x).ir_value(loc=loc, ip=ip)],
        "{\n"
        ".reg .f32 xc, t, j, f, p, two_j;\n"
        ".reg .b32 tb;\n"
        "max.NaN.f32 xc, $1, 0fC2FC0000;\n"  # -126
        "add.rm.f32 t, xc, 0f4B40007F;\n"  # 1.5 x 2^23 + 127 + floor(xc): ulp 1 there, rounded down
        "sub.f32 j, t, 0f4B40007F;\n"  # floor(xc), exact
        "sub.f32 f, xc, j;\n"  # [0, 1), exact
        f"fma.rn.f32 p, f, {c3}, {c2};\n"
        f"fma.rn.f32 p, p, f, {c1};\n"
        "fma.rn.f32 p, p, f, 0f3F800000;\n"
        "mov.b32 tb, t;\n"
        "shl.b32 tb, tb, 23;\n"  # (floor(xc) + 127) << 23: 2^floor(xc)
        "mov.b32 two_j, tb;\n"
        "mul.rn.f32 $0, p, two_j;\n"
        "}",
        "=f,f",
        False, loc, ip))


def _f32_bits(value: float) -> int:
    return struct.unpack("<I", struct.pack("<f", value))[0]


@dsl_user_op
def quantize_p_hi_lo(p0, p1, p2, p3, *, loc=None, ip=None):
    """(hi, lo) e4m3x4 words, byte i from p_i: hi = e4m3(p), lo = e4m3(p - float(hi)); saturating."""
    res = _asm(
        _struct(2, T.i32()),
        [Float32(x).ir_value(loc=loc, ip=ip) for x in (p0, p1, p2, p3)],
        "{\n"
        ".reg .b16 h0, h1, l0, l1, f0, f1, f2, f3;\n"
        ".reg .b32 x01, x23;\n"
        ".reg .f32 r0, r1, r2, r3;\n"
        "cvt.rn.satfinite.e4m3x2.f32 h0, $3, $2;\n"
        "cvt.rn.satfinite.e4m3x2.f32 h1, $5, $4;\n"
        "mov.b32 $0, {h0, h1};\n"
        "cvt.rn.f16x2.e4m3x2 x01, h0;\n"
        "cvt.rn.f16x2.e4m3x2 x23, h1;\n"
        "mov.b32 {f0, f1}, x01;\n"
        "mov.b32 {f2, f3}, x23;\n"
        "cvt.f32.f16 r0, f0;\n"
        "cvt.f32.f16 r1, f1;\n"
        "cvt.f32.f16 r2, f2;\n"
        "cvt.f32.f16 r3, f3;\n"
        "sub.f32 r0, $2, r0;\n"
        "sub.f32 r1, $3, r1;\n"
        "sub.f32 r2, $4, r2;\n"
        "sub.f32 r3, $5, r3;\n"
        "cvt.rn.satfinite.e4m3x2.f32 l0, r1, r0;\n"
        "cvt.rn.satfinite.e4m3x2.f32 l1, r3, r2;\n"
        "mov.b32 $1, {l0, l1};\n"
        "}",
        "=r,=r,f,f,f,f",
        False, loc, ip)
    return Int32(llvm.extractvalue(T.i32(), res, [0], loc=loc, ip=ip)), \
        Int32(llvm.extractvalue(T.i32(), res, [1], loc=loc, ip=ip))


# ------------------------------------------------------------------------------------------------ wgmma
# Shared-memory matrix descriptor (sm_90): bits 0-13 start address >> 4, 16-29 leading byte offset >> 4,
# 32-45 stride byte offset >> 4, 62-63 swizzle (1 = 128 B). The K-major 128B-swizzled canonical layout keeps
# rows of 128 bytes in 8-row (1024 B) atoms; the leading offset is unused there (encoded 1), the stride offset
# is the atom size. Moving along K inside a row is done by adding bytes / 16 to the start address.
DESC_LO_SWIZZLE128 = 1 << 16
DESC_HI_LAYOUT_SWIZZLE128 = 1 << 30  # bits 62-63 of the descriptor, seen from its high word
DESC_HI_SWIZZLE128 = (1024 >> 4) | DESC_HI_LAYOUT_SWIZZLE128
# The 64B-swizzled K-major layout (swizzle 2: rows of 64 bytes in 8-row, 512 B atoms): the rope's block of the ring
# and Q with `DecodeConfig.rope_rows` 64
DESC_HI_SWIZZLE64 = (512 >> 4) | (2 << 30)


@dsl_user_op
def cp_async_16_l2_128(smem_addr, gmem_addr, *, loc=None, ip=None):
    """cp.async of 16 bytes (global -> shared, L1 bypassed) with the L2::128B prefetch hint: an L2 miss fetches
    the whole 128-byte line from DRAM at once. CuTe's cp.async atom has no such option."""
    _asm(None, [Int32(smem_addr).ir_value(loc=loc, ip=ip), Int64(gmem_addr).ir_value(loc=loc, ip=ip)],
         "cp.async.cg.shared.global.L2::128B [$0], [$1], 16;", "r,l", True, loc, ip)


@dsl_user_op
def prefetch_l2_bulk(gmem_addr, nbytes: int, *, loc=None, ip=None):
    """cp.async.bulk.prefetch.L2 of nbytes (a multiple of 16) from a 16-byte-aligned global address: the bytes
    are fetched into L2 with nothing written to shared memory and nothing to wait for."""
    assert nbytes % 16 == 0, nbytes
    _asm(None, [Int64(gmem_addr).ir_value(loc=loc, ip=ip)], f"cp.async.bulk.prefetch.L2.global [$0], {nbytes};",
         "l", True, loc, ip)


@dsl_user_op
def fence_proxy_async_smem(*, loc=None, ip=None):
    """Make this thread's generic-proxy shared-memory writes (st.shared, cp.async) visible to wgmma."""
    _asm(None, [], "fence.proxy.async.shared::cta;", "", True, loc, ip)


@dsl_user_op
def wgmma_fence(*, loc=None, ip=None):
    _asm(None, [], "wgmma.fence.sync.aligned;", "", True, loc, ip)


@dsl_user_op
def wgmma_commit(*, loc=None, ip=None):
    _asm(None, [], "wgmma.commit_group.sync.aligned;", "", True, loc, ip)


@dsl_user_op
def wgmma_wait(pending: int = 0, *, loc=None, ip=None):
    _asm(None, [], f"wgmma.wait_group.sync.aligned {pending};", "", True, loc, ip)


@dsl_user_op
def fence_operand(x, *, loc=None, ip=None):
    """Pin a wgmma accumulator after wgmma_wait: an opaque side-effecting move, so no use of it is hoisted
    above the wait and no write to it sinks below the next issue."""
    return Float32(_asm(T.f32(), [Float32(x).ir_value(loc=loc, ip=ip)], "mov.b32 $0, $1;", "=f,0", True, loc, ip))


# How the SS wgmma's operand words become its descriptors (high word desc_hi): from shared addresses (mask and shift
# each), or from descriptor low words already made (`smem_desc_lo`). $A and $B stand for the operands' asm indices.
def _ss_descriptors_from_addresses(desc_hi: int) -> str:
    return (
        ".reg .b32 alo, blo, dhi;\n"
        ".reg .b64 da, db;\n"
        ".reg .pred p;\n"
        f"mov.b32 dhi, {desc_hi};\n"
        "shr.b32 alo, $A, 4;\n"
        "and.b32 alo, alo, 0x3FFF;\n"
        f"or.b32 alo, alo, {DESC_LO_SWIZZLE128};\n"
        "mov.b64 da, {alo, dhi};\n"
        "shr.b32 blo, $B, 4;\n"
        "and.b32 blo, blo, 0x3FFF;\n"
        f"or.b32 blo, blo, {DESC_LO_SWIZZLE128};\n"
        "mov.b64 db, {blo, dhi};\n"
    )


def _ss_descriptors_from_words(desc_hi: int) -> str:
    return (
        ".reg .b32 dhi;\n"
        ".reg .b64 da, db;\n"
        ".reg .pred p;\n"
        f"mov.b32 dhi, {desc_hi};\n"
        "mov.b64 da, {$A, dhi};\n"
        "mov.b64 db, {$B, dhi};\n"
    )


def _wgmma_ss_e4m3(a, b, acc, accumulate, descriptors: str, loc, ip):
    n_acc = len(acc)
    n = n_acc * 2
    outs = ", ".join(f"${i}" for i in range(n_acc))
    ia, ib, iacc = n_acc, n_acc + 1, n_acc + 2
    operands = [Int32(a).ir_value(loc=loc, ip=ip), Int32(b).ir_value(loc=loc, ip=ip),
                Int32(accumulate).ir_value(loc=loc, ip=ip)]
    operands += [Float32(x).ir_value(loc=loc, ip=ip) for x in acc]
    asm = (
        "{\n"
        + descriptors.replace("$A", f"${ia}").replace("$B", f"${ib}")
        + f"setp.ne.b32 p, ${iacc}, 0;\n"
        f"wgmma.mma_async.sync.aligned.m64n{n}k32.f32.e4m3.e4m3 {{{outs}}}, da, db, p, 1, 1;\n"
        "}"
    )
    constraints = ",".join(["=f"] * n_acc + ["r", "r", "r"] + [str(i) for i in range(n_acc)])
    res = _asm(_struct(n_acc, T.f32()), operands, asm, constraints, True, loc, ip)
    return [Float32(llvm.extractvalue(T.f32(), res, [i], loc=loc, ip=ip)) for i in range(n_acc)]


@dsl_user_op
def wgmma_ss_e4m3(a_addr, b_addr, acc, accumulate, *, swizzle64: bool = False, loc=None, ip=None):
    """D = A.B^T (+ D if accumulate != 0): wgmma m64nNk32 e4m3 -> f32, N = 2 * len(acc).

    a_addr / b_addr: shared addresses of the K-major 128B-swizzled operands (A: 64 rows, B: N rows; with
    swizzle64 both 64B-swizzled), already advanced to the k32 step. acc: this thread's N / 2 accumulators (PTX
    fragment order)."""
    desc_hi = DESC_HI_SWIZZLE64 if swizzle64 else DESC_HI_SWIZZLE128
    return _wgmma_ss_e4m3(a_addr, b_addr, acc, accumulate, _ss_descriptors_from_addresses(desc_hi), loc, ip)


def smem_desc_lo(addr):
    """The low word of the swizzled K-major descriptor of shared address addr (`wgmma_ss_e4m3`'s; the same for the
    128B and 64B swizzles, which differ in the high word). A CTA's shared window is under 2^18 bytes, so the word
    of addr + 16 j (an operand moved along K, or to a later block of rows) is this word + j: a schedule computes it
    once per operand and steps it with one add."""
    return ((addr >> 4) & 0x3FFF) | DESC_LO_SWIZZLE128


@dsl_user_op
def wgmma_ss_e4m3_desc(a_lo, b_lo, acc, accumulate, *, swizzle64: bool = False, loc=None, ip=None):
    """`wgmma_ss_e4m3` on operands given by their descriptors' low words (`smem_desc_lo`, the same for both
    swizzles), the high word the 128B-swizzled layout's (with swizzle64 the 64B one's): where a warp-uniform word
    is stepped by a constant per k32 step, ptxas issues one uniform add per operand instead of rebuilding each
    descriptor from its address."""
    desc_hi = DESC_HI_SWIZZLE64 if swizzle64 else DESC_HI_SWIZZLE128
    return _wgmma_ss_e4m3(a_lo, b_lo, acc, accumulate, _ss_descriptors_from_words(desc_hi), loc, ip)


@dsl_user_op
def wgmma_ss_e4m3_a64(a_addr, b_addr, b_lbo: int, b_sbo: int, acc, *, loc=None, ip=None):
    """D += A.B^T, wgmma m64nNk32 e4m3 -> f32 with both operands in shared memory, K-major: A 64 rows of 64 bytes
    in the 64B swizzle (`wgmma_ss_e4m3(swizzle64=True)`'s A), B without swizzle as for `wgmma_rs_e4m3` (core
    matrices b_lbo bytes apart along K, b_sbo along N); both addresses advanced to the k32 step."""
    n_acc = len(acc)
    n = n_acc * 2
    outs = ", ".join(f"${i}" for i in range(n_acc))
    ia, ib = n_acc, n_acc + 1
    operands = [Int32(a_addr).ir_value(loc=loc, ip=ip), Int32(b_addr).ir_value(loc=loc, ip=ip)]
    operands += [Float32(x).ir_value(loc=loc, ip=ip) for x in acc]
    asm = (
        "{\n"
        ".reg .b32 alo, ahi, blo, bhi;\n"
        ".reg .b64 da, db;\n"
        ".reg .pred p;\n"
        f"mov.b32 ahi, {DESC_HI_SWIZZLE64};\n"
        f"shr.b32 alo, ${ia}, 4;\n"
        "and.b32 alo, alo, 0x3FFF;\n"
        f"or.b32 alo, alo, {DESC_LO_SWIZZLE128};\n"
        "mov.b64 da, {alo, ahi};\n"
        f"mov.b32 bhi, {b_sbo >> 4};\n"
        f"shr.b32 blo, ${ib}, 4;\n"
        "and.b32 blo, blo, 0x3FFF;\n"
        f"or.b32 blo, blo, {(b_lbo >> 4) << 16};\n"
        "mov.b64 db, {blo, bhi};\n"
        "setp.eq.b32 p, blo, blo;\n"  # scale-d: accumulate
        f"wgmma.mma_async.sync.aligned.m64n{n}k32.f32.e4m3.e4m3 {{{outs}}}, da, db, p, 1, 1;\n"
        "}"
    )
    constraints = ",".join(["=f"] * n_acc + ["r", "r"] + [str(i) for i in range(n_acc)])
    res = _asm(_struct(n_acc, T.f32()), operands, asm, constraints, True, loc, ip)
    return [Float32(llvm.extractvalue(T.f32(), res, [i], loc=loc, ip=ip)) for i in range(n_acc)]


@dsl_user_op
def wgmma_rs_e4m3(a, b_addr, b_lbo: int, b_sbo: int, acc, *, b_swizzle128: bool = False, accumulate: bool = True,
                  loc=None, ip=None):
    """D += A.B^T, wgmma m64nNk32 e4m3 -> f32 with A from registers (4 Int32, the mma.m16n8k32 A fragment of
    this warp's 16 rows) and B from shared memory K-major: without swizzle 8-row x 16-byte core matrices of 128
    contiguous bytes, b_lbo bytes apart along K and b_sbo bytes apart along N; with b_swizzle128 rows of 128
    bytes in the 128B swizzle (b_lbo 16, b_sbo 1024: the ring's and Q's layout), b_addr advanced to the k32 step
    as for `wgmma_ss_e4m3`."""
    n_acc = len(acc)
    n = n_acc * 2
    outs = ", ".join(f"${i}" for i in range(n_acc))
    ia = n_acc
    ib = n_acc + 4
    operands = [Int32(x).ir_value(loc=loc, ip=ip) for x in a] + [Int32(b_addr).ir_value(loc=loc, ip=ip)]
    operands += [Float32(x).ir_value(loc=loc, ip=ip) for x in acc]
    desc_lo = (b_lbo >> 4) << 16
    desc_hi = (b_sbo >> 4) | (DESC_HI_LAYOUT_SWIZZLE128 if b_swizzle128 else 0)
    asm = (
        "{\n"
        ".reg .b32 blo, dhi;\n"
        ".reg .b64 db;\n"
        ".reg .pred p;\n"
        f"mov.b32 dhi, {desc_hi};\n"
        f"shr.b32 blo, ${ib}, 4;\n"
        "and.b32 blo, blo, 0x3FFF;\n"
        f"or.b32 blo, blo, {desc_lo};\n"
        "mov.b64 db, {blo, dhi};\n"
        # scale-d: accumulate into acc, or (accumulate=False) write A.B^T over whatever acc holds
        f"setp.{'eq' if accumulate else 'ne'}.b32 p, blo, blo;\n"
        f"wgmma.mma_async.sync.aligned.m64n{n}k32.f32.e4m3.e4m3 {{{outs}}}, "
        f"{{${ia}, ${ia + 1}, ${ia + 2}, ${ia + 3}}}, db, p, 1, 1;\n"
        "}"
    )
    constraints = ",".join(["=f"] * n_acc + ["r"] * 5 + [str(i) for i in range(n_acc)])
    res = _asm(_struct(n_acc, T.f32()), operands, asm, constraints, True, loc, ip)
    return [Float32(llvm.extractvalue(T.f32(), res, [i], loc=loc, ip=ip)) for i in range(n_acc)]


@dsl_user_op
def barrier_any(barrier_id: int, num_threads: int, pred, *, loc=None, ip=None):
    """bar.red.or.pred on named barrier barrier_id of num_threads threads: a barrier that also returns, in every
    participating thread, 1 if pred (an Int32) is nonzero in any of them, else 0."""
    return Int32(_asm(
        T.i32(), [Int32(pred).ir_value(loc=loc, ip=ip)],
        "{\n.reg .pred p, q;\n"
        "setp.ne.s32 q, $1, 0;\n"
        f"bar.red.or.pred p, {barrier_id}, {num_threads}, q;\n"
        "selp.s32 $0, 1, 0, p;\n}",
        "=r,r", True, loc, ip))


@dsl_user_op
def mbarrier_arrive_peer(smem_addr, peer_rank, *, loc=None, ip=None):
    """One arrival on the mbarrier at shared-memory address smem_addr (this CTA's 32-bit window) in the cluster's CTA
    of rank peer_rank (mapa), with the arrive's default semantics (release at CTA scope), as a TMA multicast
    pipeline's consumers tell the other CTAs that a stage they write into is read."""
    _asm(None, [Int32(smem_addr).ir_value(loc=loc, ip=ip), Int32(peer_rank).ir_value(loc=loc, ip=ip)],
         "{\n.reg .b32 remote;\n"
         "mapa.shared::cluster.u32 remote, $0, $1;\n"
         "mbarrier.arrive.shared::cluster.b64 _, [remote];\n}",
         "r,r", True, loc, ip)


@dsl_user_op
def sm_clock(*, loc=None, ip=None):
    """The SM's 32-bit cycle counter (%clock)."""
    return Int32(_asm(T.i32(), [], "mov.u32 $0, %clock;", "=r", True, loc, ip))


@dsl_user_op
def store_global_u32(gmem_addr, value, *, loc=None, ip=None):
    """st.global.u32 of value at a 64-bit global address."""
    _asm(None, [Int64(gmem_addr).ir_value(loc=loc, ip=ip), Int32(value).ir_value(loc=loc, ip=ip)],
         "st.global.u32 [$0], $1;", "l,r", True, loc, ip)


@dsl_user_op
def load_global_cg_u32(gmem_addr, *, loc=None, ip=None):
    """ld.global.cg.u32 at a 64-bit global address: from the L2, never a line the SM's L1 kept (a load issued
    before `griddepcontrol.wait`, which an L1 not yet invalidated for this grid could otherwise answer)."""
    return Int32(_asm(T.i32(), [Int64(gmem_addr).ir_value(loc=loc, ip=ip)], "ld.global.cg.u32 $0, [$1];", "=r,l",
                      True, loc, ip))


@dsl_user_op
def load_global_cg_f32(gmem_addr, *, loc=None, ip=None):
    """ld.global.cg.f32 at a 64-bit global address (`load_global_cg_u32`)."""
    return Float32(_asm(T.f32(), [Int64(gmem_addr).ir_value(loc=loc, ip=ip)], "ld.global.cg.f32 $0, [$1];", "=f,l",
                        True, loc, ip))


@dsl_user_op
def store_shared_v2_f32(smem_addr, x, y, *, loc=None, ip=None):
    """st.shared.v2.f32 of (x, y) at an 8-byte-aligned shared address (32-bit, shared window)."""
    _asm(None, [Int32(smem_addr).ir_value(loc=loc, ip=ip), Float32(x).ir_value(loc=loc, ip=ip),
                Float32(y).ir_value(loc=loc, ip=ip)],
         "st.shared.v2.f32 [$0], {$1, $2};", "r,f,f", True, loc, ip)
