"""Only what pyproject.toml cannot say: install ``sglang_omni_flash_autoload.pth``.

The .pth file must land at the top of site-packages (not inside the package) so that the
interpreter runs it at start-up; it installs the lazy hook that registers the plugin's
pipeline config with sglang-omni (docs/integration.md). setuptools has no declarative way
to put a file there, so:

* ``build_py`` copies it to the root of the build tree -> regular wheels (and ``pip install .``);
* ``editable_wheel`` adds it to the editable wheel -> ``pip install -e .`` (the Makefile).

Both record it in the wheel's RECORD, so ``pip uninstall`` removes it.
"""

from __future__ import annotations

import os

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.editable_wheel import editable_wheel

PTH_NAME = "sglang_omni_flash_autoload.pth"
PTH_SOURCE = os.path.join("sglang_omni_flash", "integration", "serve", PTH_NAME)


class build_py_with_pth(build_py):
    def run(self):
        super().run()
        self.copy_file(PTH_SOURCE, os.path.join(self.build_lib, PTH_NAME), preserve_mode=0)

    def get_outputs(self, include_bytecode=1):
        return [*super().get_outputs(include_bytecode), os.path.join(self.build_lib, PTH_NAME)]


class _StrategyWithPth:
    """Wraps setuptools' editable strategy; writes the .pth next to its own .pth/finder."""

    def __init__(self, inner):
        self._inner = inner

    def __enter__(self):
        self._inner.__enter__()
        return self

    def __exit__(self, *exc):
        return self._inner.__exit__(*exc)

    def __call__(self, wheel, files, mapping):
        self._inner(wheel, files, mapping)
        with open(PTH_SOURCE, "rb") as fh:
            wheel.writestr(PTH_NAME, fh.read())


class editable_wheel_with_pth(editable_wheel):
    def _select_strategy(self, *args, **kwargs):
        return _StrategyWithPth(super()._select_strategy(*args, **kwargs))


setup(cmdclass={"build_py": build_py_with_pth, "editable_wheel": editable_wheel_with_pth})
