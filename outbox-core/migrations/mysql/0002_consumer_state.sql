-- A consumer writes here each message whose handler is failing: one row per consumer and
-- message, from its first failure until it is handled, skipped or dead-lettered. `outbox
-- status`, `outbox doctor` and the dashboard read it.
CREATE TABLE {processed+_failing} (
    consumer        VARCHAR(255) NOT NULL,
    message_id      CHAR(36)     NOT NULL,
    event_type      VARCHAR(255) NOT NULL,
    partition_key   VARCHAR(255),
    origin          TEXT         NOT NULL,
    attempts        INT          NOT NULL,
    first_failed_at DATETIME(6)  NOT NULL DEFAULT CURRENT_TIMESTAMP(6),
    last_failed_at  DATETIME(6)  NOT NULL DEFAULT CURRENT_TIMESTAMP(6),
    last_error      TEXT         NOT NULL,
    PRIMARY KEY (consumer, message_id)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin;

-- Each running consumer instance writes its row here every heartbeat and deletes it when
-- it stops.
CREATE TABLE {processed+_consumers} (
    consumer       VARCHAR(255) NOT NULL,
    instance       CHAR(36)     NOT NULL,
    transport      VARCHAR(64)  NOT NULL,
    interval_ms    BIGINT       NOT NULL,
    started_at     DATETIME(6)  NOT NULL DEFAULT CURRENT_TIMESTAMP(6),
    seen_at        DATETIME(6)  NOT NULL DEFAULT CURRENT_TIMESTAMP(6),
    handled        BIGINT       NOT NULL,
    handler_errors BIGINT       NOT NULL,
    lag            BIGINT,
    PRIMARY KEY (consumer, instance)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin;
