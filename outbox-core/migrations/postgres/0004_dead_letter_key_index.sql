-- The relay keeps the later messages of a key behind its dead letter: its claim looks for
-- a dead row of the same key with this (normally empty) index.
CREATE INDEX {outbox:_dead_key_idx} ON {outbox} (partition_key, seq)
    WHERE dead_at IS NOT NULL;
