-- chunked-outbox on PostgreSQL, schema version 7: what a snapshot and the console's
-- charts show is counted as it happens, not read row by row.
--
-- 1. Dead letters apart from the work in flight, and counted as they come and go.
--
-- Dead letters pile up in ordinary operation (every user who blocks the bot leaves one)
-- and stay until dismissed and purged. Kept in the index of unfinished deliveries, they
-- made every health snapshot, every /metrics scrape and every console page read each of
-- them. Now that index holds the work in flight only; the dead letters have two of
-- their own, by lane (a dead letter holds its lane under the 'block' policy) and by
-- channel in age order (the newest are listed); and their counts per channel are kept
-- by the triggers below, so a snapshot reads a few rows per channel. Each connection
-- adds to rows of its own (keyed by its backend's process id, which no other live
-- connection has), so transactions failing replies at once never wait for each other,
-- nor lock two counters in opposite orders; readers sum the rows, and a purge folds
-- those of connections that ended into row 0. The triggers fire only where a row is or
-- becomes 'failed': a claim's or an ack's update evaluates their WHEN and nothing more.

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
    channel         text    NOT NULL,
    shard           integer NOT NULL,
    dead_letters    bigint  NOT NULL DEFAULT 0,
    unacknowledged  bigint  NOT NULL DEFAULT 0,
    corrupt         bigint  NOT NULL DEFAULT 0,
    failed_chunks   bigint  NOT NULL DEFAULT 0,
    PRIMARY KEY (channel, shard)
);

INSERT INTO outbound_dead_letter_counts (channel, shard, dead_letters, unacknowledged, corrupt)
SELECT channel, 0, count(*), count(*) FILTER (WHERE acknowledged_at IS NULL), count(corrupt)
FROM outbound_deliveries WHERE status = 'failed' GROUP BY channel;
INSERT INTO outbound_dead_letter_counts (channel, shard, failed_chunks)
SELECT ch.name, 0, count(*)
FROM outbound_delivery_chunks c JOIN outbound_channels ch ON ch.id = c.channel_id
WHERE c.status = 'failed' GROUP BY ch.name
ON CONFLICT (channel, shard) DO UPDATE SET failed_chunks = excluded.failed_chunks;

-- Adds to a channel's counts, in this connection's row. (Every function here runs on
-- the outbox's schema, whatever the search path of the connection that fired it.)
CREATE FUNCTION outbound_add_dead_letters(of_channel text, dead bigint, unacked bigint,
                                          unreadable bigint, chunks bigint)
RETURNS void LANGUAGE sql SET search_path FROM CURRENT AS $$
    INSERT INTO outbound_dead_letter_counts AS c
        (channel, shard, dead_letters, unacknowledged, corrupt, failed_chunks)
    VALUES (of_channel, pg_backend_pid(), dead, unacked, unreadable, chunks)
    ON CONFLICT (channel, shard) DO UPDATE
    SET dead_letters = c.dead_letters + excluded.dead_letters,
        unacknowledged = c.unacknowledged + excluded.unacknowledged,
        corrupt = c.corrupt + excluded.corrupt,
        failed_chunks = c.failed_chunks + excluded.failed_chunks
$$;

-- A delivery's row: what it took away from its channel's counts, and what it adds.
CREATE FUNCTION outbound_count_dead_letters() RETURNS trigger LANGUAGE plpgsql
SET search_path FROM CURRENT AS $$
BEGIN
    IF TG_OP <> 'INSERT' AND OLD.status = 'failed' THEN
        PERFORM outbound_add_dead_letters(OLD.channel, -1,
            -(OLD.acknowledged_at IS NULL)::int, -(OLD.corrupt IS NOT NULL)::int, 0);
    END IF;
    IF TG_OP <> 'DELETE' AND NEW.status = 'failed' THEN
        PERFORM outbound_add_dead_letters(NEW.channel, 1,
            (NEW.acknowledged_at IS NULL)::int, (NEW.corrupt IS NOT NULL)::int, 0);
    END IF;
    RETURN NULL;
END $$;

CREATE TRIGGER outbound_dead_letters_inserted AFTER INSERT ON outbound_deliveries
    FOR EACH ROW WHEN (NEW.status = 'failed')
    EXECUTE FUNCTION outbound_count_dead_letters();
CREATE TRIGGER outbound_dead_letters_updated
    AFTER UPDATE OF status, acknowledged_at, corrupt, channel ON outbound_deliveries
    FOR EACH ROW WHEN (OLD.status = 'failed' OR NEW.status = 'failed')
    EXECUTE FUNCTION outbound_count_dead_letters();
CREATE TRIGGER outbound_dead_letters_deleted AFTER DELETE ON outbound_deliveries
    FOR EACH ROW WHEN (OLD.status = 'failed')
    EXECUTE FUNCTION outbound_count_dead_letters();

-- A part's row: counted by the channel it is sent on.
CREATE FUNCTION outbound_count_failed_chunks() RETURNS trigger LANGUAGE plpgsql
SET search_path FROM CURRENT AS $$
BEGIN
    IF TG_OP <> 'INSERT' AND OLD.status = 'failed' THEN
        PERFORM outbound_add_dead_letters(name, 0, 0, 0, -1)
        FROM outbound_channels WHERE id = OLD.channel_id;
    END IF;
    IF TG_OP <> 'DELETE' AND NEW.status = 'failed' THEN
        PERFORM outbound_add_dead_letters(name, 0, 0, 0, 1)
        FROM outbound_channels WHERE id = NEW.channel_id;
    END IF;
    RETURN NULL;
END $$;

CREATE TRIGGER outbound_failed_chunks_inserted AFTER INSERT ON outbound_delivery_chunks
    FOR EACH ROW WHEN (NEW.status = 'failed')
    EXECUTE FUNCTION outbound_count_failed_chunks();
CREATE TRIGGER outbound_failed_chunks_updated
    AFTER UPDATE OF status, channel_id ON outbound_delivery_chunks
    FOR EACH ROW WHEN (OLD.status = 'failed' OR NEW.status = 'failed')
    EXECUTE FUNCTION outbound_count_failed_chunks();
CREATE TRIGGER outbound_failed_chunks_deleted AFTER DELETE ON outbound_delivery_chunks
    FOR EACH ROW WHEN (OLD.status = 'failed')
    EXECUTE FUNCTION outbound_count_failed_chunks();

-- 2. Replies that finished, per minute: delivered ones with the sum and the longest of
-- their enqueue-to-delivery times, and dead letters. Added to by the transaction that
-- finishes them (once per transaction, not per reply, in one of 16 rows of the minute by
-- its backend's process id, as the very last statement before its COMMIT: a transaction
-- waiting for that row holds nothing another one waits for), read by the console's
-- charts of the last hour and day (a bucket a whole number of minutes wide sums its
-- minutes), and forgotten by a purge with the rows before its cutoff. Filled here from
-- the rows there.
CREATE TABLE outbound_activity (
    minute          bigint  NOT NULL,
    shard           integer NOT NULL,
    delivered       bigint  NOT NULL DEFAULT 0,
    failed          bigint  NOT NULL DEFAULT 0,
    latency_sum_ms  bigint  NOT NULL DEFAULT 0,
    latency_max_ms  bigint  NOT NULL DEFAULT 0,
    PRIMARY KEY (minute, shard)
);

INSERT INTO outbound_activity (minute, shard, delivered, failed, latency_sum_ms, latency_max_ms)
SELECT finished_at / 60000, 0,
       count(*) FILTER (WHERE status = 'delivered'),
       count(*) FILTER (WHERE status = 'failed'),
       coalesce(sum(finished_at - created_at) FILTER (WHERE status = 'delivered'), 0),
       coalesce(max(finished_at - created_at) FILTER (WHERE status = 'delivered'), 0)
FROM outbound_deliveries
WHERE finished_at IS NOT NULL AND status IN ('delivered', 'failed')
GROUP BY 1;
