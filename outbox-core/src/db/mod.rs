//! The databases, one folder each. A folder holds everything its database does: the
//! write path, the migration dialect, the relay session, the stored-message SQL and its
//! constants. `lite.rs` is what MySQL/MariaDB and SQLite share (their dialects render the
//! same statements); `rows.rs` decodes rows the same way for all. Nothing outside this
//! folder names a database module: the rest of the crate drives them through the traits
//! of [`store`](crate::store).
//!
//! The list of databases, each behind its cargo feature:

#[cfg(feature = "mysql")]
mod mysql;
#[cfg(feature = "postgres")]
pub(crate) mod postgres;
#[cfg(feature = "sqlite")]
mod sqlite;

#[cfg(any(feature = "postgres", feature = "mysql"))]
mod connect;
#[cfg(any(feature = "mysql", feature = "sqlite"))]
mod lite;
// The retry rule the databases without it in SQL apply (and WAL mode's stream).
#[cfg(any(feature = "wal", feature = "mysql", feature = "sqlite"))]
mod retry;
mod rows;

#[cfg(feature = "wal")]
pub(crate) use retry::retry_plan;

// For the fuzz targets (`crate::fuzzing`).
#[cfg(all(feature = "fuzzing", any(feature = "postgres", feature = "mysql")))]
pub use connect::redact_url;
#[cfg(all(feature = "fuzzing", feature = "postgres"))]
pub use postgres::mask_literals;
