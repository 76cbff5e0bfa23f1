#!/usr/bin/env bash
# Features add up (docs/architecture.md, "Features"): each feature of outbox-core and of
# the `outbox` facade builds alone, and code written for one database keeps compiling
# whatever else the build turns on. Lints as CI's clippy step does; no services needed.
#
# - outbox-rs-core: no feature at all (what a broker crate compiles against), then each
#   feature alone;
# - outbox: each database and each broker alone (Kafka with `kafka-ssl`, the librdkafka
#   the rest of CI builds: outbox-kafka's code does not depend on it, and a second
#   librdkafka build would cost minutes);
# - the quick-start (SQLite, `Outbox<Sqlite>`) as a new project built with the facade's
#   `sqlite` and `macros` only, and run. The workspace builds the same file with
#   `postgres` on as well (outbox-examples), so both sides of "additive" are compiled.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
cd "$repo"
target="${CARGO_TARGET_DIR:-$repo/target}"

lint() {
  local started=$SECONDS
  cargo clippy --quiet --locked "$@" -- -D warnings
  echo "feature-check: ok ($((SECONDS - started)) s): $*"
}

# What each choice compiles: a user of another database, with every broker, gets neither
# PostgreSQL's driver nor the replication client; PostgreSQL without WAL mode, no
# replication client; MySQL without `mysql-rsa`, not the `rsa` crate (an advisory without
# a fix, docs/dependencies.md).
compiles() { cargo tree --locked -e normal -p outbox --no-default-features --features "$1" --prefix none | cut -d' ' -f1 | sort -u; }
for f in "mysql,sqlite,kafka,nats,rabbitmq" "postgres,kafka,nats,rabbitmq,tls-rustls"; do
  for unwanted in sqlx-postgres pgwire-replication rsa; do
    if [ "$unwanted" = sqlx-postgres ] && [[ "$f" == postgres* ]]; then continue; fi
    if compiles "$f" | grep -qx "$unwanted"; then
      case "$unwanted" in
        sqlx-postgres) needs=postgres ;;
        pgwire-replication) needs=wal ;;
        *) needs=mysql-rsa ;;
      esac
      echo "feature-check: outbox with features $f compiles $unwanted, which only $needs needs:" >&2
      cargo tree --locked -e normal,features -p outbox --no-default-features --features "$f" -i "$unwanted" >&2 || true
      exit 1
    fi
  done
done
echo "feature-check: ok: no PostgreSQL driver without \`postgres\`, no replication client without \`wal\`, no rsa without \`mysql-rsa\`"

lint -p outbox-rs-core --no-default-features
for f in postgres wal mysql sqlite macros tls-rustls opentelemetry schema; do
  lint -p outbox-rs-core --no-default-features --features "$f"
done
for f in postgres wal mysql sqlite kafka-ssl nats rabbitmq; do
  lint -p outbox --no-default-features --features "$f"
done

# The README's demo command (`cargo run -p outbox-examples --example quickstart`) resolves
# the examples' own features; CI runs the quick-start the test build made.
# The command without any broker (it parses `outbox relay` and refuses to run it).
lint -p outbox-cli --no-default-features

lint -p outbox-examples --example quickstart

started=$SECONDS
project="$target/feature-check-sqlite"
rm -rf "$project"
mkdir -p "$project/src"
cat > "$project/Cargo.toml" <<TOML
[package]
name = "feature-check-sqlite"
version = "0.0.0"
edition = "2024"
publish = false

[dependencies]
outbox = { path = "$repo/outbox", default-features = false, features = ["sqlite", "macros"] }
tokio = { version = "1", features = ["full"] }
serde = { version = "1", features = ["derive"] }
thiserror = "2"
serde_json = "1"

[workspace]
TOML
cp "$repo/Cargo.lock" "$project/Cargo.lock"
cp examples/examples/quickstart.rs "$project/src/main.rs"
(cd "$project" && CARGO_TARGET_DIR="$target" cargo run --quiet >/dev/null)
echo "feature-check: ok ($((SECONDS - started)) s): the quick-start built and ran with outbox's \`sqlite\` and \`macros\` alone"
