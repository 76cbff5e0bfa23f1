//! `outbox serve`: a dashboard of one outbox and the JSON API it uses.
//!
//! Reads (status, throughput, dead letters grouped by error, the messages a key has
//! parked) are open to whoever reaches the address, which is 127.0.0.1 unless told
//! otherwise; actions (release, discard, replay) need the token given at start, sent as
//! `Authorization: Bearer <token>` and compared in constant time. Without a token the
//! dashboard is read-only. The database URL, and so its password, is never shown.

use std::collections::VecDeque;
use std::io::Write;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::extract::{Query, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{Html, IntoResponse, Response};
use axum::routing::{get, post};
use chrono::{DateTime, Utc};
use outbox_core::admin::{Admin, ListFilter};
use outbox_core::{Backend, Outbox};
use serde::{Deserialize, Serialize};
use uuid::Uuid;

use crate::commands::{Failure, Result};

/// How often the throughput is sampled, and how many samples are kept (15 minutes).
const SAMPLE_EVERY: Duration = Duration::from_secs(5);
const SAMPLES: usize = 180;
/// The largest page a listing returns.
const MAX_PAGE: u32 = 500;

struct App<DB: Backend> {
    admin: Admin<DB>,
    token: Option<String>,
    samples: Mutex<VecDeque<Sample>>,
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
    token: Option<String>,
    out: &mut impl Write,
) -> Result {
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
    let app = Arc::new(App {
        admin: Admin::new(outbox),
        token,
        samples: Mutex::new(VecDeque::with_capacity(SAMPLES)),
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
        .with_state(app);
    let served = axum::serve(listener, router)
        .with_graceful_shutdown(async {
            let _ = tokio::signal::ctrl_c().await;
        })
        .await;
    sampler.abort();
    served.map_err(|e| Failure::Message(format!("the dashboard stopped: {e}")))
}

async fn sample<DB: Backend>(app: Arc<App<DB>>) {
    let mut last: Option<(std::time::Instant, i64, i64)> = None;
    let mut tick = tokio::time::interval(SAMPLE_EVERY);
    loop {
        tick.tick().await;
        let Ok(status) = app.admin.status().await else {
            continue; // the next tick tries again; the page shows the error itself
        };
        let now = std::time::Instant::now();
        let seq = status.last_seq.unwrap_or(0);
        let queued = status.pending + status.dead;
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
            _ => StatusCode::SERVICE_UNAVAILABLE,
        };
        ApiError(code, e.to_string())
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
    let status = app.admin.status().await?;
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

#[derive(Serialize)]
struct Listing {
    messages: Vec<outbox_core::admin::MessageInfo>,
    /// `after_seq` for the next page; `None` on the last one.
    next_after_seq: Option<i64>,
}

fn filter(page: Page) -> std::result::Result<ListFilter, ApiError> {
    let limit = page.limit.unwrap_or(50);
    if limit == 0 || limit > MAX_PAGE {
        return Err(ApiError(
            StatusCode::BAD_REQUEST,
            format!("limit must be between 1 and {MAX_PAGE}"),
        ));
    }
    Ok(ListFilter {
        key: page.key,
        after_seq: page.after_seq,
        limit,
        ..ListFilter::default()
    })
}

fn listing(messages: Vec<outbox_core::admin::MessageInfo>, limit: u32) -> Listing {
    let next_after_seq = if messages.len() == limit as usize {
        messages.last().map(|m| m.seq)
    } else {
        None
    };
    Listing {
        messages,
        next_after_seq,
    }
}

async fn dead<DB: Backend>(
    State(app): State<Arc<App<DB>>>,
    Query(page): Query<Page>,
) -> ApiResult<Listing> {
    let filter = filter(page)?;
    let messages = app.admin.dead(&filter).await?;
    Ok(axum::Json(listing(messages, filter.limit)))
}

async fn pending<DB: Backend>(
    State(app): State<Arc<App<DB>>>,
    Query(page): Query<Page>,
) -> ApiResult<Listing> {
    let filter = filter(page)?;
    let messages = app.admin.pending(&filter).await?;
    Ok(axum::Json(listing(messages, filter.limit)))
}

async fn dead_errors<DB: Backend>(
    State(app): State<Arc<App<DB>>>,
) -> ApiResult<Vec<outbox_core::admin::DeadGroup>> {
    Ok(axum::Json(app.admin.dead_by_error(50).await?))
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
        .and_then(|v| v.strip_prefix("Bearer "))
        .unwrap_or("");
    if bool::from(given.as_bytes().ct_eq(token.as_bytes())) {
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
    changed: u64,
}

fn some_ids(ids: &[Uuid]) -> std::result::Result<(), ApiError> {
    if ids.is_empty() {
        return Err(ApiError(StatusCode::BAD_REQUEST, "no ids given".to_owned()));
    }
    Ok(())
}

async fn release<DB: Backend>(
    State(app): State<Arc<App<DB>>>,
    headers: HeaderMap,
    axum::Json(body): axum::Json<Ids>,
) -> ApiResult<Done> {
    authorized(&app, &headers)?;
    some_ids(&body.ids)?;
    Ok(axum::Json(Done {
        changed: app.admin.release(&body.ids).await?,
    }))
}

async fn discard<DB: Backend>(
    State(app): State<Arc<App<DB>>>,
    headers: HeaderMap,
    axum::Json(body): axum::Json<Ids>,
) -> ApiResult<Done> {
    authorized(&app, &headers)?;
    some_ids(&body.ids)?;
    Ok(axum::Json(Done {
        changed: app.admin.discard(&body.ids).await?,
    }))
}

#[derive(Deserialize)]
struct Replay {
    #[serde(default)]
    ids: Vec<Uuid>,
    since: Option<DateTime<Utc>>,
    until: Option<DateTime<Utc>>,
    destination: Option<String>,
}

async fn replay<DB: Backend>(
    State(app): State<Arc<App<DB>>>,
    headers: HeaderMap,
    axum::Json(body): axum::Json<Replay>,
) -> ApiResult<Done> {
    authorized(&app, &headers)?;
    let changed = match (body.ids.is_empty(), body.since, body.until) {
        (false, None, None) => app.admin.replay(&body.ids).await?,
        (true, Some(since), Some(until)) => {
            app.admin
                .replay_sent_between(since, until, body.destination.as_deref())
                .await?
        }
        _ => {
            return Err(ApiError(
                StatusCode::BAD_REQUEST,
                "give either `ids`, or `since` and `until` (RFC 3339) with an optional `destination`"
                    .to_owned(),
            ));
        }
    };
    Ok(axum::Json(Done { changed }))
}
