-- chunked-outbox on PostgreSQL, schema version 1: the tables of the SQLite file at its
-- version 7, with PostgreSQL's types and keys.
--
-- Timestamps are bigint milliseconds since the Unix epoch (UTC); statuses are short
-- lowercase words, kept to the known set by CHECK constraints. Every table lives in the
-- schema first on the connection's search_path, so one database can hold several
-- outboxes (one per schema).

-- Per-database constants.
CREATE TABLE outbound_meta (
    id      integer PRIMARY KEY CHECK (id = 1),
    -- Random; scrambles row numbers into delivery uids (see outbound_deliveries.uid).
    id_salt bigint  NOT NULL
);
INSERT INTO outbound_meta (id, id_salt)
    VALUES (1, floor(random() * 4611686018427387904)::bigint);

-- Row numbers of deliveries, never reused: 49 bits, as many as a uid carries.
CREATE SEQUENCE outbound_deliveries_id_seq AS bigint MAXVALUE 562949953421311;

-- One logical outbound message (see the SQLite schema for each column). `id` is drawn
-- from the sequence after the delivery's lane is locked, so within a lane it is in
-- commit order: it is the lane position.
CREATE TABLE outbound_deliveries (
    id              bigint  PRIMARY KEY,
    uid             text    NOT NULL,
    channel         text    NOT NULL,
    chat_id         text    NOT NULL,
    sender          text,
    idempotency_key text,
    status          text    COLLATE "C" NOT NULL CHECK (status IN ('queued', 'pending',
                        'partial', 'uncertain', 'failed', 'delivered', 'cancelled',
                        'unfinalized')),
    chunk_count     bigint  NOT NULL CHECK (chunk_count > 0),
    delivered_count bigint  NOT NULL DEFAULT 0,
    created_at      bigint  NOT NULL,
    updated_at      bigint  NOT NULL,
    finished_at     bigint,
    acknowledged_at bigint,
    text            text    NOT NULL,
    corrupt         text,
    metadata        text,
    not_before      bigint,
    finalize_error  text
) WITH (fillfactor = 90, autovacuum_analyze_scale_factor = 0.01);
CREATE UNIQUE INDEX outbound_deliveries_idempotency
    ON outbound_deliveries (channel, idempotency_key) WHERE idempotency_key IS NOT NULL;
-- Unfinished deliveries by lane and status, in lane order: lane heads, the health
-- snapshot and listings never read the delivered history.
CREATE INDEX outbound_deliveries_open
    ON outbound_deliveries (channel, chat_id, status, id) WHERE status <> 'delivered';
-- Finished deliveries by the time they finished: a purge finds what is old enough
-- without reading the rest of the history.
CREATE INDEX outbound_deliveries_finished
    ON outbound_deliveries (finished_at) WHERE finished_at IS NOT NULL;

-- One platform send. The key is the delivery and the index (a chunk's public id is
-- delivery_id * 16384 + chunk_index): the chunks of a delivery are one range of it.
CREATE TABLE outbound_delivery_chunks (
    delivery_id         bigint  NOT NULL,
    chunk_index         bigint  NOT NULL CHECK (chunk_index >= 0 AND chunk_index < 16384),
    status              text    COLLATE "C" NOT NULL CHECK (status IN ('pending', 'sending',
                            'retry', 'failed', 'delivered', 'uncertain')),
    attempts            bigint  NOT NULL DEFAULT 0,
    -- Set exactly when the chunk is claimable (its due time) or sending (its lease end).
    due_at              bigint,
    claim_token         bigint,
    last_error          text,
    platform_message_id text,
    delivered_at        bigint,
    -- NULL when the chunk is the delivery's whole text.
    text                text,
    channel_id          bigint  NOT NULL,
    rate_limits         bigint  NOT NULL DEFAULT 0,
    sent_before         boolean NOT NULL DEFAULT false,
    PRIMARY KEY (delivery_id, chunk_index)
) WITH (fillfactor = 80, autovacuum_vacuum_scale_factor = 0.01,
        autovacuum_analyze_scale_factor = 0.01);
-- The claim index, per channel; chunks due at one time in key order, as claims take them.
CREATE INDEX outbound_delivery_chunks_due
    ON outbound_delivery_chunks (channel_id, due_at, delivery_id, chunk_index)
    WHERE due_at IS NOT NULL;

-- The crate's history: one row per finalized delivery; the UNIQUE key refuses a second.
CREATE TABLE outbound_messages (
    id           bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    delivery_id  text   NOT NULL UNIQUE,
    channel      text   NOT NULL,
    chat_id      text   NOT NULL,
    sender       text,
    content      text   NOT NULL,
    chunk_count  bigint NOT NULL,
    created_at   bigint NOT NULL,
    delivered_at bigint NOT NULL
);

-- Counters of finalized replies per channel, kept in the transaction that finalizes.
CREATE TABLE outbound_channel_stats (
    channel           text   PRIMARY KEY,
    delivered         bigint NOT NULL DEFAULT 0,
    last_delivered_at bigint,
    finalized_total   bigint NOT NULL DEFAULT 0,
    latency_count     bigint NOT NULL DEFAULT 0,
    latency_sum_ms    bigint NOT NULL DEFAULT 0,
    latency_le_1s     bigint NOT NULL DEFAULT 0,
    latency_le_5s     bigint NOT NULL DEFAULT 0,
    latency_le_30s    bigint NOT NULL DEFAULT 0,
    latency_le_120s   bigint NOT NULL DEFAULT 0,
    latency_le_600s   bigint NOT NULL DEFAULT 0,
    latency_le_3600s  bigint NOT NULL DEFAULT 0
);

-- The stored rules (a NULL rule: nobody declared it yet), with the version every
-- change raises, and the application's finalization statement.
CREATE TABLE outbound_policy (
    id                  integer PRIMARY KEY CHECK (id = 1),
    version             bigint  NOT NULL,
    lane_order          text    CHECK (lane_order IN ('fifo', 'parallel')),
    lane_failure        text    CHECK (lane_failure IN ('skip', 'block')),
    retry               text,
    replay              text    CHECK (replay IN ('hold', 'replay')),
    lane_interval_ms    bigint  CHECK (lane_interval_ms >= 0),
    channel_interval_us bigint  CHECK (channel_interval_us >= 0),
    finalize_sql        text
);
INSERT INTO outbound_policy (id, version) VALUES (1, 1);

-- Channels: number, own rules, and the state of the channel-wide rate.
CREATE TABLE outbound_channels (
    id                  bigint  GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY,
    name                text    NOT NULL UNIQUE,
    replay              text    CHECK (replay IN ('hold', 'replay')),
    lane_interval_ms    bigint  CHECK (lane_interval_ms >= 0),
    channel_interval_us bigint  CHECK (channel_interval_us >= 0),
    retry               text,
    next_send_at_us     bigint,
    paused_until        bigint
);

-- Lanes: pause and pacing state, and the row every writer of the lane locks.
CREATE TABLE outbound_lanes (
    channel      text   NOT NULL,
    chat_id      text   NOT NULL,
    paused_until bigint,
    next_send_at bigint,
    PRIMARY KEY (channel, chat_id)
) WITH (fillfactor = 70);
