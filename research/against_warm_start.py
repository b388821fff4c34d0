"""Every kept policy of every standing run against its own warm start, game by game on the held-out games
both played: which trainings moved the policy, which way, and which lost what the warm start had.

    python research/against_warm_start.py [--results reports/results_study/cpu] [--alpha 0.05]

A run's warm start is the model the study's report names (its seed and a letter: one name, one model); its games
are those of the `sft_warm_start` policy a run with that warm start kept (sft-only-seedN, or a DreamGym run made
before the warm start had a row of its own). A run whose warm start no run played is named, not paired. Prints a
markdown table, a line a policy: the games both played, each one's wins, the games only one won, the exact sign
test on them and a reading: "lost" or "won" where p < alpha, "no difference" otherwise. The study's verdicts pool
seeds; this is the per-run health check of each baseline and method that the pooled verdicts rest on.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from components.results.study import WARM_START_LABEL, finished_runs, paired_counts, sign_test, warm_starts


def kept_policies(results: Path) -> tuple[dict[tuple[str, str, str], dict[str, bool]], dict[str, str]]:
    """(environment, run, policy) -> task id -> won for every standing run's kept games, and each run's warm start
    name (the study's: its seed and a letter, one name a model)."""
    runs = finished_runs(results)
    policies = {(environment, run.name, policy): outcomes for run in runs
                for (policy, environment), outcomes in run.games.items()}
    return policies, warm_starts(runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", type=Path, default=Path("reports/results_study/cpu"))
    parser.add_argument("--alpha", type=float, default=0.05)
    args = parser.parse_args()
    policies, starts = kept_policies(args.results)
    warm = {(environment, starts[run]): outcomes for (environment, run, policy), outcomes in policies.items()
            if policy == WARM_START_LABEL and starts[run] != "?"}
    readings = []
    print("| run | warm start | policy | games | wins | warm start wins | alone | warm start alone | p | reading |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    unpaired = set()
    for (environment, run, policy), outcomes in sorted(policies.items()):
        start = starts[run]
        if policy == WARM_START_LABEL:
            continue
        if (environment, start) not in warm:  # "?" (no training record) is never paired: it names no model
            unpaired.add(f"{run} (no run played warm start {start} on the held-out games)")
            continue
        base = warm[(environment, start)]
        pairs = paired_counts(outcomes, base)
        if pairs is None:
            unpaired.add(f"{run} (no held-out game in common with warm start {start})")
            continue
        shared, alone, warm_alone = pairs
        common = outcomes.keys() & base.keys()
        p = sign_test(alone, warm_alone)
        reading = "no difference" if p >= args.alpha else ("won" if alone > warm_alone else "lost")
        readings.append((p, reading, f"{run} {policy}"))
        print(f"| {run} | {start} | {policy} | {shared} | {sum(outcomes[g] for g in common)} | "
              f"{sum(base[g] for g in common)} | {alone} | {warm_alone} | {p:.2g} | {reading} |")
    if not readings:
        raise SystemExit(f"{args.results}: no run's policy could be paired with its warm start's games")
    # Many tests at one alpha: say how many readings chance alone would give, and which survive Bonferroni.
    moved = [r for r in readings if r[1] != "no difference"]
    survivors = [f"{name} ({reading}, p = {p:.2g})" for p, reading, name in readings if p < args.alpha / len(readings)]
    won = sum(reading == "won" for _, reading, _ in moved)
    print(f"\n{len(readings)} policies: {won} won and {len(moved) - won} lost against their warm start at "
          f"p < {args.alpha} (about {args.alpha * len(readings):.1f} in all expected by chance if none moved); "
          f"p < {args.alpha / len(readings):.2g} (Bonferroni): {'; '.join(survivors) or 'none'}")
    if unpaired:
        print(f"\nleft out, unpaired with their warm start: {'; '.join(sorted(unpaired))}")


if __name__ == "__main__":
    main()
