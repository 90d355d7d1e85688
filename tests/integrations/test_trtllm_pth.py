"""The `cute_mla_fp8.pth` start-up hook, as `pip install` installs it: TensorRT-LLM's rank processes are fresh
interpreters that never run the launcher's imports, so the hook is what registers `cute_mla_fp8` in them.

The slow test builds a wheel of this checkout, installs it (not editable) into a new virtual environment and starts
fresh interpreters there, against the stand-in of TensorRT-LLM's fmha package (test_trtllm_registry.py).
"""

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import zipfile
from pathlib import Path

import pytest

from mla_backend.integrations.trtllm.serve import PTH_LINE
from test_trtllm_registry import PACKAGE, write_standin

REPO = Path(__file__).resolve().parents[2]
# What a wheel is built from (pyproject.toml, setup.py, MANIFEST.in); copied so that the build leaves no build/ or
# egg-info behind in the checkout.
SOURCES = ("pyproject.toml", "setup.py", "MANIFEST.in", "README.md", "cute_mla_fp8.pth", "mla_backend")


def test_the_shipped_pth_is_the_start_up_line():
    assert (REPO / "cute_mla_fp8.pth").read_text().splitlines() == [PTH_LINE]
    assert "include cute_mla_fp8.pth" in (REPO / "MANIFEST.in").read_text().splitlines()


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """A virtual environment holding a wheel of this checkout, and the stand-in TensorRT-LLM's sys.path entry.

    The environment reaches this interpreter's site-packages (torch) through a plain path line in a .pth that sorts
    before ours: a path only, so none of that site's own .pth files (e.g. an editable install of this project,
    which carries the hook too) run in it.
    """
    tmp = tmp_path_factory.mktemp("pth")
    source = tmp / "source"
    source.mkdir()
    for name in SOURCES:
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(REPO / name, source / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(tmp / "dist"), str(source)], check=True, capture_output=True, timeout=300)
    (wheel,) = (tmp / "dist").glob("cute_mla_fp8-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        assert archive.read("cute_mla_fp8.pth").decode().splitlines() == [PTH_LINE]
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps",
                    "--no-index", str(wheel)], check=True, capture_output=True, timeout=300)
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    assert (site / "cute_mla_fp8.pth").read_text().splitlines() == [PTH_LINE]
    assert not list(site.glob("__editable__*"))  # a regular install
    (site / "_cute_mla_fp8_test_torch.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return python, site, write_standin(tmp / "standin")


def run_fresh(installed, tllm_fmha_libs):
    """What a fresh interpreter of the environment, as a rank starts, has imported and registered."""
    python, _, standin = installed
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "TLLM_FMHA_LIBS")}
    env["PYTHONPATH"] = str(standin)  # the stand-in TensorRT-LLM only: mla_backend comes from the wheel
    if tllm_fmha_libs is not None:
        env["TLLM_FMHA_LIBS"] = tllm_fmha_libs
    proc = subprocess.run([str(python), "-c", textwrap.dedent(RANK)], capture_output=True, text=True, env=env,
                          cwd=str(standin), timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "Error processing line" not in proc.stderr, proc.stderr
    return json.loads(proc.stdout)


RANK = f"""
    import importlib, json, sys
    seen = {{"imported": "mla_backend.integrations.trtllm" in sys.modules, "torch": "torch" in sys.modules}}
    if seen["imported"]:
        seen["module"] = sys.modules["mla_backend"].__file__
        registry = importlib.import_module("{PACKAGE}.registry")
        seen["libs"] = list(registry.FMHA_LIBS)
        # What FmhaManager does in every rank: each name in TLLM_FMHA_LIBS must be registered there.
        seen["enabled"] = [cls.__name__ for cls in registry.get_enabled_fmha_lib_classes()]
    print(json.dumps(seen))
"""


@pytest.mark.slow
def test_a_rank_started_with_the_switch_registers_the_library(installed):
    _, site, _ = installed
    seen = run_fresh(installed, "+cute_mla_fp8")
    assert seen["imported"] and Path(seen["module"]).is_relative_to(site)
    # ours right before TensorRT-LLM's CuTe DSL MLA library, and enabled
    assert seen["libs"].index("cute_mla_fp8") == seen["libs"].index("cute_dsl_mla") - 1
    assert seen["enabled"].index("CuteMlaFp8Fmha") == seen["enabled"].index("CuteDslMlaFmha") - 1


@pytest.mark.slow
@pytest.mark.parametrize("value", [None, "", "cute_dsl_mla,fallback", "-prims_ts"])
def test_without_the_switch_the_hook_imports_nothing(installed, value):
    assert run_fresh(installed, value) == {"imported": False, "torch": False}
