"""Run ``registration.register()`` right after sglang-omni builds its config registry.

``sglang_omni_flash_autoload.pth`` (installed into site-packages by both the wheel and the
editable install, see setup.py) imports this module at interpreter start. It must stay
cheap and must never raise: it only puts one finder at the front of ``sys.meta_path``.
That finder watches for ``sglang_omni.models.registry``; when that module has finished
executing (its last line fills ``PIPELINE_CONFIG_REGISTRY``), the finder removes itself and
registers the plugin config. Processes that never import sglang-omni pay nothing else.

Set ``SGLANG_OMNI_FLASH_AUTOLOAD=0`` to opt out for one process (``sgl-omni`` is then
exactly the stock CLI; ``--asr.speculative`` is unknown).
"""

from __future__ import annotations

import importlib.abc
import os
import sys

WATCHED = "sglang_omni.models.registry"
OPT_OUT = "SGLANG_OMNI_FLASH_AUTOLOAD"


def _register_quietly() -> None:
    try:
        from sglang_omni_flash.integration.registration import register

        register()
    except Exception:  # never break the host process; the missing field will say the rest
        import logging

        logging.getLogger("sglang_omni_flash").warning(
            "sglang-omni-flash: registering WhisperFlashASRPipelineConfig failed", exc_info=True
        )


class _RegisterAfterExec(importlib.abc.Loader):
    """Delegates to the real loader; registers once the module body has run."""

    def __init__(self, inner):
        self._inner = inner

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module):
        self._inner.exec_module(module)
        _register_quietly()

    def __getattr__(self, name):  # get_source, get_filename, ... for tracebacks and inspect
        return getattr(self._inner, name)


class _WatchRegistryImport(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname != WATCHED:
            return None
        _uninstall()
        for finder in sys.meta_path:
            find_spec = getattr(finder, "find_spec", None)
            spec = find_spec(fullname, path, target) if find_spec is not None else None
            if spec is not None and spec.loader is not None:
                spec.loader = _RegisterAfterExec(spec.loader)
                return spec
        return None


_FINDER = _WatchRegistryImport()


def _uninstall() -> None:
    try:
        sys.meta_path.remove(_FINDER)
    except ValueError:
        pass


def install() -> None:
    """Idempotent. If the registry is already imported, register now instead of waiting."""
    if os.environ.get(OPT_OUT, "1").strip().lower() in ("0", "false", "no", "off"):
        return
    if WATCHED in sys.modules:
        _register_quietly()
    elif _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)


try:
    install()
except Exception:  # pragma: no cover - a .pth hook must never stop the interpreter
    pass
