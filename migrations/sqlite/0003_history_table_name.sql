-- Version 3: the crate's history of finalized deliveries is `outbound_messages`, a name
-- that cannot collide with an application's own `messages` table when the outbox lives
-- in the application's database. Files created from here on get that name from 0001;
-- the history table of a file written by version 1 or 2 is renamed by this migration's
-- hook (`schema::rename_history`), in the same transaction.

-- The application's statement that finalization runs too, beside the row in
-- `outbound_messages` (NULL: none). Stored, so every process that may finalize — a
-- dispatcher, the tool, a recovery sweep — writes the same thing.
ALTER TABLE outbound_policy ADD COLUMN finalize_sql TEXT;

-- Per-reply data the send needs (reply-to id, thread, parse mode ...), opaque to the
-- outbox: handed to the adapter with every chunk's claim, NULL when there is none.
ALTER TABLE outbound_deliveries ADD COLUMN metadata TEXT;

-- Caller idempotency keys are scoped per channel: Telegram update 9001 and Slack event
-- 9001 are different replies.
DROP INDEX outbound_deliveries_idempotency;
CREATE UNIQUE INDEX outbound_deliveries_idempotency
    ON outbound_deliveries (channel, idempotency_key) WHERE idempotency_key IS NOT NULL;

-- A delayed reply: its first chunk is not due before this time (ms), NULL for at once.
ALTER TABLE outbound_deliveries ADD COLUMN not_before INTEGER;
