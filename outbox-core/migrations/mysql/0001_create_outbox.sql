-- The outbox table on MySQL/MariaDB: the same columns as on PostgreSQL, in InnoDB types.
-- Ids are CHAR(36) UUID text (readable in a console, the same text Debezium forwards);
-- timestamps DATETIME(6) in UTC; payload and headers JSON (on MariaDB an alias of LONGTEXT
-- with a JSON_VALID check). Keys, types and destinations are at most 255 characters.
CREATE TABLE {outbox} (
    seq             BIGINT       NOT NULL AUTO_INCREMENT PRIMARY KEY,
    id              CHAR(36)     NOT NULL,
    event_type      VARCHAR(255) NOT NULL,
    event_version   INT,
    destination     VARCHAR(255) NOT NULL,
    partition_key   VARCHAR(255),
    payload         JSON         NOT NULL,
    headers         JSON         NOT NULL,
    created_at      DATETIME(6)  NOT NULL DEFAULT CURRENT_TIMESTAMP(6),
    sent_at         DATETIME(6),
    attempts        INT          NOT NULL DEFAULT 0,
    next_attempt_at DATETIME(6),
    last_error      TEXT,
    dead_at         DATETIME(6),
    CONSTRAINT {outbox:_id_key} UNIQUE (id),
    -- InnoDB has no partial indexes: pending rows are (NULL, NULL, seq...) in this one.
    INDEX {outbox:_pending_idx} (sent_at, dead_at, seq),
    INDEX {outbox:_retrying_idx} (partition_key, seq),
    INDEX {outbox:_dead_idx} (dead_at)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin;

-- The writer lock: every transaction writing outbox rows locks this row (SELECT ... FOR
-- UPDATE) just before its INSERT and keeps it until it ends, so outbox writers commit one
-- after the other and rows become visible in `seq` order (AUTO_INCREMENT values alone
-- can commit out of order).
CREATE TABLE {outbox+_lock} (
    id TINYINT NOT NULL PRIMARY KEY
) ENGINE = InnoDB;

INSERT INTO {outbox+_lock} (id) VALUES (1);

-- Consumers record the ids they processed, in the same transaction as their effect.
CREATE TABLE {processed} (
    consumer     VARCHAR(255) NOT NULL,
    message_id   CHAR(36)     NOT NULL,
    processed_at DATETIME(6)  NOT NULL DEFAULT CURRENT_TIMESTAMP(6),
    PRIMARY KEY (consumer, message_id),
    INDEX {processed:_processed_at_idx} (processed_at)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin;
