-- Version 15: the processes that write the file, each with its build. An expand step:
-- writable_from stays 14, so the builds of schema 14 keep writing beside the newer
-- ones (they do not register themselves).
--
-- Each handle that may write adds its row when it opens, renews `seen_at` while it
-- runs and removes the row when it closes; a process killed leaves its row, which
-- counts as gone once `seen_at` is older than the lease the crate gives it. `outbox
-- migrate` reads it before a contract step (which would stop the older builds still
-- live), and health shows which builds are running.
CREATE TABLE outbound_processes (
    id            TEXT    NOT NULL PRIMARY KEY,
    schema_level  INTEGER NOT NULL,
    release       TEXT    NOT NULL,
    program       TEXT    NOT NULL,
    host          TEXT    NOT NULL,
    pid           INTEGER NOT NULL,
    started_at    INTEGER NOT NULL,
    seen_at       INTEGER NOT NULL
);
