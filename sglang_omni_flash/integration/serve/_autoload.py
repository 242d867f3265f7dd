"""Run the plugin's hooks right after sglang-omni imports the modules they patch.

``sglang_omni_flash_autoload.pth`` (installed into site-packages by both the wheel and the
editable install, see setup.py) imports this module at interpreter start. It must stay
cheap and must never raise: it only puts one finder at the front of ``sys.meta_path``.
That finder watches the modules named in ``HOOKS``; when one of them has finished
executing, the finder runs its hook (and removes itself once every watched module has
been seen):

* ``sglang_omni.models.registry`` (its last line fills ``PIPELINE_CONFIG_REGISTRY``):
  ``registration.register()`` adds the plugin config;
* ``sglang_omni.serve.openai_api`` (defines ``create_app``):
  ``registration.install_openai_errors()`` makes the apps it builds answer user mistakes on
  the audio endpoints with the OpenAI error envelope (``openai_errors``).

Processes that never import sglang-omni pay nothing else.

Set ``SGLANG_OMNI_FLASH_AUTOLOAD=0`` to opt out for one process (``sgl-omni`` is then
exactly the stock CLI; ``--asr.speculative`` is unknown, errors are FastAPI's).
"""

from __future__ import annotations

import importlib.abc
import os
import sys

OPT_OUT = "SGLANG_OMNI_FLASH_AUTOLOAD"
# watched module -> name of the function in ``registration`` that runs once it is imported
HOOKS = {
    "sglang_omni.models.registry": "register",
    "sglang_omni.serve.openai_api": "install_openai_errors",
}
WATCHED = "sglang_omni.models.registry"  # the first hook's module (kept for callers and tests)


def _run_quietly(module_name: str) -> None:
    hook = HOOKS[module_name]
    try:
        from sglang_omni_flash.integration.serve import registration

        getattr(registration, hook)()
    except Exception:  # never break the host process; the stock behaviour stays
        import logging

        logging.getLogger("sglang_omni_flash").warning(
            "sglang-omni-flash: %s() after importing %s failed", hook, module_name, exc_info=True
        )


class _HookAfterExec(importlib.abc.Loader):
    """Delegates to the real loader; runs the hook once the module body has run."""

    def __init__(self, inner, module_name: str):
        self._inner = inner
        self._module_name = module_name

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module):
        self._inner.exec_module(module)
        _run_quietly(self._module_name)

    def __getattr__(self, name):  # get_source, get_filename, ... for tracebacks and inspect
        return getattr(self._inner, name)


class _WatchImports(importlib.abc.MetaPathFinder):
    def __init__(self):
        self.pending = set()

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in self.pending:
            return None
        self.pending.discard(fullname)
        if not self.pending:
            _uninstall()
        for finder in list(sys.meta_path):
            if finder is self:
                continue
            find_spec = getattr(finder, "find_spec", None)
            spec = find_spec(fullname, path, target) if find_spec is not None else None
            if spec is not None and spec.loader is not None:
                spec.loader = _HookAfterExec(spec.loader, fullname)
                return spec
        return None


_FINDER = _WatchImports()


def _uninstall() -> None:
    try:
        sys.meta_path.remove(_FINDER)
    except ValueError:
        pass


def install() -> None:
    """Idempotent. Hooks of modules already imported run now instead of waiting."""
    if os.environ.get(OPT_OUT, "1").strip().lower() in ("0", "false", "no", "off"):
        return
    for module_name in HOOKS:
        if module_name in sys.modules:
            _FINDER.pending.discard(module_name)
            _run_quietly(module_name)
        else:
            _FINDER.pending.add(module_name)
    if _FINDER.pending and _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)


try:
    install()
except Exception:  # pragma: no cover - a .pth hook must never stop the interpreter
    pass
