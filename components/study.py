"""The results study: the paper's Table 1 on our environments, assembled from pipeline runs.

Each *variant* is one pipeline run with a few params overridden (flows/study.py runs it as a `dvc exp run` and keeps
its evaluation metrics in `RESULTS_DIR/<variant>-seed<k>/`). One run yields several rows of the table: the default
run evaluates the warm start (SFT only), the synthetic-RL policy (DreamGym) and the sim-to-real policy
(DreamGym-S2R) side by side. `aggregate` pools each method's held-out episodes over seeds (Wilson interval on the
pooled episodes) and writes the table, a plot and JSON metrics.

Budgets: `real_budget` B is the real-environment RL baseline's budget of real transitions; DreamGym-S2R gets
`s2r_share` x B (the paper: at most 10%). DreamGym itself uses no real transition beyond the seed.
"""
from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from components.config import ParamsError
from components.evaluation import wilson_interval
from components.reports import markdown_table, pyplot, save_figure


@dataclass(frozen=True)
class Variant:
    name: str
    overrides: dict[str, Any]  # dotted params for this run (on top of the seed and budgets)
    rows: dict[str, str]  # evaluate_policies label -> the method (row of the table) it stands for
    real_budget: str  # which budget sim_to_real gets: "s2r" (s2r_share x B) or "full" (B)


def variants(algorithm_names: tuple[str, ...] = ("grpo", "ppo")) -> list[Variant]:
    """The runs that fill the table, per algorithm, then the three ablations (on GRPO, as in the paper)."""
    found = []
    for algorithm in algorithm_names:
        upper = algorithm.upper()
        found += [
            Variant(f"dreamgym-{algorithm}", {"synthetic_rl.algorithm": algorithm},
                    {"sft_warm_start": "SFT only", f"synthetic_{algorithm}": f"DreamGym ({upper})",
                     "sim-to-real": f"DreamGym-S2R ({upper})"}, "s2r"),
            Variant(f"real-{algorithm}", {"synthetic_rl.algorithm": algorithm, "sim_to_real.start_from": "sft"},
                    {"sim-to-real": f"{upper} in the real environment"}, "full"),
        ]
    found += [
        Variant("no-curriculum", {"synthetic_rl.curriculum.enabled": False},
                {"synthetic_grpo": "DreamGym (GRPO) w/o curriculum"}, "s2r"),
        Variant("no-retrieval", {"experience_model.prompt.use_retrieval": False},
                {"synthetic_grpo": "DreamGym (GRPO) w/o retrieval"}, "s2r"),
        Variant("no-reasoning", {"experience_model.prompt.use_reasoning": False},
                {"synthetic_grpo": "DreamGym (GRPO) w/o reasoning"}, "s2r"),
    ]
    return found


def run_overrides(variant: Variant, seed: int, real_budget: int, s2r_share: float) -> dict[str, Any]:
    """Every param a variant's run sets: its own, the seed, and the real budget of its sim-to-real stage."""
    budget = real_budget if variant.real_budget == "full" else int(s2r_share * real_budget)
    return {**variant.overrides, "seed": seed, "sim_to_real.real_transitions": budget}


# kept from each run's metrics/: the evaluation, both RL stages' summaries and their per-iteration logs
RUN_FILES = ("evaluate_policies.json", "sim_to_real.json", "synthetic_rl.json", "synthetic_rl_iterations.csv",
             "sim_to_real_iterations.csv")
RUN_RECORD = "run.json"  # what the study wrote about the run: variant, seed, params set, profile, commit, seconds


def select_variants(algorithm_names: tuple[str, ...], names: list[str] | tuple[str, ...] = ()) -> list[Variant]:
    """The variants to run: all of them, or those named (a study split over machines, or one row rerun)."""
    every = variants(algorithm_names)
    unknown = sorted(set(names) - {v.name for v in every})
    if unknown:
        raise ParamsError(f"study.variants: unknown {', '.join(unknown)}; the variants of algorithms "
                         f"{list(algorithm_names)} are {', '.join(v.name for v in every)}")
    return [v for v in every if not names or v.name in names]


def keep_run(run_dir: str | Path, record: dict[str, Any], metrics_dir: str | Path = "metrics") -> Path:
    """Copy a finished run's RUN_FILES and its record into `run_dir`, whole or not at all (a rerun skips it)."""
    run_dir = Path(run_dir)
    partial = run_dir.with_name(run_dir.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    for file_name in RUN_FILES:
        source = Path(metrics_dir) / file_name
        if source.is_file():
            shutil.copy(source, partial / file_name)
    (partial / RUN_RECORD).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    shutil.rmtree(run_dir, ignore_errors=True)
    partial.rename(run_dir)
    return run_dir


def aggregate(results_dir: str | Path, confidence: float = 0.95) -> tuple[dict[str, Any], str]:
    """Pool every method's held-out episodes over the runs in `results_dir`; the metrics and a markdown table.

    A run directory is `<variant>-seed<k>` holding RUN_FILES. Methods appear in the order of `variants()`.
    """
    results_dir = Path(results_dir)
    known = {v.name: v for v in variants()}
    pooled: dict[tuple[str, str], dict[str, Any]] = {}  # (method, environment) -> counts
    for run_dir in sorted(p for p in results_dir.iterdir() if p.is_dir() and "-seed" in p.name):
        name, seed = run_dir.name.rsplit("-seed", 1)
        if name not in known or not (run_dir / "evaluate_policies.json").is_file():
            continue
        evaluated = json.loads((run_dir / "evaluate_policies.json").read_text(encoding="utf-8"))
        s2r = _read(run_dir / "sim_to_real.json")
        synthetic = _read(run_dir / "synthetic_rl.json")
        for label, method in known[name].rows.items():
            for environment, result in evaluated.get(label, {}).items():
                if environment == "next_action":
                    continue
                entry = pooled.setdefault((method, environment), {
                    "episodes": 0, "successes": 0, "seeds": [], "real_transitions": [], "synthetic_transitions": []})
                entry["episodes"] += result["episodes"]
                entry["successes"] += result["successes"]
                entry["seeds"].append(int(seed))
                entry["real_transitions"].append(s2r.get("real_transitions_used", 0) if label == "sim-to-real" else 0)
                entry["synthetic_transitions"].append(
                    synthetic.get("synthetic_transitions", 0) if label != "sft_warm_start" else 0)
    order = [method for v in variants() for method in v.rows.values()]
    metrics: dict[str, Any] = {}
    rows = []
    for (method, environment), entry in sorted(pooled.items(), key=lambda item: (order.index(item[0][0]),
                                                                                   item[0][1])):
        n, k = entry["episodes"], entry["successes"]
        low, high = wilson_interval(k, n, confidence)
        metrics.setdefault(method, {})[environment] = {
            "episodes": n, "successes": k, "success_rate": k / n if n else 0.0, "success_ci_low": low,
            "success_ci_high": high, "seeds": sorted(entry["seeds"]),
            "real_transitions_mean": sum(entry["real_transitions"]) / len(entry["real_transitions"]),
            "synthetic_transitions_mean": sum(entry["synthetic_transitions"]) / len(entry["synthetic_transitions"])}
        m = metrics[method][environment]
        rows.append([method, environment, f"{m['success_rate']:.2f} [{low:.2f}, {high:.2f}]", n,
                     len(entry["seeds"]), f"{m['real_transitions_mean']:.0f}",
                     f"{m['synthetic_transitions_mean']:.0f}"])
    table = markdown_table(["method", "environment", f"held-out success [{confidence:.0%} CI]", "episodes",
                            "seeds", "real transitions (RL)", "synthetic transitions"], rows)
    return metrics, table


def success_plot(metrics: dict[str, Any], path: str | Path) -> Path | None:
    """Held-out success with confidence intervals, one bar per method and environment."""
    bars = [(f"{method}\n{environment}", m) for method, by_env in metrics.items() for environment, m in by_env.items()]
    if not bars:
        return None
    figure, axis = pyplot().subplots(figsize=(max(4.0, 0.9 * len(bars)), 3.6))
    rates = [m["success_rate"] for _, m in bars]
    errors = [[r - m["success_ci_low"] for r, (_, m) in zip(rates, bars, strict=True)],
              [m["success_ci_high"] - r for r, (_, m) in zip(rates, bars, strict=True)]]
    axis.bar(range(len(bars)), rates, yerr=errors, capsize=3)
    axis.set_xticks(range(len(bars)), [label for label, _ in bars], rotation=60, ha="right", fontsize=7)
    axis.set_ylabel("held-out success")
    axis.set_ylim(0, 1)
    return save_figure(figure, path)


def _read(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
