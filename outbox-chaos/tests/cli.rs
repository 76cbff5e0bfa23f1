//! The chaos rig's command line: a mistake is refused before any service is touched,
//! naming what was wrong and what is accepted. (Building this test also builds the
//! binary with the test suite's features, which CI's chaos step then runs.)

use std::process::Command;

fn chaos(args: &[&str]) -> (Option<i32>, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_outbox-chaos"))
        .args(args)
        // Nowhere to connect: a run that got as far as the services would fail differently.
        .env("DATABASE_URL", "postgres://nobody@127.0.0.1:1/none")
        .env_remove("TANSU_BIN")
        .output()
        .expect("run outbox-chaos");
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn an_unknown_fault_is_refused_naming_every_fault() {
    let (code, err) = chaos(&["run", "--fault", "relay-kill,relay-kil", "--short"]);
    assert_eq!(code, Some(1), "{err}");
    assert!(
        err.contains("--fault relay-kil: one of relay-kill, relay-stop,")
            && err.contains(" or all"),
        "{err}"
    );
    assert!(
        !err.contains("chaos: relay-kill on"),
        "a run started: {err}"
    );
}

#[test]
fn an_unknown_broker_or_a_bad_seed_is_refused() {
    let (code, err) = chaos(&["run", "--broker", "rabbit"]);
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("--broker rabbit: kafka or nats"), "{err}");
    let (code, err) = chaos(&["run", "--seed", "one"]);
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("--seed: a number"), "{err}");
}

#[test]
fn no_command_prints_the_usage() {
    let (code, err) = chaos(&[]);
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("usage: outbox-chaos run"), "{err}");
}
