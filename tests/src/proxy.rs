//! A small fault-injecting TCP proxy for tests: it forwards bytes between a client and a
//! server and, on demand, stalls (connections stay open, nothing moves), resets (every
//! open connection is closed), or, without a server behind it, is a black hole (it
//! accepts connections and never answers, like a frozen server). A proxy started with
//! [`Proxy::start_rewriting`] also rewrites what the server sends ([`Rewrite`]), for faults
//! of a protocol (the RabbitMQ tests coalesce the broker's confirms with it).

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// What the proxy does with the bytes of its connections.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Forward everything.
    Forward,
    /// Forward nothing; keep the connections open.
    Stall,
}

/// Rewrites what a server sends to its client, on one connection of a proxy started with
/// [`Proxy::start_rewriting`].
pub trait Rewrite: Send + 'static {
    /// `bytes` came from the server; returns what to send the client now.
    fn feed(&mut self, bytes: &[u8]) -> Vec<u8>;
    /// Called at every tick of the proxy's interval: what to send the client now (for
    /// what [`feed`](Self::feed) held back).
    fn tick(&mut self) -> Vec<u8>;
}

/// Makes the [`Rewrite`] of each new connection.
type Rewriter = Arc<dyn Fn() -> Box<dyn Rewrite> + Send + Sync>;

#[derive(Debug)]
struct State {
    mode: Mode,
    /// Bumped by [`Proxy::reset`]: connections of an older generation close.
    generation: u64,
    /// Set by [`Proxy::freeze_open`]: connections accepted before it never move again.
    frozen_before: u64,
}

/// A running proxy; it stops when dropped.
#[derive(Debug)]
pub struct Proxy {
    addr: SocketAddr,
    state: Arc<watch::Sender<State>>,
    accepted: Arc<AtomicU64>,
    /// Reads that a stall held back, either way (see [`Proxy::held`]).
    held: Arc<AtomicU64>,
    task: JoinHandle<()>,
}

impl Proxy {
    /// A proxy on a free local port in front of `upstream`.
    pub async fn start(upstream: SocketAddr) -> Proxy {
        Proxy::listen(Some(upstream), None).await
    }

    /// A proxy in front of `upstream` that passes what the server sends through a
    /// [`Rewrite`] made by `rewrite` for each connection, ticking it every `interval`.
    pub async fn start_rewriting<R>(
        upstream: SocketAddr,
        interval: std::time::Duration,
        rewrite: impl Fn() -> R + Send + Sync + 'static,
    ) -> Proxy
    where
        R: Rewrite,
    {
        let rewriter: Rewriter = Arc::new(move || Box::new(rewrite()) as Box<dyn Rewrite>);
        Proxy::listen(Some(upstream), Some((rewriter, interval))).await
    }

    /// A listener that accepts connections and never answers: a frozen server, or a
    /// proxy whose backend is gone.
    pub async fn black_hole() -> Proxy {
        Proxy::listen(None, None).await
    }

    async fn listen(
        upstream: Option<SocketAddr>,
        rewriter: Option<(Rewriter, std::time::Duration)>,
    ) -> Proxy {
        // A test with a proxy injects faults: its log is what a red run is read from.
        crate::init_tracing();
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("address");
        let state = Arc::new(
            watch::channel(State {
                mode: Mode::Forward,
                generation: 0,
                frozen_before: 0,
            })
            .0,
        );
        let shared = Arc::clone(&state);
        let accepted = Arc::new(AtomicU64::new(0));
        let counter = Arc::clone(&accepted);
        let held = Arc::new(AtomicU64::new(0));
        let holding = Arc::clone(&held);
        let task = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let number = counter.fetch_add(1, Ordering::SeqCst);
                let state = shared.subscribe();
                let rewrite = rewriter
                    .as_ref()
                    .map(|(make, interval)| (make(), *interval));
                let holding = Arc::clone(&holding);
                tokio::spawn(connection(
                    client, upstream, state, number, holding, rewrite,
                ));
            }
        });
        Proxy {
            addr,
            state,
            accepted,
            held,
            task,
        }
    }

    /// Where clients connect.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `url` with its host and port replaced by the proxy's (`scheme://user@host:port/...`).
    pub fn url_for(&self, url: &str) -> String {
        let (scheme, rest) = url.split_once("://").expect("a URL");
        let (userinfo, rest) = match rest.rsplit_once('@') {
            Some((u, r)) => (format!("{u}@"), r),
            None => (String::new(), rest),
        };
        let tail = rest.find(['/', '?']).map_or("", |i| &rest[i..]);
        format!("{scheme}://{userinfo}{}{tail}", self.addr)
    }

    /// Connections accepted so far.
    pub fn accepted(&self) -> u64 {
        self.accepted.load(Ordering::SeqCst)
    }

    /// How many times bytes arrived, from a client or from the server, while the proxy
    /// stalled (or froze their connection) and were held back: a client has sent a
    /// request into the stall, or its answer is held there, and it waits. Unlike a count
    /// the client keeps, this cannot miss a request sent just before the stall began
    /// (its answer is held) nor count one that went through.
    pub fn held(&self) -> u64 {
        self.held.load(Ordering::SeqCst)
    }

    /// Forwards or stalls from now on.
    pub fn set(&self, mode: Mode) {
        self.state.send_modify(|s| s.mode = mode);
    }

    /// Closes every open connection (new ones are accepted as usual).
    pub fn reset(&self) {
        self.state.send_modify(|s| s.generation += 1);
    }

    /// Every open connection stays open and never moves a byte again, as after a network
    /// partition or a NAT that forgot them (neither side hears of it); new connections
    /// are forwarded as usual.
    pub fn freeze_open(&self) {
        let accepted = self.accepted();
        self.state.send_modify(|s| s.frozen_before = accepted);
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.task.abort();
        self.reset();
    }
}

async fn connection(
    client: TcpStream,
    upstream: Option<SocketAddr>,
    mut state: watch::Receiver<State>,
    number: u64,
    held: Arc<AtomicU64>,
    rewrite: Option<(Box<dyn Rewrite>, std::time::Duration)>,
) {
    let generation = state.borrow().generation;
    let reset = |state: &State| state.generation != generation;
    let Some(upstream) = upstream else {
        // A black hole: hold the connection, say nothing, until reset or dropped.
        let _client = client;
        let _ = state.wait_for(reset).await;
        return;
    };
    let Ok(server) = TcpStream::connect(upstream).await else {
        return;
    };
    // As clients set it on their own sockets: without it, Nagle's algorithm holds a small
    // write behind an unacknowledged one for the peer's delayed ACK (~40 ms), which no
    // direct connection would see.
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    let (client_read, client_write) = client.into_split();
    let (server_read, server_write) = server.into_split();
    let up = pump(
        client_read,
        server_write,
        state.clone(),
        generation,
        number,
        Some(Arc::clone(&held)),
        None,
    );
    let down = pump(
        server_read,
        client_write,
        state.clone(),
        generation,
        number,
        Some(held),
        rewrite,
    );
    tokio::select! {
        _ = up => {}
        _ = down => {}
        _ = state.wait_for(reset) => {}
    }
}

/// Copies `from` to `to` (through `rewrite`, if any) while the mode is `Forward`; holds
/// the bytes while it is `Stall` (counting each held read in `held`, when given).
async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    mut state: watch::Receiver<State>,
    generation: u64,
    number: u64,
    held: Option<Arc<AtomicU64>>,
    mut rewrite: Option<(Box<dyn Rewrite>, std::time::Duration)>,
) {
    let mut buf = vec![0u8; 16 * 1024];
    let mut ticks = rewrite
        .as_ref()
        .map(|(_, interval)| tokio::time::interval(*interval));
    loop {
        let tick = async {
            match ticks.as_mut() {
                Some(ticks) => {
                    ticks.tick().await;
                }
                None => std::future::pending().await,
            }
        };
        let out = tokio::select! {
            read = from.read(&mut buf) => match read {
                Ok(0) | Err(_) => return,
                Ok(n) => match rewrite.as_mut() {
                    Some((rewrite, _)) => rewrite.feed(&buf[..n]),
                    None => buf[..n].to_vec(),
                },
            },
            () = tick => match rewrite.as_mut() {
                Some((rewrite, _)) => rewrite.tick(),
                None => Vec::new(),
            },
        };
        if out.is_empty() {
            continue;
        }
        let moves = |s: &State| {
            (s.mode == Mode::Forward && number >= s.frozen_before) || s.generation != generation
        };
        if !moves(&state.borrow())
            && let Some(held) = &held
        {
            held.fetch_add(1, Ordering::SeqCst);
        }
        let forward = match state.wait_for(moves).await {
            Ok(s) => s.generation == generation,
            Err(_) => false,
        };
        if !forward {
            return;
        }
        if to.write_all(&out).await.is_err() {
            return;
        }
    }
}
