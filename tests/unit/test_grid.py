"""The grid task (the entropy-mechanism study's regime) and its verifier: walks are graded as shortest paths, the
task is deterministic and held out, every move is one token, and a bad ground truth is refused before a run."""

from __future__ import annotations

import itertools
import json
from collections import Counter
from random import Random

import pytest

from common.config import ConfigError, load_config
from common.datasets import DatasetError, read_records
from common.gridpath import ground_truth, parse_ground_truth, walk_score
from common.rewards import RewardPool
from study.grid import (DATA_SOURCE, EVAL_SIZE, MAX_MOVES, MIN_MOVES, SIZE, GridTask, Walk, all_walks, flawed_walk,
                        inside, render, sft_text, shortest_walk, write_walks)

TRUTH = "(3,7)->(9,1) on 10x10"  # 6 right, 6 up


def no_ice(walk: Walk) -> str:
    """The walk's ground truth without the task's ice: is it a shortest walk at all?"""
    return ground_truth(walk.start, walk.goal, (SIZE, SIZE))


def test_a_shortest_walk_scores_one_in_any_order():
    for moves in ("R U R U U R R U U R U R", "R R R R R R U U U U U U", "U U U U U U R R R R R R"):
        assert walk_score(" " + moves, TRUTH) == (True, 1.0)


@pytest.mark.parametrize("moves, well_formed", [
    ("R U R U U R R U U R U", True),  # one move short: the goal is missed
    ("R U R U U R R U U R U R R L", True),  # a detour: the goal is reached two moves late
    ("R U R U U R R U U R U L", True),  # a swap: a wrong move in a walk of the right length
    ("D D D R U R U U R R U U R U R", True),  # three moves too many (and off the grid at y = 10)
    ("R U R U U R R U U R U R x", False),  # a word that is not a move
    ("The answer is \\boxed{12}", False),
    ("", False),
])
def test_anything_but_a_shortest_walk_scores_zero(moves, well_formed):
    assert walk_score(moves, TRUTH) == (well_formed, 0.0)


def test_only_the_shortest_length_scores_even_when_the_walk_ends_on_the_goal():
    assert walk_score(" R R D D", "(0,0)->(2,2) on 3x3") == (True, 1.0)
    assert walk_score(" L R R R D D", "(0,0)->(2,2) on 3x3") == (True, 0.0)  # on the goal, two moves late


@pytest.mark.parametrize("bad", ["12", "(3,7)->(9,1)", "(3,7)->(10,1) on 10x10", "(3,7)->(9,1) on 0x10", ""])
def test_a_bad_ground_truth_is_named(bad):
    with pytest.raises(ValueError, match="grid_path ground truth|outside"):
        parse_ground_truth(bad)


def test_ground_truth_round_trips():
    assert parse_ground_truth(ground_truth((3, 7), (9, 1), (10, 10))) == ((3, 7), (9, 1), (10, 10), frozenset())
    ice = {(4, 7), (8, 2), (0, 0)}
    assert ground_truth((3, 7), (9, 1), (10, 10), ice) == "(3,7)->(9,1) on 10x10 ice 0,0 4,7 8,2"
    assert parse_ground_truth(ground_truth((3, 7), (9, 1), (10, 10), ice))[3] == frozenset(ice)


@pytest.mark.parametrize("bad", ["(3,7)->(9,1) on 10x10 ice", "(3,7)->(9,1) on 10x10 ice 4,7,",
                                 "(3,7)->(9,1) on 10x10 ice 10,2"])
def test_a_bad_ice_list_is_named(bad):
    with pytest.raises(ValueError, match="grid_path ground truth|outside"):
        parse_ground_truth(bad)


def test_a_walk_fails_when_it_turns_on_ice_and_only_then():
    truth = "(0,0)->(2,2) on 3x3 ice 2,0 1,1"
    assert walk_score(" R R D D", truth) == (True, 0.0)  # turns at (2,0): ice
    assert walk_score(" D D R R", truth) == (True, 1.0)  # turns at (0,2)
    assert walk_score(" R D R D", truth) == (True, 0.0)  # turns at (1,0), (1,1): ice, (2,1)
    assert walk_score(" D R R D", truth) == (True, 1.0)  # turns at (0,1) and (2,1); passes (1,1) going straight
    assert walk_score(" R R D D", "(0,0)->(2,2) on 3x3 ice 1,0 2,1") == (True, 1.0)  # straight over ice is fine


def test_the_tasks_ice_is_fixed_hidden_and_makes_turns_cost():
    from study.grid import ICE, ice_cells

    assert ICE == ice_cells() and len(ICE) == 24 and (0, 0) in ICE and (9, 2) in ICE
    walks = all_walks()
    assert all(w.answer.endswith(" ice " + " ".join(f"{x},{y}" for x, y in sorted(ICE))) for w in walks[:50])
    assert all("ice" not in w.question for w in walks)  # the rule is hidden: the prompt never shows it
    rng = Random(1)
    uniform = sum(walk_score(render(shortest_walk(w, rng)), w.answer)[1] for w in walks) / len(walks)
    l_shaped = sum(walk_score(render(sorted(w.needed(), key=lambda m: m in "UD")), w.answer)[1] for w in walks)
    assert 0.33 < uniform < 0.40 and l_shaped / len(walks) == pytest.approx(0.755, abs=0.02)  # study/grid.py's figures


def test_reward_pool_grades_walks_in_the_caller_with_format_score():
    with RewardPool(1, 5.0, extract="boxed", format_score=0.1, verifier="grid_path") as pool:
        assert pool.worker_pids() == []  # every walk is graded in the caller: no math-verify worker is started
        results = pool.score_batch([(" R U R U U R R U U R U R", TRUTH), (" R U", TRUTH), ("R?", TRUTH), (" R", "12")])
    assert [r.reward for r in results] == [1.0, 0.1, 0.0, 0.0]  # a well-formed wrong walk earns the format score
    assert [r.status for r in results] == ["ok", "ok", "ok", "error"]  # a bad ground truth is an error, not a crash
    with pytest.raises(ValueError, match="verifier"):
        RewardPool(1, 5.0, extract="boxed", format_score=0.0, verifier="walks")


def test_the_task_has_every_walk_once_and_holds_out_its_eval_set():
    walks = all_walks()
    assert len(walks) == len(set(walks)) == 3536
    assert all(MIN_MOVES <= w.distance <= MAX_MOVES and w.start[0] != w.goal[0] and w.start[1] != w.goal[1]
               for w in walks)
    task = GridTask(seed=0)
    held, train = task.eval_sets()[DATA_SOURCE], task.train()
    assert len(held) == EVAL_SIZE and not set(held) & set(train) and len(held) + len(train) == len(walks)
    assert GridTask(seed=0).train() == train and GridTask(seed=1).eval_sets() != task.eval_sets()


def test_random_shortest_walks_are_shortest_and_cover_every_order():
    walk = Walk((0, 0), (2, 2))
    rng = Random(0)
    seen = Counter(render(shortest_walk(walk, rng)) for _ in range(3000))
    assert set(seen) == {render(list(p)) for p in set(itertools.permutations("RRDD"))}  # all 6 orders
    assert min(seen.values()) > 3000 / 6 * 0.8  # uniform: each about 500
    assert all(walk_score(text, no_ice(walk)) == (True, 1.0) for text in seen)


def test_flawed_walks_stay_on_the_grid_and_never_score():
    rng = Random(1)
    for w in GridTask(seed=0).train()[:300]:
        moves = flawed_walk(w, rng)
        assert inside(w, moves) and walk_score(render(moves), w.answer) == (True, 0.0)
        assert len(moves) in (w.distance, w.distance + 2, w.distance + 4)


def test_sft_texts_are_seeded_and_flawed_at_the_asked_rate():
    walks = GridTask(seed=0).train()[:1000]
    texts = [sft_text(w, 0, i, 0.55) for i, w in enumerate(walks)]
    assert texts == [sft_text(w, 0, i, 0.55) for i, w in enumerate(walks)]
    flawed = sum(walk_score(t, no_ice(w))[1] == 0.0 for t, w in zip(texts, walks)) / len(walks)
    assert 0.50 < flawed < 0.60
    assert all(walk_score(sft_text(w, 0, i), no_ice(w)) == (True, 1.0) for i, w in enumerate(walks))  # v4: none


def test_every_move_is_one_token_under_the_study_tokenizer():
    from study.tokenizer import train_bpe_tokenizer

    walks = GridTask(seed=0).train()[:300]
    tok = train_bpe_tokenizer([w.question for w in walks] + [sft_text(w, 0, i) for i, w in enumerate(walks)], 300)
    for w in walks[:20]:
        moves = shortest_walk(w, Random(2))
        assert len(tok(render(moves)).input_ids) == len(moves)


def test_the_files_load_as_a_run_reads_them_and_bad_rows_are_refused(tmp_path):
    walks = GridTask(seed=0).eval_sets()[DATA_SOURCE][:5]
    path = tmp_path / "walks.jsonl"
    write_walks(walks, path)
    records = read_records(str(path))
    assert [r.answer for r in records] == [w.answer for w in walks] and {r.data_source for r in records} == {"grid"}
    cfg = load_config(None, ["data.task=files", f"data.train_files=['{path}']", "reward.verifier=grid_path",
                             "data.instruction="])
    from common.data import PromptSource
    from study.tokenizer import train_bpe_tokenizer

    tok = train_bpe_tokenizer([w.question for w in walks], 300)
    assert len(PromptSource(cfg, tok)) == 5
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "Walk.", "reward_model": {"ground_truth": "7"}}) + "\n")
    cfg = load_config(None, ["data.task=files", f"data.train_files=['{bad}']", "reward.verifier=grid_path"])
    with pytest.raises(DatasetError, match=r"bad.jsonl: row 0: not a grid_path ground truth"):
        PromptSource(cfg, tok)


def test_the_walk_verifier_needs_a_walk_dataset():
    with pytest.raises(ConfigError, match="reward.verifier"):
        load_config(None, ["reward.verifier=grid_path"])  # the built-in arith task has math answers
    assert SIZE == 10


def test_the_committed_base_model_meets_the_plans_targets_and_holds_out_its_walks():
    import os

    from tests.helpers.paths import REPO

    base = os.path.join(REPO, "assets", "grid-base")
    report = json.load(open(os.path.join(base, "warmstart.json")))
    held = report["measured"]["grid"]
    assert 0.30 <= held["accuracy"] <= 0.50 and held["pass@8"] >= 0.8  # docs/study-grid/PLAN.md's targets
    assert held["token_entropy"] >= 0.4 and held["well_formed"] > 0.9
    task = GridTask(seed=report["seed"])
    held_rows = read_records(os.path.join(base, "eval.parquet"))
    assert [r.answer for r in held_rows] == [w.answer for w in task.eval_sets()["grid"]]
    assert [r.answer for r in read_records(os.path.join(base, "train.parquet"))] == [w.answer for w in task.train()]


def test_flaws_follow_the_walks_shape_as_amendments_1_and_2_say():
    from study.grid import MEAN_SWITCH_RATIO, flaw_probability, switch_ratio

    assert switch_ratio(list("RRRUUU")) == pytest.approx(1 / 5) and switch_ratio(list("RURURU")) == 1.0
    assert flaw_probability(list("RURURURURURU"), 0.60, 3.0) == 0.95  # a full zig-zag: clipped
    assert flaw_probability(list("RRRRRRUUUUUU"), 0.55, 0.8) == pytest.approx(0.55 + 0.8 * (1 / 11 - 0.46))  # v2
    assert flaw_probability(list("RRRRRRUUUUUU"), 0.60, 3.0) == 0.05  # v3 (amendment 2): an L-shaped walk, clipped
    assert flaw_probability(list("RURURURURURU")) == flaw_probability(list("RRRRRRUUUUUU")) == 0.0  # v4: no flaws
    assert flaw_probability(list("RURURU"), 0.55, 0.0) == 0.55  # no coupling: the first base model's rule
    rng = Random(3)
    ratios = [switch_ratio(shortest_walk(w, rng)) for w in GridTask(seed=0).train()]
    assert abs(sum(ratios) / len(ratios) - MEAN_SWITCH_RATIO) < 0.01  # the constant is the task's mean


def test_the_entropy_profile_splits_every_sampled_token_by_its_state():
    import os

    from study.grid_entropy import KINDS, profile
    from tests.helpers.paths import REPO

    out = profile(os.path.join(REPO, "assets", "grid-base"), samples=1, limit=12)
    assert sum(out[k]["share"] for k in KINDS) == pytest.approx(1.0, abs=1e-3) and out["tokens"] > 12 * 8
    assert out["tie"]["share"] > 0.2 and 0 < out["tie"]["entropy"] < 1.4 and 0 <= out["tie"]["skew"] <= 1
    assert out["entropy"] == pytest.approx(sum(out[k]["share"] * out[k]["entropy"] for k in KINDS), abs=2e-3)


def test_covrl_warmstart_task_grid_builds_a_base_model_through_its_own_module(tmp_path):
    from study.warmstart_cli import main

    out = tmp_path / "grid-base"
    assert main(["--task", "grid", "--out", str(out), "--steps", "2", "--eval-problems", "2"]) == 0
    report = json.load(open(out / "warmstart.json"))
    assert report["task"] == "grid" and report["steps"] == 2 and set(report["measured"]) == {"train_sample", "grid"}
    assert (out / "model.safetensors").is_file()
    task = GridTask(0)
    assert [r.answer for r in read_records(str(out / "eval.parquet"))] == [w.answer for w in task.eval_sets()["grid"]]
    assert len(read_records(str(out / "train.parquet"))) == len(task.train())
    with pytest.raises(SystemExit):
        main(["--task", "grid", "--flaw-fraction", "1.5"])
