"""The code's shape, measured: import cycles, the largest functions and modules, and the limits.

    python scripts/shape.py                  # gate llmgw and scripts, report tests
    python scripts/shape.py llmgw bench      # gate other roots
    python scripts/shape.py --report ''      # report nothing beyond the gated roots

For each set of roots it prints the import graph's cycles (the strongly connected components
with more than one module, and the imports that form them), the 15 largest functions (with
path:line) and modules, and the median and 90th percentile of function length. It exits 1
when a gated root has an import cycle, a function over --max-function lines or a module over
--max-module lines that the --allow file does not name.

A function's length runs from its `def` line to its last line, docstring, comments and blank
lines inside it included (decorators are not counted); a nested function or a method counts on
its own, and also inside the function or class around it. A module's length is its line count.

Modules are found by walking each root, not listed here: a file's module name is its path from
the first directory above it without an `__init__.py` (as Python would import it with that
directory on sys.path), so `llmgw/server/app.py` is `llmgw.server.app` and the flat
`scripts/benchkit.py` is `benchkit`. Every import statement counts, those under
`if TYPE_CHECKING:` and inside functions too (as in import-linter's graph). Paths named in
pyproject.toml's [tool.ruff] extend-exclude (generated code) are skipped.

The --allow file holds one exception a line, `#` comments allowed: `PATH::QUALNAME` for a
function, `PATH` for a module, `cycle MODULE` for the cycle that contains MODULE. Entries that
name nothing over the limits any more are listed, to be deleted (they do not fail the run).
"""

from __future__ import annotations

import argparse
import ast
import statistics
import sys
import tomllib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

TOP = 15  # how many of the largest functions and modules are listed


@dataclass(frozen=True, slots=True)
class Function:
    """One function or method: where its `def` is and how many lines it spans."""

    path: str
    line: int
    qualname: str
    lines: int

    @property
    def key(self) -> str:
        """How the --allow file names it."""
        return f"{self.path}::{self.qualname}"


@dataclass(frozen=True, slots=True)
class Module:
    """One source file: its dotted name, its path and its length."""

    name: str
    path: str
    lines: int


@dataclass(frozen=True, slots=True)
class Edge:
    """One import of a module by another, with the line that makes it."""

    source: str
    target: str
    path: str
    line: int


@dataclass(slots=True)
class Tree:
    """What was read from a set of roots."""

    modules: dict[str, Module] = field(default_factory=dict)
    functions: list[Function] = field(default_factory=list)
    edges: list[Edge] = field(default_factory=list)


# -- reading the tree ---------------------------------------------------------------------------


def module_name(path: Path) -> str:
    """The dotted name of the module at path, from the first directory up without __init__.py."""
    parts = [] if path.name == "__init__.py" else [path.stem]
    folder = path.parent
    while (folder / "__init__.py").is_file():
        parts.append(folder.name)
        folder = folder.parent
    return ".".join(reversed(parts))


def source_files(roots: Iterable[Path], excluded: Sequence[Path]) -> Iterator[Path]:
    """Every .py file under the roots, in a stable order, outside the excluded paths."""
    for root in roots:
        files = [root] if root.is_file() else sorted(root.rglob("*.py"))
        for path in files:
            if path.suffix != ".py" or "__pycache__" in path.parts:
                continue
            if any(path.resolve().is_relative_to(skip.resolve()) for skip in excluded):
                continue
            yield path


def functions_in(tree: ast.Module, path: str) -> Iterator[Function]:
    """Every function and method defined in a parsed module, nested ones included."""

    def walk(node: ast.AST, prefix: str) -> Iterator[Function]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                qualname = prefix + child.name
                end = child.end_lineno or child.lineno
                yield Function(path, child.lineno, qualname, end - child.lineno + 1)
                yield from walk(child, qualname + ".<locals>.")
            elif isinstance(child, ast.ClassDef):
                yield from walk(child, prefix + child.name + ".")
            else:
                yield from walk(child, prefix)

    yield from walk(tree, "")


def imported_names(
    tree: ast.Module, name: str, is_package: bool
) -> Iterator[tuple[tuple[str, ...], int]]:
    """(candidate names, line) for each import a module makes, relative ones resolved.

    `from X import y` gives X.y when that is a module and X otherwise (as grimp does); an
    import of something not read here (the standard library, excluded code) gives nothing.
    """
    package = name if is_package else name.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield (alias.name,), node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".") if package else []
                kept = parts[: len(parts) - node.level + 1]
                base = ".".join([*kept, *([node.module] if node.module else [])])
            for alias in node.names:
                yield (".".join(filter(None, [base, alias.name])), base), node.lineno


def resolve(candidates: tuple[str, ...], known: dict[str, Module]) -> str | None:
    """The first of an import's candidate names that is a module read here, if any."""
    return next((c for c in candidates if c in known), None)


def read_tree(roots: Sequence[Path], excluded: Sequence[Path]) -> Tree:
    """Parse every module under the roots: sizes, functions and the imports among them."""
    result = Tree()
    parsed: list[tuple[str, str, ast.Module, bool]] = []
    for path in source_files(roots, excluded):
        text = path.read_text(encoding="utf-8")
        shown = path.as_posix()
        name = module_name(path)
        result.modules[name] = Module(name, shown, len(text.splitlines()))
        tree = ast.parse(text, filename=shown)
        result.functions.extend(functions_in(tree, shown))
        parsed.append((name, shown, tree, path.name == "__init__.py"))
    for name, shown, tree, is_package in parsed:
        seen: set[str] = set()
        for candidates, line in imported_names(tree, name, is_package):
            target = resolve(candidates, result.modules)
            if target is None or target == name or target in seen:
                continue
            seen.add(target)
            result.edges.append(Edge(name, target, shown, line))
    return result


# -- measuring it -------------------------------------------------------------------------------


def cycles(edges: Sequence[Edge]) -> list[list[str]]:
    """The strongly connected components with more than one module, each sorted."""
    graph: dict[str, list[str]] = {}
    for edge in edges:
        graph.setdefault(edge.source, []).append(edge.target)
        graph.setdefault(edge.target, [])
    search = _Tarjan(graph)
    for start in sorted(graph):
        if start not in search.index:
            search.visit(start)
    return sorted(sorted(c) for c in search.found if len(c) > 1)


class _Tarjan:
    """Tarjan's strongly connected components, with an explicit stack (no recursion limit)."""

    def __init__(self, graph: dict[str, list[str]]) -> None:
        self.graph = graph
        self.index: dict[str, int] = {}
        self.low: dict[str, int] = {}
        self.stack: list[str] = []
        self.on_stack: set[str] = set()
        self.found: list[list[str]] = []

    def _enter(self, node: str, work: list[tuple[str, Iterator[str]]]) -> None:
        self.index[node] = self.low[node] = len(self.index)
        self.stack.append(node)
        self.on_stack.add(node)
        work.append((node, iter(self.graph[node])))

    def visit(self, start: str) -> None:
        """Walk everything reachable from start, collecting the components it closes."""
        work: list[tuple[str, Iterator[str]]] = []
        self._enter(start, work)
        while work:
            node, successors = work[-1]
            successor = next(successors, None)
            if successor is None:
                work.pop()
                if work:
                    parent = work[-1][0]
                    self.low[parent] = min(self.low[parent], self.low[node])
                if self.low[node] == self.index[node]:
                    self._close(node)
            elif successor not in self.index:
                self._enter(successor, work)
            elif successor in self.on_stack:
                self.low[node] = min(self.low[node], self.index[successor])

    def _close(self, root: str) -> None:
        component = []
        while True:
            member = self.stack.pop()
            self.on_stack.discard(member)
            component.append(member)
            if member == root:
                break
        self.found.append(component)


def percentile(values: Sequence[int], fraction: float) -> int:
    """The value below which the given fraction of values lie (nearest rank)."""
    ordered = sorted(values)
    rank = max(1, round(fraction * len(ordered) + 0.5))
    return ordered[min(rank, len(ordered)) - 1]


def read_allowed(path: Path | None) -> set[str]:
    """The exceptions an --allow file names, comments and blank lines dropped."""
    if path is None:
        return set()
    allowed = set()
    for raw in path.read_text(encoding="utf-8").splitlines():
        entry = raw.partition("#")[0].strip()
        if entry:
            allowed.add(" ".join(entry.split()))
    return allowed


def pyproject_excludes(folder: Path) -> list[Path]:
    """The paths folder/pyproject.toml's [tool.ruff] extend-exclude names (generated code)."""
    pyproject = folder / "pyproject.toml"
    if not pyproject.is_file():
        return []
    config = tomllib.loads(pyproject.read_text(encoding="utf-8"))
    names = config.get("tool", {}).get("ruff", {}).get("extend-exclude", [])
    return [folder / name for name in names]


# -- reporting ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Limits:
    """The limits a gated set of roots must keep, and the exceptions allowed."""

    max_function: int
    max_module: int
    allowed: frozenset[str]

    @property
    def allowed_cycles(self) -> set[str]:
        """The modules whose cycle the --allow file names (`cycle MODULE`)."""
        return {e.removeprefix("cycle ") for e in self.allowed if e.startswith("cycle ")}


def cycle_lines(tree: Tree, components: Sequence[Sequence[str]]) -> list[str]:
    """Each cycle's modules, then the imports among them with the line that makes each."""
    out: list[str] = []
    edges = sorted(tree.edges, key=lambda e: (e.source, e.target))
    for number, component in enumerate(components, 1):
        members = set(component)
        out.append(f"  cycle {number} ({len(component)} modules): {', '.join(component)}")
        out.extend(
            f"    {e.source} -> {e.target}  ({e.path}:{e.line})"
            for e in edges
            if e.source in members and e.target in members
        )
    return out


def violations_of(tree: Tree, components: Sequence[Sequence[str]], limits: Limits) -> list[str]:
    """What breaks the limits and the --allow file does not name."""
    found = [
        f"import cycle among {', '.join(component)}"
        for component in components
        if not set(component) & limits.allowed_cycles
    ]
    found.extend(
        f"function {f.path}:{f.line} {f.qualname}: {f.lines} lines > {limits.max_function}"
        for f in sorted(tree.functions, key=lambda f: (f.path, f.line))
        if f.lines > limits.max_function and f.key not in limits.allowed
    )
    found.extend(
        f"module {m.path}: {m.lines} lines > {limits.max_module}"
        for m in sorted(tree.modules.values(), key=lambda m: m.path)
        if m.lines > limits.max_module and m.path not in limits.allowed
    )
    return found


def needless_exceptions(
    tree: Tree, components: Sequence[Sequence[str]], limits: Limits
) -> list[str]:
    """The --allow entries that name nothing over the limits (delete them)."""
    needed = {f.key for f in tree.functions if f.lines > limits.max_function}
    needed |= {m.path for m in tree.modules.values() if m.lines > limits.max_module}
    in_cycles = {module for component in components for module in component}
    needed |= {f"cycle {module}" for module in limits.allowed_cycles & in_cycles}
    return sorted(limits.allowed - needed)


def report(title: str, tree: Tree, components: Sequence[Sequence[str]]) -> list[str]:
    """The figures for one set of roots: cycles, function lengths, the largest of each."""
    out = [f"== {title}", f"import cycles: {len(components) or 'none'}"]
    out.extend(cycle_lines(tree, components))
    lengths = [f.lines for f in tree.functions]
    if lengths:
        out.append(
            f"functions: {len(lengths)}, median {statistics.median(lengths):g} lines, "
            f"p90 {percentile(lengths, 0.9)} lines; modules: {len(tree.modules)}"
        )
    out.append("largest functions (from the def line to the last):")
    largest = sorted(tree.functions, key=lambda f: (-f.lines, f.path, f.line))
    out.extend(f"  {f.lines:5}  {f.path}:{f.line}  {f.qualname}" for f in largest[:TOP])
    out.append("largest modules:")
    biggest = sorted(tree.modules.values(), key=lambda m: (-m.lines, m.path))
    out.extend(f"  {m.lines:5}  {m.path}" for m in biggest[:TOP])
    return out


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The command line; --help shows the module docstring."""
    parser = argparse.ArgumentParser(
        prog="python scripts/shape.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "roots", nargs="*", default=["llmgw", "scripts"], help="gated roots (llmgw scripts)"
    )
    parser.add_argument(
        "--report",
        action="append",
        metavar="ROOT",
        help="a root to measure without gating (repeatable; default tests; '' for none)",
    )
    parser.add_argument(
        "--max-function", type=int, default=60, metavar="N", help="lines (default 60)"
    )
    parser.add_argument("--max-module", type=int, default=600, metavar="N", help="lines (600)")
    parser.add_argument("--allow", type=Path, metavar="FILE", help="exceptions, one a line")
    parser.add_argument(
        "--exclude", action="append", default=[], metavar="PATH", help="a path to skip"
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Measure, print, and return 1 when a gated root breaks a limit."""
    args = parse_args(argv)
    excluded = [*pyproject_excludes(Path.cwd()), *(Path(p) for p in args.exclude)]
    limits = Limits(args.max_function, args.max_module, frozenset(read_allowed(args.allow)))
    gated = [Path(root) for root in args.roots]
    reported = [Path(r) for r in (["tests"] if args.report is None else args.report) if r]
    for root in [*gated, *reported]:
        if not root.exists():
            print(f"shape: no such root: {root}", file=sys.stderr)
            return 2
    limit_text = f"functions up to {limits.max_function} lines, modules up to {limits.max_module}"
    tree = read_tree(gated, excluded)
    components = cycles(tree.edges)
    out = report(f"{' '.join(map(str, gated))} (gated: {limit_text})", tree, components)
    violations = violations_of(tree, components, limits)
    if reported:
        names = " ".join(map(str, reported))
        other = read_tree(reported, excluded)
        out.extend(report(f"{names} (reported, not gated)", other, cycles(other.edges)))
    needless = needless_exceptions(tree, components, limits)
    if needless:
        out.append(f"== {len(needless)} exceptions no longer needed (delete them from --allow)")
        out.extend(f"  {entry}" for entry in needless)
    if violations:
        out.append(f"== {len(violations)} over the limits")
        out.extend(f"  {v}" for v in violations)
    else:
        out.append("== within the limits")
    print("\n".join(out))
    return 1 if violations else 0


if __name__ == "__main__":
    sys.exit(main())
