# Lanes for a CI script: each runs to its end whatever the lanes before it did, is timed, and the
# summary at exit says which failed; the script then exits non-zero if any did. Source it, then:
#   lane "what it proves" command args...      (a shell function for a lane of several commands)
# A lane runs in a subshell with `set -euo pipefail`, so its first failing command ends it alone.
set -uo pipefail
lane_lines=()
lanes_failed=()

lane() {
  local name="$1" start=$SECONDS status
  shift
  echo "== $name"
  ( set -euo pipefail; "$@" )
  status=$?
  local outcome=ok
  if [ "$status" -ne 0 ]; then
    outcome="FAILED (exit $status)"
    lanes_failed+=("$name")
  fi
  lane_lines+=("$(printf '%5ss  %-16s %s' $((SECONDS - start)) "$outcome" "$name")")
  return 0
}

lanes_summary() {
  local status=$?
  # an interrupted or broken script fails even when every lane it finished passed
  [ "${#lanes_failed[@]}" -gt 0 ] && status=1
  echo "== lane times"
  printf '%s\n' "${lane_lines[@]}"
  echo "$((SECONDS / 60)) min $((SECONDS % 60)) s in all"
  if [ "${#lanes_failed[@]}" -gt 0 ]; then
    echo "${#lanes_failed[@]} of ${#lane_lines[@]} lanes failed:"
    printf '  %s\n' "${lanes_failed[@]}"
  elif [ "$status" -eq 0 ]; then
    echo "all ${#lane_lines[@]} lanes passed"
  fi
  exit "$status"
}
trap lanes_summary EXIT
