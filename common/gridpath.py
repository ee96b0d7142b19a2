"""The `grid_path` verifier: does a move string walk from start to goal by a shortest path?

    ground truth  "(3,7)->(9,1) on 10x10"      start (x, y), goal (x, y), grid width x height
                  "(3,7)->(9,1) on 10x10 ice 4,7 8,2"   the same, with ice cells: no walk may turn on one
    completion    " R U R U U R R U U R U R"   moves, whitespace-separated: R x+1, L x-1, D y+1, U y-1

Reward 1.0 when every word of the completion is a move, the walk ends on the goal in exactly |dx| + |dy| moves
(the Manhattan distance: the grid has no walls, so that is the shortest walk's length; such a walk stays in the box
between start and goal, so inside the grid) and it never changes axis (a horizontal move after a vertical one, or
the reverse) while standing on an ice cell; else 0.0. A completion with anything but moves in it (an answer
sentence, a stray token) scores 0.0. The ice is in the ground truth only, never in the prompt: a hidden rule of the
world that RL must find from the reward (docs/study-grid/PLAN.md amendment 3). The study's task (study/grid.py)
makes every response token a real choice: at most steps two moves are equally short, and with ice they differ in
how likely the walk is to finish.

Stdlib only: common/rewards.py scores with it in the caller (microseconds a completion, no worker), and its worker
script must import nothing heavy.
"""

from __future__ import annotations

import re

MOVES = {"R": (1, 0), "L": (-1, 0), "D": (0, 1), "U": (0, -1)}
_GROUND_TRUTH = re.compile(r"\((\d+),(\d+)\)->\((\d+),(\d+)\) on (\d+)x(\d+)((?: ice(?: \d+,\d+)+)?)")
Cell = tuple[int, int]


def ground_truth(start: Cell, goal: Cell, size: Cell, ice: frozenset[Cell] | set[Cell] = frozenset()) -> str:
    """The ground-truth string of a walk from `start` to `goal` on a grid of `size` = (width, height), with the
    cells on which no walk may turn (`ice`, in a sorted order)."""
    text = f"({start[0]},{start[1]})->({goal[0]},{goal[1]}) on {size[0]}x{size[1]}"
    return text + (" ice " + " ".join(f"{x},{y}" for x, y in sorted(ice)) if ice else "")


def parse_ground_truth(text: str) -> tuple[Cell, Cell, Cell, frozenset[Cell]]:
    """(start, goal, size, ice) of a ground truth; ValueError naming the expected form when it is not one."""
    m = _GROUND_TRUTH.fullmatch(text.strip()) if isinstance(text, str) else None
    if m is None:
        raise ValueError(f"not a grid_path ground truth: {str(text)[:80]!r}; write it as \"(x,y)->(x,y) on WxH\" "
                         f"with optional ice cells, e.g. \"(3,7)->(9,1) on 10x10\" or "
                         f"\"(3,7)->(9,1) on 10x10 ice 4,7 8,2\"")
    sx, sy, gx, gy, w, h = map(int, m.groups()[:6])
    ice = frozenset(tuple(map(int, c.split(","))) for c in m.group(7).split()[1:])
    if not (0 < w and 0 < h and 0 <= sx < w and 0 <= gx < w and 0 <= sy < h and 0 <= gy < h):
        raise ValueError(f"grid_path ground truth {text!r} puts start or goal outside its {w}x{h} grid")
    outside = sorted(c for c in ice if not (0 <= c[0] < w and 0 <= c[1] < h))
    if outside:
        raise ValueError(f"grid_path ground truth {text[:80]!r} puts ice cell {outside[0]} outside its {w}x{h} grid")
    return (sx, sy), (gx, gy), (w, h), ice


def turn_cells(start: Cell, moves: list[str]) -> list[Cell]:
    """The cells on which the walk changes axis: where it stands before a move whose axis differs from the last."""
    x, y = start
    cells = []
    for i, m in enumerate(moves):
        if i and (m in "RL") != (moves[i - 1] in "RL"):
            cells.append((x, y))
        x, y = x + MOVES[m][0], y + MOVES[m][1]
    return cells


def parse_moves(completion: str) -> list[str] | None:
    """The completion's moves, or None when any word of it is not a move."""
    words = completion.split()
    return words if all(w in MOVES for w in words) else None


def walk_score(completion: str, truth: str) -> tuple[bool, float]:
    """(well formed: the completion is nothing but moves, reward): 1.0 for a shortest walk from start to goal that
    turns on no ice cell."""
    start, goal, _, ice = parse_ground_truth(truth)
    moves = parse_moves(completion)
    if not moves:
        return False, 0.0
    x = start[0] + sum(MOVES[m][0] for m in moves)
    y = start[1] + sum(MOVES[m][1] for m in moves)
    shortest = abs(goal[0] - start[0]) + abs(goal[1] - start[1])
    # A walk of exactly the shortest length that ends on the goal never leaves the box between start and goal, so it
    # never leaves the grid: no bounds check can change a reward. A well-formed wrong walk (off the grid or not) is
    # "well formed" for reward.format_score.
    return True, float((x, y) == goal and len(moves) == shortest and ice.isdisjoint(turn_cells(start, moves)))
