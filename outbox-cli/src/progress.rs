//! Progress of long work on standard error while it is a terminal: rows done, the rate
//! and the time left where the total is known. Nothing otherwise: the command's summary
//! line (on standard output) says what was done, how long it took and how fast.
//!
//! Work done in one statement and one transaction (a replay, the partition conversion)
//! has no rows done to show until it commits: its line shows the rows it works on and
//! the time so far.

use std::future::Future;
use std::io::{IsTerminal, Write};
use std::time::{Duration, Instant};

/// How often the line is redrawn at most.
const REDRAW: Duration = Duration::from_millis(200);

/// A progress line for work done in steps (retention's batches).
pub struct Progress {
    label: String,
    total: Option<u64>,
    started: Instant,
    drawn: Option<Instant>,
    terminal: bool,
}

impl Progress {
    /// Progress of `label`, of `total` rows when known.
    pub fn new(label: impl Into<String>, total: Option<u64>) -> Progress {
        Progress {
            label: label.into(),
            total,
            started: Instant::now(),
            drawn: None,
            terminal: std::io::stderr().is_terminal(),
        }
    }

    /// Whether the line is shown (standard error is a terminal): counting the total
    /// costs a query, worth it only then.
    pub fn shown() -> bool {
        std::io::stderr().is_terminal()
    }

    /// `done` rows so far.
    pub fn update(&mut self, done: u64) {
        if !self.terminal || self.drawn.is_some_and(|at| at.elapsed() < REDRAW) {
            return;
        }
        self.drawn = Some(Instant::now());
        draw(&line(&self.label, done, self.total, self.started.elapsed()));
    }

    /// Clears the line.
    pub fn finish(self) {
        if self.terminal && self.drawn.is_some() {
            draw("");
        }
    }
}

/// Runs `work` (one statement, one transaction) with a line that shows `label`, the
/// rows it works on, and the time so far.
pub async fn ticking<T>(label: &str, rows: Option<u64>, work: impl Future<Output = T>) -> T {
    if !Progress::shown() {
        return work.await;
    }
    let started = Instant::now();
    let mut work = std::pin::pin!(work);
    let mut tick = tokio::time::interval(REDRAW);
    let mut drawn = false;
    let result = loop {
        tokio::select! {
            result = &mut work => break result,
            _ = tick.tick() => {
                drawn = true;
                let rows = rows.map_or(String::new(), |n| format!("{} rows, ", thousands(n)));
                draw(&format!(
                    "{label}: {rows}{} so far (one transaction: all or nothing)",
                    human(started.elapsed())
                ));
            }
        }
    };
    if drawn {
        draw("");
    }
    result
}

/// Replaces the terminal's current line with `text`.
fn draw(text: &str) {
    let mut err = std::io::stderr().lock();
    let _ = write!(err, "\r\x1b[2K{text}");
    let _ = err.flush();
}

/// The progress line: `label: done[/total (pct%)] rows, rate rows/s[, time left]`.
pub fn line(label: &str, done: u64, total: Option<u64>, elapsed: Duration) -> String {
    let rate = rate(done, elapsed);
    let mut text = format!("{label}: {}", thousands(done));
    if let Some(total) = total.filter(|t| *t > 0) {
        let pct = (done.min(total) as f64 / total as f64 * 100.0).floor();
        text.push_str(&format!("/{} rows ({pct}%)", thousands(total)));
    } else {
        text.push_str(" rows");
    }
    text.push_str(&format!(", {} rows/s", thousands(rate as u64)));
    if let Some(total) = total
        && rate > 0.0
        && done < total
    {
        let left = Duration::from_secs_f64((total - done) as f64 / rate);
        text.push_str(&format!(", {} left", human(left)));
    }
    text
}

/// `rows` in `elapsed`, per second (0 before any time passed).
pub fn rate(rows: u64, elapsed: Duration) -> f64 {
    let secs = elapsed.as_secs_f64();
    if secs > 0.0 { rows as f64 / secs } else { 0.0 }
}

/// `1234567` as `1,234,567`.
pub fn thousands(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// A duration as `outbox status` prints one.
pub fn human(d: Duration) -> String {
    outbox_core::admin::human_duration(d.as_secs_f64())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_line_says_rows_done_rate_and_time_left() {
        assert_eq!(
            line("deleting", 250_000, Some(1_000_000), Duration::from_secs(5)),
            "deleting: 250,000/1,000,000 rows (25%), 50,000 rows/s, 15.0s left"
        );
        assert_eq!(
            line("deleting", 1_200, None, Duration::from_secs(2)),
            "deleting: 1,200 rows, 600 rows/s"
        );
        assert_eq!(
            line("deleting", 10, Some(10), Duration::from_millis(500)),
            "deleting: 10/10 rows (100%), 20 rows/s"
        );
        assert_eq!(
            line("deleting", 0, Some(0), Duration::ZERO),
            "deleting: 0 rows, 0 rows/s"
        );
        assert_eq!(thousands(0), "0");
        assert_eq!(thousands(999), "999");
        assert_eq!(thousands(1_000), "1,000");
    }
}
