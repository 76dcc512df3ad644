-- Version 7: a reply whose chunks were all delivered but whose finalization into the
-- application's history failed (its statement met a constraint or trigger of the
-- application's) is kept apart as `unfinalized`, with the statement's error, instead of
-- failing the whole transaction of its ack; and a chunk remembers that a send of it may
-- have reached the platform across the requeues and resends that reset its attempts.
--
-- SQLite cannot change a CHECK in place, so outbound_deliveries is rebuilt with the same
-- rows and indexes, as in versions 4 and 5; the application's own indexes and triggers
-- on it are kept aside before and re-created after (`keep_application_schema!` in `src/schema.rs`).

CREATE TABLE outbound_deliveries_v7 (
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
    -- cancelled: withdrawn before any chunk started (its chunks are removed);
    -- unfinalized: every chunk delivered, but the application's finalization statement
    -- failed (finalize_error says why); retried by recovery, or by the operator.
    status          TEXT    NOT NULL CHECK (status = 'queued' OR status = 'pending'
                        OR status = 'partial' OR status = 'uncertain' OR status = 'failed'
                        OR status = 'delivered' OR status = 'cancelled'
                        OR status = 'unfinalized'),
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
    not_before      INTEGER,
    -- Why the application's finalization statement failed, while status = 'unfinalized'.
    finalize_error  TEXT
);

INSERT INTO outbound_deliveries_v7
    (id, uid, channel, chat_id, sender, idempotency_key, status, chunk_count,
     delivered_count, created_at, updated_at, finished_at, acknowledged_at, text, corrupt,
     metadata, not_before)
SELECT id, uid, channel, chat_id, sender, idempotency_key, status, chunk_count,
       delivered_count, created_at, updated_at, finished_at, acknowledged_at, text, corrupt,
       metadata, not_before
FROM outbound_deliveries;

DROP TABLE outbound_deliveries;
ALTER TABLE outbound_deliveries_v7 RENAME TO outbound_deliveries;

CREATE UNIQUE INDEX outbound_deliveries_idempotency
    ON outbound_deliveries (channel, idempotency_key) WHERE idempotency_key IS NOT NULL;

-- Unfinished deliveries by lane and status, in enqueue order (see version 1).
CREATE INDEX outbound_deliveries_open
    ON outbound_deliveries (channel, chat_id, status, id) WHERE status <> 'delivered';


-- 1 once a send of the chunk may have reached the platform in an earlier attempt budget
-- (an operator's requeue or resend starts a fresh one): such a reply is not cancelled.
ALTER TABLE outbound_delivery_chunks ADD COLUMN sent_before INTEGER NOT NULL DEFAULT 0;

-- The end of a rate limit of the whole channel (ms), as the platform gave it: no chat of
-- the channel is claimed before it, whichever process claims. Kept apart from the
-- channel's rate schedule (next_send_at_us), which a change of rate starts afresh.
ALTER TABLE outbound_channels ADD COLUMN paused_until INTEGER;
