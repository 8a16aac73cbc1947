"""Count every private access of statax's to JAX (and to the libraries it reads the frames of),
per module:

* private names: `jax._src` imports and the distinct names read from them (`core.trace_ctx`,
  and `getattr(core, "trace_state_strong_ref")` alike);
* bytecode probes: a function's `__code__` read to learn its signature or what it calls;
* frame introspection: a function that walks the call stack and recognises a frame by its
  function's name, or reads its locals or globals (not the frames read only for the user's
  file and line).

Run: `python tools/private_names.py [REV]` (a git revision: count that revision's tree; default
the working tree), or `--markdown` for the table in `docs/maintaining.md` (a test checks that
the table lists every access)."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys
from collections import defaultdict

ROOT = pathlib.Path(__file__).resolve().parents[1]


def sources(rev: str | None) -> dict[str, str]:
    if rev is None:
        return {str(p.relative_to(ROOT)): p.read_text() for p in (ROOT / "statax").rglob("*.py")}
    files = subprocess.run(
        ["git", "ls-tree", "-r", "--name-only", rev, "statax"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    return {
        f: subprocess.run(["git", "show", f"{rev}:{f}"], cwd=ROOT, capture_output=True,
                          text=True, check=True).stdout
        for f in files if f.endswith(".py")
    }  # fmt: skip


def count(text: str) -> tuple[int, set[str]]:
    tree = ast.parse(text)
    imports, aliases, names = 0, {}, set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("jax._src"):
            imports += 1
            for a in node.names:
                full = f"{node.module}.{a.name}"
                # `from jax._src import core`: a module, whose attributes are counted below.
                aliases[a.asname or a.name] = full
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("jax._src"):
                    imports += 1
                    aliases[a.asname or a.name] = a.name
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            base = aliases.get(node.value.id)
            if base is not None:
                names.add(f"{base}.{node.attr}")
        elif (  # getattr(core, "name", default)
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr")
            and len(node.args) >= 2
            and isinstance(node.args[0], ast.Name)
            and node.args[0].id in aliases
            and isinstance(node.args[1], ast.Constant)
        ):
            names.add(f"{aliases[node.args[0].id]}.{node.args[1].value}")
    for alias, full in aliases.items():
        if not any(n.startswith(full + ".") for n in names):
            names.add(full)  # imported by name and used as it is
    return imports, names


_FRAME_READS = {"co_name", "f_locals", "f_globals"}  # what recognises another library's frame


def probes(text: str) -> set[str]:
    """The bytecode probes (`bytecode: ...`) and frame introspections (`frame: function`) in
    `text`."""
    tree = ast.parse(text)
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr == "__code__":
            found.add(f"bytecode: {ast.unparse(node.value)}")
        if isinstance(node, ast.FunctionDef):
            reads = {n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)} & _FRAME_READS
            if reads:
                found.add(f"frame: {node.name} ({', '.join(sorted(reads))})")
    return found


def by_module(rev: str | None = None) -> dict[str, set[str]]:
    """statax module path -> the private accesses it makes (names, probes, frames)."""
    found = {}
    for path, text in sorted(sources(rev).items()):
        names = count(text)[1] | probes(text)
        if names:
            found[path] = names
    return found


def main():
    if sys.argv[1:] == ["--markdown"]:  # the table in docs/maintaining.md
        for path, names in by_module().items():
            listed = ", ".join(f"`{n.removeprefix('jax._src.')}`" for n in sorted(names))
            print(f"| `{path}` | {listed} |")
        return
    rev = sys.argv[1] if len(sys.argv) > 1 else None
    total_imports, total, other = 0, set(), 0
    per_file = defaultdict(set)
    for path, text in sorted(sources(rev).items()):
        imports, names = count(text)
        found = probes(text)
        total_imports += imports
        total |= names
        other += len(found)
        if names or found:
            per_file[path] = names | found
    for path, names in per_file.items():
        print(f"{path}: {len(names)}")
    frames = sum(1 for ns in per_file.values() for n in ns if n.startswith("frame: "))
    code = sum(1 for ns in per_file.values() for n in ns if n.startswith("bytecode: "))
    print(
        f"jax._src imports: {total_imports}; distinct private names read: {len(total)}; "
        f"bytecode probes: {code}; frame introspections: {frames}; "
        f"in all: {len(total) + code + frames}"
    )


if __name__ == "__main__":
    main()
