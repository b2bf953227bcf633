"""Draw attnlab's import graph and report its cycles.

Every ``import`` of an attnlab module counts as a dependency, wherever it sits: at module
level or inside a function (a lazy import is still a dependency, it only moves the moment
it happens). Imports under ``if TYPE_CHECKING:`` do not count: they never run.

Usage::

    python tools/import_graph.py                 # cycles and function-local imports per file
    python tools/import_graph.py --dot graph.dot # the graph as Graphviz dot
    python tools/import_graph.py --png graph.png # the graph as a figure (matplotlib)
    python tools/import_graph.py --packages      # also the packages a submodule import runs

The exit status is 1 when the graph has a cycle, so the command can gate CI.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "src"
PACKAGE = "attnlab"


@dataclass
class Graph:
    """Module-level and function-local edges between attnlab modules."""

    modules: dict[str, Path]
    edges: dict[str, set[str]] = field(default_factory=lambda: defaultdict(set))
    local_edges: dict[str, set[str]] = field(default_factory=lambda: defaultdict(set))
    local_counts: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    def all_edges(self, *, packages: bool = False) -> dict[str, set[str]]:
        """Every edge, module-level and function-local; with ``packages``, also the
        packages that importing a submodule runs first (``attnlab.backends`` for
        ``attnlab.backends.blockwise``), except attnlab's own ``__init__`` and a module's
        own packages."""
        merged: dict[str, set[str]] = {m: set() for m in self.modules}
        for src in (self.edges, self.local_edges):
            for a, bs in src.items():
                merged[a] |= bs
        if packages:
            for a, bs in list(merged.items()):
                for b in list(bs):
                    parts = b.split(".")
                    for i in range(2, len(parts)):
                        parent = ".".join(parts[:i])
                        if parent in self.modules and not a.startswith(parent + "."):
                            merged[a].add(parent)
        return merged


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def find_modules(root: Path = ROOT) -> dict[str, Path]:
    """Every module under ``root/attnlab``, by dotted name."""
    return {_module_name(p, root): p for p in sorted((root / PACKAGE).rglob("*.py"))}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The longest prefix of ``name`` that is an attnlab module."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in modules:
            return candidate
        parts.pop()
    return None


def _targets(
    node: ast.Import | ast.ImportFrom, here: str, is_pkg: bool, modules: dict[str, Path]
) -> list[str]:
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        if node.level:
            base = here.split(".") if is_pkg else here.split(".")[:-1]
            base = base[: len(base) - (node.level - 1)]
            stem = ".".join(base + ([node.module] if node.module else []))
        else:
            stem = node.module or ""
        # `from pkg import sub` names the submodule when there is one.
        names = [
            f"{stem}.{alias.name}" if f"{stem}.{alias.name}" in modules else stem
            for alias in node.names
        ]
    found = {_resolve(n, modules) for n in names if n == PACKAGE or n.startswith(PACKAGE + ".")}
    return sorted(m for m in found if m is not None and m != here)


def _collect(node: ast.AST, here: str, is_pkg: bool, graph: Graph, depth: int = 0) -> None:
    """Walk ``node``, recording its attnlab imports; ``depth`` > 0 inside a function."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and _is_type_checking(child.test):
            for other in child.orelse:
                _collect(other, here, is_pkg, graph, depth)
        elif isinstance(child, (ast.Import, ast.ImportFrom)):
            targets = _targets(child, here, is_pkg, graph.modules)
            if targets and depth:
                graph.local_edges[here].update(targets)
                graph.local_counts[here] += 1
            elif targets:
                graph.edges[here].update(targets)
        else:
            inner = isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            _collect(child, here, is_pkg, graph, depth + inner)


def build_graph(root: Path = ROOT) -> Graph:
    """Parse every module under ``root/attnlab`` and collect its attnlab imports."""
    graph = Graph(find_modules(root))
    for name, path in graph.modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        _collect(tree, name, path.name == "__init__.py", graph)
    return graph


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), largest first."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = 0

    def connect(v: str) -> None:
        nonlocal counter
        index[v] = low[v] = counter
        counter += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
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

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10_000))
    try:
        for v in sorted(edges):
            if v not in index:
                connect(v)
    finally:
        sys.setrecursionlimit(limit)
    return sorted(out, key=lambda c: (-len(c), c))


def to_dot(graph: Graph) -> str:
    """The graph in Graphviz dot; function-local imports dashed."""
    lines = ["digraph attnlab {", "  rankdir=LR;", "  node [shape=box, fontsize=10];"]
    for a in sorted(graph.modules):
        lines.append(f'  "{a}";')
    for a in sorted(graph.modules):
        for b in sorted(graph.edges.get(a, ())):
            lines.append(f'  "{a}" -> "{b}";')
        for b in sorted(graph.local_edges.get(a, set()) - graph.edges.get(a, set())):
            lines.append(f'  "{a}" -> "{b}" [style=dashed];')
    lines.append("}")
    return "\n".join(lines) + "\n"


def _layers(edges: dict[str, set[str]]) -> dict[str, int]:
    """Each module's height: 0 for modules that import no attnlab module (cycles share one)."""
    comp_of: dict[str, str] = {}
    for comp in cycles(edges):
        for m in comp:
            comp_of[m] = comp[0]
    height: dict[str, int] = {}

    def h(v: str, seen: frozenset[str]) -> int:
        if v in height:
            return height[v]
        deps = [
            w for w in edges.get(v, ()) if comp_of.get(w, w) != comp_of.get(v, v) and w not in seen
        ]
        height[v] = 1 + max((h(w, seen | {v}) for w in deps), default=-1)
        return height[v]

    for v in edges:
        h(v, frozenset())
    return height


def by_area(graph: Graph) -> Graph:
    """The graph with every module of a subpackage merged into it (``attnlab.models``
    for ``attnlab.models.decode.plan``): the areas of DESIGN.md's one-way flow, a figure a
    person can read."""

    def area(name: str) -> str:
        parts = name.split(".")
        top = ".".join(parts[:2])
        return top if len(parts) > 2 or graph.modules[name].name == "__init__.py" else name

    merged = Graph(modules={area(m): graph.modules[m] for m in graph.modules})
    for src, dst in ((graph.edges, merged.edges), (graph.local_edges, merged.local_edges)):
        for a, bs in src.items():
            for b in bs:
                if area(a) != area(b):
                    dst[area(a)].add(area(b))
    for m, n in graph.local_counts.items():
        merged.local_counts[area(m)] += n
    return merged


def to_png(graph: Graph, path: Path) -> None:
    """Draw the graph with matplotlib: one column per layer, lower layers on the left."""
    import matplotlib  # deferred: only the figure needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    edges = graph.all_edges()
    height = _layers(edges)
    columns: dict[int, list[str]] = defaultdict(list)
    for m in sorted(edges):
        columns[height[m]].append(m)
    pos = {m: (x, -y) for x, ms in columns.items() for y, m in enumerate(ms)}
    tall = max(len(ms) for ms in columns.values())
    small = len(edges) <= 40  # the areas' graph: larger boxes and lines
    fig, ax = plt.subplots(figsize=(2 + 1.9 * len(columns), 1 + (0.6 if small else 0.3) * tall))
    in_cycle = {m for comp in cycles(edges) for m in comp}
    for a, bs in edges.items():
        for b in bs:
            (x0, y0), (x1, y1) = pos[a], pos[b]
            local = b not in graph.edges.get(a, set())
            ax.annotate(
                "",
                xy=(x1, y1),
                xytext=(x0, y0),
                arrowprops={
                    "arrowstyle": "->",
                    "lw": 0.7 if small else 0.4,
                    "alpha": 0.5 if small else 0.35,
                    "linestyle": "--" if local else "-",
                    "color": "red" if a in in_cycle and b in in_cycle else "grey",
                },
            )
    for m, (x, y) in pos.items():
        ax.text(
            x,
            y,
            m.removeprefix(PACKAGE + ".") or PACKAGE,
            fontsize=8 if small else 5,
            ha="center",
            va="center",
            bbox={"boxstyle": "round", "fc": "mistyrose" if m in in_cycle else "white", "lw": 0.3},
        )
    ax.set_xlim(-0.8, len(columns) - 0.2)
    ax.set_ylim(-tall, 1)
    ax.set_axis_off()
    ax.set_title("attnlab imports (left: imports nothing from attnlab; dashed: function-local)")
    fig.savefig(path, dpi=150, bbox_inches="tight")
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=ROOT, help="the folder that holds attnlab/")
    parser.add_argument("--dot", type=Path, help="write the graph as Graphviz dot")
    parser.add_argument("--png", type=Path, help="write the graph as a PNG figure")
    parser.add_argument(
        "--areas",
        action="store_true",
        help="merge each subpackage into one node (models, explain, ...) before the checks",
    )
    parser.add_argument(
        "--packages",
        action="store_true",
        help="count the parent packages an import runs first as dependencies too",
    )
    args = parser.parse_args(argv)
    graph = build_graph(args.root)
    if args.areas:
        graph = by_area(graph)
    found = cycles(graph.all_edges(packages=args.packages))
    print(f"{len(graph.modules)} {'areas' if args.areas else 'modules'}")
    if found:
        print(f"{len(found)} cycle(s) (strongly connected components):")
        for comp in found:
            print(f"  {len(comp)} modules: " + ", ".join(comp))
    else:
        print("no cycles")
    total = sum(graph.local_counts.values())
    print(f"{total} function-local attnlab imports")
    for name, count in sorted(graph.local_counts.items(), key=lambda kv: (-kv[1], kv[0])):
        where = name if args.areas else graph.modules[name].relative_to(args.root)
        print(f"  {count:4d}  {where}")
    if args.dot:
        args.dot.write_text(to_dot(graph), encoding="utf-8")
    if args.png:
        to_png(graph, args.png)
    return 1 if found else 0


if __name__ == "__main__":
    raise SystemExit(main())
