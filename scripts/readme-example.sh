#!/usr/bin/env bash
# The README's example, as a new project would build it: a crate outside this workspace
# that depends on the `outbox` crate alone (by path, feature `kafka`), runs the example
# against PostgreSQL (database `app`) and the Kafka-protocol broker, and checks that its
# event was written. Needs scripts/services.sh first.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
target="${CARGO_TARGET_DIR:-$repo/target}"
project="$target/readme-example"
rm -rf "$project"
mkdir -p "$project/src"

cat > "$project/Cargo.toml" <<TOML
[package]
name = "readme-example"
version = "0.0.0"
edition = "2024"
publish = false

[dependencies]
outbox = { path = "$repo/outbox", features = ["kafka"] }
tokio = { version = "1", features = ["full"] }
serde = { version = "1", features = ["derive"] }
thiserror = "2"

# A workspace of its own (its folder is below this repository's).
[workspace]
TOML
# The versions this repository is tested with.
cp "$repo/Cargo.lock" "$project/Cargo.lock"

# The README's first Rust block, and a main that runs it.
awk '/^```rust$/ { if (!done) on = 1; next } /^```$/ { if (on) { on = 0; done = 1 } next } on' \
  "$repo/README.md" > "$project/src/main.rs"
[ -s "$project/src/main.rs" ] || { echo "readme-example: no \`\`\`rust block in README.md" >&2; exit 1; }
cat >> "$project/src/main.rs" <<'RUST'

#[tokio::main]
async fn main() -> Result<(), AppError> {
    run().await?;
    let outbox = Outbox::connect("postgres://postgres@127.0.0.1/app").await?;
    invoice(outbox).await
}
RUST

export PGOPTIONS="-c client_min_messages=warning"
psql=(psql -X -q -v ON_ERROR_STOP=1 -h 127.0.0.1 -U postgres)
"${psql[@]}" -d postgres -c "DROP DATABASE IF EXISTS app WITH (FORCE)" -c "CREATE DATABASE app"
"${psql[@]}" -d app -c "CREATE TABLE orders (id bigint PRIMARY KEY, status text NOT NULL)" \
  -c "INSERT INTO orders VALUES (42, 'new')" \
  -c "CREATE TABLE invoices (order_id bigint PRIMARY KEY)"

# The example's topic, provisioned as an operator would (the publisher checks at start that
# every destination has a topic, and a fresh broker has none).
tansu="${TANSU_BIN:-${OUTBOX_TOOLS_DIR:-$HOME/.cache/outbox-tools}/tansu}"
[ -x "$tansu" ] || { echo "readme-example: no tansu binary at $tansu; run scripts/services.sh first" >&2; exit 1; }
kafka="${KAFKA_ADDR:-127.0.0.1:9092}"
if ! "$tansu" topic list --broker "tcp://$kafka" 2>/dev/null | grep -q '"name":"orders.events"'; then
  "$tansu" topic create orders.events --broker "tcp://$kafka" --partitions 3 >/dev/null
fi

(cd "$project" && CARGO_TARGET_DIR="$target" cargo run --quiet)

status=$("${psql[@]}" -d app -At -c "SELECT status FROM orders WHERE id = 42")
events=$("${psql[@]}" -d app -At -c "SELECT count(*) FROM outbox WHERE event_type = 'OrderConfirmed'")
if [ "$status" != confirmed ] || [ "$events" != 1 ]; then
  echo "readme-example: expected order 42 confirmed and 1 OrderConfirmed event; found status '$status', $events events" >&2
  exit 1
fi
echo "readme-example: the README's example ran through the \`outbox\` crate alone: order confirmed, 1 event written"
