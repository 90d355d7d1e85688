"""The command line a user runs first (`python -m mla_backend`, mla_backend.cli): its output, and one-line errors
(exit 2, no traceback) for everything outside the supported shapes."""

import subprocess
import sys

import pytest

from mla_backend.cli import main, parse_q_lens, parse_seq_lens


def run(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "mla_backend", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_parse_seq_lens_repeats():
    assert parse_seq_lens("1048576,4096x3") == [1048576, 4096, 4096, 4096]
    assert parse_seq_lens("0, 7") == [0, 7]
    assert parse_q_lens("4,1,2,2") == [1, 2, 4]


@pytest.mark.parametrize("bad,words", [("", "one or more"), ("abc", "cannot read"), ("4x", "cannot read"),
                                       ("4096x0", "the count in '4096x0' must be at least 1")])
def test_parse_seq_lens_rejects_garbage(bad, words):
    with pytest.raises(Exception, match=words):
        parse_seq_lens(bad)


def test_plan_leads_with_the_split_the_balance_and_the_floor(capsys):
    assert main(["plan", "--seq-lens", "1048576,4096x15", "--heads", "12", "--q-len", "1", "--page-size", "32"]) == 0
    text = capsys.readouterr().out
    first, *rest = text.splitlines()
    assert first.startswith("16 requests, 1110016 KV tokens, 12 heads x q_len 1, page 32: split over 132 CTAs")
    assert "  1 x 1M tokens: 125 splits, merged by the combine" in rest
    assert any(line.startswith("  9 x 4K tokens: whole on one CTA") for line in rest)
    balance = [line for line in rest if line.startswith("balance:")][0]
    assert 1.0 <= float(balance.split("has ")[1].split("x")[0]) < 1.1 and "(132 of 132 CTAs busy)" in balance
    floor = [line for line in rest if line.startswith("floor on an H200:")][0]
    assert "memory-bound" in floor and "us" in floor
    # the kernel detail stays, below the summary
    assert text.index("detail (kernel terms):") > text.index("floor on an H200")
    assert "  busy CTAs: 132 of 132" in rest


def test_plan_runs_as_a_module_without_warnings():
    result = run("plan", "--seq-lens", "0,1,33x4", "--ctas", "8")
    assert result.returncode == 0, result.stderr
    assert "splits per request: 0, 1 x5" in result.stdout
    assert "  1 x 0 tokens: no KV (out = 0)" in result.stdout
    assert result.stderr == ""  # no NumPy (or any other) warning


@pytest.mark.parametrize("args,words", [
    (["plan", "--seq-lens", "1000000000000"], "--seq-lens must be at most 1048576 tokens per request"),
    (["plan", "--seq-lens", "4096", "--tile-tokens", "0"], "--tile-tokens must be a positive multiple or divisor"),
    (["plan", "--seq-lens", "4096x0"], "the count in '4096x0' must be at least 1"),
    (["plan", "--seq-lens", "4096", "--heads", "7"], "--heads must be in 8..128, got 7"),
    (["plan", "--seq-lens", "4096", "--heads", "129"], "--heads must be in 8..128, got 129"),
    (["plan", "--seq-lens", "4096", "--heads", "200"], "--heads must be in 8..128, got 200"),
    (["plan", "--seq-lens", "4096", "--q-len", "9"], "--q-len must be in 1..8, got 9"),
    (["plan", "--seq-lens", "4096", "--q-len", "100"], "--q-len must be in 1..8, got 100"),
    (["plan", "--seq-lens", "2000000"], "--seq-lens must be at most 1048576"),
    (["plan", "--seq-lens", "4096x1025"], "the number of --seq-lens (requests) must be in 1..1024, got 1025"),
    (["plan", "--seq-lens", "4096", "--overhead", "-1"], "--overhead must be >= 0"),
    (["plan", "--seq-lens", "4096", "--ctas", "0"], "--ctas must be at least 1"),
    (["plan", "--seq-lens", "4096", "--page-size", "16"], "--page-size must be one of 32, 64, got 16"),
    (["compile", "--heads", "0"], "--heads must be in 8..128, got 0"),
    (["compile", "--q-len", "9"], "--q-len must be in 1..8, got 9"),
    (["compile", "--page-size", "48"], "--page-size must be one of 32, 64, got 48"),
    (["compile", "--max-batch", "5000"], "--max-batch must be in 1..1024, got 5000"),
    (["plan"], "the following arguments are required: --seq-lens"),
])
def test_bad_arguments_are_one_line_errors_with_exit_2(args, words):
    result = run(*args)
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert words in result.stderr
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_a_bad_environment_switch_is_a_one_line_error():
    import os

    result = subprocess.run([sys.executable, "-m", "mla_backend", "plan", "--seq-lens", "4096"], capture_output=True,
                            text=True, timeout=120, env=dict(os.environ, CUTE_MLA_PDL="yes"))
    assert result.returncode == 2 and "CUTE_MLA_PDL must be 0 or 1, got 'yes'" in result.stderr
    assert "Traceback" not in result.stderr


def test_help_texts_say_how_to_reach_every_command():
    top = run("--help")
    assert top.returncode == 0 and "python -m mla_backend bench --help" in top.stdout
    assert "supported: heads 8..128" in top.stdout
    bench = run("bench", "--help")
    assert bench.returncode == 0 and "--peer" in bench.stdout and "--p-precision" in bench.stdout
    assert "before 2026" not in bench.stdout


def test_bench_without_a_hopper_gpu_says_so():
    result = run("bench", "--only", "B1")
    assert result.returncode == 2 and "needs a Hopper GPU" in result.stderr and "Traceback" not in result.stderr


def test_compile_builds_and_keeps_every_kernel_of_the_shape(tmp_path):
    """`compile --cache-dir` writes the decode, the planner and each combine a batch can pick; a second run loads
    them all instead of compiling."""
    cache = tmp_path / "kernels"
    result = run("compile", "--heads", "16", "--q-len", "1,2", "--page-size", "64", "--max-batch", "64",
                 "--cache-dir", str(cache), timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    for kind in ("decode", "combine", "planner"):
        assert any(line.split()[:2] == [kind, "sm_90a"] and "compiled in" in line for line in lines), result.stdout
    assert any("rows=16 schedule=rows16" in line for line in lines) and any("rows=32 schedule=swg" in line
                                                                            for line in lines)
    built = [line for line in lines if line.split()[0] in ("decode", "combine", "planner") and "compiled" in line]
    assert len(list(cache.glob("*.o"))) == len(built)
    again = run("compile", "--heads", "16", "--q-len", "1,2", "--page-size", "64", "--max-batch", "64",
                "--cache-dir", str(cache), timeout=900)
    assert again.returncode == 0, again.stderr[-3000:]
    kernels = [line for line in again.stdout.splitlines() if line.split()[0] in ("decode", "combine", "planner")]
    assert kernels and all(": loaded in" in line or ": ready in" in line for line in kernels), again.stdout
