-- A consumer writes here each message whose handler is failing: one row per consumer and
-- message, from its first failure until it is handled, skipped or dead-lettered. `outbox
-- status`, `outbox doctor` and the dashboard read it.
CREATE TABLE {processed+_failing} (
    consumer        TEXT    NOT NULL,
    message_id      TEXT    NOT NULL,
    event_type      TEXT    NOT NULL,
    partition_key   TEXT,
    origin          TEXT    NOT NULL,
    attempts        INTEGER NOT NULL,
    first_failed_at TEXT    NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now')),
    last_failed_at  TEXT    NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now')),
    last_error      TEXT    NOT NULL,
    PRIMARY KEY (consumer, message_id)
);

-- Each running consumer instance writes its row here every heartbeat and deletes it when
-- it stops.
CREATE TABLE {processed+_consumers} (
    consumer       TEXT    NOT NULL,
    instance       TEXT    NOT NULL,
    transport      TEXT    NOT NULL,
    interval_ms    INTEGER NOT NULL,
    started_at     TEXT    NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now')),
    seen_at        TEXT    NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now')),
    handled        INTEGER NOT NULL,
    handler_errors INTEGER NOT NULL,
    lag            INTEGER,
    PRIMARY KEY (consumer, instance)
);
