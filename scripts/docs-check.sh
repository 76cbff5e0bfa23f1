#!/usr/bin/env bash
# The API docs as docs.rs builds them (`--cfg docsrs`, the features in the facade's
# [package.metadata.docs.rs]), with every rustdoc warning an error: a broken or private
# intra-doc link, a bad code block. `RUSTC_BOOTSTRAP=1` lets the stable toolchain take
# the nightly-only `doc_cfg` that docs.rs uses.
set -euo pipefail
cd "$(dirname "$0")/.."
features=$(python3 -c '
import tomllib
meta = tomllib.load(open("outbox/Cargo.toml", "rb"))["package"]["metadata"]["docs"]["rs"]
print(" ".join("outbox/" + f for f in meta["features"]))')
echo "docs-check: features $features"
RUSTC_BOOTSTRAP=1 RUSTDOCFLAGS="--cfg docsrs -D warnings" cargo doc --quiet --locked --no-deps \
  -p outbox -p outbox-rs-core -p outbox-rs-macros -p outbox-rs-kafka -p outbox-rs-nats -p outbox-rs-rabbitmq \
  --features "$features"
echo "docs-check: ok: the docs of every published crate build as docs.rs builds them, without a warning"
