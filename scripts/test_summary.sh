#!/usr/bin/env bash
# Prints a readable summary of a CTest run: cases per label (passed, failed, skipped, seconds), the
# slowest cases, and for each failed case the command lines that rerun it alone.
#   bash scripts/test_summary.sh BUILD_DIR JUNIT_XML
# JUNIT_XML is what `ctest --output-junit` wrote; labels and commands come from `ctest -N -V`.
# A skipped case is counted as skipped, never as passed. Needs only bash, awk and ctest.
set -euo pipefail
BUILD_DIR=$1
JUNIT=$2
SLOWEST=${SHARDIT_TEST_SLOWEST:-10}

if [ ! -s "$JUNIT" ]; then
  echo "test summary: no results in $JUNIT (CTest ran no test)"
  exit 0
fi

# One line per registered test: name <TAB> labels (space-separated) <TAB> command.
registry=$(mktemp)
trap 'rm -f "$registry"' EXIT
ctest --test-dir "$BUILD_DIR" -N -V 2>/dev/null | awk '
  match($0, /^[0-9]+: Test command: /) { command = substr($0, RLENGTH + 1) }
  /^Labels: / { labels = substr($0, 9) }
  match($0, /^  Test +#[0-9]+: /) {
    printf "%s\t%s\t%s\n", substr($0, RLENGTH + 1), labels, command
    labels = ""; command = ""
  }' >"$registry"

awk -v slowest="$SLOWEST" -v build_dir="$BUILD_DIR" -F '\t' '
  function unescape(s) {
    gsub(/&lt;/, "<", s); gsub(/&gt;/, ">", s); gsub(/&quot;/, "\"", s); gsub(/&apos;/, "\047", s)
    gsub(/&amp;/, "\\&", s)
    return s
  }
  function attribute(line, key,    start, rest) {
    start = index(line, " " key "=\"")
    if (start == 0) return ""
    rest = substr(line, start + length(key) + 3)
    return substr(rest, 1, index(rest, "\"") - 1)
  }
  function finish_case() {
    if (current == "") return
    # notrun is a skip only when the case asked for it (SKIP_REGULAR_EXPRESSION, SKIP_RETURN_CODE);
    # otherwise it did not run at all (a missing program, a failed fixture): a failure.
    if (status == "run") outcome = "passed"
    else if (status == "notrun" && skip_reason ~ /^SKIP_/) outcome = "skipped"
    else outcome = "failed"
    names[++n] = current; outcome_of[n] = outcome; time_of[n] = seconds
    current = ""
  }
  FILENAME == ARGV[1] { label_list[$1] = $2; command_of[$1] = $3; next }
  /<testcase / {
    finish_case()
    current = unescape(attribute($0, "name")); seconds = attribute($0, "time") + 0
    status = attribute($0, "status"); skip_reason = ""
  }
  /<skipped / { skip_reason = unescape(attribute($0, "message")) }
  /<\/testsuite>/ { finish_case() }
  END {
    finish_case()
    for (i = 1; i <= n; ++i) {
      labels = label_list[names[i]]
      if (labels == "") labels = "(none)"
      count = split(labels, parts, " ")
      for (j = 1; j <= count; ++j) {
        l = parts[j]
        if (!(l in cases)) order[++labels_seen] = l
        cases[l]++; by[l, outcome_of[i]]++; total_time[l] += time_of[i]
      }
      all[outcome_of[i]]++; all_time += time_of[i]
    }
    # Labels in name order, then the whole run.
    for (i = 1; i <= labels_seen; ++i)
      for (j = i + 1; j <= labels_seen; ++j)
        if (order[j] < order[i]) { t = order[i]; order[i] = order[j]; order[j] = t }
    print ""
    print "==== Test summary ===="
    printf "%-10s %7s %7s %7s %8s %10s\n", "label", "cases", "passed", "failed", "skipped", "seconds"
    for (i = 1; i <= labels_seen; ++i) {
      l = order[i]
      printf "%-10s %7d %7d %7d %8d %10.1f\n", l, cases[l], by[l, "passed"], by[l, "failed"],
             by[l, "skipped"], total_time[l]
    }
    printf "%-10s %7d %7d %7d %8d %10.1f\n", "all", n, all["passed"], all["failed"], all["skipped"],
           all_time
    print "(a case is in every label it carries; seconds are per case, summed over parallel runs)"

    # The slowest cases, by selection (n is a few hundred).
    print ""
    print "Slowest cases:"
    for (k = 1; k <= slowest && k <= n; ++k) {
      best = 0
      for (i = 1; i <= n; ++i) if (!(i in shown) && (best == 0 || time_of[i] > time_of[best])) best = i
      shown[best] = 1
      printf "  %8.1f s  %s  [%s]\n", time_of[best], names[best], label_list[names[best]]
    }

    if (all["skipped"] > 0) {
      print ""
      print "Skipped (not passed; the reason is in the output above):"
      for (i = 1; i <= n; ++i) if (outcome_of[i] == "skipped") print "  " names[i]
    }
    if (all["failed"] > 0) {
      print ""
      print "FAILED; to rerun one case alone:"
      for (i = 1; i <= n; ++i) {
        if (outcome_of[i] != "failed") continue
        pattern = names[i]
        gsub(/[][\\.^$*+?(){}|]/, "\\\\&", pattern)
        print "  " names[i]
        print "    ctest --test-dir " build_dir " -R \047^" pattern "$\047 --output-on-failure"
        if (command_of[names[i]] != "") print "    " command_of[names[i]]
      }
    }
  }' "$registry" "$JUNIT"
