"""The project's import graph: which package imports which, and any cycle between modules.

    python tools/import_graph.py            # the package graph, one line per package
    python tools/import_graph.py --check    # exit 1 on any import cycle (make lint runs it)
    python tools/import_graph.py --dot      # Graphviz, e.g. `| dot -Tpng > imports.png`

The layer rules themselves (what may import what) are the import-linter contracts in
pyproject.toml (``lint-imports``); a layers contract says nothing about modules of one
package importing each other in a circle, which this check adds.  Imports under
``if TYPE_CHECKING:`` are left out, as in the contracts: they never run.
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict

import grimp

ROOTS = ("dualrl", "core", "backends", "benchmarks")


def package_of(module: str) -> str:
    """``core.policy.config`` -> ``core.policy``; ``dualrl.cli`` -> ``dualrl``."""
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] in ("core", "backends") and len(parts) > 1 else parts[0]


def package_graph(graph: grimp.ImportGraph) -> dict[str, set[str]]:
    edges: dict[str, set[str]] = defaultdict(set)
    for module in graph.modules:
        for imported in graph.find_modules_directly_imported_by(module):
            src, dst = package_of(module), package_of(imported)
            if src != dst:
                edges[src].add(dst)
    return edges


def module_cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    succ = {m: sorted(graph.find_modules_directly_imported_by(m)) for m in graph.modules}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(succ):
        if root in index:
            continue
        work = [(root, 0)]
        while work:
            node, i = work.pop()
            if i == 0:
                index[node] = low[node] = len(index)
                stack.append(node)
                on_stack.add(node)
            if i < len(succ[node]):
                work.append((node, i + 1))
                nxt = succ[node][i]
                if nxt not in index:
                    work.append((nxt, 0))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 on any import cycle")
    parser.add_argument("--dot", action="store_true", help="print the package graph as Graphviz")
    args = parser.parse_args(argv)
    graph = grimp.build_graph(*ROOTS, exclude_type_checking_imports=True)
    edges = package_graph(graph)
    cycles = module_cycles(graph)
    if args.dot:
        print("digraph imports {\n  rankdir=TB;")
        print("\n".join(f'  "{a}" -> "{b}";' for a in sorted(edges) for b in sorted(edges[a])))
        print("}")
    elif not args.check:
        for src in sorted(edges):
            print(f"{src} -> {', '.join(sorted(edges[src]))}")
    for cycle in cycles:
        print(f"import cycle: {' <-> '.join(cycle)}", file=sys.stderr)
    if args.check:
        print(f"{len(graph.modules)} modules, {len(cycles)} import cycle(s)")
    return 1 if args.check and cycles else 0


if __name__ == "__main__":
    sys.exit(main())
