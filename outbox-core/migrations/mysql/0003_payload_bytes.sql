-- Payloads are bytes: `body` holds the exact bytes written at emit (JSON as serde wrote
-- it, Protobuf, Avro, ...), `content_type` says what they are. A JSON column cannot hold
-- binary formats (and MySQL's re-renders JSON).
--
-- Rows written before keep their `payload` and no `body`; they are published with the
-- bytes of their JSON text, as before. New rows leave `payload` NULL. Columns added at
-- the end are an instant change on InnoDB (MariaDB 10.3+, MySQL 8.0.12+); allowing NULL
-- in `payload` is instant on MariaDB 10.4+ and an in-place rebuild that lets writes go
-- on elsewhere. A later version drops `payload` once no row needs it.
ALTER TABLE {outbox}
    ADD COLUMN body LONGBLOB NULL,
    ADD COLUMN content_type VARCHAR(255) NOT NULL DEFAULT 'application/json';

ALTER TABLE {outbox} MODIFY payload JSON NULL;
