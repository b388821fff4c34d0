#!/usr/bin/env bash
# Policy research on one GPU (issue 5), the sizes a CPU cannot afford: continue the experience model on the current
# seed (rewarded and terminal steps x8), score it on every held-out transition, then GRPO inside the synthetic
# environment at 8 tasks x 8 episodes x 14 turns per iteration.
#
#   research/policy_gpu.sh [ITERATIONS] [RESULTS_DIR]        (defaults: 20 iterations, reports/research/policy/gpu)
#
# Needs what the pipeline's stages leave: data/, annotated/, buffer/ (validate, annotate, index_buffer), the
# experience model to continue in models/experience-start, the warm start in models/policy/sft/model. Evaluate
# the result on real games with research/policy.sh's settings (CPU is enough: real TextWorld games, greedy policy):
#   dreamgym --set policy.max_turns=14 --set policy.accuracy_trajectories=50 --set policy.eval_tasks=22 stage evaluate_policies
# Resumable like research/policy.sh: a finished step is skipped; GRPO continues from its last checkpoint.
set -euo pipefail
iterations=${1:-20}
results=${2:-reports/research/policy/gpu}
# One H100 (reports/research/policy/gpu_h100/): experience-model SFT 0.7 s/step; GRPO ~430 s per iteration, 94% of
# it the experience model's replies (HF generate, 512 tokens, ~29 s per turn for 64 episodes: a turn costs about
# the same for 4 episodes or 64, so batch wide).
study=(
  --set experience_model.inference.max_new_tokens=512 --set experience_model.inference.retries=1
  --set experience_model.inference.batch_size=64
)
mkdir -p "$results"

source "$(dirname "$0")/step.sh"

# 60 steps of 16 examples: about half an epoch of the seed's transitions (outcomes repeated).
step train_experience_model train_experience_model \
  --set models.experience=models/experience-start --set experience_model.outcome_repeats=8 \
  --set experience_model.training.max_steps=60 --set experience_model.training.batch_size=8 \
  --set experience_model.training.gradient_accumulation_steps=2 --set experience_model.training.save_steps=20
step evaluate_experience_model evaluate_experience_model --set experience_model.fidelity_max_transitions=0
cp reports/evaluate_experience_model_predictions.jsonl "$results/"
# Temperature 0.7: at 1.0 the policy invents objects (`red hot knife`) that no game holds.
step synthetic_rl synthetic_rl \
  --set policy.max_turns=14 --set "synthetic_rl.iterations=$iterations" \
  --set synthetic_rl.tasks_per_iteration=8 --set synthetic_rl.group_size=8 --set synthetic_rl.micro_batch_size=8 \
  --set synthetic_rl.learning_rate=2.0e-4 --set synthetic_rl.temperature=0.7 --set synthetic_rl.save_total_limit=3
cp metrics/synthetic_rl_iterations.csv reports/synthetic_rl.png "$results/"
echo "== done: $results"
