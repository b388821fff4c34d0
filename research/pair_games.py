"""Two kept runs' policies, game by game on the held-out games both played: the pairing the study's verdicts make,
for any two runs (another seed's, another warm start's) rather than two methods pooled over seeds.

    python research/pair_games.py RUN_A POLICY_A RUN_B POLICY_B [--results reports/results_study/cpu]

A run is its folder under the results folder (textworld-cooking/real-grpo-seed1); a policy is an
evaluate_policies label (sft_warm_start, synthetic_grpo, synthetic_ppo, sim-to-real). Prints the games both played,
each one's wins, the games only one won and the exact sign test on them (McNemar's, two-sided).
"""
from __future__ import annotations

import argparse
from pathlib import Path

from components.results.study import KEPT_GAMES, paired_counts, read_games, sign_test


def policy_games(results: Path, run: str, policy: str) -> dict[tuple[str, str], bool]:
    """(environment, task id) -> won for `policy` in `run`'s kept games; an error naming what the run has if not."""
    games = read_games(results / run / KEPT_GAMES)
    if not games:
        raise SystemExit(f"{results / run / KEPT_GAMES}: no kept games (is {run!r} a finished run's folder?)")
    found = {(environment, task): won for (label, environment), outcomes in games.items() if label == policy
             for task, won in outcomes.items()}
    if not found:
        raise SystemExit(f"{run}: no games of policy {policy!r}; it kept {sorted({label for label, _ in games})}")
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for side in ("a", "b"):
        parser.add_argument(f"run_{side}")
        parser.add_argument(f"policy_{side}")
    parser.add_argument("--results", type=Path, default=Path("reports/results_study/cpu"))
    args = parser.parse_args()
    a = policy_games(args.results, args.run_a, args.policy_a)
    b = policy_games(args.results, args.run_b, args.policy_b)
    pairs = paired_counts(a, b)
    if pairs is None:
        raise SystemExit(f"{args.run_a} {args.policy_a} and {args.run_b} {args.policy_b} played no game in common")
    shared, a_only, b_only = pairs
    common = a.keys() & b.keys()
    print(f"{shared} games both played; A ({args.run_a} {args.policy_a}) won {sum(a[g] for g in common)}, "
          f"B ({args.run_b} {args.policy_b}) {sum(b[g] for g in common)}; A alone {a_only}, B alone {b_only}; "
          f"sign test p = {sign_test(a_only, b_only):.2g}")


if __name__ == "__main__":
    main()
