#!/usr/bin/env bash
# Policy study (issue 5): the SFT warm start with a real budget, GRPO inside the synthetic environment, and both
# evaluated on held-out real TextWorld games (success with Wilson intervals, next-action accuracy).
#
#   studies/policy.sh [EPOCHS] [ITERATIONS]        (default 3 warm-start epochs, 20 GRPO iterations)
#
# One `dvc exp run` (see `dvc exp show`); its metrics and reports are copied to reports/studies/policy/.
# Resumable: rerun after a crash or at the next session; SFT and RL both continue from their last checkpoints.
# Needs a trained experience model (studies/experience_model.sh, or the pipeline's).
set -euo pipefail
epochs=${1:-3}
iterations=${2:-20}
results=reports/studies/policy
git checkout -- params.yaml
dvc exp run \
  -S policy.sft.training.max_steps=-1 -S "policy.sft.training.epochs=$epochs" -S policy.sft.training.save_steps=10 \
  -S policy.accuracy_trajectories=50 -S policy.eval_tasks=22 \
  -S "synthetic_rl.iterations=$iterations" -S synthetic_rl.tasks_per_iteration=2 -S synthetic_rl.group_size=4 \
  evaluate_policies
mkdir -p "$results"
for stage in train_policy_sft synthetic_rl evaluate_policies; do
  cp "metrics/$stage.json" "reports/$stage.md" "$results/"
done
cp metrics/synthetic_rl_iterations.csv reports/synthetic_rl.png "$results/"
git checkout -- params.yaml
echo "== done: $results"
