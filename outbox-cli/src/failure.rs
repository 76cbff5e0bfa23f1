//! How a command fails: [`Failure`], what `main` turns into the exit status and the
//! one line on standard error. Shared by the commands and the dashboard.

use std::fmt;
use std::io;

/// Why a command failed. Displayed on one line.
#[derive(Debug)]
pub enum Failure {
    /// From the library; its message says what to do.
    Outbox(outbox_core::Error),
    /// Found by the tool itself.
    Message(String),
    /// Standard output could not be written.
    Output(io::Error),
    /// `doctor` found something that needs action (the report is on standard output).
    NeedsAction,
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            // The whole chain: the driver's message is the error's source.
            Failure::Outbox(e) => write!(f, "{}", outbox_core::ErrorChain(e)),
            Failure::Message(m) => f.write_str(m),
            Failure::Output(e) => write!(f, "cannot write the output: {e}"),
            Failure::NeedsAction => f.write_str("something needs action"),
        }
    }
}

impl From<outbox_core::Error> for Failure {
    fn from(e: outbox_core::Error) -> Self {
        Failure::Outbox(e)
    }
}

impl From<io::Error> for Failure {
    fn from(e: io::Error) -> Self {
        Failure::Output(e)
    }
}

impl From<serde_json::Error> for Failure {
    fn from(e: serde_json::Error) -> Self {
        Failure::Output(e.into())
    }
}

pub type Result<T = ()> = std::result::Result<T, Failure>;
