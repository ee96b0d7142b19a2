"""`grid`: the entropy study's choice-dense task -- walk from start to goal on a 10x10 grid by a shortest path.

    Walk from (3,7) to (9,1).        a shortest walk: " R U R U U R R U U R U R"   (6 R and 6 U, in any order)

Why this task (docs/study-grid/PLAN.md): on `chain` the entropy sat in about one strategy token per response and
the covariance did not drive its change, so the mechanism of Cui et al. 2025 had nothing to act on. Here every
response token is a move: while both coordinates still differ, two moves are equally short (a real choice with a
reward behind it only through what follows), the other two are wrong, and the response is 8..14 moves long (both
coordinates differ, Manhattan distance 8..14), so the length cannot carry the entropy's fall. The grid has no walls:
every shortest walk is a staircase, which a 1 M-parameter model can learn to count out (walls, and a map to read,
were not tried).

The warm start (covrl warmstart --task grid) imitates a mix of uniformly random shortest walks and walks with one
or two wrong moves (`flawed_walk`): a detour (a wrong move and its undoing later: the goal is reached, two moves
late) or a swap (a move replaced by a wrong one: the goal is missed). So the base model makes mistakes at every
step with a small probability, RL has the shortest-walk rate to gain, and pass@k measures the diversity of walks
that the sampling keeps. Reward: common/gridpath.py (`reward.verifier = "grid_path"`).

Held-out: `grid` (EVAL_SIZE walks), drawn first from its own RNG stream; the train stream never holds them. Every
draw goes through a `random.Random` seeded from `seed`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from random import Random

from common.datasets import write_rows
from common.gridpath import MOVES, ground_truth

DATA_SOURCE = "grid"
SIZE = 10  # the grid is SIZE x SIZE; coordinates are single digits (one token each)
MIN_MOVES, MAX_MOVES = 8, 14
EVAL_SIZE = 128
# Mean share of the warm start's walks with one or two wrong moves: 0 for base model v4 (amendment 3: the ice, not
# the model's mistakes, makes walks fail); 0.55 for base models v1 and v2, 0.60 for v3.
FLAW_FRACTION = 0.0
# Amendments 1 and 2 of docs/study-grid/PLAN.md: a walk's chance of a flaw grows with how often it changes axis, so
# which of two equally short moves the model takes decides how likely it errs later (0: base models v1's and v4's;
# 0.8: v2's; 3.0: v3's, nearly a step: walks that change axis less than the mean are rarely flawed, more, nearly always).
SWITCH_COUPLING = 0.0
# Amendment 3: the ice, cells on which no walk may turn, drawn once (each cell with ICE_DENSITY) from a fixed stream
# and written into every ground truth, never into a prompt. 24 of the 100 cells; a uniformly random shortest walk of
# the task turns on none of them 0.36 of the time, an L-shaped walk (one turn) 0.76 (a test pins these).
ICE_DENSITY = 0.25
MEAN_SWITCH_RATIO = 0.46  # about the mean switch ratio of a uniformly random shortest walk of the task (a test checks)
_OPPOSITE = {"R": "L", "L": "R", "D": "U", "U": "D"}


@dataclass(frozen=True)
class Walk:
    start: tuple[int, int]
    goal: tuple[int, int]

    @property
    def question(self) -> str:
        return f"Walk from ({self.start[0]},{self.start[1]}) to ({self.goal[0]},{self.goal[1]})."

    @property
    def answer(self) -> str:
        return ground_truth(self.start, self.goal, (SIZE, SIZE), ICE)

    @property
    def distance(self) -> int:
        return abs(self.goal[0] - self.start[0]) + abs(self.goal[1] - self.start[1])

    def needed(self) -> list[str]:
        """The moves of every shortest walk, as a multiset (in a fixed order)."""
        dx, dy = self.goal[0] - self.start[0], self.goal[1] - self.start[1]
        return ["R" if dx > 0 else "L"] * abs(dx) + ["D" if dy > 0 else "U"] * abs(dy)


def ice_cells(density: float = ICE_DENSITY, stream: str = "grid/ice") -> frozenset[tuple[int, int]]:
    """The task's ice: each cell of the grid, row by row, is ice with chance `density` in the stream `stream`."""
    rng = Random(stream)
    return frozenset((x, y) for y in range(SIZE) for x in range(SIZE) if rng.random() < density)


ICE = ice_cells()


def all_walks() -> list[Walk]:
    """Every start/goal pair of the task: both coordinates differ and the distance is MIN_MOVES..MAX_MOVES."""
    cells = [(x, y) for x in range(SIZE) for y in range(SIZE)]
    return [Walk(s, g) for s in cells for g in cells
            if s[0] != g[0] and s[1] != g[1] and MIN_MOVES <= abs(s[0] - g[0]) + abs(s[1] - g[1]) <= MAX_MOVES]


def shortest_walk(walk: Walk, rng: Random) -> list[str]:
    """A uniformly random shortest walk: a uniformly random order of the needed moves."""
    moves = walk.needed()
    rng.shuffle(moves)
    return moves


def inside(walk: Walk, moves: list[str]) -> bool:
    x, y = walk.start
    for m in moves:
        x, y = x + MOVES[m][0], y + MOVES[m][1]
        if not (0 <= x < SIZE and 0 <= y < SIZE):
            return False
    return True


def flawed_walk(walk: Walk, rng: Random, order: list[str] | None = None) -> list[str]:
    """A shortest walk (`order`, else a random one) with one or two wrong moves: each a detour (a wrong move, undone
    later: the goal is reached two moves late) or a swap (a move replaced by a wrong one: the goal is missed), and the
    walk stays on the grid."""
    for _ in range(100):
        moves = list(order) if order is not None else shortest_walk(walk, rng)
        for _ in range(rng.choice((1, 2))):
            i = rng.randrange(len(moves))
            right = set(walk.needed())
            wrong = rng.choice(sorted(set(MOVES) - right))
            if rng.random() < 0.5:  # detour
                j = rng.randint(i + 1, len(moves) + 1)
                moves = moves[:i] + [wrong] + moves[i:j - 1] + [_OPPOSITE[wrong]] + moves[j - 1:]
            else:  # swap
                moves[i] = wrong
        if inside(walk, moves):
            return moves
    raise RuntimeError(f"no flawed walk on the grid for {walk}: a bug in the task's bounds")


def render(moves: list[str]) -> str:
    """The response text: moves separated by spaces, each its own token (" R" under the Qwen2 pre-tokenizer)."""
    return "".join(" " + m for m in moves)


class GridTask:
    """Deterministic held-out walks and a train stream for a given seed (the interface of ChainTask)."""

    def __init__(self, seed: int = 0, eval_size: int = EVAL_SIZE):
        walks = all_walks()
        if not 0 <= eval_size <= len(walks) // 2:
            raise ValueError(f"eval_size must be in 0..{len(walks) // 2} (the task has {len(walks)} walks), "
                             f"got {eval_size}")
        Random(f"grid/{seed}/eval").shuffle(walks)
        self._eval, self._train = walks[:eval_size], walks[eval_size:]
        Random(f"grid/{seed}/train").shuffle(self._train)

    def train(self) -> list[Walk]:
        return list(self._train)

    def eval_sets(self) -> dict[str, list[Walk]]:
        return {DATA_SOURCE: list(self._eval)}


def switch_ratio(moves: list[str]) -> float:
    """The share of adjacent move pairs that change axis: 0 for an L-shaped walk, 1 for a full zig-zag."""
    axis = ["x" if m in "RL" else "y" for m in moves]
    return sum(a != b for a, b in zip(axis, axis[1:])) / max(len(moves) - 1, 1)


def flaw_probability(moves: list[str], flaw_fraction: float = FLAW_FRACTION, coupling: float = SWITCH_COUPLING) -> float:
    """The chance that the warm start's walk of this shape is flawed: `flaw_fraction` at the mean switch ratio, more
    for zig-zags and less for L-shapes by `coupling` (docs/study-grid/PLAN.md amendment 1), within [0.05, 0.95]
    (within [0, 0.95] when `flaw_fraction` is 0: base model v4 imitates flawless walks only)."""
    floor = min(0.05, flaw_fraction)
    return min(0.95, max(floor, flaw_fraction + coupling * (switch_ratio(moves) - MEAN_SWITCH_RATIO)))


def sft_text(walk: Walk, seed: int, index: int, flaw_fraction: float = FLAW_FRACTION,
             coupling: float = SWITCH_COUPLING) -> str:
    """SFT example `index`'s response: a random shortest walk, flawed with `flaw_probability` of its shape."""
    rng = Random(f"grid/{seed}/sft/{index}")
    order = shortest_walk(walk, rng)
    return render(flawed_walk(walk, rng, order) if rng.random() < flaw_probability(order, flaw_fraction, coupling)
                  else order)


def rows(walks: list[Walk]) -> list[dict]:
    """Rows in covrl's file layout (common/datasets.py): prompt, reward_model.ground_truth, data_source."""
    return [{"prompt": w.question, "reward_model": {"ground_truth": w.answer}, "data_source": DATA_SOURCE,
             "level": w.distance} for w in walks]


def write_walks(walks: list[Walk], path: Path) -> None:
    """The walks as a .jsonl or .parquet file (common/datasets.py write_rows). Parquet is zstd-compressed, as the
    base model keeps its walks: every ground truth repeats the ice, which the compression stores about once (train:
    34 KB instead of 0.8 MB of jsonl, within the GPU kit's travel budget)."""
    write_rows(rows(walks), str(path), compression="zstd", level=19)
