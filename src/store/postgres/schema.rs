//! The PostgreSQL schema: embedded migrations, applied by refinery in one transaction
//! under a lock, so servers starting at once apply each migration once, and a failed
//! one leaves nothing behind (PostgreSQL's DDL is transactional).

use crate::error::{Error, Result};

use super::pool::PgConn;

mod embedded {
    refinery::embed_migrations!("migrations/postgres");
}

/// The schema version this build writes.
pub(crate) fn latest_version() -> i64 {
    static LATEST: std::sync::OnceLock<i64> = std::sync::OnceLock::new();
    *LATEST.get_or_init(|| {
        embedded::migrations::runner()
            .get_migrations()
            .iter()
            .map(|m| i64::from(m.version()))
            .max()
            .unwrap_or(0)
    })
}

/// The first schema version that says which builds may write it (`writable_from`):
/// an older schema accepts only its own build.
const WRITABLE_FROM_SINCE: i64 = 9;

/// The oldest build (schema version) this build's schema accepts as a writer: what its
/// migrations leave in `outbound_policy.writable_from`. Only a contract step raises it.
pub(crate) const WRITABLE_FROM: i64 = 9;

/// What `outbound_meta.migrated_by` says of this build: the release to upgrade to.
fn this_release() -> String {
    crate::store::release(latest_version())
}

/// The refusal of a schema at version `found` that accepts writers from
/// `writable_from` on, migrated by `migrated_by` (empty if unknown).
pub(crate) fn too_new(found: i64, writable_from: i64, migrated_by: &str) -> Error {
    Error::SchemaTooNew {
        found,
        supported: latest_version(),
        writable_from,
        upgrade_to: if migrated_by.is_empty() {
            format!("a chunked-outbox release of schema {writable_from} or later")
        } else {
            migrated_by.to_owned()
        },
    }
}

/// A schema at version `found`, newer than this build's, that may still accept it as
/// a writer: `Ok` if it does, [`Error::SchemaTooNew`] if a contract step took that away.
fn accepts(conn: &mut PgConn, found: i64) -> Result<()> {
    let (writable_from, migrated_by) = if found >= WRITABLE_FROM_SINCE {
        let row = conn.client.query_one(
            "SELECT p.writable_from, m.migrated_by FROM outbound_policy p, outbound_meta m
             WHERE p.id = 1 AND m.id = 1",
            &[],
        )?;
        (row.try_get::<_, i64>(0)?, row.try_get::<_, String>(1)?)
    } else {
        (found, String::new())
    };
    if writable_from <= latest_version() {
        Ok(())
    } else {
        Err(too_new(found, writable_from, &migrated_by))
    }
}

/// refinery's record of applied migrations, in the outbox's schema.
const HISTORY: &str = "outbound_schema_history";

/// The version of the outbox in the connection's schema: 0 if it has none, an error if
/// the schema holds tables of ours but no record of them.
fn applied_version(conn: &mut PgConn) -> Result<i64> {
    let has_history: bool = conn
        .client
        .query_one(
            "SELECT to_regclass(quote_ident(current_schema()) || '.' || $1) IS NOT NULL",
            &[&HISTORY],
        )?
        .try_get(0)?;
    if !has_history {
        let ours: bool = conn
            .client
            .query_one(
                "SELECT to_regclass(quote_ident(current_schema()) || '.outbound_deliveries') IS NOT NULL",
                &[],
            )?
            .try_get(0)?;
        if ours {
            return Err(Error::NotAnOutbox {
                path: format!(
                    "schema {} (outbox tables without {HISTORY})",
                    current_schema(conn)?
                )
                .into(),
            });
        }
        return Ok(0);
    }
    let version: Option<i32> = conn
        .client
        .query_one("SELECT max(version) FROM outbound_schema_history", &[])?
        .try_get(0)?;
    Ok(i64::from(version.unwrap_or(0)))
}

fn current_schema(conn: &mut PgConn) -> Result<String> {
    let schema: Option<String> = conn
        .client
        .query_one("SELECT current_schema()", &[])?
        .try_get(0)?;
    schema.ok_or_else(|| {
        Error::invalid(
            "database url",
            "no schema on the search_path exists; create it or fix search_path",
        )
    })
}

/// Brings the outbox's tables in the connection's schema to this build's version:
/// refused if a newer build wrote them ([`Error::SchemaTooNew`]) or, with `upgrade`
/// off, if they need an upgrade. Runs under a lock of the schema, so a second process
/// waits and then finds the work done.
pub(crate) fn migrate(conn: &mut PgConn, config: &postgres::Config, upgrade: bool) -> Result<()> {
    let schema = current_schema(conn)?;
    let lock = "SELECT pg_advisory_lock(hashtextextended(current_schema() || '/migrate', 0))";
    conn.client.query_one(lock, &[])?;
    let result = migrate_locked(conn, config, upgrade, &schema);
    let unlock = "SELECT pg_advisory_unlock(hashtextextended(current_schema() || '/migrate', 0))";
    let unlocked = conn.client.query_one(unlock, &[]);
    result?;
    unlocked?;
    Ok(())
}

fn migrate_locked(
    conn: &mut PgConn,
    config: &postgres::Config,
    upgrade: bool,
    schema: &str,
) -> Result<()> {
    let found = applied_version(conn)?;
    let latest = latest_version();
    if found >= latest {
        // A newer schema is written as it is, if it still accepts this build.
        return if found > latest {
            accepts(conn, found)
        } else {
            Ok(())
        };
    }
    if !upgrade {
        return Err(if found == 0 {
            Error::NotAnOutbox {
                path: format!("schema {schema}").into(),
            }
        } else {
            Error::SchemaTooOld {
                path: format!("schema {schema}").into(),
                found,
                current: latest,
            }
        });
    }
    // refinery runs on the blocking client: a connection of its own, for this once
    // (the lock above is held by the store's).
    let mut client = config.connect(postgres::NoTls)?;
    let mut runner = embedded::migrations::runner();
    runner.set_migration_table_name(HISTORY);
    runner
        .set_grouped(true)
        .set_abort_divergent(true)
        .set_abort_missing(true)
        .run(&mut client)
        .map_err(|e| Error::Migration {
            version: latest,
            statement: String::new(),
            message: e.to_string(),
        })?;
    conn.client.execute(
        "UPDATE outbound_meta SET migrated_by = $1",
        &[&this_release()],
    )?;
    if crate::sabotage::planted("expand_refuses_old_writers") {
        conn.client
            .execute("UPDATE outbound_policy SET writable_from = $1", &[&latest])?;
    }
    Ok(())
}

/// Refuses a schema whose outbox is not at this build's version, or a newer one that
/// still accepts it (a read-only handle changes nothing).
pub(crate) fn require_current(conn: &mut PgConn) -> Result<()> {
    let schema = current_schema(conn)?;
    let found = applied_version(conn)?;
    let latest = latest_version();
    match found {
        0 => Err(Error::NotAnOutbox {
            path: format!("schema {schema}").into(),
        }),
        f if f > latest => accepts(conn, f),
        f if f < latest => Err(Error::SchemaTooOld {
            path: format!("schema {schema}").into(),
            found: f,
            current: latest,
        }),
        _ => Ok(()),
    }
}

/// This database's salt for delivery uids.
pub(crate) fn id_salt(conn: &mut PgConn) -> Result<i64> {
    Ok(conn
        .client
        .query_one("SELECT id_salt FROM outbound_meta WHERE id = 1", &[])?
        .try_get(0)?)
}

#[cfg(test)]
mod tests {
    use crate::error::Error;
    use crate::options::OutboxOptions;
    use crate::outbox::Outbox;
    use crate::store::test_server as server;

    fn client(url: &str) -> postgres::Client {
        postgres::Client::connect(url, postgres::NoTls).unwrap()
    }

    fn tables(url: &str) -> Vec<String> {
        client(url)
            .query(
                "SELECT tablename::text FROM pg_tables WHERE schemaname = current_schema()
                 ORDER BY 1",
                &[],
            )
            .unwrap()
            .iter()
            .map(|r| r.get(0))
            .collect()
    }

    #[test]
    fn a_newer_schema_is_refused_and_left_as_it_was() {
        let Some(url) = server::fresh_schema_url() else {
            return;
        };
        drop(Outbox::connect(&url, OutboxOptions::default()).unwrap());
        client(&url)
            .batch_execute(
                "INSERT INTO outbound_schema_history (version, name, applied_on, checksum)
                 VALUES (99, 'from_the_future', '2030-01-01', '0')",
            )
            .unwrap();
        let stored: i64 = client(&url)
            .query_one("SELECT writable_from FROM outbound_policy", &[])
            .unwrap()
            .get(0);
        assert_eq!(stored, super::WRITABLE_FROM);
        // An expand step: still written as it is.
        drop(Outbox::connect(&url, OutboxOptions::default()).unwrap());
        drop(Outbox::connect_read_only(&url, OutboxOptions::default()).unwrap());
        // A contract step: refused.
        client(&url)
            .batch_execute("UPDATE outbound_policy SET writable_from = 99")
            .unwrap();
        let before = tables(&url);
        for opened in [
            Outbox::connect(&url, OutboxOptions::default()),
            Outbox::connect_read_only(&url, OutboxOptions::default()),
        ] {
            assert!(
                matches!(
                    &opened,
                    Err(Error::SchemaTooNew {
                        found: 99,
                        supported,
                        writable_from: 99,
                        upgrade_to,
                    }) if *supported == super::latest_version() && upgrade_to == &super::this_release()
                ),
                "{opened:?}"
            );
        }
        assert_eq!(tables(&url), before);
    }

    /// Version 7 counts the dead letters already there, and the counts follow the rows
    /// after it.
    #[test]
    fn version_seven_counts_the_dead_letters_already_there() {
        let Some(url) = server::fresh_schema_url() else {
            return;
        };
        let mut old = client(&url);
        let mut runner = super::embedded::migrations::runner();
        runner.set_migration_table_name(super::HISTORY);
        runner
            .set_grouped(true)
            .set_target(refinery::Target::Version(6))
            .run(&mut old)
            .unwrap();
        old.batch_execute(
            "INSERT INTO outbound_channels (id, name) VALUES (1, 'slack'), (2, 'telegram');
             INSERT INTO outbound_deliveries (id, uid, channel, chat_id, status, chunk_count,
                 delivered_count, created_at, updated_at, text, acknowledged_at, corrupt)
             VALUES (1, 'u1', 'slack', 'a', 'failed', 2, 0, 1, 1, 'x y', NULL, NULL),
                    (2, 'u2', 'slack', 'b', 'failed', 1, 0, 1, 1, 'x', 5, NULL),
                    (3, 'u3', 'telegram', 'a', 'failed', 1, 0, 1, 1, 'x', NULL, 'bad text'),
                    (4, 'u4', 'telegram', 'a', 'pending', 1, 0, 1, 1, 'x', NULL, NULL);
             INSERT INTO outbound_delivery_chunks (delivery_id, chunk_index, status, channel_id)
             VALUES (1, 0, 'failed', 1), (1, 1, 'pending', 1), (2, 0, 'failed', 1),
                    (3, 0, 'failed', 2), (4, 0, 'pending', 2);",
        )
        .unwrap();
        let outbox = Outbox::connect(&url, OutboxOptions::default()).unwrap();
        let counts = |outbox: &Outbox| {
            let health = outbox.health().unwrap();
            ["slack", "telegram"].map(|channel| {
                let h = health.channels.get(channel).cloned().unwrap_or_default();
                (
                    h.failed_deliveries,
                    h.unacknowledged_dead_letters,
                    h.corrupt_deliveries,
                    h.failed_chunks,
                )
            })
        };
        assert_eq!(counts(&outbox), [(2, 1, 0, 2), (1, 1, 1, 1)]);
        old.batch_execute(
            "UPDATE outbound_deliveries SET status = 'pending' WHERE id = 1;
             UPDATE outbound_delivery_chunks SET status = 'retry'
             WHERE delivery_id = 1 AND chunk_index = 0;
             UPDATE outbound_deliveries SET acknowledged_at = 9 WHERE id = 3;
             DELETE FROM outbound_deliveries WHERE id = 2;
             DELETE FROM outbound_delivery_chunks WHERE delivery_id = 2;",
        )
        .unwrap();
        assert_eq!(counts(&outbox), [(0, 0, 0, 0), (1, 0, 1, 1)]);
    }

    /// A migration that fails half-way (here: a table of the application's in the
    /// schema under one of the outbox's names) leaves none of the outbox's tables.
    #[test]
    fn a_failed_migration_leaves_nothing_behind() {
        let Some(url) = server::fresh_schema_url() else {
            return;
        };
        client(&url)
            .batch_execute("CREATE TABLE outbound_lanes (app_column integer)")
            .unwrap();
        let failed = Outbox::connect(&url, OutboxOptions::default());
        assert!(matches!(failed, Err(Error::Migration { .. })), "{failed:?}");
        let left: Vec<String> = tables(&url)
            .into_iter()
            .filter(|t| t != "outbound_schema_history")
            .collect();
        assert_eq!(left, ["outbound_lanes"], "only the application's table");
        // The application renames its table: the next start migrates.
        client(&url)
            .batch_execute("ALTER TABLE outbound_lanes RENAME TO app_lanes")
            .unwrap();
        Outbox::connect(&url, OutboxOptions::default()).unwrap();
        assert!(tables(&url).contains(&"outbound_deliveries".to_owned()));
    }

    /// Servers starting at once on an empty schema: each migration runs once, every one
    /// of them opens the outbox.
    #[test]
    fn servers_starting_at_once_migrate_once() {
        let Some(url) = server::fresh_schema_url() else {
            return;
        };
        let opened: Vec<_> = (0..6)
            .map(|_| {
                let url = url.clone();
                std::thread::spawn(move || Outbox::connect(&url, OutboxOptions::default()))
            })
            .collect::<Vec<_>>()
            .into_iter()
            .map(|t| t.join().unwrap())
            .collect();
        assert!(opened.iter().all(Result::is_ok), "{opened:?}");
        let applied: i64 = client(&url)
            .query_one("SELECT count(*) FROM outbound_schema_history", &[])
            .unwrap()
            .get(0);
        assert_eq!(applied, super::latest_version());
    }

    /// A URL that does not parse is invalid input; a server that cannot be reached is a
    /// connection error naming it, without the password.
    #[test]
    fn a_bad_url_and_an_unreachable_server_are_typed_errors() {
        let bad = Outbox::connect("postgres://[::1", OutboxOptions::default());
        assert!(matches!(bad, Err(Error::InvalidInput { .. })), "{bad:?}");
        let options =
            OutboxOptions::default().with_busy_timeout(std::time::Duration::from_millis(200));
        let gone = Outbox::connect(
            "postgresql://bot:secret@/chat?host=/nonexistent-socket-dir",
            options,
        );
        match gone {
            Err(Error::Connection { target, .. }) => {
                assert!(target.contains("nonexistent-socket-dir"), "{target}");
                assert!(!target.contains("secret"), "{target}");
            }
            other => panic!("{other:?}"),
        }
    }

    /// One reader is a pool of two connections: the writer's and the reader's.
    #[test]
    fn one_reader_is_enough() {
        let Some(url) = server::fresh_schema_url() else {
            return;
        };
        for outbox in [
            Outbox::connect(&url, OutboxOptions::default().with_readers(1)).unwrap(),
            Outbox::connect_read_only(&url, OutboxOptions::default().with_readers(1)).unwrap(),
        ] {
            assert_eq!(outbox.health().unwrap().totals.total_deliveries, 0);
        }
    }

    /// With upgrades off, an empty schema is not an outbox, and nothing is made.
    #[test]
    fn without_upgrades_an_empty_schema_is_refused_untouched() {
        let Some(url) = server::fresh_schema_url() else {
            return;
        };
        let refused = Outbox::connect(&url, OutboxOptions::default().with_schema_upgrade(false));
        assert!(
            matches!(refused, Err(Error::NotAnOutbox { .. })),
            "{refused:?}"
        );
        assert!(tables(&url).is_empty());
    }
}
