"""Count the private JAX names statax reads: `jax._src` imports, the distinct names read from
them, per module. Run: `python tools/private_names.py [REV]` (a git revision: count that
revision's tree; default the working tree), or `--markdown` for the table in
`docs/maintaining.md` (a test checks that the table lists every name)."""

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
        ["git", "ls-tree", "-r", "--name-only", rev, "statax"], cwd=ROOT, capture_output=True,
        text=True, check=True,
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
    for alias, full in aliases.items():
        if not any(n.startswith(full + ".") for n in names):
            names.add(full)  # imported by name and used as it is
    return imports, names


def by_module(rev: str | None = None) -> dict[str, set[str]]:
    """statax module path -> the private JAX names it reads."""
    found = {}
    for path, text in sorted(sources(rev).items()):
        names = count(text)[1]
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
    total_imports, total = 0, set()
    per_file = defaultdict(set)
    for path, text in sorted(sources(rev).items()):
        imports, names = count(text)
        total_imports += imports
        total |= names
        if names:
            per_file[path] = names
    for path, names in per_file.items():
        print(f"{path}: {len(names)}")
    print(f"jax._src imports: {total_imports}; distinct private names read: {len(total)}")


if __name__ == "__main__":
    main()
