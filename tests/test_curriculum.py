"""components/rl/curriculum.py: task values, the lambda cap, task generation and validation, checkpoints, clustering.

`VariationBackend` is a test double for the experience-model backbone's *text* only: its replies are a fixed
function of the prompt. The curriculum around it (prompting, parsing, validation, records) is the real one; one test
runs a real tiny Hugging Face model through `make_backend`.
"""
from __future__ import annotations

import json
import logging
import math
import warnings
from pathlib import Path

import pytest

from components.data.contract import Task
from components.llm.backends import make_backend
from components.rl.curriculum import (
    INSTRUCTION_END,
    Curriculum,
    cluster_tasks,
    parse_instruction,
    read_tasks,
    task_schedule,
    variation_examples,
    variation_pairs,
)
from tests.conftest import settings_from_params
from tests.hashing_encoder import HashingEncoder

ENV = "textworld-cooking"
KITCHEN = "You are in a kitchen. You see a closed fridge and a table."


def curriculum_settings(**overrides):
    """params' curriculum settings, on and varying the top 2 tasks unless overridden (what these tests count on)."""
    return settings_from_params("curriculum", **{"enabled": True, "top_tasks": 2, **overrides})


def make_tasks(count: int) -> list[Task]:
    return [Task(f"tw-{i}", ENV, f"Cook recipe number {i}, then eat it.", {"initial_state": f"{KITCHEN} ({i})"})
            for i in range(count)]


class VariationBackend:
    """Replies `<instruction>{parent instruction} {suffix}</instruction>`, suffix "harder 1", "harder 2", ... by
    default (every reply new), or a fixed text per call from `replies`. Records every call."""

    def __init__(self, replies: list[str] | None = None) -> None:
        self.replies = replies
        self.calls: list[dict] = []
        self.counter = 0

    def generate(self, prompts, max_new_tokens, temperature=0.0):
        self.calls.append({"prompts": list(prompts), "max_new_tokens": max_new_tokens, "temperature": temperature})
        if self.replies is not None:
            return list(self.replies)
        replies = []
        for prompt in prompts:
            self.counter += 1
            parent = prompt[-1]["content"].split("\nTask: ")[1].split("\n")[0]
            replies.append(f"<instruction>{parent} harder {self.counter}</instruction>")
        return replies


def play(curriculum: Curriculum, rewards_by_task: dict[str, list[float]]) -> None:
    """One iteration's observation: each task's group of episodes with the given rewards."""
    tasks = [curriculum.tasks_by_id[i] for i, rewards in rewards_by_task.items() for _ in rewards]
    curriculum.observe(tasks, [r for rewards in rewards_by_task.values() for r in rewards])


def test_observe_records_population_variance_and_selects_the_hardest():
    a, b, c, d = make_tasks(4)
    curriculum = Curriculum([a, b, c, d], curriculum_settings(top_tasks=2))
    play(curriculum, {"tw-0": [1, 0, 1, 0], "tw-1": [1, 1, 1, 1], "tw-2": [1, 0, 0, 0], "tw-3": [0, 1, 0, 1]})
    assert curriculum.variance == {"tw-0": 0.25, "tw-1": 0.0, "tw-2": 0.1875, "tw-3": 0.25}
    assert curriculum.hardest_tasks() == [a, d]  # a tie at 0.25 goes to the smaller task id

    curriculum.settings = curriculum_settings(top_tasks=10)
    assert curriculum.hardest_tasks() == [a, d, c]  # b never varies: below min_variance, never a parent

    # only the latest iteration counts: a's old variance measured an older policy
    play(curriculum, {"tw-1": [0, 1], "tw-2": [0, 0]})
    assert curriculum.hardest_tasks() == [b]
    assert curriculum.variance["tw-0"] == 0.25  # still recorded
    assert curriculum.summary()["reward_variance_max"] == 0.25 and curriculum.summary()["reward_variance_mean"] == 0.125


def test_observe_rejects_mismatched_or_unknown_input():
    curriculum = Curriculum(make_tasks(2), curriculum_settings())
    with pytest.raises(ValueError, match="rewards"):
        curriculum.observe(make_tasks(2), [1.0])
    with pytest.raises(ValueError, match="unknown"):
        curriculum.observe([Task("other", ENV, "x")], [1.0])
    with pytest.raises(ValueError, match="duplicate"):
        Curriculum(make_tasks(2) * 2, curriculum_settings())
    with pytest.raises(ValueError, match="max_generated_share"):
        curriculum_settings(max_generated_share=1.5)


def test_disabled_or_empty_curriculum_is_exactly_task_schedule():
    tasks = make_tasks(7)
    enabled = Curriculum(tasks, curriculum_settings())
    play(enabled, {"tw-0": [1, 0], "tw-1": [0, 1]})
    enabled.propose(VariationBackend(), iteration=0)
    assert len(enabled.generated) == 2

    disabled = Curriculum(tasks, curriculum_settings(enabled=False))
    disabled.load_state_dict(enabled.state_dict())  # even with generated tasks around, the ablation ignores them
    empty = Curriculum(tasks, curriculum_settings())
    for seed in (0, 3):
        for iteration in range(5):
            for per_iteration, group_size in ((2, 4), (3, 1), (7, 2), (9, 2)):
                expected = task_schedule(tasks, per_iteration, group_size, seed, iteration)
                assert disabled.tasks_for_iteration(iteration, per_iteration, group_size, seed) == expected
                assert empty.tasks_for_iteration(iteration, per_iteration, group_size, seed) == expected

    backend = VariationBackend()
    play(disabled, {"tw-0": [1, 0]})
    assert disabled.propose(backend, iteration=1) == [] and backend.calls == []
    assert disabled.summary()["curriculum_enabled"] is False


@pytest.mark.parametrize("share, per_iteration", [(0.5, 2), (0.5, 3), (0.25, 8), (0.3, 10), (0.29, 100),
                                                  (0.0, 4), (1.0, 5), (0.7, 10)])
def test_generated_share_is_capped_by_lambda(share: float, per_iteration: int):
    tasks = make_tasks(100)
    curriculum = Curriculum(tasks, curriculum_settings(max_generated_share=share, top_tasks=100))
    play(curriculum, {t.task_id: [0, 1] for t in tasks})
    assert len(curriculum.propose(VariationBackend(), iteration=0)) == 100  # plenty to choose from

    group_size = 3
    for iteration in (1, 2):
        schedule = curriculum.tasks_for_iteration(iteration, per_iteration, group_size, seed=0)
        chosen = schedule[::group_size]
        assert schedule == [t for t in chosen for _ in range(group_size)]  # groups of identical tasks, in a row
        assert len(chosen) == per_iteration == len({t.task_id for t in chosen})
        generated = [t for t in chosen if "parent_task_id" in t.parameters]
        assert len(generated) == math.floor(round(share * per_iteration, 6))


def test_generated_picks_prefer_unplayed_newest_then_highest_variance():
    tasks = make_tasks(6)
    curriculum = Curriculum(tasks, curriculum_settings(max_generated_share=0.5, top_tasks=2))
    play(curriculum, {"tw-0": [1, 0, 0, 0], "tw-1": [1, 0, 1, 0]})
    first = curriculum.propose(VariationBackend(), iteration=0)
    assert [t.task_id for t in first] == ["tw-1~g0-0", "tw-0~g0-0"]  # highest-variance parent first

    picks = curriculum.tasks_for_iteration(1, 4, 1, seed=0)[-2:]
    assert picks == first
    play(curriculum, {first[0].task_id: [1, 1], first[1].task_id: [1, 0]})
    second = curriculum.propose(VariationBackend(), iteration=1)
    assert [t.task_id for t in second] == ["tw-0~g0-0~g1-0"]  # only the variation that still varies is varied

    picks = curriculum.tasks_for_iteration(2, 4, 1, seed=0)[-2:]
    # unplayed first, then those that still vary; tw-1~g0-0 was always solved and is no longer played
    assert [t.task_id for t in picks] == ["tw-0~g0-0~g1-0", "tw-0~g0-0"]

    # a variation whose every episode an environment failure ended (the simulator could not go on) has no variance:
    # it is not picked again as never played, which would replay it every iteration
    curriculum.observe_failures([picks[0], tasks[0]])
    assert curriculum.unplayable == {"tw-0~g0-0~g1-0"}  # generated tasks only
    assert [t.task_id for t in curriculum.tasks_for_iteration(3, 4, 1, seed=0)[-2:]][-1] == "tw-0~g0-0"
    restored = Curriculum(tasks, curriculum_settings(max_generated_share=0.5, top_tasks=2))
    restored.load_state_dict(json.loads(json.dumps(curriculum.state_dict())))
    assert restored.unplayable == curriculum.unplayable


def test_propose_writes_validated_versioned_task_records(tmp_path):
    tasks = make_tasks(3)
    settings = curriculum_settings(top_tasks=2, variations_per_task=2, max_new_tokens=40, temperature=0.9)
    curriculum = Curriculum(tasks, settings)
    play(curriculum, {"tw-0": [1, 0], "tw-1": [1, 1], "tw-2": [0, 1]})
    backend = VariationBackend()
    accepted = curriculum.propose(backend, iteration=3)

    [call] = backend.calls  # one batched call for every variation
    assert call["max_new_tokens"] == 40 and call["temperature"] == 0.9 and len(call["prompts"]) == 4
    system, user = call["prompts"][0]
    assert "<instruction>" in system["content"] and "same kinds of actions" in system["content"]
    assert "Cook recipe number 0, then eat it." in user["content"] and f"{KITCHEN} (0)" in user["content"]

    assert [t.task_id for t in accepted] == ["tw-0~g3-0", "tw-0~g3-1", "tw-2~g3-0", "tw-2~g3-1"]
    child = accepted[0]
    assert child.environment == ENV and child.instruction == "Cook recipe number 0, then eat it. harder 1"
    assert child.parameters == {"initial_state": f"{KITCHEN} (0)", "parent_task_id": "tw-0",
                                "generated_at_iteration": 3}
    assert curriculum.generated == accepted and curriculum.tasks_by_id["tw-2~g3-1"] == accepted[3]

    path = tmp_path / "generated_tasks.jsonl"
    curriculum.write_tasks(path)
    assert read_tasks(path) == accepted
    assert len(path.read_text().splitlines()) == 4
    with pytest.raises(ValueError, match="jsonl"):
        curriculum.write_tasks(tmp_path / "tasks.parquet")
    summary = curriculum.summary()
    assert summary["generated_tasks"] == 4 and summary["proposed"] == 4 and summary["accepted"] == 4
    assert summary["rejected"] == 0


def test_propose_rejects_bad_replies_by_reason_and_never_raises():
    tasks = make_tasks(1)
    curriculum = Curriculum(tasks, curriculum_settings(top_tasks=1, variations_per_task=6, max_instruction_chars=50))
    play(curriculum, {"tw-0": [1, 0]})
    replies = [
        "Sure! Here is a harder task: cook twice.",  # no tags
        "<instruction> ... </instruction>",  # nothing in them
        f"<instruction>{'cook ' * 20}</instruction>",  # over max_instruction_chars
        "<instruction>cook recipe NUMBER 0 -- then eat it</instruction>",  # the parent, in other words
        "<instruction>Cook the meal without a knife.</instruction> and some trailing text",
        "<instruction>cook the meal, without a knife!</instruction>",  # the previous reply again
    ]
    accepted = curriculum.propose(VariationBackend(replies), iteration=1)
    assert [t.instruction for t in accepted] == ["Cook the meal without a knife."]
    assert [r["reason"] for r in curriculum.rejections] == ["unparseable", "empty", "too_long", "duplicate",
                                                            "duplicate"]
    assert curriculum.rejections[0]["reply"] == replies[0]
    summary = curriculum.summary()
    assert summary["proposed"] == 6 and summary["accepted"] == 1 and summary["rejected"] == 5
    assert (summary["rejected_unparseable"], summary["rejected_empty"], summary["rejected_too_long"],
            summary["rejected_duplicate"]) == (1, 1, 1, 2)

    # a variation already generated in an earlier iteration is a duplicate, too
    assert curriculum.propose(VariationBackend([replies[4]] * 6), iteration=2) == []
    assert curriculum.summary()["rejected_duplicate"] == 8

    class Broken:
        def generate(self, prompts, max_new_tokens, temperature):
            raise ConnectionError("endpoint down")

    assert curriculum.propose(Broken(), iteration=3) == []
    assert curriculum.propose(VariationBackend(["<instruction>one only</instruction>"]), iteration=4) == []
    assert curriculum.summary()["rejected_backend_error"] == 12


def test_propose_with_a_real_tiny_model(tiny_model_dir):
    backend = make_backend("hf", str(tiny_model_dir), batch_size=8, base_url=None, weight_type="f32", threads=0,
                           context=1024, cache_dir=tiny_model_dir)
    curriculum = Curriculum(make_tasks(2), curriculum_settings(top_tasks=2, max_new_tokens=12))
    play(curriculum, {"tw-0": [1, 0], "tw-1": [0, 1]})
    accepted = curriculum.propose(backend, iteration=0)
    # a random tiny model cannot write <instruction>...</instruction>: every reply is rejected, nothing raises
    assert accepted == [] and curriculum.generated == []
    summary = curriculum.summary()
    assert summary["proposed"] == 2 and summary["rejected_unparseable"] == 2
    assert all(isinstance(r["reply"], str) for r in curriculum.rejections)


def test_state_dict_round_trip_replays_the_same_choices():
    tasks = make_tasks(8)
    settings = curriculum_settings(top_tasks=2, max_generated_share=0.5)
    original = Curriculum(tasks, settings)
    for iteration in range(3):
        schedule = original.tasks_for_iteration(iteration, 4, 2, seed=7)
        original.observe(schedule, [float((i // 2 + iteration) % 3 == 0 and i % 2) for i in range(len(schedule))])
        original.propose(VariationBackend(), iteration)
    assert original.generated

    restored = Curriculum(tasks, settings)
    restored.load_state_dict(json.loads(json.dumps(original.state_dict())))
    assert restored.state_dict() == original.state_dict()
    for iteration in (3, 4):
        schedule = restored.tasks_for_iteration(iteration, 4, 2, seed=7)
        assert schedule == original.tasks_for_iteration(iteration, 4, 2, seed=7)
        assert any("parent_task_id" in t.parameters for t in schedule)
    assert restored.hardest_tasks() == original.hardest_tasks()
    backend_a, backend_b = VariationBackend(), VariationBackend()
    assert restored.propose(backend_a, 3) == original.propose(backend_b, 3)
    assert backend_a.calls == backend_b.calls


def test_cluster_tasks_groups_near_identical_instructions():
    instructions = ["cook the red potato and eat it", "cook the red potato, then eat it",
                    "click the blue submit button", "click the blue submit button now"]
    tasks = [Task(f"t{i}", ENV, text) for i, text in enumerate(instructions)]
    clusters = cluster_tasks(tasks, HashingEncoder(), n_clusters=2, seed=0)
    assert set(clusters) == {"t0", "t1", "t2", "t3"}
    assert clusters["t0"] == clusters["t1"] != clusters["t2"] == clusters["t3"]
    assert cluster_tasks(tasks, HashingEncoder(), n_clusters=2, seed=0) == clusters  # deterministic

    twins = [*tasks[:2], Task("t4", ENV, instructions[0]), Task("t5", ENV, instructions[0])]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # k capped at 2 distinct instructions: no k-means warning
        capped = cluster_tasks(twins, HashingEncoder(), n_clusters=10, seed=0)
    assert len(set(capped.values())) == 2 and capped["t0"] == capped["t4"] == capped["t5"]
    assert cluster_tasks([], HashingEncoder(), n_clusters=3, seed=0) == {}


def test_observe_with_clusters_pools_episodes_of_similar_tasks():
    a, b, c = make_tasks(3)
    curriculum = Curriculum([a, b, c], curriculum_settings(top_tasks=3), clusters={"tw-0": 0, "tw-1": 0, "tw-2": 1})
    # one episode per task (PPO): no task has a variance of its own, its cluster has
    play(curriculum, {"tw-0": [1], "tw-1": [0], "tw-2": [1]})
    assert curriculum.cluster_variance == {0: 0.25, 1: 0.0}
    assert curriculum.variance == {"tw-0": 0.25, "tw-1": 0.25, "tw-2": 0.0}
    assert curriculum.hardest_tasks() == [a, b]

    [child, _] = curriculum.propose(VariationBackend(), iteration=0)
    assert curriculum.clusters[child.task_id] == 0  # a variation joins its parent's cluster
    restored = Curriculum([a, b, c], curriculum_settings(top_tasks=3))
    restored.load_state_dict(json.loads(json.dumps(curriculum.state_dict())))
    assert restored.clusters == curriculum.clusters and restored.cluster_variance == {0: 0.25, 1: 0.0}


def test_one_variation_written_for_two_games_is_two_tasks():
    tasks = make_tasks(2)
    curriculum = Curriculum(tasks, curriculum_settings(top_tasks=2, variations_per_task=1))
    play(curriculum, {"tw-0": [1, 0], "tw-1": [0, 1]})
    same = "<instruction>Cook the meal without a knife.</instruction>"
    accepted = curriculum.propose(VariationBackend([same, same]), iteration=1)
    # another game (here another initial state) makes another task; the same game twice would be a duplicate
    assert sorted(t.parameters["parent_task_id"] for t in accepted) == ["tw-0", "tw-1"]
    assert curriculum.propose(VariationBackend([same, same]), iteration=2) == []
    assert curriculum.summary()["rejected_duplicate"] == 2


# ---- teaching the writer ----------------------------------------------------------------------------------------


def web_tasks() -> list[Task]:
    """Two families of a web environment (two click-button pages, three enter-text ones) and a lone task."""
    def task(name: str, seed: int, instruction: str) -> Task:
        return Task(f"miniwob-{name}-s{seed}", "miniwob", instruction,
                    {"task": name, "seed": seed, "initial_state": f"page {name} {seed}"})
    return [task("click-button", 1, 'Click on the "No" button.'),
            task("click-button", 2, 'Click on the "okay" button.'),
            task("enter-text", 3, 'Enter "Bob" into the text field.'), task("enter-text", 4, 'Enter "Ann" into it.'),
            task("enter-text", 5, 'Enter "Cy" into it.'), task("login-user", 6, "Log in as Ada.")]


def cooking_games() -> list[Task]:
    """One family whose every game has one instruction, as TextWorld cooking's do."""
    return [Task(f"tw-{seed}", ENV, "Cook a meal, then eat it.", {"recipe": 1, "seed": seed,
                                                                  "initial_state": f"{KITCHEN} ({seed})"})
            for seed in range(3)]


def test_variation_pairs_are_other_instructions_of_a_tasks_family_and_a_shared_instruction_gives_none():
    pairs = variation_pairs(web_tasks(), per_task=1)
    assert [(parent.task_id, text) for parent, text in pairs] == [
        ("miniwob-click-button-s1", 'Click on the "okay" button.'),
        ("miniwob-click-button-s2", 'Click on the "No" button.'),
        ("miniwob-enter-text-s3", 'Enter "Ann" into it.'), ("miniwob-enter-text-s4", 'Enter "Cy" into it.'),
        ("miniwob-enter-text-s5", 'Enter "Bob" into the text field.')]  # each its family's next, in turn
    assert len(variation_pairs(web_tasks(), per_task=5)) == 2 + 3 * 2  # every other instruction of the family
    assert variation_pairs(cooking_games(), per_task=2) == []
    [example] = variation_examples(pairs[:1], max_state_chars=100)
    assert example["prompt"][1]["content"].endswith("page click-button 1")  # the curriculum's own prompt
    reply = example["completion"][0]["content"]
    assert reply.endswith(INSTRUCTION_END) and parse_instruction(reply) == 'Click on the "okay" button.'


def test_the_writer_is_taught_on_the_pairs_and_kept_and_untaught_where_there_are_none(tiny_model_dir, tmp_path,
                                                                                   caplog):
    from components.builders import curriculum_writer
    from components.config import load_params
    from tests.conftest import REPO

    params = load_params(REPO / "params.yaml", {
        "models.experience": str(tiny_model_dir), "models.kept_trainings": "kept",
        "synthetic_rl.curriculum.writer_training.max_steps": 2,
        "synthetic_rl.curriculum.writer_training.precision": "fp32",
        "synthetic_rl.curriculum.writer_training.lora.top_layers": None})
    writer = Path(curriculum_writer(params, tmp_path, web_tasks()))
    assert writer == tmp_path / params.synthetic_rl.out_dir / "curriculum_writer" / "model"
    assert (writer / "config.json").is_file() and len(list((tmp_path / "kept").iterdir())) == 1
    with caplog.at_level(logging.WARNING, logger="components.builders"):
        assert curriculum_writer(params, tmp_path, cooking_games()) == str(tiny_model_dir)
    assert "nothing to teach the writer from" in caplog.text
    untaught = load_params(REPO / "params.yaml", {"models.experience": str(tiny_model_dir),
                                                  "synthetic_rl.curriculum.writer_training": None})
    assert curriculum_writer(untaught, tmp_path, web_tasks()) == str(tiny_model_dir)
