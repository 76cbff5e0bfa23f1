-- `xact_id` was written with every row and never read: the relay's publish horizon
-- comes from the writer lock, not from transaction ids. Writers stop filling it; the
-- column becomes nullable without a default, so rows cost nothing for it while writers of
-- an older version (which still set it) may run during a rolling upgrade. A later
-- migration drops it.
ALTER TABLE {outbox}
    ALTER COLUMN xact_id DROP DEFAULT,
    ALTER COLUMN xact_id DROP NOT NULL;
