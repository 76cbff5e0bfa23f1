-- Payloads are bytes: `body` holds the exact bytes written at emit (JSON as serde wrote
-- it, Protobuf, Avro, ...), `content_type` says what they are. SQLite cannot change a
-- column's constraints in place (`payload` had to be JSON text), so the table is rebuilt
-- in the migration's transaction: every row is copied with its `seq` and its payload's
-- bytes (the bytes it was published with before), and the AUTOINCREMENT counter carries
-- over, so no `seq` is ever used twice.
CREATE TEMP TABLE outbox_migration_sequence AS
    SELECT seq FROM {outbox.sqlite_sequence} WHERE name = {outbox.name};

CREATE TABLE {outbox+_rebuilt} (
    seq             INTEGER PRIMARY KEY AUTOINCREMENT,
    id              TEXT    NOT NULL,
    event_type      TEXT    NOT NULL,
    event_version   INTEGER,
    destination     TEXT    NOT NULL,
    partition_key   TEXT,
    body            BLOB    NOT NULL,
    content_type    TEXT    NOT NULL DEFAULT 'application/json',
    headers         TEXT    NOT NULL DEFAULT '{}' CHECK (json_valid(headers)),
    created_at      TEXT    NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now')),
    sent_at         TEXT,
    attempts        INTEGER NOT NULL DEFAULT 0,
    next_attempt_at TEXT,
    last_error      TEXT,
    dead_at         TEXT,
    CONSTRAINT {outbox:_id_key} UNIQUE (id)
);

INSERT INTO {outbox+_rebuilt}
    (seq, id, event_type, event_version, destination, partition_key, body, headers,
     created_at, sent_at, attempts, next_attempt_at, last_error, dead_at)
SELECT seq, id, event_type, event_version, destination, partition_key, CAST(payload AS BLOB),
       headers, created_at, sent_at, attempts, next_attempt_at, last_error, dead_at
FROM {outbox} ORDER BY seq;

DROP TABLE {outbox};

ALTER TABLE {outbox+_rebuilt} RENAME TO {outbox:};

DELETE FROM {outbox.sqlite_sequence} WHERE name = {outbox.name};

INSERT INTO {outbox.sqlite_sequence} (name, seq)
    SELECT {outbox.name}, seq FROM temp.outbox_migration_sequence;

DROP TABLE temp.outbox_migration_sequence;

CREATE INDEX {outbox:_pending_idx} ON {outbox} (seq)
    WHERE sent_at IS NULL AND dead_at IS NULL;

CREATE INDEX {outbox:_retrying_idx} ON {outbox} (partition_key, seq)
    WHERE sent_at IS NULL AND dead_at IS NULL AND next_attempt_at IS NOT NULL;

CREATE INDEX {outbox:_dead_idx} ON {outbox} (seq)
    WHERE dead_at IS NOT NULL;

CREATE INDEX {outbox:_dead_key_idx} ON {outbox} (partition_key, seq)
    WHERE dead_at IS NOT NULL;
