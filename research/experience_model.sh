#!/usr/bin/env bash
# Experience-model research (issue 4): SmolLM2-135M fine-tuned on TextWorld seed transitions with reasoning and
# retrieval, and the two ablations (no retrieval, no reasoning), each at the same SFT budget, each scored for fidelity
# on the same held-out transitions against copy-nearest-neighbour and state-unchanged.
#
#   research/experience_model.sh [STEPS] [RESULTS_DIR]      (default 100 optimizer steps of 4 examples)
#
# Each variant is one `dvc exp run` (see `dvc exp show`); its metrics and reports are copied to RESULTS_DIR/VARIANT.
# Resumable: rerun after a crash; finished variants are skipped and training resumes from its last checkpoint.
# Cost: ~25 s per step on 2 CPU cores, ~55 s on one thread (run it with OMP_NUM_THREADS=1 when the machine is shared);
# minutes on a GPU. The learning rate is params.yaml's (1e-3): at 2e-4, 60 steps did not teach the reply format.
set -euo pipefail
steps=${1:-100}
results=${2:-reports/research/experience_model}
common=(-S "experience_model.training.max_steps=$steps" -S experience_model.training.save_steps=10
        -S experience_model.fidelity_max_transitions=32 -S experience_model.inference.max_new_tokens=512)

variant() {
  local name=$1; shift
  if [ -f "$results/$name/evaluate_experience_model.json" ]; then echo "== $name: done already"; return; fi
  echo "== $name: dvc exp run ${common[*]} $*"
  git checkout -- params.yaml
  dvc exp run "${common[@]}" "$@" evaluate_experience_model
  mkdir -p "$results/$name"
  cp metrics/train_experience_model.json metrics/evaluate_experience_model.json \
     reports/train_experience_model.md reports/evaluate_experience_model.md "$results/$name/"
}

variant full
variant no-retrieval -S experience_model.prompt.use_retrieval=false
variant no-reasoning -S experience_model.prompt.use_reasoning=false
git checkout -- params.yaml
echo "== all variants done: $results"
