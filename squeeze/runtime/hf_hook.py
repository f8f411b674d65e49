"""Register squeeze with transformers without importing transformers at ``squeeze.register()``.

Importing transformers' quantizer registry (``transformers.quantizers.auto``) costs seconds (it pulls in
every quantization config), more than the rest of ``import squeeze``, and ``squeeze verify`` never needs
it. So ``squeeze.register()`` (not ``import squeeze``: it has no side effect on other libraries; the CLI and the
vLLM plugin call it) calls :func:`install`: if the registry is already imported it registers at once;
otherwise a one-shot import hook registers right after the registry module first executes, which every
``from_pretrained`` does before reading a config's ``quantization_config``.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings
from collections.abc import Sequence
from types import ModuleType

REGISTRY_MODULE = "transformers.quantizers.auto"


def _register() -> None:
    partial = sys.modules.get("squeeze.runtime.hf")
    if partial is not None and not hasattr(partial, "register"):
        return  # squeeze.runtime.hf is importing the registry right now; it registers itself when done
    try:
        from squeeze.runtime.hf import register

        register()
    except Exception as exc:  # noqa: BLE001 - a failure here must not break `import transformers` for others
        warnings.warn(
            f"squeeze could not register its transformers quantizer: {type(exc).__name__}: {exc}",
            RuntimeWarning,
            stacklevel=2,
        )


class _RegisterAfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself; wraps the real loader of the registry module so registration follows its execution."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != REGISTRY_MODULE:
            return None
        uninstall()  # one shot, and the lookup below must not find this finder again
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        execute = spec.loader.exec_module

        def exec_module(module: ModuleType) -> None:
            execute(module)
            _register()

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]  # this spec's own loader instance
        return spec


_FINDER = _RegisterAfterImport()


def install() -> None:
    """Register now if transformers' registry is loaded, else once it is (idempotent)."""
    if REGISTRY_MODULE in sys.modules:
        _register()
    elif _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)


def uninstall() -> None:
    """Remove the import hook (registration already done stays)."""
    while _FINDER in sys.meta_path:
        sys.meta_path.remove(_FINDER)


__all__ = ["install", "uninstall", "REGISTRY_MODULE"]
