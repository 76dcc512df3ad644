#!/usr/bin/env bash
# Shows that every check of the torture and demo verdicts can fail. Each patch in
# scripts/sabotage/ plants one deliberate bug in the library or in the simulation's
# adapters (its name says which check should catch it); this applies each to a scratch
# worktree of HEAD, builds the tool, runs a short torture and a small demo, and reports
# whether that check failed and the
# run exited non-zero. Exit status 1 if any planted bug went unnoticed.
#
#   scripts/sabotage.sh        # every patch (about a minute each on 2 cores)
#   scripts/sabotage.sh 03     # only patches whose name contains "03"
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
work=$(mktemp -d)
export CARGO_TARGET_DIR="$root/target/sabotage"
cleanup() {
    git -C "$root" worktree remove --force "$work/tree" >/dev/null 2>&1 || true
    rm -rf "$work"
}
trap cleanup EXIT

# The value of a numeric field in a JSON line.
field() { sed -n "s/.*\"$2\":\([0-9]*\).*/\1/p" <<<"$1"; }

missed=0
printf '%-28s %-8s %-26s %s\n' patch harness check result
for patch in scripts/sabotage/*"${1:-}"*.patch; do
    name=$(basename "$patch" .patch)
    check=${name#??-}
    git worktree add -q --detach "$work/tree" HEAD
    git -C "$work/tree" apply "$root/$patch"
    cargo build -q --release --manifest-path "$work/tree/Cargo.toml" --bin outbox
    bin="$CARGO_TARGET_DIR/release/outbox"
    for harness in torture demo; do
        if [ "$harness" = torture ]; then
            args=(torture --kills 30 --seed 5 --settle-timeout 20s)
        else
            args=(demo --json --replies 600 --chats 60 --crashes 2 --seed 3 --settle-timeout 20s)
        fi
        line=$("$bin" "${args[@]}" 2>/dev/null | tail -n 1) && rc=0 || rc=$?
        key=$check
        [ "$harness" = demo ] && case $check in
            unexplained_duplicates) key=duplicates_unexplained ;;
            uncertain_left) key=uncertain ;;
        esac
        if [ "$check" = max_uncertain_per_kill ]; then
            held=$(field "$line" max_uncertain_per_kill)
            bound=$(field "$line" max_sends_in_flight)
            value="$held > $bound"
            failed=$([ -n "$held" ] && [ "$held" -gt "$bound" ] && echo yes || echo no)
        else
            value=$(field "$line" "$key")
            failed=$([ -n "$value" ] && [ "$value" -gt 0 ] && echo yes || echo no)
        fi
        if [ "$failed" = yes ] && [ "$rc" -ne 0 ]; then
            result="caught: $key = $value, exit $rc"
        else
            result="MISSED: $key = ${value:-?}, exit $rc"
            missed=1
        fi
        printf '%-28s %-8s %-26s %s\n' "$name" "$harness" "$key" "$result"
    done
    git worktree remove --force "$work/tree"
done
exit $missed
