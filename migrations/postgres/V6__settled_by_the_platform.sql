-- chunked-outbox on PostgreSQL, schema version 6: a part that may have reached its
-- platform can be settled by asking the platform (the replay policy 'ask'), and every
-- such decision is kept on the part.
--
-- first_sent_at: when a send of the part was first claimed (ms, the server's clock): the
-- earliest moment it can have reached the platform, kept across requeues and resends.
-- NULL for parts never claimed, and those claimed before version 6 (their reply's
-- creation is used instead, an earlier and so safe bound). Not indexed: a claim's
-- update stays a heap-only one.
-- settlement: what the platform was asked, what it answered and the decision taken;
-- NULL while an uncertain part has not been asked (cleared each time a part becomes
-- uncertain again).
ALTER TABLE outbound_delivery_chunks ADD COLUMN first_sent_at bigint,
                                     ADD COLUMN settlement text;

ALTER TABLE outbound_policy DROP CONSTRAINT outbound_policy_replay_check,
    ADD CONSTRAINT outbound_policy_replay_check CHECK (replay IN ('hold', 'replay', 'ask'));
ALTER TABLE outbound_channels DROP CONSTRAINT outbound_channels_replay_check,
    ADD CONSTRAINT outbound_channels_replay_check CHECK (replay IN ('hold', 'replay', 'ask'));
