"""Can the curriculum's backbone write task variations? Asks it, as the synthetic_rl stage does, for a variation of
each of the first N RL tasks (each given a reward variance, so each is a parent) and prints how many the curriculum
accepts, the rejections by reason and the replies. Uses params.yaml (models.experience, the curriculum settings),
changed by KEY=VALUE pairs as `--set` changes it (another backbone: models.experience=DIR).

    python research/curriculum_backbone.py [N] [KEY=VALUE ...]   # N default 8; needs `dvc repro collect_policy_seed`
"""
import dataclasses
import json
import sys
from pathlib import Path

from components.builders import curriculum_and_writer, rl_tasks
from components.config import load_params
from components.rl.curriculum import Curriculum
from dreamgym.cli import set_overrides

params = load_params("params.yaml", set_overrides(sys.argv[2:]))
tasks = rl_tasks(params, Path("."))[: int(sys.argv[1]) if len(sys.argv) > 1 else 8]
base, backend = curriculum_and_writer(params, Path("."), tasks, None)
if backend is None:
    sys.exit("the curriculum is off in params.yaml (synthetic_rl.curriculum.enabled or top_tasks)")
curriculum = Curriculum(tasks, dataclasses.replace(base.settings, top_tasks=len(tasks), variations_per_task=1))
curriculum.observe([t for t in tasks for _ in range(2)], [0.0, 1.0] * len(tasks))  # every task at variance 0.25
accepted = curriculum.propose(backend, iteration=1)
print(f"backbone {params.models.experience}: {len(accepted)} of {len(tasks)} variations accepted")
print(json.dumps({k: v for k, v in curriculum.summary().items() if k.startswith("rejected")}))
for task in accepted:
    print("accepted:", json.dumps(task.instruction))
for rejection in curriculum.rejections:
    print(f"rejected ({rejection['reason']}):", json.dumps(rejection["reply"][:200]))
