"""Makes PyPI's torchvision importable beside CPU torch, for the SGLang servers of the real-engine tests.

Test support, not part of the project: this folder is on the PYTHONPATH of the SGLang servers the
tests start (``support.SGLANG_CPU_COMMAND``), and Python imports ``sitecustomize`` at start-up,
in the server and in every process it spawns. Nothing here runs at start-up beyond adding one
import hook: torch is not imported until torchvision is.

Why: SGLang imports torchvision (``srt/multimodal/internvl_utils.py``, on its import path even for
a text model), and PyPI's torchvision 0.28.0 is a CUDA build. Its compiled ops do not load next to
CPU torch, so ``torchvision.extension._has_ops()`` is false, yet ``torchvision/__init__.py``
still imports ``_meta_registrations`` and ``_autograd_registrations``, which register fake
(meta) and autograd kernels for those very ops and fail: "operator torchvision::nms does not
exist". Kernels for ops that do not exist have nothing to describe, so when the ops are missing
those two modules are replaced by empty ones; with the ops present, torchvision is untouched.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types

#: The modules that register kernels for torchvision's compiled ops.
_REGISTRATIONS = frozenset({"torchvision._meta_registrations", "torchvision._autograd_registrations"})


class _SkipRegistrationsWithoutOps(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname: str, path: object, target: object = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in _REGISTRATIONS:
            return None
        from torchvision import extension  # loaded first by torchvision/__init__.py

        if extension._has_ops():
            return None  # the normal import
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return None

    def exec_module(self, module: types.ModuleType) -> None:
        module.__doc__ = "Left empty: torchvision's compiled ops are not loaded (see sglang_cpu/sitecustomize.py)."


sys.meta_path.insert(0, _SkipRegistrationsWithoutOps())
