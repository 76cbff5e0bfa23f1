//! Every log line a test binary writes, for tests that check what is (not) logged. Only
//! one subscriber can be the global one: use this in a test binary of its own.

use std::io::Write;
use std::sync::{Arc, Mutex};

/// The captured lines.
#[derive(Debug, Clone, Default)]
pub struct Captured(Arc<Mutex<Vec<u8>>>);

impl Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().expect("log buffer").extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Captured {
    /// Installs the global subscriber: every crate's lines, dependencies included, up to
    /// `level`, without colours.
    pub fn install(level: tracing::Level) -> Captured {
        let logs = Captured::default();
        let writer = logs.clone();
        tracing_subscriber::fmt()
            .with_max_level(level)
            .with_ansi(false)
            .with_writer(move || writer.clone())
            .init();
        logs
    }

    /// Everything logged so far.
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().expect("log buffer")).into_owned()
    }
}
