-- Version 5: every CHECK on a status written as comparisons joined by OR instead of
-- `status IN (...)`, and channel rates kept in microseconds.
--
-- SQLite evaluates `x IN (a, b, c)` through a temporary b-tree of the list, opened
-- and closed by every statement that writes the column: every claim, ack and enqueue
-- paid for a page cache created and destroyed under a global mutex. The comparisons
-- accept exactly the same values. SQLite cannot change a CHECK in place, so both
-- tables are rebuilt with the same columns, rows and indexes, as in version 4.

CREATE TABLE outbound_deliveries_v5 (
    id              INTEGER PRIMARY KEY,
    -- Public id (UUID v7: creation time, random bits, and the row id scrambled with this
    -- database's id_salt). Prefix of every chunk's idempotency key, so keys stay unique
    -- even across databases that were deleted and created again. The row id is
    -- recovered from the uid, so no index on this column is needed: lookups are
    -- "id = (row id from uid) AND uid = ?".
    uid             TEXT    NOT NULL,
    channel         TEXT    NOT NULL,
    chat_id         TEXT    NOT NULL,
    sender          TEXT,
    -- Optional caller key, scoped per channel: enqueueing the same key on the same
    -- channel again returns this row.
    idempotency_key TEXT,
    -- queued: waits behind an earlier delivery of its lane (channel, chat_id);
    -- pending/partial: active, none/some chunks delivered;
    -- uncertain: a chunk may have been sent and waits for a decision;
    -- failed: dead letter; delivered: finalized into outbound_messages;
    -- cancelled: withdrawn before any chunk started (its chunks are removed).
    status          TEXT    NOT NULL CHECK (status = 'queued' OR status = 'pending'
                        OR status = 'partial' OR status = 'uncertain' OR status = 'failed'
                        OR status = 'delivered' OR status = 'cancelled'),
    chunk_count     INTEGER NOT NULL CHECK (chunk_count > 0),
    delivered_count INTEGER NOT NULL DEFAULT 0,
    created_at      INTEGER NOT NULL,
    updated_at      INTEGER NOT NULL,
    finished_at     INTEGER,
    -- Set when an operator acknowledged this dead letter.
    acknowledged_at INTEGER,
    text            TEXT    NOT NULL,
    -- Why the row was set aside as unreadable (see version 2), NULL when it is sound.
    corrupt         TEXT,
    -- Per-reply data for the adapter (see version 3), NULL when there is none.
    metadata        TEXT,
    -- A delayed reply's earliest first send (ms), NULL for at once.
    not_before      INTEGER
);

INSERT INTO outbound_deliveries_v5
    (id, uid, channel, chat_id, sender, idempotency_key, status, chunk_count,
     delivered_count, created_at, updated_at, finished_at, acknowledged_at, text, corrupt,
     metadata, not_before)
SELECT id, uid, channel, chat_id, sender, idempotency_key, status, chunk_count,
       delivered_count, created_at, updated_at, finished_at, acknowledged_at, text, corrupt,
       metadata, not_before
FROM outbound_deliveries;

DROP TABLE outbound_deliveries;
ALTER TABLE outbound_deliveries_v5 RENAME TO outbound_deliveries;

CREATE UNIQUE INDEX outbound_deliveries_idempotency
    ON outbound_deliveries (channel, idempotency_key) WHERE idempotency_key IS NOT NULL;

-- Unfinished deliveries by lane and status, in enqueue order (see version 1).
CREATE INDEX outbound_deliveries_open
    ON outbound_deliveries (channel, chat_id, status, id) WHERE status <> 'delivered';

CREATE TABLE outbound_delivery_chunks_v5 (
    id                  INTEGER PRIMARY KEY,
    delivery_id         INTEGER NOT NULL,
    chunk_index         INTEGER NOT NULL CHECK (chunk_index >= 0 AND chunk_index < 16384),
    status              TEXT    NOT NULL CHECK (status = 'pending' OR status = 'sending'
                            OR status = 'retry' OR status = 'failed' OR status = 'delivered'
                            OR status = 'uncertain'),
    attempts            INTEGER NOT NULL DEFAULT 0,
    -- Non-NULL exactly when the chunk is claimable (pending or retry, head of its
    -- delivery, delivery active in its lane): the time it becomes due. For a chunk in
    -- 'sending' it is the lease expiry, so one index serves both claiming due work and
    -- reclaiming expired leases.
    due_at              INTEGER,
    claim_token         INTEGER,
    last_error          TEXT,
    platform_message_id TEXT,
    delivered_at        INTEGER,
    -- NULL when the chunk is the delivery's whole text (a reply sent as one chunk, the
    -- common case), so that text is stored once.
    text                TEXT,
    -- The channel's number in outbound_channels (see version 2).
    channel_id          INTEGER NOT NULL DEFAULT 0,
    -- Rate limits refunded since the attempt budget was last (re)set (see version 4).
    rate_limits         INTEGER NOT NULL DEFAULT 0,
    CHECK (id = delivery_id * 16384 + chunk_index)
);

INSERT INTO outbound_delivery_chunks_v5
    (id, delivery_id, chunk_index, status, attempts, due_at, claim_token, last_error,
     platform_message_id, delivered_at, text, channel_id, rate_limits)
SELECT id, delivery_id, chunk_index, status, attempts, due_at, claim_token, last_error,
       platform_message_id, delivered_at, text, channel_id, rate_limits
FROM outbound_delivery_chunks;

DROP TABLE outbound_delivery_chunks;
ALTER TABLE outbound_delivery_chunks_v5 RENAME TO outbound_delivery_chunks;

-- Claimable chunks of a channel by due time (see version 2).
CREATE INDEX outbound_delivery_chunks_due
    ON outbound_delivery_chunks (channel_id, due_at) WHERE due_at IS NOT NULL;

-- A channel's rate in whole microseconds between sends, and the start of its next
-- send likewise: whole milliseconds could not express a rate between 167/s (6 ms)
-- and 200/s (5 ms), so a channel limited at 195/s ran at 167/s.
ALTER TABLE outbound_policy RENAME COLUMN channel_interval_ms TO channel_interval_us;
UPDATE outbound_policy SET channel_interval_us = channel_interval_us * 1000;
ALTER TABLE outbound_channels RENAME COLUMN channel_interval_ms TO channel_interval_us;
UPDATE outbound_channels SET channel_interval_us = channel_interval_us * 1000;
ALTER TABLE outbound_channels RENAME COLUMN next_send_at TO next_send_at_us;
UPDATE outbound_channels SET next_send_at_us = next_send_at_us * 1000;
