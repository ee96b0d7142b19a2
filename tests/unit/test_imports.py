"""docs/DESIGN.md section 1: actors/ and learner/ never import each other; broker/ (the rollout broker, a thread
of learner rank 0) imports only common/, and learner/ imports it only in its composition root (learner/__main__.py
builds the hub and wires it in; everything else talks to it through learner/ports.py); common/ imports none of them;
launch/ imports common/ (it starts the roles as processes) and study/ (the end-of-run plots); study/ imports only
common/; hardware/ (the GPU tools) imports the roles' packages (it runs their code in its workers) but not
study/, and no role imports the tools. No product module imports tests/. And no import cycle anywhere.

Under tests/, a test module (test_*.py) is a leaf: no module there imports a test module or a conftest.py; code that
several modules share lives in tests/helpers/, fixtures in a conftest.py (docs/testing.md)."""

import ast
import os
import textwrap
from tests.helpers.paths import REPO

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


def _imported_names(source: str, package: str) -> set[str]:
    """The modules a file's import statements name, as absolute dotted names, at any depth of the file (function-local
    imports too); relative imports are resolved against `package`, and `from a import b` names both `a` and `a.b` (b
    may be a module). Imports in the file's string literals count too: the driver scripts tests run with `python -c`."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            parts = package.split(".")
            base = ".".join(parts[:len(parts) - node.level + 1]) if node.level else ""
            module = ".".join(filter(None, [base, node.module]))
            names.add(module)
            names.update(f"{module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and "import" in node.value:
            names |= _imported_names_in_text(node.value, package)
    return names


def _imported_names_in_text(text: str, package: str) -> set[str]:
    try:
        return _imported_names(textwrap.dedent(text), package)
    except SyntaxError:  # not a whole program (a str.format template, prose): line by line
        names: set[str] = set()
        for line in text.splitlines():
            try:
                names |= _imported_names(line.strip(), package)
            except SyntaxError:
                pass
        return names


def _test_module(name: str) -> str | None:
    """The file, relative to the repository, when dotted `name` is a test module (test_*.py) or a conftest.py."""
    rel = os.path.join(*name.split(".")) + ".py"
    stem = os.path.basename(rel)[:-3]
    if (stem.startswith("test_") or stem == "conftest") and os.path.isfile(os.path.join(REPO, rel)):
        return rel
    return None


def _test_tree_sources():
    """(path relative to the repository, dotted package) of every Python file under tests/."""
    for root, dirs, files in os.walk(os.path.join(REPO, "tests")):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for f in sorted(files):
            if f.endswith(".py"):
                rel = os.path.relpath(os.path.join(root, f), REPO)
                yield rel, os.path.dirname(rel).replace(os.sep, ".")


def test_no_module_under_tests_imports_a_test_module():
    """A test module is a leaf: running, renaming or deleting one never breaks another, importing one never runs
    another's module-level setup (its `pytestmark`, an importorskip), and no fixture is imported by name. Shared
    code goes to tests/helpers/ (whose modules import no test module either), shared fixtures to the conftest.py of
    the level that uses them; no module imports a conftest.py (its constants are tests/helpers/paths.py's)."""
    bad, seen = [], set()
    for rel, package in _test_tree_sources():
        seen.add(rel)
        with open(os.path.join(REPO, rel)) as f:
            names = _imported_names(f.read(), package)
        bad += [f"{rel} imports {name} ({target})" for name in sorted(names) if (target := _test_module(name))]
    assert len(seen) > 50 and {"tests/helpers/runs.py", "tests/conftest.py"} <= seen, \
        "the walk missed tests/: the rule would pass vacuously"
    assert not bad, ("a module under tests/ imports a test module or a conftest.py; move what it needs into "
                     "tests/helpers/ (a fixture into a conftest.py) and import it from there:\n" + "\n".join(bad))


def test_the_test_module_rule_sees_every_form_of_import():
    """The rule above catches each way of importing a test module, and passes an import from tests/helpers/. (The
    names are assembled here so that this file's own literals import no test module.)"""
    me = "test_" + "imports"  # this file: a test module that surely exists
    cases = {"plain": f"import tests.unit.{me} as t",
             "from its package": f"from tests.unit import {me}",
             "relative": f"from .{me} import REPO",
             "inside a function": f"def f():\n    from tests.unit.{me} import PACKAGES",
             "a script in a string": f"S = \"\"\"\nimport sys\nfrom tests.unit.{me} import REPO\nprint({{repo!r}})\n\"\"\"",
             "a conftest.py": "from .. import " + "con" + "ftest"}
    for what, source in cases.items():
        assert any(_test_module(n) for n in _imported_names(source, "tests.unit")), f"not caught ({what}): {source}"
    assert not any(_test_module(n) for n in _imported_names("from tests.helpers.runs import SMALL", "tests.unit"))
