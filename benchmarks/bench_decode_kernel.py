"""The SM90 decode kernel alone (no planner, no combine, no graph), and interleaved A/B runs of its configurations.

    python benchmarks/bench_decode_kernel.py --heads 12 --q-len 1 --page 32 --kv 1048576 --batch 4

    python benchmarks/bench_decode_kernel.py --case "12 8 32 1048576 1" --case "16 2 32 1048576 2" \\
        --variant p_planes=2 --variant rows_per_block=64,num_stages=3 --variant skip=softmax+pv

Each --variant SPEC is a set of overrides of the decode configuration the runtime picks for a case
(`mla_backend.config.decode_config`): comma-separated FIELD=VALUE pairs of the fields in VARIANT_FIELDS, e.g.
`p_planes=1`, `rows_per_block=32`, `num_stages=4`, `p_precision=fp8x2`, `causal=0`, or `skip=PART+PART` with
parts from config.DECODE_PARTS (that work left out: a research build whose outputs are wrong,
benchmarks/ablate_decode.py). Fields a SPEC leaves out keep decode_config's defaults for the configuration it
sets (rows_per_block=48 alone also takes 48 rows' ring stages and P planes). Every variant is compiled like
the runtime's kernel (`hopper.decode.compile_decode`) and timed next to the default configuration ("current"),
in rounds that alternate between the versions, so that clock and thermal drift hit all of them alike, and each
variant's outputs (final rows and partials, one call on the same inputs and plan) are compared with the current
kernel's: "identical" or the largest difference; `--error` adds every version's relative L2 error and largest lse
difference against the fp32 reference (`mla_backend.reference`) on the same inputs, its partials merged as the
combine merges them (`--inputs rising` swaps the bench's random KV for keys rising along each request,
`rise_keys`). A bad SPEC is an error naming it (exit 2), before anything runs. A change to the kernel's code is
timed by running this tool on each commit, or, when it is worth keeping as a choice, by a configuration field that
selects it. `--compile-only` compiles every version and stops, on a machine without a GPU too: run with
`CUTE_MLA_KERNEL_CACHE=DIR` there, and the GPU run of the same versions with the same sources loads them from DIR
instead of spending its time compiling.

Timing: one launch per sample, CUDA events around it, after a ~200 us spin kernel, so that the GPU is still
busy while the host enqueues the start event, the launch and the end event (without it the host's launch path,
~70-80 us at 1M x B4, is timed too). The floor is the KV bytes over the read bandwidth measured at the start of
the same run (`mla_backend.bench.ceilings`, the step bench's streaming-read kernel). `python -m mla_backend
bench` is the decode-step benchmark (planner and combine included, CUDA graphs).

The L2 is not emptied between launches here. A change to how the KV reaches shared memory can measure
differently as a step: the ping-pong's L2::128B copy hint gained 2-4% here and 4-13% in the step
(docs/experiments.md), so confirm such changes with the step benchmark.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

from mla_backend.bench.timing import SPIN_CYCLES
from mla_backend.config import DECODE_PARTS, check_p_precision

PROG = "bench_decode_kernel.py"


def error(prog: str, message) -> int:
    """Print a one-line command-line error; returns its exit status, 2."""
    print(f"{prog}: error: {message}", file=sys.stderr)
    return 2


def _flag(text: str) -> bool:
    if text not in ("0", "1", "true", "false"):
        raise ValueError(f"expected 0, 1, true or false, got {text!r}")
    return text in ("1", "true")


def _parts(text: str) -> frozenset:
    parts = frozenset(p for p in text.split("+") if p)
    unknown = sorted(parts - set(DECODE_PARTS))
    if unknown:
        raise ValueError(f"unknown part {', '.join(map(repr, unknown))} (parts: {', '.join(DECODE_PARTS)})")
    return parts


# The decode_config keywords a --variant may set, and how each value is read. The case gives num_heads, q_len and
# page_size, the plan tile_tokens; timeline builds need a spare workspace slot (benchmarks/timeline_decode.py).
VARIANT_FIELDS = {"rows_per_block": int, "num_stages": int, "p_planes": int, "p_precision": check_p_precision,
                  "causal": _flag, "skip": _parts, "kv_loads": str, "kv_refill": str, "kv_box_tokens": int,
                  "pv_order": str, "lazy_rescale": _flag, "unit_rescale_skip": _flag, "poison_smem": _flag,
                  "s_chains": int, "q_in_registers": _flag, "chunk_pairs": _flag,
                  "s_ahead": _flag, "p_exp2_fma": int, "mma_registers": int,
                  "own_chunk_first": _flag, "early_rescale": _flag, "pv_behind": int,
                  "s_under_rescale": _flag, "kv_prefetch": int, "kv_load_copies": int, "kv_multicast": _flag,
                  "rope_rows": int,
                  "p_after_pv": _flag,
                  "pv_second_per_tile": _flag, "s_between_pv": _flag, "s_after_pv": _flag,
                  "stages_under_s": _flag, "vt_smem": _flag,
                  "pair_rescale_skip": _flag, "pair_stagger": int}


def parse_variant(spec: str) -> dict:
    """'p_planes=1', 'rows_per_block=32,num_stages=4' or 'skip=softmax+pv' -> decode_config keyword overrides.
    Raises ValueError naming the spec for anything it cannot read."""
    overrides = {}
    for item in spec.split(","):
        field, sep, value = item.strip().partition("=")
        try:
            if not sep or not field:
                raise ValueError("expected FIELD=VALUE")
            if field not in VARIANT_FIELDS:
                raise ValueError(f"unknown field {field!r} (fields: {', '.join(VARIANT_FIELDS)})")
            if field in overrides:
                raise ValueError(f"{field} given twice")
            overrides[field] = VARIANT_FIELDS[field](value.strip())
        except ValueError as err:
            raise ValueError(f"--variant {spec!r}: {err}") from None
    return overrides


def format_overrides(overrides: dict) -> str:
    """The SPEC of decode_config overrides (parse_variant's inverse), e.g. 'p_planes=1,skip=pv+softmax'."""
    def value(v):
        return "+".join(sorted(v)) if isinstance(v, frozenset) else str(int(v) if isinstance(v, bool) else v)
    return ",".join(f"{k}={value(v)}" for k, v in overrides.items())


def parse_case(text: str):
    """'heads q_len page kv batch' -> a tuple of 5 ints."""
    try:
        case = tuple(int(x) for x in text.split())
    except ValueError:
        case = ()
    if len(case) != 5:
        raise ValueError(f"--case needs 5 numbers (heads q_len page kv batch), got {text!r}")
    return case


def case_config(case, overrides=None, rows_per_block=None):
    """The decode configuration of a case (heads, q_len, page, ...) with --rows-per-block and a variant's overrides
    (the variant's win)."""
    from mla_backend.config import decode_config

    kwargs = {} if rows_per_block is None else {"rows_per_block": rows_per_block}
    kwargs.update(overrides or {})
    heads, q_len, page = case[:3]
    return decode_config(heads, q_len, page, **kwargs)


def version_configs(case, variants, rows_per_block=None):
    """[(name, DecodeConfig)]: "current" and each (name, overrides) of `variants` for one case; ValueError naming
    the version whose configuration is invalid."""
    versions = []
    for name, overrides in [("current", None), *variants]:
        try:
            versions.append((name, case_config(case, overrides, rows_per_block)))
        except ValueError as err:
            raise ValueError(f"{_version(name, case)}: {err}") from None
    return versions


def _version(name: str, case) -> str:
    """How an error names a version of a case."""
    which = "the current configuration" if name == "current" else f"--variant {name!r}"
    return f"{which}, case {' '.join(map(str, case))!r}"


def compile_versions(case, versions) -> None:
    """Compile every configuration of a case (no GPU needed); ValueError naming the version that does not build
    (e.g. more shared memory than an SM90 CTA has)."""
    from mla_backend.hopper.decode import compile_decode

    for name, cfg in versions:
        try:
            compile_decode(cfg)
        except ValueError as err:
            raise ValueError(f"{_version(name, case)}: {err}") from None


def _time_once(fn) -> float:
    """GPU seconds of one fn() call (see the module docstring for why the spin kernel goes first)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(SPIN_CYCLES)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e-3


INPUTS = ("bench", "rising")


def rise_keys(inp) -> None:
    """`--inputs rising`: Gaussian KV (sigma 2) whose tokens grow along each request from 0.5x to 3.5x, with every
    997th token (from the 500th) at 6x, and unit q / k scales: rows whose max keeps moving by small steps, some
    tokens far above the rest (where the lazy rescale leaves the top token's p off 1)."""
    torch.manual_seed(1)
    page = inp.kv.shape[1]
    kv = torch.randn(inp.kv.shape, device=inp.kv.device) * 2
    for b, n in enumerate(inp.seq_lens.tolist()):
        tok = torch.arange(n, device=kv.device)
        gain = 0.5 + 3.0 * tok.float() / max(n, 1)
        gain[tok % 997 == 500] = 6.0
        pages, slots = inp.block_table[b, tok // page].long(), tok % page
        kv[pages, slots] *= gain[:, None]
    inp.kv.copy_(kv.to(inp.kv.dtype))
    inp.q_scale.fill_(1.0)
    inp.k_scale.fill_(1.0)


def step_case(heads, q_len, page, kv_len, batch):
    """The step bench's case (`mla_backend.bench.cases.Case`) of `batch` requests of kv_len tokens."""
    from mla_backend.bench.cases import Case

    return Case(f"H{heads} q{q_len} page {page} {kv_len} x B{batch}", [kv_len] * batch, heads, q_len, page)


def make_inputs(heads, q_len, page, kv_len, batch, inputs="bench"):
    """The step bench's inputs for `batch` requests of kv_len tokens (`mla_backend.bench.cases.case_inputs`: random
    FP8 q and KV, seed 0, pages in random order), with its plan computed; `inputs="rising"` replaces the KV and
    the scales (`rise_keys`)."""
    from mla_backend.bench.cases import case_inputs

    case = step_case(heads, q_len, page, kv_len, batch)
    inp = case_inputs(case)
    if inputs == "rising":
        rise_keys(inp)
    inp.plan_step(case)
    return inp


def with_plan(inp, num_ctas):
    """A plan of num_ctas CTAs for inp's requests and its workspace."""
    from mla_backend.api import DecodeWorkspace
    from mla_backend.plan import SplitPlan, plan_splits

    batch, q_len, heads, _ = inp.q.shape
    plan = SplitPlan.empty(batch, num_ctas, device="cuda")
    plan_splits(inp.seq_lens, q_len=q_len, num_heads=heads, page_size=inp.kv.shape[1], out=plan)
    return plan, DecodeWorkspace.for_plan(plan, q_len, heads)


def decode_fn(cfg, inp, plan=None, ws=None, partial_out=None, partial_lse=None):
    """A launch of the decode of `cfg` on inp (its plan and workspace unless given), into outputs of its own."""
    plan = inp.plan if plan is None else plan
    ws = inp.ws if ws is None else ws
    partial_out = ws.partial_out if partial_out is None else partial_out
    partial_lse = ws.partial_lse if partial_lse is None else partial_lse
    out, lse = torch.empty_like(inp.out), torch.empty_like(inp.lse)

    def decode():
        from mla_backend.hopper.decode import run_decode

        run_decode(cfg, inp.q, inp.kv, inp.block_table, inp.seq_lens, inp.softmax_scale, inp.q_scale, inp.k_scale,
                   plan, out, lse, partial_out, partial_lse, torch.cuda.current_stream())
    # what one call writes: the final rows of single-split requests and the partials of the others
    decode.outputs = (out, lse, partial_out, partial_lse)
    return decode


def outputs_of(fn):
    """Run fn once on zeroed outputs and return copies of everything it wrote (rows it does not own stay 0)."""
    for t in fn.outputs:
        t.zero_()
    fn()
    torch.cuda.synchronize()
    return [t.clone() for t in fn.outputs]


def compare_outputs(ref, got) -> str:
    """'identical' when every tensor matches bit for bit, else the largest absolute difference (NaN-aware)."""
    if all(torch.equal(a, b) for a, b in zip(ref, got)):
        return "identical"
    worst = 0.0
    for a, b in zip(ref, got):
        diff = (a.float() - b.float()).abs()
        bad = torch.isnan(a.float()) != torch.isnan(b.float())
        worst = max(worst, float("inf") if bool(bad.any()) else float(diff.nan_to_num(0.0).max()))
    return f"DIFFERENT (max |diff| {worst:.3g})"


def reference_errors(inp, outputs):
    """(relative L2 error of the output, largest lse difference) of each launch's final rows (`outputs_of`; its
    partials merged as the combine merges them) against the fp32 reference on the same inputs."""
    from mla_backend.reference import lse_max_error, merge_decode_outputs, mla_decode_reference, relative_l2_error

    ref_out, ref_lse = mla_decode_reference(inp.q, inp.kv, inp.block_table, inp.seq_lens,
                                            softmax_scale=inp.softmax_scale, q_scale=inp.q_scale, k_scale=inp.k_scale)
    errors = []
    for out in outputs:
        final_out, final_lse = merge_decode_outputs(inp.plan, *out, inp.k_scale)
        errors.append((relative_l2_error(final_out, ref_out), lse_max_error(final_lse, ref_lse)))
    return errors


def run_case(case, versions, rounds, per_round, bandwidth, ctas=(), errors=False, inputs="bench"):
    """Time every (name, config) of `versions` on one case (inputs of `make_inputs`); with `ctas`, the current
    kernel also on plans of those CTA counts; with `errors`, each version's error against the reference too."""
    inp = make_inputs(*case, inputs=inputs)
    current = versions[0][1]
    names = [name + (" (= current)" if i and cfg == current else "") for i, (name, cfg) in enumerate(versions)]
    fns = [decode_fn(cfg, inp) for _, cfg in versions]
    for n in ctas:
        fns.append(decode_fn(current, inp, *with_plan(inp, n)))
        names.append(f"current, {n} plan CTAs")
    for fn in fns:  # compile, then ~0.3 s of warm-up: an idle H200 sits at 345 MHz
        fn()
    torch.cuda.synchronize()
    for fn in fns:
        for _ in range(max(1, int(0.3 / len(fns) / max(_time_once(fn), 1e-6)))):
            fn()
    torch.cuda.synchronize()
    times = [[] for _ in fns]
    for _ in range(rounds):
        for t, fn in zip(times, fns):
            t.extend(_time_once(fn) for _ in range(per_round))
    kv_bytes = int(inp.seq_lens.sum()) * inp.kv.shape[2]
    floor = kv_bytes / bandwidth
    heads, q_len, page, kv_len, batch = case
    # the variants' outputs against the current kernel's, same inputs and plan (the timing loop checks nothing)
    outputs = [outputs_of(fn) for fn in fns[:len(versions)]]
    same = [compare_outputs(outputs[0], out) for out in outputs[1:]]
    errs = reference_errors(inp, outputs) if errors else []
    print(f"H{heads} q{q_len} page {page} {kv_len} x B{batch} (KV floor {floor * 1e6:.1f} us; current: "
          f"{current.rows_per_block} rows, {current.num_stages} stages, {current.p_planes} P planes):")
    for i, (name, t) in enumerate(zip(names, times)):
        med = statistics.median(t)
        spread = (max(t) - min(t)) / med
        check = f"  outputs {same[i - 1]}" if 0 < i < len(versions) else ""
        if i < len(errs):
            check += f"  error {errs[i][0]:.2e}, lse {errs[i][1]:.1e}"
        print(f"  {name:>24}: {med * 1e6:8.1f} us  {med / floor:5.3f} x floor  {kv_bytes / med / 1e12:.2f} TB/s "
              f"of KV  (min {min(t) * 1e6:.1f}, spread {spread:.1%}){check}")


def report_compiles(case, versions) -> None:
    """One line per compiled version: how this process got its kernel (compiled, or loaded from the kernel cache)
    and the kernel's name in a cache directory."""
    from mla_backend import jit_cache

    for i, (name, cfg) in enumerate(versions):
        how, seconds = jit_cache.origin(cfg)
        same = " (= current)" if i and cfg == versions[0][1] else ""
        print(f"{' '.join(map(str, case))}: {name}{same}: {how} in {seconds:.1f} s ({jit_cache.kernel_name(cfg)})")


def run(cases, variants, rounds=8, per_round=5, rows_per_block=None, ctas=(), prog=PROG, errors=False,
        inputs="bench", compile_only=False) -> int:
    """Time the current configuration and each (name, overrides) of `variants` on every case (heads, q_len, page,
    kv, batch). Every configuration is resolved first, then compiled: one that is invalid or does not build is a
    one-line error (2), as is no GPU. compile_only: compile them and stop (no GPU needed), saying how each kernel
    was got."""
    try:
        versions = [version_configs(c, variants, rows_per_block) for c in cases]
    except ValueError as err:
        return error(prog, err)
    if not compile_only and not torch.cuda.is_available():
        return error(prog, "needs a CUDA GPU (Hopper)")
    try:
        for case, vs in zip(cases, versions):
            compile_versions(case, vs)
    except ValueError as err:
        return error(prog, err)
    if compile_only:
        for case, vs in zip(cases, versions):
            report_compiles(case, vs)
        return 0
    from mla_backend.bench.ceilings import measure_read_bandwidth

    bandwidth = measure_read_bandwidth()
    print(f"read bandwidth {bandwidth / 1e12:.2f} TB/s")
    for case, vs in zip(cases, versions):
        run_case(case, vs, rounds, per_round, bandwidth, ctas, errors, inputs)
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--q-len", type=int, default=1)
    p.add_argument("--page", type=int, default=32)
    p.add_argument("--kv", type=int, default=1 << 20, help="KV tokens per request")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--case", action="append", default=[],
                   help='"heads q_len page kv batch"; repeatable; replaces --heads/--q-len/--page/--kv/--batch')
    p.add_argument("--variant", action="append", default=[], metavar="SPEC",
                   help="configuration overrides to time as well, e.g. p_planes=1 or skip=softmax+pv (repeatable)")
    p.add_argument("--rows-per-block", type=int, default=None,
                   help="query rows per CTA for every version (16, 32, 48 or 64; default: the runtime's)")
    p.add_argument("--ctas", type=int, action="append", default=[],
                   help="also time the current kernel on a plan of this many CTAs (default: plan.default_num_ctas)")
    p.add_argument("--error", action="store_true",
                   help="also each version's relative L2 error and largest lse difference against the fp32 "
                        "reference on the same inputs")
    p.add_argument("--inputs", choices=INPUTS, default="bench",
                   help="the step bench's random inputs, or KV rising along each request (rise_keys)")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--per-round", type=int, default=5)
    p.add_argument("--compile-only", action="store_true",
                   help="compile every version and stop (no GPU needed): with CUTE_MLA_KERNEL_CACHE set, a GPU run "
                        "of the same versions then loads them instead of compiling")
    args = p.parse_args(argv)
    try:
        cases = [parse_case(c) for c in args.case] or [(args.heads, args.q_len, args.page, args.kv, args.batch)]
        variants = [(spec, parse_variant(spec)) for spec in args.variant]
    except ValueError as err:
        return error(PROG, err)
    return run(cases, variants, args.rounds, args.per_round, args.rows_per_block, args.ctas, errors=args.error,
               inputs=args.inputs, compile_only=args.compile_only)


if __name__ == "__main__":
    sys.exit(main())
