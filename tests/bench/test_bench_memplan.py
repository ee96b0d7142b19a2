"""The memory plan against a real run on the CPU: the plan's host-side terms (common/memplan.py, `covrl plan`) vs the
measured peak RSS of the built-in model's learner and generator, at two ZeRO stages.

The run: launch/cluster.py --gens 1 --learners 1, the built-in `arith` model at covrl's defaults, `STEPS` steps,
evaluation off, `learner.zero_stage` = 0 and 2 (0: plain DDP-style AdamW; 2: gradients and optimizer states
partitioned, over one rank). The measure: each role process's `VmHWM` (the kernel's peak RSS over its life,
/proc/<pid>/status; tests/helpers/rss.py), read until it exits; beside it, the largest summed RSS of the role's
process tree at one 50 ms sample (a lower bound on the tree's peak).

The plan: `memplan.plan(cfg, shape, 1, 1, 1, Machine(gpus=0, ...))` for the same config: its one `host` device's
terms, "learner 0: ..." summed for the learner and "generator 0: ..." summed for the generator. On the built-in
model (about 1 M parameters) both sums are dominated by the plan's per-process constants (`LEARNER_HOST_BYTES`,
`TORCH_GEN_HOST_BYTES`), so this measures those constants more than the formulas (the activation formula is checked
against what autograd saves in tests/unit/test_memplan.py); the record also gives the constant that would make each
role's plan equal the measured peak (measured - the plan's other terms). History: the first run (2026-12-07) found
the learner at 0.26-0.28 of a plan built on a 2 GiB guess and the generator at 0.83; the CPU constants were then
calibrated from that run and a second one (learner 560 MiB, generator 400 MiB), so later runs check that they
hold, not that the plan predicts them.

Target: each role's measured peak within 15 % of its plan (0.85 <= measured / plan <= 1.15), at both stages. The
test asserts that the runs completed and were measured, not the target; the record says met / NOT MET.
"""

from __future__ import annotations

from common import memplan
from common.config import load_config
from tests.bench.common import record, verdict
from tests.helpers.pipeline_clock import launch_clocked
from tests.helpers.rss import RoleRSS

STEPS = 3
STAGES = (0, 2)
TOLERANCE = 0.15
CONSTANT = {"learner": ("LEARNER_HOST_BYTES['cpu']", memplan.LEARNER_HOST_BYTES["cpu"]),
            "generator": ("TORCH_GEN_HOST_BYTES", memplan.TORCH_GEN_HOST_BYTES)}
MiB = 1 << 20


def sets_for(stage: int) -> list[str]:
    return ["eval.every_steps=0", "learner.filter.dynamic_sampling=false", f"learner.zero_stage={stage}"]


def planned(sets: list[str]) -> dict[str, dict]:
    """{role: {"bytes", "terms"}} from the plan's host device for this config, on a machine without GPUs."""
    cfg = load_config(None, sets)
    p = memplan.plan(cfg, memplan.shape_of(cfg.model.path), 1, 1, 1,
                     memplan.Machine(gpus=0, gpu_bytes=None, host_bytes=None))
    (host,) = [d for d in p.devices if d.name == "host"]
    out = {}
    for role, prefix in (("learner", "learner 0: "), ("generator", "generator 0: ")):
        terms = {t.name[len(prefix):]: t.bytes for t in host.terms if t.name.startswith(prefix)}
        out[role] = {"bytes": sum(terms.values()), "terms": terms}
    return out


def test_memplan_host_terms_vs_measured_rss(tmp_path):
    stages, met_all = {}, True
    for stage in STAGES:
        sets = sets_for(stage)
        plan = planned(sets)
        with RoleRSS() as m:
            run = launch_clocked(str(tmp_path / f"zero{stage}"), sets, STEPS, timeout_s=240)
        assert len(run["rows"]) == STEPS, f"ZeRO-{stage}: {len(run['rows'])} metrics rows of {STEPS}"
        peaks = m.peaks()
        roles = {}
        for role in ("learner", "generator"):
            assert role in peaks and peaks[role]["hwm_bytes"] > 0, f"ZeRO-{stage}: no {role} process measured: {peaks}"
            measured, want = peaks[role]["hwm_bytes"], plan[role]["bytes"]
            ratio = measured / want
            met = abs(ratio - 1) <= TOLERANCE
            met_all &= met
            name, value = CONSTANT[role]
            roles[role] = {
                "measured_peak_rss_mib": round(measured / MiB, 1),
                "measured_tree_peak_rss_mib": round(peaks[role]["tree_peak_bytes"] / MiB, 1),
                "plan_mib": round(want / MiB, 1),
                "measured_over_plan": round(ratio, 3),
                "plan_terms_mib": {k: round(v / MiB, 2) for k, v in plan[role]["terms"].items()},
                "implied_constant": {name: f"{(measured - (want - value)) / MiB:.0f} MiB (plan: {value / MiB:.0f} MiB)"},
                "verdict": verdict(met),
            }
            print(f"ZeRO-{stage} {role}: measured peak RSS {measured / MiB:.0f} MiB, plan {want / MiB:.0f} MiB, "
                  f"ratio {ratio:.2f} ({verdict(met)}); {name} that would match: "
                  f"{(measured - (want - value)) / MiB:.0f} MiB")
        stages[f"zero{stage}"] = {"wall_s": round(run["wall_s"], 1), **roles}
    record("memplan_cpu", {
        "workload": f"built-in arith model, defaults, --gens 1 --learners 1, {STEPS} steps, eval off, CPU",
        "measure": "VmHWM of each role process (/proc/<pid>/status) vs the sum of the plan's host terms for "
                   "'learner 0: ...' / 'generator 0: ...' (common/memplan.py, Machine(gpus=0))",
        "stages": stages,
        "target": f"measured peak RSS within {TOLERANCE:.0%} of the plan, each role, each stage",
        "verdict": verdict(met_all),
    })
