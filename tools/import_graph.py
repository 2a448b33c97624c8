"""The import graph of jaxring's own modules, imports inside functions included: its cycles and its
function-level imports.

    python tools/import_graph.py            # a summary: modules, cycles, function-level imports
    python tools/import_graph.py -v         # and every function-level import with its reason

`import-linter` (`lint-imports`, the layers contract in pyproject.toml) holds the layers; this script also sees
the imports written inside functions (to dodge a cycle, or to keep an optional dependency lazy) and the
`models/` folder, which installs as `jaxring.models`. Imports under `if TYPE_CHECKING:` are left out: they never
run. `tests/integration/test_layers.py` asserts on what it finds.
"""

from __future__ import annotations

import ast
import dataclasses
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# package name -> its folder (models/ installs as jaxring.models)
PACKAGES = {"jaxring": ROOT / "jaxring", "jaxring.models": ROOT / "models"}


@dataclasses.dataclass(frozen=True)
class Import:
    importer: str
    imported: str
    line: int
    in_function: bool
    reason: str  # the comment on the import's line or the line above it ("" if none)


def modules() -> dict[str, Path]:
    """Every module of the project by dotted name."""
    out = {}
    for package, folder in PACKAGES.items():
        for path in sorted(folder.rglob("*.py")):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join([package, *parts])] = path
    return out


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _comment(lines: list[str], lineno: int) -> str:
    """The comment at the end of line `lineno` (1-based) or on the line above it."""
    for text in (lines[lineno - 1], lines[lineno - 2] if lineno > 1 else ""):
        if "#" in text:
            return text.split("#", 1)[1].strip()
    return ""


def imports(mods: dict[str, Path] | None = None) -> list[Import]:
    """Every import of one project module by another."""
    mods = modules() if mods is None else mods

    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    found = []
    for name, path in mods.items():
        source = path.read_text()
        lines = source.splitlines()
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]

        def visit(node: ast.AST, in_function: bool, name: str = name, package: str = package, lines=lines) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.If) and _is_type_checking(child):
                    continue
                inside = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
                targets = []
                if isinstance(child, ast.Import):
                    targets = [a.name for a in child.names]
                elif isinstance(child, ast.ImportFrom):
                    base = child.module or ""
                    if child.level:
                        head = package.split(".")[: len(package.split(".")) - (child.level - 1)]
                        base = ".".join(head + ([base] if base else []))
                    targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in child.names]
                for target in dict.fromkeys(targets):
                    imported = resolve(target)
                    if imported and imported != name:
                        found.append(Import(name, imported, child.lineno, inside, _comment(lines, child.lineno)))
                visit(child, inside)

        visit(ast.parse(source), False)
    return found


def cycles(found: list[Import]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    edges: dict[str, set[str]] = {}
    for i in found:
        edges.setdefault(i.importer, set()).add(i.imported)
        edges.setdefault(i.imported, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
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
                out.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(edges) + 100))
    for v in sorted(edges):
        if v not in index:
            connect(v)
    return out


def main() -> None:
    found = imports()
    lazy = [i for i in found if i.in_function]
    loops = cycles(found)
    print(f"{len(modules())} modules, {len(loops)} cycles, {len(lazy)} function-level imports of the project's own")
    for loop in loops:
        print("cycle:", " ".join(loop))
    if "-v" in sys.argv:
        for i in lazy:
            print(f"{i.importer}:{i.line} imports {i.imported} in a function  # {i.reason or '(no reason given)'}")


if __name__ == "__main__":
    main()
