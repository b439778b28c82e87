"""Build hook: every build generates the gRPC stubs (git-ignored, never committed) from proto/.

Everything else about the distribution is in pyproject.toml. A wheel gets the stubs in its build tree;
an editable install (`pip install -e .`, `make install`) writes them into proto/ in place, as
setuptools does for extension modules, because that install imports proto/ from the checkout.
"""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent


def generate_stubs(out: Path) -> None:
    spec = importlib.util.spec_from_file_location("generate_stubs", ROOT / "scripts" / "generate_stubs.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.generate(out, ROOT / "proto")


class BuildPyWithStubs(build_py):
    def run(self) -> None:
        if not self.editable_mode:
            # setuptools copies into build/lib and never empties it: a module deleted since the last
            # build in this checkout would still be shipped.
            shutil.rmtree(Path(self.build_lib, "minilm_embed"), ignore_errors=True)
        super().run()
        if self.editable_mode:
            generate_stubs(ROOT / "proto")
        else:
            generate_stubs(Path(self.build_lib, "minilm_embed", "proto"))


setup(cmdclass={"build_py": BuildPyWithStubs})
