"""benchmarks/sustained_steps.py: nvidia-smi's samples summarized over the busy ones (clock, power, the share
power-capped), and bad arguments as one-line errors (exit 2) before anything runs; its replays need a GPU."""

import shutil

import pytest
import torch

import sustained_steps

SAMPLES = [
    "2026/12/06 11:05:31.625, 1980, 124.57, 0x0000000000000000",  # idle: left out
    "2026/12/06 11:05:31.679, 1980, 512.20, 0x0000000000000000",
    "2026/12/06 11:05:31.729, 1410, 698.10, 0x0000000000000004",  # the software power cap
    "2026/12/06 11:05:31.780, 1125, 731.90, 0x0000000000000024",  # the cap among other reasons
    "[Unknown Error]",
    "2026/12/06 11:05:31.830, 1500",  # cut off by the sampler's end
]


def test_samples_are_summarized_over_the_busy_ones():
    got = sustained_steps.summarize_samples(SAMPLES)
    assert got == {"count": 3, "clock_median": 1410.0, "clock_min": 1125.0, "power_median": 698.1,
                   "capped": pytest.approx(2 / 3)}
    assert sustained_steps.summarize_samples(SAMPLES[:1] + SAMPLES[4:]) is None


@pytest.mark.parametrize("argv,message", [
    (["--case", "128 1 64"], "case"),
    (["--case", "128 1 64 1048576 4", "--variant", "kv_load_copies=3", "--decode"], "kv_load_copies is 1 or 2"),
    (["--variant", "kv_load_copies=2"], "give --decode too"),
    (["--seconds", "0"], "--seconds must be in"),
    (["--rounds", "0"], "--rounds must be at least 1"),
])
def test_bad_arguments_are_one_line_errors(argv, message, capsys):
    assert sustained_steps.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("sustained_steps.py: error:") and message in err


def test_without_a_gpu_or_nvidia_smi_it_says_so(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(shutil, "which", lambda name: None)
    assert sustained_steps.main(["--case", "12 8 64 131072 4"]) == 2
    assert "needs nvidia-smi" in capsys.readouterr().err
    monkeypatch.setattr(shutil, "which", lambda name: "/usr/bin/" + name)
    assert sustained_steps.main(["--case", "12 8 64 131072 4"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
