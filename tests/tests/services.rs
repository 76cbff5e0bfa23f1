//! `scripts/services.sh` starts servers that outlive it; they must not keep what the
//! caller handed it open (a pipe held by a broker kept the caller's caller waiting for
//! as long as the broker ran).

use std::process::Command;
use std::time::{Duration, Instant};

/// A local port nothing listens on now.
fn free_port() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    listener.local_addr().expect("address").port()
}

#[test]
fn a_server_the_script_starts_does_not_hold_the_callers_pipes() {
    let port = free_port();
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../scripts/services.sh");
    // `$( ... 3>&1 )` returns once every writer of its pipe closed it: the script itself,
    // and any server that inherited descriptor 3 from it.
    let shell = format!(
        "x=$( {{ KAFKA_ADDR=127.0.0.1:{port} {script} >/dev/null 2>\"$LOG\"; }} 3>&1 ); echo returned"
    );
    let log = std::env::temp_dir().join(format!("outbox-services-{port}.log"));
    let started = Instant::now();
    let output = Command::new("timeout")
        .args(["120", "bash", "-c", &shell])
        .env("LOG", &log)
        .output()
        .expect("run bash");
    let took = started.elapsed();
    let serving = std::net::TcpStream::connect(("127.0.0.1", port)).is_ok();
    // The broker it started on that port goes, whatever happened.
    let _ = Command::new("pkill")
        .args(["-f", &format!("listener-url tcp://127.0.0.1:{port}")])
        .status();
    let log = std::fs::read_to_string(&log).unwrap_or_default();
    assert!(
        serving,
        "the script started no broker on port {port}; its log:\n{log}"
    );
    assert_eq!(
        String::from_utf8_lossy(&output.stdout).trim(),
        "returned",
        "the caller was still waiting after {took:?}: a server kept its pipe open; the script's log:\n{log}"
    );
    assert!(
        took < Duration::from_secs(100),
        "took {took:?}; the script's log:\n{log}"
    );
}
