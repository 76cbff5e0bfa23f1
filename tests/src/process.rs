//! Child processes the tests signal (SIGKILL, SIGSTOP) and always reap.

use std::process::{Child, Command};

/// A child process, continued and killed when dropped.
#[derive(Debug)]
pub struct Process(Child);

impl Process {
    /// Spawns `command`.
    pub fn start(command: &mut Command) -> Process {
        Process(command.spawn().expect("start a child process"))
    }

    /// Sends `signal` (`-KILL`, `-STOP`, `-CONT`...) with `kill`.
    pub fn signal(&self, signal: &str) {
        let status = Command::new("kill")
            .args([signal, &self.0.id().to_string()])
            .status()
            .expect("kill");
        assert!(status.success(), "kill {signal}");
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        let _ = Command::new("kill")
            .args(["-CONT", &self.0.id().to_string()])
            .status();
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}
