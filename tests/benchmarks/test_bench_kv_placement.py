"""benchmarks/bench_kv_placement.py: bad arguments as one-line errors (exit 2) before anything runs; its
timings need a GPU."""

import pytest
import torch

import bench_kv_placement


@pytest.mark.parametrize("argv,message", [
    (["--case", "H99"], "--case 'H99' names no --many-rows case"),
    (["--case", "H64", "--case", "nothing"], "--case 'nothing'"),
    (["--pools", "0"], "--pools must be 1-16, got 0"),
    (["--pools", "17"], "--pools must be 1-16, got 17"),
    (["--reps", "0"], "--reps and --rounds must be at least 1"),
    (["--rounds", "0"], "--reps and --rounds must be at least 1"),
])
def test_bad_arguments_are_one_line_errors(argv, message, capsys):
    assert bench_kv_placement.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("bench_kv_placement.py: error:") and message in err


def test_without_a_gpu_it_says_so(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench_kv_placement.main(["--case", "H16 q4", "--pools", "2"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
