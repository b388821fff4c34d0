"""The real packaged backbone (SmolLM2-135M-Instruct, loaded with from_pretrained) as the experience model: before
SFT its replies do not parse and the fallback budget stops the stage that would use it; after a few SFT steps on a
handful of examples its replies parse and the same budget lets it through."""
from __future__ import annotations

import importlib.util

import pytest

from components.data.contract import Step, Task, Trajectory
from components.llm.backends import HFGenerationBackend
from components.llm.models import PACKAGED_MODELS, load_causal_lm
from components.llm.sft import load_trained_model, train_sft
from components.simulator.annotation import annotate
from components.simulator.experience_model import (
    REPLY_END,
    ExperienceModelFailure,
    ExperienceQuery,
    FallbackBudget,
    PredictionStats,
    predict,
    sft_examples,
)
from tests.conftest import settings_from_params

# slow: it fine-tunes and runs the real packaged backbone, minutes on 2 cores (`make test PYTEST_ARGS="-m slow"`)
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec(PACKAGED_MODELS["smollm2-135m-instruct"].package) is None,
                                 reason=PACKAGED_MODELS["smollm2-135m-instruct"].install)]

# params' reply format (reasoning first); no buffer needed
FORMAT = settings_from_params("prompt", use_reasoning=True, use_retrieval=False)
BUDGET = FallbackBudget(max_fallback_rate=0.5, max_backend_error_rate=0.0)
MAX_NEW_TOKENS = 200  # the longest target here is ~120 tokens


def _trajectory(number: int, food: str) -> Trajectory:
    """Three steps of a one-room cooking game: open the fridge, take the food, eat the meal (reward 1, the end)."""
    task = Task(f"tw-{number}", "textworld-cooking", "Cook a meal following the cookbook, then eat it.")
    closed = "You are in a kitchen. You see a closed fridge.\nInventory: nothing."
    opened = f"You open the fridge, revealing a {food}.\nInventory: nothing."
    taken = f"You take the {food} from the fridge.\nInventory: a {food}."
    eaten = "You eat the meal. Not bad.\n*** The End ***\nInventory: nothing."
    steps = [Step(closed, "open fridge", opened, 0.0, False, {"valid_action": True, "score": 0, "max_score": 2}),
             Step(opened, f"take {food} from fridge", taken, 0.0, False,
                  {"valid_action": True, "score": 1, "max_score": 2}),
             Step(taken, "eat meal", eaten, 1.0, True, {"valid_action": True, "won": True, "score": 2,
                                                         "max_score": 2})]
    return Trajectory(f"seed-{number}", task, steps, True, 1.0, "expert")


@pytest.fixture(scope="module")
def examples():
    annotated = annotate([_trajectory(i, food) for i, food in enumerate(["red potato", "carrot", "yellow apple"])])
    # the training prompts themselves: each step with its trajectory's earlier steps as history
    queries = [ExperienceQuery(r.task, r.state, r.action,
                               tuple((s.state, s.action) for s in sorted(annotated, key=lambda s: s.step_index)
                                     if s.trajectory_id == r.trajectory_id and s.step_index < r.step_index))
               for r in annotated]
    return sft_examples(annotated, None, FORMAT, outcome_repeats=1, lookalike_repeats=1), queries


def _replies(model_dir_or_name, queries, cache_dir) -> PredictionStats:
    model, tokenizer = (load_trained_model(model_dir_or_name) if cache_dir is None else
                        load_causal_lm(model_dir_or_name, cache_dir=cache_dir))
    stats = PredictionStats()
    settings = settings_from_params("inference", retries=0, max_new_tokens=MAX_NEW_TOKENS, temperature=0.0,
                                    reward_range=(-1.0, 1.0))
    predict(HFGenerationBackend(model, tokenizer, batch_size=len(queries), stop=(REPLY_END,)), queries, FORMAT,
            settings, stats=stats)
    return stats


def test_untrained_replies_fail_the_budget_and_a_few_sft_steps_teach_the_format(examples, tmp_path):
    dataset, queries = examples
    assert len(dataset) == len(queries) == 9

    untrained = _replies("smollm2-135m-instruct", queries[:3], tmp_path)  # they run to the cap: three will do
    with pytest.raises(ExperienceModelFailure, match="train it longer"):
        BUDGET.check(untrained, "evaluate_experience_model", MAX_NEW_TOKENS)

    # 24 steps at 2e-3 taught the format on 8 examples (the earlier overfit check); LoRA on the top 8 layers
    settings = settings_from_params("training", epochs=1.0, max_steps=24, learning_rate=2e-3, batch_size=1,
                                    gradient_accumulation_steps=1, max_seq_len=1536, warmup=0, logging_steps=8,
                                    save_steps=100, lora=settings_from_params("lora", r=16, alpha=32, top_layers=8),
                                    precision="fp32")
    result = train_sft(dataset, "smollm2-135m-instruct", tmp_path / "experience", settings, cache_dir=tmp_path)
    assert result.final_loss < result.train_loss  # it learned something on the way

    trained = _replies(result.model_dir, queries, None)
    assert trained.fallbacks == 0, f"unparsable replies after SFT: {trained.failed_replies}"
    BUDGET.check(trained, "evaluate_experience_model", MAX_NEW_TOKENS)
