"""The command line a user runs first: `python -m mla_backend plan`."""

import subprocess
import sys

import pytest

from mla_backend.__main__ import main, parse_seq_lens


def test_parse_seq_lens_repeats():
    assert parse_seq_lens("1048576,4096x3") == [1048576, 4096, 4096, 4096]
    assert parse_seq_lens("0, 7") == [0, 7]


@pytest.mark.parametrize("bad", ["", "abc", "4x", "-1"])
def test_parse_seq_lens_rejects_garbage(bad):
    with pytest.raises(Exception, match="seq-lens"):
        parse_seq_lens(bad)


def test_plan_command_prints_the_skewed_plan(capsys):
    assert main(["plan", "--seq-lens", "1048576,4096x15", "--heads", "12", "--q-len", "1", "--page-size", "32"]) == 0
    text = capsys.readouterr().out
    assert "batch 16" in text and "132 CTAs" in text
    assert "busy CTAs: 132 of 132" in text
    balance = float(text.split("balance:")[1].split("=")[1].strip().rstrip("x"))
    assert 1.0 <= balance < 1.1


def test_plan_command_runs_as_a_module():
    result = subprocess.run([sys.executable, "-m", "mla_backend", "plan", "--seq-lens", "0,1,33x4", "--ctas", "8"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "splits per request: 0, 1 x5" in result.stdout


@pytest.mark.parametrize("heads,q_len,page", [(12, 1, 32), (16, 8, 64)])
def test_compile_command_builds_the_decode_path_without_a_gpu(heads, q_len, page):
    result = subprocess.run([sys.executable, "-m", "mla_backend", "compile", "--arch", "sm_90a", "--heads", str(heads),
                             "--q-len", str(q_len), "--page-size", str(page)],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    for kernel in ("decode", "combine", "planner"):
        assert any(line.split()[:2] == [kernel, "sm_90a"] for line in lines), result.stdout
