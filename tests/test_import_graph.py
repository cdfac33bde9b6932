"""jaxrec's modules import each other without cycles (lazy imports inside functions
included): each layer builds on the ones below it (sparse <- ops <- optim <- nn <- models
<- train, parallel on top), and two modules that need one thing share a third module."""

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, modules: set[str]) -> set[str]:
    """The jaxrec modules ``path`` imports, anywhere in it (a name imported from a package
    that is itself a module of the package counts as that module)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("jaxrec"):
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                out.add(sub if sub in modules else node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("jaxrec"))
    return out & modules


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
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
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles_between_jaxrec_modules():
    paths = {module_name(p): p for p in (SRC / "jaxrec").rglob("*.py")}
    modules = set(paths)
    graph = {m: imports(p, modules) - {m} for m, p in paths.items()}
    # A package's __init__ re-exports its modules: an edge from a module to its own package
    # (or any ancestor) is the usual "from the package, import a sibling" and not a cycle
    # by itself; cycles among the modules themselves are what this test forbids.
    for m in graph:
        graph[m] = {d for d in graph[m] if not m.startswith(d + ".")}
    assert cycles(graph) == []


def test_parallel_builds_on_the_public_api_of_the_layers_below():
    """jaxrec.parallel meets the collections through jaxrec.nn.TableCollection and the other
    layers through their exported names: never another package's private module or name."""
    private = []
    for path in (SRC / "jaxrec" / "parallel").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.ImportFrom) and node.module
                    and node.module.startswith("jaxrec") and not node.module.startswith("jaxrec.parallel")):
                continue
            names = [a.name for a in node.names]
            parts = node.module.split(".")[1:]
            if any(p.startswith("_") for p in parts) or any(n.startswith("_") for n in names):
                if not {"_step_guard", "_mesh"} & {*parts, *names}:  # shared by every layer
                    private.append(f"{path.name}: from {node.module} import {', '.join(names)}")
        private += [f"{path.name}: {m}" for m in ("._make(",) if m in path.read_text()]
    assert private == []
