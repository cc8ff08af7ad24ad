"""The layering rules of docs/design.md that import-linter cannot check: what importing a package
loads at run time, no import cycles, no swallowed ImportError around our own imports. The static
contracts themselves (``.importlinter``) run here too, so ``pytest`` alone catches a broken layer."""

from __future__ import annotations

import ast
import subprocess
import sys

import grimp

from tests.support.processes import REPO

PACKAGES = ("cache", "wire", "sidecar", "loader")


def imported_modules(package: str) -> set[str]:
    found: set[str] = set()
    for path in (REPO / package).rglob("*.py"):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                found.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found.add(node.module.split(".")[0])
    return found


def loaded_after(code: str) -> set[str]:
    """Top-level names of the modules a fresh interpreter has loaded after running ``code``."""
    probe = f"{code}\nimport sys; print(' '.join(sorted({{m.split('.')[0] for m in sys.modules}})))"
    result = subprocess.run([sys.executable, "-c", probe], check=True, cwd=REPO, capture_output=True, text=True)
    return set(result.stdout.split())


def test_cache_imports_no_upper_layer_and_no_http():
    assert not imported_modules("cache") & {"wire", "sidecar", "loader", "aiohttp", "boto3", "botocore", "prometheus_client"}


def test_loader_never_imports_sidecar():
    assert "sidecar" not in imported_modules("loader")


def test_bench_never_imports_the_tests():
    # tests/support builds the tests' servers on bench.servers; never the other way round.
    assert "tests" not in imported_modules("bench")


def test_import_cache_is_light():
    assert not loaded_after("import cache") & {"aiohttp", "sidecar", "loader", "wire", "boto3"}


def test_import_loader_loads_no_framework_and_no_aiohttp():
    assert not loaded_after("import loader, loader.master") & {"torch", "tensorflow", "aiohttp", "prometheus_client", "sidecar"}


def test_import_sidecar_cli_is_light():
    # Building the parser imports every subcommand module: each must keep its machinery lazy.
    loaded = loaded_after("import sidecar.cli; sidecar.cli.build_parser()")
    assert not loaded & {"aiohttp", "prometheus_client", "boto3", "botocore", "torch", "tensorflow"}


def test_import_wire_loads_nothing_of_ours():
    code = "import wire, wire.names, wire.errors, wire.shuffle, wire.httpclient"
    assert not loaded_after(code) & {"cache", "sidecar", "loader", "aiohttp", "boto3"}


def _strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative (the graph has hundreds of modules)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
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
    return found


def test_no_import_cycles_among_our_modules():
    # Every import counts, lazy ones inside functions too: a cycle hidden in a function is still
    # two modules that cannot be understood (or moved) one without the other.
    graph = grimp.build_graph(*PACKAGES)
    edges = {module: set(graph.find_modules_directly_imported_by(module)) for module in graph.modules}
    assert _strongly_connected(edges) == []


def test_cycle_finder_finds_a_cycle():
    assert _strongly_connected({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def _suppressed_project_imports(tree: ast.AST) -> list[int]:
    """Lines of imports of our packages inside ``try/except ImportError`` or ``suppress(ImportError)``."""
    def ours(node: ast.AST) -> bool:
        if isinstance(node, ast.Import):
            return any(alias.name.split(".")[0] in PACKAGES for alias in node.names)
        if isinstance(node, ast.ImportFrom):
            return node.level > 0 or (node.module or "").split(".")[0] in PACKAGES
        return False

    def names_import_error(expr: ast.AST | None) -> bool:
        return expr is not None and any(
            isinstance(n, ast.Name) and n.id in ("ImportError", "ModuleNotFoundError") for n in ast.walk(expr)
        )

    lines: list[int] = []
    for node in ast.walk(tree):
        guarded: list[ast.stmt] = []
        if isinstance(node, ast.Try) and any(names_import_error(h.type) for h in node.handlers):
            guarded = node.body
        elif isinstance(node, ast.With) and any(names_import_error(item.context_expr) for item in node.items):
            guarded = node.body
        lines.extend(inner.lineno for stmt in guarded for inner in ast.walk(stmt) if ours(inner))
    return lines


def test_no_swallowed_import_errors_around_our_imports():
    offenders = []
    for package in PACKAGES:
        for path in (REPO / package).rglob("*.py"):
            for line in _suppressed_project_imports(ast.parse(path.read_text(), filename=str(path))):
                offenders.append(f"{path.relative_to(REPO)}:{line}")
    assert offenders == []


def test_suppressed_import_finder_finds_one():
    code = (
        "import contextlib\nwith contextlib.suppress(ImportError):\n    from sidecar import x\n"
        "try:\n    import yaml\nexcept ImportError:\n    pass\n"
    )
    assert _suppressed_project_imports(ast.parse(code)) == [3]


def test_import_linter_contracts_hold():
    result = subprocess.run(["lint-imports", "--no-cache"], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-4000:]
