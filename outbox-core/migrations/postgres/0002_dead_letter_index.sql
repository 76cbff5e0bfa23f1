-- Dead-lettered rows, for `outbox status`, `outbox dead` and `outbox release`: normally
-- a handful, so operators never scan the history to find them.
CREATE INDEX {outbox:_dead_idx} ON {outbox} (seq)
    WHERE dead_at IS NOT NULL;
