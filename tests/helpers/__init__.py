"""Code shared by test modules (tests/unit, tests/integration, tests/bench, tests/gpu), one idea per module.

A test module (test_*.py) is a leaf: it imports shared code from here, never from another test module or a
conftest.py, and nothing here imports a test module either (tests/unit/test_imports.py). Fixtures that several
modules take live in the conftest.py of the level that uses them."""
