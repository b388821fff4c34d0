"""A trained simulator as a self-contained, versioned bundle: what a team needs to train any agent against it.

`export_bundle` copies the experience model (merged weights and tokenizer), the replay buffer it retrieves from and
the training tasks (each with its first state) into one directory, with `manifest.json`: the prompt format and
inference settings, the reward rules, the embedder, the identities of the data, code and files, and the model's
fidelity figures. Re-exporting unchanged inputs gives the same bytes (no timestamps; files copied as they are).

`load_bundle` reads one back; `Bundle.environment(name)` is the synthetic environment it describes
(`synthetic.SyntheticEnvironment`, the pipeline's own), which `gym_env.SimulatorEnv` wraps for Gymnasium.
"""
from __future__ import annotations

import hashlib
import json
import random
import shutil
from dataclasses import dataclass
from functools import cached_property
from importlib import metadata
from pathlib import Path
from typing import Any

from components.data.contract import Task, is_heldout_task
from components.files import atomic_directory, sha256_file

FORMAT = 1
MANIFEST = "manifest.json"
MODEL_DIR, BUFFER_DIR, TASKS_FILE = "model", "buffer", "tasks.jsonl"
# the code that reads a bundle: its hash is the manifest's code identity (a change there may change the simulator)
CODE = ("components/simulator/experience_model.py", "components/simulator/synthetic.py",
        "components/simulator/replay_buffer.py", "components/simulator/state_changes.py", "components/llm/backends.py")


class BundleError(ValueError):
    pass


def export_bundle(params: Any, root: str | Path, out_dir: str | Path) -> Path:
    """Export the project's trained simulator (params: the project's `Params`) from `root` into `out_dir`, whole
    or not at all (an existing bundle there is replaced)."""
    from components.builders import experience_trajectories, success_rewards
    from components.llm.sft import has_trained_model
    from components.simulator.synthetic import first_state_tasks

    root, experience, out_dir = Path(root), params.experience_model, Path(out_dir)
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())) and not (out_dir / MANIFEST).is_file():
        raise BundleError(f"{out_dir} exists and is not a bundle: export into a new directory (an existing bundle is "
                          "replaced, anything else is left alone)")
    model, buffer = root / experience.out_dir / "model", root / params.buffer.out_dir
    if not has_trained_model(model):
        raise BundleError(f"{model}: no trained experience model; run `dvc repro train_experience_model` first")
    if not (buffer / "buffer.json").is_file():
        raise BundleError(f"{buffer}: no saved replay buffer; run `dvc repro index_buffer` first")
    if params.buffer.backend != "embedded":
        raise BundleError("buffer.backend is weaviate: a bundle carries the embedded index (set buffer.backend: "
                          "embedded and run index_buffer) so that it runs without a server")
    # held-out games only measure: their first states never leave the project
    fraction = params.data.heldout_task_fraction
    tasks = sorted(first_state_tasks([t for t in experience_trajectories(params, root)
                                      if not is_heldout_task(t.task.task_id, fraction)]), key=lambda t: t.task_id)
    data_file = root / params.data.dir / "trajectories.jsonl"
    fidelity_file = root / "metrics" / "evaluate_experience_model.json"
    repo = Path(__file__).resolve().parents[2]
    simulator = {
        "environments": list(experience.environments),
        "prompt": experience.prompt.model_dump(),
        "inference": experience.inference.model_dump(),
        "reward_range": list(params.data.reward_range),
        "success_rewards": {name: reward for name, reward in success_rewards(params, root).items()
                            if name in experience.environments},
        "embedder": params.models.embedder,
        "buffer_index": params.buffer.index.model_dump(),
        "encode_batch_size": params.buffer.encode_batch_size,
        "max_turns": params.policy.max_turns,
        "real_environments": params.environments.model_dump(),  # how shadow mode opens the real games
    }
    with atomic_directory(out_dir, replace=True) as partial:
        shutil.copytree(model, partial / MODEL_DIR)
        shutil.copytree(buffer, partial / BUFFER_DIR)
        (partial / TASKS_FILE).write_text("".join(json.dumps(_task_record(t), sort_keys=True) + "\n" for t in tasks),
                                          encoding="utf-8")
        files = {path.relative_to(partial).as_posix(): sha256_file(path)
                 for path in sorted(partial.rglob("*")) if path.is_file()}
        manifest = {
            "format": FORMAT,
            "simulator": simulator,
            "tasks": len(tasks),
            "identity": {
                "data_sha256": sha256_file(data_file) if data_file.is_file() else None,
                "code_sha256": _code_sha256(repo),
                "dreamgym_version": metadata.version("dreamgym"),
            },
            "fidelity": _fidelity(fidelity_file),
            "files": files,
        }
        (partial / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    return out_dir


@dataclass(frozen=True)
class Bundle:
    """A bundle on disk and its manifest."""

    path: Path
    manifest: dict[str, Any]

    @property
    def simulator(self) -> dict[str, Any]:
        return self.manifest["simulator"]

    @property
    def environments(self) -> list[str]:
        return list(self.simulator["environments"])

    @property
    def max_turns(self) -> int:
        return int(self.simulator["max_turns"])

    @cached_property
    def _tasks(self) -> list[Task]:  # read once: every reset draws from them
        lines = (self.path / TASKS_FILE).read_text(encoding="utf-8").splitlines()
        return [Task(r["task_id"], r["environment"], r["instruction"], r["parameters"]) for r in map(json.loads, lines)]

    def tasks(self, environment: str | None = None) -> list[Task]:
        """The training tasks it was made from, each with its first state (`parameters["initial_state"]`)."""
        return [t for t in self._tasks if environment is None or t.environment == environment]

    def prompt_format(self):
        from components.simulator.experience_model import PromptFormat

        return PromptFormat(**self.simulator["prompt"])

    def inference_settings(self):
        from components.simulator.experience_model import InferenceSettings

        inference = self.simulator["inference"]
        return InferenceSettings(retries=inference["retries"], max_new_tokens=inference["max_new_tokens"],
                                 temperature=inference["temperature"],
                                 retry_temperature=inference["retry_temperature"],
                                 reward_range=tuple(self.simulator["reward_range"]))

    def backend(self, cache_dir: str | Path, backend: str | None = None):
        """The experience model behind the bundle's inference backend (or `backend`: hf, llamacpp), replies stopped
        at their closing tag. `cache_dir` holds what a backend derives from the weights (llama.cpp's GGUF file)."""
        from components.llm.backends import make_backend
        from components.simulator.experience_model import REPLY_END

        inference = self.simulator["inference"]
        kind = backend or inference["backend"]
        if kind == "openai":  # served elsewhere: the bundle's weights are what to serve, not what it asks
            kind = "hf"
        llamacpp = inference["llamacpp"]
        return make_backend(kind, str(self.path / MODEL_DIR), batch_size=inference["batch_size"], base_url=None,
                            weight_type=llamacpp["weight_type"], threads=llamacpp["threads"],
                            context=llamacpp["context"], draft_tokens=llamacpp["draft_tokens"],
                            cache_dir=Path(cache_dir), stop=(REPLY_END,))

    def buffer(self, cache_dir: str | Path):
        from components.simulator.replay_buffer import IndexSettings, SentenceEncoder, load_replay_buffer

        encoder = SentenceEncoder(self.simulator["embedder"], Path(cache_dir), self.simulator["encode_batch_size"])
        return load_replay_buffer(self.path / BUFFER_DIR, encoder, IndexSettings(**self.simulator["buffer_index"]))

    def environment(self, name: str | None = None, *, backend: str | None = None,
                    cache_dir: str | Path | None = None, end_on_fallback: bool | None = None):
        """The synthetic environment imitating `name` (default: the bundle's only one), the pipeline's own
        `SyntheticEnvironment`, with the bundle's model (`backend` as in `Bundle.backend`) and, when its prompts
        retrieve, its buffer loaded; `cache_dir` (default: the bundle's `.cache`) as in `Bundle.backend`;
        `end_on_fallback` as in `SyntheticEnvironment` (default: the project's
        experience_model.inference.fallback_ends_episode; a bundle made before it existed kept the state)."""
        from components.simulator.synthetic import SyntheticEnvironment

        if name is None and len(self.environments) != 1:
            raise BundleError(f"{self.path}: simulates {self.environments}: name one")
        name = name or self.environments[0]
        if name not in self.environments:
            raise BundleError(f"{self.path}: simulates {self.environments}, not {name!r}")
        if not self.tasks(name):
            raise BundleError(f"{self.path}: no tasks of {name}")
        cache = Path(cache_dir) if cache_dir else self.path / ".cache"
        buffer = self.buffer(cache) if self.prompt_format().use_retrieval else None
        return SyntheticEnvironment(name, self.backend(cache, backend), buffer, self.prompt_format(),
                                    self.inference_settings(),
                                    success_reward=self.simulator["success_rewards"].get(name),
                                    end_on_fallback=self.simulator["inference"].get("fallback_ends_episode", False)
                                    if end_on_fallback is None else end_on_fallback)

    def truncated(self, episode: Any, max_turns: int | None = None) -> bool:
        """Whether the turn limit (the bundle's, or `max_turns`) ends a synthetic episode that its last step did not
        end; it is then over, and a further step needs a reset."""
        truncated = not episode.done and len(episode.steps) >= (max_turns or self.max_turns)
        if truncated:
            episode.done = True
        return truncated

    def real_environment(self, name: str):
        """The adapter of the real environment `name` imitates and its settings, for shadow mode."""
        from components.config import EnvironmentsParams
        from components.envs.registry import has_adapter, real_environment

        if not has_adapter(name):
            raise BundleError(f"{name} has no real-environment adapter (a seed-only domain): shadow mode replays "
                              "episodes in the real environment, so it needs one")
        settings = self.simulator.get("real_environments")
        if settings is None:
            raise BundleError(f"{self.path}: exported before shadow mode existed; export it again")
        return real_environment(name), EnvironmentsParams(**settings)

    def choose_task(self, environment: str, rng: random.Random, task_id: str | None = None) -> Task:
        """The task `task_id` of `environment`, or one drawn with `rng`."""
        tasks = self.tasks(environment)
        if task_id is None:
            return rng.choice(tasks)
        found = [t for t in tasks if t.task_id == task_id]
        if not found:
            raise BundleError(f"no task {task_id!r} among the bundle's {len(tasks)} {environment} tasks")
        return found[0]


def load_bundle(path: str | Path, verify: bool = True) -> Bundle:
    """The bundle in `path`; with `verify`, its model, buffer and tasks are checked against the manifest's hashes
    (a file changed, missing or added is refused)."""
    path = Path(path)
    if not (path / MANIFEST).is_file():
        raise BundleError(f"{path}: no {MANIFEST}; make a bundle with `dreamgym simulator export {path}`")
    manifest = json.loads((path / MANIFEST).read_text(encoding="utf-8"))
    if manifest.get("format") != FORMAT:
        raise BundleError(f"{path}: bundle format {manifest.get('format')!r}, this dreamgym reads {FORMAT}; "
                          "export it again with this version")
    if verify:  # every listed file as exported, and none added to the model, buffer or tasks
        present = {p.relative_to(path).as_posix() for part in (MODEL_DIR, BUFFER_DIR) for p in (path / part).rglob("*")
                   if p.is_file()} | {TASKS_FILE}
        changed = sorted(name for name in present | manifest["files"].keys() if name not in manifest["files"]
                         or not (path / name).is_file() or sha256_file(path / name) != manifest["files"][name])
        if changed:
            raise BundleError(f"{path}: {len(changed)} file(s) differ from the manifest ({', '.join(changed[:3])}); "
                              "export the bundle again")
    return Bundle(path, manifest)


def _task_record(task: Task) -> dict[str, Any]:
    return {"task_id": task.task_id, "environment": task.environment, "instruction": task.instruction,
            "parameters": task.parameters}


def _code_sha256(repo: Path) -> str:
    digest = hashlib.sha256()
    for name in CODE:
        digest.update(f"{name}\0{sha256_file(repo / name)}\n".encode())
    return digest.hexdigest()


def _fidelity(path: Path) -> dict[str, Any]:
    """The headline figures of evaluate_experience_model: on the seed's held-out transitions and, where measured, on
    policies' own play of held-out games; {} when the model was never evaluated."""
    if not path.is_file():
        return {}
    metrics = json.loads(path.read_text(encoding="utf-8"))
    keep = ("n", "token_f1", "change_f1", "reward_accuracy", "positive_reward_accuracy", "done_accuracy",
            "false_wins", "unrewarded_n")
    figures = {"seed_heldout": {k: v for k, v in metrics.get("experience model", {}).get("overall", {}).items()
                                if k in keep},
               "fallback_rate": metrics.get("prediction", {}).get("fallback_rate")}
    on_policy = metrics.get("on_policy", {}).get("experience model", {}).get("overall")
    if on_policy:
        figures["on_policy"] = {k: v for k, v in on_policy.items() if k in keep}
    return figures
