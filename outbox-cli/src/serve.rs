//! `outbox serve`: a dashboard of one outbox and the JSON API it uses.
//!
//! Reads (status, throughput, dead letters grouped by error, the messages a key has
//! parked) are open to whoever reaches the address, which is 127.0.0.1 unless told
//! otherwise; requests naming another host (`Host:`) are refused, so a web page cannot
//! reach the dashboard through DNS rebinding. Actions (release, discard, replay) need
//! the token given at start, sent as `Authorization: Bearer <token>` and compared in
//! constant time (as SHA-256 digests: not even its length leaks). Without a token the
//! dashboard is read-only. The database URL, and so its password, is never shown; nor
//! are payloads and headers (the listings leave them out).

use std::collections::VecDeque;
use std::io::Write;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::extract::rejection::{JsonRejection, QueryRejection};
use axum::extract::{Query, Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::middleware::Next;
use axum::response::{Html, IntoResponse, Response};
use axum::routing::{get, post};
use chrono::{DateTime, Utc};
use outbox_core::admin::{Admin, ListFilter};
use outbox_core::{Backend, Outbox};
use serde::{Deserialize, Serialize};
use uuid::Uuid;

use crate::failure::{Failure, Result};

/// How long the dead letters grouped by error are reused (the grouping reads every
/// dead letter).
const ERRORS_TTL: Duration = Duration::from_secs(30);
/// How often the throughput is sampled, and how many samples are kept (15 minutes).
const SAMPLE_EVERY: Duration = Duration::from_secs(5);
const SAMPLES: usize = 180;
/// The largest page a listing returns.
const MAX_PAGE: u32 = 500;

struct App<DB: Backend> {
    admin: Admin<DB>,
    /// SHA-256 of the token.
    token: Option<[u8; 32]>,
    /// Host names the dashboard answers to (any port), besides IP addresses.
    hosts: Vec<String>,
    samples: Mutex<VecDeque<Sample>>,
    /// The sampler's last status: what `/api/status` answers, however many tabs ask.
    last_status: Mutex<Option<outbox_core::admin::Status>>,
    errors: Mutex<Option<(std::time::Instant, Vec<outbox_core::admin::DeadGroup>)>>,
}

fn digest(token: &str) -> [u8; 32] {
    use sha2::Digest;
    sha2::Sha256::digest(token.as_bytes()).into()
}

/// Messages written and published per second over one sampling interval, from the
/// table's highest `seq` and its pending and dead counts (no scan of the history).
#[derive(Debug, Clone, Serialize)]
struct Sample {
    at: DateTime<Utc>,
    written_per_second: f64,
    published_per_second: f64,
    pending: i64,
    dead: i64,
}

/// Serves the dashboard on `listen` until Ctrl-C.
pub async fn serve<DB: Backend>(
    outbox: Outbox<DB>,
    listen: SocketAddr,
    token: Option<crate::cli::Token>,
    allowed_hosts: Vec<String>,
    out: &mut impl Write,
) -> Result {
    let token = token.map(|t| t.0);
    if token.as_deref().is_some_and(|t| t.len() < 16) {
        return Err(Failure::Message(
            "the token is shorter than 16 characters: use a long random one (e.g. `openssl rand -hex 32`)"
                .to_owned(),
        ));
    }
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .map_err(|e| Failure::Message(format!("cannot listen on {listen}: {e}")))?;
    let address = listener.local_addr()?;
    let mut hosts = vec!["localhost".to_owned()];
    hosts.extend(
        allowed_hosts
            .iter()
            .map(|h| host_name(h).to_ascii_lowercase()),
    );
    let app = Arc::new(App {
        admin: Admin::new(outbox),
        token: token.as_deref().map(digest),
        hosts,
        samples: Mutex::new(VecDeque::with_capacity(SAMPLES)),
        last_status: Mutex::new(None),
        errors: Mutex::new(None),
    });
    writeln!(
        out,
        "outbox dashboard on http://{address}/ ({})",
        if app.token.is_some() {
            "actions need the token"
        } else {
            "read-only: start with --token or OUTBOX_TOKEN to release, discard and replay"
        }
    )?;
    out.flush()?;
    let sampler = tokio::spawn(sample(app.clone()));
    let router = Router::new()
        .route("/", get(page))
        .route("/api/status", get(status::<DB>))
        .route("/api/dead", get(dead::<DB>))
        .route("/api/dead/errors", get(dead_errors::<DB>))
        .route("/api/pending", get(pending::<DB>))
        .route("/api/release", post(release::<DB>))
        .route("/api/discard", post(discard::<DB>))
        .route("/api/replay", post(replay::<DB>))
        .layer(axum::middleware::from_fn_with_state(
            app.clone(),
            guard::<DB>,
        ))
        .with_state(app);
    let served = axum::serve(listener, router)
        .with_graceful_shutdown(stop_signal())
        .await;
    sampler.abort();
    served.map_err(|e| Failure::Message(format!("the dashboard stopped: {e}")))
}

/// Ctrl-C or SIGTERM (systemd, containers).
pub async fn stop_signal() {
    #[cfg(unix)]
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let terminate = std::future::pending::<()>();
    tokio::select! {
        r = tokio::signal::ctrl_c() => {
            if r.is_err() {
                std::future::pending::<()>().await;
            }
        }
        () = terminate => {}
    }
}

/// The name of a `Host` value: without its port, and without the brackets of an IPv6
/// address (`[::1]:8080` -> `::1`).
fn host_name(host: &str) -> &str {
    let host = host.trim();
    if let Some(rest) = host.strip_prefix('[') {
        return rest.split(']').next().unwrap_or(rest);
    }
    if host.matches(':').count() > 1 {
        return host; // a bare IPv6 address
    }
    host.split(':').next().unwrap_or(host)
}

/// Refuses requests for another host (DNS rebinding), and keeps the page out of frames.
async fn guard<DB: Backend>(
    State(app): State<Arc<App<DB>>>,
    request: Request,
    next: Next,
) -> Response {
    // A page that rebinds its own domain name to this address still sends that name:
    // answer IP addresses, `localhost` and the names allowed at start. No `Host` at
    // all (HTTP/1.0, a script) is not a browser.
    let host = request
        .headers()
        .get(header::HOST)
        .and_then(|h| h.to_str().ok())
        .map(host_name);
    let allowed = host.is_none_or(|name| {
        name.parse::<std::net::IpAddr>().is_ok()
            || app.hosts.iter().any(|h| h.eq_ignore_ascii_case(name))
    });
    if !allowed {
        return ApiError(
            StatusCode::MISDIRECTED_REQUEST,
            "this dashboard answers to localhost and IP addresses; start it with \
             --allowed-host NAME to answer to another name"
                .to_owned(),
        )
        .into_response();
    }
    let mut response = next.run(request).await;
    let headers = response.headers_mut();
    headers.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    headers.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static("frame-ancestors 'none'"),
    );
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    response
}

async fn sample<DB: Backend>(app: Arc<App<DB>>) {
    let mut last: Option<(std::time::Instant, i64, i64)> = None;
    let mut tick = tokio::time::interval(SAMPLE_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let Ok(status) = app.admin.status().await else {
            // Not the last good figures: `/api/status` reads the database itself, and
            // the page shows its error.
            *app.last_status.lock().unwrap_or_else(|p| p.into_inner()) = None;
            continue;
        };
        *app.last_status.lock().unwrap_or_else(|p| p.into_inner()) = Some(status.clone());
        let now = std::time::Instant::now();
        let Some(seq) = status.last_seq else {
            last = None; // an empty table: nothing to difference against
            continue;
        };
        let queued = status.pending + status.dead;
        if last.is_some_and(|(_, last_seq, _)| seq < last_seq) {
            last = None; // rows deleted from the top: start again
            continue;
        }
        if let Some((then, last_seq, last_queued)) = last {
            let secs = now.duration_since(then).as_secs_f64().max(0.001);
            let written = (seq - last_seq).max(0) as f64;
            // Written minus what stayed queued; a replay (queued without a write) is
            // clamped rather than shown as negative publishing.
            let published = (written - (queued - last_queued) as f64).max(0.0);
            let mut samples = app.samples.lock().unwrap_or_else(|p| p.into_inner());
            if samples.len() == SAMPLES {
                samples.pop_front();
            }
            samples.push_back(Sample {
                at: Utc::now(),
                written_per_second: written / secs,
                published_per_second: published / secs,
                pending: status.pending,
                dead: status.dead,
            });
        }
        last = Some((now, seq, queued));
    }
}

async fn page() -> Html<&'static str> {
    Html(include_str!("serve/page.html"))
}

/// An error as JSON: `{"error": "..."}`.
struct ApiError(StatusCode, String);

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.0, axum::Json(serde_json::json!({ "error": self.1 }))).into_response()
    }
}

impl From<outbox_core::Error> for ApiError {
    fn from(e: outbox_core::Error) -> Self {
        use outbox_core::Error;
        let code = match &e {
            Error::UnknownMessage { .. } => StatusCode::NOT_FOUND,
            Error::WrongState { .. } => StatusCode::CONFLICT,
            Error::InvalidArgument(_) | Error::InvalidMessage(_) => StatusCode::BAD_REQUEST,
            Error::Unavailable { .. } | Error::Tls { .. } => StatusCode::SERVICE_UNAVAILABLE,
            _ => StatusCode::INTERNAL_SERVER_ERROR,
        };
        ApiError(code, outbox_core::ErrorChain(&e).to_string())
    }
}

impl From<JsonRejection> for ApiError {
    fn from(e: JsonRejection) -> Self {
        ApiError(
            StatusCode::BAD_REQUEST,
            format!("a JSON body was expected: {}", e.body_text()),
        )
    }
}

impl From<QueryRejection> for ApiError {
    fn from(e: QueryRejection) -> Self {
        ApiError(StatusCode::BAD_REQUEST, e.body_text())
    }
}

type ApiResult<T> = std::result::Result<axum::Json<T>, ApiError>;

#[derive(Serialize)]
struct StatusView {
    status: outbox_core::admin::Status,
    throughput: Vec<Sample>,
    actions_enabled: bool,
}

async fn status<DB: Backend>(State(app): State<Arc<App<DB>>>) -> ApiResult<StatusView> {
    let cached = app
        .last_status
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .clone();
    let status = match cached {
        Some(status) => status,
        None => app.admin.status().await?, // before the sampler's first reading
    };
    let throughput = app
        .samples
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .iter()
        .cloned()
        .collect();
    Ok(axum::Json(StatusView {
        status,
        throughput,
        actions_enabled: app.token.is_some(),
    }))
}

#[derive(Deserialize)]
struct Page {
    after_seq: Option<i64>,
    limit: Option<u32>,
    key: Option<String>,
}

/// A message as the listings show it: `MessageInfo` without its payload and headers.
fn row(message: outbox_core::admin::MessageInfo) -> serde_json::Value {
    let mut value = serde_json::to_value(message).unwrap_or_default();
    if let Some(fields) = value.as_object_mut() {
        fields.remove("payload");
        fields.remove("headers");
    }
    value
}

#[derive(Serialize)]
struct Listing {
    messages: Vec<serde_json::Value>,
    /// `after_seq` for the next page; `None` on the last one.
    next_after_seq: Option<i64>,
}

/// The listing's filter, and the page size asked for: the filter asks one row more, so
/// that a page that is exactly full still knows whether another follows.
fn filter(page: Page) -> std::result::Result<(ListFilter, u32), ApiError> {
    let limit = page.limit.unwrap_or(50);
    if limit == 0 || limit > MAX_PAGE {
        return Err(ApiError(
            StatusCode::BAD_REQUEST,
            format!("limit must be between 1 and {MAX_PAGE}"),
        ));
    }
    let mut filter = ListFilter::default();
    filter.key = page.key;
    filter.after_seq = page.after_seq;
    filter.limit = limit + 1;
    Ok((filter, limit))
}

fn listing(mut messages: Vec<outbox_core::admin::MessageInfo>, limit: u32) -> Listing {
    // One row past the page: there is a next page, and it starts after the page's last.
    let next_after_seq = if messages.len() > limit as usize {
        messages.truncate(limit as usize);
        messages.last().map(|m| m.seq)
    } else {
        None
    };
    Listing {
        messages: messages.into_iter().map(row).collect(),
        next_after_seq,
    }
}

async fn dead<DB: Backend>(
    State(app): State<Arc<App<DB>>>,
    page: std::result::Result<Query<Page>, QueryRejection>,
) -> ApiResult<Listing> {
    let (filter, limit) = filter(page?.0)?;
    let messages = app.admin.dead(&filter).await?;
    Ok(axum::Json(listing(messages, limit)))
}

async fn pending<DB: Backend>(
    State(app): State<Arc<App<DB>>>,
    page: std::result::Result<Query<Page>, QueryRejection>,
) -> ApiResult<Listing> {
    let (filter, limit) = filter(page?.0)?;
    let messages = app.admin.pending(&filter).await?;
    Ok(axum::Json(listing(messages, limit)))
}

async fn dead_errors<DB: Backend>(
    State(app): State<Arc<App<DB>>>,
) -> ApiResult<Vec<outbox_core::admin::DeadGroup>> {
    let cached = app.errors.lock().unwrap_or_else(|p| p.into_inner()).clone();
    if let Some((at, groups)) = cached
        && at.elapsed() < ERRORS_TTL
    {
        return Ok(axum::Json(groups));
    }
    let groups = app.admin.dead_by_error(50).await?;
    *app.errors.lock().unwrap_or_else(|p| p.into_inner()) =
        Some((std::time::Instant::now(), groups.clone()));
    Ok(axum::Json(groups))
}

/// Forgets the cached status and error groups (after an action changed messages).
fn forget_cached<DB: Backend>(app: &App<DB>) {
    *app.errors.lock().unwrap_or_else(|p| p.into_inner()) = None;
    *app.last_status.lock().unwrap_or_else(|p| p.into_inner()) = None;
}

/// The token check for actions: `Authorization: Bearer <token>`, compared in constant
/// time.
fn authorized<DB: Backend>(
    app: &App<DB>,
    headers: &HeaderMap,
) -> std::result::Result<(), ApiError> {
    use subtle::ConstantTimeEq;
    let Some(token) = &app.token else {
        return Err(ApiError(
            StatusCode::FORBIDDEN,
            "actions are disabled: start `outbox serve` with --token (or OUTBOX_TOKEN)".to_owned(),
        ));
    };
    let given = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| {
            v.get(..7)
                .filter(|p| p.eq_ignore_ascii_case("bearer "))
                .map(|_| &v[7..])
        })
        .unwrap_or("");
    if bool::from(digest(given).ct_eq(token)) {
        Ok(())
    } else {
        Err(ApiError(
            StatusCode::UNAUTHORIZED,
            "missing or wrong token (Authorization: Bearer <token>)".to_owned(),
        ))
    }
}

#[derive(Deserialize)]
struct Ids {
    ids: Vec<Uuid>,
}

#[derive(Serialize)]
struct Done {
    /// How many messages changed (with `preview`: would change).
    changed: u64,
    /// Nothing changed: a replay's preview.
    preview: bool,
}

fn some_ids(ids: &[Uuid]) -> std::result::Result<(), ApiError> {
    if ids.is_empty() {
        return Err(ApiError(StatusCode::BAD_REQUEST, "no ids given".to_owned()));
    }
    Ok(())
}

/// What `release` and `discard` do to the ids they are given.
#[derive(Clone, Copy)]
enum IdsAction {
    Release,
    Discard,
}

/// Checks the token and the ids, runs `action` (one transaction), forgets the caches.
async fn on_ids<DB: Backend>(
    app: &App<DB>,
    headers: &HeaderMap,
    body: std::result::Result<axum::Json<Ids>, JsonRejection>,
    action: IdsAction,
) -> ApiResult<Done> {
    authorized(app, headers)?;
    let body = body?.0;
    some_ids(&body.ids)?;
    let changed = match action {
        IdsAction::Release => app.admin.release(&body.ids).await?,
        IdsAction::Discard => app.admin.discard(&body.ids).await?,
    };
    forget_cached(app);
    Ok(axum::Json(Done {
        changed,
        preview: false,
    }))
}

async fn release<DB: Backend>(
    State(app): State<Arc<App<DB>>>,
    headers: HeaderMap,
    body: std::result::Result<axum::Json<Ids>, JsonRejection>,
) -> ApiResult<Done> {
    on_ids(&app, &headers, body, IdsAction::Release).await
}

async fn discard<DB: Backend>(
    State(app): State<Arc<App<DB>>>,
    headers: HeaderMap,
    body: std::result::Result<axum::Json<Ids>, JsonRejection>,
) -> ApiResult<Done> {
    on_ids(&app, &headers, body, IdsAction::Discard).await
}

#[derive(Deserialize)]
struct Replay {
    #[serde(default)]
    ids: Vec<Uuid>,
    since: Option<DateTime<Utc>>,
    until: Option<DateTime<Utc>>,
    destination: Option<String>,
    /// With `since`/`until`: count what the window holds, change nothing.
    #[serde(default)]
    preview: bool,
}

async fn replay<DB: Backend>(
    State(app): State<Arc<App<DB>>>,
    headers: HeaderMap,
    body: std::result::Result<axum::Json<Replay>, JsonRejection>,
) -> ApiResult<Done> {
    authorized(&app, &headers)?;
    let body = body?.0;
    let changed = match (body.ids.is_empty(), body.since, body.until) {
        (false, None, None) if !body.preview => app.admin.replay(&body.ids).await?,
        (true, Some(since), Some(until)) if body.preview => {
            let n = app
                .admin
                .preview_replay_sent_between(since, until, body.destination.as_deref())
                .await?;
            return Ok(axum::Json(Done {
                changed: n,
                preview: true,
            }));
        }
        (true, Some(since), Some(until)) => {
            app.admin
                .replay_sent_between(since, until, body.destination.as_deref())
                .await?
        }
        _ => {
            return Err(ApiError(
                StatusCode::BAD_REQUEST,
                "give either `ids`, or `since` and `until` (RFC 3339) with an optional `destination` (and `preview: true` to count first)"
                    .to_owned(),
            ));
        }
    };
    forget_cached(&app);
    Ok(axum::Json(Done {
        changed,
        preview: false,
    }))
}
