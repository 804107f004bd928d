"""The package's imports, read from the source with ``ast`` (nothing is imported): no import circle joins its modules,
function-local imports counted too, and every function-local import says why it is not at the top, in a comment on
its line or on the line just above (docs/design.md, "Layers: who may import whom").

The modules are the ``.py`` files of the packages pyproject.toml lists, in the folders its ``package-dir`` maps
them to (``convert/`` is ``sdnpu.convert``, and so on). An edge goes from a module to each of ours it imports:
``from sdnpu.x import y`` to the submodule ``sdnpu.x.y`` where ``y`` is one, else to ``sdnpu.x``. Imports under
``if TYPE_CHECKING:`` never run: they are neither edges nor held to the rule."""

from __future__ import annotations

import ast
import io
import tokenize
import tomllib
from dataclasses import dataclass
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parent.parent
SETUPTOOLS = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]

# Files whose function-local imports are not yet held to the rule while another change reorganizes them (none
# now: the canonical package, issue 41 item 1, is in and held to it like every other module).
IN_PROGRESS: set[str] = set()
IN_PROGRESS_PACKAGES: set[str] = set()


@dataclass(frozen=True)
class Import:
    path: str  # the file, relative to the repository
    line: int
    targets: tuple[str, ...]  # the modules of ours it imports
    local: bool  # inside a function
    reason: bool  # a comment on its line or on the line just above
    source: str  # its first line


def _folder(package: str) -> Path:
    """Where setuptools finds ``package``: its own package-dir entry, else its parent's folder and its name."""
    mapped = SETUPTOOLS["package-dir"]
    head = max((k for k in mapped if package == k or package.startswith(k + ".")), key=len)
    return Path(mapped[head], *package[len(head) :].split(".")[1:])


def _modules() -> dict[str, Path]:
    """Every module of the installed packages, by its ``sdnpu.*`` name."""
    out = {}
    for package in SETUPTOOLS["packages"]:
        for path in sorted((ROOT / _folder(package)).glob("*.py")):
            out[package if path.stem == "__init__" else f"{package}.{path.stem}"] = path
    return out


MODULES = _modules()


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _targets(node: ast.Import | ast.ImportFrom, module: str, is_package: bool) -> tuple[str, ...]:
    if isinstance(node, ast.Import):
        return tuple(a.name for a in node.names if a.name in MODULES)
    if node.level:  # relative: from the module's own package up
        base = module.split(".") if is_package else module.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        source = ".".join(base + ([node.module] if node.module else []))
    else:
        source = node.module or ""
    out = [f"{source}.{a.name}" for a in node.names if f"{source}.{a.name}" in MODULES]
    if len(out) < len(node.names) and source in MODULES:  # names the module itself defines (or re-exports)
        out.append(source)
    return tuple(out)


def _comment_on_first_line(statement: str) -> bool:
    tokens = tokenize.generate_tokens(io.StringIO(statement).readline)
    return any(t.type == tokenize.COMMENT and t.start[0] == 1 for t in tokens)


def _imports(module: str, path: Path) -> list[Import]:
    """Every import statement of the module, found through the statements' bodies (an import is a statement:
    expressions need no visit)."""
    text = path.read_text()
    lines = text.splitlines()
    rel = path.relative_to(ROOT).as_posix()
    out: list[Import] = []

    def visit(statements: list[ast.stmt], local: bool) -> None:
        for node in statements:
            if isinstance(node, ast.If) and _is_type_checking(node):
                visit(node.orelse, local)
                continue
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                statement = "\n".join(lines[node.lineno - 1 : node.end_lineno]).strip() + "\n"
                above = lines[node.lineno - 2].lstrip()
                reason = local and (_comment_on_first_line(statement) or above.startswith("#"))
                targets = _targets(node, module, path.name == "__init__.py")
                out.append(Import(rel, node.lineno, targets, local, reason, lines[node.lineno - 1].strip()))
                continue
            inner = local or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            for field in ("body", "orelse", "finalbody"):
                visit([c for c in getattr(node, field, ()) if isinstance(c, ast.stmt)], inner)
            for part in (*getattr(node, "handlers", ()), *getattr(node, "cases", ())):  # except and case blocks
                visit(part.body, inner)

    visit(ast.parse(text, str(path)).body, False)
    return out


IMPORTS = {module: _imports(module, path) for module, path in MODULES.items()}


def _in_progress(path: str) -> bool:
    return path in IN_PROGRESS or path.startswith(tuple(IN_PROGRESS_PACKAGES))


def test_the_modules_are_read_as_the_package_installs_them():
    assert {"sdnpu.cli", "sdnpu.convert.blockwise.piece", "sdnpu.passes.rules.gemm"} <= set(MODULES)
    assert MODULES["sdnpu.convert"] == ROOT / "convert" / "__init__.py"
    assert MODULES["sdnpu.formats.weights"] == ROOT / "sdnpu" / "formats" / "weights.py"
    folders = ("sdnpu", "convert", "passes", "reports", "runtime", "ops", "lora")
    assert {p for d in folders for p in (ROOT / d).rglob("*.py")} == set(MODULES.values())  # no file left out
    edges = {t for i in IMPORTS["sdnpu.convert.blockwise"] for t in i.targets}
    assert {"sdnpu.convert.blockwise.driver", "sdnpu.convert.blockwise.state"} <= edges


def test_no_import_circle_even_counting_function_local_imports():
    graph = nx.DiGraph()
    graph.add_nodes_from(MODULES)
    graph.add_edges_from((m, t) for m, imports in IMPORTS.items() for i in imports for t in i.targets if t != m)
    circles = []
    for group in nx.strongly_connected_components(graph):
        if len(group) > 1:
            cycle = [a for a, _ in nx.find_cycle(graph.subgraph(group))]
            circles.append(" -> ".join([*cycle, cycle[0]]) + f"  ({len(group)} modules joined)")
    assert not circles, "import circles:\n" + "\n".join(sorted(circles))


def test_every_function_local_import_says_why():
    silent = [
        f"{i.path}:{i.line}: {i.source}"
        for imports in IMPORTS.values()
        for i in imports
        if i.local and not i.reason and not _in_progress(i.path)
    ]
    assert not silent, f"{len(silent)} function-local imports without a reason beside them:\n" + "\n".join(silent)
