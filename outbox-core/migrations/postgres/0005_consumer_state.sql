-- A consumer writes here each message whose handler is failing: one row per consumer and
-- message, from its first failure until it is handled, skipped or dead-lettered. `outbox
-- status`, `outbox doctor` and the dashboard read it: a key stuck behind a failing
-- handler is visible where the operators look, not only in the consumer's log.
CREATE TABLE {processed+_failing} (
    consumer        text        NOT NULL,
    message_id      uuid        NOT NULL,
    event_type      text        NOT NULL,
    partition_key   text,
    origin          text        NOT NULL,
    attempts        int4        NOT NULL,
    first_failed_at timestamptz NOT NULL DEFAULT now(),
    last_failed_at  timestamptz NOT NULL DEFAULT now(),
    last_error      text        NOT NULL,
    PRIMARY KEY (consumer, message_id)
);

-- Each running consumer instance writes its row here every heartbeat (what it handled,
-- its handler errors, the lag its transport reports) and deletes it when it stops; a row
-- not refreshed for three of its intervals is an instance that died or cannot reach
-- the database.
CREATE TABLE {processed+_consumers} (
    consumer       text        NOT NULL,
    instance       uuid        NOT NULL,
    transport      text        NOT NULL,
    interval_ms    int8        NOT NULL,
    started_at     timestamptz NOT NULL DEFAULT now(),
    seen_at        timestamptz NOT NULL DEFAULT now(),
    handled        int8        NOT NULL,
    handler_errors int8        NOT NULL,
    lag            int8,
    PRIMARY KEY (consumer, instance)
);
