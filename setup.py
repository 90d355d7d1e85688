"""Installs `cute_mla_fp8.pth` at the top of site-packages, beside the package: for `pip install .`, wheels, sdists
(MANIFEST.in) and `pip install -e .` (PEP 660). Everything else is in pyproject.toml.

The .pth is TensorRT-LLM's start-up hook (docs/trtllm.md): a line that every Python process runs at start-up and that
imports `mla_backend.integrations.trtllm` only when TLLM_FMHA_LIBS names cute_mla_fp8, so TensorRT-LLM's spawned
rank processes register the library before they build the model. Without that variable it imports nothing.
"""

import os

from setuptools import setup
from setuptools.command.build_py import build_py

PTH = "cute_mla_fp8.pth"
HERE = os.path.dirname(os.path.abspath(__file__))


class build_py_with_pth(build_py):
    def run(self):
        super().run()
        # A wheel's root (build_lib here) is unpacked into site-packages.
        targets = [self.build_lib]
        if getattr(self, "editable_mode", False):
            # PEP 660: setuptools' editable_wheel throws build_lib away and points `install`'s install_lib at the
            # root of the editable wheel it is packing (setuptools >= 64).
            targets.append(self.get_finalized_command("install").install_lib)
        for target in targets:
            self.mkpath(target)
            self.copy_file(os.path.join(HERE, PTH), os.path.join(target, PTH), preserve_mode=False)


setup(cmdclass={"build_py": build_py_with_pth})
