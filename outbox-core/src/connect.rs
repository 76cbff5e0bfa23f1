//! Connecting a pool from a URL, the same way for every database with a server.

use sqlx::{ConnectOptions as _, Connection};

use crate::{Error, Result};

/// A pool connected to `url`. One direct connection is made first: a pool retries until
/// its acquire timeout (30 s), while a server that is down should be reported at once.
/// Errors name the server without its password ([`Error::Unavailable`]), or say what the
/// server refused ([`Error::Database`]).
pub(crate) async fn pool<DB: sqlx::Database>(url: &str) -> Result<sqlx::Pool<DB>> {
    let target = format!(" at {}", crate::error::redact_url(url));
    let classify = |source: sqlx::Error| match source {
        sqlx::Error::Database(_) | sqlx::Error::Configuration(_) => Error::Database {
            context: "connecting to the database",
            source,
        },
        source => Error::Unavailable {
            target: target.clone(),
            source,
        },
    };
    let options: <DB::Connection as Connection>::Options = url.parse().map_err(classify)?;
    options
        .connect()
        .await
        .map_err(classify)?
        .close()
        .await
        .map_err(classify)?;
    sqlx::pool::PoolOptions::<DB>::new()
        .connect_with(options)
        .await
        .map_err(classify)
}
