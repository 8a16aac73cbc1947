"""The package's layers, as `ls statax/` shows them, and the direction of its imports.

Imports run toward the engine, never away from it:

    __init__, testing   the public API
    _store              a store of captures on disk: record, open_store
    _patching           patching experiments: sweep
    _monitor            stats, sinks, records, the tracker, the notebook display
    _drivers            pull, plant, grad_inters, stateful: trace, hook the evaluator, cache, name
    _select             selections: the vocabulary, objects, Flax Linen, places, reports
    handlers            one module per primitive family: `statax.extend`, JAX's public API and
                        their own library, nothing else (an allowlist, checked here)
    extend              the handler API: the engine and the shims only
    _core               the engine: save_inter, the evaluator, the registry, staging, state
    _jax                version shims only: nothing of statax's

Every import of statax's is checked, at module level and inside functions, and the module
graph has no cycle.
"""

import ast
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "statax"

# layer -> the layers it may import (itself included)
MAY_IMPORT = {
    "_jax": {"_jax"},
    "_core": {"_core", "_jax"},
    "extend": {"extend", "_core", "_jax"},
    "_select": {"_select", "_core", "_jax"},
    "_drivers": {"_drivers", "_select", "_core", "_jax"},
    "_monitor": {"_monitor", "_drivers", "_select", "_core", "_jax"},
    "_store": {"_store", "_monitor", "_drivers", "_select", "_core", "_jax"},
    "_patching": {"_patching", "_monitor", "_drivers", "_select", "_core", "_jax"},
    "top": {
        "top",
        "_patching",
        "_store",
        "_monitor",
        "_drivers",
        "_select",
        "handlers",
        "extend",
        "_core",
        "_jax",
    },
}
# What a handler module may import besides `statax.extend`, the standard library and JAX's
# public API: its own library.
OWN_LIBRARY = {"equinox": {"equinox"}}


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer_of(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1 or parts[1] in ("testing",):
        return "top"
    return parts[1]


def imports_of(path: pathlib.Path) -> list[tuple[int, str, int]]:
    """`(line, absolute module, level)` of every import in `path`, at any depth (a relative
    import's module resolved; `from . import x` gives the submodule `x`)."""
    module = module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, a.name, 0) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                base = node.module
            else:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1])
                base = f"{base}.{node.module}" if node.module else base
            for alias in node.names:
                target = f"{base}.{alias.name}"
                is_module = (PACKAGE.parent / (target.replace(".", "/") + ".py")).exists() or (
                    PACKAGE.parent / target.replace(".", "/")
                ).is_dir()
                found.append((node.lineno, target if is_module else base, node.level))
    return found


def statax_modules() -> list[pathlib.Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_the_layers_are_the_folders():
    folders = sorted(p.name for p in PACKAGE.iterdir() if p.is_dir() and p.name != "__pycache__")
    assert folders == [
        "_core",
        "_drivers",
        "_jax",
        "_monitor",
        "_patching",
        "_select",
        "_store",
        "extend",
        "handlers",
    ]
    flat = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert flat == ["__init__.py", "testing.py"]


def test_no_module_is_over_500_lines():
    sizes = {str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in statax_modules()}
    assert {p: n for p, n in sizes.items() if n > 500} == {}


@pytest.mark.parametrize("path", statax_modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_run_toward_the_engine(path):
    layer = layer_of(module_name(path))
    if layer == "handlers":
        return  # the allowlist below
    wrong = [
        f"{path.relative_to(ROOT)}:{line} imports {target}"
        for line, target, _ in imports_of(path)
        if target.startswith("statax.") and layer_of(target) not in MAY_IMPORT[layer]
    ]
    assert wrong == []


def handler_import_errors(path: pathlib.Path, source: str | None = None) -> list[str]:
    """What a handler module imports outside its allowlist."""
    own = OWN_LIBRARY.get(path.stem, set())
    tree = ast.parse(source if source is not None else path.read_text())
    errors = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level:
            errors.append(f"line {node.lineno}: a relative import (use statax.extend)")
            continue
        if isinstance(node, ast.Import):
            modules = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            modules = [node.module]
        else:
            continue
        for module in modules:
            top = module.split(".")[0]
            allowed = (
                module == "__future__"
                or (top in sys.stdlib_module_names and top != "statax")
                or (top == "jax" and not any(p.startswith("_") for p in module.split(".")))
                or module == "statax.extend"
                or module.startswith(("statax.extend.", "statax.handlers"))
                or (top in own and not any(p.startswith("_") for p in module.split(".")))
            )
            if not allowed:
                errors.append(f"line {node.lineno}: {module}")
    return errors


@pytest.mark.parametrize("path", sorted((PACKAGE / "handlers").glob("*.py")), ids=lambda p: p.name)
def test_handlers_import_only_statax_extend_jax_and_their_library(path):
    assert handler_import_errors(path) == []


@pytest.mark.parametrize(
    "source",
    [
        "from statax._core import marks\n",
        "from statax._core.registry import register_handler\n",
        "from statax import pull\n",
        "import statax._jax.primitive_params\n",
        "from jax._src import core\n",
        "import numpy as np\n",
        "from equinox.internal import _loop\n",
        "from .. import extend\n",
    ],
)
def test_the_handler_allowlist_refuses_anything_else(source):
    assert handler_import_errors(PACKAGE / "handlers" / "probe.py", source)


def test_the_handler_allowlist_takes_what_a_handler_needs():
    source = (
        "from __future__ import annotations\nimport math\nimport jax\nimport jax.numpy as jnp\n"
        "from jax.extend import core\nfrom statax.extend import mark, params\n"
    )
    assert handler_import_errors(PACKAGE / "handlers" / "probe.py", source) == []
    assert handler_import_errors(PACKAGE / "handlers" / "equinox.py", "import equinox\n") == []
    assert handler_import_errors(PACKAGE / "handlers" / "cond.py", "import equinox\n")


def test_no_import_cycle():
    graph: dict[str, set[str]] = {}
    for path in statax_modules():
        module = module_name(path)
        graph[module] = {t for _, t, _ in imports_of(path) if t.startswith("statax.")}
    graph = {m: {t for t in ts if t in graph and t != m} for m, ts in graph.items()}
    # A package imports its submodules (to re-export them): not a cycle back to it.
    for m in graph:
        graph[m] = {t for t in graph[m] if not t.startswith(m + ".")}
    cycles = []
    state: dict[str, int] = {}

    def visit(m, stack):
        state[m] = 1
        for t in sorted(graph[m]):
            if state.get(t) == 1:
                cycles.append(" -> ".join([*stack[stack.index(t) :], t]))
            elif t not in state:
                visit(t, [*stack, t])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert cycles == []


def private_imports(path: pathlib.Path, source: str | None = None) -> list[str]:
    """`"module.name"` of each underscore name that `path` (or `source`, as if it were there)
    imports from another of statax's modules (a dunder such as `__all__` is no private name)."""
    module = module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text() if source is None else source)):
        if not isinstance(node, ast.ImportFrom):
            continue
        if node.level == 0:
            base = node.module or ""
            if not base.startswith("statax"):
                continue
        else:
            base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1])
            base = f"{base}.{node.module}" if node.module else base
        for alias in node.names:
            if alias.name.startswith("_") and not alias.name.startswith("__"):
                found.append(f"{base}.{alias.name} (line {node.lineno})")
    return found


@pytest.mark.parametrize("path", statax_modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_module_imports_another_modules_private_name(path):
    """A name another module uses is part of its module's interface: no underscore."""
    assert private_imports(path) == []


def test_a_private_import_is_caught():
    source = (
        "from .naming import _helper, check_only\n"
        "from .._core.meta import ARRAY, __all__\n"
        "from statax._core.marks import _cached\n"
        "from jax._src import core\n"
    )
    found = private_imports(PACKAGE / "_drivers" / "pull.py", source)
    assert found == [
        "statax._drivers.naming._helper (line 1)",
        "statax._core.marks._cached (line 3)",
    ]


_REGISTRATIONS = ("register_handler", "register_exposer", "register_rules", "register_family")


def registrations(path, monkeypatch) -> list:
    """What the handler module at `path` registers, in order: each registration's key (a
    primitive, a name or a family's test), the module run again with `statax.extend`'s
    registrations recorded in place of made."""
    import runpy

    import statax.extend

    seen: list = []

    def recorder(key, handler=None, *args, **rules):
        seen.append(key)
        return (lambda h: h) if handler is None else handler

    for name in _REGISTRATIONS:
        monkeypatch.setattr(statax.extend, name, recorder)
    runpy.run_path(str(path), run_name=f"statax_registrations_of_{path.stem}")
    return seen


HANDLER_MODULES = sorted(p for p in (PACKAGE / "handlers").glob("*.py") if p.stem != "__init__")


@pytest.mark.parametrize("path", HANDLER_MODULES, ids=lambda p: p.stem)
def test_each_handler_module_registers_each_primitive_once(path, monkeypatch):
    # One record per primitive, registered once: a second registration would replace the first
    # whole (the scan that once had an exposer from one call and a handler from another).
    seen = registrations(path, monkeypatch)
    assert seen, f"{path.name} registers nothing"
    twice = [key for key in seen if seen.count(key) > 1]
    assert twice == []


def test_a_second_registration_is_caught(tmp_path, monkeypatch):
    module = tmp_path / "twice.py"
    module.write_text(
        "from jax.extend.core.primitives import scan_p\n"
        "from statax.extend import register_exposer, register_handler\n"
        "register_exposer(scan_p, print)\n"
        "register_handler(scan_p, print, selectable=True)\n"
    )
    seen = registrations(module, monkeypatch)
    assert len(seen) == 2 and seen[0] is seen[1]


def test_importing_statax_starts_nothing():
    """Issue 47: `import statax` (every module of it) starts no JAX backend, so that
    `jax.distributed.initialize()` may follow it, as a multi-host script has it."""
    import socket
    import subprocess

    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    script = f"""
import importlib, pkgutil
import statax
for module in pkgutil.walk_packages(statax.__path__, "statax."):
    importlib.import_module(module.name)
from jax._src import xla_bridge
assert not xla_bridge.backends_are_initialized(), "a backend was started"
import jax
jax.distributed.initialize("localhost:{port}", num_processes=1, process_id=0)
import jax.numpy as jnp
out, inters = statax.pull(lambda x: statax.save_inter(x * 2, name="y"))(jnp.ones(2))
assert float(inters["y_0"][0]) == 2.0
print("OK")
"""
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0 and "OK" in result.stdout, result.stdout + result.stderr
