//! The interop decoders in `tests/interop/` (Python, with packages nobody here wrote:
//! the CloudEvents SDK, Google's Protobuf runtime, fastavro, each broker's client), run
//! from the venv `scripts/services.sh` installs.

use std::path::PathBuf;

use serde_json::Value;

/// The venv's Python (`OUTBOX_PYTHON`, else where scripts/services.sh puts it).
pub fn python() -> PathBuf {
    let path = std::env::var_os("OUTBOX_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            let tools = std::env::var_os("OUTBOX_TOOLS_DIR")
                .map(PathBuf::from)
                .unwrap_or_else(|| {
                    PathBuf::from(std::env::var_os("HOME").expect("HOME"))
                        .join(".cache/outbox-tools")
                });
            tools.join("py/bin/python")
        });
    assert!(
        path.exists(),
        "no Python with the interop packages at {}: run scripts/services.sh (it installs the venv), or set OUTBOX_PYTHON",
        path.display()
    );
    path
}

/// What `tests/interop/<script>` printed when run with `args`: one JSON object per
/// line, `count` of them (else the test fails with the script's output).
pub async fn run_interop(script: &str, args: &[&str], count: usize) -> Vec<Value> {
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("interop")
        .join(script);
    let args: Vec<String> = std::iter::once(script.display().to_string())
        .chain(args.iter().map(|a| (*a).to_owned()))
        .collect();
    let shown = args.join(" ");
    let output = tokio::task::spawn_blocking(move || {
        std::process::Command::new(python()).args(args).output()
    })
    .await
    .expect("the decoder task")
    .expect("run the Python decoder");
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "the Python decoder failed ({}): {shown}\n{stdout}\n{}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    let lines: Vec<Value> = stdout
        .lines()
        .map(|line| {
            serde_json::from_str(line).unwrap_or_else(|e| {
                panic!(
                    "{shown} printed a line that is not JSON ({e}): {line}\n{stdout}\n{}",
                    String::from_utf8_lossy(&output.stderr)
                )
            })
        })
        .collect();
    assert_eq!(
        lines.len(),
        count,
        "{shown}\n{stdout}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    lines
}
