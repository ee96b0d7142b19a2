"""End-to-end runs of launch/cluster.py on CPU: real processes, sockets, gloo groups, DeepSpeed."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file
from torch.testing import assert_close

from common.checkpoint_dirs import GOOD, MANIFEST, complete_checkpoints, verify
from common.metrics import read_metrics
from tests.helpers.paths import BASE_MODEL, REPO
from tests.helpers.runs import EVAL, SMALL, VOLATILE, launch, start, wait_for_steps

pytestmark = pytest.mark.slow


def test_four_generators_four_learners(tmp_path):
    """Acceptance 2 + 4: 6 steps, every rank trains every step, every generator gets every version."""
    run = tmp_path / "r"
    launch(run, "--gens", "4", "--learners", "4", "--steps", "6", *SMALL)
    rows = read_metrics(str(run))
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert all(r["learner/ranks_participating"] == 4 for r in rows)
    assert all(r["staleness/max"] <= 1 for r in rows)  # default max_staleness_steps = 1
    learner_sums = {int(r["weights/version"]): r["weights/checksum"] for r in rows}
    assert len(set(learner_sums.values())) > 1, "weights never changed: nothing was trained"
    for g in range(4):
        with open(run / "generators" / f"gen{g}.jsonl") as f:
            got = [json.loads(line) for line in f]
        assert [e["version"] for e in got] == [1, 2, 3, 4, 5, 6]
        for e in got:
            assert e["checksum"] == learner_sums[e["version"]]
    for key in ("actor/entropy", "actor/cov_mean", "actor/pg_loss", "actor/pg_clipfrac", "actor/grad_norm",
                "actor/is_weight_mean", "critic/score/mean", "response_length/mean", "staleness/mean",
                "staleness/max", "perf/gen_tokens_per_s", "perf/learner_tokens_per_s", "timing_s/step",
                "timing_s/weight_sync"):
        assert all(r.get(key) is not None for r in rows), key
    assert os.listdir(run / "tb")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ckpt = run / "checkpoints" / "step_6"
    model = AutoModelForCausalLM.from_pretrained(ckpt)
    AutoTokenizer.from_pretrained(ckpt)
    assert sum(p.numel() for p in model.parameters()) > 0


@pytest.mark.parametrize("learners, micro_tokens", [pytest.param(1, 4096, marks=pytest.mark.long), (2, 64)])
def test_staleness_zero_equals_synchronous_reference(tmp_path, learners, micro_tokens):
    """Acceptance 3: same seed, k = 0, one generator: the async run ends where the sync loop does.

    With 2 ranks and tiny micro-batches it also shows the token-mean loss is invariant to how the
    batch is split over ranks and micro-batches (the reference runs one rank, one micro-batch).
    """
    run = tmp_path / "async"
    sets = [*SMALL, "--set", "rollout.max_staleness_steps=0", "--set", "rollout.groups_per_request=8",
            "--set", "learner.lr=1e-4", "--set", "learner.filter.dynamic_sampling=false"]
    launch(run, "--gens", "1", "--learners", str(learners), "--steps", "3", *sets,
           "--set", f"learner.micro_batch_tokens={micro_tokens}")
    assert all(r["staleness/max"] == 0 for r in read_metrics(str(run)))
    out = tmp_path / "ref.safetensors"
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(_port()), "PYTHONPATH": REPO}
    p = subprocess.run([sys.executable, os.path.join(REPO, "tests", "integration", "reference_loop.py"), str(run), str(out),
                        "--micro-batch-tokens", "100000"],
                       capture_output=True, text=True, timeout=600, env=env, cwd=REPO)
    assert p.returncode == 0, p.stderr[-3000:]
    ref = load_file(str(out))
    got = load_file(str(run / "checkpoints" / "step_3" / "model.safetensors"))
    base = load_file(os.path.join(BASE_MODEL, "model.safetensors"))
    assert any(not torch.equal(got[k], base[k]) for k in base), "nothing trained: the comparison would be vacuous"
    for k in got:
        assert_close(got[k], ref[k], msg=lambda m: f"{k}: {m}")


def test_staleness_bound_holds_with_two_generators(tmp_path):
    """Acceptance 3b: with k = 2 no trained token is more than 2 versions old."""
    run = tmp_path / "k2"
    launch(run, "--gens", "2", "--learners", "1", "--steps", "6", *SMALL, "--set", "rollout.max_staleness_steps=2",
           "--set", "rollout.groups_per_request=2")
    rows = read_metrics(str(run))
    assert len(rows) == 6 and all(r["staleness/max"] <= 2 for r in rows)
    assert max(r["staleness/max"] for r in rows) >= 1, "the run never went off-policy: the bound was not exercised"


def test_bad_config_fails_before_anything_starts(tmp_path):
    p = subprocess.run([sys.executable, os.path.join(REPO, "launch", "cluster.py"), "--run-dir", str(tmp_path / "x"),
                        "--set", "rollout.group_size=1"], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert p.returncode == 2 and "rollout.group_size" in p.stderr
    assert not (tmp_path / "x" / "logs").exists()


def _port():
    from common.transport import free_port

    return free_port()


def test_sigterm_stops_every_process_it_started_and_tensorboard_serves_the_run(tmp_path):
    """docs/DESIGN.md section 2: Ctrl-C / SIGTERM stops everything the launcher started, and nothing else (SIGUSR1
    before it prints the launcher's stacks and changes nothing);
    `--tensorboard` serves the run's scalars while it trains, and is stopped with it (one of the processes the
    launcher started), printing the command that reopens it."""
    import signal
    import time
    import urllib.request

    import psutil

    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    run = tmp_path / "term"
    p = start(run, "--gens", "2", "--learners", "2", "--steps", "500", "--tensorboard", *SMALL)
    try:
        first = p.stdout.readline()
        assert first.startswith("TensorBoard: http://127.0.0.1:"), first
        url = first.split()[1]
        tags, deadline = "", time.time() + 120
        while "actor/entropy" not in tags and time.time() < deadline and p.poll() is None:
            try:
                tags = urllib.request.urlopen(url + "data/plugin/scalars/tags", timeout=5).read().decode()
            except OSError:
                pass
            time.sleep(1)
        assert "actor/entropy" in tags and "critic/score/mean" in tags
        wait_for_steps(run, 1)
        family = psutil.Process(p.pid).children(recursive=True)
        assert len(family) >= 5  # 2 learners + 2 generators + TensorBoard (+ reward workers)
        p.send_signal(signal.SIGUSR1)  # every thread's stack on stderr (for a launcher that seems stuck); it goes on
        time.sleep(1)
        assert p.poll() is None
        at_signal = len(read_metrics(str(run)))
        p.send_signal(signal.SIGTERM)
        out, err = p.communicate(timeout=120)
        assert p.returncode == 130 and "stopping every process" in err
        assert "Current thread 0x" in err and 'launch/supervisor.py", line' in err, err[-2000:]
        # Not at a terminal: TensorBoard is stopped with the run, and the command that reopens it is printed.
        assert "TensorBoard stopped; reopen it with: " in out and f"--logdir {run}/tb" in out
        # Graceful: the learners finished their step and wrote a checkpoint before anything was stopped.
        (step, path), = complete_checkpoints(str(run))
        assert step >= at_signal and f"checkpoint of step {step} written" in (run / "logs" / "learner0.log").read_text()
        assert f"continue with covrl resume {run}" in out
        gone, alive = psutil.wait_procs(family, timeout=10)
        assert not alive, f"orphans left: {[a.pid for a in alive]}"
        assert bystander.poll() is None  # a process it did not start is untouched
    finally:
        if p.poll() is None:
            p.kill()
        bystander.kill()


def test_a_run_explains_itself_and_a_finished_run_is_not_restarted(tmp_path):
    """Off a terminal the progress is plain lines (no carriage returns or escape codes) with step / total, the eval
    step while it runs, elapsed and ETA; the run ends with RUN_DIR/plots; --resume of the finished run says it is
    complete and starts nothing."""
    import re

    run = tmp_path / "explained"
    cmd = [sys.executable, os.path.join(REPO, "launch", "cluster.py"), "--run-dir", str(run), "--steps", "4",
           "--progress-every", "0.2", *EVAL]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "\r" not in p.stdout and "\x1b" not in p.stdout
    lines = [ln for ln in p.stdout.splitlines() if re.match(r"^step \d+/4 \| ", ln)]
    assert len(lines) >= 3 and all("elapsed " in ln for ln in lines)
    assert any("evaluating step 0" in ln for ln in lines)  # the base model's evaluation, before step 1
    assert any(re.search(r"\| ETA \d+s", ln) for ln in lines)
    assert lines[-1].startswith("step 4/4 | reward ") and "eval acc arith_easy " in lines[-1]
    assert "  data: 128 training prompts" in p.stdout and "  eval: arith_easy 16, arith_hard 16" in p.stdout
    pngs = sorted(os.listdir(run / "plots"))
    assert pngs == ["acc_vs_entropy.png", "entropy.png", "eval_acc.png", "response_length.png", "reward.png"]
    assert all((run / "plots" / f).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for f in pngs)
    assert f"plots: {run}/plots/" in p.stdout
    logs = {f: (run / "logs" / f).stat() for f in os.listdir(run / "logs")}
    again = subprocess.run([sys.executable, os.path.join(REPO, "launch", "cluster.py"), "--resume", str(run)],
                           capture_output=True, text=True, timeout=120, cwd=REPO)
    assert again.returncode == 0 and "is complete: it trained 4 of 4 steps" in again.stdout, again.stdout + again.stderr
    assert "--steps N" in again.stdout
    after = {f: (run / "logs" / f).stat() for f in os.listdir(run / "logs")}
    assert after.keys() == logs.keys() and all(after[f].st_mtime_ns == logs[f].st_mtime_ns for f in logs)  # no role ran


def evaluated_run(run_dir) -> list[dict]:
    launch(run_dir, "--gens", "1", "--learners", "1", "--steps", "4", *EVAL)
    return read_metrics(str(run_dir))


def test_evaluation_rows_at_versions_0_2_4(tmp_path):
    """In-training evaluation in the async pipeline (staleness 1): the base model's row at step 0, then versions 2
    and 4, each data source with every eval metric. That such a run writes the same numbers twice is checked by
    test_recorded_runs.py's kl_cov_par_eval (evaluation, staleness 1, to the bit) here, and by the two-run case below
    in `make bench`."""
    a = evaluated_run(tmp_path / "a")
    assert [r["step"] for r in a] == [0, 1, 2, 3, 4]  # one row per step; step 0 is the base model's eval
    assert set(a[0]) == {"step", *(f"eval/{ds}/{m}" for ds in ("arith_easy", "arith_hard")
                                   for m in ("acc", "pass@k", "response_length", "score_failures", "entropy",
                                             "entropy_per_response"))}
    for v in (0, 2, 4):
        assert 0 <= a[v]["eval/arith_easy/acc"] <= a[v]["eval/arith_easy/pass@k"] <= 1
        # arith_hard is greedy here (temperature 0: one sample), so avg@k and pass@k coincide.
        assert a[v]["eval/arith_hard/acc"] == a[v]["eval/arith_hard/pass@k"]
    assert a[0]["eval/arith_easy/acc"] > 0.2, "the warm-started base model should solve some easy problems"
    assert not any(k.startswith("eval/") for k in a[1]) and not any(k.startswith("eval/") for k in a[3])
    assert max(r["staleness/max"] for r in a[1:]) == 1  # the run was off-policy, not a synchronous loop


@pytest.mark.long
def test_same_seed_same_numbers_with_evaluation(tmp_path):
    """Determinism with in-training evaluation: two runs of the async pipeline (staleness 1) with evaluation at
    versions 0, 2, 4 write identical metrics, timings aside."""
    a, b = evaluated_run(tmp_path / "a"), evaluated_run(tmp_path / "b")
    strip = lambda r: {k: v for k, v in r.items() if not k.startswith(VOLATILE)}  # noqa: E731
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for ra, rb in zip(a, b):
        assert strip(ra) == strip(rb), f"step {ra['step']} differs"


def test_zero3_publishes_and_checkpoints_gathered_parameters(tmp_path):
    """ZeRO-3 on the learner: each rank holds shards; publishing gathers them bucket by bucket, the
    generator receives exactly what the learner fingerprints, and training matches ZeRO-1 on the same data."""
    sets = [*SMALL, "--set", "rollout.max_staleness_steps=0", "--set", "learner.filter.dynamic_sampling=false"]
    ckpts = {}
    for stage in (1, 3):
        run = tmp_path / f"zero{stage}"
        launch(run, "--gens", "1", "--learners", "2", "--steps", "3", *sets, "--set", f"learner.zero_stage={stage}")
        rows = read_metrics(str(run))
        with open(run / "generators" / "gen0.jsonl") as f:
            got = {e["version"]: e["checksum"] for e in map(json.loads, f)}
        assert got == {int(r["weights/version"]): r["weights/checksum"] for r in rows}, stage
        ckpts[stage] = load_file(str(run / "checkpoints" / "step_3" / "model.safetensors"))
        # The manifest covers every rank's own files (ZeRO-3: each rank's module shard too), and they verify.
        files = json.load(open(run / "checkpoints" / "step_3" / MANIFEST))["files"]
        per_rank = {f"deepspeed/zero_pp_rank_{r}_mp_rank_00_{kind}_states.pt" for r in (0, 1)
                    for kind in (("optim", "model") if stage == 3 else ("optim",))}
        assert per_rank <= files.keys() and {"rng/rank_0.pt", "rng/rank_1.pt", "model.safetensors"} <= files.keys()
        assert verify(str(run / "checkpoints" / "step_3")).state == GOOD
    base = load_file(os.path.join(BASE_MODEL, "model.safetensors"))
    assert ckpts[3].keys() == ckpts[1].keys() == base.keys()
    assert any(not torch.equal(ckpts[3][k], base[k]) for k in base), "nothing trained under ZeRO-3"
    for k in base:  # the same updates; ZeRO-3 reduces gradients in another order, so not to the bit
        assert_close(ckpts[3][k], ckpts[1][k], rtol=1e-4, atol=1e-6, msg=lambda m: f"{k}: {m}")
