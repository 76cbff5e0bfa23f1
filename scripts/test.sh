#!/usr/bin/env bash
# Runs the whole test suite against the real services (started if needed).
# This is the command the README gives; CI runs exactly this.
set -euo pipefail
cd "$(dirname "$0")/.."
eval "$(scripts/services.sh)"
cargo test --workspace "$@"
