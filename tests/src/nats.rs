//! NATS fixtures: the shared server (`OUTBOX_TEST_NATS_URL`, default
//! `nats://127.0.0.1:4222`), test streams that work on a brand-new server, and servers of
//! a test's own.

use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use async_nats::jetstream::{self, stream};
use uuid::Uuid;

/// The NATS server the tests share.
pub fn nats_url() -> String {
    std::env::var("OUTBOX_TEST_NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".to_owned())
}

/// A message's headers as text (a header sent twice: its last value).
pub fn text_headers(
    headers: Option<&async_nats::HeaderMap>,
) -> std::collections::BTreeMap<String, String> {
    headers
        .into_iter()
        .flat_map(|h| h.iter())
        .filter_map(|(name, values)| Some((name.to_string(), values.last()?.to_string())))
        .collect()
}

/// A fresh stream capturing `<prefix>.>` on the server at `url`; returns the context,
/// the stream name and the prefix.
///
/// The stream keeps its messages in memory: a file-backed stream needs the server's
/// store folder, which a brand-new server creates on first use, and streams created and
/// deleted in parallel there race on it (JetStream 10049, "error creating store for
/// stream"). Nothing these tests check depends on where JetStream keeps the messages.
pub async fn fresh_stream_at(url: &str) -> (jetstream::Context, String, String) {
    let client = async_nats::connect(url)
        .await
        .unwrap_or_else(|e| panic!("NATS at {url} (set OUTBOX_TEST_NATS_URL): {e}"));
    fresh_stream_on(client).await
}

/// [`fresh_stream_at`] through a client connected already (over TLS, say).
pub async fn fresh_stream_on(client: async_nats::Client) -> (jetstream::Context, String, String) {
    let url = client.server_info().host;
    let js = jetstream::new(client);
    let id = Uuid::now_v7().simple().to_string();
    let (name, prefix) = (format!("OUTBOX_TEST_{id}"), format!("outbox-test-{id}"));
    js.create_stream(stream::Config {
        name: name.clone(),
        subjects: vec![format!("{prefix}.>")],
        duplicate_window: Duration::from_secs(120),
        storage: stream::StorageType::Memory,
        ..Default::default()
    })
    .await
    .unwrap_or_else(|e| {
        panic!("create the test stream {name} on {url} (is JetStream enabled?): {e}")
    });
    (js, name, prefix)
}

/// Every message of stream `name` (at most `max`), in stream order, through an ephemeral
/// pull consumer: its headers as text (a header sent twice: its last value) and its
/// payload's bytes as they came.
pub async fn read_all(
    js: &jetstream::Context,
    name: &str,
    max: usize,
) -> Vec<(std::collections::BTreeMap<String, String>, Vec<u8>)> {
    use futures_util::StreamExt as _;
    let reader = js
        .get_stream(name)
        .await
        .unwrap_or_else(|e| panic!("stream {name}: {e}"))
        .create_consumer(jetstream::consumer::pull::Config::default())
        .await
        .unwrap_or_else(|e| panic!("a reader of {name}: {e}"));
    let mut messages = reader
        .fetch()
        .max_messages(max)
        .expires(Duration::from_secs(2))
        .messages()
        .await
        .unwrap_or_else(|e| panic!("fetch from {name}: {e}"));
    let mut read = Vec::new();
    while let Some(m) = messages.next().await {
        let m = m.unwrap_or_else(|e| panic!("a message of {name}: {e}"));
        let headers = m
            .headers
            .iter()
            .flat_map(|h| h.iter())
            .filter_map(|(k, v)| Some((k.to_string(), v.last()?.as_str().to_owned())))
            .collect();
        read.push((headers, m.payload.to_vec()));
    }
    read
}

/// [`fresh_stream_at`] on the shared server.
pub async fn fresh_stream() -> (jetstream::Context, String, String) {
    fresh_stream_at(&nats_url()).await
}

/// A `nats-server` of the test's own with JetStream, on a free port, with an empty
/// store folder of its own (a brand-new server), optionally requiring a user and
/// password. Killed when dropped.
#[derive(Debug)]
pub struct OwnNats {
    port: u16,
    child: Option<Child>,
    dir: PathBuf,
    bin: String,
    auth: Option<(String, String)>,
    /// Serves TLS only, with the test CA's server certificate (`tls_dir()`).
    tls: bool,
}

impl OwnNats {
    /// Starts the server from `$NATS_SERVER_BIN`, `nats-server` on the `PATH` or
    /// `/usr/sbin/nats-server`, and waits until it accepts connections.
    pub fn start(auth: Option<(&str, &str)>) -> OwnNats {
        OwnNats::start_with(auth, false)
    }

    /// [`OwnNats::start`], a server that accepts TLS connections only, with the server
    /// certificate of the test CA (`crate::tls_dir()`, made by `scripts/services.sh`;
    /// it names `localhost` and `127.0.0.1`).
    pub fn start_tls() -> OwnNats {
        OwnNats::start_with(None, true)
    }

    fn start_with(auth: Option<(&str, &str)>, tls: bool) -> OwnNats {
        let bin = std::env::var("NATS_SERVER_BIN")
            .ok()
            .or_else(|| {
                [
                    "/usr/sbin/nats-server",
                    "/usr/bin/nats-server",
                    "/usr/local/bin/nats-server",
                ]
                .into_iter()
                .find(|p| std::path::Path::new(p).exists())
                .map(str::to_owned)
            })
            .unwrap_or_else(|| "nats-server".to_owned());
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("find a free port")
            .port();
        let dir = std::env::temp_dir().join(format!("outbox-test-nats-{port}-{}", Uuid::now_v7()));
        std::fs::create_dir_all(&dir).expect("create the server's folder");
        let mut server = OwnNats {
            port,
            child: None,
            dir,
            bin,
            auth: auth.map(|(u, p)| (u.to_owned(), p.to_owned())),
            tls,
        };
        server.restart();
        server
    }

    /// Starts the server process (again, on the same port and store folder: what
    /// JetStream stored on disk survives) and waits until it accepts connections.
    pub fn restart(&mut self) {
        assert!(self.child.is_none(), "the server is already running");
        let (port, bin) = (self.port, self.bin.clone());
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.join("server.log"))
            .expect("open the server log");
        let mut command = Command::new(&bin);
        command
            .args(["-a", "127.0.0.1", "-p", &port.to_string(), "-js", "-sd"])
            .arg(self.dir.join("store"));
        if let Some((user, pass)) = &self.auth {
            command.args(["--user", user, "--pass", pass]);
        }
        if self.tls {
            let dir = crate::tls_dir();
            command
                .arg("--tls")
                .args(["--tlscert", &format!("{dir}/server.crt")])
                .args(["--tlskey", &format!("{dir}/server.key")]);
        }
        let child = command
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log handle"))
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| {
                panic!(
                    "start {bin}: {e}; this test runs a NATS server of its own: install \
                     nats-server (apt-get install nats-server) or set NATS_SERVER_BIN"
                )
            });
        self.child = Some(child);
        let server = &*self;
        let deadline = Instant::now() + Duration::from_secs(20);
        let sock = format!("127.0.0.1:{port}").parse().expect("address");
        while TcpStream::connect_timeout(&sock, Duration::from_millis(200)).is_err() {
            assert!(
                Instant::now() < deadline,
                "nats-server did not listen on port {port} within 20 s; see {}",
                server.dir.join("server.log").display()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// SIGKILLs the server and reaps it.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// `nats://127.0.0.1:<port>` (`tls://localhost:<port>` for a TLS server: the name
    /// its certificate is verified against).
    pub fn url(&self) -> String {
        if self.tls {
            format!("tls://localhost:{}", self.port)
        } else {
            format!("nats://127.0.0.1:{}", self.port)
        }
    }

    /// The port it listens on.
    pub fn port(&self) -> u16 {
        self.port
    }
}

impl Drop for OwnNats {
    fn drop(&mut self) {
        self.kill();
        // A failed test shows what the server said (its start, slow consumers, JetStream
        // errors): one red run is enough to tell the server's part from ours.
        if std::thread::panicking() {
            let log = std::fs::read_to_string(self.dir.join("server.log")).unwrap_or_default();
            let tail: Vec<&str> = log.lines().rev().take(40).collect::<Vec<_>>();
            eprintln!(
                "---- the last lines of nats-server on port {} ----\n{}\n---- end ----",
                self.port,
                tail.into_iter().rev().collect::<Vec<_>>().join("\n")
            );
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
