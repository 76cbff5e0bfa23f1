-- The outbox table on SQLite: the same columns as on PostgreSQL, in SQLite's types.
-- `seq` is an AUTOINCREMENT rowid: never reused, and, SQLite having one writer at a time,
-- rows become visible in `seq` order. Ids are UUID text (`0190...-...`), timestamps
-- RFC 3339 text in UTC with milliseconds (they sort as text), payload and headers JSON text.
CREATE TABLE {outbox} (
    seq             INTEGER PRIMARY KEY AUTOINCREMENT,
    id              TEXT    NOT NULL,
    event_type      TEXT    NOT NULL,
    event_version   INTEGER,
    destination     TEXT    NOT NULL,
    partition_key   TEXT,
    payload         TEXT    NOT NULL CHECK (json_valid(payload)),
    headers         TEXT    NOT NULL DEFAULT '{}' CHECK (json_valid(headers)),
    created_at      TEXT    NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now')),
    sent_at         TEXT,
    attempts        INTEGER NOT NULL DEFAULT 0,
    next_attempt_at TEXT,
    last_error      TEXT,
    dead_at         TEXT,
    CONSTRAINT {outbox:_id_key} UNIQUE (id)
);

-- The relay only ever scans pending rows, never history.
CREATE INDEX {outbox:_pending_idx} ON {outbox} (seq)
    WHERE sent_at IS NULL AND dead_at IS NULL;

-- Rows waiting for a retry block the later rows of their key.
CREATE INDEX {outbox:_retrying_idx} ON {outbox} (partition_key, seq)
    WHERE sent_at IS NULL AND dead_at IS NULL AND next_attempt_at IS NOT NULL;

-- Dead-lettered rows.
CREATE INDEX {outbox:_dead_idx} ON {outbox} (seq)
    WHERE dead_at IS NOT NULL;

-- Consumers record the ids they processed, in the same transaction as their effect.
CREATE TABLE {processed} (
    consumer     TEXT NOT NULL,
    message_id   TEXT NOT NULL,
    processed_at TEXT NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now')),
    PRIMARY KEY (consumer, message_id)
);

CREATE INDEX {processed:_processed_at_idx} ON {processed} (processed_at);
