"""annotate: every seed transition given a reasoning trace (annotate.out_dir/transitions.jsonl)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from components.config import Params
from components.data.contract import TRAJECTORIES, read_trajectories
from components.reports import write_stage_outputs
from components.simulator import annotation
from stages.common import StageError


def run(params: Params, root: str | Path = ".") -> dict[str, Any]:
    """Give every seed transition a reasoning trace (annotate.out_dir/transitions.jsonl)."""
    root = Path(root)
    trajectories = read_trajectories(root / params.data.dir / TRAJECTORIES)
    spec = params.annotate.teacher
    teacher = annotation.make_teacher(annotation.TeacherSpec(**spec.model_dump()) if spec else None,
                                      root / params.models.cache_dir)
    # Outside annotate.out_dir: the kept replies are a resume cache, not a versioned output.
    records = annotation.annotate(trajectories, teacher, replies_path=root / ".cache" / "annotate" / "replies.jsonl",
                                  describe_changes=params.annotate.describe_changes,
                                  restate_action=params.annotate.restate_action,
                                  ground_objects=params.annotate.ground_objects)
    metrics = annotation.annotation_summary(records, teacher.name if teacher else None)
    if teacher is not None and records and metrics["teacher_fallbacks"] == len(records):
        # A teacher that never answered (an endpoint down, a wrong model) is a broken run, not deterministic
        # traces under the teacher's name for DVC to cache; partial failures are counted in the metrics.
        raise StageError(f"the teacher {teacher.name} gave no usable trace for any of {len(records)} transitions "
                         "(its errors are logged above); fix annotate.teacher (model, base_url, the key in its "
                         "api_key_env) or set annotate.teacher: null for deterministic traces")
    annotation.write_annotated(records, root / params.annotate.out_dir / "transitions.jsonl")
    write_stage_outputs("annotate", metrics, report(metrics, records), root)
    return metrics


def report(metrics: dict[str, Any], records: list) -> str:
    """The summary and, per environment, the trace of its first transition."""
    examples = {record.task.environment: record for record in records if record.step_index == 1}
    return (f"# Reasoning traces\n\n{metrics['transitions']} transitions of {metrics['trajectories']} trajectories "
            f"annotated by `{metrics['annotator']}`; traces average {metrics['mean_trace_words']:.0f} words.\n\n"
            + "".join(f"## Example: {env}\n\nAction `{r.action}`, reward {r.reward}, done {r.done}.\n\n"
                      f"> {r.reasoning}\n\n" for env, r in sorted(examples.items())))
