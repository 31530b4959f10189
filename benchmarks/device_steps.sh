# Sourced by benchmarks/device/*.sh: a step that failed or ran out of its time says so, and the call ends non-zero.
# A step's output is piped through grep/tee/tail, so its own status is the pipeline's first: `check NAME` must come
# right after the step's pipeline (a skipped step, `[ ... ] || pipeline`, reads 0).
FAILED_STEPS=()
check() {
  local rc=${PIPESTATUS[0]}
  [ "$rc" = 0 ] && return 0
  local why="exit $rc"
  [ "$rc" = 124 ] && why="timed out"
  echo "STEP FAILED: $1 ($why)"
  FAILED_STEPS+=("$1 ($why)")
}
finish() {  # NAME: the summary line, then every failed step again (the tail the device tool returns keeps them)
  echo "$1 done in $SECONDS s"
  [ ${#FAILED_STEPS[@]} = 0 ] && return 0
  printf 'STEP FAILED: %s\n' "${FAILED_STEPS[@]}"
  exit 1
}
