-- Version 12: the dead letters' counts are kept by the statements that make and unmake
-- dead letters, not by triggers.
--
-- A trigger on a table makes every insert and every update of a column it names run as
-- a statement that may abort halfway: SQLite opens a statement journal for it, copies
-- each page it changes into that journal, and allocates the trigger's frame to test its
-- WHEN clause, even when the clause is false. Every claim, acknowledgement, finalization
-- and activation changes a status, so every one of them paid that, for counts that move
-- only when a reply fails, is requeued, dismissed or purged (a quarter of a batched
-- drain's time). The store's statements that can change what is counted now add to the
-- counts themselves, in the same transaction (src/store/sqlite/dead.rs); the counts
-- kept so far are the rows' and stay as they are.
DROP TRIGGER outbound_dead_letters_inserted;
DROP TRIGGER outbound_dead_letters_updated;
DROP TRIGGER outbound_dead_letters_deleted;
DROP TRIGGER outbound_failed_chunks_inserted;
DROP TRIGGER outbound_failed_chunks_updated;
DROP TRIGGER outbound_failed_chunks_deleted;
