-- Version 14: a schema says which builds may still write it.
--
-- `writable_from` is the oldest schema version whose build may still write this file:
-- every later migration that keeps the statements of older builds correct (an expand
-- step: new columns with defaults, old statements' effects completed) leaves it where
-- it is, so a process of an older release keeps enqueueing and sending through a
-- rolling upgrade; only a contract step, which drops what older builds rely on, raises
-- it. Each write reads it with the rules' version, so a process the schema no longer
-- accepts stops before its next write. `migrated_by` names the release that last
-- migrated the file: the one to upgrade to.
ALTER TABLE outbound_policy ADD COLUMN writable_from INTEGER NOT NULL DEFAULT 14;
ALTER TABLE outbound_meta ADD COLUMN migrated_by TEXT NOT NULL DEFAULT '';
