//! What each command does: connect, call `outbox_core::admin` (or migrate, or retention),
//! print the result.

use std::future::Future;
use std::io::{self, Write};
use std::path::Path;

use outbox_core::admin::{Admin, ListFilter, MessageInfo, MessageState, Status};
use outbox_core::config::percent_decoded;
use outbox_core::doctor::{Doctor, Limits, Report};
use outbox_core::postgres::SlotStatus;
use outbox_core::retention::Retention;
use outbox_core::sqlx::{Database as _, MySql, Postgres, Sqlite};
use outbox_core::{Backend, Outbox, OutboxBuilder, TableName};

use crate::cli::{Cli, Command, Filter, SlotCommand};
use crate::failure::{Failure, Result};
use outbox_core::admin::human_duration as human;

/// Runs the command, writing its output to `out`: connects to the database the URL's
/// scheme names, then does the same on each.
pub async fn run(cli: Cli, out: &mut impl Write) -> Result {
    // Names first: a typo is reported without touching the database.
    TableName::parse("outbox table name", &cli.table)?;
    if let Some(name) = &cli.processed_table {
        TableName::parse("processed-messages table name", name)?;
    }
    let url = cli
        .database_url
        .clone()
        .filter(|u| !u.trim().is_empty())
        .ok_or_else(|| {
            Failure::Message(
                "no database given; set DATABASE_URL or pass --database-url \
                 (postgres://user@host:5432/db, mysql://user@host:3306/db or sqlite://path/to/app.db)"
                    .to_owned(),
            )
        })?;
    let scheme = url.split_once(':').map_or("", |(scheme, _)| scheme);
    // The schemes each driver accepts, as sqlx declares them.
    let is = |schemes: &[&str]| schemes.contains(&scheme);
    let wal = cli.wal || cli.wal_slot.is_some();
    if !is(Postgres::URL_SCHEMES) && matches!(cli.command, Command::Partition { .. }) {
        return Err(Failure::Message(
            "`outbox partition` is PostgreSQL only (MySQL/MariaDB and SQLite keep a plain \
             table; retention deletes their old rows in batches)"
                .to_owned(),
        ));
    }
    if !is(Postgres::URL_SCHEMES) && (wal || matches!(cli.command, Command::Slot { .. })) {
        return Err(Failure::Message(
            "WAL mode (--wal, --wal-slot, `outbox slot`) is PostgreSQL only; \
             give a postgres:// database URL, or drop the option"
                .to_owned(),
        ));
    }
    if is(Postgres::URL_SCHEMES) {
        let slot = cli.wal_slot.clone();
        let outbox: Outbox<Postgres> = connect(&cli, Outbox::connect(&url), |b| match slot {
            Some(slot) => b.wal_slot(slot),
            None if wal => b.wal(),
            None => b,
        })
        .await?;
        if let Command::Slot { command } = &cli.command {
            return slot_command(&cli, outbox, command, out).await;
        }
        if let Command::Partition { interval, yes } = &cli.command {
            return partition_command(outbox, *interval, *yes, cli.json, out).await;
        }
        if let Command::Relay(args) = &cli.command {
            return crate::relay::run_postgres(args, outbox, out).await;
        }
        execute(cli, outbox, out).await
    } else if is(MySql::URL_SCHEMES) {
        let url = mysql_scheme(&url);
        let outbox: Outbox<MySql> = connect(&cli, Outbox::connect_mysql(&url), |b| b).await?;
        execute(cli, outbox, out).await
    } else if is(Sqlite::URL_SCHEMES) {
        sqlite_file_exists(&url, &cli.command)?;
        let outbox: Outbox<Sqlite> = connect(&cli, Outbox::open(&url), |b| b).await?;
        execute(cli, outbox, out).await
    } else {
        Err(Failure::Message(format!(
            "the database URL must start with postgres://, mysql:// (or mariadb://) or sqlite://, \
             not {}; check DATABASE_URL or --database-url",
            shown_scheme(&url)
        )))
    }
}

/// What an error may show of a URL with an unknown scheme: the scheme alone, when it is
/// one (letters, digits, `+`, `-`, `.`); nothing else of the URL, which may hold a password.
fn shown_scheme(url: &str) -> String {
    match url.split_once("://") {
        Some((scheme, _))
            if scheme.starts_with(|c: char| c.is_ascii_alphabetic())
                && scheme
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || "+-.".contains(c)) =>
        {
            format!("{scheme}://")
        }
        _ => "a URL without a scheme (scheme://...)".to_owned(),
    }
}

/// Opening a SQLite file creates it: outside `migrate` a missing file is a wrong path.
fn sqlite_file_exists(url: &str, command: &Command) -> Result {
    let rest = url.trim_start_matches("sqlite:");
    let path = rest.strip_prefix("//").unwrap_or(rest);
    let path = percent_decoded(path.split('?').next().unwrap_or(path));
    if matches!(command, Command::Migrate) || path == ":memory:" || Path::new(&path).exists() {
        return Ok(());
    }
    Err(Failure::Message(format!(
        "no SQLite database at {path}; check the path in DATABASE_URL or --database-url \
         (`outbox migrate` creates the file and its tables)"
    )))
}

/// Asks on the terminal whether to go on (`question`, e.g. "delete them"); without a
/// terminal, or without a yes, fails saying that nothing was `done` (e.g. "deleted").
fn confirm(out: &mut impl Write, json: bool, question: &str, done: &str) -> Result {
    use std::io::{BufRead, IsTerminal};
    if json {
        return Err(Failure::Message(format!(
            "nothing {done}: with --json, give --yes to go ahead (nothing is asked: the \
             question would mix with the JSON)"
        )));
    }
    out.flush()?;
    let stdin = io::stdin();
    if !stdin.is_terminal() {
        return Err(Failure::Message(format!(
            "nothing {done}: this command changes many messages at once; \
             rerun it with --yes to go ahead (or on a terminal, to be asked)"
        )));
    }
    eprint!("{question}? [y/N] ");
    let mut answer = String::new();
    stdin.lock().read_line(&mut answer)?;
    if matches!(answer.trim(), "y" | "Y" | "yes" | "YES" | "Yes") {
        Ok(())
    } else {
        Err(Failure::Message(format!("nothing {done}: not confirmed")))
    }
}

/// sqlx knows MariaDB by the `mysql` scheme: `mariadb://` becomes `mysql://`, and
/// nothing else in the URL changes (a host or user may well be called `mariadb`).
fn mysql_scheme(url: &str) -> String {
    match url.strip_prefix("mariadb:") {
        Some(rest) => format!("mysql:{rest}"),
        None => url.to_owned(),
    }
}

/// What a command did: a line of text, or with `--json` the object `value`.
fn report(
    out: &mut impl Write,
    json: bool,
    text: impl FnOnce() -> String,
    value: serde_json::Value,
) -> Result {
    if json {
        serde_json::to_writer_pretty(&mut *out, &value)?;
        writeln!(out)?;
    } else {
        writeln!(out, "{}", text())?;
    }
    Ok(())
}

async fn execute<DB: Backend>(cli: Cli, outbox: Outbox<DB>, out: &mut impl Write) -> Result {
    let table = outbox.tables().outbox.to_string();
    let admin = Admin::new(outbox.clone());
    let json = cli.json;
    match cli.command {
        // Answered in `main`, before a database is asked for.
        Command::Completions { .. } => {}
        Command::Relay(args) => return crate::relay::run(&args, outbox, out).await,
        Command::Migrate => {
            let applied = outbox.migrate().await?;
            let value = serde_json::json!({ "table": table, "applied": applied });
            report(
                out,
                json,
                || {
                    if applied.is_empty() {
                        format!("{table} is up to date; no migration to apply")
                    } else {
                        let list: Vec<String> = applied.iter().map(i64::to_string).collect();
                        format!("applied migrations {} to {table}", list.join(", "))
                    }
                },
                value,
            )?;
        }
        Command::Doctor {
            oldest_pending,
            open_writer,
            consumer_failing,
            consumer_gone,
            dead_rows,
            slot_wal_mib,
            partitions,
        } => {
            let mut limits = Limits::default()
                .oldest_pending(oldest_pending)
                .open_writer(open_writer)
                .consumer_failing(consumer_failing)
                .consumer_gone(consumer_gone)
                .dead_rows(dead_rows, Limits::default().dead_ratio)
                .slot_retained_bytes(
                    i64::try_from(slot_wal_mib.saturating_mul(1 << 20)).unwrap_or(i64::MAX),
                );
            if let Some(n) = partitions {
                limits = limits.partitions(n);
            }
            let report = Doctor::new(outbox.clone()).limits(limits).examine().await?;
            if json {
                serde_json::to_writer_pretty(&mut *out, &report)?;
                writeln!(out)?;
            } else {
                print_report(out, &report)?;
            }
            if report.needs_action() {
                return Err(Failure::NeedsAction);
            }
        }
        Command::Serve {
            listen,
            token,
            allowed_hosts,
        } => {
            crate::serve::serve(outbox.clone(), listen, token, allowed_hosts, out).await?;
        }
        Command::Status => {
            let status = admin.status().await?;
            if json {
                serde_json::to_writer_pretty(&mut *out, &status)?;
                writeln!(out)?;
            } else {
                print_status(out, &status)?;
            }
        }
        Command::Pending { filter, in_retry } => {
            let mut list_filter = list_filter(filter);
            list_filter.in_retry_only = in_retry;
            let messages = admin.pending(&list_filter).await?;
            print_messages(out, &messages, json, "pending")?;
        }
        Command::Dead { filter } => {
            let messages = admin.dead(&list_filter(filter)).await?;
            print_messages(out, &messages, json, "dead-lettered")?;
        }
        Command::Replay {
            ids,
            since,
            until,
            destination,
            yes,
        } => {
            let n = match (since, until) {
                (Some(since), Some(until)) => {
                    let destination = destination.as_deref();
                    if !yes {
                        let n = admin
                            .preview_replay_sent_between(since, until, destination)
                            .await?;
                        if !json {
                            writeln!(
                                out,
                                "would re-queue {n} message(s) sent from {since} until {until}{} in {table}",
                                destination.map(|d| format!(" to {d}")).unwrap_or_default()
                            )?;
                        }
                        if n == 0 {
                            return match json {
                                true => report(
                                    out,
                                    json,
                                    String::new,
                                    serde_json::json!({ "table": table, "requeued": 0 }),
                                ),
                                // The line above said it.
                                false => Ok(()),
                            };
                        }
                        confirm(out, json, "re-queue them", "re-queued")?;
                    }
                    crate::progress::ticking(
                        &format!("{table}: re-queuing"),
                        None,
                        admin.replay_sent_between(since, until, destination),
                    )
                    .await?
                }
                _ => admin.replay(&ids).await?,
            };
            report(
                out,
                json,
                || {
                    format!(
                        "re-queued {n} sent message(s) in {table}; the relay publishes them again, \
                         each before the newer pending messages of its key"
                    )
                },
                serde_json::json!({ "table": table, "requeued": n }),
            )?;
        }
        Command::Release { ids, key } => {
            let n = match &key {
                Some(key) => {
                    let n = admin.release_key(key).await?;
                    if n == 0 {
                        return Err(Failure::Message(format!(
                            "no dead-lettered message has partition key {key:?} in {table}; \
                             `outbox dead` lists them; nothing was changed"
                        )));
                    }
                    n
                }
                None => admin.release(&ids).await?,
            };
            report(
                out,
                json,
                || {
                    format!(
                        "released {n} dead-lettered message(s) in {table}: pending again, attempts reset"
                    )
                },
                serde_json::json!({ "table": table, "released": n }),
            )?;
        }
        Command::Discard { ids } => {
            let n = admin.discard(&ids).await?;
            report(
                out,
                json,
                || {
                    format!(
                        "discarded {n} dead-lettered message(s) from {table}: deleted, never to be \
                         published; the later messages of their keys go on"
                    )
                },
                serde_json::json!({ "table": table, "discarded": n }),
            )?;
        }
        Command::Purge {
            sent_before,
            dead_before,
            dry_run,
            yes,
            max_rows,
        } => {
            if !dry_run {
                // Counted first: a purge of millions of rows in one transaction is a long
                // lock and a burst of WAL (the delete may still find a few more, written
                // since).
                let preview = admin.purge(sent_before, dead_before, true).await?;
                let rows = preview.sent + preview.dead;
                if rows > max_rows {
                    let instead = if preview.dead > 0 {
                        " (retention keeps dead letters: for those, raise --max-rows or narrow \
                         --dead-before)"
                    } else {
                        ""
                    };
                    return Err(Failure::Message(format!(
                        "would delete {rows} row(s) of {table} ({} sent, {} dead-lettered) in one \
                         transaction, more than --max-rows {max_rows} (a long lock and a burst of \
                         WAL); nothing deleted. Delete old sent messages in batches with `outbox \
                         retention --sent-older-than <age> --keep-processed`, or raise --max-rows{instead}",
                        preview.sent, preview.dead
                    )));
                }
                if dead_before.is_some() && !yes {
                    // Dead letters are messages that never reached anyone: ask first.
                    if !json {
                        writeln!(
                            out,
                            "would delete {} sent and {} dead-lettered message(s) from {table}",
                            preview.sent, preview.dead
                        )?;
                    }
                    if rows == 0 {
                        return match json {
                            true => report(
                                out,
                                json,
                                String::new,
                                serde_json::json!({ "table": table, "sent": 0, "dead": 0, "dry_run": false }),
                            ),
                            // The line above said it.
                            false => Ok(()),
                        };
                    }
                    confirm(out, json, "delete them", "deleted")?;
                }
            }
            let done = admin.purge(sent_before, dead_before, dry_run).await?;
            let verb = if dry_run { "would delete" } else { "deleted" };
            report(
                out,
                json,
                || {
                    format!(
                        "{verb} {} sent and {} dead-lettered message(s) from {table}{}",
                        done.sent,
                        done.dead,
                        if dry_run {
                            " (dry run: nothing deleted)"
                        } else {
                            ""
                        }
                    )
                },
                serde_json::json!({ "table": table, "sent": done.sent, "dead": done.dead, "dry_run": dry_run }),
            )?;
        }
        Command::Slot { .. } => {
            unreachable!("`outbox slot` runs on PostgreSQL only (checked in `run`)")
        }
        Command::Partition { .. } => {
            unreachable!("`outbox partition` runs on PostgreSQL only (checked in `run`)")
        }
        Command::Retention {
            sent_older_than,
            processed_older_than,
            keep_sent,
            keep_processed,
            batch_size,
        } => {
            let mut builder = Retention::builder(outbox.clone())
                .sent_older_than(sent_older_than)
                .processed_older_than(processed_older_than)
                .batch_size(batch_size as usize);
            if keep_sent {
                builder = builder.keep_sent();
            }
            if keep_processed {
                builder = builder.keep_processed();
            }
            // The total to delete, for the time left: a count of the sent rows past the
            // cutoff (one scan), only when the progress line is shown.
            let total = match (keep_sent, crate::progress::Progress::shown()) {
                (false, true) => {
                    let cutoff = chrono::Utc::now()
                        - chrono::Duration::from_std(sent_older_than)
                            .unwrap_or(chrono::Duration::MAX);
                    Some(admin.purge(Some(cutoff), None, true).await?.sent)
                }
                _ => None,
            };
            let mut sent_progress =
                crate::progress::Progress::new(format!("{table}: deleting sent messages"), total);
            let mut processed_progress = None;
            let done = builder
                .build()
                .run_once_with_progress(|so_far| {
                    if so_far.processed_deleted == 0 {
                        sent_progress.update(so_far.sent_deleted);
                    } else {
                        processed_progress
                            .get_or_insert_with(|| {
                                crate::progress::Progress::new(
                                    format!("{table}: deleting processed ids"),
                                    None,
                                )
                            })
                            .update(so_far.processed_deleted);
                    }
                })
                .await?;
            sent_progress.finish();
            if let Some(p) = processed_progress {
                p.finish();
            }
            let rows = done.sent_deleted + done.processed_deleted;
            report(
                out,
                json,
                || {
                    format!(
                        "{table}: {done}; {} rows/s",
                        crate::progress::thousands(crate::progress::rate(rows, done.elapsed) as u64)
                    )
                },
                serde_json::json!({
                    "table": table,
                    "sent_deleted": done.sent_deleted,
                    "processed_deleted": done.processed_deleted,
                    "sent_cutoff": done.sent_cutoff,
                    "processed_cutoff": done.processed_cutoff,
                    "batches": done.batches,
                    "longest_batch_seconds": done.longest_batch.as_secs_f64(),
                    "elapsed_seconds": done.elapsed.as_secs_f64(),
                }),
            )?;
        }
    }
    Ok(())
}

/// Waits for `connecting` (at most `--connect-timeout`), then applies the table names
/// and `mode` (WAL mode on PostgreSQL).
async fn connect<DB: Backend>(
    cli: &Cli,
    connecting: impl Future<Output = outbox_core::Result<Outbox<DB>>>,
    mode: impl FnOnce(OutboxBuilder<DB>) -> OutboxBuilder<DB>,
) -> Result<Outbox<DB>> {
    let outbox = tokio::time::timeout(cli.connect_timeout, connecting)
        .await
        .map_err(|_| {
            Failure::Message(format!(
                "cannot reach the database: no answer within {}; check that the server is running and \
                 that DATABASE_URL or --database-url points at it (or raise --connect-timeout)",
                human(cli.connect_timeout.as_secs_f64())
            ))
        })??;
    let mut builder = Outbox::builder(outbox.pool().clone()).table(&cli.table);
    if let Some(name) = &cli.processed_table {
        builder = builder.processed_table(name);
    }
    Ok(mode(builder).build()?)
}

/// `outbox partition --interval ...` (PostgreSQL).
async fn partition_command(
    outbox: Outbox<Postgres>,
    interval: crate::cli::Interval,
    yes: bool,
    json: bool,
    out: &mut impl Write,
) -> Result {
    let table = outbox.tables().outbox.clone();
    let interval = match interval {
        crate::cli::Interval::Hour => outbox_core::postgres::PartitionInterval::Hourly,
        crate::cli::Interval::Day => outbox_core::postgres::PartitionInterval::Daily,
    };
    if !yes {
        confirm(
            out,
            json,
            &format!(
                "copy {table} into a table partitioned {interval} (writers and relays wait meanwhile), \
                 then drop the old table"
            ),
            "changed",
        )?;
    }
    let started = std::time::Instant::now();
    let done = crate::progress::ticking(
        &format!("{table}: copying into partitions"),
        None,
        outbox.partition_by_time(interval),
    )
    .await?;
    let elapsed = started.elapsed();
    let value = serde_json::json!({
        "table": table.to_string(),
        "interval": interval.to_string(),
        "rows_copied": done.rows_copied,
        "partitions": done.partitions,
        "relays_disconnected": done.relays_disconnected,
        "elapsed_seconds": elapsed.as_secs_f64(),
    });
    report(
        out,
        json,
        || {
            if done.partitions.is_empty() {
                format!("{table} is already partitioned {interval}; nothing to do")
            } else {
                format!(
                    "{table} is partitioned {interval}: {} rows copied in {} ({} rows/s) into {} \
                     partitions ({} to {}) and the default partition; {} relay session(s) reconnect \
                     to it. `outbox retention` now drops old partitions whole",
                    done.rows_copied,
                    human(elapsed.as_secs_f64()),
                    crate::progress::thousands(
                        crate::progress::rate(done.rows_copied, elapsed) as u64
                    ),
                    done.partitions.len(),
                    done.partitions.first().map_or("", String::as_str),
                    done.partitions.last().map_or("", String::as_str),
                    done.relays_disconnected
                )
            }
        },
        value,
    )
}

/// `outbox slot ...` (PostgreSQL, WAL mode).
async fn slot_command(
    cli: &Cli,
    outbox: Outbox<Postgres>,
    command: &SlotCommand,
    out: &mut impl Write,
) -> Result {
    if !(cli.wal || cli.wal_slot.is_some()) {
        return Err(Failure::Message(
            "`outbox slot` needs WAL mode: pass --wal (slot outbox_<table>) or --wal-slot <SLOT> \
             (or set OUTBOX_WAL_SLOT)"
                .to_owned(),
        ));
    }
    let admin = Admin::new(outbox);
    match command {
        SlotCommand::Drop { yes } => {
            if !yes {
                let status = admin.status().await?;
                if let Some(slot) = status.slot.as_ref().filter(|_| !cli.json) {
                    print_slot(out, slot)?;
                }
                confirm(
                    out,
                    cli.json,
                    "drop the slot, and the events it still holds",
                    "dropped",
                )?;
            }
            let slot = outbox_core::postgres::Slot::drop(admin.outbox()).await?;
            report(
                out,
                cli.json,
                || {
                    format!(
                        "dropped replication slot {} and its publication ({} not confirmed by a \
                         relay); `outbox migrate --wal-slot {}` creates a new one, which sees only \
                         what is written after it",
                        slot.name,
                        bytes(slot.unconfirmed_bytes),
                        slot.name
                    )
                },
                serde_json::json!({ "slot": slot.name, "unconfirmed_bytes": slot.unconfirmed_bytes }),
            )?;
        }
    }
    Ok(())
}

fn bytes(n: Option<i64>) -> String {
    match n {
        None => "-".to_owned(),
        Some(n) if n < 1024 => format!("{n} B"),
        Some(n) if n < 1024 * 1024 => format!("{:.1} KiB", n as f64 / 1024.0),
        Some(n) if n < 1024 * 1024 * 1024 => format!("{:.1} MiB", n as f64 / 1048576.0),
        Some(n) => format!("{:.1} GiB", n as f64 / 1073741824.0),
    }
}

fn print_slot(out: &mut impl Write, slot: &SlotStatus) -> io::Result<()> {
    if !slot.exists {
        return writeln!(
            out,
            "replication slot {}: missing; the relay cannot start. `outbox migrate` creates it \
             (see \"A lost or invalidated slot\" in docs/wal.md if it existed before)",
            slot.name
        );
    }
    let who = slot.active_pid.map_or_else(
        || "no relay streaming".to_owned(),
        |pid| format!("a relay streaming (pid {pid})"),
    );
    let status = slot.wal_status.as_deref().unwrap_or("-");
    writeln!(
        out,
        "replication slot {}: {who}, WAL {status}; {} not confirmed, oldest unconfirmed commit {}, {} retained",
        slot.name,
        bytes(slot.unconfirmed_bytes),
        age(slot.oldest_unconfirmed_age_seconds),
        bytes(slot.retained_bytes),
    )?;
    if status == "lost" {
        writeln!(
            out,
            "the slot was invalidated (it retained more than max_slot_wal_keep_size): the relay \
             refuses to read it; see \"A lost or invalidated slot\" in docs/wal.md"
        )?;
    }
    Ok(())
}

fn list_filter(filter: Filter) -> ListFilter {
    let mut list = ListFilter::default();
    list.destination = filter.destination;
    list.event_type = filter.event_type;
    list.key = filter.key;
    list.since = filter.since;
    list.until = filter.until;
    list.limit = filter.limit;
    list
}

fn age(secs: Option<f64>) -> String {
    secs.map_or_else(|| "-".to_owned(), human)
}

fn print_report(out: &mut impl Write, report: &Report) -> io::Result<()> {
    print_status(out, &report.status)?;
    writeln!(out)?;
    for finding in &report.findings {
        write!(out, "{finding}")?;
    }
    let actions = report
        .findings
        .iter()
        .filter(|f| f.severity == outbox_core::doctor::Severity::Action)
        .count();
    if actions == 0 {
        writeln!(out, "\nnothing needs action")?;
    } else {
        writeln!(out, "\n{actions} finding(s) need action")?;
    }
    Ok(())
}

fn print_status(out: &mut impl Write, s: &Status) -> io::Result<()> {
    writeln!(
        out,
        "{}: {} pending ({} in retry), {} dead-lettered, oldest pending {}; {}; {}",
        s.table,
        s.pending,
        s.in_retry,
        s.dead,
        age(s.oldest_pending_age_seconds),
        s.relays.map_or_else(
            || "relays not tracked (SQLite)".to_owned(),
            |n| format!("{n} relay(s) connected")
        ),
        match s.rows_estimate {
            n if n >= 0 => format!("~{n} rows in the table"),
            _ => "rows in the table unknown (never analysed: ANALYZE the table for an estimate)"
                .to_owned(),
        }
    )?;
    if let Some(slot) = &s.slot {
        print_slot(out, slot)?;
    }
    if let Some(w) = s.oldest_writer.as_ref().filter(|w| w.age_seconds >= 1.0) {
        let who = w.pid.map_or_else(
            || "a prepared transaction".to_owned(),
            |pid| format!("pid {pid}"),
        );
        writeln!(
            out,
            "oldest open writer: {who} ({}), open {}: nothing written after it began is published \
             until it commits or rolls back",
            w.state,
            human(w.age_seconds)
        )?;
    }
    print_consumers(out, s)?;
    if s.destinations.is_empty() {
        return Ok(());
    }
    let rows: Vec<Vec<String>> = s
        .destinations
        .iter()
        .map(|d| {
            vec![
                d.destination.clone(),
                d.pending.to_string(),
                d.in_retry.to_string(),
                d.dead.to_string(),
                age(d.oldest_pending_age_seconds),
            ]
        })
        .collect();
    table(
        out,
        &[
            "DESTINATION",
            "PENDING",
            "IN RETRY",
            "DEAD",
            "OLDEST PENDING",
        ],
        &rows,
    )
}

/// The consumers of this database: one line each, then the messages their handlers are
/// failing on.
fn print_consumers(out: &mut impl Write, s: &Status) -> io::Result<()> {
    for c in &s.consumers {
        let failing = match c.failing.iter().map(|m| m.failing_seconds).reduce(f64::max) {
            None => "no handler failing".to_owned(),
            Some(longest) => format!(
                "handler failing on {} message(s), the longest for {}",
                c.failing.len(),
                human(longest)
            ),
        };
        let alive = c.instances.iter().filter(|i| i.alive).count();
        let mut transports: Vec<&str> = c.instances.iter().map(|i| i.transport.as_str()).collect();
        transports.dedup();
        let mut running = if c.instances.is_empty() {
            "no heartbeat".to_owned()
        } else {
            format!("{alive} instance(s) running ({})", transports.join(", "))
        };
        let gone = c.instances.len() - alive;
        if gone > 0 {
            let last = c
                .instances
                .iter()
                .filter(|i| !i.alive)
                .map(|i| i.seen_seconds_ago)
                .fold(f64::MAX, f64::min);
            running.push_str(&format!(", {gone} gone (last seen {} ago)", human(last)));
        }
        if let Some(lag) = c.lag {
            running.push_str(&format!(", lag {lag}"));
        }
        writeln!(
            out,
            "consumer {}: {running}; {} processed in the last minute; {failing}",
            c.consumer, c.processed_last_minute
        )?;
    }
    let rows: Vec<Vec<String>> = s
        .consumers
        .iter()
        .flat_map(|c| c.failing.iter().map(move |m| (c, m)))
        .map(|(c, m)| {
            vec![
                c.consumer.clone(),
                m.message_id.to_string(),
                m.event_type.clone(),
                m.partition_key.clone().unwrap_or_else(|| "-".to_owned()),
                m.attempts.to_string(),
                human(m.failing_seconds),
                shorten(&m.last_error, 60),
            ]
        })
        .collect();
    if rows.is_empty() {
        return Ok(());
    }
    table(
        out,
        &[
            "CONSUMER",
            "FAILING MESSAGE",
            "TYPE",
            "KEY",
            "ATTEMPTS",
            "FAILING FOR",
            "LAST ERROR",
        ],
        &rows,
    )
}

/// The columns of `pending` and `dead` (`dead` adds HOLDS BACK before LAST ERROR).
const MESSAGE_COLUMNS: [&str; 9] = [
    "SEQ",
    "ID",
    "STATE",
    "TYPE",
    "DESTINATION",
    "KEY",
    "CREATED",
    "ATTEMPTS",
    "LAST ERROR",
];

fn print_messages(
    out: &mut impl Write,
    messages: &[MessageInfo],
    json: bool,
    what: &str,
) -> Result {
    if json {
        serde_json::to_writer_pretty(&mut *out, messages)?;
        writeln!(out)?;
        return Ok(());
    }
    if messages.is_empty() {
        writeln!(out, "no {what} messages")?;
        return Ok(());
    }
    let dead = messages.iter().all(|m| m.state == MessageState::Dead);
    let rows: Vec<Vec<String>> = messages
        .iter()
        .map(|m| {
            let mut row = vec![
                m.seq.to_string(),
                m.id.to_string(),
                m.state.to_string(),
                m.event_type.clone(),
                m.destination.clone(),
                m.partition_key.clone().unwrap_or_else(|| "-".to_owned()),
                m.created_at.format("%Y-%m-%dT%H:%M:%SZ").to_string(),
                m.attempts.to_string(),
                m.last_error
                    .as_deref()
                    .map_or_else(|| "-".to_owned(), |e| shorten(e, 60)),
            ];
            if dead {
                row.insert(8, m.held_back.to_string());
            }
            row
        })
        .collect();
    let mut headers = MESSAGE_COLUMNS.to_vec();
    if dead {
        // Pending messages of the key after it, parked until it is released or discarded.
        headers.insert(8, "HOLDS BACK");
    }
    table(out, &headers, &rows)?;
    Ok(())
}

/// `text` on one line, at most `max` columns wide as a terminal shows it (a CJK
/// character or an emoji takes two), cut with `…`.
fn shorten(text: &str, max: usize) -> String {
    let one_line = text.replace(['\n', '\r'], " ");
    if width(&one_line) <= max {
        return one_line;
    }
    let mut s = String::new();
    let mut used = 0;
    for c in one_line.chars() {
        let w = unicode_width::UnicodeWidthChar::width(c).unwrap_or(0);
        if used + w + 1 > max {
            break;
        }
        used += w;
        s.push(c);
    }
    s.push('…');
    s
}

/// Columns a terminal gives `text`.
fn width(text: &str) -> usize {
    unicode_width::UnicodeWidthStr::width(text)
}

/// The terminal's width when standard output is one (`COLUMNS` first, as shells set it);
/// `None` otherwise: a script gets whole rows.
fn terminal_width() -> Option<usize> {
    use std::io::IsTerminal;
    if !io::stdout().is_terminal() {
        return None;
    }
    std::env::var("COLUMNS")
        .ok()
        .and_then(|c| c.parse().ok())
        .or_else(|| terminal_size::terminal_size().map(|(w, _)| usize::from(w.0)))
}

fn table(out: &mut impl Write, header: &[&str], rows: &[Vec<String>]) -> io::Result<()> {
    fit_table(out, header, rows, terminal_width())
}

/// The columns a narrow terminal may cut: prose and names. Ids, keys, numbers and times
/// stay whole (an operator copies them into `release --id`, `release --key`).
const CUTTABLE: [&str; 3] = ["LAST ERROR", "TYPE", "DESTINATION"];

/// Columns padded to their widest cell; with `max_width`, the [`CUTTABLE`] columns are
/// cut, widest first (their cells end in `…`), down to 8 columns each, until a line
/// fits; if it still does not, the lines are longer than the terminal.
fn fit_table(
    out: &mut impl Write,
    header: &[&str],
    rows: &[Vec<String>],
    max_width: Option<usize>,
) -> io::Result<()> {
    let mut widths: Vec<usize> = header.iter().map(|h| width(h)).collect();
    for row in rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(width(cell));
        }
    }
    if let Some(max) = max_width {
        let gaps = 2 * widths.len().saturating_sub(1);
        let floor = |i: usize| width(header[i]).max(8);
        loop {
            let total = widths.iter().sum::<usize>() + gaps;
            let Some(over) = total.checked_sub(max).filter(|over| *over > 0) else {
                break;
            };
            let widest = (0..widths.len())
                .filter(|&i| CUTTABLE.contains(&header[i]) && widths[i] > floor(i))
                .max_by_key(|&i| widths[i]);
            let Some(i) = widest else {
                break;
            };
            widths[i] -= over.min(widths[i] - floor(i));
        }
    }
    let line = |out: &mut dyn Write, cells: &[&str]| -> io::Result<()> {
        let mut text = String::new();
        for (i, (cell, w)) in cells.iter().zip(&widths).enumerate() {
            if i > 0 {
                text.push_str("  ");
            }
            let cell = if width(cell) > *w {
                shorten(cell, *w)
            } else {
                (*cell).to_owned()
            };
            text.push_str(&cell);
            if i + 1 < cells.len() {
                text.extend(std::iter::repeat_n(' ', w.saturating_sub(width(&cell))));
            }
        }
        writeln!(out, "{text}")
    };
    line(out, header)?;
    for row in rows {
        let cells: Vec<&str> = row.iter().map(String::as_str).collect();
        line(out, &cells)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rendered(rows: &[Vec<String>], max_width: Option<usize>) -> Vec<String> {
        let mut out = Vec::new();
        fit_table(&mut out, &["KEY", "TYPE", "LAST ERROR"], rows, max_width).expect("render");
        String::from_utf8(out)
            .expect("utf-8")
            .lines()
            .map(str::to_owned)
            .collect()
    }

    /// Wide characters take two columns: the next column starts at the same column on
    /// every line (it was shifted by one per CJK character: `chars().count()`).
    #[test]
    fn cjk_and_emoji_cells_keep_the_columns_aligned() {
        let rows = vec![
            vec![
                "注文-42".to_owned(),
                "Bestellung".to_owned(),
                "-".to_owned(),
            ],
            vec!["k🚀".to_owned(), "注文確定".to_owned(), "-".to_owned()],
            vec!["plain".to_owned(), "x".to_owned(), "-".to_owned()],
        ];
        let lines = rendered(&rows, None);
        let third_column = |line: &str| {
            let at = line.rfind("  ").expect("a gap") + 2;
            // Measured as a terminal shows it (not with the code under test).
            unicode_width::UnicodeWidthStr::width(&line[..at])
        };
        let starts: Vec<usize> = lines.iter().map(|l| third_column(l)).collect();
        assert!(starts.windows(2).all(|w| w[0] == w[1]), "{lines:#?}");
    }

    /// On a terminal narrower than the table, the prose columns are cut (`…`) and every
    /// line fits; ids and keys stay whole.
    #[test]
    fn a_table_fits_the_terminal_by_cutting_its_prose() {
        let error = "connection refused by the broker at kafka-1.internal:9092 (all brokers down) "
            .repeat(2);
        let rows = vec![vec![
            "order-1".to_owned(),
            "OrderPlaced".to_owned(),
            error.clone(),
        ]];
        let lines = rendered(&rows, Some(60));
        for line in &lines {
            assert!(width(line) <= 60, "{} columns: {line}", width(line));
        }
        assert!(
            lines[1].ends_with('…') && lines[1].contains("OrderPlaced"),
            "{lines:#?}"
        );
        let whole = rendered(&rows, None);
        assert!(
            whole[1].trim_end().ends_with(error.trim_end()),
            "no terminal: whole rows"
        );
    }

    /// `outbox dead` on an 80-column terminal: nine columns, more over than any one
    /// column is wide (it underflowed and panicked: found in review). The id and the key
    /// stay whole; the type, destination and error give way; the lines are as short as
    /// that allows.
    #[test]
    fn a_wide_listing_on_80_columns_keeps_ids_and_keys_whole() {
        let header = MESSAGE_COLUMNS;
        let id = "0192a3b4-c5d6-7e8f-9012-3456789abcde";
        let key = "customer-7f3a9c";
        let row = vec![
            "1234567".to_owned(),
            id.to_owned(),
            "dead".to_owned(),
            "billing.InvoiceFinalized".to_owned(),
            "billing.invoices.v2".to_owned(),
            key.to_owned(),
            "2026-12-04T09:00:00Z".to_owned(),
            "5".to_owned(),
            "message too large: 1200000 bytes, the broker takes 1048576".to_owned(),
        ];
        let mut out = Vec::new();
        fit_table(&mut out, &header, std::slice::from_ref(&row), Some(80)).expect("render");
        let text = String::from_utf8(out).expect("utf-8");
        let line = text.lines().nth(1).expect("a row");
        assert!(line.contains(id) && line.contains(key), "{text}");
        assert!(line.contains('…'), "the prose is cut: {text}");
        // As short as that allows: the uncut columns whole, each cut one at its floor
        // (8, or its header), two spaces between columns.
        let expected: usize = header
            .iter()
            .zip(&row)
            .map(|(h, cell)| match CUTTABLE.contains(h) {
                true => width(h).max(8),
                false => width(h).max(width(cell)),
            })
            .sum::<usize>()
            + 2 * (header.len() - 1);
        assert_eq!(width(line), expected, "{text}");
    }

    #[test]
    fn only_the_mariadb_scheme_is_rewritten() {
        assert_eq!(
            mysql_scheme("mariadb://mariadb:pw@mariadb:3306/app"),
            "mysql://mariadb:pw@mariadb:3306/app"
        );
        assert_eq!(
            mysql_scheme("mysql://app:pw@mariadb:3306/app"),
            "mysql://app:pw@mariadb:3306/app"
        );
    }

    #[test]
    fn sqlite_paths_are_percent_decoded_like_sqlx_does() {
        assert_eq!(percent_decoded("/tmp/my%20app.db"), "/tmp/my app.db");
        assert_eq!(percent_decoded("/tmp/100%.db"), "/tmp/100%.db");
        assert_eq!(percent_decoded("/tmp/caf%C3%A9.db"), "/tmp/café.db");
    }
}
