-- chunked-outbox on PostgreSQL, schema version 3: a channel's counters in several rows.
--
-- Every transaction that finalizes replies adds them to its channel's counters, and the
-- row it updates stays locked until it commits: with one row per channel, every
-- finalizing transaction of the channel waited for the one before to commit (fsync
-- included), on every host. Each connection now adds to one of 16 rows of the channel,
-- picked by its backend's process id (a connection runs one transaction at a time, so
-- two at once rarely meet); readers sum the rows. A purge's decrement may leave one row
-- negative; the sums stay right.

ALTER TABLE outbound_channel_stats ADD COLUMN shard integer NOT NULL DEFAULT 0;
ALTER TABLE outbound_channel_stats DROP CONSTRAINT outbound_channel_stats_pkey;
ALTER TABLE outbound_channel_stats ADD PRIMARY KEY (channel, shard);
