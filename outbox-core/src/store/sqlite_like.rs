//! What the MySQL/MariaDB and SQLite stores share: the multi-row `INSERT` with `?`
//! placeholders.

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
