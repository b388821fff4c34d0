"""Reasoning traces for seed transitions: the data behind the experience model's joint objective.

DreamGym trains the experience model to first explain *why* an action leads to the next state and the reward, then
predict them. Here every seed transition gets such a trace, from one of two annotators:

- a teacher LLM (`HFTeacher` for any Hugging Face model or local checkpoint, `OpenAICompatibleTeacher` for any
  OpenAI-compatible endpoint), prompted with `TEACHER_SYSTEM` / `teacher_messages` below, the one place that prompt
  lives;
- with no teacher configured, `deterministic_trace`: facts read off the data (the action's verb and target, what
  appeared, disappeared or changed between the states, whether the environment accepted the action, the score, why
  the reward and why the episode goes on or ends). It needs no model, so the whole pipeline runs offline.

Teacher replies are kept as they arrive (`annotate(..., replies_path=)`), so a crash or a rerun on grown seed data
asks the teacher only for transitions it has not answered yet.

Output is one JSON object per transition (`AnnotatedTransition`), written atomically in input order: with the
deterministic annotator, the same seed data always gives byte-identical files, so DVC versions the traces like any
other data. Each record names its annotator, so a file made with a teacher says which teacher, and which records
fell back to the deterministic trace because the teacher's reply was unusable.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any, Literal, Protocol

from components.data.contract import Task, Trajectory, Transition, read_records, transitions, write_records
from components.simulator.state_changes import sections

log = logging.getLogger(__name__)

DETERMINISTIC = "deterministic-v1"  # bump when deterministic_trace changes, so old and new traces are told apart

# Bounds that keep a data-derived trace short: it is a training target, and every token of it costs SFT time.
_MAX_NEW_LINES = 3  # what appeared explains the action's effect best
_MAX_GONE_LINES = 2  # what disappeared is mostly the previous message scrolling away
_MAX_LINE_CHARS = 90
_MAX_TEACHER_TRACE_CHARS = 1200


@dataclass(frozen=True, slots=True, kw_only=True)
class AnnotatedTransition(Transition):
    """One seed step (a contract `Transition`) with its reasoning trace; the records of one trajectory share
    `trajectory_id`.

    History is not stored (`history` is empty): it is rebuilt from the earlier steps of the same trajectory
    (`step_index` orders them), so the experience model's history length stays a training knob instead of being
    frozen into the data. `reasoning` and `annotator` are keyword-only.
    """

    reasoning: str
    annotator: str  # DETERMINISTIC, or the teacher's name

    @classmethod
    def of(cls, transition: Transition, reasoning: str, annotator: str) -> AnnotatedTransition:
        """`transition` with its trace; its history is left out (not stored, see above)."""
        shared = {f.name: getattr(transition, f.name) for f in fields(Transition) if f.name != "history"}
        return cls(**shared, reasoning=reasoning, annotator=annotator)

    def to_dict(self) -> dict[str, Any]:
        """The stored record: every field but `history`, in field order (the file's key order)."""
        record = asdict(self)  # Task is a dataclass too: it becomes the contract's task object
        del record["history"]
        return record

    @classmethod
    def from_dict(cls, record: Mapping[str, Any]) -> AnnotatedTransition:
        return cls(
            trajectory_id=record["trajectory_id"],
            step_index=int(record["step_index"]),
            task=Task.from_dict(record["task"]),
            state=record["state"],
            action=record["action"],
            next_state=record["next_state"],
            reward=float(record["reward"]),
            done=bool(record["done"]),
            source=record["source"],
            info=dict(record.get("info") or {}),
            reasoning=record["reasoning"],
            annotator=record["annotator"],
        )


# ---- the deterministic, data-derived trace -------------------------------------------------------------------


class StepLike(Protocol):
    """What a trace needs: contract `Step`, `Transition` and `AnnotatedTransition` all have these."""

    state: str
    action: str
    next_state: str
    reward: float
    done: bool


def deterministic_trace(step: StepLike, previous_info: Mapping[str, Any] | None = None,
                        describe_changes: bool = True, restate_action: bool = True,
                        ground_objects: bool = False) -> str:
    """Explain a transition from the data alone, in a few short sentences.

    `describe_changes` off leaves out what changed, appeared and disappeared: for an experience model whose reply
    states the changed sections itself (`experience_model.prompt.reply: changes`), they would be written twice.
    `restate_action` off leaves out the sentence that repeats the action (its verb and object, already in the
    prompt); which element a web action names is still said. `ground_objects` adds, before the verdict, where the
    state mentions what the action names (`grounding_sentence`): the fact that decides whether the environment
    accepts it, written out before the model states the verdict.

    `step.info` (when the object has one) supplies `valid_action`, `score`/`max_score`, `won`/`lost`/`success`,
    `truncated`, `timeout`; `previous_info` is the info of the step before, which turns a score into a change
    ("rose from 1 to 2"). Missing keys are simply not mentioned: any environment's data works.
    """
    info: Mapping[str, Any] = getattr(step, "info", None) or {}
    sentences = [_action_sentence(step.action, step.state, restate_action)]
    if ground_objects:
        sentences.append(grounding_sentence(step.action, step.state))
    sentences.append(_validity_sentence(step, info))
    if describe_changes:
        sentences += _change_sentences(step.state, step.next_state)
    sentences.append(_progress_sentence(info, previous_info))
    sentences.append(_outcome_sentence(step.reward, step.done, info))
    return " ".join(s for s in sentences if s)


def _action_sentence(action: str, state: str, restate: bool = True) -> str:
    verb, _, target = action.strip().partition(" ")
    sentences = []
    if restate:
        sentences.append(f"The action '{action.strip()}' uses the verb '{verb}'"
                         + (f" on '{target.strip()}'." if target.strip() else "."))
    # Web-style actions name an element by reference ("click [12]"): say which element of the state that is.
    if ref := re.search(r"\[(-?\d+)\]", action):
        for line in state.splitlines():
            if line.strip().startswith(f"[{ref.group(1)}]"):
                sentences.append(f"Element [{ref.group(1)}] is {_quote(line.strip()[len(ref.group(0)):].strip())}.")
                break
    return " ".join(sentences)


# "take X from Y", "put X on Y", "cook X with Y": the object, then the place or tool.
_PLACE_WORDS = re.compile(r"\s+(?:from|into|in|on|onto|with|to|at)\s+")


def grounding_sentence(action: str, state: str) -> str:
    """Where the state mentions the action's object: the sections naming it and, for "X from Y" and the like, the
    last sentence naming both. A command the environment refuses usually names something the state puts elsewhere
    (already in the inventory, in another container) or nowhere; without this fact first, a small experience model
    learns how often commands are refused, not which (reports/research/experience_model/refusals/). Web actions
    name an element by reference instead, which `_action_sentence` quotes."""
    target = action.strip().partition(" ")[2].strip()
    if not target or target.startswith('"') or re.search(r"\[-?\d+\]", target):
        return ""  # nothing named, a key (`press "Enter"`) or an element by reference
    thing, *place = _PLACE_WORDS.split(target, maxsplit=1)
    where = list(dict.fromkeys(label.rstrip(":") for label, text in sections(state) if label and _names(text, thing)))
    if not where:
        return f"The state does not mention '{thing}'."
    sentence = f"The state mentions '{thing}' under {_and_list(where)}."
    if place:
        together = [s for line in state.splitlines() for s in re.split(r"(?<=[.!?])\s+", line.strip())
                    if _names(s, thing) and _names(s, place[0])]
        sentence += (f" '{thing}' and '{place[0]}' meet in {_quote(together[-1].rstrip('.!?'))}." if together
                     else f" No sentence names '{thing}' with '{place[0]}'.")
    return sentence


def _names(text: str, phrase: str) -> bool:
    return re.search(rf"(?<![\w-]){re.escape(phrase)}(?![\w-])", text, re.IGNORECASE) is not None


def _and_list(items: list[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


VERDICT_WORDS = ("accepted", "rejected")  # the trace's word for a command the environment took, and refused


def _validity_sentence(step: StepLike, info: Mapping[str, Any]) -> str:
    unchanged = step.state == step.next_state
    if info.get("valid_action") is False:
        return f"The environment {VERDICT_WORDS[1]} it as invalid" + (", so nothing changed." if unchanged else ".")
    if info.get("valid_action") is True:
        return f"The environment {VERDICT_WORDS[0]} it" + (" but it had no visible effect." if unchanged else ".")
    return "It had no visible effect." if unchanged else ""


def _change_sentences(state: str, next_state: str) -> list[str]:
    """What changed, appeared and disappeared, as lines (order kept, blank lines ignored)."""
    before = [line.strip() for line in state.splitlines() if line.strip()]
    after = [line.strip() for line in next_state.splitlines() if line.strip()]
    before_set, after_set = set(before), set(after)
    gone = list(dict.fromkeys(line for line in before if line not in after_set))  # ordered, without repeats
    new = list(dict.fromkeys(line for line in after if line not in before_set))

    # "Key: old" -> "Key: new" reads better as one change than as a line gone plus a line new.
    changed = []
    new_by_key = {_key(line): line for line in new if _key(line)}
    for line in list(gone):
        key = _key(line)
        if key and key in new_by_key:
            changed.append(f"{key} went from {_quote(_value(line))} to {_quote(_value(new_by_key[key]))}")
            gone.remove(line)
            new.remove(new_by_key.pop(key))

    sentences = []
    if changed:
        sentences.append("Changed: " + "; ".join(changed[:_MAX_NEW_LINES]) + ".")
    if new:
        sentences.append("New: " + _listing(new, _MAX_NEW_LINES) + ".")
    if gone:
        sentences.append("Gone: " + _listing(gone, _MAX_GONE_LINES) + ".")
    return sentences


def _key(line: str) -> str | None:
    key, sep, value = line.partition(":")
    # A short label before a colon ("Inventory: ...", "Task: ...") marks a field; long prose with a colon does not.
    return key if sep and value.strip() and 0 < len(key) <= 24 and not key.startswith("[") else None


def _value(line: str) -> str:
    return line.partition(":")[2].strip()


def _listing(lines: list[str], limit: int) -> str:
    shown = "; ".join(_quote(line) for line in lines[:limit])
    more = len(lines) - limit
    return shown + (f" and {more} more line{'s' if more > 1 else ''}" if more > 0 else "")


def _quote(text: str) -> str:
    text = text if len(text) <= _MAX_LINE_CHARS else text[: _MAX_LINE_CHARS - 3] + "..."
    return f"'{text}'"


def _progress_sentence(info: Mapping[str, Any], previous_info: Mapping[str, Any] | None) -> str:
    score = info.get("score")
    if not isinstance(score, int | float) or isinstance(score, bool):
        return ""
    out_of = f" of {info['max_score']:g}" if isinstance(info.get("max_score"), int | float) else ""
    before = (previous_info or {}).get("score")
    if not isinstance(before, int | float) or isinstance(before, bool):
        return f"The score is now {score:g}{out_of}."
    if score > before:
        return f"Progress: the score rose from {before:g} to {score:g}{out_of}."
    if score < before:
        return f"Setback: the score fell from {before:g} to {score:g}{out_of}."
    return f"No progress: the score stays at {score:g}{out_of}."


def _outcome_sentence(reward: float, done: bool, info: Mapping[str, Any]) -> str:
    if not done:
        if reward > 0:
            return f"Reward {reward:g}: the action earned credit; the episode goes on."
        if reward < 0:
            return f"Reward {reward:g}: the action was penalised; the episode goes on."
        return "Reward 0: the task is not finished yet, so the episode goes on."
    if info.get("won") or info.get("success") or (reward > 0 and not info.get("lost")):
        return f"Reward {reward:g}: the task is complete, so the episode ends in success."
    if info.get("lost"):
        why = "the game is lost"
    elif info.get("timeout"):
        why = "the environment timed out"
    elif info.get("truncated"):
        why = "the step limit was reached"
    else:
        why = "the task failed"
    return f"Reward {reward:g}: the episode ends because {why}."


# ---- teachers -------------------------------------------------------------------------------------------------

# The teacher prompt, in one place. The deterministic facts go in too: they keep a small or distant teacher grounded
# in what the data actually shows, and the teacher adds the causal "why" on top of them.
TEACHER_SYSTEM = (
    "You explain transitions of a text environment. Given a task, a state, an action, the resulting next state, the "
    "reward and whether the episode ended, write 2 to 4 sentences of reasoning: why this action, in this state, "
    "leads to this next state and this reward. Mention whether the action was valid, what changed, and the progress "
    "towards the task. Use only facts present in the input. Reply with the reasoning only, no preamble, no tags."
)


def teacher_messages(transition: AnnotatedTransition, facts: str) -> list[dict[str, str]]:
    user = (
        f"Task: {transition.task.instruction}\n\n"
        f"State:\n{transition.state}\n\n"
        f"Action: {transition.action}\n\n"
        f"Next state:\n{transition.next_state}\n\n"
        f"Reward: {transition.reward:g}\nEpisode ended: {'yes' if transition.done else 'no'}\n\n"
        f"Facts read off the data: {facts}\n\n"
        "Reasoning:"
    )
    return [{"role": "system", "content": TEACHER_SYSTEM}, {"role": "user", "content": user}]


class Teacher(Protocol):
    """Writes a reasoning trace per transition; None (or empty text) where it has nothing usable."""

    name: str

    def explain(self, transitions: Sequence[AnnotatedTransition]) -> list[str | None]: ...


class _BackendTeacher:
    """A teacher over any generation backend (`components.llm.backends`: HF, OpenAI-compatible, vLLM)."""

    def __init__(self, name: str, backend: Any, max_new_tokens: int = 160) -> None:
        self.name = name
        self.backend = backend
        self.max_new_tokens = max_new_tokens

    def explain(self, transitions: Sequence[AnnotatedTransition]) -> list[str | None]:
        # Greedy decoding: a local teacher then gives the same traces on every run (versioned data).
        prompts = [teacher_messages(t, t.reasoning) for t in transitions]
        return list(self.backend.generate(prompts, max_new_tokens=self.max_new_tokens, temperature=0.0))


def HFTeacher(  # noqa: N802  (a factory that reads like the class it stands for)
    model: str,
    cache_dir: str | Path = ".cache/models",
    batch_size: int = 8,
    dtype: str = "float32",
    max_new_tokens: int = 160,
) -> _BackendTeacher:
    """A Hugging Face model (packaged alias, hub id or local path) as teacher, with batched greedy generation."""
    from components.llm.backends import HFGenerationBackend
    from components.llm.models import load_causal_lm

    lm, tokenizer = load_causal_lm(model, cache_dir=cache_dir, dtype=dtype)  # type: ignore[arg-type]
    return _BackendTeacher(f"hf:{model}", HFGenerationBackend(lm, tokenizer, batch_size=batch_size), max_new_tokens)


def OpenAICompatibleTeacher(  # noqa: N802
    base_url: str,
    model: str,
    api_key_env: str = "OPENAI_API_KEY",
    max_new_tokens: int = 160,
    concurrency: int = 4,
) -> _BackendTeacher:
    """Any OpenAI-compatible chat-completions endpoint as teacher; the key (if any) comes from `api_key_env`."""
    from components.llm.backends import OpenAICompatibleBackend

    backend = OpenAICompatibleBackend(base_url, model, api_key=os.environ.get(api_key_env), concurrency=concurrency)
    return _BackendTeacher(f"openai:{model}", backend, max_new_tokens)


def _clean_teacher_trace(text: str | None) -> str | None:
    """One paragraph, bounded, with no markup that could collide with the experience model's target tags."""
    if not text:
        return None
    text = re.sub(r"</?\s*(reasoning|next_state|changes|reward|done)\s*>", " ", text, flags=re.IGNORECASE)
    text = " ".join(text.split())
    if text.lower().startswith("reasoning:"):
        text = text[len("reasoning:"):].strip()
    if len(text) > _MAX_TEACHER_TRACE_CHARS:  # cut at a sentence end when there is one in reach
        cut = text.rfind(". ", 0, _MAX_TEACHER_TRACE_CHARS)
        text = text[: cut + 1] if cut > 0 else text[:_MAX_TEACHER_TRACE_CHARS]
    return text or None


# ---- annotate, read, write ------------------------------------------------------------------------------------


def iter_steps(trajectories: Iterable[Trajectory], describe_changes: bool = True,
               restate_action: bool = True, ground_objects: bool = False) -> Iterator[AnnotatedTransition]:
    """Every step as an AnnotatedTransition with its deterministic trace (the final trace, or a teacher's facts)."""
    for trajectory in trajectories:
        previous_info: Mapping[str, Any] | None = None
        for transition in transitions(trajectory, history_length=0):
            trace = deterministic_trace(transition, previous_info, describe_changes, restate_action, ground_objects)
            yield AnnotatedTransition.of(transition, trace, DETERMINISTIC)
            previous_info = transition.info


def annotate(
    trajectories: Iterable[Trajectory],
    teacher: Teacher | None = None,
    batch_size: int = 16,
    replies_path: str | Path | None = None,
    describe_changes: bool = True,
    restate_action: bool = True,
    ground_objects: bool = False,
) -> list[AnnotatedTransition]:
    """Annotate every step of every trajectory, in input order.

    With a teacher, each trace is the teacher's reply; an empty or failed reply keeps the deterministic trace, and
    that record's `annotator` says so (count them with `annotation_summary`). A teacher that raises (an endpoint
    down) fails the whole batch over to deterministic traces with a warning instead of losing the run.

    `replies_path` keeps every usable reply as it arrives, keyed by the teacher and its prompt, so a crashed or
    rerun annotation asks the teacher only what it has not answered yet (greedy replies are reproducible). Failed
    replies are not kept: a rerun asks again.
    """
    records = list(iter_steps(trajectories, describe_changes, restate_action, ground_objects))
    if teacher is None:
        return records
    kept = _read_replies(replies_path)
    keys = [_reply_key(teacher, record) for record in records]
    asking = [i for i, key in enumerate(keys) if key not in kept]
    if kept:
        log.info("%d of %d transitions answered by %s before, asking %d", len(records) - len(asking), len(records),
                 teacher.name, len(asking))
    for start in range(0, len(asking), batch_size):
        batch = asking[start: start + batch_size]
        try:
            replies = teacher.explain([records[i] for i in batch])
            if len(replies) != len(batch):
                raise ValueError(f"{len(replies)} replies for {len(batch)} transitions")
        except Exception as error:  # noqa: BLE001  (any teacher failure: keep the data-derived trace)
            log.warning("teacher %s failed on %d transitions from #%d: %s", teacher.name, len(batch), batch[0], error)
            replies = [None] * len(batch)
        answered = {keys[i]: trace for i, reply in zip(batch, replies, strict=True)
                    if (trace := _clean_teacher_trace(reply)) is not None}
        kept.update(answered)
        _append_replies(replies_path, answered)
        log.info("annotated %d/%d transitions", start + len(batch), len(asking))
    return [record if (trace := kept.get(key)) is None else replace(record, reasoning=trace, annotator=teacher.name)
            for record, key in zip(records, keys, strict=True)]


def _reply_key(teacher: Teacher, record: AnnotatedTransition) -> str:
    """What a reply depends on: the teacher, its length limit and its prompt (the transition and its facts)."""
    what = [teacher.name, getattr(teacher, "max_new_tokens", None), teacher_messages(record, record.reasoning)]
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()


def _read_replies(path: str | Path | None) -> dict[str, str]:
    if path is None or not Path(path).exists():
        return {}
    replies = {}
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
            replies[record["key"]] = record["reasoning"]
        except (json.JSONDecodeError, KeyError, TypeError):
            continue  # a line torn by a crash: that transition is asked again
    return replies


def _append_replies(path: str | Path | None, replies: Mapping[str, str]) -> None:
    if path is None or not replies:
        return
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as out:
        out.write("".join(json.dumps({"key": key, "reasoning": trace}) + "\n" for key, trace in replies.items()))


def annotation_summary(records: Sequence[AnnotatedTransition], teacher: str | None = None) -> dict[str, Any]:
    """Metrics for the stage: counts, trace length, and how many records fell back from the teacher."""
    words = [len(r.reasoning.split()) for r in records]
    summary: dict[str, Any] = {
        "transitions": len(records),
        "trajectories": len({r.trajectory_id for r in records}),
        "annotator": teacher or DETERMINISTIC,
        "mean_trace_words": sum(words) / len(words) if words else 0.0,
        "max_trace_words": max(words, default=0),
    }
    if teacher is not None:
        fallbacks = sum(r.annotator != teacher for r in records)
        summary["teacher_fallbacks"] = fallbacks
        summary["teacher_fallback_rate"] = fallbacks / len(records) if records else 0.0
    return summary


def write_annotated(records: Iterable[AnnotatedTransition], path: str | Path) -> None:
    write_records((r.to_dict() for r in records), path)  # atomic, key order fixed: byte-identical reruns


def read_annotated(path: str | Path) -> list[AnnotatedTransition]:
    return [AnnotatedTransition.from_dict(record) for record in read_records(path)]


@dataclass(frozen=True)
class TeacherSpec:
    """What params.yaml says about the teacher; `make_teacher` turns it into one (None: deterministic traces)."""

    kind: Literal["hf", "openai"]
    model: str  # hf: packaged alias, hub id or local path; openai: the served model's name
    base_url: str | None = None  # openai only, e.g. http://127.0.0.1:8000/v1
    api_key_env: str = "OPENAI_API_KEY"  # the variable holding the key; keys never live in params.yaml
    batch_size: int = 8
    max_new_tokens: int = 160


def make_teacher(spec: TeacherSpec | None, cache_dir: str | Path = ".cache/models") -> Teacher | None:
    if spec is None:
        return None
    if spec.kind == "hf":
        return HFTeacher(spec.model, cache_dir, batch_size=spec.batch_size, max_new_tokens=spec.max_new_tokens)
    if spec.kind == "openai":
        if not spec.base_url:
            raise ValueError("an 'openai' teacher needs base_url (e.g. http://127.0.0.1:8000/v1)")
        return OpenAICompatibleTeacher(spec.base_url, spec.model, spec.api_key_env, spec.max_new_tokens)
    raise ValueError(f"unknown teacher kind {spec.kind!r}: expected 'hf' or 'openai'")
