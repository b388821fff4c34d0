"""The results study: the paper's Table 1 on our environments, assembled from pipeline runs.

Each *variant* is one pipeline run with a few params overridden (flows/study.py runs it as a `dvc exp run` and keeps
its evaluation metrics in `RESULTS_DIR/<environment>/<variant>-seed<k>/`: each run trains its experience model and
policy on one environment). One run yields one or more rows of the table: a DreamGym run evaluates the synthetic-RL
policy (DreamGym) and the sim-to-real policy (DreamGym-S2R) side by side; the warm start (SFT only), which every run
of a seed starts from, is a run of its own. `aggregate` pools each method's held-out episodes over seeds (Wilson
interval on the pooled episodes) and writes the table, a plot and JSON metrics.

Budgets: `real_budget` B is the real-environment RL baseline's budget of real transitions; DreamGym-S2R gets
`s2r_share` x B (the paper: at most 10%). DreamGym itself uses no real transition beyond the seed. DreamGym-S2R with
on-policy correction (stages/correction_rounds.py) spends the same `s2r_share` x B: sim-to-real after its last round
(about half, in whole iterations) and the rest on the rounds' replay audits, whose real transitions correct the
experience model.
"""
from __future__ import annotations

import csv
import json
import math
import shutil
from dataclasses import dataclass
from itertools import accumulate
from pathlib import Path
from statistics import NormalDist
from string import ascii_lowercase
from typing import Any

from components.config import ParamsError
from components.data.contract import append_records, read_records
from components.envs.registry import has_adapter
from components.files import atomic_directory, atomic_write_text
from components.reports import (
    GAMES_FILE,
    markdown_table,
    metrics_path,
    pyplot,
    report_path,
    save_figure,
    write_csv,
    write_stage_outputs,
)
from components.results.evaluation import SIMULATED
from components.stats import wilson_interval

WARM_START_LABEL, WARM_START_METHOD = "sft_warm_start", "SFT only"  # evaluate_policies' label, the table's row


@dataclass(frozen=True)
class Variant:
    name: str
    overrides: dict[str, Any]  # dotted params for this run (on top of the seed and budgets)
    rows: dict[str, str]  # evaluate_policies label -> the method (row of the table) it stands for
    real_budget: str  # what it spends: "s2r" (s2r_share x B in sim_to_real), "full" (B), "correction" (run_overrides),
    # "none" (no sim-to-real)
    target: str = "evaluate_policies"  # the DVC stage its run ends with
    costs_like: str | None = None  # the variant whose finished runs estimate its cost until it has its own


    @property
    def measures_simulator(self) -> bool:
        """Whether its run also scores its experience model (evaluate_experience_model): a run whose policies come
        from synthetic RL. Correction rounds score theirs every round; a real-only baseline's policy never met it."""
        return self.target == "evaluate_policies" and any(label.startswith("synthetic_") for label in self.rows)

    @property
    def policies(self) -> list[str]:
        """The policies its run evaluates (evaluate.policies, by training stage): its rows' only, as each held-out
        evaluation costs minutes on a CPU (the warm start is played once per seed, in its own run). Correction rounds
        evaluate their own policies, and their run's pipeline plays none (`stages_not_needed`): the warm start, named
        here, is another run's of the seed too."""
        if self.target == "correction_rounds":
            return ["train_policy_sft"]
        stages = {WARM_START_LABEL: "train_policy_sft", "sim-to-real": "sim_to_real"}
        return sorted({stages.get(label, "synthetic_rl") for label in self.rows})


def variants(algorithm_names: tuple[str, ...] = ("grpo", "ppo")) -> list[Variant]:
    """The runs that fill the table: the warm start (SFT only, the same policy for every algorithm, so one run a
    seed, first: it trains what every other run of the seed starts from), the runs of each algorithm, then the three
    ablations (on GRPO, as in the paper). Beside the paper's rows, real-environment RL at DreamGym-S2R's budget:
    without it, S2R's gain over the warm start cannot be told apart from what its few real transitions alone buy."""
    found = [Variant("sft-only", {"sim_to_real.start_from": "sft"}, {WARM_START_LABEL: WARM_START_METHOD}, "none")]
    for number, algorithm in enumerate(algorithm_names):
        upper = algorithm.upper()

        def like(prefix: str, suffix: str = "") -> str | None:  # the first algorithm's runs of the same kind
            return f"{prefix}-{algorithm_names[0]}{suffix}" if number else None
        found += [
            Variant(f"dreamgym-{algorithm}", {"synthetic_rl.algorithm": algorithm},
                    {f"synthetic_{algorithm}": f"DreamGym ({upper})",
                     "sim-to-real": f"DreamGym-S2R ({upper})"}, "s2r", costs_like=like("dreamgym")),
            Variant(f"real-{algorithm}", {"synthetic_rl.algorithm": algorithm, "sim_to_real.start_from": "sft"},
                    {"sim-to-real": f"{upper} in the real environment"}, "full", costs_like=like("real")),
            # DreamGym-S2R's real transitions spent from the warm start: what synthetic RL adds to sim-to-real
            Variant(f"real-{algorithm}-s2r-budget", {"synthetic_rl.algorithm": algorithm,
                                                     "sim_to_real.start_from": "sft"},
                    {"sim-to-real": f"{upper} in the real environment at S2R's budget"}, "s2r",
                    costs_like=like("real", "-s2r-budget")),
        ]
    grpo = {"synthetic_rl.algorithm": "grpo"}  # whatever params.yaml says: the rows are GRPO's
    # an ablation runs DreamGym's stages (its experience model reads or writes less): DreamGym (GRPO)'s runs
    # estimate its cost until it has runs of its own
    found += [
        Variant("no-curriculum", {**grpo, "synthetic_rl.curriculum.enabled": False},
                {"synthetic_grpo": "DreamGym (GRPO) w/o curriculum"}, "s2r", costs_like="dreamgym-grpo"),
        Variant("no-retrieval", {**grpo, "experience_model.prompt.use_retrieval": False},
                {"synthetic_grpo": "DreamGym (GRPO) w/o retrieval"}, "s2r", costs_like="dreamgym-grpo"),
        Variant("no-reasoning", {**grpo, "experience_model.prompt.use_reasoning": False},
                {"synthetic_grpo": "DreamGym (GRPO) w/o reasoning"}, "s2r", costs_like="dreamgym-grpo"),
        Variant("s2r-correction", {**grpo, "correction.feedback": True},
                {"sim-to-real": "DreamGym-S2R (GRPO) + correction"}, "correction", "correction_rounds"),
    ]
    return found


def measured_elsewhere(row: PlannedRun, runs: list[Run]) -> Run | None:
    """A finished run that evaluated what `row` would: the warm start of its environment and seed (a DreamGym run
    made before the warm start had a row of its own evaluated it too). Its games count as the row's."""
    if list(row.variant.rows) != [WARM_START_LABEL]:
        return None
    return next((run for run in runs if run.seed == row.seed and run.environment == row.environment
                 and run.name != row.name and row.environment in run.evaluated.get(WARM_START_LABEL, {})), None)


def s2r_budget(real_budget: int, s2r_share: float) -> int:
    """The real transitions DreamGym-S2R (and its correction row) may spend: `s2r_share` of B, whole."""
    return int(s2r_share * real_budget)


def run_overrides(variant: Variant, seed: int, real_budget: int, s2r_share: float, correction_rounds: int = 0,
                  sim_to_real_iteration: int = 1, environment: str | None = None, max_turns: int = 1
                  ) -> dict[str, Any]:
    """Every param a variant's run sets: its own, the seed, the real budget of its sim-to-real stage, the policies
    it evaluates and, with `environment`, the one environment its experience model and policy are trained on. A
    correction run spends DreamGym-S2R's budget as whole sim-to-real iterations of `sim_to_real_iteration` real
    transitions (about half, at least one) after its last round and the rest on the rounds' replay audits, the
    feedback, which must pay for an episode (`max_turns`) a round. ParamsError when the budget cannot pay for the
    variant's run."""
    budget = real_budget if variant.real_budget == "full" else s2r_budget(real_budget, s2r_share)
    overrides = {**variant.overrides, "seed": seed, "evaluate.policies": variant.policies}
    if variant.real_budget != "none":
        overrides["sim_to_real.real_transitions"] = budget
    if environment is not None:
        overrides |= {"experience_model.environments": [environment], "policy.environments": [environment]}
    if variant.real_budget == "correction":  # DreamGym-S2R's shape: its sim-to-real after the last round
        cost = max(sim_to_real_iteration, 1)
        if budget < cost or not correction_rounds:
            raise ParamsError(f"{variant.name}: DreamGym-S2R's real budget of {budget} pays for no sim-to-real "
                              f"iteration (one costs up to {cost}): raise study.real_budget or s2r_share"
                              if correction_rounds else f"{variant.name}: correction.rounds is 0: set it to 1 or more")
        real = max(cost, budget // 2 // cost * cost)  # whole iterations, about half; the rest funds the feedback
        replays = (budget - real) // correction_rounds
        if replays < max_turns:  # a replay budget below one episode replays nothing: the row would correct nothing
            raise ParamsError(f"{variant.name}: DreamGym-S2R's real budget of {budget} leaves {replays} replayed "
                              f"transition(s) a round after sim-to-real's {real}, less than one episode (up to "
                              f"{max_turns}), so nothing would be fed back: raise study.real_budget or s2r_share, or "
                              "lower correction.rounds")
        overrides |= {"correction.sim_to_real": "last_round", "correction.real_transitions": real,
                      "correction.replay_transitions": replays}
    return overrides


def stages_not_needed(overrides: dict[str, Any], target: str) -> tuple[str, ...]:
    """The pipeline stages a run with these overrides needs nothing from, though DVC's graph has the stages it runs
    depend on their outputs: for a real-environment row (sim-to-real from the warm start, no synthetic-RL policy
    evaluated), synthetic RL, and sim-to-real too where its policy is not evaluated (the warm start's row), and,
    where every environment it plays has a real adapter (none is a seed-only domain, whose held-out games are played
    inside the experience model), the experience model's training; for a correction row, the pipeline's synthetic
    RL, sim-to-real and held-out evaluation, since its rounds run their own from the warm start (on a new machine a
    finished evaluation would play its games again). flows.study leaves them out and stands in for their outputs
    while the row runs."""
    if target == "correction_rounds":
        return ("evaluate_policies", "sim_to_real", "synthetic_rl")
    policies = overrides.get("evaluate.policies", ["synthetic_rl"])
    if target != "evaluate_policies" or overrides.get("sim_to_real.start_from") != "sft" or "synthetic_rl" in policies:
        return ()
    skipped = ("synthetic_rl",) if "sim_to_real" in policies else ("sim_to_real", "synthetic_rl")
    environments = overrides.get("policy.environments")
    if environments and all(has_adapter(name) for name in environments):
        return (*skipped, EXPERIENCE_STAGE)
    return skipped


def scoring_overrides(overrides: dict[str, Any]) -> dict[str, Any]:
    """The params of a row's scoring of its experience model (evaluate_experience_model): the row's, with no
    fallback budget. Why: there the fallbacks are what is measured (the runs table shows their share), and a model
    over the budget that synthetic RL kept would otherwise go unscored; the stages that train on it keep the budget."""
    return {**overrides, "experience_model.max_fallback_rate": 1.0}


# kept from each run's metrics/: the evaluation, both RL stages' summaries and their per-iteration logs (a correction
# run's: its last round's), and the correction rounds' summary and per-round table
RUN_FILES = ("evaluate_policies.json", "sim_to_real.json", "synthetic_rl.json", "synthetic_rl_iterations.csv",
             "sim_to_real_iterations.csv")
# and the two models every variant of a seed starts from (from the run's own stage root): what they cost
UPSTREAM_FILES = ("train_experience_model.json", "train_policy_sft.json")
SIMULATOR_FILE = "evaluate_experience_model.json"  # kept from a run that scored its experience model
CORRECTION_FILE, CORRECTION_ROUNDS = "correction_rounds.json", "correction_rounds.csv"
CORRECTION_PLOT = "results_study_correction.png"  # in the results folder, beside the report
KEPT_GAMES = Path(GAMES_FILE).name  # each held-out game's outcome, to pair the methods
RUN_RECORD = "run.json"  # what the study wrote about the run: variant, seed, params set, profile, commit, seconds
SUPERSEDED = "superseded"  # run.json's reason a later change to the method superseded the run (`supersede`)
FAILURES_FILE = "failed_attempts.jsonl"  # in the results folder: each failed attempt at a row, a line


def select_variants(algorithm_names: tuple[str, ...], names: list[str] | tuple[str, ...] = ()) -> list[Variant]:
    """The variants to run: all of them, or those named (a study split over machines, or one row rerun)."""
    every = variants(algorithm_names)
    unknown = sorted(set(names) - {v.name for v in every})
    if unknown:
        raise ParamsError(f"study.variants: unknown {', '.join(unknown)}; the variants of algorithms "
                         f"{list(algorithm_names)} are {', '.join(v.name for v in every)}")
    return [v for v in every if not names or v.name in names]


@dataclass(frozen=True)
class PlannedRun:
    """One run the study's params ask for, `<environment>/<variant>-seed<k>`: the params it sets, or why it cannot
    run (`switched_off`: params turn the row off, as correction.rounds 0 does; otherwise its budget cannot pay)."""
    environment: str
    seed: int
    variant: Variant
    overrides: dict[str, Any] | None
    why_not: str | None = None
    switched_off: bool = False

    @property
    def name(self) -> str:
        return f"{self.environment}/{self.variant.name}-seed{self.seed}"


def plan(params: Any, sim_to_real_iteration: int) -> list[PlannedRun]:
    """Every run params.yaml's `study` asks for, in the order it runs them: per seed, per environment, each variant
    (`select_variants`) with its `run_overrides` (`sim_to_real_iteration`: the real transitions one sim-to-real
    iteration may spend, stages.sim_to_real.iteration_cost). Seed first: every row is measured once, on every
    environment, before any is repeated, so a study cut short still has each row's cost and a first answer."""
    settings, correction_rounds, max_turns = params.study, params.correction.rounds, params.policy.max_turns
    planned = []
    for seed in settings.seeds:
        for environment in settings.environments:
            for variant in select_variants(tuple(settings.algorithms), settings.variants):
                if variant.target == "correction_rounds" and not correction_rounds:
                    planned.append(PlannedRun(environment, seed, variant, None, "correction.rounds is 0", True))
                    continue
                try:
                    overrides = run_overrides(variant, seed, settings.real_budget, settings.s2r_share,
                                              correction_rounds, sim_to_real_iteration, environment, max_turns)
                except ParamsError as error:  # a row this budget cannot pay for
                    planned.append(PlannedRun(environment, seed, variant, None, str(error)))
                    continue
                planned.append(PlannedRun(environment, seed, variant, overrides))
    return planned


def run_budget(params: Any) -> str:
    """What params.yaml gives every row to spend, as a sentence for the report: synthetic RL's iterations and the
    synthetic transitions they may play, the real budgets, the held-out games per policy."""
    rl, settings, turns = params.synthetic_rl, params.study, params.policy.max_turns
    episodes = rl.iterations * rl.tasks_per_iteration * rl.group_size
    return (f"Each row's budget: synthetic RL plays {rl.iterations} iterations of {rl.tasks_per_iteration} tasks x "
            f"{rl.group_size} episodes in the experience model (at most {episodes * turns} synthetic transitions, "
            f"{turns} turns an episode); real-environment RL spends up to B = {settings.real_budget} real "
            f"transitions, DreamGym-S2R and its correction row up to "
            f"{s2r_budget(settings.real_budget, settings.s2r_share)} "
            f"({settings.s2r_share:.0%} of B); each policy plays {params.policy.eval_tasks} held-out games per "
            "environment. The runs table gives what each row spent and its wall time.")


def select_rows(planned: list[PlannedRun], names: list[str] | tuple[str, ...] = (),
                variants_set: list[str] | tuple[str, ...] = ()) -> list[PlannedRun]:
    """The planned runs named `<environment>/<variant>-seed<k>` (all of them when none is named); ParamsError
    naming the planned ones for a name the study does not plan (and study.variants, `variants_set`, if it limits
    the plan)."""
    unknown = sorted(set(names) - {row.name for row in planned})
    if unknown:
        limit = (f" (study.variants {list(variants_set)} limits it: set it to [] to plan every variant)"
                 if variants_set else "")
        raise ParamsError(f"no such row of this study: {', '.join(unknown)}. params.yaml `study` plans "
                          f"{', '.join(row.name for row in planned) or 'none'}{limit}")
    return [row for row in planned if not names or row.name in names]


def uninformative(row: PlannedRun, runs: list[Run]) -> str | None:
    """Why running `row` would tell nothing, by the finished runs: the warm start's row, when another run of its
    environment and seed evaluated the warm start (`measured_elsewhere`: it would play the same policy on the same
    games); the no-curriculum ablation, when DreamGym (GRPO)'s curriculum accepted no variation in the finished run
    of the row's seed, or, before it finished, in any finished run of the row's environment (so DreamGym played the
    base task schedule, which the ablation plays: the two differ by sampling alone). None when the row can tell
    something."""
    if (measured := measured_elsewhere(row, runs)) is not None:
        return (f"not informative: {measured.name} played seed {row.seed}'s warm start on the held-out games, and "
                "those games count as this row's")
    if row.variant.overrides.get("synthetic_rl.curriculum.enabled", True):
        return None
    base = [run for run in runs if run.variant.name == "dreamgym-grpo" and run.environment == row.environment
            and run.synthetic_rl.get("curriculum", {}).get("curriculum_enabled")]
    own = [run for run in base if run.seed == row.seed]
    judged = own or base  # the seed's own DreamGym run once it has finished, else the environment's
    if not judged or any(run.synthetic_rl["curriculum"].get("accepted", 0) for run in judged):
        return None
    proposed = sum(run.synthetic_rl["curriculum"].get("proposed", 0) for run in judged)
    why = (f"accepted 0 of {proposed} proposed variations (`python research/curriculum_backbone.py N` asks a backbone "
           "for N)" if proposed else "proposed no variation (no task's reward variance reached "
           "synthetic_rl.curriculum.min_variance)")
    where = f"in {own[0].name}" if own else f"in its {len(base)} finished run(s) on {row.environment}"
    return (f"not informative: DreamGym (GRPO)'s curriculum {why} {where}, so DreamGym played the base task "
            "schedule, which is what this ablation plays")


def keep_run(run_dir: str | Path, record: dict[str, Any], root: str | Path = ".",
             evaluated_in: str | Path | None = None, simulator: bool = False, not_needed: tuple[str, ...] = ()
             ) -> Path:
    """Keep a finished run's files (`run_files`) and its record in `run_dir`, whole or not at all (a rerun replaces
    it)."""
    return keep_files(run_dir, {**run_files(root, evaluated_in, simulator, not_needed),
                                RUN_RECORD: json.dumps(record, indent=2, sort_keys=True) + "\n"})


def record_failure(results_dir: str | Path, record: dict[str, Any]) -> None:
    """Append a failed attempt at a row (run, profile, commit, seconds, the stage it failed in, why) to the results
    folder's FAILURES_FILE: what a row that could not run cost, and why, for the plan to show."""
    append_records([record], Path(results_dir) / FAILURES_FILE)


def read_failures(results_dir: str | Path) -> dict[str, list[dict[str, Any]]]:
    """The failed attempts `record_failure` kept, by row name, oldest first."""
    path = Path(results_dir) / FAILURES_FILE
    found: dict[str, list[dict[str, Any]]] = {}
    for record in read_records(path) if path.is_file() else []:
        found.setdefault(record["run"], []).append(record)
    return found


def run_files(root: str | Path = ".", evaluated_in: str | Path | None = None, simulator: bool = False,
              not_needed: tuple[str, ...] = ()) -> dict[str, str]:
    """A finished run's RUN_FILES and its games (GAMES_FILE), by name, from the stage root that evaluated its
    policies (`evaluated_in`, default `root`; a correction run's last round, and then `root`'s CORRECTION_FILE and
    CORRECTION_ROUNDS too),
    and `root`'s UPSTREAM_FILES, and SIMULATOR_FILE when the run scored its experience model (`simulator`: the file
    left by another run would not be this run's); none of the stages it did not run (`not_needed`:
    `stages_not_needed`) at `root`, whose files there are another run's (a correction run's rounds ran their own)."""
    root_metrics = Path(root) / "metrics"
    sources = [Path(evaluated_in or root) / path for path in [*(f"metrics/{name}" for name in RUN_FILES), GAMES_FILE]]
    sources += [root_metrics / name for name in (*UPSTREAM_FILES, *[SIMULATOR_FILE] * simulator)]
    sources += [root_metrics / CORRECTION_FILE, root_metrics / CORRECTION_ROUNDS] if evaluated_in is not None else []
    not_run = {f"{stage}{suffix}" for stage in not_needed for suffix in (".json", "_iterations.csv")}
    return {source.name: source.read_text(encoding="utf-8") for source in sources if source.is_file()
            and not (source.parent == root_metrics and source.name in not_run)}


def keep_files(run_dir: str | Path, files: dict[str, str]) -> Path:
    """Write a run's files (name -> text) as `run_dir`, whole or not at all."""
    with atomic_directory(Path(run_dir), replace=True) as partial:
        for name, text in files.items():
            (partial / name).write_text(text, encoding="utf-8")
    return Path(run_dir)


def same_study(kept_profile: str, profile: str) -> bool:
    """Whether a run made at `kept_profile` belongs to the study of params.yaml at `profile`: the same named profile,
    or "custom" on either side (custom params cannot be told apart: trusted)."""
    return "custom" in (kept_profile, profile) or kept_profile == profile


def supersede(results_dir: str | Path, names: list[str] | tuple[str, ...], reason: str) -> list[Path]:
    """Mark the finished runs `names` (<environment>/<variant>-seed<k>) superseded by a later change to the method,
    with `reason` in their run.json: kept in their folders with every number, left out of the verdicts and tables of
    results, counted for what rows cost, and run again by the study (the rerun replaces the folder)."""
    if not reason.strip():
        raise ParamsError("superseding a run needs a reason (--reason): the report prints it beside the run")
    results_dir = Path(results_dir)
    kept = {run.name: run for run in kept_runs(results_dir)}
    unknown = [name for name in names if name not in kept]
    if unknown:
        raise ParamsError(f"{', '.join(unknown)}: no finished run of that name in {results_dir} to supersede; the "
                          f"finished ones are {', '.join(kept) or 'none'}")
    for name in names:
        record = {**kept[name].record, SUPERSEDED: reason.strip()}
        atomic_write_text(kept[name].path / RUN_RECORD, json.dumps(record, indent=2, sort_keys=True) + "\n")
    return [kept[name].path for name in names]


def is_finished(run_dir: str | Path, profile: str, overrides: dict[str, Any] | None = None) -> bool:
    """Whether `run_dir` holds a finished run, which a study keeps and skips. One finished at another named profile,
    or with another value of a param this run would set (`run_overrides`: a changed budget), is an error: its
    numbers would be pooled with this study's (profiles set their own study.results_dir)."""
    run_dir = Path(run_dir)
    if not (run_dir / "evaluate_policies.json").is_file():
        return False
    record = _read(run_dir / RUN_RECORD)
    if record.get(SUPERSEDED):  # a later change to the method: run again (the rerun replaces it)
        return False
    kept = record.get("profile", "custom")
    if not same_study(kept, profile):
        raise ParamsError(f"{run_dir}: finished at profile {kept!r}, but params.yaml is at profile {profile!r}. Set "
                          f"study.results_dir to this profile's folder (`dreamgym params use {profile}` does), or "
                          f"delete {run_dir} to run it again")
    kept_params, wanted = record.get("params_set", {}), json.loads(json.dumps(overrides or {}))  # as run.json has it
    # evaluate.policies only says which policies are played: a run that played more is still this run
    changed = sorted(key for key in kept_params.keys() & wanted.keys() - {"evaluate.policies"}
                     if kept_params[key] != wanted[key])
    if changed:
        raise ParamsError(f"{run_dir}: finished with " + ", ".join(f"{k}={kept_params[k]!r}" for k in changed)
                          + ", but this study sets " + ", ".join(f"{k}={wanted[k]!r}" for k in changed)
                          + f" (params.yaml `study`). Restore them, or delete {run_dir} to run it again")
    return True


@dataclass(frozen=True)
class Run:
    """One finished run of the study, as kept in `RESULTS_DIR/<environment>/<variant>-seed<k>/` (or, before runs
were per environment, `RESULTS_DIR/<variant>-seed<k>/`)."""
    path: Path
    name: str  # its folder under the results folder: <variant>-seed<k>, or <environment>/<variant>-seed<k>
    variant: Variant
    seed: int
    evaluated: dict[str, Any]  # evaluate_policies.json
    sim_to_real: dict[str, Any]
    synthetic_rl: dict[str, Any]
    record: dict[str, Any]  # run.json (empty for runs kept before it existed)
    games: dict[tuple[str, str], dict[str, bool]]  # (policy label, environment) -> task id -> won; {} if not kept
    correction: dict[str, Any]  # correction_rounds.json of a correction run ({} otherwise)
    upstream: list[dict[str, Any]]  # UPSTREAM_FILES ({} for one the run did not keep)
    simulator: dict[str, Any]  # SIMULATOR_FILE ({} if the run did not score its experience model)

    @property
    def environment(self) -> str | None:
        """The environment its folder names; None for a run kept before runs were per environment."""
        return self.name.partition("/")[0] if "/" in self.name else None

    @property
    def rows(self) -> dict[str, str]:
        """Its variant's rows (label -> method), and the warm start's where it evaluated it (a DreamGym run made
        before the warm start had a row of its own: `measured_elsewhere`)."""
        warm_start = {WARM_START_LABEL: WARM_START_METHOD} if WARM_START_LABEL in self.evaluated else {}
        return {**warm_start, **self.variant.rows}

    @property
    def superseded(self) -> str | None:
        """Why a later change to the method superseded it (`supersede`), or None."""
        return self.record.get(SUPERSEDED)

    def real_transitions(self, label: str) -> int:
        """Real transitions spent on the policy evaluated under `label`: a correction run's, over all its rounds."""
        if label != "sim-to-real":
            return 0
        return self.correction.get("real_transitions", self.sim_to_real.get("real_transitions_used", 0))

    def synthetic_transitions(self, label: str) -> int:
        if not self.from_synthetic_rl(label):
            return 0
        return self.correction.get("synthetic_transitions", self.synthetic_rl.get("synthetic_transitions", 0))

    def from_synthetic_rl(self, label: str) -> bool:
        """Whether the policy evaluated under `label` descends from this run's synthetic RL."""
        return label.startswith("synthetic_") or (
            label == "sim-to-real" and self.sim_to_real.get("start_from", "synthetic_rl") == "synthetic_rl")

    def gradient_iterations(self, stage: str) -> tuple[int, int] | None:
        """(iterations with a nonzero gradient, iterations) in `stage`'s log (synthetic_rl or sim_to_real; a
        correction run's last round); None where it logged no gradient norm. An iteration without one (every
        episode of each group scored alike) leaves the policy as it was."""
        rows = self.iterations(stage)
        if not rows or any("grad_norm" not in row for row in rows):
            return None
        return sum(row["grad_norm"] > 0 for row in rows), len(rows)

    def never_updated(self, label: str) -> bool:
        """Whether the RL stage that made the policy evaluated under `label` had no iteration with a gradient: that
        policy is the one the stage started from. Never said of a correction run's policy: each of its rounds trained
        it, and only the last round's logs are kept."""
        if self.correction:
            return False
        stage = "sim_to_real" if label == "sim-to-real" else "synthetic_rl" if label.startswith("synthetic_") else None
        found = self.gradient_iterations(stage) if stage else None
        return found is not None and found[0] == 0

    @property
    def uses_synthetic_rl(self) -> bool:
        """Whether a policy this run stands for descends from its synthetic RL (a real-only baseline's does not,
        though a run kept before `stages_not_needed` left it out ran synthetic RL too)."""
        return any(self.from_synthetic_rl(label) for label in self.variant.rows)

    @property
    def not_needed(self) -> tuple[str, ...]:
        """The stages its row needs nothing from (`stages_not_needed`), which a fresh machine does not run for it."""
        return stages_not_needed(self.record.get("params_set", {}), self.variant.target)

    @property
    def from_scratch_seconds(self) -> float | None:
        """What its pipeline costs with nothing cached: the time each stage its row needs took when it ran (experience
        model, warm start, synthetic RL, sim-to-real, its row's policies' held-out games (not those of a warm start it
        evaluated beside them, which is a row of its own) and the experience model's scoring),
        whichever run ran it; a real-environment row's leaves out synthetic RL and the experience model, which
        `stages_not_needed` spares it (a run kept before that counts them in its wall time, not here). None for a
        run kept without the upstream stages' metrics (UPSTREAM_FILES), and for a correction run, which keeps its last
        round's stages but not those of the pipeline its rounds start from."""
        shared = self.shared_seconds
        if shared is None:
            return None
        synthetic = 0.0 if "synthetic_rl" in self.not_needed else self.synthetic_rl.get("seconds", 0.0)
        return sum(shared.values()) + synthetic + self.sim_to_real.get("seconds", 0.0) \
            + self.simulator.get("seconds", 0.0) + sum(
            entry.get("wall_s", 0.0) for label, policy in self.evaluated.items()
            if label in self.variant.rows and isinstance(policy, dict)
            for entry in policy.values() if isinstance(entry, dict) and "success_rate" in entry)

    @property
    def shared_seconds(self) -> dict[str, float] | None:
        """The time of each stage that other rows of its environment and seed can share and its row needs
        (UPSTREAM_FILES, by stage: the experience model, shared by rows that set no experience_model param, and the
        warm start, by all), which DVC's run cache runs once in one workspace; None where not kept."""
        seconds = {name.removesuffix(".json"): kept.get("seconds") for name, kept in zip(UPSTREAM_FILES, self.upstream,
                                                                                          strict=True)
                   if name.removesuffix(".json") not in self.not_needed}
        return None if None in seconds.values() or self.correction else seconds

    @property
    def cost_seconds(self) -> float | None:
        """What a row like this one costs to run: its time from scratch where known (a run resumed after a crash or
        a session's end counts its wall time from the resumption), else its wall time."""
        scratch = self.from_scratch_seconds
        return scratch if scratch is not None else self.record.get("seconds")

    def iterations(self, stage: str) -> list[dict[str, float]]:
        """The per-iteration log of `stage` (synthetic_rl or sim_to_real), numbers only."""
        path = self.path / f"{stage}_iterations.csv"
        if not path.is_file():
            return []
        with path.open(encoding="utf-8") as handle:
            return [{key: float(value) for key, value in row.items() if _is_number(value)}
                    for row in csv.DictReader(handle)]


def finished_runs(results_dir: str | Path, algorithm_names: tuple[str, ...] = ("grpo", "ppo")) -> list[Run]:
    """The runs in `results_dir` that finished and stand (`kept_runs` but the superseded ones)."""
    return [run for run in kept_runs(results_dir, algorithm_names) if not run.superseded]


def kept_runs(results_dir: str | Path, algorithm_names: tuple[str, ...] = ("grpo", "ppo")) -> list[Run]:
    """The runs in `results_dir` that finished, superseded ones too (a crashed copy's temporary or an unknown folder
    is not one), as variants of a study of `algorithm_names` (the first one's DreamGym run stands for the warm
    start)."""
    known = {v.name: v for v in variants(algorithm_names)}
    runs = []
    results_dir = Path(results_dir)
    for path in sorted([*results_dir.glob("*-seed*"), *results_dir.glob("*/*-seed*")]):
        name, _, seed = path.name.rpartition("-seed")
        if name in known and seed.isdigit() and (path / "evaluate_policies.json").is_file():
            runs.append(Run(path, path.relative_to(results_dir).as_posix(), known[name], int(seed),
                            _read(path / "evaluate_policies.json"),
                            _read(path / "sim_to_real.json"), _read(path / "synthetic_rl.json"),
                            _read(path / RUN_RECORD), read_games(path / KEPT_GAMES), _read(path / CORRECTION_FILE),
                            [_read(path / name) for name in UPSTREAM_FILES], _read(path / SIMULATOR_FILE)))
    return runs


def read_games(path: Path) -> dict[tuple[str, str], dict[str, bool]]:
    """(policy, environment) -> task id -> won; a game an environment failure ended has no outcome and is left out
    (as the metrics leave it out of `episodes`), so no pairing counts it as a loss."""
    games: dict[tuple[str, str], dict[str, bool]] = {}
    if path.is_file():
        with path.open(encoding="utf-8") as handle:
            for row in csv.DictReader(handle):
                if not row.get("env_failure"):
                    games.setdefault((row["policy"], row["environment"]), {})[row["task_id"]] = row["won"] == "1"
    return games


def _method_results(runs: list[Run]):
    """(run, policy label, method, environment, result) for each method's held-out evaluation, once per seed: the
    same warm start may have been evaluated in more than one run of a seed (`Run.rows`), and counts once."""
    counted = set()
    for run in runs:
        for label, method in run.rows.items():
            for environment, result in run.evaluated.get(label, {}).items():
                if environment == "next_action" or (method, environment, run.seed) in counted:
                    continue
                counted.add((method, environment, run.seed))
                yield run, label, method, environment, result


def aggregate(runs: list[Run], confidence: float = 0.95) -> tuple[dict[str, Any], str]:
    """Pool every method's held-out episodes over `runs` (`finished_runs`); the metrics and a markdown table.

    Methods appear in the order of `variants()`; a method's episodes count once per seed (a warm start evaluated in
    more than one run of its seed counts once). Transitions are those the evaluated policy was trained on: real
    ones in sim-to-real or real RL, synthetic ones when it descends from synthetic RL (whose experience-model
    fallback rate is given too: predictions whose replies could not be parsed, so no simulation).
    """
    pooled: dict[tuple[str, str], dict[str, Any]] = {}  # (method, environment) -> counts
    for run, label, method, environment, result in _method_results(runs):
        synthetic = run.synthetic_rl if run.from_synthetic_rl(label) else {}
        entry = pooled.setdefault((method, environment), {
            "episodes": 0, "successes": 0, "seeds": [], "real_transitions": [], "synthetic_transitions": [],
            "fallback_rates": [], "generated_tasks": [], "never_updated": 0})
        entry["episodes"] += result["episodes"]
        entry["successes"] += result["successes"]
        entry["never_updated"] += run.never_updated(label)
        entry["seeds"].append(run.seed)
        entry["real_transitions"].append(run.real_transitions(label))
        entry["synthetic_transitions"].append(run.synthetic_transitions(label))
        if synthetic:
            entry["fallback_rates"].append(synthetic.get("experience_model", {}).get("fallback_rate", 0.0))
            entry["generated_tasks"].append(synthetic.get("curriculum", {}).get("accepted", 0))
    order = [method for v in variants() for method in v.rows.values()]
    metrics: dict[str, Any] = {}
    rows = []
    for (method, environment), entry in sorted(pooled.items(), key=lambda item: (order.index(item[0][0]),
                                                                                   item[0][1])):
        n, k = entry["episodes"], entry["successes"]
        low, high = wilson_interval(k, n, confidence)
        fallbacks = entry["fallback_rates"]
        m = metrics.setdefault(method, {})[environment] = {
            "episodes": n, "successes": k, "success_rate": k / n if n else 0.0, "success_ci_low": low,
            "success_ci_high": high, "seeds": sorted(entry["seeds"]),
            "real_transitions_mean": _mean(entry["real_transitions"]),
            "synthetic_transitions_mean": _mean(entry["synthetic_transitions"]),
            "simulator_fallback_rate": _mean(fallbacks) if fallbacks else None,
            "generated_tasks_mean": _mean(entry["generated_tasks"]) if entry["generated_tasks"] else None,
            "runs_never_updated": entry["never_updated"]}
        rows.append([method, environment, f"{m['success_rate']:.2f} [{low:.2f}, {high:.2f}]", f"{k}/{n}",
                     len(entry["seeds"]), f"{m['real_transitions_mean']:.0f}",
                     f"{m['synthetic_transitions_mean']:.0f}", "-" if not fallbacks else _percent(_mean(fallbacks))])
    table = markdown_table(["method", "environment", f"held-out success [{confidence:.0%} CI]", "wins",
                            "seeds", "real transitions (RL)", "synthetic transitions", "simulator fallbacks"], rows)
    return metrics, table


def paired_games(runs: list[Run]) -> dict[tuple[str, str], dict[tuple[int, str], bool]]:
    """(method, environment) -> (seed, task id) -> won, for the methods whose every counted run kept its games
    (KEPT_GAMES) and whose games add up to its metrics: the same episodes `aggregate` pools, game by game."""
    games: dict[tuple[str, str], dict[tuple[int, str], bool]] = {}
    incomplete = set()
    for run, label, method, environment, result in _method_results(runs):
        outcomes = run.games.get((label, environment))
        if outcomes is None or (len(outcomes), sum(outcomes.values())) != (result["episodes"], result["successes"]):
            incomplete.add((method, environment))  # not kept, or not the games the metrics count
        else:
            games.setdefault((method, environment), {}).update(
                {(run.seed, task_id): won for task_id, won in outcomes.items()})
    return {key: value for key, value in games.items() if key not in incomplete}


def sign_test(a_only: int, b_only: int) -> float:
    """Exact two-sided p-value of McNemar's test: of the games exactly one of two policies won, is A's share
    different from half? (Binomial(a_only + b_only, 1/2); 1.0 when no game tells them apart.)"""
    n, k = a_only + b_only, min(a_only, b_only)
    return min(1.0, 2 * sum(math.comb(n, i) for i in range(k + 1)) / 2 ** n) if n else 1.0


def detectable_difference(games: int, discordant_share: float, confidence: float = 0.95, power: float = 0.8) -> float:
    """The smallest true difference in success rate between two policies playing the same `games` that a two-sided
    paired test at level 1 - confidence detects with probability `power` (McNemar's normal approximation):
    z * sqrt(discordant_share / games), z = z[1 - alpha/2] + z[power], where `discordant_share` is the share of games
    exactly one of the two wins. A difference needs at least that many split games itself (the share is at least
    the difference), which floors it at z^2 / games. Games are (seed, game) pairs, so seeds pool into the count."""
    if not games:
        return 1.0
    z = _power_z(confidence, power)
    return max(z * math.sqrt(discordant_share / games), z * z / games)


def _power_z(confidence: float, power: float = 0.8) -> float:
    """z[1 - alpha/2] + z[power]: the normal deviates a two-sided test at level 1 - confidence needs."""
    return NormalDist().inv_cdf(1 - (1 - confidence) / 2) + NormalDist().inv_cdf(power)


def _difference(a: dict[str, Any], b: dict[str, Any], pairs: tuple[int, int, int] | None,
                confidence: float) -> tuple[float, float]:
    """The observed difference A - B in success rate, and the smallest one this comparison could detect (80%
    power). Paired: at the observed share of split games. Unpaired: each row's games, at the pooled rate's
    variance."""
    observed = a["success_rate"] - b["success_rate"]
    if pairs is not None:
        shared, a_only, b_only = pairs
        detectable = detectable_difference(shared, (a_only + b_only) / shared, confidence)
    else:
        n = min(a["episodes"], b["episodes"])
        pooled = (a["successes"] + b["successes"]) / max(a["episodes"] + b["episodes"], 1)
        detectable = _power_z(confidence) * math.sqrt(2 * pooled * (1 - pooled) / n) if n else 1.0
    return observed, min(detectable, 1.0)


@dataclass(frozen=True)
class Claim:
    """A claim as a comparison of two table rows. kind "better": A beats B; "not worse": A does at least as well as
    B; "better with generated tasks": "better", testable only if A's curriculum accepted a generated task (else A
    played the ablation's schedule, episode for episode). {A} in a method is the algorithm; the ablations are on
    GRPO, as in the paper. {share} in the text: A's real transitions as a share of B's, as the runs spent them."""
    text: str
    method_a: str
    method_b: str
    kind: str
    paper_gap: float | None = None  # the paper's A - B with GRPO on WebShop, in points (DESIGN.md); None: ours


WARM_START = Claim("Synthetic-only RL improves on the warm start", "DreamGym ({A})", WARM_START_METHOD, "better",
                   63.9 - 35.1)
MATCHES_REAL = Claim("Synthetic-only RL matches RL in the real environment", "DreamGym ({A})",
                     "{A} in the real environment", "not worse", 63.9 - 65.0)
S2R_BEATS_REAL = Claim("Sim-to-real on {share} of the real transitions beats real-only RL on all of them",
                       "DreamGym-S2R ({A})", "{A} in the real environment", "better", 75.0 - 65.0)
S2R_BEATS_SAME_BUDGET = Claim("Synthetic RL first beats real-only RL on the same real transitions",
                              "DreamGym-S2R ({A})", "{A} in the real environment at S2R's budget", "better")
CURRICULUM_HELPS = Claim("The curriculum helps", "DreamGym (GRPO)", "DreamGym (GRPO) w/o curriculum",
                         "better with generated tasks", 63.9 - 57.3)
RETRIEVAL_HELPS = Claim("Retrieval of similar transitions helps", "DreamGym (GRPO)", "DreamGym (GRPO) w/o retrieval",
                        "better", 63.9 - 59.2)
REASONING_HELPS = Claim("Reasoning before predicting helps", "DreamGym (GRPO)", "DreamGym (GRPO) w/o reasoning",
                        "better", 63.9 - 55.8)
CORRECTION_HELPS = Claim("On-policy correction helps sim-to-real at the same real budget",
                         "DreamGym-S2R (GRPO) + correction", "DreamGym-S2R (GRPO)", "better")
CORRECTED_BEATS_SAME_BUDGET = Claim("Synthetic RL with on-policy correction beats real-only RL on the same real "
                                    "transitions", "DreamGym-S2R (GRPO) + correction",
                                    "GRPO in the real environment at S2R's budget", "better")
CLAIMS = (WARM_START, MATCHES_REAL, S2R_BEATS_REAL, S2R_BEATS_SAME_BUDGET, CURRICULUM_HELPS, RETRIEVAL_HELPS,
          REASONING_HELPS, CORRECTION_HELPS, CORRECTED_BEATS_SAME_BUDGET)
# The paper's three claims, its WebShop figures (success %, Llama-3.1-8B policy and experience model), and the
# comparisons above that test each one at our scale (those without a paper_gap are our controls).
PAPER_CLAIMS = (
    ("DreamGym's synthetic-only RL matches RL in the real environment",
     "DreamGym 63.9% with no real transition beyond the seed, GRPO in the real environment 65.0% on 80K real "
     "transitions, both from the SFT warm start's 35.1%", (WARM_START, MATCHES_REAL)),
    ("DreamGym-S2R beats real-only RL on a small share of its real transitions",
     "DreamGym-S2R 75.0% on 5K real transitions against 65.0% on 80K",
     (S2R_BEATS_REAL, S2R_BEATS_SAME_BUDGET, CORRECTION_HELPS, CORRECTED_BEATS_SAME_BUDGET)),
    ("The curriculum, retrieval and reasoning each help",
     "DreamGym 63.9% against 57.3% without the curriculum, 59.2% without retrieval and 55.8% without reasoning",
     (CURRICULUM_HELPS, RETRIEVAL_HELPS, REASONING_HELPS)),
)


@dataclass(frozen=True)
class Comparison:
    """One claim tested on one environment (and algorithm, for a claim of every algorithm): its two rows' pooled
    results (`aggregate`, over the seeds both have: `matched_seeds`), their paired games when both kept them, and the
    verdict."""
    claim: Claim
    algorithm: str  # the RL algorithm of its methods
    text: str  # the claim's text, with its share filled in
    environment: str
    method_a: str
    method_b: str
    a: dict[str, Any]
    b: dict[str, Any] | None  # None: B has no run, and the verdict is known without it
    pairs: tuple[int, int, int] | None  # (games both played, games only A won, games only B won)
    verdict: str
    observed: float | None = None  # A - B in success rate
    detectable: float | None = None  # the smallest true A - B found with 80% power here
    other_warm_starts: tuple[int, ...] = ()  # seeds whose A and B runs started from different models (`warm_starts`)
    b_below_warm_start: str = ""  # where B lost to the warm start on the same seeds' games: the paired evidence
    untried_seeds: tuple[int, ...] = ()  # the curriculum claim's seeds left out: A's curriculum accepted no task

    @property
    def outcome(self) -> str:
        """supported, contradicted, not resolved, not contradicted, not tested or not testable."""
        return self.verdict.partition(":")[0]

    @property
    def paper_gap(self) -> float | None:
        """The paper's A - B in points where our copy of its figures has it: its GRPO rows."""
        return self.claim.paper_gap if self.algorithm == "grpo" else None


def claim_pairs(algorithm_names: tuple[str, ...]) -> list[tuple[Claim, str, str, str]]:
    """(claim, method A, method B, algorithm) for every comparison the study makes: a claim of every algorithm once
    per algorithm, the GRPO ablations once."""
    found: dict[tuple[str, str], tuple[Claim, str]] = {}
    for algorithm in algorithm_names:
        for claim in CLAIMS:
            found.setdefault((claim.method_a.format(A=algorithm.upper()), claim.method_b.format(A=algorithm.upper())),
                             (claim, algorithm if "{A}" in claim.method_a else "grpo"))
    return [(claim, a, b, algorithm) for (a, b), (claim, algorithm) in found.items()]


def comparisons(metrics: dict[str, Any], algorithm_names: tuple[str, ...] = ("grpo", "ppo"),
                games: dict[tuple[str, str], dict[tuple[int, str], bool]] | None = None,
                confidence: float = 0.95, runs: list[Run] | None = None) -> list[Comparison]:
    """Each claim against our table, wherever both its rows have results (or its verdict needs no B, see Claim).

    With the `runs` the table pools, two rows whose seeds differ are compared on the seeds both have
    (`matched_seeds`): a seed one of them lacks would weigh its own warm start into one side only.

    Where both rows kept their games (`paired_games`), the two methods are compared on the held-out games both
    played: a difference counts when the exact sign test on the games only one of them won gives p < 1 -
    confidence. Both play the same games greedily, so pairing removes the games' own difficulty, which two
    unpaired intervals carry twice. Otherwise a difference counts only when the Wilson intervals are apart (far
    more conservative: with 22 games, 6 wins against 16). One test per claim, not corrected for the number of claims.
    """
    games = games or {}
    starts = warm_starts(runs or [])
    start_of = {(method, environment, run.seed): starts[run.name]
                for run, _, method, environment, _ in _method_results(runs or [])}
    found = []
    for claim, a, b, algorithm in claim_pairs(algorithm_names):
        for environment in sorted(set(metrics.get(a, {})) & set(metrics.get(b, {}))):
            tried = _seeds_with_generated_tasks(a, environment, runs) if claim.kind == "better with generated " \
                "tasks" else None
            ra, rb = matched_seeds(metrics, a, b, environment, runs, confidence, tried)
            seeds = set(ra.get("seeds", [])) & set(rb.get("seeds", []))
            pairs = paired_counts(*({game: won for game, won in (games.get((method, environment)) or {}).items()
                                     if tried is None or game[0] in seeds} for method in (a, b)))
            untried = sorted(set(metrics[a][environment].get("seeds", [])) & set(metrics[b][environment].get(
                "seeds", [])) - seeds) if tried else []
            other = tuple(seed for seed in sorted(seeds)
                          if _other_starts(start_of.get((a, environment, seed)), start_of.get((b, environment, seed))))
            below = _below_warm_start(b, environment, seeds, games, start_of, confidence)
            found.append(Comparison(claim, algorithm, claim.text.format(share=_share(ra, rb)), environment, a, b, ra,
                                    rb, pairs, _verdict(ra, rb, claim.kind, pairs, confidence),
                                    *_difference(ra, rb, pairs, confidence), other, below, tuple(untried)))
        if claim.kind == "better with generated tasks":  # the answer is known without the ablation's run
            for environment in sorted(set(metrics.get(a, {})) - set(metrics.get(b, {}))):
                ra = metrics[a][environment]
                if not ra.get("generated_tasks_mean"):
                    found.append(Comparison(claim, algorithm, claim.text, environment, a, b, ra, None, None,
                                            "not tested: the curriculum accepted no generated task, so B would play "
                                            "A's tasks"))
    return found


def _seeds_with_generated_tasks(method: str, environment: str, runs: list[Run] | None) -> set[int] | None:
    """The seeds whose `method` run's curriculum accepted a generated task (as `aggregate`'s generated_tasks_mean
    counts them): only there can it differ from the ablation by more than sampling. None where no run is known or
    none accepted one (the claim is then not tested)."""
    seeds = {run.seed for run, _, name, where, _ in _method_results(runs or []) if name == method
             and where == environment and run.synthetic_rl.get("curriculum", {}).get("accepted")}
    return seeds or None


def _below_warm_start(method: str, environment: str, seeds: set[int],
                      games: dict[tuple[str, str], dict[tuple[int, str], bool]],
                      start_of: dict[tuple[str, str, int], str], confidence: float) -> str:
    """Where `method`, trained from the warm start, lost to it on the held-out games of `seeds` (the exact sign test
    at 1 - confidence), the paired evidence, for the reading of a claim against it; "" otherwise. A seed where the
    method started from another model than the one SFT only played is left out: that loss would not be its own."""
    mine, warm = games.get((method, environment)), games.get((WARM_START_METHOD, environment))
    if method == WARM_START_METHOD or not mine or not warm:
        return ""
    other = sorted(seed for seed in seeds if _other_starts(start_of.get((method, environment, seed)),
                                                           start_of.get((WARM_START_METHOD, environment, seed))))
    pairs = paired_counts({game: won for game, won in mine.items() if game[0] in seeds - set(other)}, warm)
    if pairs is None or pairs[1] >= pairs[2] or sign_test(pairs[1], pairs[2]) >= 1 - confidence:
        return ""
    return _paired_evidence(pairs, "B", WARM_START_METHOD) + (
        f"; {_seeds_named(other)} left out, where B started from another model "
        f"than the warm start {WARM_START_METHOD} played" if other else "")


def _seeds_named(seeds) -> str:
    """"seed 1" or "seeds 0, 2": the seeds a reading names."""
    return f"seed{'s' * (len(seeds) > 1)} {', '.join(map(str, seeds))}"


def _other_starts(a: str | None, b: str | None) -> bool:
    """Whether two runs' warm starts (`warm_starts`) are known to be different models."""
    return a not in (None, "?") and b not in (None, "?") and a != b


def matched_seeds(metrics: dict[str, Any], a: str, b: str, environment: str, runs: list[Run] | None,
                  confidence: float, only: set[int] | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """Methods `a` and `b`'s pooled results on `environment`, over the seeds both have (of `only`, where it shares
    one with them) where `runs` are given and their seeds differ (`aggregate` of those seeds' runs); as the table
    pools them otherwise, or where they share no seed."""
    ra, rb = metrics[a][environment], metrics[b][environment]
    common = set(ra.get("seeds", [])) & set(rb.get("seeds", []))
    common = common & only if only and common & only else common
    if runs is None or not common or set(ra.get("seeds", [])) == common == set(rb.get("seeds", [])):
        return ra, rb
    matched, _ = aggregate([run for run in runs if run.seed in common], confidence)
    return matched[a][environment], matched[b][environment]


def claim_verdicts(metrics: dict[str, Any], algorithm_names: tuple[str, ...] = ("grpo", "ppo"),
                   games: dict[tuple[str, str], dict[tuple[int, str], bool]] | None = None,
                   confidence: float = 0.95) -> str:
    """`comparisons` as a markdown table, with the paper's own difference beside ours."""
    return claims_table(comparisons(metrics, algorithm_names, games, confidence))


def claims_table(found: list[Comparison]) -> str:
    rows = [[c.text, c.environment, f"{c.method_a}: {c.a['successes']}/{c.a['episodes']}",
             f"{c.method_b}: " + (f"{c.b['successes']}/{c.b['episodes']}" if c.b else "not run"),
             "" if c.observed is None else f"{c.observed:+.0%}",
             "" if c.detectable is None else f"{c.detectable:.0%}", _paper_gap(c), c.verdict + (
                 f" ({_seeds_named(c.untried_seeds)} left out: A's "
                 "curriculum accepted no task there)" if c.untried_seeds else "")]
            for c in found]
    if not rows:
        return "No claim can be tested yet: no two of its rows have finished runs.\n"
    return markdown_table(["claim", "environment", "A", "B", "A - B", "detectable (80% power)", "paper (WebShop)",
                           "verdict"], rows)


def _paper_gap(comparison: Comparison) -> str:
    if comparison.claim.paper_gap is None:
        return "not the paper's"
    return "-" if comparison.paper_gap is None else f"{comparison.paper_gap:+.1f} points"


def claims_reading(found: list[Comparison], metrics: dict[str, Any], untested: dict[tuple[str, str], str],
                   algorithm_names: tuple[str, ...] = ("grpo", "ppo"), environments: list[str] | None = None) -> str:
    """A reading of each of the paper's claims (PAPER_CLAIMS), whichever way it falls: each of its comparisons
    (`comparisons`) with its verdict beside the gap the paper reports and the gap it could detect, each comparison
    not made with why (`untested`: (method, environment) -> why it has no result, `untested_reasons`), and what two
    comparisons say together (where sim-to-real's gain comes from). `environments`: the study's, beside those with
    results."""
    made = {(c.method_a, c.method_b, c.environment): c for c in found}
    simulated = {c.environment for c in found if c.environment.endswith(SIMULATED)}  # a seed-only domain's label
    environments = sorted(set(environments or []) - {e.removesuffix(SIMULATED) for e in simulated}
                          | {c.environment for c in found})
    sections = []
    for number, (title, paper, its_claims) in enumerate(PAPER_CLAIMS, 1):
        tested, not_tested, outcomes = [], [], {"the paper's": [], "our controls'": []}
        for claim, a, b, _ in claim_pairs(algorithm_names):
            if claim not in its_claims:
                continue
            for environment in environments:
                comparison = made.get((a, b, environment))
                label = (comparison.text if comparison else claim.text.format(share="a share")) + (
                    " (our control)" if claim.paper_gap is None else "")
                if comparison is not None and comparison.outcome != "not tested":
                    tested.append(f"- {label}, {environment}, {a} against {b}: {_reading(comparison)}")
                else:
                    planned = environment.removesuffix(SIMULATED)
                    why = [comparison.verdict.partition(": ")[2]] if comparison else list(dict.fromkeys(
                        untested.get((method, planned), f"{method} has no finished run")
                        for method in (a, b) if environment not in metrics.get(method, {})))
                    not_tested.append(f"- {label}, {environment}, {a} against {b}: {'; '.join(why)}.")
                outcomes["the paper's" if claim.paper_gap is not None else "our controls'"].append(
                    comparison.outcome if comparison else "not tested")
        counts = "; ".join(f"of {whose} {len(found_)} comparisons, " + ", ".join(
            f"{found_.count(outcome)} {outcome}" for outcome in (
                "supported", "not contradicted", "not resolved", "contradicted", "not testable", "not tested")
            if outcome in found_) for whose, found_ in outcomes.items() if found_)
        traced = {S2R_BEATS_REAL, S2R_BEATS_SAME_BUDGET} <= set(its_claims)
        together = _attribution(made, environments, algorithm_names) if traced else ""
        parts = [f"### {number}. {title}", f"The paper (WebShop, GRPO): {paper}.", f"Here, {counts or 'none'}.",
                 "\n".join(tested), together, "Not tested:\n\n" + "\n".join(not_tested) if not_tested else ""]
        sections.append("\n\n".join(part for part in parts if part) + "\n")
    return "\n".join(sections)


def _reading(comparison: Comparison) -> str:
    """A comparison's verdict, in the reading's words: bold outcome, evidence, the gaps, and what a null means."""
    c = comparison
    if c.observed is None or c.detectable is None or c.b is None:
        return f"**{c.outcome}**{c.verdict[len(c.outcome):]}."
    paper = c.paper_gap
    seeds = sorted(set(c.a.get("seeds", [])) | set(c.b.get("seeds", [])))
    gaps = f"{_seeds_named(seeds)}; " * bool(seeds) + (
        f"A - B {100 * c.observed:+.0f} points, detectable {100 * c.detectable:.0f}") + (
        f", the paper's {paper:+.1f}" if paper is not None else "")
    meaning = ""  # from the paired test's power only: unpaired, intervals apart is a stricter test than it assumes
    if c.pairs is not None and c.outcome == "not resolved" and paper is not None:
        meaning = (" A gap the size of the paper's would usually have been detected here."
                   if paper / 100 >= c.detectable else " The paper's gap is smaller than this comparison detects.")
    elif c.pairs is not None and c.outcome == "not contradicted":
        meaning = f" A shortfall of {100 * c.detectable:.0f} points or more would usually have been detected here."
    still = [f"{found['runs_never_updated']} of {side}'s {len(found['seeds'])} run{'s' * (len(found['seeds']) > 1)}"
             for side, found in (("A", c.a), ("B", c.b)) if found.get("runs_never_updated")]
    if still:
        meaning += (f" In {' and '.join(still)}, no RL iteration had a gradient (each group's episodes scored alike), "
                    "so RL left the policy it started from as it was.")
    if c.untried_seeds:
        meaning += (f" Left out: {_seeds_named(c.untried_seeds)}, where A's curriculum accepted no generated task, "
                    "so A played B's tasks and the two differ by sampling alone.")
    if c.b_below_warm_start:
        meaning += (f" B itself lost to {WARM_START_METHOD} on these seeds ({c.b_below_warm_start}), so part of any "
                    "lead of A over B is B's fall below its warm start.")
    if c.other_warm_starts:
        meaning += (f" On {_seeds_named(c.other_warm_starts)}, A and B started from different warm starts (the runs "
                    "table's), so their games differ by the start too.")
    return f"**{c.outcome}**{c.verdict[len(c.outcome):]} ({gaps}).{meaning}"


def _attribution(made: dict[tuple[str, str, str], Comparison], environments: list[str],
                 algorithm_names: tuple[str, ...]) -> str:
    """Where DreamGym-S2R's lead over real-only RL comes from, where it has one: real-only RL on the same real
    transitions (S2R_BEATS_SAME_BUDGET) tells whether synthetic RL first adds anything, or the few real transitions
    alone did."""
    said = []
    for algorithm in algorithm_names:
        s2r, full, control = (method.format(A=algorithm.upper()) for method in (
            S2R_BEATS_REAL.method_a, S2R_BEATS_REAL.method_b, S2R_BEATS_SAME_BUDGET.method_b))
        for environment in environments:
            lead, same = made.get((s2r, full, environment)), made.get((s2r, control, environment))
            if lead is None or lead.outcome != "supported":
                continue
            where = f"On {environment} ({algorithm.upper()}), DreamGym-S2R's lead over real-only RL"
            if same is None:  # made only where both rows have results
                said.append(f"{where} is not yet traced to synthetic RL: real-only RL on S2R's budget has no run.")
            elif same.outcome == "supported":
                said.append(f"{where} holds against real-only RL at S2R's budget too: synthetic RL first adds to "
                            "what those real transitions buy.")
            else:
                said.append(f"{where} is not shown to come from synthetic RL: real-only RL at S2R's budget won "
                            f"{same.b['successes']}/{same.b['episodes']} against S2R's "
                            f"{same.a['successes']}/{same.a['episodes']} ({same.outcome}).")
    return " ".join(said)


def _share(a: dict[str, Any], b: dict[str, Any]) -> str:
    spent = b.get("real_transitions_mean") or 0
    return f"{a.get('real_transitions_mean', 0) / spent:.0%}" if spent else "a share"


def paired_counts(a: dict[tuple, bool] | None, b: dict[tuple, bool] | None) -> tuple[int, int, int] | None:
    """(games both played, games only A won, games only B won), or None when they share no game."""
    common = (a or {}).keys() & (b or {}).keys()
    if not common:
        return None
    return len(common), sum(a[g] and not b[g] for g in common), sum(b[g] and not a[g] for g in common)


def _paired_evidence(pairs: tuple[int, int, int], a: str = "A", b: str = "B") -> str:
    """The games two policies both played, those only each one won, and the exact sign test on them."""
    shared, a_only, b_only = pairs
    return (f"of {shared} games both played, {a} alone won {a_only}, {b} alone {b_only}; sign test p = "
            f"{sign_test(a_only, b_only):.2g}")


def _verdict(a: dict[str, Any], b: dict[str, Any], kind: str, pairs: tuple[int, int, int] | None = None,
             confidence: float = 0.95) -> str:
    if kind == "better with generated tasks" and not a.get("generated_tasks_mean"):
        return "not tested: the curriculum accepted no generated task, so A played B's tasks"
    if a["successes"] == 0 and b["successes"] == 0:
        return "not testable: neither won a game"
    if pairs is not None:
        _, a_only, b_only = pairs
        p = sign_test(a_only, b_only)
        leaning = "A higher" if a_only > b_only else ("A lower" if a_only < b_only else "tied")
        evidence = _paired_evidence(pairs)
        if p < 1 - confidence:
            return f"{'supported' if a_only > b_only else 'contradicted'}: {leaning}, {evidence}"
        return f"{'not contradicted' if kind == 'not worse' else 'not resolved'}: {leaning}, {evidence}"
    if a["success_ci_low"] > b["success_ci_high"]:
        return "supported: A higher, intervals apart (no games kept to pair)"
    if b["success_ci_low"] > a["success_ci_high"]:
        return "contradicted: A lower, intervals apart (no games kept to pair)"
    leaning = "A higher" if a["success_rate"] > b["success_rate"] else (
        "A lower" if a["success_rate"] < b["success_rate"] else "tied")
    seeds = ("" if a.get("seeds") == b.get("seeds")
             else f" (unpaired seeds: A {a.get('seeds')}, B {b.get('seeds')})")
    return (f"not contradicted: {leaning}, intervals overlap{seeds}" if kind == "not worse"
            else f"not resolved: {leaning}, intervals overlap{seeds}")


def runs_table(runs: list[Run]) -> str:
    """One line per run: what it set, its profile, commit, warm start (`warm_starts`) and wall time, and what its RL
    stages consumed and won in the real environment, and how many of their iterations had a gradient (where every
    episode of each group scored alike, GRPO had no advantage to follow). A run's wall time is what it took here
    over its invocations (DVC reuses the stages it shares with an earlier run; a stopped row run again goes on, and
    its record's `earlier_seconds` counts the stopped ones); from scratch and the RL stages' own time are what its
    stages took when they ran."""
    rows, starts = [], warm_starts(runs)
    for run in runs:
        synthetic = run.synthetic_rl if run.uses_synthetic_rl else {}
        rows.append([
            run.name, run.record.get("profile", "?"), str(run.record.get("commit", "?"))[:8], starts[run.name],
            f"{run.record['seconds'] / 60:.1f}" if "seconds" in run.record else "?",
            f"{run.from_scratch_seconds / 60:.1f}" if run.from_scratch_seconds is not None else "?",
            f"{(synthetic.get('seconds', 0.0) + run.sim_to_real.get('seconds', 0.0)) / 60:.1f}",
            synthetic.get("iterations", "-"), run.synthetic_transitions("sim-to-real") if synthetic else "-",
            _percent(synthetic["experience_model"]["fallback_rate"]) if "experience_model" in synthetic else "-",
            _confirmed_wins(run) if synthetic else "-",
            _simulator_false_wins(run),
            run.sim_to_real.get("start_from", "-"), run.sim_to_real.get("iterations", 0), _real_episodes_won(run),
            run.real_transitions("sim-to-real"), _gradient_iterations(run)])
    return markdown_table(["run", "profile", "commit", "warm start", "wall time (min)", "from scratch (min)",
                           "RL stages' time (min)",
                           "synthetic RL iterations", "synthetic transitions", "simulator fallbacks",
                           "synthetic wins the real game confirms",
                           "simulator's false wins (held-out seed steps; its warm start's play; fallbacks of its "
                           "predictions)",
                           "sim-to-real from", "real RL iterations", "real RL episodes won",
                           "real transitions", "RL iterations with a gradient (synthetic; real)"], rows)


STUDY_RUN_COMMAND = "dreamgym study run"  # runs named rows of params.yaml's study (dreamgym/cli.py)


@dataclass(frozen=True)
class RowStatus:
    """Where a planned run stands (`plan_status`)."""
    row: PlannedRun
    status: str  # "finished", "not run yet", or why it is kept with other params, cannot run or would tell nothing
    minutes: str  # finished: its wall time; else its estimate, or "not measured yet"
    command: str  # what runs it, for a row not run
    estimate: float | None = None  # minutes, for a row to run whose variant has finished runs on its environment
    costed_by: str | None = None  # the look-alike variant whose runs give the estimate (Variant.costs_like)
    uninformative: bool = False  # not run: the finished runs show it would tell nothing (`uninformative`)
    shared: dict[str, float] | None = None  # minutes of the estimate in stages other rows can share, by stage
    history: str = ""  # not finished: its failed attempts (`record_failure`, the last one's stage and why) and its
    # superseded run (`supersede`)

    @property
    def to_run(self) -> bool:
        return self.status == "not run yet"


def plan_status(planned: list[PlannedRun], runs: list[Run], profile: str = "custom",
                failures: dict[str, list[dict[str, Any]]] | None = None,
                superseded: list[Run] | None = None) -> list[RowStatus]:
    """Every run the study plans: finished (its wall time), kept with other params than the plan's (`is_finished`
    refuses it), or not run (why, or what it would cost by the finished runs of its variant on its environment, and
    the command that runs it alone; and its failed attempts, `failures`: `read_failures`, and its `superseded` run,
    whose cost counts in the estimates as a finished run's does)."""
    kept = {run.name: run for run in runs}
    status: dict[str, str] = {}  # row -> "finished" or why the run kept under its name is not this row's
    for row in planned:
        if row.name in kept and not row.why_not:
            try:
                is_finished(kept[row.name].path, profile, row.overrides)
                status[row.name] = "finished"
            except ParamsError as error:
                status[row.name] = f"kept with other params: {error}"
    minutes: dict[str, list[float]] = {}  # <environment>/<variant> -> minutes of its finished rows (`cost_seconds`)
    shared: dict[str, list[dict[str, float] | None]] = {}  # the same rows' shareable stages (`shared_seconds`)
    replaced = {run.name: run for run in superseded or []}
    for row in planned:
        measured = kept.get(row.name) if status.get(row.name) == "finished" else replaced.get(row.name)
        if measured is not None and (cost := measured.cost_seconds) is not None:
            minutes.setdefault(row.name.rpartition("-seed")[0], []).append(cost / 60)
            part = measured.shared_seconds  # known where the cost is the time from scratch
            shared.setdefault(row.name.rpartition("-seed")[0], []).append(
                None if part is None else {stage: seconds / 60 for stage, seconds in part.items()})
    found = []
    for row in planned:
        if row.name in status:
            wall = kept[row.name].record.get("seconds") if status[row.name] == "finished" else None
            found.append(RowStatus(row, status[row.name], f"{wall / 60:.0f}" if wall is not None else "", ""))
        elif row.why_not:
            found.append(RowStatus(row, f"{'switched off' if row.switched_off else 'cannot run'}: {row.why_not}",
                                   "", ""))
        else:
            group, like = row.name.rpartition("-seed")[0], row.variant.costs_like
            measured = minutes.get(group)
            cost = f"about {_mean(measured):.0f} (mean of {len(measured)})" if measured else "not measured yet"
            if not measured and like and (measured := minutes.get(group := f"{row.environment}/{like}")):
                cost = f"about {_mean(measured):.0f} (as {like}, mean of {len(measured)})"
            else:
                like = None
            parts = shared.get(group, [None])
            in_shared = None if not measured or None in parts else {
                stage: _mean([part[stage] for part in parts if part is not None]) for stage in parts[0] or {}}
            history = "; ".join(filter(None, [_failed_attempts((failures or {}).get(row.name, [])),
                                              _superseded(replaced.get(row.name))]))
            if reason := uninformative(row, runs):
                found.append(RowStatus(row, reason, cost, f"`{STUDY_RUN_COMMAND} {row.name}` runs it anyway",
                                       uninformative=True, history=history))
            else:
                found.append(RowStatus(row, "not run yet", cost, f"`{STUDY_RUN_COMMAND} {row.name}`",
                                       _mean(measured) if measured else None, like, shared=in_shared, history=history))
    return found


def _failed_attempts(attempts: list[dict[str, Any]]) -> str:
    """A row's failed attempts in a few words: how many, their minutes, and where and why the last one failed."""
    if not attempts:
        return ""
    last, minutes = attempts[-1], sum(a.get("seconds") or 0.0 for a in attempts) / 60
    why = last.get("reason", "").removeprefix(f"{last.get('stage')}: ")  # dreamgym's errors start with the stage
    return (f"{len(attempts)} failed attempt{'s' * (len(attempts) > 1)} ({minutes:.0f} min); the last, at "
            f"{(last.get('commit') or '?')[:8]}, in {last.get('stage') or 'an unknown stage'}: "
            f"{why[:240] + '...' if len(why) > 240 else why}")


def _superseded(run: Run | None) -> str:
    return "" if run is None else (f"its run at {(run.record.get('commit') or '?')[:8]} was superseded: "
                                   f"{run.superseded}")


EXPERIENCE_STAGE = UPSTREAM_FILES[0].removesuffix(".json")  # trained again by a row that sets experience_model params


def _experience_overrides(row: PlannedRun) -> str:
    """The experience_model params a row sets: rows setting the same ones share one trained experience model."""
    return json.dumps({k: v for k, v in (row.overrides or {}).items() if k.startswith("experience_model.")},
                      sort_keys=True)


def plan_table(statuses: list[RowStatus]) -> str:
    """`plan_status` as a table, after a line on the total left."""
    to_run = [s for s in statuses if s.to_run]
    left = sum(s.estimate or 0.0 for s in to_run)
    once: dict[tuple, float] = {}  # a shareable stage of an environment and seed (and its params) -> minutes, once
    for s in to_run:
        for stage, minutes in (s.shared or {}).items():
            params = _experience_overrides(s.row) if stage == EXPERIENCE_STAGE else ""
            key = (s.row.environment, s.row.seed, stage, params)
            once[key] = max(once.get(key, 0.0), minutes)
    left_together = left - sum(sum((s.shared or {}).values()) for s in to_run) + sum(once.values())
    unmeasured = sum(s.estimate is None for s in to_run)
    idle = sum(s.uninformative for s in statuses)
    finished = sum(s.status == "finished" for s in statuses)
    total = (f"{finished} of {len(statuses)} planned runs finished; {len(to_run)} to run"
             + (f" ({unmeasured} not estimated: no finished run on their environment to cost them by)"
                if unmeasured else "")
             + (f", about {left / 60:.1f} h by the finished runs of their variants or, where "
                "named, of a variant they cost like" if left else "")
             + (f", or about {left_together / 60:.1f} h run in one workspace per environment and seed, where DVC's "
                "run cache trains the warm start once for all its rows and the experience model once for the rows "
                "that set the same experience_model params"
                if left and left_together < left else "")
             + (f"; {idle} not informative by the finished runs (not run unless named)" if idle else "")
             + ". A run's wall time is what it took where it ran: one that DVC restored earlier stages for takes "
               "less than one that trains its experience model and warm start. A row's estimate is its variant's "
               "time from scratch (the runs table's: the stages a seed's rows share counted in each) where its runs "
               "kept it, else their wall time, so the total is what the rows cost on fresh machines. Each command runs "
               f"that row alone; `{STUDY_RUN_COMMAND}` with no row runs every row not finished.\n\n")
    return total + markdown_table(["row", "status", "minutes (finished: wall time; else estimate)", "command"],
                                  [[s.row.name, s.status + (f"; {s.history}" if s.history else ""), s.minutes,
                                    s.command] for s in statuses])


def untested_reasons(statuses: list[RowStatus]) -> dict[tuple[str, str], str]:
    """(method, environment) -> why it has no result, for each method no planned run of which has finished on that
    environment: its rows' status (the first row's, with how many more share it) and estimate."""
    rows: dict[tuple[str, str], list[RowStatus]] = {}
    for status in statuses:
        for method in status.row.variant.rows.values():
            rows.setdefault((method, status.row.environment), []).append(status)
    reasons = {}
    for key, found in rows.items():
        if any(s.status == "finished" for s in found):
            continue
        first = found[0]
        more = f" (and {len(found) - 1} more seed{'s' if len(found) > 2 else ''})" if len(found) > 1 else ""
        cost = f", about {first.estimate:.0f} min each" + (f" (as {first.costed_by})" if first.costed_by else "") \
            if first.to_run and first.estimate is not None else (
            ", its cost not measured yet" if first.to_run else "")
        reasons[key] = f"`{first.row.name}`{more}: {first.status}{cost}"
    return reasons


def _simulator_false_wins(run: Run) -> str:
    """The experience model's false wins (a reward where the game gave none) among the unrewarded steps it scored:
    on held-out seed steps and on the warm start's play of held-out games (evaluate_experience_model)."""
    if not run.simulator:
        return "not scored: " + run.record["simulator_not_scored"] if "simulator_not_scored" in run.record else "-"
    scored = [run.simulator.get("experience model", {}).get("overall", {}),
              run.simulator.get("on_policy", {}).get("experience model", {}).get("overall", {})]
    text = "; ".join(f"{part['false_wins']}/{part['unrewarded_n']}" if "false_wins" in part else "-" for part in scored)
    # a fallback predicts no reward: it is never a false win
    predictions = [part["prediction"] for part in (run.simulator, run.simulator.get("on_policy", {}))
                   if "prediction" in part]
    if predictions:
        text += (f" (fallbacks {sum(p['fallbacks'] for p in predictions)}/"
                 f"{sum(p['requests'] for p in predictions)})")
    return text


def warm_starts(runs: list[Run]) -> dict[str, str]:
    """Which runs share a warm start: the same training record but its time (a resumed training takes another) is the
    same model, restored by DVC or trained again alike (one seed trains one model on one machine, another machine's
    may differ), named by its seed and a letter in order of appearance within its environment (so one environment's
    names stay put as another's runs land); "?" for a run that kept no record of it."""
    names: dict[tuple[str | None, int, str], str] = {}
    labels: dict[str, str] = {}
    for run in runs:
        record = run.upstream[UPSTREAM_FILES.index("train_policy_sft.json")] if run.upstream else {}
        if not record:
            labels[run.name] = "?"
            continue
        key = (run.environment, run.seed,
               json.dumps({k: v for k, v in record.items() if k != "seconds"}, sort_keys=True))
        if key not in names:  # a letter, then a number: two models of one environment never share a name
            count = sum(key[:2] == other[:2] for other in names)
            names[key] = f"{run.seed}{ascii_lowercase[count] if count < 26 else f'.{count + 1}'}"
        labels[run.name] = names[key]
    return labels


def _real_episodes_won(run: Run) -> str:
    """Of the episodes its real-environment RL played (its last round's, for a correction run), how many it won, from
    the iteration log (each iteration plays the same number of episodes)."""
    rows, episodes = run.iterations("sim_to_real"), run.sim_to_real.get("episodes")
    if not rows or not episodes or any("success_rate" not in row for row in rows):
        return "-"
    return f"{round(sum(row['success_rate'] for row in rows) * episodes / len(rows))}/{episodes}"


def _gradient_iterations(run: Run) -> str:
    """Of each RL stage's iterations, those whose update had a gradient (`Run.gradient_iterations`)."""
    cells = []
    for stage, ran in (("synthetic_rl", run.uses_synthetic_rl), ("sim_to_real", bool(run.sim_to_real))):
        found = run.gradient_iterations(stage) if ran else None
        cells.append("-" if not ran else "?" if found is None else f"{found[0]}/{found[1]}")
    return "; ".join(cells)


def _confirmed_wins(run: Run) -> str:
    """Of the episodes synthetic RL won inside the experience model, how many win when their actions are replayed in
    the real environment (evaluate_policies' replay audit): how far the simulator's rewards can be trusted. Episodes
    on curriculum variations have no real game to replay them in: counted beside, as the audit could not judge them."""
    audits = run.evaluated.get("synthetic_replay", {}).values()
    if not audits:
        return "-"
    unreplayable = sum(a.get("unreplayable", 0) for a in audits)
    return (f"{sum(a['both'] for a in audits)}/{sum(a['synthetic_successes'] for a in audits)}"
            + (f" ({unreplayable} episodes on variations not replayable)" if unreplayable else ""))


def _curve_method(run: Run, stage: str) -> str:
    """The table row a run's curve of `stage` belongs to: its synthetic RL's or its sim-to-real's method."""
    if stage == "sim_to_real":
        return run.variant.rows.get("sim-to-real", run.variant.name)
    return next((method for label, method in run.variant.rows.items() if label.startswith("synthetic_")),
                f"{run.variant.name} (synthetic RL)")


def learning_curves_plot(runs: list[Run], path: str | Path) -> Path | None:
    """Per iteration, synthetic RL (in the simulator) and RL in the real environment (against the real transitions
    spent), one column per environment and one line per run that trained that stage itself, coloured by its table
    row and dashed by its seed: mean episode reward and, where the run measured it (evaluate.curve_every), held-out
    real success on the curve's fixed games."""
    stages = [("synthetic_rl", "synthetic RL", "iteration"), ("sim_to_real", "real-environment RL", "real transitions")]
    lines: dict[tuple[str, str], list[tuple[Run, list[dict[str, float]]]]] = {}
    for run in runs:
        trained = {"synthetic_rl": run.uses_synthetic_rl, "sim_to_real": "sim-to-real" in run.variant.rows}
        for stage, _, _ in stages:
            rows = run.iterations(stage) if trained[stage] else []
            if rows:
                lines.setdefault((stage, run.environment or ""), []).append((run, rows))
    if not lines:
        return None
    measures = [("reward_mean", "mean episode reward")]
    if any("heldout_success" in row for found in lines.values() for _, rows in found for row in rows):
        measures.append(("heldout_success", "held-out success"))
    panels = [(stage, title, x_label, measure, y_label) for stage, title, x_label in stages
              if any(key[0] == stage for key in lines) for measure, y_label in measures]
    environments = sorted({environment for _, environment in lines})
    methods = sorted({_curve_method(run, stage) for (stage, _), found in lines.items() for run, _ in found})
    light = pyplot().get_cmap("tab20").colors[1::2]  # after tab10's ten, their lighter shades
    colours = dict(zip(methods, (pyplot().get_cmap("tab10").colors + light) * 2, strict=False))
    dashes = ["-", "--", ":", "-."]
    seeds = sorted({run.seed for found in lines.values() for run, _ in found})
    seeds = seeds if len(seeds) > 1 else []  # one seed: no dashes to tell apart
    legend_columns = 2 * len(environments)  # a long method name takes about half an environment's width
    legend_rows = math.ceil((len(methods) + len(seeds)) / legend_columns)
    figure, axes = pyplot().subplots(
        len(panels) + 1, len(environments), squeeze=False, figsize=(5.5 * len(environments), 2.8 * len(panels) + 0.6),
        gridspec_kw={"height_ratios": [2.8] * len(panels) + [0.15 * legend_rows]})
    legend_axis = figure.add_subplot(axes[-1][0].get_gridspec()[-1, :])  # the last row, whole: the legend
    for axis in [*axes[-1], legend_axis]:
        axis.axis("off")
    for row_axes, (stage, title, x_label, measure, y_label) in zip(axes[:-1], panels, strict=True):
        for axis, environment in zip(row_axes, environments, strict=True):
            for run, rows in lines.get((stage, environment), []):
                if stage == "synthetic_rl":
                    xs = [row["iteration"] for row in rows]
                else:  # cumulative real transitions: runs of different budgets share one axis
                    xs = list(accumulate(row.get("env_transitions", 0.0) for row in rows))
                points = [(x, row[measure]) for x, row in zip(xs, rows, strict=True) if measure in row]
                axis.plot([x for x, _ in points], [y for _, y in points], marker="o", markersize=3,
                          color=colours[_curve_method(run, stage)], linestyle=dashes[run.seed % len(dashes)])
            if (stage, environment) not in lines:
                axis.text(0.5, 0.5, "no run trained this yet", ha="center", va="center", transform=axis.transAxes,
                          fontsize=8, color="grey")
            axis.set_title(f"{environment}: {title}, {y_label}" if environment else f"{title}: {y_label}",
                           fontsize=9)
            axis.set_xlabel(x_label, fontsize=8)
            axis.set_ylabel(y_label, fontsize=8)
            axis.tick_params(labelsize=7)
            if measure == "heldout_success":  # a rate: on its whole scale, a 20-game curve's noise reads as such
                axis.set_ylim(-0.03, 1.03)
    handles = [pyplot().Line2D([], [], color=colours[method], marker="o", markersize=3) for method in methods]
    handles += [pyplot().Line2D([], [], color="grey", linestyle=dashes[seed % len(dashes)]) for seed in seeds]
    legend_axis.legend(handles, methods + [f"seed {seed}" for seed in seeds], loc="center", fontsize=7,
                       ncol=legend_columns, frameon=False)
    return save_figure(figure, path)


def report(results_dir: str | Path, confidence: float = 0.95, algorithm_names: tuple[str, ...] = ("grpo", "ppo"),
           planned: list[PlannedRun] | None = None, profile: str = "custom", budget: str = ""
           ) -> tuple[dict[str, Any], str]:
    """The study's metrics and markdown report, with its plots written into `results_dir`; with `planned` (`plan` of
    params.yaml at `profile`) and its `budget` (`run_budget`), a section on every planned run, finished or not,
    unless the kept runs were made at another profile (another study's, such as a first edition's, which these
    params do not plan)."""
    results_dir = Path(results_dir)
    kept = kept_runs(results_dir, algorithm_names)
    runs, superseded = [run for run in kept if not run.superseded], [run for run in kept if run.superseded]
    profiles = {run.name: run.record.get("profile", "custom") for run in runs}
    if len(set(profiles.values()) - {"custom"}) > 1:
        raise ParamsError(f"{results_dir}: its runs were made at different profiles ({profiles}), and a report pools "
                          "them. Keep each profile's runs in its own folder (its study.results_dir).")
    # the plan is params.yaml's: runs made at another named profile are another study's
    others = {kept for kept in profiles.values() if not same_study(kept, profile)}
    metrics, table = aggregate(runs, confidence)
    found = comparisons(metrics, algorithm_names, paired_games(runs), confidence, runs)
    failures = read_failures(results_dir)
    statuses = plan_status(planned, runs, profile, failures, superseded) if planned and not others else None
    bars = success_plot(metrics, results_dir / "results_study.png")
    curves = learning_curves_plot(runs, results_dir / "results_study_curves.png")
    corrections = correction_plot(runs, results_dir / CORRECTION_PLOT)
    hours = sum(run.record.get("seconds", 0.0) for run in runs) / 3600
    scratch = [run.from_scratch_seconds for run in runs if run.from_scratch_seconds is not None]
    attempts = [a for tried in failures.values() for a in tried]
    hours_text = f"{hours:.1f} h of runs" + (
        f" as they ran; {sum(scratch) / 3600:.1f} h from scratch, summed over the {len(scratch)} that kept their "
        "stages' times" if scratch else "") + (
        f"; and {sum(a.get('seconds') or 0.0 for a in attempts) / 3600:.1f} h in {len(attempts)} failed attempt"
        f"{'s' * (len(attempts) > 1)}, listed under Planned runs" if attempts else "")
    text = (f"# Results study\n\nHeld-out real-environment success per method, pooled over seeds (Wilson "
            f"intervals), from {len(runs)} finished runs in `{results_dir}/` ({hours_text}, profile "
            f"{', '.join(sorted(set(profiles.values()))) or '-'}). An environment "
            f"marked{SIMULATED} is a seed-only domain: its held-out games are played inside the experience model."
            f"\n\n{table}"
            + (f"\n![held-out success]({bars.name})\n" if bars else "")
            + f"\n## The paper's claims at this scale\n\n{CLAIMS_NOTE.format(alpha=1 - confidence)}\n\n"
            + claims_table(found)
            + f"\n## A reading of each claim\n\n{READING_NOTE}\n\n"
            + claims_reading(found, metrics, untested_reasons(statuses or []), algorithm_names,
                             sorted({status.row.environment for status in statuses or []}))
            + "\n## Runs\n\nRuns of one environment whose warm start has one name (its seed and a letter) started from "
              "the same model: its training record is the same but for the time. A seed's rows trained on other "
              "machines may start from another, since one seed trains one model on one machine only. A run's wall "
              "time counts every invocation of its row, stopped ones too (`earlier_seconds` in its run.json; for "
              "runs kept before the study timed stopped invocations, what the study's logs timed).\n\n"
            + runs_table(runs)
            + (f"\n![learning curves]({curves.name})\n" if curves else "")
            + correction_section(runs, corrections)
            + superseded_section(superseded)
            + _plan_section(planned, statuses, profile, others, budget))
    return metrics, text


def correction_section(runs: list[Run], plot: Path | None = None) -> str:
    """Each correction run's rounds: the real transitions spent so far, how often the experience model the next
    round uses rewards a step the game did not reward in the round's policy's own play of held-out games (on-policy
    false wins), how many synthetic wins the real game confirmed, and the held-out success (its CORRECTION_ROUNDS;
    a run kept before it was kept shows its first and final rounds from its summary), and their `plot`
    (`correction_plot`) where there is one."""
    lines = [[run.name, row["round"], row.get("real_transitions_total", "-"),
              _of(row, "on_policy_false_wins", "on_policy_unrewarded", "on_policy_false_win_rate"),
              _of(row, "confirmed_wins", "synthetic_wins"), _format_number(row.get("heldout_success"))]
             for run in runs for row in correction_rounds(run)]
    if not lines:
        return ""
    return ("\n### On-policy correction, round by round\n\nAfter each round the experience model is trained on the "
            "real transitions of the round's training tasks, then scored on the round's policy playing held-out games "
            "in the real game (measured, never trained on): an on-policy false win is a step there that the game did "
            "not reward and the model does, the error that lets synthetic RL chase moves the game refuses. Held-out "
            "success is on the round's subset of held-out games (the last round's on all of them). A run kept before "
            "its per-round table was kept shows its first and last rounds, with the rate only.\n\n"
            + markdown_table(["run", "round", "real transitions so far", "on-policy false wins",
                              "synthetic wins confirmed in the real game", "held-out success"], lines)
            + (f"\n![correction rounds]({plot.name})\n" if plot else ""))


def correction_rounds(run: Run) -> list[dict[str, str]]:
    """A correction run's rounds as its CORRECTION_ROUNDS holds them, else its summary's first and last; [] for
    another run."""
    if not run.correction:
        return []
    if (path := run.path / CORRECTION_ROUNDS).is_file():
        with path.open(encoding="utf-8") as handle:
            return list(csv.DictReader(handle))
    first, final = run.correction.get("first", {}), run.correction.get("final", {})
    return [{"round": "1", **first}, {"round": str(run.correction.get("rounds", "last")), **final}]


def correction_plot(runs: list[Run], path: str | Path) -> Path | None:
    """The on-policy false-win rate of each correction run's experience model, round by round, one panel per
    environment, one line per run (dashed by seed); None without a correction run."""
    found = [(run, [(int(row["round"]), rate) for row in correction_rounds(run)
                    if str(row["round"]).isdigit() and (rate := _false_win_rate(row)) is not None]) for run in runs]
    found = [(run, points) for run, points in found if points]
    if not found:
        return None
    environments = sorted({run.environment or "" for run, _ in found})
    figure, axes = pyplot().subplots(1, len(environments), squeeze=False, figsize=(5 * len(environments), 3.2))
    for axis, environment in zip(axes[0], environments, strict=True):
        for run, points in ((run, points) for run, points in found if (run.environment or "") == environment):
            rounds = [x for x, _ in points]
            every_round = rounds == list(range(rounds[0], rounds[0] + len(rounds)))  # else no line across a gap
            axis.plot(rounds, [y for _, y in points], marker="o", label=f"seed {run.seed}",
                      linestyle=["-", "--", ":", "-."][run.seed % 4] if every_round else "none")
        axis.set_title(f"{environment}: the experience model after each round", fontsize=9)
        axis.set_xlabel("round", fontsize=8)
        axis.set_ylabel("on-policy false-win rate", fontsize=8)
        axis.set_ylim(-0.03, 1.03)
        axis.xaxis.get_major_locator().set_params(integer=True)
        axis.legend(fontsize=7)
    return save_figure(figure, path)


def _false_win_rate(row: dict[str, Any]) -> float | None:
    """A round's on-policy false wins over the unrewarded steps, else its rate as kept, else None."""
    wins, unrewarded = str(row.get("on_policy_false_wins")), str(row.get("on_policy_unrewarded"))
    if _is_number(wins) and _is_number(unrewarded) and float(unrewarded):
        return float(wins) / float(unrewarded)
    rate = str(row.get("on_policy_false_win_rate"))
    return float(rate) if _is_number(rate) else None


def _of(row: dict[str, Any], part: str, whole: str, rate: str = "") -> str:
    """`part`/`whole` of a round's row, else its `rate`, else '-'."""
    if _is_number(str(row.get(part, ""))) and _is_number(str(row.get(whole, ""))):
        return f"{int(float(row[part]))}/{int(float(row[whole]))}"
    return _format_number(row.get(rate)) if rate else "-"


def _format_number(value: Any) -> str:
    return f"{float(value):.2f}" if _is_number(str(value)) else "-"


def superseded_section(superseded: list[Run]) -> str:
    """The runs a later change to the method superseded (`supersede`): out of every result above, kept in their
    folders; what each spent and why it no longer stands."""
    if not superseded:
        return ""
    return ("\n### Superseded runs\n\nOut of every verdict, table and curve above; their folders keep every number, "
            "and the study runs them again (the rerun replaces the folder). Their costs still estimate their rows'.\n\n"
            + markdown_table(["run", "commit", "wall time (min)", "real transitions", "why superseded"],
                             [[run.name, (run.record.get("commit") or "?")[:8],
                               f"{run.record['seconds'] / 60:.1f}" if run.record.get("seconds") else "-",
                               run.sim_to_real.get("real_transitions_used", "-"), run.superseded]
                              for run in superseded]))


def _plan_section(planned: list[PlannedRun] | None, statuses: list[RowStatus] | None, profile: str,
                  others: set[str], budget: str) -> str:
    if not planned:
        return ""
    if others:
        return (f"\nPlanned runs: not listed. These runs were made at profile {', '.join(sorted(others))} and the plan "
                f"is params.yaml's, at profile {profile}.\n")
    return f"\n## Planned runs\n\n{budget + ' ' if budget else ''}{plan_table(statuses or [])}"


def write_report(results_dir: str | Path, confidence: float = 0.95, algorithm_names: tuple[str, ...] = ("grpo", "ppo"),
                 root: str | Path = ".", planned: list[PlannedRun] | None = None, profile: str = "custom",
                 budget: str = "") -> tuple[dict[str, Any], str]:
    """`report`, written: README.md in `results_dir`, and the results_study stage outputs in `root` (metrics JSON and
    CSV, reports/results_study.md with its plots beside it)."""
    results_dir = Path(results_dir)
    metrics, text = report(results_dir, confidence, algorithm_names, planned, profile, budget)
    results_dir.mkdir(parents=True, exist_ok=True)  # no run may have finished yet
    (results_dir / "README.md").write_text(text, encoding="utf-8")
    write_stage_outputs("results_study", metrics, text, root)
    for image in results_dir.glob("results_study*.png"):  # beside reports/results_study.md, whose links name them
        shutil.copy(image, report_path("results_study", root).with_name(image.name))
    write_csv(flat_rows(metrics), metrics_path("results_study", root).with_suffix(".csv"))
    return metrics, text


CLAIMS_NOTE = ("Both methods of a claim play the same held-out games, greedily. Where their runs kept each game's "
               "outcome, the verdict pairs them game by game: an exact sign test (McNemar's) on the games only one "
               "of them won, at p < {alpha:.3g} per claim (not corrected for the number of claims); otherwise their "
               "Wilson intervals must be apart. \"Not resolved\" and, for a claim of matching, \"not "
               "contradicted\" mean no significant difference at this number of games, not that the two are "
               "equal. \"Detectable\" is the smallest true difference in success rate this comparison finds with "
               "80% power at that level (McNemar's normal approximation over the games both played, seeds pooled, "
               "with their observed share of split games; unpaired, the pooled rate's variance): a difference "
               "smaller than it would usually read \"not resolved\" here.")


READING_NOTE = ("Each of the paper's three claims, from the comparisons above that test it, beside the gap the paper "
                "reports on WebShop (its scale: an 8B policy and experience model, 80K real transitions) and the gap "
                "each comparison could detect (in points; our copy of the paper's figures is its GRPO rows); and the "
                "comparisons not made, with why. Where a paired comparison is not resolved, a paper's gap larger than "
                "the detectable one weighs against the claim at our scale; a smaller one leaves it open. \"Our "
                "control\" marks a comparison the paper does not make.")


def flat_rows(metrics: dict[str, Any]) -> list[dict[str, Any]]:
    """The table as rows for a CSV (`dvc plots show` draws metrics/results_study.csv as bars)."""
    return [{"method": method, "environment": environment, "success_rate": m["success_rate"],
             "success_ci_low": m["success_ci_low"], "success_ci_high": m["success_ci_high"],
             "episodes": m["episodes"]} for method, by_env in metrics.items() for environment, m in by_env.items()]


def success_plot(metrics: dict[str, Any], path: str | Path) -> Path | None:
    """Held-out success with confidence intervals, one panel per environment and one bar per method."""
    environments = sorted({environment for by_env in metrics.values() for environment in by_env})
    if not environments:
        return None
    panels = [[(method, by_env[environment]) for method, by_env in metrics.items() if environment in by_env]
              for environment in environments]
    figure, axes = pyplot().subplots(1, len(environments), squeeze=False, sharey=True,
                                     gridspec_kw={"width_ratios": [len(bars) for bars in panels]},
                                     figsize=(max(4.0, 0.55 * sum(map(len, panels)) + 1.5), 4.2))
    for axis, environment, bars in zip(axes[0], environments, panels, strict=True):
        rates = [m["success_rate"] for _, m in bars]
        errors = [[r - m["success_ci_low"] for r, (_, m) in zip(rates, bars, strict=True)],
                  [m["success_ci_high"] - r for r, (_, m) in zip(rates, bars, strict=True)]]
        axis.bar(range(len(bars)), rates, yerr=errors, capsize=3)
        axis.set_xticks(range(len(bars)), [method for method, _ in bars], rotation=60, ha="right", fontsize=7)
        axis.set_title(environment, fontsize=9)
        axis.set_ylim(0, 1)
    axes[0][0].set_ylabel("held-out success")
    return save_figure(figure, path)


def _read(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _percent(rate: float) -> str:
    """A rate as a percentage; one decimal under 1%, where a whole number would read as none (1 of 601 is 0.2%)."""
    return f"{rate:.1%}" if 0 < rate < 0.01 else f"{rate:.0%}"


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def _is_number(text: str | None) -> bool:
    try:
        float(text or "")
    except ValueError:
        return False
    return True
