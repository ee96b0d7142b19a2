"""The benchmark table of docs/benchmarks.md and the README's headline figures, rendered from
tests/bench/results.json (so the text and the results cannot disagree).

    python tests/bench/readme_table.py            print the table and the headline figures
    python tests/bench/readme_table.py --write    replace both between their markers (`make bench` runs this last)
    python tests/bench/readme_table.py --check    exit 1 if either page holds something else

tests/unit/test_readme.py checks that both pages hold exactly what this renders.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
RESULTS = os.path.join(HERE, "results.json")
README = os.path.join(REPO, "README.md")
BENCHMARKS = os.path.join(REPO, "docs", "benchmarks.md")
BEGIN, END = "<!-- bench-table:begin -->", "<!-- bench-table:end -->"
HEAD_BEGIN, HEAD_END = "<!-- bench-headline:begin -->", "<!-- bench-headline:end -->"


def _x(v: float) -> str:
    return f"{v:.2f}x"


def _row(name: str, measured: str, r: dict) -> str:
    return f"| {name} | {measured} | {r['target']} | {r['verdict']} ({r['date']}) |"


def rows(res: dict) -> list[str]:
    out = []
    if r := res.get("transport"):
        out.append(_row(
            "1. transport: 8 x 2048-token rollout groups over loopback TCP vs raw ZeroMQ bytes",
            f"{r['groups_per_s']['covrl']:.0f} vs {r['groups_per_s']['raw_zmq']:.0f} msgs/s "
            f"({r['mb_per_s']['covrl']:.0f} vs {r['mb_per_s']['raw_zmq']:.0f} MB/s) = {r['ratio_vs_raw_zmq']:.2f} of raw; "
            f"per message HMAC-SHA256 {r['cpu_us_per_message']['hmac_sha256']:.0f} us (each side), "
            f"check {r['cpu_us_per_message']['check_rollout']:.0f} us, raw ZeroMQ {r['raw_us_per_message']:.0f} us", r))
    if r := res.get("pipeline_overlap"):
        out.append(_row(
            "2. pipeline overlap: arith, 1 generator + 1 learner, 1 thread each, async vs synchronous loop",
            f"{r['async_samples_per_s']:.0f} vs {r['sync_samples_per_s']:.0f} samples/s = {_x(r['speedup'])}; the stages "
            f"are unequal (generate {r['sync_stage_s']['generate_and_score']:.2f} s, train "
            f"{r['sync_stage_s']['train_and_load_weights']:.2f} s per step), so overlap can give at most "
            f"{_x(r['overlap_bound'])}: reached {r['fraction_of_bound']:.0%} of that bound", r))
    if r := res.get("weight_sync"):
        out.append(_row(
            "3. weight sync: 256 MiB over the gloo pair channel vs memcpy",
            f"{r['gb_per_s']['sync']:.2f} GB/s = {r['ratio_vs_memcpy']:.3f} of memcpy ({r['gb_per_s']['memcpy']:.1f} GB/s); "
            f"bare gloo broadcast {r['gb_per_s']['bare_gloo']:.2f} GB/s, so ours is {r['ratio_vs_bare_gloo']:.2f} of it; "
            f"demo model ({r['demo_model']['bytes'] / 2**20:.1f} MiB) {r['demo_model']['seconds_per_sync_min'] * 1e3:.0f} ms "
            f"per sync", r))
    if r := res.get("generation"):
        out.append(_row(
            "4. generation: TorchEngine vs transformers `generate`, demo model, 4 prompts x 8 samples x 64 tokens",
            f"{r['tokens_per_s']['engine']:.0f} vs {r['tokens_per_s']['hf_generate']:.0f} tokens/s = "
            f"{_x(r['speedup_vs_hf_generate'])}; logprobs within {r['engine_logprob_max_abs_err_vs_forward']:.0e} of a "
            f"fresh forward", r))
    if r := res.get("learner_packing"):
        out.append(_row(
            "5. learner: packed vs padded micro-batches, lognormal lengths up to 512",
            f"{r['real_tokens_per_s']['packed']:.0f} vs {r['real_tokens_per_s']['padded']:.0f} real tokens/s = "
            f"{_x(r['ratio_packed_vs_padded'])} ({r['pad_fraction']:.0%} of the padded slots are padding)", r))
    if r := res.get("losses"):
        q = r["ratio_vs_ppo"]
        out.append(_row(
            "6a. policy losses fwd+bwd at B=64, T=4096 vs `ppo_loss`",
            f"ppo {r['seconds_fwd_bwd']['ppo'] * 1e3:.1f} ms; clip_cov {_x(q['clip_cov'])}, kl_cov {_x(q['kl_cov'])}, "
            f"gspo {_x(q['gspo'])}, cispo {_x(q['cispo'])}", r))
    if r := res.get("chunked_entropy"):
        out.append(_row(
            "6b. logprobs + entropy, 8192 tokens x 152064 vocab: peak memory above the inputs",
            f"chunked {r['peak_extra_mib']['chunked'] / 1024:.2f} GiB vs naive {r['peak_extra_mib']['naive'] / 1024:.1f} GiB "
            f"(ratio {r['ratio']:.3f}); {r['chunked']['seconds']:.0f} s vs {r['naive']['seconds']:.0f} s", r))
    if r := res.get("trl_peer"):
        c, t = r["covrl"], r["trl"]
        fast = r["covrl_without_entropy_delta_pass"]
        out.append(_row(
            f"7. peer: TRL {r['versions_bench_env']['trl']} GRPOTrainer vs covrl, same model, prompts, reward, batch, "
            f"{r['steps']} steps",
            f"steady state {c['s_per_sample_steady'] * 1e3:.1f} vs TRL {t['s_per_sample_steady'] * 1e3:.1f} ms per sample "
            f"(covrl/TRL {1 / r['trl_over_covrl_s_per_sample_steady']:.2f}: "
            f"{'covrl' if r['trl_over_covrl_s_per_sample_steady'] >= 1 else 'TRL'} wins); covrl without the entropy-after "
            f"pass (`learner.log_entropy_delta=false`) {fast['s_per_sample_steady'] * 1e3:.1f} ms "
            f"(covrl/TRL {1 / fast['trl_over_covrl_s_per_sample_steady']:.2f}); reward over the last steps {c['reward_last']:.3f} "
            f"vs {t['reward_last']:.3f}, per-step difference {r['reward_diff_covrl_minus_trl_per_step']['mean']:+.3f} +- "
            f"{r['reward_diff_covrl_minus_trl_per_step']['standard_error']:.3f}", r))
    if r := res.get("generation_heavy"):
        a, L = r["async_vs_sync"], r["response_length"]
        trl = r["vs_trl"]
        vs_trl = (f"TRL not run ({trl['skipped']})" if "skipped" in trl else
                  f"covrl at its defaults {trl['covrl_s_per_sample_steady'] * 1e3:.0f} vs TRL "
                  f"{trl['trl_s_per_sample_steady'] * 1e3:.0f} ms per sample: covrl/TRL {trl['covrl_over_trl_s_per_sample']:.2f}"
                  + (f" (TRL not re-run: the figures of {trl['carried_from']})" if "carried_from" in trl else ""))
        lp, idle = r["loops"], r["idle_per_step_s"]["batch_loop_defaults"]
        fr = lp["fraction_of_bound"]
        loops = (f"covrl at its defaults (the batch loop, a step's groups a Work) "
                 f"{lp['batch_loop_defaults_samples_per_s']:.1f} samples/s, {fr['batch_loop_defaults']:.0%} of the overlap "
                 f"bound (target {a['verdict']}); the same config run again (16 groups a request, the best hand-set value "
                 f"of the loop before) {lp['batch_loop_groups_per_request_16_samples_per_s']:.1f} "
                 f"({fr['batch_loop_groups_per_request_16']:.0%}); the streaming loop (generator.loop stream) "
                 f"{lp['stream_samples_per_s']:.1f} ({fr['stream']:.0%}; {_x(lp['stream_over_best_batch'])} of the batch "
                 f"loop, so \"auto\" takes the batch loop on a CPU); ")
        staleness = f"the streaming loop at staleness 2 {_x(r['staleness_2_vs_1']['ratio'])} of staleness 1; "
        out.append(_row(
            "9. generation-heavy: lognormal response lengths (median 128, sigma 0.9, cap 2048), 1 generator + 1 learner",
            f"mean length {sum(L['mean_per_step']) / len(L['mean_per_step']):.0f} tokens, longest {L['max_over_mean']:.1f}x "
            f"the mean; {loops}async {a['async_samples_per_s']:.1f} vs sync {a['sync_samples_per_s']:.1f} samples/s = "
            f"{_x(a['speedup'])} (bound {_x(a['overlap_bound'])}: generate {a['sync_stage_s']['generate_and_score']:.1f} s, "
            f"train {a['sync_stage_s']['train_and_load_weights']:.1f} s per step); {staleness}idle per step: learner "
            f"{idle['learner_idle_s']:.1f} s, generator {idle['generator_idle_s']:.1f} s of {idle['step_s']:.1f} s; {vs_trl}"
            + (f"; the simulator calibrated with these stage costs predicts {_x(sim['predicted_speedup'])}"
               if (sim := r.get("simulator_calibrated")) else ""),
            r))
    if r := res.get("autoscale"):
        out.append(_row(
            "10. autoscale: the generation-heavy workload from 1 generator under `--autoscale 1:3` (policy defaults) vs "
            "the best fixed count of 1, 2, 3, in the same make bench",
            f"{autoscale_summary(r)}; on paper (the simulator at 64 GPUs, 16 learners, this machine's stage ratio): "
            f"{paper_summary(r['simulated_64_gpus'])}", r))
    if r := res.get("memplan_cpu"):
        cells = "; ".join(f"ZeRO-{k.removeprefix('zero')}: learner {v['learner']['measured_peak_rss_mib']:.0f} vs "
                          f"{v['learner']['plan_mib']:.0f} MiB, generator {v['generator']['measured_peak_rss_mib']:.0f} vs "
                          f"{v['generator']['plan_mib']:.0f} MiB" for k, v in r["stages"].items())
        out.append(_row(
            "11. memory plan on the CPU: the plan's host terms (`covrl plan`) vs each role's measured peak RSS, "
            "built-in model, two ZeRO stages",
            f"{cells} (the per-process constants calibrated from the first two runs of 2026-12-07: this checks they "
            f"hold; the activation formula is checked against autograd in the unit tests)", r))
    if r := res.get("soak"):
        f, lf = r["faults"], r["learner_freeze"]
        out.append(_row(
            "12. soak: 2 learner ranks + 3 generators for about 10 minutes under random faults (generators SIGKILLed "
            "or SIGSTOPped every 5-12 s, learner rank 1 frozen once), deadlines of seconds",
            f"{r['steps']} steps in {r['minutes']:.1f} min; {f['generator_killed']} generators killed, "
            f"{f['generator_frozen']} frozen, {r['set_aside']} slot(s) set aside; the frozen learner rank ended the run "
            f"{lf['ended_after_s']:.0f} s after the freeze (bound {lf['bound_s']} s), the resumed run back at its step "
            f"{lf['back_at_its_step_after_s']:.0f} s after it; time lost about {r['lost_s_per_generator_fault']:.1f} s "
            f"per generator fault against the fault-free pace of {r['baseline_s_per_step']:.2f} s/step (coarse); every "
            f"step once: {r['every_step_once']}, ledger 0 / 0: {r['ledger_zero']}", r))
    if r := res.get("simulate"):
        k = r["speedup_vs_colocated_sync_min_max_by_k"]
        out.append(_row(
            "8. simulator: G generators + L learners (16-128 devices), heavy-tailed lengths, staleness k",
            "predicted speedup over colocated sync: " + ", ".join(f"k={key} {lo:.2f}-{hi:.2f}x" for key, (lo, hi) in
                                                                 k.items()) + "; reported: AReaL up to 2.77x, PipelineRL "
            "about 2x", r))
    return out


def autoscale_summary(r: dict) -> str:
    moves = ", ".join(f"{d['kind']} {d['before']}->{d['after']} at step {d['step']}" for d in r["autoscale"]["decisions"]
                      if d["kind"] in ("up", "down", "undo", "gave_up", "kept")) or "no change"
    best = r["fixed"][str(r["best_fixed"])]["samples_per_s"]
    return (f"steady {r['autoscale']['steady_samples_per_s']:.1f} vs {best:.1f} samples/s at {r['best_fixed']} fixed "
            f"= {r['ratio']:.2f} ({r['whole_run_ratio']:.2f} over the whole run, exploring included); fixed 1/2/3: "
            + "/".join(f"{r['fixed'][g]['samples_per_s']:.1f}" for g in sorted(r["fixed"])) + f"; decisions: {moves}")


def paper_summary(p: dict) -> str:
    def one(q: dict) -> str:
        return (f"ends at {q['settled_at']} generators (its last change at step {q['settled_from_step']} of 300), "
                f"{q['ratio']:.2f} of the "
                f"best fixed count's samples/s at {q['samples_per_s_per_gpu']['settled'] / q['samples_per_s_per_gpu']['best_fixed']:.1f}x "
                f"its samples/s per GPU")
    return (f"at its defaults it {one(p)}, the best fixed count being {p['best_fixed']} generators; with min_gain "
            f"0.05 it {one(p['min_gain_0.05'])}")


def table(res: dict) -> str:
    head = ["| benchmark | measured | target | verdict (date) |", "|---|---|---|---|"]
    return "\n".join([f"Machine: {res.get('machine', '?')}, no GPU, one torch thread per role.", "", *head, *rows(res)])


def block(res: dict) -> str:
    return f"{BEGIN}\n{table(res)}\n{END}"


def headline(res: dict) -> str:
    """The few figures the README keeps, each from the row of the full table it summarises."""
    peer, heavy, overlap = res["trl_peer"], res["generation_heavy"], res["pipeline_overlap"]
    sync, transport = res["weight_sync"], res["transport"]
    a, trl = heavy["async_vs_sync"], heavy["vs_trl"]
    return "\n".join([
        f"- **Against TRL {peer['versions_bench_env']['trl']}** (GRPOTrainer, same model, prompts, reward and batch): "
        f"{peer['covrl']['s_per_sample_steady'] * 1e3:.1f} vs {peer['trl']['s_per_sample_steady'] * 1e3:.1f} ms per "
        f"training sample on `arith` (covrl/TRL {1 / peer['trl_over_covrl_s_per_sample_steady']:.2f}); with long, "
        f"heavy-tailed responses {trl['covrl_s_per_sample_steady'] * 1e3:.0f} vs {trl['trl_s_per_sample_steady'] * 1e3:.0f} "
        f"ms (covrl/TRL {trl['covrl_over_trl_s_per_sample']:.2f}).",
        f"- **Asynchrony**: with long, heavy-tailed responses one generator and one learner train {_x(a['speedup'])} the "
        f"samples/s of the synchronous loop (bound {_x(a['overlap_bound'])}"
        + f", {a['fraction_of_bound']:.0%} of it, target {a['verdict']}; the streaming loop "
        f"{_x(heavy['loops']['stream_over_best_batch'])} of the batch loop on a CPU, where \"auto\" does not take it"
        + f"); on `arith`, where training dominates, "
        f"{_x(overlap['speedup'])} (bound {_x(overlap['overlap_bound'])}; target {overlap['verdict']}).",
        f"- **Weight sync**: {sync['gb_per_s']['sync']:.2f} GB/s per 256 MiB over gloo, {sync['ratio_vs_bare_gloo']:.2f} "
        f"of a bare gloo broadcast; **transport**: {transport['ratio_vs_raw_zmq']:.2f} of raw ZeroMQ bytes (target "
        f"{transport['verdict']}: every message is authenticated with HMAC-SHA256).",
        *([f"- **Autoscaling** (from 1 generator, generation-heavy workload): {autoscale_summary(r)} (target "
           f"{r['verdict']}). At 64 GPUs on paper, {paper_summary(r['simulated_64_gpus'])}."]
          if (r := res.get("autoscale")) else []),
    ])


def headline_block(res: dict) -> str:
    return f"{HEAD_BEGIN}\n{headline(res)}\n{HEAD_END}"


def _replace(path: str, begin: str, end: str, new: str) -> str:
    with open(path) as f:
        text = f.read()
    a, b = text.find(begin), text.find(end)
    if a < 0 or b < 0:
        raise SystemExit(f"error: {os.path.relpath(path, REPO)} has no {begin} ... {end} markers")
    return text[:a] + new + text[b + len(end):]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help="write the table into docs/benchmarks.md and the "
                      "headline figures into README.md")
    mode.add_argument("--check", action="store_true", help="exit 1 if either page differs from what results.json "
                      "renders; nothing is written")
    args = parser.parse_args(argv)
    with open(RESULTS) as f:
        res = json.load(f)
    if not (args.write or args.check):
        print(table(res), headline(res), sep="\n\n")
        return 0
    pages = {BENCHMARKS: _replace(BENCHMARKS, BEGIN, END, block(res)),
             README: _replace(README, HEAD_BEGIN, HEAD_END, headline_block(res))}
    stale = []
    for path, new in pages.items():
        with open(path) as f:
            if f.read() == new:
                continue
        stale.append(os.path.relpath(path, REPO))
        if args.write:
            with open(path, "w") as f:
                f.write(new)
    if args.check and stale:
        print(f"stale: {', '.join(stale)}; run `python tests/bench/readme_table.py --write`", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
