"""The import graph of ``llmgw.cli`` has no cycle (grimp, import-linter's own graph).

The layers contract in pyproject.toml says which module may import which; this says only
that no chain of imports, direct or not, leads from a module of ``llmgw.cli`` back to itself.
"""

from __future__ import annotations

import grimp


def _cli_graph() -> dict[str, set[str]]:
    graph = grimp.build_graph("llmgw", include_external_packages=False)
    modules = {m for m in graph.modules if m.startswith("llmgw.cli.")}
    return {m: graph.find_modules_directly_imported_by(m) & modules for m in modules}


def _cycle(edges: dict[str, set[str]]) -> list[str]:
    """One cycle of ``edges`` as the modules along it (first = last), or [] if none."""
    state: dict[str, str] = {}  # "open" while on the path, "done" once fully explored
    path: list[str] = []

    def visit(module: str) -> list[str]:
        state[module] = "open"
        path.append(module)
        for target in sorted(edges[module]):
            if state.get(target) == "open":
                return [*path[path.index(target) :], target]
            if target not in state and (found := visit(target)):
                return found
        path.pop()
        state[module] = "done"
        return []

    for module in sorted(edges):
        if module not in state and (found := visit(module)):
            return found
    return []


def test_the_cycle_finder_finds_a_cycle_and_only_a_cycle() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) == []


def test_llmgw_cli_has_no_import_cycle() -> None:
    edges = _cli_graph()
    assert "llmgw.cli.main" in edges and len(edges) > 10  # the graph is the real one
    assert _cycle(edges) == []


def test_no_module_imports_the_command_line_main() -> None:
    edges = _cli_graph()
    assert {m for m, targets in edges.items() if "llmgw.cli.main" in targets} == set()
