#!/usr/bin/env bash
# Runs the peer benchmarks of ../shared/peers on this checkout with
# harness-1.0-api.patch applied to a copy of the harness (the shared one is read-only).
#
# The harness's outbox bench was written against the 0.x API: it reads
# `StorageSettings::foreign_keys` (gone: no foreign key is declared, so the pragma is
# no longer set), `BACKGROUND_AUTOCHECKPOINT_PAGES` at the crate root (now an associated
# constant of `StorageSettings`) and `count(*)` of `messages` (the crate's history is
# `outbound_messages` since schema 3), and enqueues its batches through `enqueue_in`
# (now `Outbox::enqueue_batch`); it also mirrors the writer's page cache in its notes
# (16 MiB now, not 32). The patch changes exactly those lines.
#
#   scripts/peers/run.sh                                  # every system, 3 reps
#   SYSTEMS="raw honker outbox" scripts/peers/run.sh      # as ../shared/peers/run.sh
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
peers="${PEERS:-$root/../shared/peers}"
copy="$(mktemp -d)"
trap 'rm -rf "$copy"' EXIT
cp -r "$peers/." "$copy/"
chmod -R u+w "$copy"
patch -s -d "$copy" -p1 < "$here/harness-1.0-api.patch"
PROJECT="$root" PEERS_WORK="${PEERS_WORK:-$root/target/peers}" "$copy/run.sh" "$@"
