-- Version 10: the processes that write the schema, each with its build. An expand
-- step: writable_from stays 9, so the builds of schema 9 keep writing beside the newer
-- ones (they do not register themselves).
--
-- Each handle that may write adds its row when it connects, renews `seen_at` (the
-- server's clock) while it runs and removes the row when it closes; a process killed
-- leaves its row, which counts as gone once `seen_at` is older than the lease the crate
-- gives it. `outbox migrate` reads it before a contract step (which would stop the
-- older builds still live), and health shows which builds are running.
CREATE TABLE outbound_processes (
    id            text    NOT NULL PRIMARY KEY,
    schema_level  bigint  NOT NULL,
    release       text    NOT NULL,
    program       text    NOT NULL,
    host          text    NOT NULL,
    pid           bigint  NOT NULL,
    started_at    bigint  NOT NULL,
    seen_at       bigint  NOT NULL
);
