//! Background tasks that stop when asked: the relay, retention, and the broker crates'
//! consumers share this one handle and this one `stopped`.
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")] async fn main() {
//! use outbox_core::task::{TaskHandle, stopped};
//!
//! let handle = TaskHandle::spawn(|mut shutdown| async move {
//!     stopped(&mut shutdown).await; // work until asked to stop
//!     "done"
//! });
//! assert_eq!(handle.shutdown().await, Some("done"));
//! # }
//! ```

use std::future::Future;

use tokio::sync::watch;
use tokio::task::JoinHandle;

/// The message a panic carried, as text.
pub(crate) fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".to_owned())
}

/// Resolves when shutdown is requested. If the sender is dropped without asking (a
/// detached task), it never resolves: the task runs as long as the runtime.
pub async fn stopped(shutdown: &mut watch::Receiver<bool>) {
    if shutdown.wait_for(|stop| *stop).await.is_err() {
        std::future::pending::<()>().await;
    }
}

/// A task on the tokio runtime, with a way to ask it to stop.
#[derive(Debug)]
#[must_use = "dropping the handle detaches the task: it runs until the runtime ends, and cannot be stopped gracefully; keep it and call `shutdown`"]
pub struct TaskHandle<T = ()> {
    shutdown: watch::Sender<bool>,
    task: JoinHandle<T>,
}

impl<T: Send + 'static> TaskHandle<T> {
    /// Spawns `run(shutdown)` on the current runtime; `shutdown` turns `true` when
    /// [`shutdown`](Self::shutdown) is called (wait for it with [`stopped`]).
    pub fn spawn<F>(run: impl FnOnce(watch::Receiver<bool>) -> F) -> Self
    where
        F: Future<Output = T> + Send + 'static,
    {
        let (shutdown, rx) = watch::channel(false);
        TaskHandle {
            shutdown,
            task: tokio::spawn(run(rx)),
        }
    }

    /// Asks the task to stop and waits until it has: its output, or `None` if it was
    /// aborted. A panic in the task is raised again here.
    pub async fn shutdown(self) -> Option<T> {
        let _ = self.shutdown.send(true);
        self.join().await
    }

    /// Waits for the task to end by itself; `None` if it was aborted. A panic in the
    /// task is raised again here.
    pub async fn join(self) -> Option<T> {
        match self.task.await {
            Ok(output) => Some(output),
            Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
            Err(_) => None,
        }
    }

    /// Stops the task at once, wherever it is (as a crash would).
    pub fn abort(&self) {
        self.task.abort();
    }

    /// Whether the task has ended.
    pub fn is_finished(&self) -> bool {
        self.task.is_finished()
    }
}
