#!/usr/bin/env bash
# Policy research (issue 5): the SFT warm start, GRPO inside the synthetic environment, and both evaluated on
# held-out real TextWorld games (success with Wilson intervals, teacher-forced next-action accuracy).
#
#   research/policy.sh [EPOCHS] [ITERATIONS] [RESULTS_DIR]   (defaults: 2 warm-start epochs, 8 GRPO iterations)
#
# Runs the three stages with `dreamgym --set ... stage`, not `dvc exp run`: the study uses the experience model
# already in models/experience/model (trained by research/experience_model.sh at its own budget), which an
# experiment on params.yaml would retrain at the quick profile's. Resumable: a finished stage is skipped, SFT
# and RL continue from their last checkpoints. Threads: OMP_NUM_THREADS (default: every core) for the sequential
# steps, half of them each for the two that run side by side.
set -euo pipefail
epochs=${1:-2}
iterations=${2:-8}
results=${3:-reports/research/policy}
# 14 turns: the expert walkthroughs of this rung take 9-10 commands. LoRA from zero needs a high rate at CPU
# budgets (the experience model's finding, params.yaml). RL makes one optimizer step per iteration and a CPU
# study affords two or three: at 2e-4 (a fifth of the warm start's rate) they can move the policy at all. At
# temperature 1.0, 391 of 606 sampled commands were not valid in the real game (session 10); 0.7 as the H100 run.
study=(
  --set policy.max_turns=14
  --set policy.sft.training.max_steps=-1 --set "policy.sft.training.epochs=$epochs"
  --set policy.sft.training.learning_rate=1.0e-3 --set policy.sft.training.save_steps=10
  --set policy.accuracy_trajectories=50 --set policy.eval_tasks=22
  --set "synthetic_rl.iterations=$iterations" --set synthetic_rl.tasks_per_iteration=2
  --set synthetic_rl.group_size=4 --set synthetic_rl.learning_rate=2.0e-4 --set synthetic_rl.temperature=0.7
  --set experience_model.inference.max_new_tokens=512 --set experience_model.inference.retries=1
)
mkdir -p "$results"

source "$(dirname "$0")/step.sh"
threads=${OMP_NUM_THREADS:-$(nproc)}
half=$(( threads > 1 ? threads / 2 : 1 ))

OMP_NUM_THREADS=$threads step train_policy_sft train_policy_sft
# The later steps must use the warm start this study trained and scored: a resumed study (or one whose SFT steps
# were copied in) with another model in models/policy/sft, e.g. after a `dvc checkout`, stops here.
warm_start=$(python -c 'from components.files import directory_sha256; print(directory_sha256("models/policy/sft/model"))')
if [ ! -f "$results/warm_start.sha256" ]; then echo "$warm_start" > "$results/warm_start.sha256"
elif [ "$(cat "$results/warm_start.sha256")" != "$warm_start" ]; then
  echo "models/policy/sft/model is not the warm start of $results (warm_start.sha256); put that one back" >&2
  exit 1
fi
# Evaluating the warm start and training RL need nothing of each other: half the threads each. evaluate.policies
# picks the one policy each evaluation scores.
OMP_NUM_THREADS=$half step evaluate_sft evaluate_policies --set "evaluate.policies=[train_policy_sft]" &
evaluating=$!
# every thread to RL when the warm start's evaluation was done before (a resumed study)
rl_threads=$([ -f "$results/evaluate_sft.seconds" ] && echo "$threads" || echo "$half")
OMP_NUM_THREADS=$rl_threads step synthetic_rl synthetic_rl
wait "$evaluating"
OMP_NUM_THREADS=$threads \
step evaluate_rl evaluate_policies --set "evaluate.policies=[synthetic_rl]"
cp metrics/synthetic_rl_iterations.csv reports/synthetic_rl.png "$results/"
printf '%s\n' "research/policy.sh $epochs $iterations $results" "${study[@]}" > "$results/command.txt"
echo "== done: $results"
