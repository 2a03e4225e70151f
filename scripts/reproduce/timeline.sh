# Sourced by the reproduction scripts (after RES is set): a timeline of what ran, in $RES/timeline.txt.
#   stamp TEXT       one line: wall-clock time, seconds since the script started, TEXT
#   run NAME CMD...  CMD with its output in $RES/logs/NAME.log, its start and end (with the exit code) stamped
mkdir -p "$RES/logs"
T0=$(date +%s)
stamp() { echo "$(date +%T) +$(($(date +%s) - T0))s $*" | tee -a "$RES/timeline.txt"; }
run() {
  local name=$1; shift; stamp "start $name"; "$@" > "$RES/logs/$name.log" 2>&1
  local rc=$?; stamp "end $name rc=$rc"; return $rc
}
