"""components/results/study.py: the variants' params and the pooling of held-out episodes into the results table."""
from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path

import pytest

from components.config import ParamsError, load_params
from components.results.study import (
    aggregate,
    claim_verdicts,
    claims_reading,
    claims_table,
    comparisons,
    correction_plot,
    correction_section,
    detectable_difference,
    finished_runs,
    is_finished,
    keep_run,
    kept_runs,
    paired_games,
    plan,
    plan_status,
    read_failures,
    record_failure,
    report,
    run_budget,
    run_overrides,
    select_rows,
    select_variants,
    sign_test,
    stages_not_needed,
    success_plot,
    untested_reasons,
    variants,
    warm_starts,
)
from components.stats import wilson_interval
from dreamgym.cli import main
from tests.conftest import REPO


def _evaluation(successes: int, episodes: int) -> dict:
    """The per-environment numbers evaluate_policies writes (EvaluationResult.metrics)."""
    return {"episodes": episodes, "successes": successes, "success_rate": successes / episodes,
            "success_ci_low": 0.0, "success_ci_high": 1.0, "mean_return": 0.0, "mean_steps": 5.0, "wall_s": 1.0}


def _run(results, name, evaluated, s2r_used=0, synthetic=0, start_from="synthetic_rl"):
    run_dir = results / name
    run_dir.mkdir(parents=True)
    (run_dir / "evaluate_policies.json").write_text(json.dumps(evaluated))
    (run_dir / "sim_to_real.json").write_text(json.dumps({"real_transitions_used": s2r_used,
                                                          "start_from": start_from}))
    (run_dir / "synthetic_rl.json").write_text(json.dumps({"synthetic_transitions": synthetic,
                                                           "experience_model": {"fallback_rate": 0.25},
                                                           "curriculum": {"accepted": synthetic % 2}}))


def test_budgets_follow_the_variant():
    by_name = {v.name: v for v in variants()}
    assert run_overrides(by_name["real-grpo"], 1, 160, 0.1) == {
        "synthetic_rl.algorithm": "grpo", "sim_to_real.start_from": "sft", "seed": 1,
        "sim_to_real.real_transitions": 160, "evaluate.policies": ["sim_to_real"]}
    # the warm start is one policy for every algorithm: its own row plays it, with no sim-to-real budget
    assert run_overrides(by_name["sft-only"], 2, 160, 0.1) == {
        "sim_to_real.start_from": "sft", "seed": 2, "evaluate.policies": ["train_policy_sft"]}
    assert run_overrides(by_name["dreamgym-grpo"], 0, 160, 0.1)["evaluate.policies"] == ["sim_to_real", "synthetic_rl"]
    assert run_overrides(by_name["dreamgym-ppo"], 0, 160, 0.1)["evaluate.policies"] == ["sim_to_real", "synthetic_rl"]
    assert [v.policies for v in variants(("ppo",))][0] == ["train_policy_sft"]
    assert by_name["no-retrieval"].policies == ["synthetic_rl"]  # an ablation's one row: its synthetic RL policy
    # the ablations' rows are GRPO's, whatever algorithm params.yaml names
    assert all(by_name[n].overrides["synthetic_rl.algorithm"] == "grpo" for n in ("no-curriculum", "no-retrieval",
                                                                                  "no-reasoning"))
    assert run_overrides(by_name["dreamgym-ppo"], 0, 160, 0.1)["sim_to_real.real_transitions"] == 16
    assert run_overrides(by_name["no-curriculum"], 0, 160, 0.1)["synthetic_rl.curriculum.enabled"] is False
    assert [v.name for v in variants(("grpo",))] == ["sft-only", "dreamgym-grpo", "real-grpo", "real-grpo-s2r-budget",
                                                      "no-curriculum", "no-retrieval", "no-reasoning", "s2r-correction"]
    # real RL at DreamGym-S2R's budget: from the warm start, as many real transitions as sim-to-real spends
    assert run_overrides(by_name["real-ppo-s2r-budget"], 0, 160, 0.1) == {
        "synthetic_rl.algorithm": "ppo", "sim_to_real.start_from": "sft", "seed": 0,
        "sim_to_real.real_transitions": 16, "evaluate.policies": ["sim_to_real"]}


def test_a_correction_run_spends_dreamgym_s2rs_budget_on_sim_to_real_after_its_last_round_and_the_rest_on_feedback():
    correction = {v.name: v for v in variants()}["s2r-correction"]
    overrides = run_overrides(correction, 2, 336, 0.1, correction_rounds=3, sim_to_real_iteration=28, max_turns=1)
    # the pipeline stages before the rounds have the DreamGym run's params (its warm start and experience model); the
    # pipeline's own synthetic RL, sim-to-real and held-out evaluation do not run (the rounds run their own)
    dreamgym = run_overrides({v.name: v for v in variants()}["dreamgym-grpo"], 2, 336, 0.1)
    del dreamgym["evaluate.policies"]  # a param of the held-out games alone, which the rounds play their own way
    assert {key: overrides[key] for key in dreamgym} == dreamgym
    assert overrides["evaluate.policies"] == ["train_policy_sft"]
    assert stages_not_needed(overrides, correction.target) == ("evaluate_policies", "sim_to_real", "synthetic_rl")
    assert overrides["correction.feedback"] is True and correction.target == "correction_rounds"
    # 33 real transitions: one sim-to-real iteration (28) after the last round, 5 left: 1 a round
    assert overrides["correction.sim_to_real"] == "last_round"
    assert (overrides["correction.real_transitions"], overrides["correction.replay_transitions"]) == (28, 1)
    # a larger budget: whole iterations up to about half of it, the rest over the rounds' replay audits
    larger = run_overrides(correction, 0, 3360, 0.1, correction_rounds=3, sim_to_real_iteration=28, max_turns=14)
    assert (larger["correction.real_transitions"], larger["correction.replay_transitions"]) == (168, 56)
    assert larger["correction.real_transitions"] + 3 * larger["correction.replay_transitions"] <= 336
    # the cpu profile's own episodes are up to 14 turns: 1 replayed transition a round feeds nothing back
    with pytest.raises(ParamsError, match="leaves 1 replayed transition.*less than one episode \\(up to 14\\)"):
        run_overrides(correction, 0, 336, 0.1, correction_rounds=3, sim_to_real_iteration=28, max_turns=14)
    with pytest.raises(ParamsError, match="correction.rounds is 0"):
        run_overrides(correction, 0, 336, 0.1, correction_rounds=0)
    with pytest.raises(ParamsError, match="33 pays for no sim-to-real iteration .*34.*raise study.real_budget"):
        run_overrides(correction, 0, 336, 0.1, correction_rounds=3, sim_to_real_iteration=34)


def _cpu_study(**study):
    """The cpu profile's params, with `study` settings changed (plan() reads params, it runs nothing)."""
    import yaml

    profile = yaml.safe_load((REPO / "profiles" / "cpu.yaml").read_text())
    return load_params(REPO / "params.yaml", {**profile, **{f"study.{k}": v for k, v in study.items()}})


def test_the_plan_names_every_row_in_running_order_and_why_a_row_cannot_run():
    planned = plan(_cpu_study(seeds=[0, 1], environments=["textworld-cooking", "miniwob"]), sim_to_real_iteration=28)

    # the warm start's row first: it trains what the seed's other rows start from
    assert [row.name for row in planned[:3]] == ["textworld-cooking/sft-only-seed0",
                                                 "textworld-cooking/dreamgym-grpo-seed0",
                                                 "textworld-cooking/real-grpo-seed0"]
    assert len(planned) == 2 * 2 * 11 and planned[-1].name == "miniwob/s2r-correction-seed1"
    assert planned[11].name == "miniwob/sft-only-seed0"  # seed 0 everywhere before seed 1
    real = planned[2]
    assert real.overrides == run_overrides(real.variant, 0, 700, 0.1, environment="textworld-cooking")
    # the cpu profile's budget pays for the correction row: 70 = one sim-to-real iteration (28) + 3 rounds x 14
    assert (planned[10].overrides["correction.real_transitions"],
            planned[10].overrides["correction.replay_transitions"]) == (28, 14)
    # at 336, 33 real transitions leave one replayed transition a round, less than an episode: the row cannot run,
    # and the plan says why
    correction = plan(_cpu_study(real_budget=336), sim_to_real_iteration=28)[10]
    assert correction.overrides is None and not correction.switched_off
    assert "leaves 1 replayed transition(s) a round" in correction.why_not
    # correction.rounds 0 switches the row off: no failure
    [off] = [row for row in plan(load_params(REPO / "params.yaml"), 16) if row.variant.name == "s2r-correction"]
    assert off.switched_off and off.why_not == "correction.rounds is 0"

    assert select_rows(planned, ["miniwob/no-retrieval-seed1"]) == [planned[-3]]
    assert select_rows(planned) == planned
    with pytest.raises(ParamsError, match=r"no such row of this study: miniwob/no-retrieval-seed7\. params.yaml "
                                          r"`study` plans textworld-cooking/sft-only-seed0, "):
        select_rows(planned, ["miniwob/no-retrieval-seed7"])
    with pytest.raises(ParamsError, match=r"study.variants \['real-grpo'\] limits it: set it to \[\]"):
        select_rows(plan(_cpu_study(variants=["real-grpo"]), 28), ["miniwob/no-retrieval-seed0"], ["real-grpo"])


def test_the_report_lists_every_planned_row_finished_or_with_its_cost_and_command(tmp_path):
    tw = "textworld-cooking"
    results = tmp_path / "results"
    _run(results, f"{tw}/dreamgym-grpo-seed0", {"sft_warm_start": {tw: _evaluation(1, 4)}})
    (results / tw / "dreamgym-grpo-seed0" / "run.json").write_text(json.dumps({"seconds": 5400.0, "profile": "cpu"}))
    # kept at another budget: the study would refuse it, so it is no finished row of this plan
    _run(results, "miniwob/dreamgym-grpo-seed0", {"sft_warm_start": {"miniwob": _evaluation(1, 4)}})
    (results / "miniwob" / "dreamgym-grpo-seed0" / "run.json").write_text(json.dumps(
        {"seconds": 60.0, "profile": "cpu", "params_set": {"sim_to_real.real_transitions": 70}}))
    _run(results, "real-grpo-seed1", {"sim-to-real": {tw: _evaluation(1, 4)}})  # the older flat layout: no row
    params = _cpu_study(seeds=[0, 1], variants=["dreamgym-grpo", "real-grpo", "s2r-correction"],
                        environments=[tw, "miniwob"], real_budget=336)
    planned = plan(params, 28)

    _, text = report(results, 0.95, ("grpo", "ppo"), planned, "cpu", run_budget(params))

    # what every row may spend, from the params (cpu: 6 iterations of 2 tasks x 4 episodes of at most 14 turns)
    assert "## Planned runs\n\nEach row's budget: synthetic RL plays 6 iterations of 2 tasks x 4 episodes in the " \
           "experience model (at most 672 synthetic transitions, 14 turns an episode); real-environment RL spends up " \
           "to B = 336 real transitions, DreamGym-S2R and its correction row up to 33 (10% of B); each policy plays " \
           "200 held-out games per environment." in text

    assert "1 of 12 planned runs finished; 6 to run (5 not estimated: no finished run on their environment to cost " \
           "them by), about 1.5 h by the finished runs of their variants or, where named, of a variant they cost " \
           "like. A run's wall time" in text
    assert f"| {tw}/dreamgym-grpo-seed0 | finished | 90 |  |" in text
    assert f"| {tw}/dreamgym-grpo-seed1 | not run yet | about 90 (mean of 1) | `dreamgym study run " \
           f"{tw}/dreamgym-grpo-seed1` |" in text
    assert f"| {tw}/real-grpo-seed0 | not run yet | not measured yet | `dreamgym study run {tw}/real-grpo-seed0` |" \
        in text
    assert "| miniwob/dreamgym-grpo-seed0 | kept with other params: " in text and "finished with " \
        "sim_to_real.real_transitions=70, but this study sets sim_to_real.real_transitions=33" in text
    # a run's cost is measured on its own environment: MiniWoB's DreamGym run is not TextWorld's
    assert "| miniwob/dreamgym-grpo-seed1 | not run yet | not measured yet |" in text
    assert f"| {tw}/real-grpo-seed1 | not run yet |" in text
    assert f"| {tw}/s2r-correction-seed1 | cannot run: s2r-correction: DreamGym-S2R's real budget of 33 leaves 1 " \
           "replayed transition(s)" in text
    assert "## Planned runs" not in report(results, 0.95, ("grpo", "ppo"))[1]  # no plan given: no section
    # runs of another profile are another study's (a first edition's): these params do not plan them
    assert "Planned runs: not listed. These runs were made at profile cpu and the plan is params.yaml's, at profile " \
        "quick." in report(results, 0.95, ("grpo", "ppo"), planned, "quick")[1]
    assert "## Planned runs" in report(results, 0.95, ("grpo", "ppo"), planned, "custom")[1]  # as is_finished judges


def test_a_row_costs_its_stages_from_scratch_and_one_the_finished_runs_show_tells_nothing_says_why(tmp_path):
    """A run kept after a resumption took less wall time than its stages did: the plan estimates rows by the stages'
    own times. The no-curriculum ablation tells nothing while DreamGym's curriculum accepted no variation."""
    tw = "textworld-cooking"
    results = tmp_path / "results"
    run_dir = results / tw / "dreamgym-grpo-seed0"
    _run(results, f"{tw}/dreamgym-grpo-seed0", {"sft_warm_start": {tw: {**_evaluation(1, 4), "wall_s": 600.0}},
                                                "synthetic_grpo": {tw: {**_evaluation(2, 4), "wall_s": 600.0}}})
    curriculum = {"curriculum_enabled": True, "proposed": 6, "accepted": 0}
    (run_dir / "synthetic_rl.json").write_text(json.dumps({"seconds": 2400.0, "curriculum": curriculum}))
    (run_dir / "sim_to_real.json").write_text(json.dumps({"seconds": 600.0, "start_from": "synthetic_rl"}))
    (run_dir / "run.json").write_text(json.dumps({"seconds": 1200.0, "profile": "cpu"}))  # resumed at the games
    planned = plan(_cpu_study(seeds=[0, 1], variants=["dreamgym-grpo", "no-curriculum"], environments=[tw]), 28)

    # without the upstream stages' metrics the time from scratch is unknown: the estimate is the wall time
    assert f"| {tw}/dreamgym-grpo-seed1 | not run yet | about 20 (mean of 1) |" in report(results, 0.95, ("grpo",),
                                                                                             planned, "cpu")[1]
    (run_dir / "train_experience_model.json").write_text(json.dumps({"seconds": 3000.0}))
    (run_dir / "train_policy_sft.json").write_text(json.dumps({"seconds": 1200.0}))
    _, text = report(results, 0.95, ("grpo",), planned, "cpu")

    # its row's games only: the warm start it played beside them is a row of its own (sft-only)
    assert finished_runs(results)[0].from_scratch_seconds == 3000 + 1200 + 2400 + 600 + 600
    assert f"| {tw}/dreamgym-grpo-seed0 | cpu | ? | 0a | 20.0 | 130.0 |" in text
    assert f"| {tw}/dreamgym-grpo-seed1 | not run yet | about 130 (mean of 1) |" in text
    # the seed's own DreamGym run judges its ablation; a seed whose run has not finished is judged by the others
    assert (f"| {tw}/no-curriculum-seed0 | not informative: DreamGym (GRPO)'s curriculum accepted 0 of 6 proposed "
            "variations (`python research/curriculum_backbone.py N` asks a backbone for N) in "
            f"{tw}/dreamgym-grpo-seed0, so DreamGym played the base task schedule") in text
    assert (f"| {tw}/no-curriculum-seed1 | not informative: DreamGym (GRPO)'s curriculum accepted 0 of 6 proposed "
            "variations (`python research/curriculum_backbone.py N` asks a backbone for N) in its 1 finished run(s) "
            f"on {tw}, so DreamGym played the base task schedule") in text
    assert f"`dreamgym study run {tw}/no-curriculum-seed0` runs it anyway |" in text
    assert "1 of 4 planned runs finished; 1 to run, about 2.2 h by the finished runs of their variants or, where " \
           "named, of a variant they cost like; 2 not informative by the finished runs (not run unless named)" in text
    # an ablation with no run of its own costs what DreamGym (GRPO)'s runs did, and says so
    assert f"| {tw}/no-curriculum-seed1 | not informative: " in text
    assert f"| about 130 (as dreamgym-grpo, mean of 1) | `dreamgym study run {tw}/no-curriculum-seed1` runs it " \
           "anyway |" in text
    assert "(0.3 h of runs as they ran; 2.2 h from scratch, summed over the 1 that kept their stages' times, " \
           "profile cpu)" in text

    # a curriculum no task was varied by: the same schedule, another reason
    (run_dir / "synthetic_rl.json").write_text(json.dumps({"curriculum": {**curriculum, "proposed": 0}}))
    assert "curriculum proposed no variation (no task's reward variance reached synthetic_rl.curriculum.min_variance)" \
        in report(results, 0.95, ("grpo",), planned, "cpu")[1]
    # a curriculum that wrote a task, or was off, or DreamGym runs on another environment only: worth running
    for kept, environment in [({**curriculum, "accepted": 1}, tw), ({**curriculum, "curriculum_enabled": False}, tw),
                              (curriculum, "miniwob")]:
        (run_dir / "synthetic_rl.json").write_text(json.dumps({"seconds": 2400.0, "curriculum": kept}))
        other = plan(_cpu_study(seeds=[0], variants=["no-curriculum"], environments=[environment]), 28)
        assert f"| {environment}/no-curriculum-seed0 | not run yet |" in report(results, 0.95, ("grpo",), other,
                                                                                 "cpu")[1]
    # once seed 1's DreamGym run wrote no task, its ablation tells nothing though seed 0's wrote one
    (run_dir / "synthetic_rl.json").write_text(json.dumps({"seconds": 2400.0, "curriculum": {**curriculum,
                                                                                             "accepted": 1}}))
    _run(results, f"{tw}/dreamgym-grpo-seed1", {"synthetic_grpo": {tw: _evaluation(1, 4)}})
    (results / tw / "dreamgym-grpo-seed1" / "synthetic_rl.json").write_text(json.dumps({"curriculum": curriculum}))
    _, text = report(results, 0.95, ("grpo",), planned, "cpu")
    assert f"| {tw}/no-curriculum-seed0 | not run yet |" in text
    assert f"| {tw}/no-curriculum-seed1 | not informative: DreamGym (GRPO)'s curriculum accepted 0 of 6 proposed " \
           "variations (`python research/curriculum_backbone.py N` asks a backbone for N) in " \
           f"{tw}/dreamgym-grpo-seed1" in text
    shutil.rmtree(results / tw / "dreamgym-grpo-seed1")
    # rows of one environment and seed share the warm start (20 of each row's 130 minutes) and, where they set the
    # same experience_model params, the experience model (50): in one workspace DVC trains each once. no-retrieval
    # sets experience_model.prompt.use_retrieval, so it trains its own: 3 x 130 - 3 x 70 + 2 x 20 + 3 x 50 = 370
    (run_dir / "synthetic_rl.json").write_text(json.dumps({"seconds": 2400.0, "curriculum": {"accepted": 1}}))
    together = plan(_cpu_study(seeds=[0, 1], variants=["dreamgym-grpo", "no-retrieval"], environments=[tw]), 28)
    assert "1 of 4 planned runs finished; 3 to run, about 6.5 h by the finished runs of their variants or, where " \
           "named, of a variant they cost like, or about 6.2 h run in one workspace per environment and seed, " \
           "where DVC's run cache trains the warm start once for all its rows and the experience model once for the " \
           "rows that set the same experience_model params." in report(
               results, 0.95, ("grpo",), together, "cpu")[1]


def test_runs_that_restored_one_warm_start_share_its_name_and_one_trained_again_gets_another(tmp_path):
    tw = "textworld-cooking"
    results = tmp_path / "results"
    trained = {"sft-only-seed1": {"final_loss": 0.006, "seconds": 4158.6}, "real-grpo-seed1": {},
               "real-ppo-s2r-budget-seed1": {"final_loss": 0.006, "seconds": 5000.0},  # its training resumed
               "real-grpo-s2r-budget-seed1": {"final_loss": 0.0048, "seconds": 2633.3},  # trained on another machine
               "real-ppo-s2r-budget-seed2": {"final_loss": 0.006, "seconds": 4158.6}}  # another seed's, alike
    for name, record in trained.items():
        label = "sft_warm_start" if name.startswith("sft-only") else "sim-to-real"
        _run(results, f"{tw}/{name}", {label: {tw: _evaluation(1, 4)}}, start_from="sft")
        if record:
            (results / tw / name / "train_policy_sft.json").write_text(json.dumps(record))
    assert warm_starts(finished_runs(results)) == {
        f"{tw}/real-grpo-s2r-budget-seed1": "1a", f"{tw}/real-grpo-seed1": "?", f"{tw}/real-ppo-s2r-budget-seed1": "1b",
        f"{tw}/real-ppo-s2r-budget-seed2": "2a", f"{tw}/sft-only-seed1": "1b"}

    # a claim whose two runs of a seed started from different models says so; one from the same model does not
    _run(results, f"{tw}/dreamgym-grpo-seed1", {"synthetic_grpo": {tw: _evaluation(1, 4)},
                                                "sim-to-real": {tw: _evaluation(1, 4)}})
    (results / tw / "dreamgym-grpo-seed1" / "train_policy_sft.json").write_text(json.dumps(trained["sft-only-seed1"]))
    runs = finished_runs(results)
    metrics, _ = aggregate(runs)
    found = {(c.method_a, c.method_b): c for c in comparisons(metrics, ("grpo",), runs=runs)}
    assert found[("DreamGym-S2R (GRPO)", "GRPO in the real environment at S2R's budget")].other_warm_starts == (1,)
    assert found[("DreamGym (GRPO)", "SFT only")].other_warm_starts == ()
    assert found[("DreamGym-S2R (GRPO)", "GRPO in the real environment")].other_warm_starts == ()  # "?": not known

    # another environment's warm start of seed 1, listed before TextWorld's runs, renames none of them
    textworld = warm_starts(runs)
    _run(results, "miniwob/sft-only-seed1", {"sft_warm_start": {"miniwob": _evaluation(1, 4)}}, start_from="sft")
    (results / "miniwob" / "sft-only-seed1" / "train_policy_sft.json").write_text(json.dumps({"final_loss": 0.1}))
    assert warm_starts(finished_runs(results)) == {**textworld, "miniwob/sft-only-seed1": "1a"}


def test_the_warm_start_is_a_row_of_its_own_that_counts_once_per_seed(tmp_path):
    """The warm start's row plays it without sim-to-real; where a DreamGym run of the seed played it before the row
    existed, the row would play the same policy on the same games: not informative, its games counted once."""
    tw = "textworld-cooking"
    results = tmp_path / "results"
    _run(results, f"{tw}/dreamgym-grpo-seed0", {"sft_warm_start": {tw: _evaluation(1, 4)},
                                                "synthetic_grpo": {tw: _evaluation(2, 4)}})
    planned = plan(_cpu_study(seeds=[0, 1], variants=["sft-only", "dreamgym-grpo"], environments=[tw, "miniwob"]),
                   28)
    statuses = {status.row.name: status for status in plan_status(planned, finished_runs(results), "cpu")}

    assert statuses[f"{tw}/sft-only-seed0"].status == (
        f"not informative: {tw}/dreamgym-grpo-seed0 played seed 0's warm start on the held-out games, and those "
        "games count as this row's")
    # another seed's or environment's warm start is not that one
    assert statuses[f"{tw}/sft-only-seed1"].to_run and statuses["miniwob/sft-only-seed0"].to_run
    # it needs neither synthetic RL nor the experience model nor sim-to-real (flows.study stands in for them)
    row = statuses["miniwob/sft-only-seed0"].row
    assert stages_not_needed(row.overrides, row.variant.target) == ("sim_to_real", "synthetic_rl",
                                                                    "train_experience_model")
    # run anyway (named), the warm start of seed 0 counts once; seed 1's own row adds its games
    _run(results, f"{tw}/sft-only-seed0", {"sft_warm_start": {tw: _evaluation(1, 4)}}, start_from="sft")
    _run(results, f"{tw}/sft-only-seed1", {"sft_warm_start": {tw: _evaluation(3, 4)}}, start_from="sft")
    metrics, text = aggregate(finished_runs(results))
    assert metrics["SFT only"][tw]["successes"] == 1 + 3 and metrics["SFT only"][tw]["episodes"] == 8
    assert "| SFT only | textworld-cooking | 0.50 " in text
    assert metrics["DreamGym (GRPO)"][tw]["successes"] == 2


def test_a_rows_failed_attempts_are_kept_and_the_plan_says_what_they_cost_and_why(tmp_path):
    """A row that could not run says why and what its attempts cost: the study keeps each failed attempt
    (`record_failure`, flows.study.run_variant), and the plan and the report's total show them."""
    tw, row = "textworld-cooking", "textworld-cooking/dreamgym-grpo-seed0"
    results = tmp_path / "results"
    planned = plan(_cpu_study(seeds=[0], variants=["dreamgym-grpo"], environments=[tw]), 28)
    assert read_failures(results) == {}
    reason = "synthetic_rl: the experience model is over its failure budget: it fell back on 12 of 21 predictions"
    record_failure(results, {"run": row, "commit": "ae7f53f0" + "0" * 32, "profile": "cpu", "seconds": 600.0,
                             "stage": "train_experience_model", "reason": "killed"})
    record_failure(results, {"run": row, "commit": "1d3e4520" + "0" * 32, "profile": "cpu", "seconds": 1052.0,
                             "stage": "synthetic_rl", "reason": reason})
    assert [a["stage"] for a in read_failures(results)[row]] == ["train_experience_model", "synthetic_rl"]

    _, text = report(results, 0.95, ("grpo",), planned, "cpu")

    # dreamgym's error names the stage first: the table names it once
    assert f"| {row} | not run yet; 2 failed attempts (28 min); the last, at 1d3e4520, in synthetic_rl: " \
           f"{reason.removeprefix('synthetic_rl: ')} |" in text
    assert "from 0 finished runs in" in text and "0.0 h of runs; and 0.5 h in 2 failed attempts, listed under " \
        "Planned runs" in text
    long = "x" * 300  # a long reason is cut in the table (the file keeps it whole)
    record_failure(results, {"run": row, "seconds": 60.0, "stage": None, "reason": long})
    assert f"in an unknown stage: {'x' * 240}... |" in report(results, 0.95, ("grpo",), planned, "cpu")[1]


def test_a_superseded_run_leaves_the_results_keeps_its_numbers_and_cost_and_is_run_again(tmp_path, capsys):
    """A later change to the method (sim-to-real's iteration planning) outdates finished runs: `study supersede`
    marks them with the reason; they leave every verdict and table, stay in their folder, still cost their row, and
    the study runs them again."""
    tw = "textworld-cooking"
    results = tmp_path / "results"
    for name, label, wins in [("dreamgym-grpo-seed0", "sft_warm_start", 1), ("real-grpo-seed0", "sim-to-real", 3)]:
        _run(results, f"{tw}/{name}", {label: {tw: _evaluation(wins, 4)}}, s2r_used=576, start_from="sft")
        (results / tw / name / "run.json").write_text(json.dumps({"seconds": 6000.0, "profile": "cpu",
                                                                  "commit": "edf9cbeb" + "0" * 32}))
    params = ["--params", str(REPO / "params.yaml"), "--set", f"study.results_dir={results}"]
    row = f"{tw}/real-grpo-seed0"
    assert main([*params, "study", "supersede", row]) == 2
    assert "superseding a run needs a reason (--reason)" in capsys.readouterr().err
    assert main([*params, "study", "supersede", f"{tw}/real-ppo-seed0", "--reason", "x"]) == 2
    assert f"{tw}/real-ppo-seed0: no finished run of that name in {results} to supersede; the finished ones are " \
        f"{tw}/dreamgym-grpo-seed0, {row}" in capsys.readouterr().err
    assert main([*params, "study", "supersede", row, "--reason", "sim-to-real now plans iterations adaptively"]) == 0

    assert [run.name for run in finished_runs(results)] == [f"{tw}/dreamgym-grpo-seed0"]
    assert [run.superseded for run in kept_runs(results)] == [None, "sim-to-real now plans iterations adaptively"]
    assert not is_finished(results / row, "cpu")  # the study runs it again
    assert json.loads((results / row / "evaluate_policies.json").read_text())["sim-to-real"][tw]["successes"] == 3
    metrics, text = report(results, 0.95, ("grpo",), plan(_cpu_study(seeds=[0], variants=["dreamgym-grpo",
                                                                                          "real-grpo"],
                                                                      environments=[tw]), 28), "cpu")
    assert "GRPO in the real environment" not in metrics and "SFT only" in metrics
    assert "from 1 finished runs" in text and f"| {row} | cpu |" not in text
    assert "### Superseded runs" in text and f"| {row} | edf9cbeb | 100.0 | 576 | sim-to-real now plans " \
        "iterations adaptively |" in text
    assert f"| {row} | not run yet; its run at edf9cbeb was superseded: sim-to-real now plans iterations " \
        f"adaptively | about 100 (mean of 1) | `dreamgym study run {row}` |" in text


def test_a_row_from_synthetic_rl_keeps_its_simulators_fidelity_and_the_report_shows_its_false_wins(tmp_path):
    """Rows whose policies come from synthetic RL also score their experience model (flows.study.run_row): the run
    keeps evaluate_experience_model.json only when it scored it (a file another row left would not be its own)."""
    # the correction rounds score theirs every round
    assert {v.name: v.measures_simulator for v in variants(("grpo",))} == {
        "sft-only": False, "dreamgym-grpo": True, "real-grpo": False, "real-grpo-s2r-budget": False,
        "no-curriculum": True, "no-retrieval": True, "no-reasoning": True, "s2r-correction": False}
    # and the real-environment rows alone need nothing of synthetic RL, nor of the experience model where every
    # environment they play is a real one (flows.study.run_command leaves them out)
    real = ("synthetic_rl", "train_experience_model")
    assert {v.name: stages_not_needed(run_overrides(v, 0, 700, 0.1, 3, 28, "miniwob"), v.target)
            for v in variants(("grpo",))} == {
        "sft-only": ("sim_to_real", *real), "dreamgym-grpo": (), "real-grpo": real, "real-grpo-s2r-budget": real,
        "no-curriculum": (), "no-retrieval": (), "no-reasoning": (),
        "s2r-correction": ("evaluate_policies", "sim_to_real", "synthetic_rl")}  # its rounds run their own
    real_row = run_overrides(variants(("grpo",))[2], 0, 700, 0.1)
    assert stages_not_needed({**real_row, "policy.environments": ["miniwob", "webshop"]}, "evaluate_policies") == \
        ("synthetic_rl",)  # a seed-only domain's held-out games are played inside the experience model
    assert stages_not_needed(real_row, "evaluate_policies") == ("synthetic_rl",)  # environments not named
    tw = "textworld-cooking"
    metrics_dir = tmp_path / "metrics"
    metrics_dir.mkdir()
    (metrics_dir / "evaluate_policies.json").write_text(json.dumps({"synthetic_grpo": {tw: _evaluation(2, 4)}}))
    (metrics_dir / "evaluate_experience_model.json").write_text(json.dumps(
        {"seconds": 420.0, "prediction": {"fallbacks": 2, "requests": 32},
         "experience model": {"overall": {"false_wins": 0, "unrewarded_n": 27}},
         "on_policy": {"prediction": {"fallbacks": 5, "requests": 32},
                       "experience model": {"overall": {"false_wins": 1, "unrewarded_n": 26}}}}))
    results = tmp_path / "results"

    scored = keep_run(results / "dreamgym-grpo-seed0", {"seconds": 60.0}, tmp_path, simulator=True)
    unscored = keep_run(results / "no-retrieval-seed0", {"seconds": 60.0, "simulator_not_scored": "it failed"},
                        tmp_path)

    assert (scored / "evaluate_experience_model.json").is_file()
    assert not (unscored / "evaluate_experience_model.json").exists()
    text = report(results, 0.95, ("grpo",))[1]
    assert "| dreamgym-grpo-seed0 | ? | ? | ? | 1.0 | ? | 0.0 | - | - | - | - | 0/27; 1/26 (fallbacks 7/64) |" in text
    assert "| no-retrieval-seed0 | ? | ? | ? | 1.0 | ? | 0.0 | - | - | - | - | not scored: it failed |" in text


def test_study_run_refuses_a_row_the_study_does_not_plan_and_names_those_it_does(capsys):
    assert main(["--params", str(REPO / "params.yaml"), "study", "run", "textworld-cooking/dreamgym-grpo-seed9"]) == 2
    error = capsys.readouterr().err
    assert "error: no such row of this study: textworld-cooking/dreamgym-grpo-seed9" in error
    assert "plans textworld-cooking/sft-only-seed0, textworld-cooking/dreamgym-grpo-seed0, " in error
    assert main(["study", "report", "textworld-cooking/dreamgym-grpo-seed0"]) == 2
    assert "`study report` takes no rows" in capsys.readouterr().err


def test_a_profiles_study_is_reported_without_switching_params_yaml_to_it(tmp_path, monkeypatch, capsys):
    """`dreamgym study report --profile cpu` in a checkout at the quick profile: the cpu study's folder, its plan
    (2 environments x 3 seeds x 8 variants), params.yaml untouched."""
    shutil.copy(REPO / "params.yaml", tmp_path / "params.yaml")
    shutil.copytree(REPO / "profiles", tmp_path / "profiles")
    monkeypatch.chdir(tmp_path)

    assert main(["study", "report", "--profile", "cpu"]) == 0

    readme = Path("reports/results_study/cpu/README.md").read_text()
    assert "0 of 66 planned runs finished; 66 to run (66 not estimated: no finished run on their environment to " \
           "cost them by)" \
        in readme and "| miniwob/s2r-correction-seed2 | not run yet |" in readme
    assert Path("params.yaml").read_text() == (REPO / "params.yaml").read_text()
    assert main(["study", "run", "--profile", "cpu"]) == 2
    assert "`study run` runs the study params.yaml holds" in capsys.readouterr().err


def test_a_correction_run_is_kept_from_its_last_round_and_counts_every_rounds_transitions(tmp_path):
    tw = "textworld-cooking"
    last_round = tmp_path / "models" / "correction" / "rounds" / "round_3"
    (last_round / "metrics").mkdir(parents=True)
    (last_round / "metrics" / "evaluate_policies.json").write_text(json.dumps({"sim-to-real": {tw: _evaluation(3, 4)}}))
    (last_round / "metrics" / "sim_to_real.json").write_text(json.dumps({"real_transitions_used": 6}))
    (last_round / "metrics" / "synthetic_rl.json").write_text(json.dumps({"synthetic_transitions": 90}))
    (last_round / "metrics" / "sim_to_real_iterations.csv").write_text("iteration,grad_norm\n1,0.0\n")
    (last_round / "reports").mkdir()
    _games(last_round / "reports", "sim-to-real", {0, 1, 2}, played=4)
    (tmp_path / "metrics").mkdir()
    (tmp_path / "metrics" / "correction_rounds.json").write_text(json.dumps(
        {"rounds": 3, "real_transitions": 31, "synthetic_transitions": 270}))
    rounds_table = ("round,real_transitions_total,on_policy_false_wins,on_policy_unrewarded,synthetic_wins,"
                    "confirmed_wins,heldout_success\n1,13,0,26,1,0,0.38\n2,25,0,26,1,0,0.38\n3,31,5,26,1,0,0.39\n")
    (tmp_path / "metrics" / "correction_rounds.csv").write_text(rounds_table)
    results = tmp_path / "results"

    # the pipeline's own synthetic RL, sim-to-real and evaluation did not run: their files at the root are another run's
    (tmp_path / "metrics" / "synthetic_rl.json").write_text(json.dumps({"synthetic_transitions": 999}))
    keep_run(results / "s2r-correction-seed0", {"run": "s2r-correction-seed0"}, tmp_path, evaluated_in=last_round,
             not_needed=("evaluate_policies", "sim_to_real", "synthetic_rl"))

    kept = results / "s2r-correction-seed0"
    assert json.loads((kept / "synthetic_rl.json").read_text()) == {"synthetic_transitions": 90}  # the last round's
    assert json.loads((kept / "sim_to_real.json").read_text()) == {"real_transitions_used": 6}
    assert (kept / "correction_rounds.csv").read_text() == rounds_table  # each round's audit, not only the last
    [run] = finished_runs(results, ("grpo",))
    assert run.games[("sim-to-real", tw)] == {"g0": True, "g1": True, "g2": True, "g3": False}
    metrics, _ = aggregate([run])
    row = metrics["DreamGym-S2R (GRPO) + correction"][tw]
    assert (row["successes"], row["real_transitions_mean"], row["synthetic_transitions_mean"]) == (3, 31, 270)
    assert row["runs_never_updated"] == 0  # its last round's S2R had no gradient, but every round trained the policy
    # the report shows each round's on-policy audit; a run kept before the table was, its summary's first and last
    section = correction_section([run], correction_plot([run], tmp_path / "corrections.png"))
    assert "| s2r-correction-seed0 | 3 | 31 | 5/26 | 0/1 | 0.39 |" in section
    assert "![correction rounds](corrections.png)" in section and (tmp_path / "corrections.png").is_file()
    assert correction_plot([], tmp_path / "none.png") is None
    (kept / "correction_rounds.csv").unlink()
    (kept / "correction_rounds.json").write_text(json.dumps({"rounds": 3, "first": {
        "on_policy_false_win_rate": 0.0, "heldout_success": 0.38}, "final": {
        "on_policy_false_win_rate": 5 / 26, "synthetic_wins": 1, "confirmed_wins": 0, "heldout_success": 0.39}}))
    [run] = finished_runs(results, ("grpo",))
    assert "| s2r-correction-seed0 | 3 | - | 0.19 | 0/1 | 0.39 |" in correction_section([run])


def test_episodes_pool_over_seeds_with_a_wilson_interval(tmp_path):
    tw = "textworld-cooking"
    for seed, (sft, dream, s2r) in enumerate([(1, 2, 3), (2, 3, 5)]):
        _run(tmp_path, f"dreamgym-grpo-seed{seed}",
             {"skipped": [], "sft_warm_start": {tw: _evaluation(sft, 6), "next_action": {"accuracy": 0.5}},
              "synthetic_grpo": {tw: _evaluation(dream, 6)}, "sim-to-real": {tw: _evaluation(s2r, 6)}},
             s2r_used=16, synthetic=40 + seed)
    _run(tmp_path, "real-grpo-seed0", {"sim-to-real": {tw: _evaluation(4, 6)}}, s2r_used=150, synthetic=40,
         start_from="sft")
    # a PPO run that played the warm start too (as before it stopped doing so): GRPO's copy is the one counted
    _run(tmp_path, "dreamgym-ppo-seed0", {"sft_warm_start": {tw: _evaluation(5, 6)},
                                          "synthetic_ppo": {tw: _evaluation(0, 6)}}, synthetic=40)
    (tmp_path / ".no-retrieval-seed0.k2x9a1").mkdir()  # a crashed copy's temporary (keep_run) is not a run

    metrics, table = aggregate(finished_runs(tmp_path))

    assert list(metrics) == ["SFT only", "DreamGym (GRPO)", "DreamGym-S2R (GRPO)", "GRPO in the real environment",
                             "DreamGym (PPO)"]
    sft = metrics["SFT only"][tw]
    assert (sft["episodes"], sft["successes"], sft["seeds"]) == (12, 3, [0, 1])
    s2r = metrics["DreamGym-S2R (GRPO)"][tw]
    assert (s2r["episodes"], s2r["successes"], s2r["seeds"]) == (12, 8, [0, 1])
    assert (s2r["success_ci_low"], s2r["success_ci_high"]) == wilson_interval(8, 12, 0.95)
    assert s2r["real_transitions_mean"] == 16 and metrics["DreamGym (GRPO)"][tw]["real_transitions_mean"] == 0
    real = metrics["GRPO in the real environment"][tw]  # started from the warm start: no synthetic transitions
    assert (real["real_transitions_mean"], real["synthetic_transitions_mean"], real["simulator_fallback_rate"]) == (
        150, 0, None)
    assert metrics["DreamGym (GRPO)"][tw]["simulator_fallback_rate"] == 0.25
    assert metrics["DreamGym (GRPO)"][tw]["generated_tasks_mean"] == 0.5  # accepted 0 and 1 (seeds 0 and 1)
    assert real["generated_tasks_mean"] is None  # trained in the real environment only
    assert metrics["SFT only"][tw]["synthetic_transitions_mean"] == 0
    assert "| DreamGym-S2R (GRPO) | textworld-cooking | 0.67 [" in table
    assert success_plot(metrics, tmp_path / "results.png").stat().st_size > 1000


def test_unknown_variant_names_fail_with_the_known_ones():
    assert [v.name for v in select_variants(("ppo",), ["real-ppo"])] == ["real-ppo"]
    with pytest.raises(ParamsError, match="unknown real-gpro; .* are sft-only, dreamgym-grpo, real-grpo"):
        select_variants(("grpo",), ["real-gpro"])


def _rates(successes, episodes):
    low, high = wilson_interval(successes, episodes, 0.95)
    return {"successes": successes, "episodes": episodes, "success_rate": successes / episodes,
            "success_ci_low": low, "success_ci_high": high}


def test_without_kept_games_a_claim_counts_only_when_the_intervals_are_apart():
    tw = "textworld-cooking"
    metrics = {"SFT only": {tw: _rates(2, 40)}, "DreamGym (GRPO)": {tw: {**_rates(30, 40), "generated_tasks_mean": 3}},
               "GRPO in the real environment": {tw: {**_rates(26, 40), "real_transitions_mean": 336}},
               "DreamGym-S2R (GRPO)": {tw: {**_rates(0, 40), "real_transitions_mean": 33}},
               "DreamGym (GRPO) w/o curriculum": {tw: _rates(0, 40)}}
    rows = {line.split(" | ")[0].strip("| "): line for line in claim_verdicts(metrics, ("grpo",)).splitlines()}
    assert "supported: A higher, intervals apart" in rows["Synthetic-only RL improves on the warm start"]
    assert "not contradicted: A higher, intervals overlap |" in rows[  # same seeds: nothing to add
        "Synthetic-only RL matches RL in the real environment"]
    assert "contradicted: A lower, intervals apart" in rows[
        "Sim-to-real on 10% of the real transitions beats real-only RL on all of them"]
    assert "supported" in rows["The curriculum helps"] and "Retrieval of similar transitions helps" not in rows
    both_lost = {"SFT only": {tw: _rates(0, 3)}, "DreamGym (GRPO)": {tw: _rates(0, 3)}}
    assert "not testable: neither won a game" in claim_verdicts(both_lost, ("grpo",))
    seed_apart = {"SFT only": {tw: {**_rates(1, 3), "seeds": [0]}}, "DreamGym (GRPO)": {tw: {**_rates(2, 3),
                                                                                           "seeds": [1]}}}
    assert "A higher, intervals overlap (unpaired seeds: A [1], B [0])" in claim_verdicts(seed_apart, ("grpo",))
    # a curriculum that wrote no task leaves DreamGym on the ablation's schedule: a difference there is noise
    metrics["DreamGym (GRPO)"][tw]["generated_tasks_mean"] = 0
    rows = {line.split(" | ")[0].strip("| "): line for line in claim_verdicts(metrics, ("grpo",)).splitlines()}
    assert "not tested: the curriculum accepted no generated task" in rows["The curriculum helps"]
    # which needs no run of the ablation to say: it would play DreamGym's own schedule
    del metrics["DreamGym (GRPO) w/o curriculum"]
    rows = {line.split(" | ")[0].strip("| "): line for line in claim_verdicts(metrics, ("grpo",)).splitlines()}
    assert "DreamGym (GRPO) w/o curriculum: not run |  |  | +6.6 points | not tested: the curriculum accepted no " \
           "generated task" in rows["The curriculum helps"]
    metrics["DreamGym (GRPO)"][tw]["generated_tasks_mean"] = 2  # with generated tasks, only the run can tell
    assert "The curriculum helps" not in claim_verdicts(metrics, ("grpo",))


def test_the_reading_weighs_each_verdict_against_the_papers_gap_and_says_why_a_comparison_was_not_made(tmp_path):
    """Each of the paper's claims read from its comparisons: a null that would usually have caught a gap the
    paper's size says so; S2R's lead over real-only RL is traced (or not) to synthetic RL by the real-only run at
    S2R's budget; a comparison with no run names the row that would make it and where it stands."""
    tw, games = "textworld-cooking", 200

    def outcomes(won):  # the first `won` games of 200
        return {(0, f"g{i}"): i < won for i in range(games)}
    wins = {"SFT only": 40, "DreamGym (GRPO)": 44, "DreamGym-S2R (GRPO)": 80, "GRPO in the real environment": 50,
            "GRPO in the real environment at S2R's budget": 76}
    metrics = {method: {tw: {**_rates(won, games), "seeds": [0]}} for method, won in wins.items()}
    found = comparisons(metrics, ("grpo",), {(method, tw): outcomes(won) for method, won in wins.items()})
    results = tmp_path / "results"
    _run(results, f"{tw}/dreamgym-grpo-seed0", {"sft_warm_start": {tw: _evaluation(1, 4)}})
    params = _cpu_study(seeds=[0], variants=["sft-only", "dreamgym-grpo", "no-retrieval"],
                        environments=[tw, "miniwob"])
    statuses = plan_status(plan(params, 28), finished_runs(results), "cpu")

    text = claims_reading(found, metrics, untested_reasons(statuses), ("grpo",), ["miniwob", tw])

    assert "### 1. DreamGym's synthetic-only RL matches RL in the real environment" in text
    # 44 against 40 of 200 games: not resolved, though a gap of the paper's 28.8 points would have shown
    assert "- Synthetic-only RL improves on the warm start, textworld-cooking, DreamGym (GRPO) against SFT only: " \
           "**not resolved**: A higher, of 200 games both played, A alone won 4, B alone 0; sign test p = 0.12 " \
           "(seed 0; A - B +2 points, detectable 4, the paper's +28.8). A gap the size of the paper's would " \
           "usually have been detected here." in text
    assert "**supported**: A higher, of 200 games both played, A alone won 30, B alone 0" in text  # S2R vs real
    assert "On textworld-cooking (GRPO), DreamGym-S2R's lead over real-only RL is not shown to come from synthetic " \
           "RL: real-only RL at S2R's budget won 76/200 against S2R's 80/200 (not resolved)." in text
    assert "- Synthetic RL first beats real-only RL on the same real transitions (our control), textworld-cooking" \
        in text
    # no run at all on MiniWoB, and the ablation's row not run: each named with where it stands
    assert "- Retrieval of similar transitions helps, textworld-cooking, DreamGym (GRPO) against DreamGym (GRPO) " \
           f"w/o retrieval: `{tw}/no-retrieval-seed0`: not run yet, its cost not measured yet." in text
    assert "- Synthetic-only RL improves on the warm start, miniwob, DreamGym (GRPO) against SFT only: " \
           "`miniwob/dreamgym-grpo-seed0`: not run yet, its cost not measured yet; `miniwob/sft-only-seed0`: not run " \
           "yet, its cost not measured yet." in text
    # the second claim: the paper's comparison per environment, and our three controls (synthetic RL first, the
    # correction against S2R and against real-only RL, at the same real budget)
    assert "Here, of the paper's 2 comparisons, 1 supported, 1 not tested; of our controls' 6 comparisons, 1 not " \
           "resolved, 5 not tested." in text
    assert "- Synthetic RL with on-policy correction beats real-only RL on the same real transitions (our control), " \
           f"{tw}, DreamGym-S2R (GRPO) + correction against GRPO in the real environment at S2R's budget: " in text
    # a method whose RL never had a gradient is the policy it started from: the reading says so beside its verdict
    metrics["GRPO in the real environment at S2R's budget"][tw]["runs_never_updated"] = 1
    found = comparisons(metrics, ("grpo",), {(method, tw): outcomes(won) for method, won in wins.items()})
    assert "(seed 0; A - B +2 points, detectable 4). In 1 of B's 1 run, no RL iteration had a gradient (each " \
           "group's episodes scored alike), so RL left the policy it started from as it was." in claims_reading(
               found, metrics, {}, ("grpo",))
    # once real-only RL at S2R's budget is beaten too, synthetic RL first is what adds
    metrics["GRPO in the real environment at S2R's budget"][tw] = {**_rates(50, games), "seeds": [0]}
    found = comparisons(metrics, ("grpo",), {(m, tw): outcomes(metrics[m][tw]["successes"]) for m in metrics})
    assert "holds against real-only RL at S2R's budget too" in claims_reading(found, metrics, {}, ("grpo",))
    # unpaired, the verdict is intervals apart, a stricter test than the power assumes: no claim about what it catches
    unpaired = claims_reading(comparisons(metrics, ("grpo",)), metrics, {}, ("grpo",))
    assert "**not resolved**: A higher, intervals overlap (seed 0; A - B +2 points, detectable 11, the paper's " \
           "+28.8)." in unpaired
    assert "would usually have been detected" not in unpaired
    # a seed-only domain's games are played in the experience model: its row is there, under its simulated label
    simulated = {method: {f"{tw} (simulated)": rates[tw]} for method, rates in metrics.items()}
    reading = claims_reading(comparisons(simulated, ("grpo",)), simulated, untested_reasons(statuses), ("grpo",), [tw])
    assert f"Synthetic-only RL improves on the warm start, {tw} (simulated)" in reading
    assert f"Synthetic-only RL improves on the warm start, {tw}," not in reading  # not listed again as untested
    # PPO's comparisons: our copy of the paper's figures is GRPO's
    ppo = {"SFT only": metrics["SFT only"], "DreamGym (PPO)": metrics["DreamGym (GRPO)"]}
    assert "the paper's" not in claims_reading(comparisons(ppo, ("grpo", "ppo")), ppo, {}, ("grpo", "ppo")).split(
        "DreamGym (PPO) against SFT only")[1].split("\n")[0]


def test_a_reading_against_a_baseline_that_lost_to_the_warm_start_says_so():
    """A claim that DreamGym matches or beats real-only RL reads differently when real-only RL fell below the warm
    start it trained from: the reading gives that paired evidence, on the comparison's own seeds only."""
    tw = "textworld-cooking"

    def outcomes(won_by_seed):  # seed -> the first `won` of 100 games
        return {(seed, f"g{i}"): i < won for seed, won in won_by_seed.items() for i in range(100)}
    wins = {"SFT only": {0: 40, 1: 40}, "DreamGym (GRPO)": {0: 41, 1: 40},
            "GRPO in the real environment": {0: 38, 1: 5}}
    games = {(method, tw): outcomes(won) for method, won in wins.items()}

    def found(seeds):
        metrics = {method: {tw: {**_rates(sum(won[s] for s in seeds), 100 * len(seeds)), "seeds": seeds}}
                   for method, won in wins.items()}
        made = {(c.method_a, c.method_b): c for c in comparisons(metrics, ("grpo",), games)}
        return made, claims_reading(list(made.values()), metrics, {}, ("grpo",))

    made, reading = found([0])  # on seed 0 real-only RL is 2 games behind the warm start: nothing to say
    assert made[("DreamGym (GRPO)", "GRPO in the real environment")].b_below_warm_start == ""
    assert "itself lost" not in reading
    made, reading = found([0, 1])  # with seed 1's 35 games lost, it is
    assert made[("DreamGym (GRPO)", "GRPO in the real environment")].b_below_warm_start.startswith(
        "of 200 games both played, B alone won 0, SFT only alone 37; sign test p = 1.5e-11")
    assert made[("DreamGym (GRPO)", "SFT only")].b_below_warm_start == ""  # the warm start is no baseline of itself
    assert "B itself lost to SFT only on these seeds (of 200 games both played, B alone won 0, SFT only alone 37; " \
           "sign test p = 1.5e-11), so part of any lead of A over B is B's fall below its warm start." in reading
    # a seed where B started from another model than the warm start SFT only played is not B's own loss: left out
    from components.results.study import _below_warm_start
    starts = {"SFT only": {0: "0a", 1: "1a"}, "DreamGym (GRPO)": {0: "0a", 1: "1a"},
              "GRPO in the real environment": {0: "0a", 1: "1b"}}
    assert _below_warm_start("GRPO in the real environment", tw, {0, 1}, games,
                             {(m, tw, seed): name for m, by_seed in starts.items() for seed, name in by_seed.items()},
                             0.95) == ""
    starts["GRPO in the real environment"] = {0: "0b", 1: "1a"}  # seed 1's loss is its own, seed 0 is named
    assert _below_warm_start("GRPO in the real environment", tw, {0, 1}, games,
                             {(m, tw, seed): name for m, by_seed in starts.items() for seed, name in by_seed.items()},
                             0.95).endswith("sign test p = 5.8e-11; seed 0 left out, where B started from another "
                                            "model than the warm start SFT only played")


def test_the_curriculum_claim_pools_only_the_seeds_whose_curriculum_accepted_a_task(tmp_path):
    """Where DreamGym's curriculum accepted no variation, DreamGym played the ablation's schedule: that seed's games
    tell sampling apart, not the curriculum, so the comparison leaves the seed out and says so; with no such seed at
    all, the claim is not tested."""
    mw = "miniwob"
    for seed, generated, dreamgym_won, ablation_won in ((0, 0, set(range(12)), set()), (1, 2, {0, 1}, {0, 1, 2})):
        for variant, won in (("dreamgym-grpo", dreamgym_won), ("no-curriculum", ablation_won)):
            name = f"{mw}/{variant}-seed{seed}"
            _run(tmp_path, name, {"synthetic_grpo": {mw: _evaluation(len(won), 12)}})
            (tmp_path / name / "synthetic_rl.json").write_text(json.dumps(
                {"synthetic_transitions": 10, "experience_model": {"fallback_rate": 0.0},
                 "curriculum": {"curriculum_enabled": variant == "dreamgym-grpo", "generated_tasks": generated,
                                "accepted": generated}}))
            _games(tmp_path / name, "synthetic_grpo", won, environment=mw)
    runs = finished_runs(tmp_path)
    metrics, _ = aggregate(runs)
    [found] = [c for c in comparisons(metrics, ("grpo",), paired_games(runs), runs=runs)
               if c.method_b == "DreamGym (GRPO) w/o curriculum"]
    assert (found.a["successes"], found.b["successes"], found.pairs) == (2, 3, (12, 0, 1))  # seed 1's 12 games only
    assert found.untried_seeds == (0,)
    assert "Left out: seed 0, where A's curriculum accepted no generated task, so A played B's tasks and the two " \
           "differ by sampling alone." in claims_reading([found], metrics, {}, ("grpo",))
    assert "p = 1 (seed 0 left out: A's curriculum accepted no task there) |" in claims_table([found])
    # seed 1's curriculum too accepted none: neither seed can tell, and the claim is not tested
    record = json.loads((tmp_path / mw / "dreamgym-grpo-seed1" / "synthetic_rl.json").read_text())
    record["curriculum"].update(generated_tasks=0, accepted=0)
    (tmp_path / mw / "dreamgym-grpo-seed1" / "synthetic_rl.json").write_text(json.dumps(record))
    runs = finished_runs(tmp_path)
    metrics, _ = aggregate(runs)
    [found] = [c for c in comparisons(metrics, ("grpo",), paired_games(runs), runs=runs)
               if c.method_b == "DreamGym (GRPO) w/o curriculum"]
    assert found.outcome == "not tested" and found.untried_seeds == ()


def _games(run_dir, policy, won, played=12, environment="textworld-cooking"):
    """A kept games file's rows for one policy: it won the games numbered in `won`, of games g0..g<played-1>."""
    path = run_dir / "evaluate_policies_games.csv"
    lines = [] if path.is_file() else ["policy,environment,task_id,won,steps"]
    lines += [f"{policy},{environment},g{i},{int(i in won)},5" for i in range(played)]
    with path.open("a") as handle:
        handle.write("\n".join(lines) + "\n")


def test_sign_test_is_exact_and_two_sided():
    assert sign_test(6, 0) == sign_test(0, 6) == 2 / 64
    assert sign_test(5, 1) == 2 * 7 / 64 and sign_test(2, 2) == sign_test(0, 0) == 1.0


def test_pair_games_pairs_two_runs_policies_and_names_what_a_run_lacks(tmp_path, capsys, monkeypatch):
    """research/pair_games.py: any two runs' policies over the games both played, with the sign test the verdicts
    use; a policy a run did not play is an error naming the ones it did."""
    from research import pair_games
    for name in ("a-seed1", "b-seed1"):
        (tmp_path / name).mkdir()
    _games(tmp_path / "a-seed1", "sim-to-real", set(range(8)))
    _games(tmp_path / "b-seed1", "sim-to-real", {0, 1}, played=10)  # g10, g11 only A played: left out
    monkeypatch.setattr("sys.argv", ["pair_games.py", "a-seed1", "sim-to-real", "b-seed1", "sim-to-real",
                                     "--results", str(tmp_path)])
    pair_games.main()
    assert capsys.readouterr().out.startswith("10 games both played; A (a-seed1 sim-to-real) won 8, B (b-seed1 "
                                              "sim-to-real) 2; A alone 6, B alone 0; sign test p = 0.031")
    monkeypatch.setattr("sys.argv", ["pair_games.py", "a-seed1", "synthetic_grpo", "b-seed1", "sim-to-real",
                                     "--results", str(tmp_path)])
    with pytest.raises(SystemExit, match=r"a-seed1: no games of policy 'synthetic_grpo'; it kept \['sim-to-real'\]"):
        pair_games.main()


def test_against_warm_start_pairs_each_policy_with_the_games_of_its_own_warm_start(tmp_path, capsys, monkeypatch):
    """research/against_warm_start.py: each kept policy against the games of the model it started from (the study's
    warm start names), a reading only where the sign test clears alpha, and a run whose warm start no run played
    named rather than paired with another model of its seed."""
    from research import against_warm_start
    tw = "textworld-cooking"
    one, two = {"final_loss": 0.006}, {"final_loss": 0.0048}  # two trainings of seed 1: two models
    for name, label, won, record in (("sft-only-seed1", "sft_warm_start", set(range(8)), one),
                                     ("real-ppo-seed1", "sim-to-real", set(), one),  # lost all 8: p = 0.0078
                                     ("real-grpo-seed1", "sim-to-real", {0}, two)):
        _run(tmp_path, f"{tw}/{name}", {label: {tw: _evaluation(len(won), 12)}}, start_from="sft")
        (tmp_path / tw / name / "train_policy_sft.json").write_text(json.dumps(record))
        _games(tmp_path / tw / name, label, won)
    _run(tmp_path, f"{tw}/dreamgym-grpo-seed2", {"sft_warm_start": {tw: _evaluation(2, 12)},
                                                 "synthetic_grpo": {tw: _evaluation(3, 12)}})
    (tmp_path / tw / "dreamgym-grpo-seed2" / "train_policy_sft.json").write_text(json.dumps(one))
    _games(tmp_path / tw / "dreamgym-grpo-seed2", "sft_warm_start", {0, 1})
    _games(tmp_path / tw / "dreamgym-grpo-seed2", "synthetic_grpo", {0, 1, 2})  # one game more: no difference
    monkeypatch.setattr("sys.argv", ["against_warm_start.py", "--results", str(tmp_path)])
    against_warm_start.main()
    out = capsys.readouterr().out
    assert f"| {tw}/real-ppo-seed1 | 1b | sim-to-real | 12 | 0 | 8 | 0 | 8 | 0.0078 | lost |" in out
    assert f"| {tw}/dreamgym-grpo-seed2 | 2a | synthetic_grpo | 12 | 3 | 2 | 1 | 0 | 1 | no difference |" in out
    assert "2 policies: 0 won and 1 lost" in out and f"(Bonferroni): {tw}/real-ppo-seed1 sim-to-real (lost" in out
    assert (f"unpaired with their warm start: {tw}/real-grpo-seed1 (no run played warm start 1a on the held-out games)"
            in out)


def test_action_format_counts_games_with_stacked_commands_and_games_stuck_in_a_loop(tmp_path, capsys, monkeypatch):
    """research/action_format.py: a game with an action holding several commands, a game that ran out of turns on at
    most two distinct actions, and a game an environment failure ended (left out, as the verdicts leave it out)."""
    from research import action_format
    run_dir = tmp_path / "miniwob" / "real-ppo-seed1"
    run_dir.mkdir(parents=True)
    games = [("g0", 1, 1, ["click [6]"], ""),
             ("g1", 0, 3, ['type [3] "Q2" "type [3]" "type [3]"', "click [4]", "click [5]"], ""),
             ("g2", 0, 4, ["click [6]", "click [7]", "click [6]", "click [7]"], ""),
             ("g3", 0, 4, ["click [1] click [2]"] * 4, "the page did not load")]
    with (run_dir / "evaluate_policies_games.csv").open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["policy", "environment", "task_id", "won", "steps", "actions", "env_failure"])
        writer.writerows(["sim-to-real", "miniwob", task, won, steps, json.dumps(actions), failure]
                         for task, won, steps, actions, failure in games)
    monkeypatch.setattr("sys.argv", ["action_format.py", "miniwob/real-ppo-seed1", "sim-to-real",
                                     "--results", str(tmp_path), "--trajectories", str(tmp_path / "no-seed.jsonl")])
    action_format.main()
    assert capsys.readouterr().out == ("miniwob/real-ppo-seed1 sim-to-real: 3 games, won 1; an action of several "
                                       "commands in 1; all 4 turns on at most two distinct actions in 1; 8 actions: "
                                       "click 88%, type 12%\n")
    # a seed that wins g1's kind only by typing: the games of that kind, those that typed and those won
    seed = {"trajectory_id": "seed-1", "task": {"task_id": "miniwob-g1-s7", "environment": "miniwob",
                                                "instruction": "type it", "parameters": {"task": "g1"}},
            "steps": [{"state": "s", "action": 'type [1] "x"', "next_state": "s", "reward": 1.0, "done": True}],
            "success": True, "return": 1.0, "source": "real"}
    (tmp_path / "seed.jsonl").write_text(json.dumps(seed) + "\n")
    monkeypatch.setattr("sys.argv", ["action_format.py", "miniwob/real-ppo-seed1", "sim-to-real",
                                     "--results", str(tmp_path), "--trajectories", str(tmp_path / "seed.jsonl")])
    action_format.main()
    assert capsys.readouterr().out.endswith("type 12%; on typing tasks 1 games, typed in 1, won 0\n")
    monkeypatch.setattr("sys.argv", ["action_format.py", "miniwob/real-ppo-seed1", "synthetic_ppo",
                                     "--results", str(tmp_path)])
    with pytest.raises(SystemExit, match=r"miniwob/real-ppo-seed1: no games of policy 'synthetic_ppo'"):
        action_format.main()


def test_synthetic_verbs_splits_episodes_by_whether_their_task_needs_typing(tmp_path, capsys, monkeypatch):
    """research/synthetic_verbs.py: a task kind whose seed wins all type needs typing; each synthetic episode counts
    in its split, and a simulated win on a typing task that never typed is listed with the simulator's reasoning."""
    from components.data.contract import Step, Task, Trajectory
    from research import synthetic_verbs

    def episode(kind: str, actions: list[str], won: bool, fallback: bool = False) -> Trajectory:
        steps = [Step("s", action, "s", float(won and i == len(actions) - 1), i == len(actions) - 1,
                      {"fallback": fallback, "reasoning": "Reward 1: the task is complete"})
                 for i, action in enumerate(actions)]
        task = Task(f"miniwob-{kind}-s1", "miniwob", "do it", {"task": kind})
        return Trajectory(f"{kind}-{len(actions)}-{won}", task, steps, won, float(won), "synthetic")

    seed = [episode("enter-text", ['type [1] "a"', "click [2]"], True), episode("click-button", ["click [1]"], True),
            episode("click-button", ['type [1] "b"', "click [1]"], True)]
    (tmp_path / "seed.jsonl").write_text("".join(json.dumps(t.to_dict()) + "\n" for t in seed))
    synthetic = [episode("enter-text", ["click [2]"], True),
                 episode("enter-text", ['type [1] "a"', "click [2]"], True),
                 episode("enter-text", ['type [1] "a"'], False, fallback=True),
                 episode("click-button", ["click [1]"], False)]
    (tmp_path / "episodes.jsonl").write_text("".join(json.dumps({"iteration": 1, "trajectory": t.to_dict()}) + "\n"
                                                     for t in synthetic))
    monkeypatch.setattr("sys.argv", ["synthetic_verbs.py", str(tmp_path / "episodes.jsonl"),
                                     "--trajectories", str(tmp_path / "seed.jsonl")])
    synthetic_verbs.main()
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "task kinds the seed wins only by typing: enter-text"
    name = tmp_path / "episodes.jsonl"
    assert out[1:4] == [f"{name}: other task, never typed: 1 episodes, simulator won 0 (0%), 0 ended on a fallback",
                        f"{name}: typing task, never typed: 1 episodes, simulator won 1 (100%), 0 ended on a fallback",
                        f"{name}: typing task, typed: 2 episodes, simulator won 1 (50%), 1 ended on a fallback"]
    assert out[4].startswith("  won without typing: miniwob-enter-text-s1 ['click [2]']")
    monkeypatch.setattr("sys.argv", ["synthetic_verbs.py", "no-such-file.jsonl",
                                     "--trajectories", str(tmp_path / "seed.jsonl")])
    with pytest.raises(SystemExit, match="no-such-file.jsonl: no such file"):
        synthetic_verbs.main()
    monkeypatch.setattr("sys.argv", ["synthetic_verbs.py", str(name), "--trajectories", str(tmp_path / "none.jsonl")])
    with pytest.raises(SystemExit, match=r"none.jsonl: no seed trajectories \(`dvc checkout data.dvc`"):
        synthetic_verbs.main()


def test_a_claim_pairs_the_games_both_methods_played(tmp_path):
    """8/12 against 2/12 overlaps as intervals, but when the second's two wins are among the first's eight, the six
    games only the first won are a difference (p = 2/64); a run that kept no games falls back to the intervals."""
    tw = "textworld-cooking"
    _run(tmp_path, "dreamgym-grpo-seed0", {"sft_warm_start": {tw: _evaluation(2, 12)},
                                           "synthetic_grpo": {tw: _evaluation(8, 12)},
                                           "sim-to-real": {tw: _evaluation(3, 12)}}, s2r_used=16, synthetic=40)
    _games(tmp_path / "dreamgym-grpo-seed0", "sft_warm_start", {0, 1})
    _games(tmp_path / "dreamgym-grpo-seed0", "synthetic_grpo", set(range(8)))
    _games(tmp_path / "dreamgym-grpo-seed0", "sim-to-real", {0, 1, 9})
    _run(tmp_path, "real-grpo-seed0", {"sim-to-real": {tw: _evaluation(9, 12)}}, s2r_used=160,
         start_from="sft")  # no games kept
    runs = finished_runs(tmp_path)
    metrics, _ = aggregate(runs)
    rows = {line.split(" | ")[0].strip("| "): line
            for line in claim_verdicts(metrics, ("grpo",), paired_games(runs)).splitlines()}

    assert "supported: A higher, of 12 games both played, A alone won 6, B alone 0; sign test p = 0.031" in rows[
        "Synthetic-only RL improves on the warm start"]
    # 5 to 0 is p = 0.0625: not yet; the same against A is a contradiction once it reaches 6 to 0
    def rows_for(a_won, b_won):
        rates = {"SFT only": {tw: _rates(len(b_won), 12)}, "DreamGym (GRPO)": {tw: _rates(len(a_won), 12)}}
        games = {("DreamGym (GRPO)", tw): {(0, f"g{i}"): i in a_won for i in range(12)},
                 ("SFT only", tw): {(0, f"g{i}"): i in b_won for i in range(12)}}
        return {line.split(" | ")[0].strip("| "): line for line in claim_verdicts(rates, ("grpo",), games).splitlines()}
    assert "not resolved: A higher, of 12 games both played, A alone won 5, B alone 0; sign test p = 0.062" in \
        rows_for(set(range(5)), set())["Synthetic-only RL improves on the warm start"]
    assert "contradicted: A lower, of 12 games both played, A alone won 0, B alone 6" in \
        rows_for({0}, set(range(7)))["Synthetic-only RL improves on the warm start"]
    assert "not resolved: A lower, intervals overlap" in rows[  # 3/12 against 9/12, without pairs
        "Sim-to-real on 10% of the real transitions beats real-only RL on all of them"]
    unpaired = claim_verdicts(metrics, ("grpo",))
    assert "Synthetic-only RL improves on the warm start | textworld-cooking | DreamGym (GRPO): 8/12 | SFT only: " \
           "2/12 | +50% | 56% | +28.8 points | not resolved: A higher, intervals overlap" in unpaired  # 12 games a row

    # a second seed plays games with the same ids: pairs are (seed, game), so 12 more pairs, not overwritten ones
    _run(tmp_path, "dreamgym-grpo-seed1", {"sft_warm_start": {tw: _evaluation(0, 12)},
                                           "synthetic_grpo": {tw: _evaluation(1, 12)},
                                           "sim-to-real": {tw: _evaluation(0, 12)}}, synthetic=40)
    _games(tmp_path / "dreamgym-grpo-seed1", "sft_warm_start", set())
    _games(tmp_path / "dreamgym-grpo-seed1", "synthetic_grpo", {11})
    _games(tmp_path / "dreamgym-grpo-seed1", "sim-to-real", {5})  # 1 win, but the metrics count 0: not paired
    runs = finished_runs(tmp_path)
    games = paired_games(runs)
    assert len(games[("DreamGym (GRPO)", tw)]) == 24 and games[("DreamGym (GRPO)", tw)][(1, "g11")] is True
    assert ("DreamGym-S2R (GRPO)", tw) not in games  # its games do not add up to its metrics: unpaired
    metrics, _ = aggregate(runs)
    assert "of 24 games both played, A alone won 7, B alone 0; sign test p = 0.016" in claim_verdicts(
        metrics, ("grpo",), games)

    # real GRPO has seed 0 only: S2R is compared with it on seed 0's 3/12, not on both seeds' 3/24 (the table's)
    assert metrics["DreamGym-S2R (GRPO)"][tw]["successes"] == 3 and metrics["DreamGym-S2R (GRPO)"][tw]["episodes"] == 24
    s2r = ("DreamGym-S2R (GRPO)", "GRPO in the real environment")
    matched = {(c.method_a, c.method_b): c for c in comparisons(metrics, ("grpo",), games, runs=runs)}[s2r]
    assert (matched.a["successes"], matched.a["episodes"], matched.a["seeds"]) == (3, 12, [0])
    assert (matched.b["successes"], matched.b["episodes"], matched.b["seeds"]) == (9, 12, [0])
    assert matched.observed == -0.5
    pooled = {(c.method_a, c.method_b): c for c in comparisons(metrics, ("grpo",), games)}[s2r]  # without runs
    assert pooled.a["episodes"] == 24


def test_kept_runs_make_a_report_with_runs_and_learning_curves(tmp_path):
    tw = "textworld-cooking"
    metrics_dir = tmp_path / "metrics"
    metrics_dir.mkdir()
    (metrics_dir / "evaluate_policies.json").write_text(json.dumps(
        {"sft_warm_start": {tw: _evaluation(1, 4)}, "synthetic_grpo": {tw: _evaluation(2, 4)},
         "sim-to-real": {tw: _evaluation(3, 4)},
         "synthetic_replay": {tw: {"episodes": 8, "synthetic_successes": 3, "real_successes": 1, "both": 1,
                                   "synthetic_only": 2, "real_only": 0, "unreplayable": 0}}}))
    (metrics_dir / "synthetic_rl.json").write_text(json.dumps({"iterations": 2, "synthetic_transitions": 32,
                                                                   "seconds": 240.0,
                                                                   "experience_model": {"fallback_rate": 1 / 601}}))
    (metrics_dir / "sim_to_real.json").write_text(json.dumps(
        {"start_from": "synthetic_rl", "iterations": 1, "episodes": 2, "real_transitions_used": 16, "seconds": 60.0}))
    (metrics_dir / "synthetic_rl_iterations.csv").write_text(
        "iteration,reward_mean,tasks,grad_norm\n1,0.0,tw-a,0.0\n2,0.5,tw-b,0.12\n")
    (metrics_dir / "sim_to_real_iterations.csv").write_text(  # both episodes won: GRPO had no advantage
        "iteration,reward_mean,success_rate,env_transitions,grad_norm\n1,1.0,1.0,16,0.0\n")
    results = tmp_path / "results"
    (results / "dreamgym-grpo-seed0").mkdir(parents=True)  # an earlier copy of the run: replaced whole
    (results / "dreamgym-grpo-seed0" / "stale.json").write_text("{}")
    record = {"run": "dreamgym-grpo-seed0", "profile": "quick", "commit": "e54f2c8abc", "seconds": 600.0,
              "params_set": {"seed": 0}}

    reports_dir = tmp_path / "reports"
    reports_dir.mkdir()
    _games(reports_dir, "sim-to-real", {0, 1, 2}, played=4)

    run_dir = keep_run(results / "dreamgym-grpo-seed0", record, tmp_path)

    assert sorted(p.name for p in results.iterdir()) == ["dreamgym-grpo-seed0"]
    assert not (run_dir / "stale.json").exists()
    assert finished_runs(results)[0].games == {("sim-to-real", tw): {"g0": True, "g1": True, "g2": True, "g3": False}}
    assert json.loads((run_dir / "run.json").read_text()) == record
    metrics, text = report(results, 0.95, ("grpo",))
    assert metrics["DreamGym-S2R (GRPO)"][tw]["successes"] == 3
    assert "| dreamgym-grpo-seed0 | quick | e54f2c8a | ? | 10.0 | ? | 5.0 | 2 | 32 | 0.2% | 1/3 |" in text  # not "0%"
    assert "| synthetic_rl | 1 | 2/2 | 16 | 1/2; 0/1 |" in text  # its real RL won its 2 episodes, learning nothing
    # episodes on curriculum variations have no real game: the audit names them rather than leaving them out unsaid
    audit = json.loads((run_dir / "evaluate_policies.json").read_text())
    audit["synthetic_replay"][tw]["unreplayable"] = 5
    (run_dir / "evaluate_policies.json").write_text(json.dumps(audit))
    assert "| 0.2% | 1/3 (5 episodes on variations not replayable) |" in report(results, 0.95, ("grpo",))[1]
    assert metrics["DreamGym-S2R (GRPO)"][tw]["runs_never_updated"] == 1
    assert metrics["DreamGym (GRPO)"][tw]["runs_never_updated"] == 0
    assert "1 finished runs" in text and "## The paper's claims at this scale" in text
    assert (results / "results_study_curves.png").stat().st_size > 1000 and "results_study_curves.png" in text
    assert 'profile quick)' in text

    # a run of another profile in the same folder would be pooled with these: the report refuses, naming both
    keep_run(results / "real-grpo-seed0", {**record, "run": "real-grpo-seed0", "profile": "cpu"}, tmp_path)
    with pytest.raises(ParamsError, match=r"different profiles .*'dreamgym-grpo-seed0': 'quick'.*'cpu'"):
        report(results, 0.95, ("grpo",))


def test_a_finished_run_is_skipped_at_its_own_profile_and_refused_at_another(tmp_path):
    """A study pools the runs of its results folder, so a run finished at the quick profile must not count as a cpu
    run: the study stops and names the folder and the fix. "custom" params cannot be told apart: trusted."""
    run_dir = tmp_path / "dreamgym-grpo-seed0"
    assert not is_finished(run_dir, "cpu")  # never ran
    (run_dir).mkdir()
    (run_dir / "evaluate_policies.json").write_text("{}")
    (run_dir / "run.json").write_text(json.dumps({"profile": "quick"}))

    assert is_finished(run_dir, "quick") and is_finished(run_dir, "custom")
    with pytest.raises(ParamsError, match=r"seed0: finished at profile 'quick'.*'cpu'.*study.results_dir"):
        is_finished(run_dir, "cpu")

    # at the same profile, a changed budget is another run; playing other policies is not
    (run_dir / "run.json").write_text(json.dumps({"profile": "quick", "params_set": {
        "seed": 0, "sim_to_real.real_transitions": 16, "evaluate.policies": ["synthetic_rl", "train_policy_sft"]}}))
    assert is_finished(run_dir, "quick", {"seed": 0, "sim_to_real.real_transitions": 16,
                                          "evaluate.policies": ["synthetic_rl"], "synthetic_rl.algorithm": "grpo"})
    with pytest.raises(ParamsError, match=r"finished with sim_to_real.real_transitions=16, but this study sets "
                                          r"sim_to_real.real_transitions=33 .*delete .*seed0 to run it again"):
        is_finished(run_dir, "quick", {"seed": 0, "sim_to_real.real_transitions": 33})


def test_the_committed_cpu_study_report_is_what_its_kept_runs_make(tmp_path, monkeypatch):
    """`dreamgym study report` remakes a study's report from its kept runs alone (runs copied in from other
    checkouts), running nothing: from the CPU study's committed runs, it writes the committed report, word for word."""
    repo = Path(__file__).resolve().parents[1]
    kept = Path("reports/results_study_cpu_first_edition")
    shutil.copytree(repo / kept, tmp_path / kept, ignore=shutil.ignore_patterns("*.png", "README.md"))
    shutil.copytree(repo / "profiles", tmp_path / "profiles")  # params.yaml's profile (quick) is not the runs' (cpu)
    monkeypatch.chdir(tmp_path)

    assert main(["--params", str(repo / "params.yaml"), "--set", f"study.results_dir={kept}", "study", "report"]) == 0

    assert (kept / "README.md").read_text() == (repo / kept / "README.md").read_text()
    assert Path("reports/results_study.md").read_text() == (kept / "README.md").read_text()
    assert json.loads(Path("metrics/results_study.json").read_text())["SFT only"]["textworld-cooking"]["episodes"] == 22
    assert (kept / "results_study.png").is_file() and Path("reports/results_study.png").is_file()


def test_the_detectable_difference_shrinks_with_the_square_root_of_the_games():
    """McNemar's normal approximation at p < 0.05 and 80% power: (1.96 + 0.84) * sqrt(discordant share / games),
    never below (1.96 + 0.84)^2 / games (a difference is made of split games). 22 games cannot see less than 36
    points whatever the policies do; 200 games x 3 seeds with 30% of them split see 6."""
    assert detectable_difference(22, 0.3) == detectable_difference(22, 0.0) == pytest.approx(0.357, abs=1e-3)
    assert detectable_difference(600, 0.3) == pytest.approx(0.063, abs=1e-3)
    assert detectable_difference(800, 0.3) == pytest.approx(detectable_difference(200, 0.3) / 2)
    assert detectable_difference(600, 0.3, confidence=0.99) > detectable_difference(600, 0.3)
    assert detectable_difference(600, 0.3, power=0.9) > detectable_difference(600, 0.3)
    assert detectable_difference(0, 0.3) == 1.0
