#!/usr/bin/env bash
# Runs the whole test suite against the real services (started if needed).
# This is the command the README gives; CI runs exactly this.
set -euo pipefail
cd "$(dirname "$0")/.."
eval "$(scripts/services.sh)"
log=$(mktemp)
trap 'rm -f "$log"' EXIT
status=0
# --no-fail-fast: one failing test binary must not hide the results of the later ones.
# outbox-rs-core/schema (the outbox-core folder): the contract module's own tests, whatever other crates enable.
cargo test --workspace --no-fail-fast --features outbox-rs-core/schema "$@" 2>&1 | tee "$log" || status=$?
# One closing line for the whole run (cargo prints one per test binary).
awk '/^test result:/ { p += $4; f += $6; i += $8 } END { printf "tests: %d passed, %d failed, %d skipped\n", p, f, i }' "$log"
exit "$status"
