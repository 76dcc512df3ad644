-- Version 10: what a snapshot and the console's charts show is counted as it happens,
-- not read row by row.
--
-- 1. Dead letters apart from the work in flight, and counted as they come and go.
--
-- Dead letters pile up in ordinary operation (every user who blocks the bot leaves one)
-- and stay until dismissed and purged. Kept in the index of unfinished deliveries, they
-- made every health snapshot, every /metrics scrape and every console page read each of
-- them. Now that index holds the work in flight only; the dead letters have two of
-- their own, by lane (a dead letter holds its lane under the 'block' policy) and by
-- channel in age order (the newest are listed); and their counts per channel are kept
-- by the triggers below, so a snapshot reads one row per channel.

DROP INDEX outbound_deliveries_open;
CREATE INDEX outbound_deliveries_open
    ON outbound_deliveries (channel, chat_id, status, id)
    WHERE status <> 'delivered' AND status <> 'failed';
CREATE INDEX outbound_deliveries_dead
    ON outbound_deliveries (channel, chat_id, id) WHERE status = 'failed';
CREATE INDEX outbound_deliveries_dead_newest
    ON outbound_deliveries (channel, id) WHERE status = 'failed';

-- Per channel: dead letters, those nobody acknowledged, those set aside as unreadable,
-- and the failed parts (one per dead letter, the part that failed).
CREATE TABLE outbound_dead_letter_counts (
    channel         TEXT    NOT NULL PRIMARY KEY,
    dead_letters    INTEGER NOT NULL DEFAULT 0,
    unacknowledged  INTEGER NOT NULL DEFAULT 0,
    corrupt         INTEGER NOT NULL DEFAULT 0,
    failed_chunks   INTEGER NOT NULL DEFAULT 0
);

INSERT INTO outbound_dead_letter_counts (channel, dead_letters, unacknowledged, corrupt)
SELECT channel, count(*), count(*) FILTER (WHERE acknowledged_at IS NULL), count(corrupt)
FROM outbound_deliveries WHERE status = 'failed' GROUP BY channel;
INSERT INTO outbound_dead_letter_counts (channel)
SELECT name FROM outbound_channels WHERE true ON CONFLICT DO NOTHING;
UPDATE outbound_dead_letter_counts SET failed_chunks = (
    SELECT count(*) FROM outbound_delivery_chunks c
         JOIN outbound_channels ch ON ch.id = c.channel_id
    WHERE c.status = 'failed' AND ch.name = outbound_dead_letter_counts.channel);

-- A delivery's row: what it took away from its channel's counts, and what it adds.
CREATE TRIGGER outbound_dead_letters_inserted AFTER INSERT ON outbound_deliveries
WHEN new.status = 'failed'
BEGIN
    INSERT INTO outbound_dead_letter_counts (channel) VALUES (new.channel)
        ON CONFLICT DO NOTHING;
    UPDATE outbound_dead_letter_counts
    SET dead_letters = dead_letters + 1,
        unacknowledged = unacknowledged + (new.acknowledged_at IS NULL),
        corrupt = corrupt + (new.corrupt IS NOT NULL)
    WHERE channel = new.channel;
END;

CREATE TRIGGER outbound_dead_letters_updated
AFTER UPDATE OF status, acknowledged_at, corrupt, channel ON outbound_deliveries
WHEN old.status = 'failed' OR new.status = 'failed'
BEGIN
    INSERT INTO outbound_dead_letter_counts (channel) VALUES (new.channel)
        ON CONFLICT DO NOTHING;
    UPDATE outbound_dead_letter_counts
    SET dead_letters = dead_letters - 1,
        unacknowledged = unacknowledged - (old.acknowledged_at IS NULL),
        corrupt = corrupt - (old.corrupt IS NOT NULL)
    WHERE channel = old.channel AND old.status = 'failed';
    UPDATE outbound_dead_letter_counts
    SET dead_letters = dead_letters + 1,
        unacknowledged = unacknowledged + (new.acknowledged_at IS NULL),
        corrupt = corrupt + (new.corrupt IS NOT NULL)
    WHERE channel = new.channel AND new.status = 'failed';
END;

CREATE TRIGGER outbound_dead_letters_deleted AFTER DELETE ON outbound_deliveries
WHEN old.status = 'failed'
BEGIN
    UPDATE outbound_dead_letter_counts
    SET dead_letters = dead_letters - 1,
        unacknowledged = unacknowledged - (old.acknowledged_at IS NULL),
        corrupt = corrupt - (old.corrupt IS NOT NULL)
    WHERE channel = old.channel;
END;

-- A part's row: counted by the channel it is sent on.
CREATE TRIGGER outbound_failed_chunks_inserted AFTER INSERT ON outbound_delivery_chunks
WHEN new.status = 'failed'
BEGIN
    INSERT INTO outbound_dead_letter_counts (channel)
        SELECT name FROM outbound_channels WHERE id = new.channel_id
        ON CONFLICT DO NOTHING;
    UPDATE outbound_dead_letter_counts SET failed_chunks = failed_chunks + 1
    WHERE channel = (SELECT name FROM outbound_channels WHERE id = new.channel_id);
END;

CREATE TRIGGER outbound_failed_chunks_updated
AFTER UPDATE OF status, channel_id ON outbound_delivery_chunks
WHEN old.status = 'failed' OR new.status = 'failed'
BEGIN
    INSERT INTO outbound_dead_letter_counts (channel)
        SELECT name FROM outbound_channels WHERE id = new.channel_id
        ON CONFLICT DO NOTHING;
    UPDATE outbound_dead_letter_counts SET failed_chunks = failed_chunks - 1
    WHERE channel = (SELECT name FROM outbound_channels WHERE id = old.channel_id)
      AND old.status = 'failed';
    UPDATE outbound_dead_letter_counts SET failed_chunks = failed_chunks + 1
    WHERE channel = (SELECT name FROM outbound_channels WHERE id = new.channel_id)
      AND new.status = 'failed';
END;

CREATE TRIGGER outbound_failed_chunks_deleted AFTER DELETE ON outbound_delivery_chunks
WHEN old.status = 'failed'
BEGIN
    UPDATE outbound_dead_letter_counts SET failed_chunks = failed_chunks - 1
    WHERE channel = (SELECT name FROM outbound_channels WHERE id = old.channel_id);
END;

-- 2. Replies that finished, per minute: delivered ones with the sum and the longest of
-- their enqueue-to-delivery times, and dead letters. Added to by the transaction that
-- finishes them (once per transaction, not per reply), read by the console's charts of
-- the last hour and day (a bucket a whole number of minutes wide sums its minutes), and
-- forgotten by a purge with the rows before its cutoff. Filled here from the rows there.
CREATE TABLE outbound_activity (
    minute          INTEGER NOT NULL PRIMARY KEY,
    delivered       INTEGER NOT NULL DEFAULT 0,
    failed          INTEGER NOT NULL DEFAULT 0,
    latency_sum_ms  INTEGER NOT NULL DEFAULT 0,
    latency_max_ms  INTEGER NOT NULL DEFAULT 0
);

INSERT INTO outbound_activity (minute, delivered, failed, latency_sum_ms, latency_max_ms)
SELECT finished_at / 60000,
       count(*) FILTER (WHERE status = 'delivered'),
       count(*) FILTER (WHERE status = 'failed'),
       coalesce(sum(finished_at - created_at) FILTER (WHERE status = 'delivered'), 0),
       coalesce(max(finished_at - created_at) FILTER (WHERE status = 'delivered'), 0)
FROM outbound_deliveries INDEXED BY outbound_deliveries_finished
WHERE finished_at IS NOT NULL AND status IN ('delivered', 'failed')
GROUP BY 1;
