-- Version 4: a reply can be cancelled before any of its chunks has started
-- (`Outbox::cancel`), and refunded rate limits are counted per chunk.
--
-- Cancel. The delivery's status gains `cancelled`; SQLite cannot change a
-- CHECK constraint in place, so the table is rebuilt with the same columns, rows and
-- indexes (SQLite's documented procedure for other kinds of table schema changes; no
-- view or foreign key refers to the table).

CREATE TABLE outbound_deliveries_v4 (
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
    status          TEXT    NOT NULL CHECK (status IN
                        ('queued', 'pending', 'partial', 'uncertain', 'failed', 'delivered',
                         'cancelled')),
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

INSERT INTO outbound_deliveries_v4
    (id, uid, channel, chat_id, sender, idempotency_key, status, chunk_count,
     delivered_count, created_at, updated_at, finished_at, acknowledged_at, text, corrupt,
     metadata, not_before)
SELECT id, uid, channel, chat_id, sender, idempotency_key, status, chunk_count,
       delivered_count, created_at, updated_at, finished_at, acknowledged_at, text, corrupt,
       metadata, not_before
FROM outbound_deliveries;

DROP TABLE outbound_deliveries;
ALTER TABLE outbound_deliveries_v4 RENAME TO outbound_deliveries;

CREATE UNIQUE INDEX outbound_deliveries_idempotency
    ON outbound_deliveries (channel, idempotency_key) WHERE idempotency_key IS NOT NULL;

-- Unfinished deliveries by lane and status, in enqueue order (see version 1). Cancelled
-- rows stay in it until purged, like acknowledged dead letters; lane lookups seek by
-- status, so they never see them.
CREATE INDEX outbound_deliveries_open
    ON outbound_deliveries (channel, chat_id, status, id) WHERE status <> 'delivered';

-- Rate limits whose attempt was given back since the chunk's attempt budget was last
-- (re)set. Past a fixed number (`MAX_REFUNDED_RATE_LIMITS`) a rate limit uses an
-- attempt, so a chunk refused as "rate limited" forever still becomes a dead letter.
ALTER TABLE outbound_delivery_chunks ADD COLUMN rate_limits INTEGER NOT NULL DEFAULT 0;

-- Totals that only grow, per channel, for monitoring that must not drop after a purge:
-- replies finalized, and how long each took from enqueue to finalization (count, sum
-- and cumulative buckets of a Prometheus histogram). Kept by the statement that already
-- counts a finalization, so every process, and every scraper, sees the same numbers.
-- Files written before start their total at the finalized replies they still store.
ALTER TABLE outbound_channel_stats ADD COLUMN finalized_total INTEGER NOT NULL DEFAULT 0;
ALTER TABLE outbound_channel_stats ADD COLUMN latency_count INTEGER NOT NULL DEFAULT 0;
ALTER TABLE outbound_channel_stats ADD COLUMN latency_sum_ms INTEGER NOT NULL DEFAULT 0;
ALTER TABLE outbound_channel_stats ADD COLUMN latency_le_1s INTEGER NOT NULL DEFAULT 0;
ALTER TABLE outbound_channel_stats ADD COLUMN latency_le_5s INTEGER NOT NULL DEFAULT 0;
ALTER TABLE outbound_channel_stats ADD COLUMN latency_le_30s INTEGER NOT NULL DEFAULT 0;
ALTER TABLE outbound_channel_stats ADD COLUMN latency_le_120s INTEGER NOT NULL DEFAULT 0;
ALTER TABLE outbound_channel_stats ADD COLUMN latency_le_600s INTEGER NOT NULL DEFAULT 0;
ALTER TABLE outbound_channel_stats ADD COLUMN latency_le_3600s INTEGER NOT NULL DEFAULT 0;
UPDATE outbound_channel_stats SET finalized_total = delivered;
