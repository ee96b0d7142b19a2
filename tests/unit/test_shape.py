"""docs/DESIGN.md section 1: in every product package no function is longer than about a screen or nested deeper
than three blocks, so each reads at a glance. A block is an `if`, loop, `with`, `try`, `match` or a nested def or
class; an `elif` is the same level as its `if`."""

import ast
import os
from tests.helpers.paths import REPO

CHECKED = ("actors", "broker", "common", "hardware", "launch", "learner", "study")
MAX_LINES, MAX_DEPTH = 80, 3
BLOCKS = (ast.If, ast.For, ast.AsyncFor, ast.While, ast.With, ast.AsyncWith, ast.Try, ast.Match,
          ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)


def depth(node: ast.AST) -> int:
    """How many blocks deep the body of `node` goes."""
    deepest = 0
    for child in ast.iter_child_nodes(node):
        elif_ = isinstance(node, ast.If) and isinstance(child, ast.If) and node.orelse == [child]
        deepest = max(deepest, depth(child) + (isinstance(child, BLOCKS) and not elif_))
    return deepest


def functions(root: str):
    for pkg in CHECKED:
        for folder, _, files in os.walk(os.path.join(root, pkg)):
            for f in sorted(files):
                if f.endswith(".py"):
                    path = os.path.join(folder, f)
                    for node in ast.walk(ast.parse(open(path).read(), path)):
                        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                            yield os.path.relpath(path, root), node


def test_depth_counts_blocks_not_elifs():
    tree = ast.parse("def f(x):\n    if x:\n        for i in x:\n            pass\n    elif x:\n        pass\n")
    assert depth(tree.body[0]) == 2
    tree = ast.parse("def f(x):\n    with x:\n        try:\n            while x:\n                if x:\n"
                     "                    pass\n        except E:\n            pass\n")
    assert depth(tree.body[0]) == 4


def test_functions_are_short_and_shallow():
    bad, seen = [], 0
    for path, fn in functions(REPO):
        seen += 1
        lines, d = fn.end_lineno - fn.lineno + 1, depth(fn)
        if lines > MAX_LINES or d > MAX_DEPTH:
            bad.append(f"{path}:{fn.lineno} {fn.name}: {lines} lines, {d} blocks deep")
    assert seen > 200, "the walk found too few functions: the check would pass vacuously"
    assert not bad, (f"functions over {MAX_LINES} lines or {MAX_DEPTH} blocks deep (split them into named steps):\n"
                     + "\n".join(bad))
