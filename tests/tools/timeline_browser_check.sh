#!/usr/bin/env bash
# The timeline page in a real browser (ctest timeline_browser*): cucache-replay --timeline writes
# the page of TRACE, headless Chromium loads it (--dump-dom), and the check requires that the page
# rendered with no errors (its window.onerror / console.error hook writes into #errors and the
# body's data-status) and shows the reserved peak the same replay printed with --json, exactly;
# then it saves a screenshot. Exit 77 (skipped) when no Chromium is installed.
# Usage: timeline_browser_check.sh REPLAY_BIN TRACE WORK_DIR [--config ...]
set -euo pipefail
replay=$1 trace=$2 work=$3
shift 3
browser=${CUCACHE_CHROMIUM:-}
if [[ -z $browser ]]; then
  for b in chromium chromium-browser google-chrome; do
    if command -v "$b" >/dev/null; then browser=$(command -v "$b"); break; fi
  done
fi
if [[ -z $browser ]]; then
  echo "SKIP: no chromium to load the page with (apt package chromium; tools/install_deps.sh --tests installs it)"
  exit 77
fi
name=$(basename "$trace")
name=${name%.gz}
name=${name%.csv}
mkdir -p "$work"
page=$work/$name.html png=$work/$name.png dom=$work/$name.dom.html
rm -f "$page" "$png" "$dom"

CUCACHE_BACKEND=sim "$replay" --backend sim --json --timeline "$page" "$@" "$trace" \
  >"$work/$name.json" 2>"$work/$name.replay.err"
peak=$(grep -o '"peak_reserved_bytes":[0-9]*' "$work/$name.json" | head -1 | cut -d: -f2)
[[ -n $peak ]] || { echo "FAIL: no peak_reserved_bytes in the --json output"; exit 1; }
[[ -s $page ]] || { echo "FAIL: $page was not written"; exit 1; }

# One profile per run, in the work folder: nothing shared with other runs or the user's.
profile=$work/$name.profile
rm -rf "$profile"
flags=(--headless --no-sandbox --disable-gpu --hide-scrollbars --no-first-run
       --user-data-dir="$profile" --virtual-time-budget=30000 --window-size=1400,1500)
"$browser" "${flags[@]}" --dump-dom "file://$(realpath "$page")" >"$dom" 2>"$work/$name.browser.err"
"$browser" "${flags[@]}" --screenshot="$png" "file://$(realpath "$page")" >/dev/null \
  2>>"$work/$name.browser.err"
rm -rf "$profile"

fail=0
check() {  # check WHAT REGEX: the DOM must match REGEX
  if grep -Eq -- "$2" "$dom"; then echo "ok: $1"; else echo "FAIL: $1 (no match for $2 in $dom)"; fail=1; fi
}
check "the page's script ran to the end without errors" '<body[^>]* data-status="ok"'
check "no error was reported in #errors" '<div id="errors" data-count="0"'
check "the peak shown is the replay's, $peak bytes" "id=\"peak-reserved\" data-bytes=\"$peak\""
grouped=$(printf "%s" "$peak" | rev | sed -E 's/([0-9]{3})/\1,/g; s/,$//' | rev)
check "the peak's text reads $grouped bytes" ">$grouped bytes<"
# A trace that sleeps tags (docs/timeline.md, "Sleep and wake"): the sleeping series is offered
# among the "all" group's series and the sleep and wake lanes are drawn.
if grep -q '"sleeps":[1-9]' "$work/$name.json"; then
  check "the sleeping series is offered" '<input type="checkbox"[^>]*><span class="swatch"[^>]*></span>sleeping</label>'
else
  # ... and not on a trace that never sleeps (it would be zero throughout).
  if grep -Eq '</span>sleeping</label>' "$dom"; then
    echo "FAIL: the sleeping series is offered on a trace that never sleeps"
    fail=1
  else
    echo "ok: no sleeping series on a trace that never sleeps"
  fi
fi
# The series picker: one row per group, each metric in its own column (the page checks the
# boxes' positions and reports a misplaced one in #errors, checked above); every group offers
# requested, allocated and reserved.
for metric in requested allocated reserved; do
  rows=$(grep -o "data-metric=\"$metric\"" "$dom" | wc -l)
  groups=$(grep -o '<div class="group"' "$dom" | wc -l)
  if ((rows == groups && rows > 0)); then
    echo "ok: $metric offered in each of the $groups groups"
  else
    echo "FAIL: $metric offered $rows times for $groups groups"
    fail=1
  fi
done
if grep -q 'id="errors"' "$dom"; then
  sed -n 's/.*<div id="errors"[^>]*>\([^<]*\(<div>[^<]*<\/div>\)*\).*/\1/p' "$dom" | head -c 2000
fi
if [[ -s $png ]] && [[ $(head -c 8 "$png" | od -An -tx1 | tr -d ' \n') == 89504e470d0a1a0a ]]; then
  echo "ok: screenshot $png ($(stat -c %s "$png") bytes)"
else
  echo "FAIL: no PNG screenshot at $png"
  fail=1
fi
exit $fail
