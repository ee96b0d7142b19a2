"""The `grid_path` verifier: does a move string walk from start to goal by a shortest path?

    ground truth  "(3,7)->(9,1) on 10x10"      start (x, y), goal (x, y), grid width x height
    completion    " R U R U U R R U U R U R"   moves, whitespace-separated: R x+1, L x-1, D y+1, U y-1

Reward 1.0 when every word of the completion is a move and the walk ends on the goal in exactly |dx| + |dy| moves
(the Manhattan distance: the grid has no walls, so that is the shortest walk's length; such a walk stays in the box
between start and goal, so inside the grid); else 0.0. A completion with anything but moves in it (an answer sentence, a stray token) scores 0.0. The study's
task (study/grid.py) makes every response token a real choice: at most steps two moves are equally short.

Stdlib only: common/rewards.py scores with it in the caller (microseconds a completion, no worker), and its worker
script must import nothing heavy.
"""

from __future__ import annotations

import re

MOVES = {"R": (1, 0), "L": (-1, 0), "D": (0, 1), "U": (0, -1)}
_GROUND_TRUTH = re.compile(r"\((\d+),(\d+)\)->\((\d+),(\d+)\) on (\d+)x(\d+)")


def ground_truth(start: tuple[int, int], goal: tuple[int, int], size: tuple[int, int]) -> str:
    """The ground-truth string of a walk from `start` to `goal` on a grid of `size` = (width, height)."""
    return f"({start[0]},{start[1]})->({goal[0]},{goal[1]}) on {size[0]}x{size[1]}"


def parse_ground_truth(text: str) -> tuple[tuple[int, int], tuple[int, int], tuple[int, int]]:
    """(start, goal, size) of a ground truth; ValueError naming the expected form when it is not one."""
    m = _GROUND_TRUTH.fullmatch(text.strip()) if isinstance(text, str) else None
    if m is None:
        raise ValueError(f"not a grid_path ground truth: {str(text)[:80]!r}; write it as \"(x,y)->(x,y) on WxH\", "
                         f"e.g. \"(3,7)->(9,1) on 10x10\"")
    sx, sy, gx, gy, w, h = map(int, m.groups())
    if not (0 < w and 0 < h and 0 <= sx < w and 0 <= gx < w and 0 <= sy < h and 0 <= gy < h):
        raise ValueError(f"grid_path ground truth {text!r} puts start or goal outside its {w}x{h} grid")
    return (sx, sy), (gx, gy), (w, h)


def parse_moves(completion: str) -> list[str] | None:
    """The completion's moves, or None when any word of it is not a move."""
    words = completion.split()
    return words if all(w in MOVES for w in words) else None


def walk_score(completion: str, truth: str) -> tuple[bool, float]:
    """(well formed: the completion is nothing but moves, reward): 1.0 for a shortest walk from start to goal."""
    start, goal, _ = parse_ground_truth(truth)
    moves = parse_moves(completion)
    if not moves:
        return False, 0.0
    x = start[0] + sum(MOVES[m][0] for m in moves)
    y = start[1] + sum(MOVES[m][1] for m in moves)
    shortest = abs(goal[0] - start[0]) + abs(goal[1] - start[1])
    # A walk of exactly the shortest length that ends on the goal never leaves the box between start and goal, so it
    # never leaves the grid: no bounds check can change a reward. A well-formed wrong walk (off the grid or not) is
    # "well formed" for reward.format_score.
    return True, float((x, y) == goal and len(moves) == shortest)
