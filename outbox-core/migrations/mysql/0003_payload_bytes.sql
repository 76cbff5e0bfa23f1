-- Payloads are bytes: `body` holds the exact bytes written at emit (JSON as serde wrote
-- it, Protobuf, Avro, ...), `content_type` says what they are. A JSON column cannot hold
-- binary formats (and MySQL's re-renders JSON).
--
-- Rows written before keep their `payload` and no `body`; they are published with the
-- bytes of their JSON text, as before. New rows leave `payload` NULL. One statement, so
-- a failure leaves the table as it was: allowing NULL in `payload` makes it an online
-- rebuild on InnoDB (writes go on while it copies; measured in docs/databases.md). A
-- later version drops `payload` once no row needs it.
ALTER TABLE {outbox}
    ADD COLUMN body LONGBLOB NULL,
    ADD COLUMN content_type VARCHAR(255) NOT NULL DEFAULT 'application/json',
    MODIFY payload JSON NULL;
