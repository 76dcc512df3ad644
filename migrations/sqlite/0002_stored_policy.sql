-- chunked-outbox schema, version 2: the rules whose effects are stored live in the
-- file, so every process on it (dispatchers, the `outbox` tool, cron jobs) acts on the
-- same rows by the same rules; and the claim index is searched per channel.

-- File-wide rules, and the policy of channels that have none of their own. `version`
-- changes with every change of a rule here or in outbound_channels, so each handle
-- knows when to read them again. A NULL rule is one nobody declared yet: every process
-- follows the default for it, and the first process that declares it stores it (the
-- default channel rules are declared together: `replay` NULL means all three are).
CREATE TABLE outbound_policy (
    id                  INTEGER PRIMARY KEY CHECK (id = 1),
    version             INTEGER NOT NULL,
    lane_order          TEXT    CHECK (lane_order IN ('fifo', 'parallel')),
    lane_failure        TEXT    CHECK (lane_failure IN ('skip', 'block')),
    -- The retry policy as JSON (see policy.rs).
    retry               TEXT,
    replay              TEXT    CHECK (replay IN ('hold', 'replay')),
    lane_interval_ms    INTEGER CHECK (lane_interval_ms >= 0),
    channel_interval_ms INTEGER CHECK (channel_interval_ms >= 0)
);
-- Version 1 files carried no stored rules: every process used the defaults.
INSERT INTO outbound_policy (id, version) VALUES (1, 1);

-- One row per channel the file has seen: its number (stamped on its chunks, for the
-- claim index), its own rules (NULL: the file's default), and the state of its
-- channel-wide rate.
CREATE TABLE outbound_channels (
    id                  INTEGER PRIMARY KEY,
    name                TEXT    NOT NULL UNIQUE,
    replay              TEXT    CHECK (replay IN ('hold', 'replay')),
    lane_interval_ms    INTEGER CHECK (lane_interval_ms >= 0),
    channel_interval_ms INTEGER CHECK (channel_interval_ms >= 0),
    retry               TEXT,
    -- The earliest time the channel's next send may start, whichever process sends.
    next_send_at        INTEGER
);
INSERT INTO outbound_channels (name) SELECT DISTINCT channel FROM outbound_deliveries;

-- The claim index, per channel: a claim or next-due search for some channels is a
-- range search on theirs alone, whatever backlog other channels have.
ALTER TABLE outbound_delivery_chunks ADD COLUMN channel_id INTEGER NOT NULL DEFAULT 0;
UPDATE outbound_delivery_chunks SET channel_id = (
    SELECT ch.id FROM outbound_deliveries d JOIN outbound_channels ch ON ch.name = d.channel
    WHERE d.id = outbound_delivery_chunks.delivery_id);
DROP INDEX outbound_delivery_chunks_due;
CREATE INDEX outbound_delivery_chunks_due
    ON outbound_delivery_chunks (channel_id, due_at) WHERE due_at IS NOT NULL;

-- Lanes (channel, chat): a rate-limit pause, and the earliest time the chat's next
-- send may start under its channel's lane interval, whoever sends it.
CREATE TABLE outbound_lanes (
    channel      TEXT    NOT NULL,
    chat_id      TEXT    NOT NULL,
    paused_until INTEGER,
    next_send_at INTEGER,
    PRIMARY KEY (channel, chat_id)
) WITHOUT ROWID;
INSERT INTO outbound_lanes (channel, chat_id, paused_until)
    SELECT channel, chat_id, paused_until FROM outbound_lane_pauses;
DROP TABLE outbound_lane_pauses;

-- Why a row was set aside as unreadable (a uid that does not parse, text that is not
-- UTF-8): it is failed, reported by health and the tool, and never stops a claim.
ALTER TABLE outbound_deliveries ADD COLUMN corrupt TEXT;
