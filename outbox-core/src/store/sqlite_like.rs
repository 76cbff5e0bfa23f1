//! What the MySQL/MariaDB and SQLite stores share: the multi-row `INSERT` with `?`
//! placeholders and the headers' JSON text.

use crate::{Error, OutboxMessage, Result};

pub(crate) fn headers_json(m: &OutboxMessage) -> Result<String> {
    if m.headers.is_empty() {
        return Ok("{}".to_owned());
    }
    serde_json::to_string(&m.headers).map_err(|source| Error::Serialize {
        event_type: m.event_type.clone(),
        source,
    })
}

/// `INSERT INTO t (...) VALUES (?, ...), (?, ...)`: rows draw `seq` in emit order.
pub(crate) fn insert_sql(outbox: &str, rows: usize) -> String {
    let mut sql = format!(
        "INSERT INTO {outbox} (id, event_type, event_version, destination, partition_key, payload, headers) VALUES "
    );
    for i in 0..rows {
        if i > 0 {
            sql.push_str(", ");
        }
        sql.push_str("(?, ?, ?, ?, ?, ?, ?)");
    }
    sql
}
