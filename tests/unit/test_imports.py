"""docs/DESIGN.md section 1: actors/ and learner/ never import each other; common/ imports neither;
launch/ imports only common/ (it starts the roles as processes)."""

import ast
import os

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FORBIDDEN = {"actors": {"learner", "launch"}, "learner": {"actors", "launch"},
             "common": {"actors", "learner", "launch"}, "launch": {"actors", "learner"}}


def _imports(path):
    tree = ast.parse(open(path).read(), path)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module.split(".")[0]


def test_import_rule():
    bad = []
    checked = 0
    for pkg, forbidden in FORBIDDEN.items():
        for root, _, files in os.walk(os.path.join(REPO, pkg)):
            for f in files:
                if f.endswith(".py"):
                    path = os.path.join(root, f)
                    checked += 1
                    bad += [f"{os.path.relpath(path, REPO)} imports {m}" for m in _imports(path) if m in forbidden]
    assert checked > 10, "the walk found no sources: the rule would pass vacuously"
    assert not bad, "import rule broken:\n" + "\n".join(bad)


def _module_graph():
    """module -> the repository modules it imports (at any depth of the file, function-level imports too)."""
    graph = {}
    for pkg in ("actors", "learner", "common", "launch"):
        for root, _, files in os.walk(os.path.join(REPO, pkg)):
            for f in files:
                if f.endswith(".py"):
                    path = os.path.join(root, f)
                    name = os.path.relpath(path, REPO)[:-3].replace(os.sep, ".").removesuffix(".__init__")
                    tree = ast.parse(open(path).read(), path)
                    deps = set()
                    for node in ast.walk(tree):
                        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                            deps.add(node.module)
                            deps.update(f"{node.module}.{a.name}" for a in node.names)
                        elif isinstance(node, ast.Import):
                            deps.update(a.name for a in node.names)
                    graph[name] = deps
    return {m: {d for d in deps if d in graph and d != m} for m, deps in graph.items()}


def test_no_import_cycles():
    graph = _module_graph()
    assert "actors.factory" in graph and "actors.engine" in graph["actors.factory"], "the graph missed imports"
    state, cycles = {}, []

    def visit(m, path):
        state[m] = "open"
        for d in sorted(graph[m]):
            if state.get(d) == "open":
                cycles.append(" -> ".join(path[path.index(d):] + [d]))
            elif d not in state:
                visit(d, path + [d])
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)
