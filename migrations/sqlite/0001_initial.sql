-- chunked-outbox schema, version 1.
--
-- Timestamps are INTEGER milliseconds since the Unix epoch (UTC).
-- Statuses are stored as short lowercase words so the file stays readable with the
-- sqlite3 shell; CHECK constraints keep them to the known set.

-- Per-database constants.
CREATE TABLE outbound_meta (
    id      INTEGER PRIMARY KEY CHECK (id = 1),
    -- Random; scrambles row ids into delivery uids (see outbound_deliveries.uid).
    id_salt INTEGER NOT NULL
);
INSERT INTO outbound_meta (id, id_salt) VALUES (1, random());

-- One logical outbound message.
CREATE TABLE outbound_deliveries (
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
    -- Optional caller key: enqueueing the same key again returns this row.
    idempotency_key TEXT,
    -- queued: waits behind an earlier delivery of its lane (channel, chat_id);
    -- pending/partial: active, none/some chunks delivered;
    -- uncertain: a chunk may have been sent and waits for a decision;
    -- failed: dead letter; delivered: finalized into outbound_messages.
    status          TEXT    NOT NULL CHECK (status IN
                        ('queued', 'pending', 'partial', 'uncertain', 'failed', 'delivered')),
    chunk_count     INTEGER NOT NULL CHECK (chunk_count > 0),
    delivered_count INTEGER NOT NULL DEFAULT 0,
    created_at      INTEGER NOT NULL,
    updated_at      INTEGER NOT NULL,
    finished_at     INTEGER,
    -- Set when an operator acknowledged this dead letter.
    acknowledged_at INTEGER,
    text            TEXT    NOT NULL
);

CREATE UNIQUE INDEX outbound_deliveries_idempotency
    ON outbound_deliveries (idempotency_key) WHERE idempotency_key IS NOT NULL;

-- Unfinished deliveries by lane and status, in enqueue order. Delivered rows leave
-- this index, so lane scheduling and the health snapshot never read delivered history;
-- the status column lets "is anything active in this lane?" and "which queued delivery
-- is next?" be single seeks however long the lane's queue is.
CREATE INDEX outbound_deliveries_open
    ON outbound_deliveries (channel, chat_id, status, id) WHERE status <> 'delivered';

-- One platform send: an independently retryable part of a delivery.
--
-- A chunk's id is derived from its place: delivery_id * 16384 + chunk_index (a delivery
-- has at most 10,000 chunks). The table's own B-tree is then ordered by delivery and
-- index, so "chunk k of delivery d" and "the chunks of delivery d" are primary-key
-- lookups and ranges, and no separate (delivery_id, chunk_index) index has to be
-- written on every enqueue. The CHECK keeps the columns and the id in agreement.
CREATE TABLE outbound_delivery_chunks (
    id                  INTEGER PRIMARY KEY,
    delivery_id         INTEGER NOT NULL,
    chunk_index         INTEGER NOT NULL CHECK (chunk_index >= 0 AND chunk_index < 16384),
    status              TEXT    NOT NULL CHECK (status IN
                            ('pending', 'sending', 'retry', 'failed', 'delivered', 'uncertain')),
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
    CHECK (id = delivery_id * 16384 + chunk_index)
);

-- The claim index. It holds only claimable and leased chunks, ordered exactly as the
-- claim query's ORDER BY, so a claim is a range search whose cost depends on the
-- number of chunks it returns, not on backlog or history.
CREATE INDEX outbound_delivery_chunks_due
    ON outbound_delivery_chunks (due_at) WHERE due_at IS NOT NULL;

-- History of finalized deliveries. UNIQUE (delivery_id) makes a second finalization of
-- the same delivery impossible, whatever the code above it does.
CREATE TABLE outbound_messages (
    id           INTEGER PRIMARY KEY,
    delivery_id  TEXT    NOT NULL UNIQUE,
    channel      TEXT    NOT NULL,
    chat_id      TEXT    NOT NULL,
    sender       TEXT,
    content      TEXT    NOT NULL,
    chunk_count  INTEGER NOT NULL,
    created_at   INTEGER NOT NULL,
    delivered_at INTEGER NOT NULL
);

-- Per-channel counters of finalized deliveries still stored, maintained by
-- finalization and purge, so health never counts history rows. (Unfinished deliveries
-- are counted from the index of open deliveries, so enqueue does not touch this table.)
CREATE TABLE outbound_channel_stats (
    channel           TEXT PRIMARY KEY,
    delivered         INTEGER NOT NULL DEFAULT 0,
    last_delivered_at INTEGER
) WITHOUT ROWID;

-- Lanes paused by a rate limit: nothing in the lane becomes due before paused_until.
CREATE TABLE outbound_lane_pauses (
    channel      TEXT    NOT NULL,
    chat_id      TEXT    NOT NULL,
    paused_until INTEGER NOT NULL,
    PRIMARY KEY (channel, chat_id)
) WITHOUT ROWID;
