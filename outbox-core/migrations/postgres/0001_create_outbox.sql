-- The outbox table: one row per message, written in the business transaction.
-- `seq` orders the relay; `xact_id` is the writing transaction (for visibility checks);
-- `id` is the message id consumers deduplicate on.
CREATE TABLE {outbox} (
    seq             bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    id              uuid        NOT NULL,
    xact_id         xid8        NOT NULL DEFAULT pg_current_xact_id(),
    event_type      text        NOT NULL,
    event_version   integer,
    destination     text        NOT NULL,
    partition_key   text,
    payload         jsonb       NOT NULL,
    headers         jsonb       NOT NULL DEFAULT '{}'::jsonb,
    created_at      timestamptz NOT NULL DEFAULT now(),
    sent_at         timestamptz,
    attempts        integer     NOT NULL DEFAULT 0,
    next_attempt_at timestamptz,
    last_error      text,
    dead_at         timestamptz,
    CONSTRAINT {outbox:_id_key} UNIQUE (id)
);

-- The relay only ever scans pending rows, never history.
CREATE INDEX {outbox:_pending_idx} ON {outbox} (seq)
    WHERE sent_at IS NULL AND dead_at IS NULL;

-- Rows that failed and wait for a retry block the later rows of their key; the relay
-- checks for them with this (normally empty) index.
CREATE INDEX {outbox:_retrying_idx} ON {outbox} (partition_key, seq)
    WHERE sent_at IS NULL AND dead_at IS NULL AND next_attempt_at IS NOT NULL;

-- Consumers record the ids they processed, in the same transaction as their effect.
CREATE TABLE {processed} (
    consumer     text        NOT NULL,
    message_id   uuid        NOT NULL,
    processed_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, message_id)
);

-- Retention deletes old processed ids by age.
CREATE INDEX {processed:_processed_at_idx} ON {processed} (processed_at);
