"""Imports follow the request's way, and nothing points back up.

A request goes entrypoints -> managers -> speculative -> mem_cache / compress -> model_executor ->
models / layers -> kernels. LAYERS below places every top-level subpackage and module of
sglang_vericache in one layer (top first); a module may import its own layer and any layer below,
never one above. A few modules sit in another layer than their package's: each is named on its own
with the reason (the longest matching name wins).

Every import counts: module level, inside functions, and inside `if TYPE_CHECKING:` blocks. The one
exception is explicit: TYPE_ONLY_UP lists the modules (the request, Req, and the scheduler's
collaborators it hands down) that the round drivers (speculative/, disagg/) may name in annotations,
under `if TYPE_CHECKING:` only; importing them at run time from below (module level or in a function)
is rejected like any other upward import.

test/test_import_layers.py checks the package against the table; its cycle test rejects every cycle
among the imports that run when a module is imported (module level, outside TYPE_CHECKING): cycles
through deferred or type-only imports can only close inside one layer, since the layer rule bounds
those. Its last test imports every module first in a fresh interpreter, so a runtime cycle fails
there with Python's own ImportError.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_DIR = ROOT / "python" / "sglang_vericache"
PACKAGE = "sglang_vericache"
KERNELS = "sgl_kernel_ext"

# (layer, names, why) from the top of the request's way to the bottom. Names are dotted module paths
# under sglang_vericache ("" is the package's own __init__); sgl_kernel_ext is the kernels' package. A
# package's modules sit in its layer unless one of them is named on its own (below its package).
LAYERS: list[tuple[str, tuple[str, ...], str]] = [
    (
        "testing",
        ("testing",),
        "helpers for tests and benchmarks: they build whole schedulers, so they may import anything; "
        "the product never imports them",
    ),
    (
        "entrypoints",
        ("", "launch_server", "engine", "entrypoints", "dp", "bench_serving", "disagg.verifier",
         "disagg.verify_worker"),
        "where a request comes in: the CLI, the offline Engine, the HTTP/OpenAI server, the "
        "data-parallel controller that starts whole scheduler+tokenizer replicas and routes to them, "
        "the benchmark client; and disagg/verifier.py, the verifier instance's main loop, which builds "
        "a full-mode Scheduler and serves the drafter's wire (launch_server runs it instead of HTTP), with "
        "the round driver it installs on that scheduler (disagg/verify_worker.py)",
    ),
    (
        "managers",
        ("managers",),
        "the tokenizer manager, the scheduler and its collaborators",
    ),
    (
        "disagg",
        ("disagg",),
        "the drafter's side of dual-instance VeriCache: its round driver (RemoteVerifyWorker, a spec "
        "worker on speculative/'s interface), its admission (RemotePrefill), the verifier link, the "
        "messages and their wire. The scheduler builds them from narrow collaborators (queues, memory, "
        "output, metrics) that they name in annotations only (TYPE_ONLY_UP), never the other way round",
    ),
    (
        "speculative",
        ("speculative",),
        "VeriCache rounds: draft over the compressed tier, verify over the exact KV; driven by the "
        "scheduler, driving the caches and the model runner",
    ),
    (
        "mem_cache",
        ("mem_cache", "compress"),
        "where KV lives (radix/prefix caches, the two tiers, host and remote stores) and how it is "
        "compressed; kvzip's reconstruction pass (compress/kvzip_reconstruction.py) is built by the "
        "scheduler and handed to the two-tier cache",
    ),
    (
        "model_executor",
        ("model_executor", "model_loader", "mem_cache.device_page_cache"),
        "one forward pass: the model runner, CUDA graphs, loading the weights; the runner allocates "
        "the device page cache it forwards through",
    ),
    (
        "models",
        (
            "models",
            "layers",
            "sampling",
            "constrained",
            "model_executor.forward_batch",
            "mem_cache.memory_pool",
            "mem_cache.compressed_pool",
            "mem_cache.kv_stager",
            "mem_cache.transfer_engine",
            "mem_cache.copy_stream",
            "compress.base",
        ),
        "the network and what turns its logits into tokens (models, layers, attention backends, the "
        "sampler, sampling parameters, grammar masks), and what one forward reads and writes, handed "
        "down to every layer as in SGLang: the ForwardBatch and the KV storage (exact pool, compressed "
        "pool with its chunk layouts, the streamed host KV and its copy engine). The model runner "
        "allocates the storage; the caches above only manage slots in it",
    ),
    (
        "kernels",
        (KERNELS,),
        "sgl_kernel_ext: the C++/Triton kernels, which import nothing of sglang_vericache",
    ),
    (
        "base",
        (
            "utils",
            "distributed",
            "server_args",
            "server_args_groups",
            "compressor_names",
            "model_config",
            "dp.router_flags",
        ),
        "what everyone may read: the configuration (server args and their groups of flags and checks, the "
        "sglang-router flags they include, compressor names, the model config), tensor-parallel "
        "groups, file and tokenizer helpers; it imports nothing above it",
    ),
]

# Type-only imports that may go up: the request and the scheduler's collaborators that the scheduler
# hands down to the round drivers (speculative/) and to disagg/'s RemoteVerifyWorker and RemotePrefill,
# named in their annotations only; module -> (the
# layers that may name it, what it is). Allowed under `if TYPE_CHECKING:` alone; a runtime import of
# them (module level or in a function) from below is rejected like any other. (The caches name the
# request by a Protocol of their own, mem_cache/cache_req.py.)
TYPE_ONLY_UP: dict[str, tuple[tuple[str, ...], str]] = {
    "managers.schedule_batch": (("disagg", "speculative"), "Req, the request's state, passed down"),
    "managers.request_memory": (("disagg", "speculative"), "RequestMemory (slots, retraction), handed to the "
                                                           "drivers and RemotePrefill"),
    "managers.output_sink": (("disagg", "speculative"), "OutputSink (emits tokens), handed to VeriCacheRound "
                                                        "and RemotePrefill"),
    "managers.stats": (("disagg", "speculative"), "SchedulerMetrics (counters), handed to VeriCacheRound and "
                                                  "RemotePrefill"),
    "managers.request_queues": (("disagg",), "RequestQueues (waiting, running), handed to RemotePrefill"),
}


@dataclass(frozen=True)
class Import:
    line: int
    module: str  # the imported module, absolute; for `from m import x` the submodule m.x if it exists
    type_only: bool  # under `if TYPE_CHECKING:`
    deferred: bool  # inside a function: runs when the function is called, not at import


def layer_names() -> list[str]:
    return [layer for layer, _, _ in LAYERS]


def placements() -> dict[str, int]:
    table: dict[str, int] = {}
    for index, (_, names, _) in enumerate(LAYERS):
        for name in names:
            full = name if name == KERNELS else ".".join(p for p in (PACKAGE, name) if p)
            assert full not in table, f"{full} is placed twice in LAYERS"
            table[full] = index
    return table


def layer_of(module: str) -> int | None:
    """Index in LAYERS of a module (0 = top); None for modules outside this package and the kernels."""
    table = placements()
    if module == PACKAGE:
        return table[PACKAGE]
    parts = module.split(".")
    for end in range(len(parts), 0, -1):
        name = ".".join(parts[:end])
        if name in table and name != PACKAGE:
            return table[name]
    return None


def module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE_DIR.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def package_modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE_DIR.rglob("*.py"))}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports_of(module: str, source: str, is_package: bool, known: Iterable[str] = ()) -> Iterator[Import]:
    """Every import statement in source: module level, in functions, under TYPE_CHECKING."""
    known = set(known)
    here = module.split(".") if is_package else module.split(".")[:-1]

    def visit(node: ast.AST, type_only: bool, deferred: bool) -> Iterator[Import]:
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield Import(node.lineno, alias.name, type_only, deferred)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[: len(here) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                yield Import(node.lineno, sub if sub in known else target, type_only, deferred)
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.body:
                yield from visit(child, True, deferred)
            for child in node.orelse:
                yield from visit(child, type_only, deferred)
        else:
            inner = deferred or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            for child in ast.iter_child_nodes(node):
                yield from visit(child, type_only, inner)

    yield from visit(ast.parse(source), False, False)


def upward_imports(module: str, source: str, is_package: bool = False, known: Iterable[str] = ()) -> list[str]:
    """'module:line imports X (layer a -> layer b)' for each import of a layer above module's own,
    except the type-only imports TYPE_ONLY_UP allows."""
    mine = layer_of(module)
    assert mine is not None, f"{module} has no layer in LAYERS"
    names = layer_names()
    found = []
    for imp in imports_of(module, source, is_package, known):
        theirs = layer_of(imp.module)
        if theirs is None or theirs >= mine:
            continue
        allowed = TYPE_ONLY_UP.get(imp.module.removeprefix(PACKAGE + "."), ((), ""))[0]
        if imp.type_only and names[mine] in allowed:
            continue
        kind = "type-only " if imp.type_only else ""
        found.append(f"{module}:{imp.line} {kind}imports {imp.module} ({names[mine]} -> {names[theirs]})")
    return list(dict.fromkeys(found))


def import_graph(sources: dict[str, tuple[str, bool]], at_import: bool = True) -> dict[str, set[str]]:
    """module -> the package modules it imports; sources: module -> (source, is_package). at_import:
    only the imports that run when the module is imported (not type-only, not inside functions)."""
    graph: dict[str, set[str]] = {}
    for module, (source, is_package) in sources.items():
        graph[module] = {
            imp.module
            for imp in imports_of(module, source, is_package, sources)
            if imp.module in sources
            and imp.module != module
            and not (at_import and (imp.type_only or imp.deferred))
        }
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (as a closed path) per strongly connected component of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def connect(v: str) -> None:  # Tarjan
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(component)

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in sorted(graph):
        if v not in index:
            connect(v)
    return [_a_cycle(graph, set(c)) for c in sorted(components, key=min)]


def _a_cycle(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    start = min(component)
    paths = {start: [start]}
    frontier = [start]
    while frontier:  # breadth first: the shortest cycle through start
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & component):
                if w == start:
                    return paths[v] + [start]
                if w not in paths:
                    paths[w] = paths[v] + [w]
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no cycle through {start}")


def sources() -> dict[str, tuple[str, bool]]:
    return {m: (p.read_text(), p.name == "__init__.py") for m, p in package_modules().items()}
