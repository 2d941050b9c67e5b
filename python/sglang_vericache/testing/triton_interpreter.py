"""A faster TRITON_INTERPRET=1 for the test suite: device-function calls skip re-patching triton.language.

Triton's interpreter (3.x) patches triton.language's builtins at every kernel launch and undoes it at
the end; a call of a @triton.jit device function from inside the kernel patches them again
(`InterpretedFunction.__call__` -> `_patch_lang`), although the launch already did, and never undoes
it. That second patching replaces already-patched members with equivalent ones and costs
inspect.getmembers over the language modules per call: about a third of an interpreted forward of
our kernels, which call small helpers (sgl_kernel_ext._common) in their inner loops. `install()` makes
a device call skip it while a launch that patched the same modules is running. Nothing a kernel
computes changes; without the interpreter, or with a triton whose interpreter lacks these hooks,
it does nothing.
"""

from __future__ import annotations

import inspect
import threading

_state = threading.local()  # .langs: the language modules the running launch patched (None: no launch)
_installed = False


def _langs(fn) -> frozenset[int]:
    import triton.language as tl

    return frozenset(id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core))


def install() -> bool:
    """Apply the patch once per process; False where this triton's interpreter has no such hooks."""
    global _installed
    if _installed:
        return True
    try:
        from triton.runtime import interpreter
    except ImportError:
        return False
    grid_call = getattr(getattr(interpreter, "GridExecutor", None), "__call__", None)
    patch_lang = getattr(interpreter, "_patch_lang", None)
    scope_cls = getattr(interpreter, "_LangPatchScope", None)
    if grid_call is None or patch_lang is None or scope_cls is None:
        return False

    def launch(self, *args, **kwargs):
        outer = getattr(_state, "langs", None)
        _state.langs = frozenset()  # a launch is running; its own _patch_lang call fills this in
        try:
            return grid_call(self, *args, **kwargs)
        finally:
            _state.langs = outer

    def patch_once(fn):
        active = getattr(_state, "langs", None)
        langs = _langs(fn)
        if active and langs <= active:
            return scope_cls()  # already patched by the running launch; its restore() undoes it
        scope = patch_lang(fn)
        if active is not None:
            _state.langs = active | langs
        return scope

    interpreter.GridExecutor.__call__ = launch
    interpreter._patch_lang = patch_once
    _installed = True
    return True
