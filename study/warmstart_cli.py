"""`covrl warmstart`: build a task's base model. `--task grid` goes to study/grid_warmstart.py, every other task
to study/warmstart.py (arith, the demo's; chain, the earlier studies'). Two modules, so the grid's warm start can
reuse study/warmstart.py's recipe without the two importing each other."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    grid = any(a == "--task=grid" for a in argv) or any(a == "--task" and b == "grid" for a, b in zip(argv, argv[1:]))
    if grid:
        from study.grid_warmstart import main as grid_main

        return grid_main(argv)
    from study.warmstart import main as task_main

    return task_main(argv) or 0


if __name__ == "__main__":
    raise SystemExit(main())
