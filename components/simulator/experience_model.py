"""The experience model M_exp: prompt and target formats, SFT, inference backends, and robust parsing.

Prompt (a system message and a user message, rendered with the tokenizer's chat template):

    system: what the model simulates and the exact reply format
    user:   Task (environment): <instruction>
            Similar transitions:            <- top-k retrieved examples; absent with use_retrieval off or none found
            Example 1
            State: <clipped>  Action: <a>  Next state: <clipped>  Reward: 0, done: false
            Recent history (oldest first):  <- at most history_length (state, action) pairs, states clipped
            Current state: <state>
            Action: <action>

Target (the assistant reply), strict and parseable:

    <reasoning>
    why the action leads to the next state and the reward
    </reasoning>
    <next_state>
    the full next state, verbatim
    </next_state>
    <reward>0</reward>
    <done>false</done>

With `reply: changes` the next state is written as the sections it changed (`<changes>`, see `state_changes`),
in full where those cannot rebuild it exactly; with `trim_context` the history and example states start at their
first changed section. With use_reasoning off the reasoning section is absent. Reasoning comes first so the next
state is generated conditioned on it: that is the paper's joint objective, and the loss covers the whole reply
(prompt tokens masked).
`format_target` and `parse_prediction` are exact inverses (a state round-trips byte for byte).

Inference goes through `GenerationBackend.generate` (Hugging Face batched `generate` by default; vLLM and any
OpenAI-compatible endpoint behind the same seam). `predict` never raises on bad model output: it retries unparsable
replies (and rewards outside the configured range) with sampling, then falls back (see `fallback_prediction`) and
counts it in `PredictionStats`. A stage then holds the run to a `FallbackBudget`: a simulator that mostly falls back
simulates nothing (each fallback keeps the state, or ends the episode with no outcome), and the stage fails saying
so.
"""
from __future__ import annotations

import logging
import math
import re
from collections import defaultdict
from collections.abc import Collection, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING

from components.data.contract import Task, is_lookalike, is_outcome, is_refused, rewarded_commands
from components.llm.backends import BackendError, GenerationBackend, Message, PromptTooLong
from components.simulator import state_changes
from components.simulator.annotation import AnnotatedTransition
from components.simulator.replay_buffer import ReplayBuffer, Retrieved
from components.stats import wilson_interval

if TYPE_CHECKING:  # heavy imports (torch, transformers, datasets) happen inside the functions that need them
    from datasets import Dataset

log = logging.getLogger(__name__)



# ---- settings -------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PromptFormat:
    """What goes into a prompt and a target. The same values must be used for training and for inference.

    params experience_model.prompt: no defaults here, every value comes from params."""

    use_reasoning: bool  # ablation: the target carries a reasoning section
    use_retrieval: bool  # ablation: the prompt carries retrieved examples
    history_length: int  # earlier (state, action) pairs shown, most recent last
    top_k: int  # retrieved examples shown
    max_state_chars: int  # the current state (and the target's next state is never cut)
    history_state_chars: int  # each history state: history is mostly context for the actions
    example_state_chars: int  # each retrieved example's state and next state
    reply: str  # "next_state": the reply restates the whole next state; "changes": only its changed sections
    trim_context: bool  # history and example states start at their first changed section (state_changes)


@dataclass(frozen=True)
class InferenceSettings:
    """How the experience model is asked (params experience_model.inference, and data.reward_range)."""

    retries: int  # re-generations of an unparsable reply before a fallback
    max_new_tokens: int
    temperature: float  # the first attempt's (0: greedy)
    retry_temperature: float  # a retry samples at least this hot (a greedy retry repeats the reply)
    reward_range: tuple[float, float] | None  # a reward outside it is unparsable (None: any finite reward)


# ---- prompt and target ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ExperienceQuery:
    """One request to the experience model: what the agent did, and the context to predict its outcome in."""

    task: Task
    state: str
    action: str
    history: Sequence[tuple[str, str]] = ()  # earlier (state, action) pairs, oldest first
    examples: Sequence[Retrieved] = ()  # retrieved similar transitions, best first


def system_message(fmt: PromptFormat) -> str:
    outcome = ("<changes>\nonly the sections of the state that change, each from its header line\n</changes>"
               if fmt.reply == "changes" else "<next_state>\nthe full next state\n</next_state>")
    reply = f"{outcome}\n<reward>a number</reward>\n<done>true or false</done>"
    if fmt.use_reasoning:
        reply = "<reasoning>\nwhy the action leads to the next state and the reward\n</reasoning>\n" + reply
    return (
        "You simulate a text environment. Given the task, the recent history, the current state and the agent's "
        "action, predict what the environment returns. An invalid action leaves the state unchanged with reward 0. "
        f"Reply in exactly this format:\n{reply}"
    )


def build_messages(query: ExperienceQuery, fmt: PromptFormat) -> list[Message]:
    parts = [f"Task ({query.task.environment}): {query.task.instruction}"]
    examples = list(query.examples)[: fmt.top_k] if fmt.use_retrieval else []
    if examples:
        lines = ["Similar transitions:"]
        for number, ex in enumerate(examples, 1):
            shown = state_changes.from_first_change(ex.state, ex.next_state) if fmt.trim_context else ex.state
            step = state_changes.changes(ex.state, ex.next_state) if fmt.reply == "changes" else None
            lines += [
                f"Example {number}",
                f"State: {clip(shown, fmt.example_state_chars)}",
                f"Action: {ex.action}",
                f"Changes: {clip(step, fmt.example_state_chars)}" if step is not None
                else f"Next state: {clip(ex.next_state, fmt.example_state_chars)}",
                f"Reward: {format_reward(ex.reward)}, done: {format_done(ex.done)}",
            ]
        parts.append("\n".join(lines))
    history = list(query.history)[-fmt.history_length:] if fmt.history_length > 0 else []
    if history:
        lines = ["Recent history (oldest first):"]
        for state, action in history:
            shown = state_changes.from_first_change(state, query.state) if fmt.trim_context else state
            lines += [f"State: {clip(shown, fmt.history_state_chars)}", f"Action: {action}"]
        parts.append("\n".join(lines))
    else:
        parts.append("Recent history: none, this is the first step.")
    parts.append(f"Current state:\n{clip(query.state, fmt.max_state_chars)}")
    parts.append(f"Action: {query.action}")
    return [{"role": "system", "content": system_message(fmt)}, {"role": "user", "content": "\n\n".join(parts)}]


def clip(text: str, limit: int) -> str:
    """Keep the head and the tail of a long text: states often put the goal first and the inventory last."""
    if len(text) <= limit:
        return text
    marker = f" [... {len(text) - limit} chars cut ...] "
    keep = max(limit - len(marker), 0)
    head = keep // 2
    return text[:head] + marker + text[len(text) - (keep - head):]


def format_reward(reward: float) -> str:
    return f"{reward:g}"  # 0.0 -> "0", 1.0 -> "1", 0.25 -> "0.25": short, and float() reads it back exactly


def format_done(done: bool) -> str:
    return "true" if done else "false"


def format_target(next_state: str, reward: float, done: bool, reasoning: str | None = None, *,
                  changes_from: str | None = None) -> str:
    """The reply for a transition. With `changes_from` (the current state) the next state is written as its changed
    sections (`<changes>`) wherever `state_changes.changes` can rebuild it exactly, else in full (`<next_state>`)."""
    head = f"<reasoning>\n{reasoning.strip()}\n</reasoning>\n" if reasoning is not None else ""
    tail = f"<reward>{format_reward(reward)}</reward>\n<done>{format_done(done)}</done>"
    step = state_changes.changes(changes_from, next_state) if changes_from is not None else None
    if step is not None:
        target = f"{head}<changes>\n{step}\n</changes>\n{tail}"
        # the tags' optional newlines must not take a line of the changes: the reply has to parse back exactly
        parsed = parse_prediction(target, changes_from)
        if parsed is not None and parsed.next_state == next_state:
            return target
    return f"{head}<next_state>\n{next_state}\n</next_state>\n{tail}"


@dataclass(frozen=True)
class Prediction:
    next_state: str
    reward: float
    done: bool
    reasoning: str | None = None
    fallback: bool = False  # True: the model gave no parsable reply, this is `fallback_prediction`
    attempts: int = 1  # generations it took (1 + retries)


REPLY_END = "</done>"  # the last tag of a reply: generation can stop there (`make_backend(..., stop=(REPLY_END,))`)
# The whole reply up to the first </done>; anything after it is ignored (a model may run on before it stops).
# Non-greedy next_state (or changes) with optional newlines around it: the exact inverse of format_target.
_TARGET = re.compile(
    r"\s*(?:<reasoning>(?P<reasoning>.*?)</reasoning>\s*)?"
    r"(?:<next_state>\n?(?P<next_state>.*?)\n?</next_state>|<changes>\n?(?P<changes>.*?)\n?</changes>)\s*"
    r"<reward>(?P<reward>[^<]*)</reward>\s*"
    r"<done>(?P<done>[^<]*)</done>",
    re.DOTALL,
)


def parse_prediction(text: str, state: str | None = None) -> Prediction | None:
    """The prediction in a reply, or None if the reply breaks the format in any way (never raises). A `<changes>`
    reply needs the current `state` it applies to."""
    if not isinstance(text, str):
        return None
    end = text.find(REPLY_END)
    if end < 0:
        return None
    match = _TARGET.fullmatch(text[: end + len(REPLY_END)])
    if match is None:
        return None
    if match["changes"] is not None:
        next_state = state_changes.apply_changes(state, match["changes"]) if state is not None else None
    else:
        next_state = match["next_state"]
    if next_state is None or not next_state.strip():
        return None
    try:
        reward = float(match["reward"].strip())
    except ValueError:
        return None
    if not math.isfinite(reward):
        return None
    done = match["done"].strip().lower()
    if done not in ("true", "false"):
        return None
    reasoning = match["reasoning"].strip() if match["reasoning"] is not None else None
    return Prediction(next_state, reward, done == "true", reasoning)


# ---- SFT data -------------------------------------------------------------------------------------------------

def sft_examples(
    annotated: Sequence[AnnotatedTransition],
    buffer: ReplayBuffer | None,
    fmt: PromptFormat,
    outcome_repeats: int,
    lookalike_repeats: int,
    policy_share: float = 0.0,
    refusal_repeats: int = 1,
    fed_back: Collection[str] = (),
) -> Dataset:
    """Conversational prompt/completion pairs for TRL's SFTTrainer (loss on the completion only).

    Rewarded or terminal transitions appear `outcome_repeats` times. Why: outcomes are rare in seed data (2-3% of
    TextWorld steps), and a model trained on the plain mix learns "reward 0, not done" everywhere, so synthetic RL
    never sees a success.
    Transitions of the trajectories in `fed_back` (a trained policy's real play, fed back by correction rounds) are
    repeated on top, whole times, until they make up about `policy_share` of the examples (`policy_repeats`). Why:
    they show the states the policy reaches, which the seed rarely does, and a few dozen of them beside thousands of
    seed steps are hardly drawn in a short continued training (reports/results_study_findings.md, the correction
    row). Not every `source: policy` record: the seed's own scripted play has that source too, and counted, it put
    the share past reach so nothing was repeated (session 57's note).
    Look-alikes (`contract.is_lookalike`: unrewarded steps of a command rewarded elsewhere, `eat meal` with no meal)
    appear `lookalike_repeats` times. Why: repeating only the rewarded `eat meal` teaches "eat meal wins" whatever the
    state (reports/research/experience_model/on_policy/).
    Commands the environment refused (`contract.is_refused`) appear `refusal_repeats` times. Why: a policy's own
    play is full of sensible commands the state does not allow (`take X from Y` with X already held), and a model
    that lets one succeed hands synthetic RL a win the game never gives (reports/research/experience_model/refusals/).

    History is rebuilt from the earlier steps of each transition's trajectory. Grounding examples come from
    `buffer.retrieve_examples`, which never returns the transition's own trajectory: the buffer holds the seed data
    itself, and a model trained next to its own answer learns to copy instead of to simulate. Extra columns
    (trajectory_id, step_index) are for inspection.
    """
    from datasets import Dataset

    if min(outcome_repeats, lookalike_repeats, refusal_repeats) < 1:
        raise ValueError(f"outcome_repeats, lookalike_repeats and refusal_repeats must be >= 1, got "
                         f"{outcome_repeats}, {lookalike_repeats}, {refusal_repeats}")
    if not 0 <= policy_share < 1:
        raise ValueError(f"policy_share must be in [0, 1), got {policy_share}")
    rewarded, fed_back = rewarded_commands(annotated), set(fed_back)
    by_trajectory: dict[str, list[AnnotatedTransition]] = defaultdict(list)
    for record in annotated:
        by_trajectory[record.trajectory_id].append(record)
    for steps in by_trajectory.values():
        steps.sort(key=lambda r: r.step_index)

    examples: list[list[Retrieved]] = [[] for _ in annotated]
    if fmt.use_retrieval and buffer is not None:
        examples = buffer.retrieve_examples(
            [(r.task.environment, r.state, r.action, r.trajectory_id) for r in annotated], fmt.top_k)
    rows, on_policy = [], []
    for record, found in zip(annotated, examples, strict=True):
        earlier = [s for s in by_trajectory[record.trajectory_id] if s.step_index < record.step_index]
        history = [(s.state, s.action) for s in earlier][-fmt.history_length:] if fmt.history_length > 0 else []
        query = ExperienceQuery(record.task, record.state, record.action, tuple(history), tuple(found))
        target = format_target(record.next_state, record.reward, record.done,
                               record.reasoning if fmt.use_reasoning else None,
                               changes_from=record.state if fmt.reply == "changes" else None)
        row = {
            "prompt": build_messages(query, fmt),
            "completion": [{"role": "assistant", "content": target}],
            "trajectory_id": record.trajectory_id,
            "step_index": record.step_index,
        }
        repeats = (outcome_repeats if is_outcome(record.reward, record.done)
                   else lookalike_repeats if is_lookalike(record, rewarded)
                   else refusal_repeats if is_refused(record) else 1)
        rows.extend([row] * repeats)
        on_policy.extend([record.trajectory_id in fed_back] * repeats)
    own_repeats = policy_repeats(sum(on_policy), len(rows) - sum(on_policy), policy_share)
    return Dataset.from_list([row for row, own in zip(rows, on_policy, strict=True)
                              for _ in range(own_repeats if own else 1)])


def policy_repeats(on_policy: int, others: int, share: float) -> int:
    """How many times each on-policy example appears so that they make up about `share` of all examples (at least
    once: 1 where there are none, or `share` is 0 or already reached)."""
    if not on_policy or not share:
        return 1
    return max(1, round(share * others / ((1 - share) * on_policy)))


# ---- prediction with retries and fallback ---------------------------------------------------------------------

# Appended to the unchanged state when the model gave nothing usable.
FALLBACK_NOTE = "[no effect: the environment did not respond to this action]"


def fallback_prediction(query: ExperienceQuery, attempts: int) -> Prediction:
    """The outcome used when every reply was unparsable: state unchanged (plus FALLBACK_NOTE), reward 0, not done.

    Reward 0 never credits the policy for the simulator's failure, and an unchanged state is the least-informative
    honest answer. `Prediction.fallback` and `PredictionStats` tell it apart; the synthetic environment ends the
    episode there as an environment failure (`synthetic.SyntheticEnvironment`), so no outcome rests on it.
    """
    return Prediction(f"{query.state}\n{FALLBACK_NOTE}", 0.0, False, None, fallback=True, attempts=attempts)


FAILED_REPLIES_KEPT = 3  # the first unparsable replies a run keeps, to show in a budget failure


@dataclass
class PredictionStats:
    """Counters across `predict` calls: pass one object to every call of a run and report `as_dict()`."""

    requests: int = 0
    generations: int = 0
    retries: int = 0  # generations beyond each request's first
    fallbacks: int = 0
    reward_out_of_range: int = 0  # replies that parsed with a reward outside the range (counted as unparsable)
    backend_calls: int = 0  # generate() calls
    backend_errors: int = 0  # generate() calls that raised (each costs its batch one attempt)
    failed_replies: list[str] = field(default_factory=list, repr=False)  # the first few, for the failure message
    last_backend_error: str | None = field(default=None, repr=False)

    @property
    def fallback_rate(self) -> float:
        return self.fallbacks / self.requests if self.requests else 0.0

    @property
    def backend_error_rate(self) -> float:
        return self.backend_errors / self.backend_calls if self.backend_calls else 0.0

    def as_dict(self) -> dict[str, float]:
        counts = {key: value for key, value in asdict(self).items()
                  if key not in ("failed_replies", "last_backend_error")}
        return {**counts, "fallback_rate": self.fallback_rate, "backend_error_rate": self.backend_error_rate}

    def add(self, other: PredictionStats) -> None:
        """Count `other`'s predictions in these counters too (a stage's budget holds for all its predictions)."""
        for name, value in asdict(other).items():
            if isinstance(value, int):
                setattr(self, name, getattr(self, name) + value)
        for reply in other.failed_replies:
            self.keep_failed(reply)
        self.last_backend_error = other.last_backend_error or self.last_backend_error

    def backend_failed(self, error: Exception) -> None:
        """Count a generate() call that raised, and keep why (for the budget's message)."""
        self.backend_errors += 1
        self.last_backend_error = f"{type(error).__name__}: {error}"

    def keep_failed(self, reply: str) -> None:
        if len(self.failed_replies) < FAILED_REPLIES_KEPT:
            self.failed_replies.append(reply)


BUDGET_CONFIDENCE = 0.95  # how sure a stage must be that the experience model fails too often before it stops


class ExperienceModelFailure(RuntimeError):
    """The experience model failed more often than its budget allows: its outcomes would be the fallback's."""


@dataclass(frozen=True)
class FallbackBudget:
    """How often the experience model may fail before a stage stops (params experience_model.max_fallback_rate and
    max_backend_error_rate, fractions in [0, 1]). A stage stops when its failures show the rate above the budget at
    BUDGET_CONFIDENCE (one-sided Wilson bound), not on the first rate over it: checked before each RL iteration, a
    point estimate would stop a run on one failure among its first few predictions (1 of 8: 12%), while a model that
    fails at scale still stops within a few (4 of 4, or 12 of 21 against 10%)."""

    max_fallback_rate: float
    max_backend_error_rate: float

    def over(self, failures: int, total: int, budget: float) -> bool:
        """Whether `failures` of `total` show a rate above `budget`."""
        return wilson_interval(failures, total, 2 * BUDGET_CONFIDENCE - 1)[0] > budget if total else False

    def check(self, stats: PredictionStats, where: str, max_new_tokens: int | None = None) -> None:
        """Raise ExperienceModelFailure, with the rate, the first failed replies and what to do, when `stats` are over
        budget; `where` names the stage (and part) in the message."""
        problems = []
        if self.over(stats.backend_errors, stats.backend_calls, self.max_backend_error_rate):
            problems.append(
                f"the backend failed on {stats.backend_errors} of {stats.backend_calls} calls "
                f"({stats.backend_error_rate:.0%}, above experience_model.max_backend_error_rate of "
                f"{self.max_backend_error_rate:.0%} at {BUDGET_CONFIDENCE:.0%} confidence); last error: "
                f"{stats.last_backend_error}. Check the endpoint "
                "(experience_model.inference.base_url), the served model's name (models.experience) and the key in "
                "OPENAI_API_KEY, or the model directory for the hf backend")
        if self.over(stats.fallbacks, stats.requests, self.max_fallback_rate):
            shown = "".join(f"\n  {n}. {_preview(reply)}" for n, reply in enumerate(stats.failed_replies, 1))
            cut = [reply for reply in stats.failed_replies if REPLY_END not in reply]
            hint = (f" {len(cut)} of the {len(stats.failed_replies)} shown never reach {REPLY_END}: cut at "
                    f"experience_model.inference.max_new_tokens ({max_new_tokens}) or the format is not learned."
                    if cut and max_new_tokens else "")
            out_of_range = (f" {stats.reward_out_of_range} replies gave a reward outside data.reward_range."
                            if stats.reward_out_of_range else "")
            problems.append(
                f"it fell back on {stats.fallbacks} of {stats.requests} predictions ({stats.fallback_rate:.0%}, above "
                f"experience_model.max_fallback_rate of {self.max_fallback_rate:.0%} at {BUDGET_CONFIDENCE:.0%} "
                f"confidence), so those steps are no simulation.{out_of_range}{hint} First unparsable replies:"
                f"{shown or ' (none kept: they came before a resume)'}\nWhat to do: train it longer "
                "(experience_model.training: max_steps -1 and more epochs) until its replies parse; raise "
                "experience_model.inference.max_new_tokens if replies are cut before the closing tag; allow "
                "experience_model.inference.retries; or, knowingly, raise experience_model.max_fallback_rate")
        if problems:
            raise ExperienceModelFailure(f"{where}: the experience model is over its failure budget: "
                                         + "; ".join(problems) + ".")


def _preview(reply: str, limit: int = 200) -> str:
    return repr(reply if len(reply) <= limit else reply[:limit] + f"... ({len(reply)} chars)")


def predict(
    backend: GenerationBackend,
    queries: Sequence[ExperienceQuery],
    fmt: PromptFormat,
    settings: InferenceSettings,
    *,
    stats: PredictionStats | None = None,
) -> list[Prediction]:
    """One prediction per query, in order; never raises on bad output or a failing backend.

    The first attempt uses `settings.temperature` (0: greedy); the unparsable replies (a reward outside
    `settings.reward_range` is one: the environment cannot give it) are generated again, up to `settings.retries`
    times, sampling at `settings.retry_temperature` at least (a greedy retry would repeat the same reply); what
    still fails gets `fallback_prediction`. A prompt too long for the backend's context (`PromptTooLong`) falls back
    at once, without costing the rest of its batch their replies.
    """
    stats = stats if stats is not None else PredictionStats()
    stats.requests += len(queries)
    prompts = [build_messages(q, fmt) for q in queries]
    results: list[Prediction | None] = [None] * len(queries)
    pending, too_long = list(range(len(queries))), []  # too long for the backend's context: no retry helps
    for attempt in range(settings.retries + 1):
        if not pending:
            break
        stats.generations += len(pending)
        if attempt:
            stats.retries += len(pending)
        heat = settings.temperature if attempt == 0 else max(settings.temperature, settings.retry_temperature)
        stats.backend_calls += 1
        try:
            try:
                replies = backend.generate([prompts[i] for i in pending], max_new_tokens=settings.max_new_tokens,
                                           temperature=heat)
            except PromptTooLong as error:  # those never fit and fall back; the rest of the batch is answered now
                stats.backend_failed(error)
                log.warning("experience model: %s", error)
                too_long += [pending[k] for k in error.indices]
                pending = [i for i in pending if i not in too_long]
                stats.generations -= len(error.indices)
                stats.backend_calls += 1
                replies = backend.generate([prompts[i] for i in pending], max_new_tokens=settings.max_new_tokens,
                                           temperature=heat) if pending else []
            if len(replies) != len(pending):
                raise BackendError(f"{len(replies)} replies for {len(pending)} prompts")
        except Exception as error:  # noqa: BLE001  (a rollout must survive a backend hiccup; the budget counts it)
            stats.backend_failed(error)
            log.warning("experience model backend failed (attempt %d): %s", attempt + 1, error)
            continue
        still = []
        for i, reply in zip(pending, replies, strict=True):
            parsed = parse_prediction(reply, queries[i].state)
            if parsed is not None and settings.reward_range is not None and not (
                    settings.reward_range[0] <= parsed.reward <= settings.reward_range[1]):
                stats.reward_out_of_range += 1
                parsed = None
            if parsed is None:
                stats.keep_failed(reply)
                still.append(i)
            else:
                results[i] = replace(parsed, attempts=attempt + 1)
        pending = still
    pending = sorted([*pending, *too_long])
    for i in pending:
        stats.fallbacks += 1
        results[i] = fallback_prediction(queries[i], attempts=settings.retries + 1)
    if pending:
        log.info("experience model: %d of %d replies unparsable after %d attempts, fell back",
                 len(pending), len(queries), settings.retries + 1)
    return [r for r in results if r is not None]
