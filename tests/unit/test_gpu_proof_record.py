"""`hardware.proof --record`: finished gpu_proof.json files go into results.json under "gpu_proofs", one record per
device, so a lease on another card adds its row rather than erasing the first card's."""

import json

from hardware.proof import record


def proof(tmp_path, name, device, stages, date="2026-11-27T02:00:00+00:00", **extra):
    doc = {"device": device, "date": date, "git_commit": "abc", "stages": stages, **extra}
    path = tmp_path / name
    path.write_text(json.dumps(doc))
    return str(path)


def stage(passed=True):
    return {"passed": passed, "seconds": 1.0, "figures": {}, "checks": {}, "key_lines": ["x"] * 50}


def test_records_are_kept_per_device_and_the_old_layout_migrates(tmp_path):
    results = tmp_path / "results.json"
    h200 = {"device": "H200", "date": "2026-11-26", "stages": {"vllm-run": stage()}, "all_passed": True}
    results.write_text(json.dumps({"bench": {"x": 1}, "gpu_proof": h200}))
    a = proof(tmp_path, "a.json", "H100", {"tests": stage(), "z3": stage(False)})
    b = proof(tmp_path, "b.json", "H100", {"z3": stage()}, date="2026-11-27T02:11:00+00:00")
    assert record([a, b], force=False, results_path=str(results)) == 0
    doc = json.loads(results.read_text())
    assert "gpu_proof" not in doc and doc["bench"] == {"x": 1}
    assert doc["gpu_proofs"]["H200"] == h200  # another device's record is untouched
    h100 = doc["gpu_proofs"]["H100"]
    assert sorted(h100["stages"]) == ["tests", "z3"] and h100["stages"]["z3"]["passed"]  # the later file wins
    assert h100["all_passed"] and h100["date"] == "2026-11-27T02:11:00+00:00"
    assert len(h100["stages"]["tests"]["key_lines"]) == 40
    # The same device again replaces its record.
    c = proof(tmp_path, "c.json", "H100", {"z1": stage(False)})
    assert record([c], force=False, results_path=str(results)) == 0
    doc = json.loads(results.read_text())
    assert sorted(doc["gpu_proofs"]) == ["H100", "H200"]
    assert list(doc["gpu_proofs"]["H100"]["stages"]) == ["z1"] and not doc["gpu_proofs"]["H100"]["all_passed"]


def test_mixed_devices_and_rehearsals_are_refused(tmp_path, capsys):
    results = tmp_path / "results.json"
    results.write_text("{}")
    a = proof(tmp_path, "a.json", "H100", {"tests": stage()})
    b = proof(tmp_path, "b.json", "H200", {"z1": stage()})
    assert record([a, b], force=False, results_path=str(results)) == 2
    assert "one device per record" in capsys.readouterr().err
    r = proof(tmp_path, "r.json", "cpu", {"z1": stage()}, rehearse_cpu=True)
    assert record([r], force=False, results_path=str(results)) == 2
    assert "CPU rehearsal" in capsys.readouterr().err
    assert json.loads(results.read_text()) == {}


def test_a_record_merged_across_leases_keeps_each_stages_provenance_in_date_order(tmp_path):
    """An earlier record of the same device keeps the stages the new lease did not rerun, each with the commit and
    date it ran at; a rerun stage, the machine's head and the commit are the newest file's, whatever the order the
    files are given in; notes only the earlier record has stay; stamps a stage already carries are kept."""
    results = tmp_path / "results.json"
    results.write_text("{}")
    kept = {**stage(), "date": "2026-11-25T00:00:00+00:00", "git_commit": "older", "git_dirty": False}
    old = proof(tmp_path, "old.json", "H200", {"vllm-kit": stage(), "vllm-run": stage(False), "z1": kept},
                date="2026-11-26T09:00:00+00:00", git_commit="old", git_dirty=True, source_digest="d-old",
                driver="570", notes="written by hand", merged_from=["a run", "another run"], warnings=["w-old"])
    new = proof(tmp_path, "new.json", "H200", {"vllm-run": stage()}, date="2026-11-27T05:00:00+00:00",
                git_commit="new", git_dirty=False, source_digest="d-new", driver="580", warnings=["w-new"])
    assert record([new, old], force=False, results_path=str(results)) == 0
    rec = json.loads(results.read_text())["gpu_proofs"]["H200"]
    kit, run, z1 = rec["stages"]["vllm-kit"], rec["stages"]["vllm-run"], rec["stages"]["z1"]
    assert (kit["git_commit"], kit["date"], kit["git_dirty"], kit["source_digest"]) == (
        "old", "2026-11-26T09:00:00+00:00", True, "d-old")
    assert (run["git_commit"], run["date"], run["git_dirty"], run["passed"]) == (
        "new", "2026-11-27T05:00:00+00:00", False, True)
    assert (z1["git_commit"], z1["date"]) == ("older", "2026-11-25T00:00:00+00:00")
    assert (rec["git_commit"], rec["git_dirty"], rec["source_digest"], rec["driver"]) == ("new", False, "d-new", "580")
    assert rec["date"] == "2026-11-27T05:00:00+00:00" and rec["notes"] == "written by hand"
    assert rec["merged_from"] == ["a run", "another run", "vllm-run run 2026-11-27T05:00:00+00:00"]
    assert rec["warnings"] == ["w-new", "w-old"] and rec["all_passed"]


def test_a_zero3_vllm_run_of_the_old_option_is_filed_as_vllm_z3(tmp_path):
    results = tmp_path / "results.json"
    results.write_text("{}")
    z3 = {**stage(), "figures": {"zero_stage": 3}}
    a = proof(tmp_path, "a.json", "H200", {"vllm-run": stage()}, date="2026-11-26T00:00:00+00:00")
    b = proof(tmp_path, "b.json", "H200", {"vllm-run": z3}, date="2026-11-27T00:00:00+00:00")
    assert record([a, b], force=False, results_path=str(results)) == 0
    rec = json.loads(results.read_text())["gpu_proofs"]["H200"]
    assert sorted(rec["stages"]) == ["vllm-run", "vllm-z3"]
    assert rec["stages"]["vllm-z3"]["figures"]["zero_stage"] == 3 and "zero_stage" not in rec["stages"]["vllm-run"]["figures"]


def test_the_learner_stage_lands_with_its_per_variant_figures_and_a_cut_one_is_not_passed(tmp_path):
    """The learner stage's figures (per shape, per variant, per budget) go into the record as they are; a command
    stopped mid-stage leaves the stage in progress (hardware/proof.py partial_writer): kept with what it measured,
    never counted as passed."""
    results = tmp_path / "results.json"
    results.write_text("{}")
    budget = {"micro_batch_tokens": 8192, "tokens_per_s": 52000.0, "mfu": 0.16, "speedup": 1.36,
              "peak_allocated_gib": 21.5, "profile": {"attention_s": 0.1, "head_s": 0.2, "optimizer_s": 0.05,
                                                      "body_s": 0.4, "total_s": 0.75}}
    figures = {"baseline": "sdpa-chunked", "shapes": {"0.5b": {"variants": {
        "sdpa-chunked": {"status": "measured", "budgets": [{**budget, "speedup": 1.0}]},
        "varlen-fused": {"status": "measured", "budgets": [budget], "agreement": {"flagged": []}},
        "varlen-fused-compile": {"status": "not_run", "reason": "the stage's time for this shape was spent"}}}}}
    done = {**stage(), "figures": figures}
    a = proof(tmp_path, "a.json", "H200", {"learner": done, "vllm-kit": stage()}, date="2026-11-28T01:00:00+00:00")
    assert record([a], force=False, results_path=str(results)) == 0
    rec = json.loads(results.read_text())["gpu_proofs"]["H200"]
    assert rec["stages"]["learner"]["figures"] == figures and rec["all_passed"]
    cut = {**stage(False), "in_progress": "the stage was still running when this was written: its figures so far",
           "figures": figures}
    b = proof(tmp_path, "b.json", "H200", {"learner": cut}, date="2026-11-28T02:00:00+00:00")
    assert record([a, b], force=False, results_path=str(results)) == 0
    rec = json.loads(results.read_text())["gpu_proofs"]["H200"]
    assert rec["stages"]["learner"]["in_progress"] and rec["stages"]["learner"]["figures"] == figures
    assert not rec["all_passed"] and rec["stages"]["vllm-kit"]["passed"]
