#!/usr/bin/env python3
"""The rules of docs/architecture.md that a script can check (CI runs it):

1. No cycle among the files of any crate of the workspace
   (`../shared/tools/modcycles.py --files <crate>/src` reports 0 cycles).
2. No neutral module of outbox-core names a PostgreSQL type. Neutral: every file of
   outbox-core/src except PostgreSQL's wing (db/postgres/), its public face (postgres.rs)
   and the files that exist only for it (doctor/postgres.rs, config/moved.rs). A neutral
   file may name one only in an item that exists only with the `postgres` feature (a
   `#[cfg(feature = "postgres")]` on the item or on a block around it): a report's
   PostgreSQL-only field, a deprecated path kept for one release.

Exits 1 and says where, if a rule is broken.
"""

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODCYCLES = os.path.join(ROOT, "..", "shared", "tools", "modcycles.py")
CRATES = [
    "outbox",
    "outbox-core",
    "outbox-macros",
    "outbox-kafka",
    "outbox-nats",
    "outbox-rabbitmq",
    "outbox-cli",
    "outbox-bench",
    "outbox-chaos",
    "examples",
    "tests",
]
CORE = os.path.join(ROOT, "outbox-core", "src")
POSTGRES_ONLY = ["db/postgres/", "postgres.rs", "doctor/postgres.rs", "config/moved.rs"]
# A PostgreSQL type, by path or by the name of one of the wing's public types.
PG = re.compile(
    r"\bsqlx::postgres\b|\bsqlx::Postgres\b|\bPostgres\b|\bPg[A-Z]\w*|\bdb::postgres\b"
    r"|\bcrate::postgres\b|\boutbox_core::postgres\b"
    r"|(?<!::)\b(?:Wal|SlotStatus|Slot|PartitionInterval|Partitioned|PartitionReport|Health"
    r"|OpenWriter|RelayInstance|ReplicationSlot)\b"
)
CFG_PG = re.compile(r'#\[cfg\((?:all\()?[^\]]*feature\s*=\s*"postgres"')


def cycles():
    bad = []
    for crate in CRATES:
        src = os.path.join(ROOT, crate, "src")
        if not os.path.isdir(src):
            continue
        out = subprocess.run(
            [sys.executable, MODCYCLES, "--files", src], capture_output=True, text=True
        )
        if out.returncode != 0:
            bad.append(f"{crate}/src: {out.stdout.strip() or out.stderr.strip()}")
    return bad


def code_lines(path):
    """The file's lines with comments and string literals blanked (a message may say
    "PostgreSQL"); test code (from `#[cfg(test)]`) left out."""
    lines = []
    for line in open(path, encoding="utf-8").read().split("\n"):
        if line.strip().startswith("#[cfg(test)]"):
            break
        if line.strip().startswith("//"):
            lines.append("")
            continue
        line = re.sub(r'"(?:[^"\\]|\\.)*"', '""', line)
        lines.append(line.split("//")[0])
    return lines


def gated_lines(lines, raw):
    """Which lines belong to an item under `#[cfg(feature = "postgres")]`: from the
    attribute to the end of the item (its `;` or `,`, or the `}` closing its block)."""
    gated = [False] * len(lines)
    depth = 0
    parens = 0
    pending = False  # a postgres cfg was seen; its item has not started yet
    gate = None  # (depth at the item's start, whether its block was entered)
    in_attribute = False
    for i, line in enumerate(lines):
        text = line.strip()
        attribute = in_attribute or text.startswith("#[")
        if attribute:
            in_attribute = not text.endswith("]")
            if CFG_PG.search(raw[i]) and gate is None:
                pending = True
            if pending or gate is not None:
                gated[i] = True
            continue
        if not text:
            if gate is not None or pending:
                gated[i] = True
            continue
        if pending:
            gate = (depth, False)
            pending = False
        if gate is not None:
            gated[i] = True
        depth += text.count("{") - text.count("}")
        parens += text.count("(") + text.count("[") - text.count(")") - text.count("]")
        if gate is not None:
            start, entered = gate
            entered = entered or depth > start
            gate = (start, entered)
            if depth <= start and parens <= 0 and (entered or text.endswith((";", ",", "}"))):
                gate = None
    return gated


def neutral_names():
    bad = []
    for folder, _, files in os.walk(CORE):
        for name in sorted(files):
            if not name.endswith(".rs"):
                continue
            path = os.path.join(folder, name)
            rel = os.path.relpath(path, CORE).replace(os.sep, "/")
            if any(rel == p or rel.startswith(p) for p in POSTGRES_ONLY if p.endswith("/")) or rel in POSTGRES_ONLY:
                continue
            raw = open(path, encoding="utf-8").read().split("\n")
            lines = code_lines(path)
            gated = gated_lines(lines, raw)
            for i, line in enumerate(lines):
                m = PG.search(line)
                if m and not gated[i]:
                    bad.append(f"outbox-core/src/{rel}:{i + 1}: names `{m.group(0)}`: {raw[i].strip()}")
    return bad


def main():
    problems = cycles()
    for p in problems:
        print(f"module cycle: {p}")
    names = neutral_names()
    for n in names:
        print(f"neutral module names a PostgreSQL type: {n}")
    if names:
        print(
            "  -> move it into db/postgres/ (public through postgres.rs), or gate the item "
            'with #[cfg(feature = "postgres")] if it is a report field or a deprecated path'
        )
    if problems or names:
        sys.exit(1)
    print(f"architecture: 0 cycles in {len(CRATES)} crates; no neutral module names a PostgreSQL type")


if __name__ == "__main__":
    main()
