//! The embedded schema and its migrations: versions, upgrades, newer files refused.
//! Connections and file checks are in [`super::connection`].

use std::path::Path;

use rusqlite::{Connection, TransactionBehavior};
use rusqlite_migration::{HookError, M, Migrations};

use crate::error::{Error, Result};

/// What a migration that rebuilds `outbound_deliveries` or `outbound_delivery_chunks`
/// runs first: DROP TABLE drops every index and trigger of the table, the application's
/// too, so those of the application are kept aside in a temporary table, to be
/// re-created by `restore_application_schema` (SQLite's documented procedure for a
/// table change). Views and the triggers of other tables that name the table are left
/// in place: `legacy_alter_table` lets the new table take the old name without SQLite
/// refusing them meanwhile, and `check_application_objects` tests them after. A macro,
/// so `concat!` can put it before the migration's own SQL.
macro_rules! keep_application_schema {
    () => {
        "PRAGMA legacy_alter_table = ON;
CREATE TEMP TABLE IF NOT EXISTS outbox_kept_schema (name TEXT PRIMARY KEY, sql TEXT NOT NULL);
INSERT OR IGNORE INTO temp.outbox_kept_schema (name, sql)
SELECT name, sql FROM main.sqlite_master
WHERE (type = 'index' OR type = 'trigger') AND sql IS NOT NULL
  AND (tbl_name = 'outbound_deliveries' OR tbl_name = 'outbound_delivery_chunks')
  AND name <> 'outbound_deliveries_idempotency' AND name <> 'outbound_deliveries_open'
  AND name <> 'outbound_deliveries_uncertain'
  AND name <> 'outbound_delivery_chunks_due' AND name <> 'outbound_deliveries_finished';
"
    };
}

/// Every migration, in order. `migrations/sqlite/NNNN_name.sql` is embedded in the binary; the
/// ones that rebuild a table keep the application's objects on it first.
const MIGRATIONS: &[&str] = &[
    include_str!("../../../migrations/sqlite/0001_initial.sql"),
    include_str!("../../../migrations/sqlite/0002_stored_policy.sql"),
    include_str!("../../../migrations/sqlite/0003_history_table_name.sql"),
    concat!(
        keep_application_schema!(),
        include_str!("../../../migrations/sqlite/0004_cancel_and_rate_limit_budget.sql")
    ),
    concat!(
        keep_application_schema!(),
        include_str!("../../../migrations/sqlite/0005_status_checks_and_microsecond_rates.sql")
    ),
    include_str!("../../../migrations/sqlite/0006_chunk_rows_at_activation.sql"),
    concat!(
        keep_application_schema!(),
        include_str!("../../../migrations/sqlite/0007_unfinalized_and_sent_before.sql")
    ),
    include_str!("../../../migrations/sqlite/0008_finished_index.sql"),
    include_str!("../../../migrations/sqlite/0009_settled_by_the_platform.sql"),
    include_str!("../../../migrations/sqlite/0010_counted_not_read.sql"),
    include_str!("../../../migrations/sqlite/0011_resend_deadline.sql"),
    include_str!("../../../migrations/sqlite/0012_counted_by_the_writer.sql"),
    include_str!("../../../migrations/sqlite/0013_open_index_by_chat.sql"),
    include_str!("../../../migrations/sqlite/0014_writable_from.sql"),
    include_str!("../../../migrations/sqlite/0015_process_registry.sql"),
];

/// What migration `version` runs after its SQL, in its transaction, if anything:
/// version 3 renames the history table of a file written by version 1 or 2; the
/// versions that rebuild a table (4, 5, 7) re-create the application's own indexes and
/// triggers on it, which `keep_application_schema!` kept in `temp.outbox_kept_schema`.
fn hook(version: usize) -> Option<(Hook, &'static str)> {
    match version {
        3 => Some((
            rename_history as Hook,
            "ALTER TABLE messages RENAME TO outbound_messages",
        )),
        4 | 5 | 7 => Some((
            restore_application_schema as Hook,
            "re-create the application's indexes and triggers (temp.outbox_kept_schema)",
        )),
        _ => None,
    }
}

/// Re-creates the application's indexes and triggers that a table rebuild dropped, from
/// the copy its migration kept, and empties that copy. One that no longer applies
/// fails the upgrade, which then names it: an object of the application's is never
/// dropped silently.
fn restore_application_schema(tx: &Connection) -> rusqlite::Result<()> {
    let kept: Vec<(String, String)> = tx
        .prepare("SELECT name, sql FROM temp.outbox_kept_schema ORDER BY rowid")?
        .query_map([], |r| Ok((r.get(0)?, r.get(1)?)))?
        .collect::<rusqlite::Result<_>>()?;
    for (name, sql) in kept {
        let exists: bool = tx.query_row(
            "SELECT EXISTS (SELECT 1 FROM main.sqlite_master WHERE name = ?1)",
            [&name],
            |r| r.get(0),
        )?;
        if !exists {
            tx.execute_batch(&sql).map_err(|e| {
                rusqlite::Error::SqliteFailure(
                    rusqlite::ffi::Error::new(rusqlite::ffi::SQLITE_ERROR),
                    Some(format!(
                        "the application's {name} on an outbox table cannot be re-created after the table was rebuilt: {}",
                        sqlite_message(&e)
                    )),
                )
            })?;
        }
    }
    tx.execute_batch("DROP TABLE temp.outbox_kept_schema; PRAGMA legacy_alter_table = OFF")?;
    check_application_objects(tx)
}

/// Checks that every view and trigger in the file still reads what exists, now that a
/// rebuild renamed its new table to the old name without looking at them (SQLite's
/// `legacy_alter_table`, so that the application's views and the triggers of its own
/// tables, which name the table, are not refused while it is briefly gone): renaming a
/// scratch table makes SQLite test each of them, and one that no longer applies fails
/// the upgrade, which then names it ([`advice`]).
fn check_application_objects(tx: &Connection) -> rusqlite::Result<()> {
    tx.execute_batch("SAVEPOINT outbox_upgrade_check")?;
    let checked = tx.execute_batch(
        "CREATE TABLE outbox_upgrade_check (x);
         ALTER TABLE outbox_upgrade_check RENAME TO outbox_upgrade_checked;",
    );
    tx.execute_batch("ROLLBACK TO outbox_upgrade_check; RELEASE outbox_upgrade_check")?;
    checked
}

/// SQLite's `message` about a failed upgrade, with what to do when it names a view or a
/// trigger (the application's: the outbox has none) that reads what the upgrade changes.
fn advice(message: String) -> String {
    let object = ["view", "trigger"].into_iter().find_map(|kind| {
        let rest = message.strip_prefix("error in ")?.strip_prefix(kind)?;
        let name = rest.trim_start().split(':').next()?.trim();
        Some((kind, name.to_owned()))
    });
    match object {
        Some((kind, name)) => format!(
            "{message} (the {kind} {name} reads what this upgrade changes: drop it, open the \
             outbox to upgrade the file, then create it again against the new tables; \
             nothing was changed)"
        ),
        None => message,
    }
}

/// Rust that a migration runs after its SQL.
type Hook = fn(&Connection) -> rusqlite::Result<()>;

/// The migrations with their hooks.
fn migrations() -> Migrations<'static> {
    Migrations::new(
        MIGRATIONS
            .iter()
            .enumerate()
            .map(|(i, sql)| match hook(i + 1) {
                Some((run, _)) => M::up_with_hook(sql, move |tx: &rusqlite::Transaction| {
                    run(tx).map_err(HookError::from)
                }),
                None => M::up(sql),
            })
            .collect(),
    )
}

/// Renames a version 1 or 2 history table, `messages`, to `outbound_messages`. A file
/// created at version 3 or later already has `outbound_messages` from its first
/// migration, and whatever `messages` table it has is the application's.
fn rename_history(tx: &Connection) -> rusqlite::Result<()> {
    let exists = |name: &str| -> rusqlite::Result<bool> {
        tx.query_row(
            "SELECT EXISTS (SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?1)",
            [name],
            |r| r.get(0),
        )
    };
    if !exists("outbound_messages")? {
        tx.execute_batch("ALTER TABLE messages RENAME TO outbound_messages")?;
    }
    Ok(())
}

/// The schema version this build writes (SQLite `user_version`).
pub const SCHEMA_VERSION: i64 = MIGRATIONS.len() as i64;

/// The first schema version that says which builds may write it (`writable_from`):
/// an older file accepts only its own build.
const WRITABLE_FROM_SINCE: i64 = 14;

/// The oldest build (schema version) this build's schema accepts as a writer: what
/// its migrations leave in `outbound_policy.writable_from`. Only a contract step raises
/// it.
pub(crate) const WRITABLE_FROM: i64 = 14;

fn user_version(conn: &Connection) -> Result<i64> {
    Ok(conn.query_row("PRAGMA user_version", [], |r| r.get(0))?)
}

/// How a file's schema stands to this build.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Standing {
    /// Older than this build's: it needs a migration.
    Older(i64),
    /// This build's own.
    Current,
    /// Newer, and still accepting this build as a writer (it was migrated by an expand
    /// step): written as it is, never migrated by this build.
    NewerAccepting(i64),
}

/// How the schema of `conn`'s file stands to this build; [`Error::SchemaTooNew`] if a
/// newer build migrated it past what this one may write. Reads only, so a refused file
/// is left byte for byte as it was.
pub(crate) fn standing(conn: &Connection) -> Result<Standing> {
    let found = user_version(conn)?;
    if found < SCHEMA_VERSION {
        return Ok(Standing::Older(found));
    }
    if found == SCHEMA_VERSION {
        return Ok(Standing::Current);
    }
    let said = conn.query_row(
        "SELECT p.writable_from, m.migrated_by FROM outbound_policy p, outbound_meta m
         WHERE p.id = 1",
        [],
        |r| Ok((r.get::<_, i64>(0)?, r.get::<_, String>(1)?)),
    );
    let (writable_from, migrated_by) = match said {
        Ok(said) if found >= WRITABLE_FROM_SINCE => said,
        // No such table or column (not a statement that ran: one that could not be
        // compiled): a file that says nothing of its writers accepts only its own.
        Err(rusqlite::Error::SqliteFailure(e, _)) if e.code == rusqlite::ErrorCode::Unknown => {
            (found, String::new())
        }
        Ok(_) => (found, String::new()),
        Err(e) => return Err(e.into()),
    };
    if writable_from <= SCHEMA_VERSION {
        return Ok(Standing::NewerAccepting(found));
    }
    Err(too_new(found, writable_from, &migrated_by))
}

/// The refusal of a file at schema `found` that accepts writers from `writable_from`
/// on, migrated by `migrated_by` (empty if unknown).
pub(crate) fn too_new(found: i64, writable_from: i64, migrated_by: &str) -> Error {
    Error::SchemaTooNew {
        found,
        supported: SCHEMA_VERSION,
        writable_from,
        upgrade_to: if migrated_by.is_empty() {
            format!("a chunked-outbox release of schema {writable_from} or later")
        } else {
            migrated_by.to_owned()
        },
    }
}

/// Refuses a file written by a newer version that no longer accepts this build. Called
/// before anything (even a pragma such as `journal_mode`) is written, so a refused file
/// is left byte for byte as it was.
pub(crate) fn refuse_newer(conn: &Connection) -> Result<()> {
    standing(conn).map(drop)
}

/// What `outbound_meta.migrated_by` says of this build: the release to upgrade to.
fn this_release() -> String {
    crate::store::release(SCHEMA_VERSION)
}

/// Brings the schema to [`SCHEMA_VERSION`], refusing a newer one before writing.
///
/// Several processes may open a new file at once: whoever loses the race finds the
/// schema already current after its own attempt failed, and that is success.
pub(crate) fn migrate(conn: &mut Connection) -> Result<()> {
    let Standing::Older(from) = standing(conn)? else {
        return Ok(());
    };
    conn.set_transaction_behavior(TransactionBehavior::Immediate);
    let result = migrations().to_latest(conn);
    conn.set_transaction_behavior(TransactionBehavior::Deferred);
    let outcome = match result {
        Ok(()) => conn
            .execute(
                "UPDATE outbound_meta SET migrated_by = ?1",
                [this_release()],
            )
            .and_then(|_| {
                if !crate::sabotage::planted("expand_refuses_old_writers") {
                    return Ok(0);
                }
                conn.execute(
                    "UPDATE outbound_policy SET writable_from = ?1",
                    [SCHEMA_VERSION],
                )
            })
            .map(drop)
            .map_err(Error::from),
        Err(_) if user_version(conn)? == SCHEMA_VERSION => Ok(()),
        Err(rusqlite_migration::Error::RusqliteError { err, .. }) => match Error::from(err) {
            // Nothing wrong with the schema: the file is busy, full, read-only, ...
            Error::Sqlite(_) => Err(failed_statement(conn, from)),
            operational => Err(operational),
        },
        Err(e) => Err(Error::Migration {
            version: SCHEMA_VERSION,
            statement: String::new(),
            message: e.to_string(),
        }),
    };
    // A rebuild that failed, or its replay, may have left it on (see
    // `check_application_objects`).
    conn.execute_batch("PRAGMA legacy_alter_table = OFF")?;
    outcome
}

/// Finds which statement of which migration fails on this file, replaying the
/// migrations from version `from` one statement at a time in a transaction that is
/// rolled back: the error names that statement, not the whole migration file.
fn failed_statement(conn: &mut Connection, from: i64) -> Error {
    // Where no single statement fails, the error is the upgrade's as a whole.
    let unknown = |message: String| Error::Migration {
        version: SCHEMA_VERSION,
        statement: String::new(),
        message,
    };
    let tx = match conn.transaction() {
        Ok(tx) => tx,
        Err(e) => return unknown(e.to_string()),
    };
    for (i, sql) in MIGRATIONS.iter().enumerate().skip(from as usize) {
        for statement in statements(sql) {
            if let Err(e) = tx.execute_batch(statement) {
                // As written, without the comments before it.
                let lines = statement.trim().lines();
                let code: Vec<&str> = lines.skip_while(|l| l.starts_with("--")).collect();
                return Error::Migration {
                    version: i as i64 + 1,
                    statement: code.join("\n").trim().to_owned(),
                    message: advice(sqlite_message(&e)),
                };
            }
        }
        if let Some((run, what)) = hook(i + 1)
            && let Err(e) = run(&tx)
        {
            return Error::Migration {
                version: i as i64 + 1,
                statement: what.into(),
                message: advice(sqlite_message(&e)),
            };
        }
    }
    unknown("the migration failed, but each of its statements applies on its own".into())
}

/// SQLite's own message, without the SQL text some errors carry.
pub(crate) fn sqlite_message(e: &rusqlite::Error) -> String {
    match e {
        rusqlite::Error::SqlInputError { msg, .. } => msg.clone(),
        rusqlite::Error::SqliteFailure(_, Some(msg)) => msg.clone(),
        other => other.to_string(),
    }
}

/// The statements of a migration file: split at each `;` outside comments and quotes,
/// except inside a trigger's body, which ends at the `;` after its `END`.
fn statements(sql: &str) -> Vec<&str> {
    let (mut out, mut start) = (Vec::new(), 0);
    let mut chars = sql.char_indices().peekable();
    while let Some((i, c)) = chars.next() {
        match c {
            '-' if chars.peek().is_some_and(|&(_, n)| n == '-') => {
                for (_, n) in chars.by_ref() {
                    if n == '\n' {
                        break;
                    }
                }
            }
            '\'' | '"' => {
                for (_, n) in chars.by_ref() {
                    if n == c {
                        break;
                    }
                }
            }
            ';' => {
                let statement = &sql[start..i];
                let words = |text: &str| -> Vec<String> {
                    text.lines()
                        .filter(|line| !line.trim_start().starts_with("--"))
                        .flat_map(|line| line.split_whitespace())
                        .map(str::to_ascii_uppercase)
                        .collect()
                };
                let all = words(statement);
                let trigger = all.len() >= 2 && all[..2] == ["CREATE", "TRIGGER"];
                if !trigger || all.last().is_some_and(|w| w == "END") {
                    out.push(&sql[start..=i]);
                    start = i + 1;
                }
            }
            _ => {}
        }
    }
    out
}

/// Refuses, without writing anything, a file this handle may not bring up to date: an
/// older outbox (`SchemaTooOld`), or a file with tables that is not an outbox at all
/// (`NotAnOutbox`). An empty file counts as not an outbox too: only a handle that may
/// create (and so upgrade) one gives it a schema.
pub(crate) fn refuse_upgrade(conn: &Connection, path: &Path) -> Result<()> {
    let found = match standing(conn)? {
        Standing::Current | Standing::NewerAccepting(_) => return Ok(()),
        Standing::Older(found) => found,
    };
    let ours: bool = conn.query_row(
        "SELECT EXISTS (SELECT 1 FROM sqlite_master WHERE name = 'outbound_meta')",
        [],
        |r| r.get(0),
    )?;
    if found > 0 && ours {
        return Err(Error::SchemaTooOld {
            path: path.to_owned(),
            found,
            current: SCHEMA_VERSION,
        });
    }
    Err(Error::NotAnOutbox {
        path: path.to_owned(),
    })
}

/// This database's salt for delivery uids (see `DeliveryId::for_row`), drawn when the
/// file was created.
pub(crate) fn id_salt(conn: &Connection) -> Result<i64> {
    Ok(conn.query_row("SELECT id_salt FROM outbound_meta", [], |r| r.get(0))?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::sqlite::connection::check_file;
    use rusqlite::OptionalExtension;

    #[test]
    fn migrations_are_valid() {
        migrations().validate().unwrap();
        assert_eq!(SCHEMA_VERSION, 15);
    }

    /// The first column of each row `sql` reads, as text.
    fn dump(conn: &Connection, sql: &str) -> Vec<String> {
        conn.prepare(sql)
            .unwrap()
            .query_map([], |r| r.get(0))
            .unwrap()
            .collect::<rusqlite::Result<_>>()
            .unwrap()
    }

    fn schema_of(conn: &Connection) -> Vec<String> {
        let mut stmt = conn
            .prepare("SELECT coalesce(sql, name) FROM sqlite_master ORDER BY name")
            .unwrap();
        stmt.query_map([], |r| r.get(0))
            .unwrap()
            .collect::<rusqlite::Result<_>>()
            .unwrap()
    }

    /// The statement splitter that names a failed statement cuts every migration into
    /// statements that, run one by one, build exactly the schema the whole files build.
    #[test]
    fn migrations_split_into_statements_that_build_the_same_schema() {
        let whole = Connection::open_in_memory().unwrap();
        let split = Connection::open_in_memory().unwrap();
        for sql in MIGRATIONS {
            whole.execute_batch(sql).unwrap();
            let statements = statements(sql);
            assert!(!statements.is_empty());
            for statement in statements {
                assert!(
                    !statement.to_uppercase().contains("CREATE TRIGGER")
                        || statement.trim_end().to_uppercase().ends_with("END;"),
                    "the splitter does not cut trigger bodies: {statement}"
                );
                split.execute_batch(statement).unwrap();
            }
        }
        assert_eq!(schema_of(&whole), schema_of(&split));
        assert!(schema_of(&whole).len() > 10);
    }

    #[test]
    fn the_splitter_ignores_semicolons_in_comments_and_quotes() {
        let sql = "-- a; comment\nSELECT 'a;b', \"c;d\"; SELECT 3 - 2; SELECT 2;\n-- tail;";
        assert_eq!(
            statements(sql),
            vec![
                "-- a; comment\nSELECT 'a;b', \"c;d\";",
                " SELECT 3 - 2;",
                " SELECT 2;"
            ]
        );
    }

    /// After a rebuild renamed without looking (`legacy_alter_table`), the check finds
    /// a view that no longer reads what exists, and the advice names it and what to do.
    #[test]
    fn a_view_a_rebuild_broke_is_found_and_named() {
        let conn = Connection::open_in_memory().unwrap();
        conn.execute_batch(
            "CREATE TABLE t (a, b); CREATE VIEW app_reads_a AS SELECT a FROM t;
             CREATE TABLE app_log (x);
             CREATE TRIGGER app_logs AFTER INSERT ON app_log BEGIN UPDATE t SET b = new.x; END;",
        )
        .unwrap();
        check_application_objects(&conn).unwrap();
        conn.execute_batch(
            "PRAGMA legacy_alter_table = ON; DROP TABLE t; CREATE TABLE t_new (b);
             ALTER TABLE t_new RENAME TO t; PRAGMA legacy_alter_table = OFF;",
        )
        .unwrap();
        let message = advice(sqlite_message(
            &check_application_objects(&conn).unwrap_err(),
        ));
        assert!(
            message.starts_with(
                "error in view app_reads_a: no such column: a (the view app_reads_a reads"
            ) && message.contains("drop it"),
            "{message}"
        );
        conn.execute_batch("DROP VIEW app_reads_a").unwrap();
        check_application_objects(&conn).unwrap();
        conn.execute_batch("DROP TABLE t").unwrap();
        let message = advice(sqlite_message(
            &check_application_objects(&conn).unwrap_err(),
        ));
        assert!(message.contains("(the trigger app_logs reads"), "{message}");
        assert_eq!(advice("disk I/O error".into()), "disk I/O error");
    }

    /// A file of version 1 whose history table cannot be renamed (something already
    /// holds the new name) names the rename as the statement that failed.
    #[test]
    fn a_failed_rename_is_named() {
        let mut conn = Connection::open_in_memory().unwrap();
        conn.execute_batch(MIGRATIONS[0]).unwrap();
        conn.execute_batch(
            "ALTER TABLE outbound_messages RENAME TO messages;
             CREATE VIEW outbound_messages AS SELECT 1;
             PRAGMA user_version = 1;",
        )
        .unwrap();
        let err = migrate(&mut conn).unwrap_err();
        match err {
            Error::Migration {
                version, statement, ..
            } => assert_eq!(
                (version, statement.as_str()),
                (3, "ALTER TABLE messages RENAME TO outbound_messages")
            ),
            other => panic!("{other:?}"),
        }
        assert_eq!(user_version(&conn).unwrap(), 1, "nothing applied");
    }

    /// Version 4 rebuilds the deliveries table to admit `cancelled`: every column of
    /// every row, and both indexes, come through; the CHECK still refuses unknown words.
    #[test]
    fn version_five_keeps_every_row_and_index_and_converts_rates_to_microseconds() {
        let mut conn = Connection::open_in_memory().unwrap();
        migrations().to_version(&mut conn, 4).unwrap();
        conn.execute_batch(
            "INSERT INTO outbound_deliveries VALUES
               (7, 'u7', 'slack', 'C1', 'bot', 'key-1', 'partial', 2, 1, 10, 11, NULL, NULL,
                'a b', NULL, '{}', 5000);
             INSERT INTO outbound_delivery_chunks VALUES
               (7 * 16384, 7, 0, 'delivered', 1, NULL, NULL, NULL, 'p1', 12, 'a', 1, 0),
               (7 * 16384 + 1, 7, 1, 'retry', 2, 99, 5, 'boom', NULL, NULL, 'b', 1, 3);
             INSERT INTO outbound_channels (id, name, replay, channel_interval_ms, next_send_at)
               VALUES (1, 'slack', 'hold', 34, 1000);
             UPDATE outbound_policy SET channel_interval_ms = 5 WHERE id = 1;",
        )
        .unwrap();
        let dump = |conn: &Connection, sql: &str| -> Vec<String> {
            let mut stmt = conn.prepare(sql).unwrap();
            stmt.query_map([], |r| r.get(0))
                .unwrap()
                .collect::<rusqlite::Result<_>>()
                .unwrap()
        };
        let deliveries = "SELECT json_array(id, uid, channel, chat_id, sender, idempotency_key,
            status, chunk_count, delivered_count, created_at, updated_at, finished_at,
            acknowledged_at, text, corrupt, metadata, not_before) FROM outbound_deliveries";
        let chunks = "SELECT json_array(id, delivery_id, chunk_index, status, attempts, due_at,
            claim_token, last_error, platform_message_id, delivered_at, text, channel_id,
            rate_limits) FROM outbound_delivery_chunks ORDER BY id";
        let indexes = "SELECT name FROM sqlite_master WHERE type = 'index'
            AND name NOT LIKE 'sqlite_autoindex%' ORDER BY name";
        let mut before = (
            dump(&conn, deliveries),
            dump(&conn, chunks),
            dump(&conn, indexes),
        );
        migrate(&mut conn).unwrap();
        // Version 8 adds one, version 10 two (the dead letters'), version 13 one (the
        // uncertain replies').
        before.2.extend([
            "outbound_deliveries_finished".into(),
            "outbound_deliveries_dead".into(),
            "outbound_deliveries_dead_newest".into(),
            "outbound_deliveries_uncertain".into(),
        ]);
        before.2.sort();
        let after = (
            dump(&conn, deliveries),
            dump(&conn, chunks),
            dump(&conn, indexes),
        );
        assert_eq!(after, before);
        assert_eq!(
            dump(
                &conn,
                "SELECT json_array(channel_interval_us, next_send_at_us) FROM outbound_channels"
            ),
            ["[34000,1000000]"]
        );
        let policy: i64 = conn
            .query_row("SELECT channel_interval_us FROM outbound_policy", [], |r| {
                r.get(0)
            })
            .unwrap();
        assert_eq!(policy, 5000);
        // The checks still refuse a status no code writes.
        for sql in [
            "UPDATE outbound_deliveries SET status = 'withdrawn'",
            "UPDATE outbound_delivery_chunks SET status = 'queued'",
        ] {
            assert!(conn.execute(sql, []).is_err(), "{sql}");
        }
    }

    /// Version 9 admits the replay policy `ask`: the stored replay policies come
    /// through, the CHECK still refuses an unknown word, and a chunk gains its first
    /// send's time and settlement, empty.
    /// Version 10 keeps every row, counts the dead letters already there, and the
    /// counts follow the rows after it.
    #[test]
    fn version_ten_keeps_every_row_and_counts_the_dead_letters_there() {
        let mut conn = Connection::open_in_memory().unwrap();
        migrations().to_version(&mut conn, 9).unwrap();
        conn.execute_batch(
            "INSERT INTO outbound_channels (id, name) VALUES (1, 'slack'), (2, 'telegram');
             INSERT INTO outbound_deliveries (id, uid, channel, chat_id, status, chunk_count,
                 delivered_count, created_at, updated_at, text, acknowledged_at, corrupt,
                 finished_at)
             VALUES (1, 'u1', 'slack', 'a', 'failed', 2, 0, 1, 1, 'x y', NULL, NULL, 60000),
                    (2, 'u2', 'slack', 'b', 'failed', 1, 0, 1, 1, 'x', 5, NULL, 60500),
                    (3, 'u3', 'telegram', 'a', 'failed', 1, 0, 1, 1, 'x', NULL, 'bad text',
                     180000),
                    (4, 'u4', 'telegram', 'a', 'pending', 1, 0, 1, 1, 'x', NULL, NULL, NULL),
                    (5, 'u5', 'slack', 'c', 'delivered', 1, 1, 1, 1, 'x', NULL, NULL, 61000),
                    (6, 'u6', 'slack', 'c', 'uncertain', 1, 0, 1, 1, 'x', NULL, NULL, NULL);
             INSERT INTO outbound_delivery_chunks (id, delivery_id, chunk_index, status, channel_id)
             VALUES (1 * 16384, 1, 0, 'failed', 1), (1 * 16384 + 1, 1, 1, 'pending', 1),
                    (2 * 16384, 2, 0, 'failed', 1), (3 * 16384, 3, 0, 'failed', 2),
                    (4 * 16384, 4, 0, 'pending', 2), (5 * 16384, 5, 0, 'delivered', 1),
                    (6 * 16384, 6, 0, 'uncertain', 1);",
        )
        .unwrap();
        let rows = "SELECT json_array(id, uid, channel, chat_id, status, acknowledged_at, corrupt)
                    FROM outbound_deliveries ORDER BY id";
        let chunks = "SELECT json_array(id, status, channel_id) FROM outbound_delivery_chunks
                      ORDER BY id";
        let before = (dump(&conn, rows), dump(&conn, chunks));
        migrations().to_version(&mut conn, 10).unwrap();
        assert_eq!((dump(&conn, rows), dump(&conn, chunks)), before);
        let counts = |conn: &Connection| {
            dump(
                conn,
                "SELECT json_array(channel, dead_letters, unacknowledged, corrupt, failed_chunks)
                 FROM outbound_dead_letter_counts WHERE dead_letters OR failed_chunks
                 ORDER BY channel",
            )
        };
        assert_eq!(
            counts(&conn),
            ["[\"slack\",2,1,0,2]", "[\"telegram\",1,1,1,1]"]
        );
        // The replies finished so far, counted by the minute they finished in.
        assert_eq!(
            dump(
                &conn,
                "SELECT json_array(minute, delivered, failed, latency_sum_ms, latency_max_ms)
                 FROM outbound_activity ORDER BY minute"
            ),
            ["[1,1,2,60999,60999]", "[3,0,1,0,0]"]
        );
        // After it (until version 12), the triggers keep them: a requeue, an
        // acknowledgement, a purge.
        conn.execute_batch(
            "UPDATE outbound_deliveries SET status = 'pending' WHERE id = 1;
             UPDATE outbound_delivery_chunks SET status = 'retry' WHERE id = 16384;
             UPDATE outbound_deliveries SET acknowledged_at = 9 WHERE id = 3;
             DELETE FROM outbound_deliveries WHERE id = 2;
             DELETE FROM outbound_delivery_chunks WHERE delivery_id = 2;
             UPDATE outbound_deliveries SET status = 'failed' WHERE id = 4;
             UPDATE outbound_delivery_chunks SET status = 'failed' WHERE id = 4 * 16384;",
        )
        .unwrap();
        assert_eq!(counts(&conn), ["[\"telegram\",2,1,1,2]"]);
    }

    /// Replies in every state (and their chunks) on two channels, as versions 11 to 13
    /// store them.
    const EVERY_STATE: &str =
        "INSERT INTO outbound_channels (id, name) VALUES (1, 'slack'), (2, 'telegram');
             INSERT INTO outbound_deliveries (id, uid, channel, chat_id, status, chunk_count,
                 delivered_count, created_at, updated_at, text, acknowledged_at, corrupt,
                 finished_at, finalize_error)
             VALUES (1, 'u1', 'slack', 'a', 'failed', 2, 1, 1, 2, 'x y', NULL, NULL, 60000, NULL),
                    (2, 'u2', 'slack', 'b', 'failed', 1, 0, 1, 2, 'x', 5, NULL, 60500, NULL),
                    (3, 'u3', 'telegram', 'a', 'failed', 1, 0, 1, 2, 'x', NULL, 'bad', 9, NULL),
                    (4, 'u4', 'telegram', 'a', 'queued', 1, 0, 1, 1, 'x', NULL, NULL, NULL, NULL),
                    (5, 'u5', 'slack', 'c', 'delivered', 1, 1, 1, 3, 'x', NULL, NULL, 61000, NULL),
                    (6, 'u6', 'slack', 'c', 'uncertain', 1, 0, 1, 1, 'x', NULL, NULL, NULL, NULL),
                    (7, 'u7', 'slack', 'd', 'pending', 1, 0, 1, 1, 'x', NULL, NULL, NULL, NULL),
                    (8, 'u8', 'slack', 'e', 'partial', 2, 1, 1, 1, 'x y', NULL, NULL, NULL, NULL),
                    (9, 'u9', 'slack', 'f', 'cancelled', 1, 0, 1, 1, 'x', NULL, NULL, 7, NULL),
                    (10, 'u10', 'slack', 'g', 'unfinalized', 1, 1, 1, 1, 'x', NULL, NULL, NULL,
                     'no such table');
             INSERT INTO outbound_delivery_chunks
                 (id, delivery_id, chunk_index, status, channel_id, attempts, due_at,
                  claim_token, resend_by)
             VALUES (1 * 16384, 1, 0, 'delivered', 1, 1, NULL, NULL, NULL),
                    (1 * 16384 + 1, 1, 1, 'failed', 1, 5, NULL, NULL, NULL),
                    (2 * 16384, 2, 0, 'failed', 1, 1, NULL, NULL, NULL),
                    (3 * 16384, 3, 0, 'failed', 2, 0, NULL, NULL, NULL),
                    (5 * 16384, 5, 0, 'delivered', 1, 1, NULL, NULL, NULL),
                    (6 * 16384, 6, 0, 'uncertain', 1, 1, NULL, 3, 70000),
                    (7 * 16384, 7, 0, 'sending', 1, 1, 90000, 4, NULL),
                    (8 * 16384, 8, 0, 'delivered', 1, 1, NULL, NULL, NULL),
                    (8 * 16384 + 1, 8, 1, 'retry', 1, 2, 80000, NULL, NULL),
                    (10 * 16384, 10, 0, 'delivered', 1, 1, NULL, NULL, NULL);";

    /// The columns of [`EVERY_STATE`]'s replies, a row each.
    const EVERY_STATE_ROWS: &str = "SELECT json_array(id, uid, channel, chat_id, status,
            chunk_count, delivered_count, created_at, updated_at, text, acknowledged_at,
            corrupt, finished_at, finalize_error)
        FROM outbound_deliveries ORDER BY id";

    /// The columns of [`EVERY_STATE`]'s chunks, a row each.
    const EVERY_STATE_CHUNKS: &str = "SELECT json_array(id, delivery_id, chunk_index, status,
            channel_id, attempts, due_at, claim_token, resend_by)
        FROM outbound_delivery_chunks ORDER BY id";

    /// Version 12 keeps every row of a file of version 11, with replies in every state,
    /// and the dead letters' counts its triggers kept; the triggers are gone.
    #[test]
    fn version_twelve_keeps_every_row_and_the_counts_without_triggers() {
        let mut conn = Connection::open_in_memory().unwrap();
        migrations().to_version(&mut conn, 11).unwrap();
        // Written through version 11's triggers, which count the dead letters.
        conn.execute_batch(EVERY_STATE).unwrap();
        let counts = "SELECT json_array(channel, dead_letters, unacknowledged, corrupt,
                          failed_chunks)
                      FROM outbound_dead_letter_counts WHERE dead_letters OR failed_chunks
                      ORDER BY channel";
        let before = (
            dump(&conn, EVERY_STATE_ROWS),
            dump(&conn, EVERY_STATE_CHUNKS),
            dump(&conn, counts),
        );
        assert_eq!(
            before.2,
            ["[\"slack\",2,1,0,2]", "[\"telegram\",1,1,1,1]"],
            "version 11's triggers counted them"
        );
        migrate(&mut conn).unwrap();
        assert_eq!(
            (
                dump(&conn, EVERY_STATE_ROWS),
                dump(&conn, EVERY_STATE_CHUNKS),
                dump(&conn, counts)
            ),
            before
        );
        let triggers: i64 = conn
            .query_row(
                "SELECT count(*) FROM sqlite_master WHERE type = 'trigger'",
                [],
                |r| r.get(0),
            )
            .unwrap();
        assert_eq!(triggers, 0, "no trigger is left on the outbox's tables");
    }

    /// Version 13 keeps every row of a file of version 12, with replies in every state;
    /// its index of work in flight holds the same replies, keyed by chat first, and
    /// each lane's head and the uncertain replies are read as before.
    #[test]
    fn version_thirteen_keeps_every_row_and_reads_the_lanes_as_before() {
        let mut conn = Connection::open_in_memory().unwrap();
        migrations().to_version(&mut conn, 12).unwrap();
        conn.execute_batch(EVERY_STATE).unwrap();
        let in_flight = "SELECT CAST(id AS TEXT) FROM outbound_deliveries
                         INDEXED BY outbound_deliveries_open
                         WHERE status <> 'delivered' AND status <> 'failed' ORDER BY id";
        let reads = |conn: &Connection| {
            let lanes = dump(
                conn,
                "SELECT DISTINCT json_array(channel, chat_id) FROM outbound_deliveries
                 ORDER BY 1",
            );
            let mut head = conn.prepare(crate::store::sqlite::lanes::HEAD_SQL).unwrap();
            let heads: Vec<String> = lanes
                .iter()
                .map(|lane| {
                    let lane: (String, String) = serde_json::from_str(lane).unwrap();
                    let found: Option<(bool, i64)> = head
                        .query_row([&lane.0, &lane.1], |r| Ok((r.get(0)?, r.get(1)?)))
                        .optional()
                        .unwrap();
                    format!("{lane:?}: {found:?}")
                })
                .collect();
            let unasked: Vec<i64> = ["slack", "telegram"]
                .iter()
                .flat_map(|channel| {
                    conn.prepare(crate::store::sqlite::operator::UNASKED_SQL)
                        .unwrap()
                        .query_map(rusqlite::params![channel, 10], |r| r.get(0))
                        .unwrap()
                        .collect::<rusqlite::Result<Vec<i64>>>()
                        .unwrap()
                })
                .collect();
            (heads, unasked)
        };
        let before = (
            dump(&conn, EVERY_STATE_ROWS),
            dump(&conn, EVERY_STATE_CHUNKS),
            dump(&conn, in_flight),
            reads(&conn),
        );
        assert_eq!(
            before.2,
            ["4", "6", "7", "8", "9", "10"],
            "the work in flight, held by version 12's index"
        );
        assert_eq!(
            before.3.1,
            [6 * 16384],
            "the uncertain part nobody asked about"
        );
        migrate(&mut conn).unwrap();
        assert_eq!(
            (
                dump(&conn, EVERY_STATE_ROWS),
                dump(&conn, EVERY_STATE_CHUNKS),
                dump(&conn, in_flight),
                reads(&conn)
            ),
            before
        );
        assert_eq!(
            dump(
                &conn,
                "SELECT group_concat(name, ',') FROM pragma_index_info('outbound_deliveries_open')"
            ),
            ["chat_id,channel,status,id"]
        );
    }

    #[test]
    fn version_nine_keeps_the_replay_policies_and_admits_ask() {
        let mut conn = Connection::open_in_memory().unwrap();
        migrations().to_version(&mut conn, 8).unwrap();
        conn.execute_batch(
            "UPDATE outbound_policy SET replay = 'hold', lane_interval_ms = 7 WHERE id = 1;
             INSERT INTO outbound_channels (id, name, replay, lane_interval_ms)
               VALUES (1, 'matrix', 'replay', 5), (2, 'telegram', NULL, NULL);",
        )
        .unwrap();
        migrate(&mut conn).unwrap();
        let rows: Vec<(String, Option<String>, Option<i64>)> = conn
            .prepare("SELECT name, replay, lane_interval_ms FROM outbound_channels ORDER BY id")
            .unwrap()
            .query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))
            .unwrap()
            .collect::<rusqlite::Result<_>>()
            .unwrap();
        assert_eq!(
            rows,
            [
                ("matrix".into(), Some("replay".into()), Some(5)),
                ("telegram".into(), None, None)
            ]
        );
        let policy: (String, i64) = conn
            .query_row(
                "SELECT replay, lane_interval_ms FROM outbound_policy",
                [],
                |r| Ok((r.get(0)?, r.get(1)?)),
            )
            .unwrap();
        assert_eq!(policy, ("hold".into(), 7));
        conn.execute(
            "UPDATE outbound_channels SET replay = 'ask' WHERE id = 2",
            [],
        )
        .unwrap();
        for sql in [
            "UPDATE outbound_channels SET replay = 'maybe'",
            "UPDATE outbound_policy SET replay = 'maybe'",
        ] {
            assert!(conn.execute(sql, []).is_err(), "{sql}");
        }
        conn.execute_batch("SELECT first_sent_at, settlement FROM outbound_delivery_chunks")
            .unwrap();
    }

    #[test]
    fn the_rebuild_for_cancel_keeps_every_row_and_index() {
        let mut conn = Connection::open_in_memory().unwrap();
        migrations().to_version(&mut conn, 3).unwrap();
        conn.execute_batch(
            "INSERT INTO outbound_deliveries VALUES
               (7, 'u7', 'slack', 'C1', 'bot', 'key-1', 'failed', 2, 1, 10, 11, 12, 13, 'a b',
                'bad uid', '{\"thread_ts\":\"1.2\"}', 5000),
               (8, 'u8', 'telegram', '42', NULL, NULL, 'queued', 1, 0, 20, 20, NULL, NULL, 'c',
                NULL, NULL, NULL);",
        )
        .unwrap();
        let rows = |conn: &Connection| -> Vec<String> {
            let mut stmt = conn
                .prepare(
                    "SELECT json_array(id, uid, channel, chat_id, sender, idempotency_key,
                        status, chunk_count, delivered_count, created_at, updated_at,
                        finished_at, acknowledged_at, text, corrupt, metadata, not_before)
                     FROM outbound_deliveries ORDER BY id",
                )
                .unwrap();
            stmt.query_map([], |r| r.get(0))
                .unwrap()
                .collect::<rusqlite::Result<_>>()
                .unwrap()
        };
        let before = rows(&conn);
        assert_eq!(before.len(), 2);
        migrate(&mut conn).unwrap();
        assert_eq!(rows(&conn), before);
        let indexes: Vec<String> = conn
            .prepare(
                "SELECT name FROM sqlite_master
                 WHERE type = 'index' AND tbl_name = 'outbound_deliveries' ORDER BY name",
            )
            .unwrap()
            .query_map([], |r| r.get(0))
            .unwrap()
            .collect::<rusqlite::Result<_>>()
            .unwrap();
        assert_eq!(
            indexes,
            [
                "outbound_deliveries_dead",
                "outbound_deliveries_dead_newest",
                "outbound_deliveries_finished",
                "outbound_deliveries_idempotency",
                "outbound_deliveries_open",
                "outbound_deliveries_uncertain"
            ]
        );
        conn.execute(
            "UPDATE outbound_deliveries SET status = 'cancelled' WHERE id = 8",
            [],
        )
        .unwrap();
        assert!(
            conn.execute(
                "UPDATE outbound_deliveries SET status = 'withdrawn' WHERE id = 8",
                []
            )
            .is_err()
        );
        // The caller key is still unique per channel.
        assert!(
            conn.execute(
                "INSERT INTO outbound_deliveries (id, uid, channel, chat_id, idempotency_key,
                    status, chunk_count, created_at, updated_at, text)
                 VALUES (9, 'u9', 'slack', 'C2', 'key-1', 'queued', 1, 1, 1, 'd')",
                []
            )
            .is_err()
        );
    }

    #[test]
    fn newer_schema_is_refused_and_left_alone() {
        let mut conn = Connection::open_in_memory().unwrap();
        conn.pragma_update(None, "user_version", SCHEMA_VERSION + 1)
            .unwrap();
        let err = migrate(&mut conn).unwrap_err();
        assert!(
            matches!(err, Error::SchemaTooNew { found, supported, writable_from, .. } if found == SCHEMA_VERSION + 1 && supported == SCHEMA_VERSION && writable_from == found),
            "{err:?}"
        );
        let tables: i64 = conn
            .query_row("SELECT count(*) FROM sqlite_master", [], |r| r.get(0))
            .unwrap();
        assert_eq!(tables, 0);
    }

    /// A newer schema that still accepts this build (an expand step) is written as it
    /// is and never migrated; one whose contract step took that away is refused,
    /// naming the release that migrated it.
    #[test]
    fn a_newer_schema_is_written_while_it_accepts_this_build() {
        let mut conn = Connection::open_in_memory().unwrap();
        migrate(&mut conn).unwrap();
        let stored: (i64, String) = conn
            .query_row(
                "SELECT p.writable_from, m.migrated_by FROM outbound_policy p, outbound_meta m",
                [],
                |r| Ok((r.get(0)?, r.get(1)?)),
            )
            .unwrap();
        assert_eq!(stored, (WRITABLE_FROM, this_release()));
        assert_eq!(standing(&conn).unwrap(), Standing::Current);
        conn.pragma_update(None, "user_version", SCHEMA_VERSION + 1)
            .unwrap();
        assert_eq!(
            standing(&conn).unwrap(),
            Standing::NewerAccepting(SCHEMA_VERSION + 1)
        );
        migrate(&mut conn).unwrap();
        assert_eq!(
            user_version(&conn).unwrap(),
            SCHEMA_VERSION + 1,
            "not migrated"
        );
        conn.execute(
            "UPDATE outbound_policy SET writable_from = ?1",
            [SCHEMA_VERSION + 1],
        )
        .unwrap();
        conn.execute_batch(
            "UPDATE outbound_meta SET migrated_by = 'chunked-outbox 9.9.9 (schema 99)'",
        )
        .unwrap();
        let err = standing(&conn).unwrap_err();
        assert!(
            matches!(&err, Error::SchemaTooNew { writable_from, upgrade_to, .. }
                if *writable_from == SCHEMA_VERSION + 1 && upgrade_to == "chunked-outbox 9.9.9 (schema 99)"),
            "{err:?}"
        );
        assert!(
            err.to_string().contains("upgrade to chunked-outbox 9.9.9"),
            "{err}"
        );
        // A file older than this build needs a migration, and says so.
        conn.pragma_update(None, "user_version", 3).unwrap();
        assert_eq!(standing(&conn).unwrap(), Standing::Older(3));
    }

    /// A header naming more pages than the file holds is a truncation for a file at
    /// rest, but not while a WAL holds commits (a checkpoint in another connection
    /// writes the new header before the pages that extend the file), nor during a
    /// commit in rollback-journal mode (found: six processes creating one file).
    #[test]
    fn size_check_applies_to_files_at_rest_only() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("x.db");
        let conn = Connection::open(&path).unwrap();
        conn.execute_batch("CREATE TABLE t (v); INSERT INTO t VALUES (zeroblob(20000));")
            .unwrap();
        drop(conn);
        check_file(&path).expect("a whole file at rest");
        let full = std::fs::read(&path).unwrap();
        std::fs::write(&path, &full[..full.len() - 4096]).unwrap();
        assert!(matches!(check_file(&path), Err(Error::Corrupt { .. })));
        // An empty journal beside it is no commit in progress.
        std::fs::write(dir.path().join("x.db-journal"), b"").unwrap();
        assert!(matches!(check_file(&path), Err(Error::Corrupt { .. })));

        std::fs::write(dir.path().join("x.db-wal"), b"frames").unwrap();
        check_file(&path).unwrap();
        // Nor while a rollback journal exists: a commit may be writing the pages.
        std::fs::remove_file(dir.path().join("x.db-wal")).unwrap();
        assert!(matches!(check_file(&path), Err(Error::Corrupt { .. })));
        std::fs::write(dir.path().join("x.db-journal"), b"pages").unwrap();
        check_file(&path).unwrap();
    }
}

/// Query-plan checks: the hot and monitoring queries must be index searches whose cost
/// does not grow with delivered history or backlog.
#[cfg(test)]
mod plan_tests {
    use crate::options::OutboxOptions;
    use crate::outbox::Outbox;
    use crate::reply::NewDelivery;

    fn explain(outbox: &Outbox, sql: &str, params: usize) -> String {
        let conn = outbox.sqlite("test").unwrap().writer();
        let mut stmt = conn.prepare(&format!("EXPLAIN QUERY PLAN {sql}")).unwrap();
        let values: Vec<rusqlite::types::Value> = (0..params).map(|_| 0_i64.into()).collect();
        let rows = stmt
            .query_map(rusqlite::params_from_iter(values), |r| {
                r.get::<_, String>(3)
            })
            .unwrap();
        rows.map(Result::unwrap).collect::<Vec<_>>().join("\n")
    }

    /// An outbox with delivered history, failures and a backlog, so the planner sees
    /// every kind of row (no ANALYZE, as in production).
    fn populated() -> Outbox {
        let ob = Outbox::open_in_memory(OutboxOptions::default()).unwrap();
        for i in 0..300 {
            let chat = format!("c{}", i % 7);
            let _ = ob
                .enqueue(&NewDelivery::chunked("telegram", chat, "a b", ["a", "b"]))
                .unwrap();
        }
        for _ in 0..3 {
            for c in ob.claim(100).unwrap() {
                ob.ack(&c, None).unwrap();
            }
        }
        ob
    }

    fn assert_no_full_scan(plan: &str, table_alias: &str) {
        for line in plan.lines() {
            let scans_table = line.starts_with(&format!("SCAN {table_alias}"))
                && !line.contains("USING INDEX")
                && !line.contains("USING COVERING INDEX");
            assert!(!scans_table, "full scan of {table_alias}:\n{plan}");
        }
        assert!(
            !plan.contains("TEMP B-TREE"),
            "sort in a temp b-tree:\n{plan}"
        );
    }

    /// The claim, the next-due search and recovery each read one channel's range of
    /// the claim index, in its order: another channel's backlog is never read.
    #[test]
    fn claim_is_an_ordered_range_search_on_one_channels_due_index() {
        let ob = populated();
        let plan = explain(&ob, crate::store::sqlite::claims::CLAIM_SQL, 2);
        assert!(
            plan.contains(
                "SEARCH c USING INDEX outbound_delivery_chunks_due (channel_id=? AND due_at>? AND due_at<?)"
            ) || plan.contains("SEARCH c USING INDEX outbound_delivery_chunks_due (channel_id=? AND due_at<?)"),
            "claim does not range-search its channel's part of the due index:\n{plan}"
        );
        // The claim reads rows until its limit: in index order, not after a sort of all.
        assert!(!plan.contains("TEMP B-TREE"), "claim sorts:\n{plan}");
        assert!(
            plan.contains("SEARCH d USING INTEGER PRIMARY KEY"),
            "{plan}"
        );
        assert_no_full_scan(&plan, "c");
        assert_no_full_scan(&plan, "d");

        let plan = explain(&ob, crate::store::sqlite::claims::NEXT_DUE_SQL, 1);
        assert!(
            plan.contains("outbound_delivery_chunks_due (channel_id=?"),
            "next due does not seek its channel:\n{plan}"
        );
        assert_no_full_scan(&plan, "outbound_delivery_chunks");

        let plan = explain(&ob, crate::store::sqlite::claims::EXPIRED_SQL, 2);
        assert!(
            plan.contains("outbound_delivery_chunks_due (channel_id=? AND due_at"),
            "recovery does not range-search its channel:\n{plan}"
        );
        assert_no_full_scan(&plan, "c");
    }

    #[test]
    fn health_reads_only_unfinished_deliveries() {
        let ob = populated();
        let plan = explain(&ob, crate::store::sqlite::reads::OPEN_DELIVERIES_SQL, 0);
        assert!(plan.contains("outbound_deliveries_open"), "{plan}");
        assert_no_full_scan(
            &plan.replace("USE TEMP B-TREE FOR GROUP BY", ""),
            "outbound_deliveries",
        );

        let plan = explain(&ob, crate::store::sqlite::reads::OPEN_CHUNKS_SQL, 1);
        assert!(
            plan.contains("SCAN d USING INDEX outbound_deliveries_open")
                || plan.contains("SCAN d USING COVERING INDEX outbound_deliveries_open"),
            "{plan}"
        );
        assert!(
            plan.contains("SEARCH c USING INTEGER PRIMARY KEY (rowid>? AND rowid<?)"),
            "{plan}"
        );
        assert!(!plan.contains("messages"), "{plan}");
    }

    /// Dead letters are read from their own indexes, newest first, a page at a time:
    /// by channel, and by lane; the snapshot reads their counts, and the work in flight
    /// from an index that holds none of them.
    #[test]
    fn dead_letters_are_read_from_their_own_indexes() {
        use crate::inspect::ListFilter;
        use crate::store::sqlite::reads::{LIST_DEAD, list_sql};
        let ob = populated();
        for chat in 0..50 {
            let id = ob
                .enqueue(&NewDelivery::single("viber", format!("gone{chat}"), "x"))
                .unwrap();
            let claim = ob.claim_channels(&["viber"], 1).unwrap().remove(0);
            ob.record_error_text(&claim, "Forbidden: bot was blocked by the user")
                .unwrap();
            assert_eq!(claim.delivery_id, id.id);
        }
        let failed = ListFilter::default().status(crate::status::DeliveryStatus::Failed);
        let (sql, values) = list_sql(LIST_DEAD, &failed, Some("t"));
        let plan = explain(&ob, &sql, values.len());
        assert_eq!(
            plan,
            "SEARCH outbound_deliveries USING INDEX outbound_deliveries_dead_newest (channel=?)"
        );
        let of_chat = failed.clone().chat_id("gone1");
        let (sql, values) = list_sql(LIST_DEAD, &of_chat, Some("t"));
        let plan = explain(&ob, &sql, values.len());
        assert!(
            plan.contains("USING INDEX outbound_deliveries_dead (channel=? AND chat_id=?)"),
            "{plan}"
        );
        assert_no_full_scan(&plan, "outbound_deliveries");
        let in_flight = crate::store::sqlite::reads::LIST_IN_FLIGHT;
        let (sql, values) = list_sql(in_flight, &ListFilter::default().unfinished(), None);
        let plan = explain(&ob, &sql, values.len());
        assert!(plan.contains("outbound_deliveries_open"), "{plan}");
        let plan = explain(&ob, crate::store::sqlite::reads::DEAD_LETTER_COUNTS_SQL, 0);
        assert_eq!(plan, "SCAN outbound_dead_letter_counts");
        // The index of work in flight holds none of them.
        let conn = ob.sqlite("test").unwrap().writer();
        let in_index: i64 = conn
            .query_row(
                "SELECT count(*) FROM outbound_deliveries INDEXED BY outbound_deliveries_open
                 WHERE status <> 'delivered' AND status <> 'failed'",
                [],
                |r| r.get(0),
            )
            .unwrap();
        let dead: i64 = conn
            .query_row(
                "SELECT count(*) FROM outbound_deliveries WHERE status = 'failed'",
                [],
                |r| r.get(0),
            )
            .unwrap();
        assert_eq!(dead, 50);
        assert_eq!(
            in_index,
            conn.query_row(
                "SELECT count(*) FROM outbound_deliveries NOT INDEXED
                 WHERE status NOT IN ('delivered', 'failed')",
                [],
                |r| r.get::<_, i64>(0),
            )
            .unwrap()
        );
    }

    /// A caller key is found through its (channel, key) index, never by a scan.
    #[test]
    fn a_caller_key_lookup_is_an_index_search() {
        let ob = populated();
        let plan = explain(&ob, crate::store::sqlite::deliveries::KEY_LOOKUP_SQL, 2);
        assert!(
            plan.contains("USING INDEX outbound_deliveries_idempotency"),
            "{plan}"
        );
    }

    /// The queries that find a delivery's chunks now that chunks have no index of their
    /// own: each must reach them through the chunk table's key, never by a scan.
    #[test]
    fn chunk_lookups_use_the_chunk_key_and_never_scan_history() {
        let ob = populated();
        for (sql, params) in [
            (crate::store::sqlite::operator::DEAD_LETTER_CHUNKS_SQL, 1),
            (crate::store::sqlite::lanes::PAUSE_DUE_SQL, 3),
            (crate::store::sqlite::finalize::SWEEP_SQL, 0),
            (
                crate::store::sqlite::chunks::chunk_ref_where!("c.id = ?1"),
                1,
            ),
            (crate::store::sqlite::chunks::LOAD_CHUNK_SQL, 1),
        ] {
            let plan = explain(&ob, sql, params);
            assert!(plan.contains("INTEGER PRIMARY KEY"), "{plan}");
            assert_no_full_scan(&plan, "c");
            assert_no_full_scan(&plan, "d");
            assert_no_full_scan(&plan, "outbound_delivery_chunks");
            assert_no_full_scan(&plan, "outbound_deliveries");
        }
    }

    /// The uncertain parts nobody asked about yet: the channel's uncertain deliveries
    /// from the index of uncertain ones, their chunks by the chunk key; only those rows
    /// are sorted (oldest first), never history nor the rest of the work in flight.
    #[test]
    fn unasked_parts_are_found_from_the_uncertain_index() {
        let ob = populated();
        let plan = explain(&ob, crate::store::sqlite::operator::UNASKED_SQL, 2);
        assert!(
            plan.contains("USING COVERING INDEX outbound_deliveries_uncertain (channel=?)"),
            "{plan}"
        );
        assert!(
            plan.contains("SEARCH c USING INTEGER PRIMARY KEY (rowid>? AND rowid<?)"),
            "{plan}"
        );
        let plan = plan.replace("USE TEMP B-TREE FOR ORDER BY", "");
        for table in ["c", "d", "outbound_deliveries"] {
            assert_no_full_scan(&plan, table);
        }
    }

    #[test]
    fn lane_lookups_are_seeks_on_the_open_index() {
        let ob = populated();
        let plan = explain(&ob, crate::store::sqlite::lanes::HEAD_SQL, 2);
        assert_eq!(
            plan,
            "SEARCH outbound_deliveries USING INDEX outbound_deliveries_open (chat_id=? AND channel=? AND status>? AND status<?)",
            "one range of the index, read in its order"
        );
        let plan = explain(&ob, crate::store::sqlite::lanes::HELD_SQL, 3);
        assert!(
            plan.contains(
                "USING INDEX outbound_deliveries_open (chat_id=? AND channel=? AND status=?)"
            ) && plan.contains("USING INDEX outbound_deliveries_dead (channel=? AND chat_id=?)")
                && plan.contains("SEARCH c USING INTEGER PRIMARY KEY (rowid=?)"),
            "{plan}"
        );
        assert_no_full_scan(&plan, "outbound_deliveries");
        // An enqueue's entry: the head from the covering index, a queued head's row by
        // its id, the lane's pause by its key; the head is not materialized first.
        let plan = explain(&ob, crate::store::sqlite::lanes::ENTER_SQL, 3);
        assert!(
            plan.contains(
                "SEARCH outbound_deliveries USING COVERING INDEX outbound_deliveries_open \
                 (chat_id=? AND channel=? AND status>? AND status<?)"
            ) && plan.contains("SEARCH outbound_deliveries USING INTEGER PRIMARY KEY (rowid=?)")
                && plan
                    .contains("SEARCH outbound_lanes USING PRIMARY KEY (channel=? AND chat_id=?)")
                && !plan.contains("MATERIALIZE"),
            "{plan}"
        );
        assert_no_full_scan(&plan, "outbound_deliveries");
        assert_no_full_scan(&plan, "d");
    }

    /// The statements of every claim, ack and enqueue run without a temporary b-tree:
    /// `x IN (list)` in a CHECK or a lookup builds one per execution (and a page cache
    /// under a global mutex), which was a tenth of a batched claim and ack.
    #[test]
    fn hot_statements_open_no_temporary_b_tree() {
        let ob = populated();
        let conn = ob.sqlite("test").unwrap().writer();
        for sql in [
            crate::store::sqlite::lanes::HEAD_SQL,
            crate::store::sqlite::lanes::ENTER_SQL,
            crate::store::sqlite::lanes::HELD_SQL,
            crate::store::sqlite::chunks::CLAIMED_SQL,
            crate::store::sqlite::finalize::HISTORY_SQL,
            "UPDATE outbound_delivery_chunks SET status = 'sending', attempts = attempts + 1
             WHERE id = ?1",
            "UPDATE outbound_delivery_chunks SET status = 'delivered' WHERE id = ?1",
            "UPDATE outbound_deliveries SET status = 'delivered' WHERE id = ?1",
            "INSERT INTO outbound_deliveries (id, uid, channel, chat_id, status, chunk_count,
                 created_at, updated_at, text) VALUES (?1, 'u', 'c', 'x', 'pending', 1, 0, 0, 't')",
            "INSERT INTO outbound_delivery_chunks (id, delivery_id, chunk_index, status)
             VALUES (?1 * 16384, ?1, 0, 'pending')",
        ] {
            let params = (1..=9)
                .take_while(|n| sql.contains(&format!("?{n}")))
                .count();
            let mut stmt = conn.prepare(&format!("EXPLAIN {sql}")).unwrap();
            let values: Vec<rusqlite::types::Value> = (0..params).map(|_| 0_i64.into()).collect();
            let opcodes: Vec<String> = stmt
                .query_map(rusqlite::params_from_iter(values), |r| r.get(1))
                .unwrap()
                .map(Result::unwrap)
                .collect();
            assert!(
                !opcodes.iter().any(|op| op == "OpenEphemeral"),
                "a temporary b-tree in {sql}"
            );
        }
    }
}
