//! The replication stream: messages taken from it into the buffer (bounded in count and
//! bytes), the commits they belong to, what may be claimed, and the position confirmed.

use super::*;

/// The bytes of a message the memory bounds count: its payload and its headers.
pub(super) fn size_of_record(record: &OutboxRecord) -> usize {
    record.payload.len()
        + record
            .headers
            .iter()
            .map(|(k, v)| k.len() + v.len())
            .sum::<usize>()
}

/// `due` as a wall-clock time.
pub(super) fn wall(due: Option<Instant>) -> Option<DateTime<Utc>> {
    let now = Instant::now();
    due.filter(|d| *d > now)
        .and_then(|d| chrono::Duration::from_std(d - now).ok())
        .map(|d| Utc::now() + d)
}

impl WalSession<'_> {
    /// Takes in one event.
    pub(super) fn take(&mut self, event: ReplicationEvent) -> SessionResult<()> {
        match event {
            ReplicationEvent::Begin { .. } => (self.in_tx, self.tx_ours) = (true, false),
            ReplicationEvent::Commit { end_lsn, .. } => {
                self.in_tx = false;
                self.wal_end = self.wal_end.max(end_lsn);
                self.commits.push_back((self.next_seq - 1, end_lsn));
                self.confirm();
            }
            ReplicationEvent::Message {
                prefix, content, ..
            } if prefix == self.wal.prefix => {
                let record = decode(&content, self.next_seq).map_err(|e| {
                    // Never skipped: a message this relay cannot read stops it, and
                    // the slot keeps it for a relay that can.
                    SessionError::protocol(
                        format!("a WAL message of replication slot {:?}", self.wal.slot),
                        format!("{e}; the slot keeps it for a relay that can read it"),
                    )
                })?;
                self.next_seq += 1;
                self.tx_ours = true;
                let to_table = record
                    .partition_key
                    .as_ref()
                    .is_some_and(|k| self.parked.contains(k));
                self.bytes += size_of_record(&record);
                self.buffer.push_back(Entry {
                    record,
                    sent: false,
                    due: None,
                    row: None,
                    to_table,
                    outage: false,
                });
            }
            // Everything decoded up to `wal_end` has been received: with nothing
            // unacknowledged, the slot may move on (WAL of other activity is freed).
            ReplicationEvent::KeepAlive { wal_end, .. } => {
                self.wal_end = self.wal_end.max(wal_end);
                if !self.in_tx && self.commits.is_empty() && self.first_open().is_none() {
                    self.advance(wal_end);
                }
            }
            _ => {}
        }
        Ok(())
    }

    /// Takes in what the stream holds now, without waiting, up to `limit` new messages.
    pub(super) fn pull(&mut self, limit: usize) -> SessionResult<()> {
        use futures_util::FutureExt as _;
        let mut taken = 0;
        while taken < limit && !self.full() {
            let Some(client) = self.client.as_mut() else {
                return Ok(());
            };
            // Unconstrained: tokio's cooperative budget would make `recv` report
            // "pending" after 128 ready messages in one poll, and cap a batch at that.
            match tokio::task::unconstrained(client.recv()).now_or_never() {
                None => return Ok(()),
                Some(Ok(Some(event))) => {
                    taken += usize::from(matches!(event, ReplicationEvent::Message { .. }));
                    self.take(event)?;
                }
                Some(Ok(None)) => return Err(self.ended(None)),
                Some(Err(e)) => return Err(self.ended(Some(e))),
            }
        }
        Ok(())
    }

    /// The buffer holds its most messages or bytes: the stream waits in the slot.
    pub(super) fn full(&self) -> bool {
        self.buffer.len() >= self.cap || self.bytes >= self.cap_bytes
    }

    /// The stream has ended (with the error `e`, if any): the session is over.
    pub(super) fn ended(&mut self, e: Option<PgWireError>) -> SessionError {
        self.client = None;
        let stream = || format!("the replication stream of slot {:?}", self.wal.slot);
        match e {
            Some(
                e @ (PgWireError::Protocol(_)
                | PgWireError::Internal(_)
                | PgWireError::MessageTooLarge { .. }),
            ) => SessionError::protocol(stream(), e.to_string()),
            e => SessionError::closed(stream(), e.map(|e| e.to_string())),
        }
    }

    /// Drops the acknowledged head of the buffer and confirms the last commit before
    /// the first unacknowledged message.
    pub(super) fn confirm(&mut self) {
        while self.buffer.front().is_some_and(|e| e.sent) {
            if let Some(e) = self.buffer.pop_front() {
                self.bytes = self.bytes.saturating_sub(size_of_record(&e.record));
            }
        }
        let first_open = self.first_open().unwrap_or(self.next_seq);
        let mut lsn = None;
        while let Some(&(last, end)) = self.commits.front() {
            if last >= first_open {
                break;
            }
            lsn = Some(end);
            self.commits.pop_front();
        }
        if let Some(lsn) = lsn {
            self.advance(lsn);
        }
    }

    /// The first message of the stream not yet acknowledged (or in the outbox table).
    /// Rows read from the table hold no position in the stream.
    pub(super) fn first_open(&self) -> Option<i64> {
        self.buffer
            .iter()
            .find(|e| !e.sent && e.row.is_none())
            .map(|e| e.record.seq)
    }

    pub(super) fn advance(&mut self, lsn: Lsn) {
        if lsn > self.confirmed {
            self.confirmed = lsn;
            if let Some(client) = &self.client {
                client.update_applied_lsn(lsn);
            }
        }
    }

    pub(super) fn claimable(&self) -> bool {
        !self.select(0, 1, usize::MAX).is_empty()
    }

    /// The oldest claimable messages after `after`: not acknowledged, not waiting for a
    /// retry, and not behind a message of their key that waits for one.
    pub(super) fn select(&self, after: i64, limit: usize, max_bytes: usize) -> Vec<OutboxRecord> {
        let now = Instant::now();
        let mut held: HashSet<&str> = HashSet::new();
        let mut batch = Vec::new();
        let mut bytes = 0;
        for e in &self.buffer {
            if e.sent || e.to_table {
                continue;
            }
            let key = e.record.partition_key.as_deref();
            if e.due.is_some_and(|d| d > now) {
                if let Some(k) = key {
                    held.insert(k);
                }
                continue;
            }
            if e.record.seq <= after || key.is_some_and(|k| held.contains(k)) {
                continue;
            }
            if batch.len() >= limit || (bytes >= max_bytes && !batch.is_empty()) {
                break;
            }
            bytes += e.record.payload.len();
            batch.push(e.record.clone());
            // A retry goes without the later messages of its key, as in table mode: if
            // it failed again while they were accepted, they would overtake it.
            if e.record.attempts > 0
                && let Some(k) = key
            {
                held.insert(k);
            }
        }
        batch
    }
    pub(super) fn entry(&mut self, seq: i64) -> Option<&mut Entry> {
        let first = self.buffer.front()?.record.seq;
        let i = usize::try_from(seq - first).ok()?;
        self.buffer.get_mut(i).filter(|e| e.record.seq == seq)
    }
}
