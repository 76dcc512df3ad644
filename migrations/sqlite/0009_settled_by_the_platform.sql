-- Version 9: a part that may have reached its platform can be settled by asking the
-- platform (the replay policy 'ask'), and every such decision is kept on the part.
--
-- first_sent_at: when a send of the part was first claimed (ms): the earliest moment it
-- can have reached the platform, kept across requeues and resends, so a platform that
-- deduplicates for a while (Discord's nonce) is asked about the right window, and a
-- lookup searches from there. NULL for parts never claimed (and those claimed before
-- version 9: their reply's creation is used instead, an earlier and so safe bound).
-- settlement: what the platform was asked and what it answered, and the decision taken;
-- NULL while an uncertain part has not been asked (it is cleared each time a part
-- becomes uncertain again).
ALTER TABLE outbound_delivery_chunks ADD COLUMN first_sent_at INTEGER;
ALTER TABLE outbound_delivery_chunks ADD COLUMN settlement TEXT;

-- The replay policy gains 'ask'. SQLite cannot change a CHECK in place; a column whose
-- own CHECK names only itself can be dropped, so the column is renamed, added again
-- with the new CHECK, copied and dropped (the tables keep their rows and ids).
ALTER TABLE outbound_policy RENAME COLUMN replay TO replay_before_v9;
ALTER TABLE outbound_policy ADD COLUMN replay TEXT CHECK (replay IN ('hold', 'replay', 'ask'));
UPDATE outbound_policy SET replay = replay_before_v9;
ALTER TABLE outbound_policy DROP COLUMN replay_before_v9;

ALTER TABLE outbound_channels RENAME COLUMN replay TO replay_before_v9;
ALTER TABLE outbound_channels ADD COLUMN replay TEXT CHECK (replay IN ('hold', 'replay', 'ask'));
UPDATE outbound_channels SET replay = replay_before_v9;
ALTER TABLE outbound_channels DROP COLUMN replay_before_v9;
