//! `outbox serve` in a process of its own, and a minimal HTTP/1.1 client for its API.
#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};

use outbox_tests::TestDb;

pub const TOKEN: &str = "a-test-token-of-32-characters-xx";

/// A running dashboard; killed when dropped.
pub struct Dashboard {
    child: Child,
    /// `127.0.0.1:<port>`.
    pub address: String,
}

impl Drop for Dashboard {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts `outbox --table <schema>.outbox serve --listen 127.0.0.1:0` against `url`,
/// with `token` (or read-only), and waits for the line that says where it listens.
pub fn dashboard(db: &TestDb, url: &str, token: Option<&str>) -> Dashboard {
    let table = format!("{}.outbox", db.schema);
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_outbox"));
    cmd.args(["--table", &table, "serve", "--listen", "127.0.0.1:0"])
        .env_remove("OUTBOX_TABLE")
        .env_remove("OUTBOX_TOKEN")
        .env("DATABASE_URL", url)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    if let Some(token) = token {
        cmd.env("OUTBOX_TOKEN", token);
    }
    let mut child = cmd.spawn().expect("start `outbox serve`");
    let stdout = child.stdout.take().expect("stdout");
    let mut line = String::new();
    BufReader::new(stdout)
        .read_line(&mut line)
        .expect("the first line");
    let address = line
        .split("http://")
        .nth(1)
        .and_then(|rest| rest.split('/').next())
        .unwrap_or_else(|| panic!("no address in {line:?}"))
        .to_owned();
    Dashboard { child, address }
}

/// A response: status code and body.
#[derive(Debug)]
pub struct Reply {
    pub code: u16,
    pub body: String,
}

impl Reply {
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("not JSON ({e}): {}", self.body))
    }
}

/// `method path` with an optional JSON body and bearer token.
pub async fn http(
    address: &str,
    method: &str,
    path: &str,
    body: Option<serde_json::Value>,
    token: Option<&str>,
) -> Reply {
    raw(
        address,
        address,
        method,
        path,
        body.map(|b| b.to_string()),
        token,
    )
    .await
}

/// [`http`] with any `Host` header and any body.
pub async fn raw(
    address: &str,
    host: &str,
    method: &str,
    path: &str,
    body: Option<String>,
    token: Option<&str>,
) -> Reply {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(address)
        .await
        .expect("connect to the dashboard");
    let body = body.unwrap_or_default();
    let mut request = format!(
        "{method} {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\nContent-Length: {}\r\n",
        body.len()
    );
    if !body.is_empty() {
        request.push_str("Content-Type: application/json\r\n");
    }
    if let Some(token) = token {
        request.push_str(&format!("Authorization: Bearer {token}\r\n"));
    }
    request.push_str("\r\n");
    request.push_str(&body);
    stream
        .write_all(request.as_bytes())
        .await
        .expect("send the request");
    let mut raw = Vec::new();
    stream
        .read_to_end(&mut raw)
        .await
        .expect("read the response");
    let raw = String::from_utf8_lossy(&raw).into_owned();
    let (head, body) = raw.split_once("\r\n\r\n").unwrap_or((&raw, ""));
    let code = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or_else(|| panic!("no status in {head:?}"));
    Reply {
        code,
        body: body.to_owned(),
    }
}
