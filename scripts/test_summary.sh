#!/usr/bin/env bash
# Prints a readable summary of a CTest run: cases per label (passed, failed, skipped, seconds), the
# slowest cases, and for each failed case the command lines that rerun it alone.
#   bash scripts/test_summary.sh BUILD_DIR JUNIT_XML
# JUNIT_XML is what `ctest --output-junit` wrote: one result per CTest entry. An entry of a
# GoogleTest executable runs the cases of one test file and writes GoogleTest's XML report
# (--gtest_output=xml:FILE in its command); the cases are counted from those reports, and the
# cases its --gtest_filter names that have no passing result there (the entry crashed, timed out or
# never ran them) count as failed. An entry without a report of its own (the fuzzer) is one case.
# Labels and commands come from `ctest -N -V`. A skipped case is counted as skipped, never as
# passed. Needs only bash, awk and ctest.
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
  # The value of a --name=VALUE argument in a command line as ctest -N -V prints it.
  function argument(command, name,    rest) {
    if (!match(command, "--" name "=[^\" ]*")) return ""
    return substr(command, RSTART + length(name) + 3, RLENGTH - length(name) - 3)
  }
  function add_case(name, entry, outcome, seconds) {
    names[++n] = name; entry_of[n] = entry; outcome_of[n] = outcome; time_of[n] = seconds
  }
  # The cases of one entry: from its GoogleTest report, then every case its filter names that
  # the report does not show as run (failed: the process died or never ran it).
  function add_entry_cases(entry, entry_outcome, entry_seconds,
                           command, report, filter, count, parts, i, line, name, outcome, seconds, seen) {
    command = command_of[entry]
    report = argument(command, "gtest_output")
    sub(/^xml:/, "", report)
    filter = argument(command, "gtest_filter")
    if (report == "" || filter == "") {
      add_case(entry, entry, entry_outcome, entry_seconds)
      return
    }
    name = ""
    while ((getline line < report) > 0) {
      if (line ~ /<testcase /) {
        if (name != "") add_case(name, entry, outcome, seconds)
        name = unescape(attribute(line, "classname")) "." unescape(attribute(line, "name"))
        seconds = attribute(line, "time") + 0
        outcome = attribute(line, "result") == "skipped" ? "skipped" : "passed"
        if (attribute(line, "status") != "run") outcome = "failed"
        seen[name] = 1
      } else if (line ~ /<failure /) {
        outcome = "failed"
      }
    }
    close(report)
    if (name != "") add_case(name, entry, outcome, seconds)
    count = split(filter, parts, ":")
    for (i = 1; i <= count; ++i) {
      if (parts[i] in seen) continue
      add_case(parts[i], entry, "failed", 0)
      unreported[n] = 1
    }
  }
  FILENAME == ARGV[1] { label_list[$1] = $2; command_of[$1] = $3; next }
  /<testcase / {
    entry = unescape(attribute($0, "name")); entry_time = attribute($0, "time") + 0
    status = attribute($0, "status")
    entries[++entry_count] = entry; entry_time_of[entry_count] = entry_time; entry_status[entry_count] = status
  }
  /<skipped / { entry_skip[entry_count] = unescape(attribute($0, "message")) }
  END {
    for (e = 1; e <= entry_count; ++e) {
      # notrun is a skip only when the entry asked for it (SKIP_REGULAR_EXPRESSION,
      # SKIP_RETURN_CODE); otherwise it did not run at all (a missing program): a failure.
      if (entry_status[e] == "run") outcome = "passed"
      else if (entry_status[e] == "notrun" && entry_skip[e] ~ /^SKIP_/) outcome = "skipped"
      else outcome = "failed"
      entry_outcome[entries[e]] = outcome
      add_entry_cases(entries[e], outcome, entry_time_of[e])
    }
    for (i = 1; i <= n; ++i) {
      labels = label_list[entry_of[i]]
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
    printf "(%d CTest entries, one per test file; a case is in every label of its entry; seconds are\n", entry_count
    print " per case, summed over entries run in parallel)"

    # The slowest cases, by selection (n is a few hundred).
    print ""
    print "Slowest cases:"
    for (k = 1; k <= slowest && k <= n; ++k) {
      best = 0
      for (i = 1; i <= n; ++i) if (!(i in shown) && (best == 0 || time_of[i] > time_of[best])) best = i
      shown[best] = 1
      printf "  %8.1f s  %s  [%s]\n", time_of[best], names[best], entry_of[best]
    }

    if (all["skipped"] > 0) {
      print ""
      print "Skipped (not passed; the reason is in the output above):"
      for (i = 1; i <= n; ++i) if (outcome_of[i] == "skipped") print "  " names[i] "  [" entry_of[i] "]"
    }
    if (all["failed"] > 0) {
      print ""
      print "FAILED; to rerun one case alone:"
      for (i = 1; i <= n; ++i) {
        if (outcome_of[i] != "failed") continue
        entry = entry_of[i]
        print "  " names[i] "  [" entry "]" (i in unreported ? " (no result: the entry " \
              (entry_outcome[entry] == "failed" ? "failed, crashed or timed out" : "did not run it") ")" : "")
        pattern = entry
        gsub(/[][\\.^$*+?(){}|]/, "\\\\&", pattern)
        print "    ctest --test-dir " build_dir " -R \047^" pattern "$\047 --output-on-failure"
        command = command_of[entry]
        if (argument(command, "gtest_filter") != "") {
          labels = label_list[entry]
          gsub(/ /, ",", labels)
          program = command
          sub(/ .*/, "", program)
          print "    SHARDIT_TEST_LABELS=" labels " " program " --gtest_filter=\047" names[i] "\047"
        } else if (command != "") {
          print "    " command
        }
      }
    }
  }' "$registry" "$JUNIT"
