# Sourced by the study scripts: `step NAME STAGE [--set ...]` runs one stage with the study's overrides (the
# caller's `study` array) and keeps its log, metrics, report and seconds in $results as NAME.*. A step whose
# NAME.seconds exists is skipped, so a study script run again resumes after its last finished step.
step() {
  local name=$1 stage=$2 start=$SECONDS
  shift 2
  if [ -f "$results/$name.seconds" ]; then echo "== $name: done before, skipped"; return; fi
  echo "== $name (log: $results/$name.log)"
  dreamgym "${study[@]}" "$@" stage "$stage" > "$results/$name.log" 2>&1
  echo $((SECONDS - start)) > "$results/$name.seconds"
  cp "metrics/$stage.json" "$results/$name.json"
  cp "reports/$stage.md" "$results/$name.md"
}
