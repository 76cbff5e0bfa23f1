//! Child processes the tests signal (SIGKILL, SIGSTOP) and always reap.
//!
//! A child's output goes to a file of its own, not to the terminal: when the test fails
//! (the process is dropped while the test's thread panics), the end of that file is
//! printed under the child's name, so that one red run shows what each relay was doing;
//! when the test passes, the file is removed.

use std::io::{Read, Seek, SeekFrom};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};

/// How much of a child's output a failed test prints (its last bytes).
const TAIL: u64 = 24 * 1024;

/// A child process, continued and killed when dropped.
#[derive(Debug)]
pub struct Process {
    child: Child,
    name: String,
    log: PathBuf,
}

impl Process {
    /// Spawns `command`, named after its last argument (a relay's name) in what a failed
    /// test prints.
    pub fn start(command: &mut Command) -> Process {
        let name = command
            .get_args()
            .last()
            .map(|a| a.to_string_lossy().into_owned())
            .unwrap_or_else(|| command.get_program().to_string_lossy().into_owned());
        Process::named(&name, command)
    }

    /// Spawns `command` as `name`, its stdout and stderr into a file of its own.
    pub fn named(name: &str, command: &mut Command) -> Process {
        let log = std::env::temp_dir().join(format!(
            "outbox-test-{}-{}-{}.log",
            std::process::id(),
            name.replace(|c: char| !c.is_ascii_alphanumeric() && c != '-', "_"),
            uuid::Uuid::now_v7().simple()
        ));
        let file = std::fs::File::create(&log).expect("a log file for the child process");
        let child = command
            .stdout(file.try_clone().expect("log file"))
            .stderr(Stdio::from(file))
            .spawn()
            .expect("start a child process");
        Process {
            child,
            name: name.to_owned(),
            log,
        }
    }

    /// The child's process id.
    pub fn id(&self) -> u32 {
        self.child.id()
    }

    /// Sends `signal` (`-KILL`, `-STOP`, `-CONT`...) with `kill`.
    pub fn signal(&self, signal: &str) {
        let status = Command::new("kill")
            .args([signal, &self.child.id().to_string()])
            .status()
            .expect("kill");
        assert!(status.success(), "kill {signal}");
    }

    /// Its exit status, if it has exited (reaped then).
    pub fn try_wait(&mut self) -> Option<std::process::ExitStatus> {
        self.child.try_wait().expect("the child's status")
    }

    /// Everything the child wrote so far.
    pub fn output(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// The last 24 KiB the child wrote so far.
    pub fn output_tail(&self) -> String {
        let Ok(mut file) = std::fs::File::open(&self.log) else {
            return String::new();
        };
        let len = file.metadata().map(|m| m.len()).unwrap_or(0);
        let _ = file.seek(SeekFrom::Start(len.saturating_sub(TAIL)));
        let mut bytes = Vec::new();
        let _ = file.read_to_end(&mut bytes);
        String::from_utf8_lossy(&bytes).into_owned()
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        let _ = Command::new("kill")
            .args(["-CONT", &self.child.id().to_string()])
            .stderr(Stdio::null())
            .status();
        let _ = self.child.kill();
        let _ = self.child.wait();
        if std::thread::panicking() {
            eprintln!(
                "---- the last output of child process {:?} (pid {}, {}) ----\n{}\n---- end of {:?} ----",
                self.name,
                self.child.id(),
                self.log.display(),
                self.output_tail(),
                self.name
            );
        } else {
            let _ = std::fs::remove_file(&self.log);
        }
    }
}
