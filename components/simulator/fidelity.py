"""Fidelity of an experience model on held-out *real* transitions: does it predict what the environment did?

Held-out transitions are the steps of seed trajectories whose task falls on the held-out side of
`contract.is_heldout_task` (`data.heldout_task_fraction`): those tasks are kept out of experience-model training and
out of the replay buffer, so nothing here can be answered by looking the transition up.

A *predictor* is a plain callable `(list[Transition]) -> list[prediction]`, one prediction per transition, in order,
where a prediction is anything with `next_state`, `reward` and `done` (`experience_model.Prediction`, or the small
`Guess` below). Three are provided:

- `state_unchanged`: next state = current state, reward 0, not done (what an invalid action does; a strong floor,
  since most steps in text environments change little and earn nothing).
- `copy_nearest_neighbour(buffer)`: the outcome of the most similar training transition of the same environment.
- `model_predictor(backend, fmt, buffer)`: the trained experience model, through the same signature; its
  retrieval and reasoning ablations are the `PromptFormat.use_retrieval` / `use_reasoning` switches.

Metrics (`score_predictions`), per environment and overall, every rate a fraction in [0, 1] with its count:

- `exact_match`: next states equal after collapsing runs of whitespace and stripping the ends.
- `token_f1`: SQuAD-style token F1 of next states: lower-cased `\\w+` tokens (whitespace and punctuation split and
  dropped), multiset overlap, harmonic mean of precision and recall; 1.0 when both are empty, 0.0 when one is.
  Unlike SQuAD, articles are kept: in TextWorld "a" / "the" carry no answer span, they are state text.
- `change_f1`: token F1 of what changed: the lines of the next state that the current state does not hold (a
  multiset of stripped lines), predicted against real. Copying the state scores 0 on a step that changed something
  (and 1 where nothing did), so this is the measure that token F1 of whole states, mostly unchanged text, blurs.
- `embedding_similarity` (only when an encoder is given): mean cosine of the next-state embeddings.
- `reward_accuracy`: |predicted - gold| < `reward_tolerance` (default 0.5). Seed rewards are binary {0, 1}, where
  this is exactly "the prediction rounds to the gold reward"; for graded rewards pass a smaller tolerance.
- `positive_reward_accuracy` over the `positive_n` transitions with gold reward > 0: rewards are rare (about 2% of
  TextWorld steps), so a constant-0 predictor already scores ~98% overall and 0% here.
- `done_accuracy`, and `terminal_done_accuracy` over the `terminal_n` transitions that do end the episode.
- `false_wins` (of the `unrewarded_n` transitions with gold reward <= 0, those predicted a reward above it beyond the
  tolerance: a synthetic win the game never gives) and `missed_wins` (rewarded transitions predicted without it).
- `refused_n`: transitions whose step info says the game refused the command (`valid_action` false, as the real
  TextWorld adapter records); `refusal_change_f1` (did the model say what the game answered?) and
  `refusal_false_wins` over them. Seed data from elsewhere may carry no such info: then refused_n is 0.
A rate over an empty subset is None (JSON null), never a made-up 0 or 1.
"""
from __future__ import annotations

import re
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from components.data.contract import (
    Trajectory,
    Transition,
    is_heldout_task,
    is_lookalike,
    is_outcome,
    is_refused,
    rewarded_commands,
    transitions,
)

if TYPE_CHECKING:
    from components.llm.backends import GenerationBackend
    from components.simulator.experience_model import InferenceSettings, PredictionStats, PromptFormat
    from components.simulator.replay_buffer import Encoder, ReplayBuffer

OVERALL = "overall"


class PredictionLike(Protocol):
    next_state: str
    reward: float
    done: bool


@dataclass(frozen=True)
class Guess:
    """A baseline's prediction: the fields of `experience_model.Prediction` that fidelity scores."""

    next_state: str
    reward: float
    done: bool


Predictor = Callable[[list[Transition]], Sequence[PredictionLike]]


# ----------------------------------------------------------------------------------------------------- the data
def heldout_transitions(trajectories: Iterable[Trajectory], fraction: float,
                        history_length: int | None = None) -> list[Transition]:
    """Every step of every trajectory whose task is held out (`is_heldout_task(task_id, fraction)`), in file order."""
    return [t for trajectory in trajectories if is_heldout_task(trajectory.task.task_id, fraction)
            for t in transitions(trajectory, history_length)]


def outcomes_first_sample(transitions_: Sequence[Transition], per_environment: int) -> list[Transition]:
    """At most `per_environment` transitions of each environment: up to half of them rewarded or terminal, up to a
    quarter look-alikes (`is_lookalike`), up to a quarter commands the environment refused, the rest ordinary (then,
    where too few are, what the other kinds have left: a capped kind never empties the sample), each kind in file
    order.

    Why: outcomes are 2-3% of steps, so the first N steps hold almost none, and reward and done accuracy would only
    measure "predicts nothing happens". Look-alikes test that a reward is earned by the state, not by the command
    or the turn it comes at. Refusals test that a command the state does not allow changes nothing: a model that
    lets one succeed hands a policy states the environment never reaches. The per-kind rows of the report keep the
    kinds apart.
    """
    rewarded = rewarded_commands(transitions_)
    groups: dict[str, tuple[list, list, list, list]] = defaultdict(lambda: ([], [], [], []))
    for t in transitions_:
        outcomes, alike, refused, ordinary = groups[t.task.environment]
        (outcomes if is_outcome(t.reward, t.done) else alike if is_lookalike(t, rewarded)
         else refused if is_refused(t) else ordinary).append(t)
    sample = []
    half, quarter = per_environment // 2, per_environment // 4
    for outcomes, alike, refused, ordinary in groups.values():
        chosen = outcomes[:half] + alike[:quarter] + refused[:quarter]
        rest = ordinary + refused[quarter:] + alike[quarter:] + outcomes[half:]
        sample += chosen + rest[:per_environment - len(chosen)]
    return sample


# -------------------------------------------------------------------------------------------------- the metrics
_TOKEN = re.compile(r"\w+")


def tokens(text: str) -> list[str]:
    return _TOKEN.findall(text.lower())


def token_f1(pred: str, gold: str) -> float:
    """SQuAD-style token F1 (module docstring)."""
    p, g = tokens(pred), tokens(gold)
    if not p or not g:
        return float(p == g)
    overlap = sum((Counter(p) & Counter(g)).values())
    if overlap == 0:
        return 0.0
    precision, recall = overlap / len(p), overlap / len(g)
    return 2 * precision * recall / (precision + recall)


def exact_match(pred: str, gold: str) -> bool:
    return " ".join(pred.split()) == " ".join(gold.split())


def reward_correct(pred: float, gold: float, tolerance: float = 0.5) -> bool:
    """|pred - gold| < tolerance; with binary rewards and the default 0.5, "rounds to the gold reward"."""
    return abs(float(pred) - float(gold)) < tolerance


def changed_text(state: str, next_state: str) -> str:
    """The lines of `next_state` that `state` does not hold (as a multiset of stripped, non-empty lines), in order."""
    left = Counter(line.strip() for line in state.splitlines() if line.strip())
    changed = []
    for line in (line.strip() for line in next_state.splitlines()):
        if line and left[line] > 0:
            left[line] -= 1
        elif line:
            changed.append(line)
    return "\n".join(changed)


def score_predictions(transitions_: Sequence[Transition], predictions: Sequence[PredictionLike], *,
                      reward_tolerance: float = 0.5, encoder: Encoder | None = None) -> dict[str, dict[str, Any]]:
    """{environment: metrics, ..., "overall": metrics} for predictions aligned with transitions (module docstring)."""
    if len(transitions_) != len(predictions):
        raise ValueError(f"{len(predictions)} predictions for {len(transitions_)} transitions")
    rewarded = rewarded_commands(transitions_)
    rows = []
    for t, p in zip(transitions_, predictions):
        reward_right = reward_correct(p.reward, t.reward, reward_tolerance)
        rows.append({
            "environment": t.task.environment,
            "exact": exact_match(p.next_state, t.next_state),
            "f1": token_f1(p.next_state, t.next_state),
            "change_f1": token_f1(changed_text(t.state, p.next_state), changed_text(t.state, t.next_state)),
            "reward": reward_right,
            "positive": t.reward > 0,
            "false_win": t.reward <= 0 and not reward_right and p.reward > t.reward,
            "done": bool(p.done) == bool(t.done),
            "terminal": bool(t.done),
            "lookalike": is_lookalike(t, rewarded),
            "refused": is_refused(t),
        })
    if encoder is not None and rows:
        predicted = encoder.encode([p.next_state for p in predictions])
        gold = encoder.encode([t.next_state for t in transitions_])
        cosines = np.sum(_unit(predicted) * _unit(gold), axis=1)
        for row, cosine in zip(rows, cosines):
            row["cosine"] = float(cosine)
    groups: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for row in rows:
        groups[row["environment"]].append(row)
    result = {environment: _aggregate(group, encoder is not None) for environment, group in sorted(groups.items())}
    result[OVERALL] = _aggregate(rows, encoder is not None)
    return result


def _unit(vectors: np.ndarray) -> np.ndarray:
    vectors = np.asarray(vectors, dtype=np.float64)
    return vectors / np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)


def _mean(values: list[float]) -> float | None:
    return float(sum(values) / len(values)) if values else None


def _aggregate(rows: list[dict[str, Any]], with_embeddings: bool) -> dict[str, Any]:
    positive = [r for r in rows if r["positive"]]
    terminal = [r for r in rows if r["terminal"]]
    lookalike = [r for r in rows if r["lookalike"]]
    refused = [r for r in rows if r["refused"]]
    metrics: dict[str, Any] = {
        "n": len(rows),
        "exact_match": _mean([r["exact"] for r in rows]),
        "token_f1": _mean([r["f1"] for r in rows]),
        "change_f1": _mean([r["change_f1"] for r in rows]),
        "reward_accuracy": _mean([r["reward"] for r in rows]),
        "positive_n": len(positive),
        "positive_reward_accuracy": _mean([r["reward"] for r in positive]),
        "done_accuracy": _mean([r["done"] for r in rows]),
        "terminal_n": len(terminal),
        "terminal_done_accuracy": _mean([r["done"] for r in terminal]),
        "lookalike_n": len(lookalike),
        "lookalike_reward_accuracy": _mean([r["reward"] for r in lookalike]),
        "unrewarded_n": len(rows) - len(positive),
        "false_wins": sum(r["false_win"] for r in rows),
        "missed_wins": sum(not r["reward"] for r in positive),
        "refused_n": len(refused),
        "refusal_change_f1": _mean([r["change_f1"] for r in refused]),
        "refusal_false_wins": sum(r["false_win"] for r in refused),
    }
    if with_embeddings:
        metrics["embedding_similarity"] = _mean([r["cosine"] for r in rows])
    return metrics


# ----------------------------------------------------------------------------------------------- the predictors
def state_unchanged(transitions_: list[Transition]) -> list[Guess]:
    """Next state = current state, reward 0, not done."""
    return [Guess(t.state, 0.0, False) for t in transitions_]


def copy_nearest_neighbour(buffer: ReplayBuffer, k: int = 1, exclude_own_trajectory: bool = True) -> Predictor:
    """A predictor copying the outcome of the most similar (state, action) in `buffer`, same environment only.

    next_state is the top hit's. With k = 1 reward and done are the top hit's too; with k > 1 they are the majority
    over the top k (ties go to the better-ranked value). `exclude_own_trajectory` keeps a transition from
    retrieving itself or its own trajectory when the buffer happens to hold it (held-out tasks are not in the
    pipeline's buffer, so there it changes nothing). An environment with no stored transitions falls back to
    `state_unchanged`.
    """
    if not isinstance(k, int) or k < 1:
        raise ValueError(f"k must be a positive int, got {k!r}")

    def predict(transitions_: list[Transition]) -> list[Guess]:
        out: list[Guess | None] = [None] * len(transitions_)
        by_environment: dict[str, list[int]] = defaultdict(list)
        for i, t in enumerate(transitions_):
            by_environment[t.task.environment].append(i)
        for environment, positions in by_environment.items():
            batch = [transitions_[i] for i in positions]
            hits = buffer.retrieve_batch(
                [(t.state, t.action) for t in batch], environment=environment, k=k,
                exclude_trajectories=[t.trajectory_id if exclude_own_trajectory else None for t in batch])
            for i, t, found in zip(positions, batch, hits):
                if not found:
                    out[i] = Guess(t.state, 0.0, False)
                    continue
                out[i] = Guess(found[0].next_state, _vote([h.reward for h in found]), _vote([h.done for h in found]))
        return [g for g in out if g is not None]

    predict.__name__ = f"copy_nearest_neighbour_k{k}"
    return predict


def _vote(values: list[Any]) -> Any:
    """Most common value; ties go to the one ranked first (Counter keeps first-seen order)."""
    return Counter(values).most_common(1)[0][0]


def model_predictor(backend: GenerationBackend, fmt: PromptFormat, settings: InferenceSettings,
                    buffer: ReplayBuffer | None = None, stats: PredictionStats | None = None) -> Predictor:
    """The trained experience model as a predictor, with the same signature as the baselines.

    Each transition becomes an `ExperienceQuery` with its last `fmt.history_length` (state, action) pairs and, when
    `fmt.use_retrieval` and a buffer is given, the `fmt.top_k` most similar buffer transitions of its environment
    (its own trajectory excluded); `experience_model.predict` does the rest (retries, fallbacks). The ablations are
    the format's switches: evaluate the model trained with and without `use_retrieval` / `use_reasoning`, each
    with the format it was trained with.
    """
    from components.simulator.experience_model import ExperienceQuery, predict

    def run(transitions_: list[Transition]) -> list[PredictionLike]:
        examples: list[Sequence[Any]] = [()] * len(transitions_)
        if fmt.use_retrieval and buffer is not None:
            examples = buffer.retrieve_examples(
                [(t.task.environment, t.state, t.action, t.trajectory_id) for t in transitions_], fmt.top_k)
        queries = [ExperienceQuery(t.task, t.state, t.action,
                                   t.history[-fmt.history_length:] if fmt.history_length > 0 else (), tuple(found))
                   for t, found in zip(transitions_, examples, strict=True)]
        return list(predict(backend, queries, fmt, settings, stats=stats))

    return run


def evaluate(predictors: dict[str, Predictor], transitions_: list[Transition], *, reward_tolerance: float = 0.5,
             encoder: Encoder | None = None) -> dict[str, dict[str, dict[str, Any]]]:
    """{predictor name: score_predictions(...)} for each predictor on the same transitions."""
    return {name: score_predictions(transitions_, predictor(transitions_), reward_tolerance=reward_tolerance,
                                    encoder=encoder)
            for name, predictor in predictors.items()}


# ---------------------------------------------------------------------------------------------------- the report
_COLUMNS = (("n", "n"), ("exact_match", "exact match"), ("token_f1", "token F1"), ("change_f1", "change F1"),
            ("embedding_similarity", "embedding sim."), ("reward_accuracy", "reward acc."),
            ("positive_reward_accuracy", "reward acc. (r>0)"), ("done_accuracy", "done acc."),
            ("terminal_done_accuracy", "done acc. (terminal)"),
            ("lookalike_reward_accuracy", "reward acc. (look-alikes)"), ("false_wins", "false wins"),
            ("missed_wins", "missed wins"), ("refusal_change_f1", "refusals: change F1"))


def fidelity_report(results: dict[str, dict[str, dict[str, Any]]], title: str | None = "Fidelity on held-out real "
                    "transitions", reward_tolerance: float = 0.5) -> str:
    """A markdown table, one row per (predictor, environment), from {predictor: score_predictions(...)}."""
    has_embeddings = any("embedding_similarity" in m for scores in results.values() for m in scores.values())
    columns = [c for c in _COLUMNS if has_embeddings or c[0] != "embedding_similarity"]
    lines = [f"## {title}", ""] if title else []
    lines.append("| predictor | environment | " + " | ".join(label for _, label in columns) + " |")
    lines.append("|---|---|" + "---:|" * len(columns))
    for name, scores in results.items():
        for environment, metrics in scores.items():
            cells = []
            for key, _ in columns:
                value = metrics.get(key)
                if key == "positive_reward_accuracy" and value is not None:
                    cells.append(f"{value:.3f} (n={metrics['positive_n']})")
                elif key == "terminal_done_accuracy" and value is not None:
                    cells.append(f"{value:.3f} (n={metrics['terminal_n']})")
                elif key == "lookalike_reward_accuracy" and value is not None:
                    cells.append(f"{value:.3f} (n={metrics['lookalike_n']})")
                elif key == "false_wins":
                    cells.append(f"{value} of {metrics['unrewarded_n']}")
                elif key == "missed_wins":
                    cells.append(f"{value} of {metrics['positive_n']}")
                elif key == "refusal_change_f1" and value is not None:
                    cells.append(f"{value:.3f} (n={metrics['refused_n']})")
                elif value is None:
                    cells.append("–")
                elif isinstance(value, int) and not isinstance(value, bool):
                    cells.append(str(value))
                else:
                    cells.append(f"{value:.3f}")
            lines.append(f"| {name} | {environment} | " + " | ".join(cells) + " |")
    lines.append("")
    lines.append(f"Reward accuracy: |predicted − gold| < {reward_tolerance:g}. Change F1: token F1 of the lines the "
                 "step changed, predicted against real (copying the state scores 0 where something changed). "
                 "Look-alikes: unrewarded steps whose command is rewarded elsewhere in the sample (`eat meal` with "
                 "no meal). False wins: a reward predicted where the game gave none; missed wins: the reverse. "
                 "Refusals: commands the game refused (step info `valid_action` false). Rates are fractions in "
                 "[0, 1]; – marks an empty subset.")
    return "\n".join(lines) + "\n"
