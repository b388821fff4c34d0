"""components/study.py: the variants' params and the pooling of held-out episodes into the results table."""
from __future__ import annotations

import json

from components.evaluation import wilson_interval
from components.study import aggregate, run_overrides, success_plot, variants


def _evaluation(successes: int, episodes: int) -> dict:
    """The per-environment numbers evaluate_policies writes (EvaluationResult.metrics)."""
    return {"episodes": episodes, "successes": successes, "success_rate": successes / episodes,
            "success_ci_low": 0.0, "success_ci_high": 1.0, "mean_return": 0.0, "mean_steps": 5.0, "wall_s": 1.0}


def _run(results, name, evaluated, s2r_used=0, synthetic=0):
    run_dir = results / name
    run_dir.mkdir(parents=True)
    (run_dir / "evaluate_policies.json").write_text(json.dumps(evaluated))
    (run_dir / "sim_to_real.json").write_text(json.dumps({"real_transitions_used": s2r_used}))
    (run_dir / "synthetic_rl.json").write_text(json.dumps({"synthetic_transitions": synthetic}))


def test_budgets_follow_the_variant():
    by_name = {v.name: v for v in variants()}
    assert run_overrides(by_name["real-grpo"], 1, 160, 0.1) == {
        "synthetic_rl.algorithm": "grpo", "sim_to_real.start_from": "sft", "seed": 1,
        "sim_to_real.real_transitions": 160}
    assert run_overrides(by_name["dreamgym-ppo"], 0, 160, 0.1)["sim_to_real.real_transitions"] == 16
    assert run_overrides(by_name["no-curriculum"], 0, 160, 0.1)["synthetic_rl.curriculum.enabled"] is False
    assert [v.name for v in variants(("grpo",))] == ["dreamgym-grpo", "real-grpo", "no-curriculum", "no-retrieval",
                                                      "no-reasoning"]


def test_episodes_pool_over_seeds_with_a_wilson_interval(tmp_path):
    tw = "textworld-cooking"
    for seed, (sft, dream, s2r) in enumerate([(1, 2, 3), (2, 3, 5)]):
        _run(tmp_path, f"dreamgym-grpo-seed{seed}",
             {"skipped": [], "sft_warm_start": {tw: _evaluation(sft, 6), "next_action": {"accuracy": 0.5}},
              "synthetic_grpo": {tw: _evaluation(dream, 6)}, "sim-to-real": {tw: _evaluation(s2r, 6)}},
             s2r_used=16, synthetic=40 + seed)
    _run(tmp_path, "real-grpo-seed0", {"sim-to-real": {tw: _evaluation(4, 6)}}, s2r_used=150, synthetic=40)
    (tmp_path / "no-retrieval-seed0.partial").mkdir()  # an unfinished run is not counted

    metrics, table = aggregate(tmp_path)

    assert list(metrics) == ["SFT only", "DreamGym (GRPO)", "DreamGym-S2R (GRPO)", "GRPO in the real environment"]
    s2r = metrics["DreamGym-S2R (GRPO)"][tw]
    assert (s2r["episodes"], s2r["successes"], s2r["seeds"]) == (12, 8, [0, 1])
    assert (s2r["success_ci_low"], s2r["success_ci_high"]) == wilson_interval(8, 12, 0.95)
    assert s2r["real_transitions_mean"] == 16 and metrics["DreamGym (GRPO)"][tw]["real_transitions_mean"] == 0
    assert metrics["GRPO in the real environment"][tw]["real_transitions_mean"] == 150
    assert metrics["SFT only"][tw]["synthetic_transitions_mean"] == 0
    assert "| DreamGym-S2R (GRPO) | textworld-cooking | 0.67 [" in table
    assert success_plot(metrics, tmp_path / "results.png").stat().st_size > 1000
