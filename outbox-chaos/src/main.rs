//! `outbox-chaos`: a ledger-checked chaos rig for the outbox, built on the public API.
//!
//! ```text
//! outbox-chaos run [--broker kafka|nats] [--fault all|relay-kill,...] [--seed N] [--short] [--wal]
//! ```
//!
//! Each fault gets a run of its own: writers commit `(key, n)` events with their business
//! row, two relays (OS processes) publish them through a fault-injecting proxy, a consumer
//! (an OS process) applies them through the inbox, and the ledger counts lost events and
//! per-key order violations after deduplication. Any loss or violation fails the run
//! (exit code 1). See `docs/reliability.md`.
//!
//! Needs the services of `scripts/services.sh` (PostgreSQL; `TANSU_BIN` for Kafka;
//! `nats-server` for NATS).

mod ledger;
mod procs;
mod rig;

use std::process::ExitCode;

/// A statement built at run time from the rig's own schema and table names (sqlx 0.9
/// asks every statement that is not a literal to say so).
fn trusted_sql(statement: impl Into<String>) -> sqlx::AssertSqlSafe<String> {
    sqlx::AssertSqlSafe(statement.into())
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(4)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("outbox-chaos: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let rest = args.get(1..).unwrap_or_default();
    let result = runtime.block_on(async {
        match args.first().map(String::as_str) {
            Some("run") => rig::main(rest).await,
            Some("relay") => procs::relay(rest).await,
            Some("consume") => procs::consume(rest).await,
            _ => Err(format!(
                "usage: outbox-chaos run [--broker kafka|nats] [--fault all|{}] [--seed N] [--short] [--wal]",
                rig::FAULTS.join("|")
            )),
        }
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("outbox-chaos: {e}");
            ExitCode::FAILURE
        }
    }
}
