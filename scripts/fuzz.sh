#!/usr/bin/env bash
# Builds the fuzz targets in fuzz/ and runs each for a bounded time (docs/reliability.md).
#
#   scripts/fuzz.sh                  every target, OUTBOX_FUZZ_SECONDS (default 30) each,
#                                    OUTBOX_FUZZ_JOBS (default: the cores) at a time
#   scripts/fuzz.sh mask_sql         one target
#
# Stable Rust: libFuzzer (libfuzzer-sys) with the coverage instrumentation cargo-fuzz
# would ask rustc for, no sanitizer (the code is safe Rust; a target fails on a panic,
# a wrong answer it asserts, or an input that runs longer than OUTBOX_FUZZ_TIMEOUT).
# Every target runs; the script fails if any crashed, leaving the input in
# $OUTBOX_FUZZ_ARTIFACTS and the log.
# Each target starts from its committed seeds in fuzz/seeds/<target>/; what it finds
# goes to a scratch corpus, not into the repository.
set -euo pipefail
cd "$(dirname "$0")/.."

seconds="${OUTBOX_FUZZ_SECONDS:-30}"
timeout="${OUTBOX_FUZZ_TIMEOUT:-10}"
triple="$(rustc -vV | sed -n 's/^host: //p')"
# Instrumented code goes to a target folder of its own: its flags differ from the CI build's.
export CARGO_TARGET_DIR="${OUTBOX_FUZZ_TARGET_DIR:-$HOME/.cache/outbox-fuzz-target}"
export RUSTFLAGS="--cfg fuzzing -Cpasses=sancov-module -Cllvm-args=-sanitizer-coverage-level=4 \
-Cllvm-args=-sanitizer-coverage-inline-8bit-counters -Cllvm-args=-sanitizer-coverage-pc-table \
-Cllvm-args=-sanitizer-coverage-trace-compares -Cdebug-assertions -Coverflow-checks"
artifacts="${OUTBOX_FUZZ_ARTIFACTS:-$CARGO_TARGET_DIR/artifacts}"
work="$CARGO_TARGET_DIR/corpus"

targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then
    mapfile -t targets < <(cd fuzz/fuzz_targets && ls ./*.rs | sed 's|^\./||; s|\.rs$||')
fi

echo "== fuzz: building ${#targets[@]} targets ($triple, stable, no sanitizer)"
# --target: the instrumentation applies to the targets, not to build scripts and macros.
cargo build --manifest-path fuzz/Cargo.toml --release --locked --target "$triple" \
    $(printf -- '--bin %s ' "${targets[@]}")
echo "== fuzz: built in $SECONDS s"

# One libFuzzer process per core (each is single-threaded): the same time per target,
# in a fraction of the wall time.
jobs="${OUTBOX_FUZZ_JOBS:-$(nproc)}"
fuzz_one() { # target: its result goes to its summary, printed when it is reaped
    local target="$1" log="$artifacts/$1/log.txt"
    if "$CARGO_TARGET_DIR/$triple/release/$target" "$work/$target" "fuzz/seeds/$target" \
        -max_total_time="$seconds" -timeout="$timeout" -rss_limit_mb=2048 -max_len=4096 \
        -print_final_stats=1 -artifact_prefix="$artifacts/$target/" >"$log" 2>&1; then
        runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log")
        cover=$(grep -o 'cov: [0-9]*' "$log" | tail -1)
        echo "== fuzz: $target ran ${seconds}s: ok: $runs executions, $cover"
    else
        echo "== fuzz: $target ran ${seconds}s: CRASH (the input and the log are in $artifacts/$target/):"
        grep -E "panicked at|assertion|ERROR: libFuzzer|Test unit written|SUMMARY" "$log" | head -20 | sed 's/^/   /'
        return 1
    fi
}

failed=()
declare -A running=()
# Waits for one target to end and prints its summary whole (two targets never interleave).
reap() {
    local done_pid
    wait -n -p done_pid || failed+=("${running[$done_pid]}")
    cat "$artifacts/${running[$done_pid]}/summary.txt"
    unset "running[$done_pid]"
}
for target in "${targets[@]}"; do
    mkdir -p "$work/$target" "$artifacts/$target"
    while [ ${#running[@]} -ge "$jobs" ]; do reap; done
    fuzz_one "$target" >"$artifacts/$target/summary.txt" &
    running[$!]="$target"
done
while [ ${#running[@]} -gt 0 ]; do reap; done
if [ ${#failed[@]} -gt 0 ]; then
    echo "== fuzz: FAILED: ${failed[*]}; reproduce with" \
        "\"$CARGO_TARGET_DIR/$triple/release/<target>\" <the crash file>, then make it a regression test"
    exit 1
fi
echo "== fuzz: every target ran ${seconds}s without a crash"
