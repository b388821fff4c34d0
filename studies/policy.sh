#!/usr/bin/env bash
# Policy study (issue 5): the SFT warm start, GRPO inside the synthetic environment, and both evaluated on
# held-out real TextWorld games (success with Wilson intervals, teacher-forced next-action accuracy).
#
#   studies/policy.sh [EPOCHS] [ITERATIONS] [RESULTS_DIR]   (defaults: 2 warm-start epochs, 8 GRPO iterations)
#
# Runs the three stages with `dreamgym --set ... stage`, not `dvc exp run`: the study uses the experience model
# already in models/experience/model (trained by studies/experience_model.sh at its own budget), which an
# experiment on params.yaml would retrain at the quick profile's. Resumable: a finished stage is skipped, SFT
# and RL continue from their last checkpoints. Run it with OMP_NUM_THREADS set when something else shares the CPU.
set -euo pipefail
epochs=${1:-2}
iterations=${2:-8}
results=${3:-reports/studies/policy}
# 14 turns: the expert walkthroughs of this rung take 9-10 commands. LoRA from zero needs a high rate at CPU
# budgets (the experience model's finding, params.yaml); RL at 5e-5 so a few iterations can move the policy.
study=(
  --set policy.max_turns=14
  --set policy.sft.training.max_steps=-1 --set "policy.sft.training.epochs=$epochs"
  --set policy.sft.training.learning_rate=1.0e-3 --set policy.sft.training.save_steps=10
  --set policy.accuracy_trajectories=50 --set policy.eval_tasks=22
  --set "synthetic_rl.iterations=$iterations" --set synthetic_rl.tasks_per_iteration=2
  --set synthetic_rl.group_size=4 --set synthetic_rl.learning_rate=5.0e-5
  --set experience_model.inference.max_new_tokens=512 --set experience_model.inference.retries=1
)
mkdir -p "$results"
for stage in train_policy_sft synthetic_rl evaluate_policies; do
  if [ -f "$results/$stage.seconds" ]; then echo "== $stage: done before, skipped"; continue; fi
  echo "== $stage"
  start=$SECONDS
  dreamgym "${study[@]}" stage "$stage"
  echo $((SECONDS - start)) > "$results/$stage.seconds"
  cp "metrics/$stage.json" "reports/$stage.md" "$results/"
done
cp metrics/synthetic_rl_iterations.csv "$results/"
cp reports/*.png "$results/" 2>/dev/null || true
printf '%s\n' "studies/policy.sh $epochs $iterations $results" "${study[@]}" > "$results/command.txt"
echo "== done: $results"
