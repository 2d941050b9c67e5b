"""The layer table of test/import_layers.py, kept: no import up the table, no import-time cycle, every
module importable first; and checks that the checker reports what it must (it can fail)."""

from __future__ import annotations

import os
import subprocess
import sys

from import_layers import (
    KERNELS,
    PACKAGE,
    ROOT,
    TYPE_ONLY_UP,
    cycles,
    import_graph,
    layer_names,
    layer_of,
    package_modules,
    placements,
    sources,
    upward_imports,
)


def test_every_module_has_a_layer():
    unplaced = [m for m in package_modules() if layer_of(m) is None]
    assert unplaced == [], f"place these in LAYERS: {unplaced}"


def test_every_placement_names_a_module():
    table = set(placements()) - {PACKAGE, KERNELS}
    modules = package_modules()
    missing = [n for n in table if not any(m == n or m.startswith(n + ".") for m in modules)]
    assert missing == [], f"LAYERS names modules that do not exist: {missing}"
    allowed = [n for n, (layers, _) in TYPE_ONLY_UP.items()
               if f"{PACKAGE}.{n}" not in modules or not set(layers) <= set(layer_names())]
    assert allowed == [], f"TYPE_ONLY_UP names modules or layers that do not exist: {allowed}"


def test_no_import_goes_up():
    found = []
    modules = sources()
    for module, (source, is_package) in modules.items():
        found += upward_imports(module, source, is_package, modules)
    assert found == [], "imports against the request's way:\n" + "\n".join(found)


def test_no_import_cycle_between_modules():
    """The imports that run when a module is imported (module level, not type-only) form no cycle."""
    found = cycles(import_graph(sources()))
    assert found == [], "import cycles:\n" + "\n".join(" -> ".join(c) for c in found)



def test_checker_reports_an_upward_import():
    source = (
        "from typing import TYPE_CHECKING\n"
        "from sglang_vericache.layers.sampler import Sampler\n"
        "if TYPE_CHECKING:\n"
        "    from sglang_vericache.managers.scheduler import Scheduler\n"
        "    from sglang_vericache.managers.schedule_batch import Req\n"
        "def f():\n"
        "    from ..speculative import vericache_round\n"
        "    from sglang_vericache.managers.schedule_batch import Req\n"
        "    import sgl_kernel_ext\n"
    )
    pkg = "sglang_vericache"
    assert upward_imports(f"{pkg}.mem_cache.fake", source) == [
        f"{pkg}.mem_cache.fake:4 type-only imports {pkg}.managers.scheduler (mem_cache -> managers)",
        f"{pkg}.mem_cache.fake:5 type-only imports {pkg}.managers.schedule_batch (mem_cache -> managers)",
        f"{pkg}.mem_cache.fake:7 imports {pkg}.speculative (mem_cache -> speculative)",
        f"{pkg}.mem_cache.fake:8 imports {pkg}.managers.schedule_batch (mem_cache -> managers)",
    ]
    type_only = f"from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from {pkg}.managers.stats import X\n"
    assert upward_imports(f"{pkg}.speculative.fake", type_only) == []  # TYPE_ONLY_UP
    assert upward_imports(f"{pkg}.speculative.fake", f"def f():\n    from {pkg}.managers.stats import X\n") == [
        f"{pkg}.speculative.fake:2 imports {pkg}.managers.stats (speculative -> managers)"
    ]
    assert upward_imports(f"{pkg}.layers.fake", type_only) == [  # allowed to speculative/ only
        f"{pkg}.layers.fake:3 type-only imports {pkg}.managers.stats (models -> managers)"
    ]
    # disagg/'s drafter side names the scheduler's collaborators in annotations only; the scheduler's
    # module is above it, at run time or not
    assert upward_imports(f"{pkg}.disagg.fake", type_only) == []
    assert upward_imports(f"{pkg}.disagg.fake", f"from {pkg}.managers.scheduler import Scheduler\n") == [
        f"{pkg}.disagg.fake:1 imports {pkg}.managers.scheduler (disagg -> managers)"
    ]
    assert upward_imports(f"{pkg}.managers.fake", f"from {pkg}.disagg.remote_prefill import RemotePrefill\n") == []
    assert upward_imports(f"{pkg}.utils.fake", "import sgl_kernel_ext.cpu_attention\n") == [
        f"{pkg}.utils.fake:1 imports sgl_kernel_ext.cpu_attention (base -> kernels)"
    ]
    # a module named on its own sits below its package: the forward batch may not import the executor
    runner = f"{pkg}.model_executor.model_runner"
    assert upward_imports(f"{pkg}.model_executor.forward_batch", "from . import model_runner\n", known=[runner]) == [
        f"{pkg}.model_executor.forward_batch:1 imports {runner} (models -> model_executor)"
    ]


def test_checker_reports_a_cycle():
    fake = {
        "pkg.a": ("from pkg import b\n", False),
        "pkg.b": ("import os\nfrom pkg.c import x\n", False),
        "pkg.c": ("import pkg.a\n", False),
        "pkg.d": ("import pkg.a\n", False),
    }
    assert cycles(import_graph(fake)) == [["pkg.a", "pkg.b", "pkg.c", "pkg.a"]]
    fake["pkg.c"] = ("def f():\n    import pkg.a\n", False)  # deferred: not a module cycle
    assert cycles(import_graph(fake)) == []
    assert cycles(import_graph(fake, at_import=False)) == [["pkg.a", "pkg.b", "pkg.c", "pkg.a"]]


# Run in a fresh interpreter: every module of the package imported first, with none of the package
# loaded before it (sys.modules cleared of it between modules), so an import cycle at run time raises
# Python's own ImportError whichever module a user imports first.
IMPORT_EACH_FIRST = """
import importlib, sys, traceback
failed = []
for name in sys.argv[1:]:
    for loaded in [m for m in sys.modules if m == "sglang_vericache" or m.startswith("sglang_vericache.")]:
        del sys.modules[loaded]
    try:
        importlib.import_module(name)
    except Exception:
        failed.append(name + ":\\n" + traceback.format_exc(limit=-3))
print("\\n".join(failed))
sys.exit(1 if failed else 0)
"""


def test_every_module_imports_first_in_a_fresh_interpreter():
    modules = [m for m in package_modules() if not m.endswith("__main__")]  # __main__ runs a CLI
    entry = ["sglang_vericache.launch_server", "sglang_vericache.engine", "sglang_vericache.managers.scheduler"]
    assert set(entry) <= set(modules)
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'python'}{os.pathsep}{ROOT / 'sgl-kernel-ext' / 'python'}"}
    done = subprocess.run([sys.executable, "-c", IMPORT_EACH_FIRST, *modules], capture_output=True, text=True,
                          env=env, timeout=600)
    assert done.returncode == 0, f"modules that fail to import first:\n{done.stdout[-6000:]}\n{done.stderr[-2000:]}"
