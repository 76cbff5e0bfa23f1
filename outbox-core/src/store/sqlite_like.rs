//! What the MySQL/MariaDB and SQLite stores share: the multi-row `INSERT` with `?`
//! placeholders, and how a commit's messages are split into such statements.

#[cfg(feature = "mysql")]
use crate::OutboxMessage;

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

/// Splits `messages`, in order, into runs of at most `max_rows` messages and at most
/// about `max_bytes` of values (a message larger than that goes alone): one `INSERT`
/// each. The byte bound keeps a statement under the server's packet limit (MySQL's
/// `max_allowed_packet`), which 9,000 large rows would exceed. (SQLite has no such
/// limit on bound values; its store splits by rows only.)
#[cfg(feature = "mysql")]
pub(crate) fn chunks(
    messages: &[OutboxMessage],
    max_rows: usize,
    max_bytes: usize,
) -> Vec<&[OutboxMessage]> {
    let mut out = Vec::new();
    let (mut start, mut bytes) = (0, 0);
    for (i, m) in messages.iter().enumerate() {
        let size = 64 // the id, the version, the statement's own text per row
            + m.event_type.len()
            + m.destination.len()
            + m.partition_key.as_ref().map_or(0, String::len)
            + m.payload.len()
            + m.headers.iter().map(|(k, v)| k.len() + v.len() + 6).sum::<usize>();
        if i > start && (i - start == max_rows || bytes + size > max_bytes) {
            out.push(&messages[start..i]);
            (start, bytes) = (i, 0);
        }
        bytes += size;
    }
    if start < messages.len() {
        out.push(&messages[start..]);
    }
    out
}

#[cfg(all(test, feature = "mysql"))]
mod tests {
    use super::*;

    #[test]
    fn chunks_are_bounded_by_rows_and_bytes_and_keep_the_order() {
        let m = |n: usize| OutboxMessage::new("T", "d", "x".repeat(n));
        let messages: Vec<OutboxMessage> = [10, 10, 10, 500, 10, 2000, 10].map(m).into();
        let sizes = |max_rows, max_bytes| -> Vec<usize> {
            chunks(&messages, max_rows, max_bytes)
                .iter()
                .map(|c| c.len())
                .collect()
        };
        assert_eq!(sizes(1000, usize::MAX), vec![7]);
        assert_eq!(sizes(3, usize::MAX), vec![3, 3, 1]);
        // 76 bytes each for the small ones, 566 and 2066 for the large ones.
        assert_eq!(sizes(1000, 700), vec![3, 2, 1, 1]);
        assert_eq!(
            sizes(1000, 1),
            vec![1; 7],
            "a message over the budget goes alone"
        );
        let flat: Vec<OutboxMessage> = chunks(&messages, 2, 300).concat();
        assert_eq!(flat, messages, "in order, each once");
        assert!(chunks(&[], 10, 10).is_empty());
    }
}
