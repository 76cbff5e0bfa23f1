#!/usr/bin/env bash
# What a registry would get: every published crate packaged and built from its .crate
# alone, in dependency order (`cargo publish --workspace --dry-run`: the crates not yet on
# the registry come from a local overlay), and no package shipping a file that cannot
# build outside this workspace (a test of the unpublished test kit, say).
set -euo pipefail
cd "$(dirname "$0")/.."

# "name folder" of every crate that is published.
published=$(cargo metadata --format-version 1 --no-deps | python3 -c '
import json, os, sys
for p in json.load(sys.stdin)["packages"]:
    if p.get("publish") != []:
        print(p["name"], os.path.dirname(p["manifest_path"]))')
echo "package-check: published crates: $(cut -d' ' -f1 <<<"$published" | tr '\n' ' ')"

bad=0
while read -r crate dir; do
  files=$(cargo package --list --allow-dirty -p "$crate")
  for f in $files; do
    case "$f" in
      *.rs)
        if [ -f "$dir/$f" ] && grep -q 'outbox_tests\b' "$dir/$f"; then
          echo "package-check: $crate ships $f, which needs the unpublished test kit (outbox_tests): leave it out with \`include\`/\`exclude\` in $crate's Cargo.toml" >&2
          bad=1
        fi ;;
    esac
  done
  for need in Cargo.toml README.md LICENSE-MIT LICENSE-APACHE; do
    if ! grep -qx "$need" <<<"$files"; then
      echo "package-check: $crate does not ship $need" >&2
      bad=1
    fi
  done
done <<<"$published"
[ "$bad" = 0 ] || exit 1

cargo publish --workspace --dry-run --locked
