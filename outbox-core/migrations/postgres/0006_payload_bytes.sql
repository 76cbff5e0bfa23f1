-- Payloads are bytes: `body` holds the exact bytes written at emit (JSON as serde wrote
-- it, Protobuf, Avro, ...), `content_type` says what they are. `jsonb` re-rendered JSON
-- (keys reordered, spaces changed), so signatures over the body did not hold, and it
-- could not hold binary formats.
--
-- Rows written before keep their `payload` (jsonb) and no `body`; they are published with
-- the bytes of `payload::text`, the bytes they were published with before. New rows leave
-- `payload` NULL. Every step is a change of the catalog only (a nullable column, a column
-- with a constant default, dropping NOT NULL): no table rewrite, and the exclusive lock
-- is held for milliseconds whatever the table's size. A later version drops `payload`
-- once no row needs it.
ALTER TABLE {outbox}
    ADD COLUMN body bytea,
    ADD COLUMN content_type text NOT NULL DEFAULT 'application/json',
    ALTER COLUMN payload DROP NOT NULL;
