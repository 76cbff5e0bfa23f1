//! The benchmark's command line: a mistake is refused before anything runs, naming what
//! was wrong and what is accepted. (Building this test also builds the binary with the
//! test suite's features, which CI's benchmark step then runs.)

use std::process::Command;

fn bench(args: &[&str]) -> (Option<i32>, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_outbox-bench"))
        .args(args)
        // Nowhere to connect: a run that started a scenario would fail differently.
        .env("DATABASE_URL", "postgres://nobody@127.0.0.1:1/none")
        .output()
        .expect("run outbox-bench");
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn an_unknown_scenario_is_refused_before_the_others_run() {
    let (code, err) = bench(&["drain", "darin", "--smoke"]);
    assert_eq!(code, Some(2), "{err}");
    assert!(
        err.contains(r#"unknown scenario "darin": one of drain, latency"#),
        "{err}"
    );
    assert!(
        !err.contains("== drain"),
        "drain ran before the mistake was seen: {err}"
    );
}

#[test]
fn an_option_without_its_value_or_a_number_is_refused() {
    let (code, err) = bench(&["drain", "--events"]);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("--events needs a value"), "{err}");
    let (code, err) = bench(&["drain", "--events", "many"]);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains(r#"--events "many""#), "{err}");
}

#[test]
fn no_scenario_prints_the_usage() {
    let (code, err) = bench(&[]);
    assert_eq!(code, Some(2), "{err}");
    assert!(
        err.contains("no scenario given") && err.contains("usage: outbox-bench"),
        "{err}"
    );
}
