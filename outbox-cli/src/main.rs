//! `outbox`: the operations tool of the transactional outbox.
//!
//! Exit status: 0 on success, 1 when the command failed (the reason is on one line of
//! standard error, and nothing was changed), 2 for a command line that does not parse,
//! 3 when `doctor` found something that needs action.

mod cli;
mod commands;
mod failure;
mod progress;
mod relay;
mod serve;
mod settings;
mod time;

use std::io::Write;
use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    let mut cli = cli::Cli::parse();
    if let cli::Command::Completions { shell } = cli.command {
        let mut command = <cli::Cli as clap::CommandFactory>::command();
        // Into memory first: clap_complete panics on a write error, and a reader that
        // went away (`| head`) is not an error of ours.
        let mut script = Vec::new();
        clap_complete::generate(shell, &mut command, "outbox", &mut script);
        return match std::io::stdout().lock().write_all(&script) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => ExitCode::SUCCESS,
            Err(e) => fail(&format!("cannot write the output: {e}")),
        };
    }
    let json = cli.json;
    if let Err(e) = relay::prepare(&mut cli) {
        return fail_as(json, &e.to_string());
    }
    // A relay is a service: it says what it does (info), in JSON when asked.
    let (relay, log_json) = match &cli.command {
        cli::Command::Relay(args) => (true, args.settings.log_format == settings::LogFormat::Json),
        _ => (false, false),
    };
    let filter = tracing_subscriber::EnvFilter::try_from_env("OUTBOX_LOG")
        // sqlx's "slow statement" warnings would interleave with the command's own
        // output (a status on a busy server); `OUTBOX_LOG=sqlx=warn` shows them.
        .unwrap_or_else(|_| {
            tracing_subscriber::EnvFilter::new(if relay {
                "info,sqlx::query=error"
            } else {
                "warn,sqlx::query=error"
            })
        });
    let logs = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    if log_json {
        logs.json().init();
    } else {
        logs.init();
    }
    let runtime = if relay {
        tokio::runtime::Builder::new_multi_thread()
    } else {
        tokio::runtime::Builder::new_current_thread()
    }
    .enable_all()
    .build();
    let runtime = match runtime {
        Ok(rt) => rt,
        Err(e) => return fail(&format!("cannot start the async runtime: {e}")),
    };
    let fail = |message: &str| fail_as(json, message);
    let mut out = std::io::stdout().lock();
    match runtime.block_on(commands::run(cli, &mut out)) {
        Ok(()) => match out.flush() {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => ExitCode::SUCCESS,
            Err(e) => fail(&format!("cannot write the output: {e}")),
        },
        // The reader went away (`outbox dead | head`): not an error of ours.
        Err(failure::Failure::Output(e)) if e.kind() == std::io::ErrorKind::BrokenPipe => {
            ExitCode::SUCCESS
        }
        Err(failure::Failure::NeedsAction) => {
            let _ = out.flush();
            ExitCode::from(3)
        }
        Err(e) => fail(&e.to_string()),
    }
}

fn fail(message: &str) -> ExitCode {
    fail_as(false, message)
}

/// The failure on one line of standard error: `outbox: error: ...`, or with `--json` a
/// JSON object `{"error": "...", "exit_status": 1}`.
fn fail_as(json: bool, message: &str) -> ExitCode {
    // One line: messages from the library never span lines, but a driver error might.
    let line = message.replace('\n', " ");
    let _ = if json {
        writeln!(
            std::io::stderr(),
            "{}",
            serde_json::json!({ "error": line, "exit_status": 1 })
        )
    } else {
        writeln!(std::io::stderr(), "outbox: error: {line}")
    };
    ExitCode::FAILURE
}
