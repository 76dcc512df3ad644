-- Version 3: the crate's history of finalized deliveries is `outbound_messages`, a name
-- that cannot collide with an application's own `messages` table when the outbox lives
-- in the application's database. Files created from here on get that name from 0001;
-- the history table of a file written by version 1 or 2 is renamed by this migration's
-- hook (`schema::rename_history`), in the same transaction.
SELECT 1;
