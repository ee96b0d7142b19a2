"""docs/DESIGN.md section 1: actors/ and learner/ never import each other; broker/ (the rollout broker, a thread
of learner rank 0) imports only common/, and learner/ imports it only in its composition root (learner/__main__.py
builds the hub and wires it in; everything else talks to it through learner/ports.py); common/ imports none of them;
launch/ imports common/ (it starts the roles as processes) and study/ (the end-of-run plots); study/ imports only
common/; hardware/ (the GPU tools) imports the roles' packages (it runs their code in its workers) but not
study/, and no role imports the tools. No product module imports tests/. And no import cycle anywhere."""

import ast
import os

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGES = ("actors", "broker", "common", "hardware", "launch", "learner", "study")
FORBIDDEN = {"actors": {"learner", "broker", "launch"}, "learner": {"actors", "broker", "launch"},
             "broker": {"actors", "learner", "launch"}, "common": {"actors", "learner", "broker", "launch"},
             "launch": {"actors", "learner", "broker", "hardware"},  # study/: the end-of-run plots
             "study": {"actors", "learner", "broker", "launch", "hardware"},
             "hardware": {"study"}}  # the roles' packages: the proof's workers and the check's learner role
for _role in ("actors", "broker", "common", "learner"):  # no role and no common/ module imports the tools
    FORBIDDEN[_role] |= {"study", "hardware"}
for _pkg in FORBIDDEN:  # tests/ is not part of the product: no command, role or tool may need it
    FORBIDDEN[_pkg].add("tests")
# The one file allowed an import its package's row forbids: (file, package) -> why.
EXCEPTIONS = {("learner/__main__.py", "broker"): "the composition root builds the hub and hands it to the loop"}


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
                    rel = os.path.relpath(path, REPO)
                    bad += [f"{rel} imports {m}" for m in _imports(path)
                            if m in forbidden and (rel, m) not in EXCEPTIONS]
    assert set(FORBIDDEN) == set(PACKAGES) == {d for d in os.listdir(REPO) if os.path.isfile(
        os.path.join(REPO, d, "__init__.py")) and d != "tests"}, "a package without a layering rule"
    assert checked > 10, "the walk found no sources: the rule would pass vacuously"
    assert not bad, "import rule broken:\n" + "\n".join(bad)


def _module_graph():
    """module -> the repository modules it imports (at any depth of the file, function-level imports too)."""
    graph = {}
    for pkg in PACKAGES:
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
    assert "broker.rules" in graph["broker.hub"] and "broker.hub" in graph["learner.__main__"], "the graph missed broker"
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


def test_only_the_engine_and_the_nccl_sender_import_vllm():
    """vLLM is a GPU-only dependency: the vLLM engine imports it, and the learner's NCCL sender (vLLM's NCCL
    wrapper), and the GPU proof's vLLM workers; nothing in common/ does, so the CPU product never reaches for it."""
    users = set()
    for pkg in PACKAGES:
        for root, _, files in os.walk(os.path.join(REPO, pkg)):
            users.update(os.path.relpath(os.path.join(root, f), REPO) for f in files
                         if f.endswith(".py") and "vllm" in _imports(os.path.join(root, f)))
    assert users == {"actors/vllm_engine.py", "learner/nccl.py", "hardware/proof_workers.py"}, sorted(users)


def test_learner_imports_the_broker_only_in_its_composition_root():
    """The exception above is used, and is the only one: the learner's modules other than __main__ see the hub only
    through learner/ports.py."""
    users = set()
    for root, _, files in os.walk(os.path.join(REPO, "learner")):
        users.update(os.path.relpath(os.path.join(root, f), REPO) for f in files
                     if f.endswith(".py") and "broker" in _imports(os.path.join(root, f)))
    assert users == {"learner/__main__.py"}, sorted(users)
    assert set(EXCEPTIONS) == {("learner/__main__.py", "broker")}


def test_no_two_modules_share_a_name():
    """Each file is one room with a name of its own across the product's packages (`__init__` and `__main__`
    apart), so a name in a log, a traceback or a review points at one place."""
    seen: dict[str, list[str]] = {}
    for pkg in PACKAGES:
        for root, _, files in os.walk(os.path.join(REPO, pkg)):
            for f in files:
                if f.endswith(".py") and f not in ("__init__.py", "__main__.py"):
                    seen.setdefault(f, []).append(os.path.relpath(os.path.join(root, f), REPO))
    assert len(seen) > 50, "the walk found too few modules: the check would pass vacuously"
    shared = {name: paths for name, paths in seen.items() if len(paths) > 1}
    assert not shared, f"modules sharing a name: {shared}"
