//! Storage: pragmas read back on writer and readers, owner-only files, refusal of a
//! newer schema and of non-database files without touching them, a missing file that
//! is not created when creation is off, a busy database, and retention that keeps
//! `outbound_messages` and the maintained counters right.

mod common;

use std::time::Duration;

use chrono::{TimeZone, Utc};
use chunked_outbox::store::sqlite::{SCHEMA_VERSION, StorageSettings, Synchronous};
use chunked_outbox::{Error, NewDelivery, Outbox, OutboxOptions, Result};
use common::*;

#[test]
fn pragmas_are_read_back_on_writer_and_readers() -> Result<()> {
    for sync in [Synchronous::Normal, Synchronous::Full] {
        let db = TestDb::new(
            OutboxOptions::default()
                .with_synchronous(sync)
                .with_busy_timeout(Duration::from_millis(1234)),
        );
        let w = db.outbox.writer_settings()?;
        let r = db.outbox.reader_settings()?;
        let want_sync = if sync == Synchronous::Full { 2 } else { 1 };
        for s in [&w, &r] {
            assert_eq!(s.journal_mode, "wal");
            assert_eq!(s.synchronous, want_sync);
            assert_eq!(s.busy_timeout_ms, 1234);
        }
        assert!(!w.query_only);
        assert!(r.query_only, "pooled readers can never write");
        assert_eq!(
            w.wal_autocheckpoint,
            StorageSettings::BACKGROUND_AUTOCHECKPOINT_PAGES,
            "with background checkpoints, the automatic one only bounds the WAL"
        );
    }
    // Without the background thread, SQLite's own checkpoint does the work as usual.
    let db = TestDb::new(OutboxOptions::default().with_background_checkpoints(None));
    assert_eq!(db.outbox.writer_settings()?.wal_autocheckpoint, 1000);
    let mem = Outbox::open_in_memory(OutboxOptions::default())?;
    assert_eq!(mem.writer_settings()?.journal_mode, "memory");
    Ok(())
}

#[cfg(unix)]
#[test]
fn database_and_wal_files_are_owner_only() -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    let db = TestDb::default();
    let _ = enqueue(&db.outbox, "1", &["private"]);
    let _ = db.outbox.health()?; // opens a reader, so the -shm file exists
    for suffix in ["", "-wal", "-shm"] {
        let path = format!("{}{suffix}", db.path().display());
        let mode = std::fs::metadata(&path).expect(&path).permissions().mode() & 0o777;
        assert_eq!(mode, 0o600, "{path} has mode {mode:o}");
    }
    Ok(())
}

#[test]
fn newer_schema_is_refused_and_the_file_left_untouched() -> Result<()> {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("future.db");
    {
        let conn = raw(&path);
        conn.execute_batch(&format!(
            "PRAGMA journal_mode=DELETE; CREATE TABLE future (x); PRAGMA user_version = {};",
            SCHEMA_VERSION + 1
        ))?;
    }
    let before = std::fs::read(&path).unwrap();
    let err = Outbox::open(&path, OutboxOptions::default()).unwrap_err();
    assert!(
        matches!(err, Error::SchemaTooNew { found, supported, .. } if found == SCHEMA_VERSION + 1 && supported == SCHEMA_VERSION),
        "{err:?}"
    );
    assert!(err.to_string().contains("upgrade"));
    assert!(
        std::fs::read(&path).unwrap() == before,
        "the file is byte for byte unchanged"
    );
    assert_eq!(
        std::fs::read_dir(dir.path()).unwrap().count(),
        1,
        "no -wal or -shm appeared"
    );
    Ok(())
}

/// A rolling upgrade on one file: a newer build's expand step leaves this build
/// writing it as before; once a contract step takes that away, each write of a handle
/// still open fails with `SchemaTooNew` naming the release to upgrade to and changes
/// nothing, reads still work, and a new open is refused with the file left as it was.
#[test]
fn an_older_build_writes_a_newer_file_until_a_contract_step() -> Result<()> {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("rolling.db");
    let older = Outbox::open(&path, OutboxOptions::default())?;
    older.enqueue(&NewDelivery::single("t", "c", "before"))?;
    // A newer build's expand step, as it records itself.
    raw(&path).pragma_update(None, "user_version", SCHEMA_VERSION + 1)?;
    older.enqueue(&NewDelivery::single("t", "c2", "during"))?;
    let claim = older.claim(1)?.remove(0);
    older.ack(&claim, None)?;
    drop(Outbox::open(&path, OutboxOptions::default())?);
    drop(Outbox::open_read_only(&path, OutboxOptions::default())?);
    // Its contract step.
    raw(&path).execute_batch(&format!(
        "UPDATE outbound_policy SET writable_from = {};
         UPDATE outbound_meta SET migrated_by = 'chunked-outbox 9.9.9 (schema 99)'",
        SCHEMA_VERSION + 1
    ))?;
    let err = older
        .enqueue(&NewDelivery::single("t", "c", "after"))
        .unwrap_err();
    assert!(
        matches!(&err, Error::SchemaTooNew { writable_from, upgrade_to, .. }
            if *writable_from == SCHEMA_VERSION + 1 && upgrade_to == "chunked-outbox 9.9.9 (schema 99)"),
        "{err:?}"
    );
    assert!(matches!(older.claim(1), Err(Error::SchemaTooNew { .. })));
    let all = older.list(&chunked_outbox::monitoring::ListFilter::default())?;
    assert_eq!(
        all.len(),
        2,
        "the refused write changed nothing; reads work"
    );
    drop(older);
    let before = std::fs::read(&path).unwrap();
    let refused = Outbox::open(&path, OutboxOptions::default()).map(drop);
    assert!(
        matches!(refused, Err(Error::SchemaTooNew { .. })),
        "{refused:?}"
    );
    assert!(std::fs::read(&path).unwrap() == before, "left as it was");
    Ok(())
}

#[test]
fn a_file_that_is_not_a_database_is_refused_and_untouched() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("notes.txt");
    let content = b"these are my notes, not an SQLite database\n".repeat(200);
    std::fs::write(&path, &content).unwrap();
    let err = Outbox::open(&path, OutboxOptions::default()).unwrap_err();
    match &err {
        Error::NotADatabase { path: p } => assert_eq!(p, &path),
        other => panic!("expected NotADatabase, got {other:?}"),
    }
    assert!(err.to_string().contains("notes.txt"));
    assert!(
        std::fs::read(&path).unwrap() == content,
        "the file was modified"
    );
}

#[test]
fn missing_file_is_not_created_when_creation_is_off() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("absent.db");
    let err = Outbox::open(
        &path,
        OutboxOptions::default().with_create_if_missing(false),
    )
    .unwrap_err();
    assert!(
        matches!(&err, Error::DatabaseMissing { path: p } if p == &path),
        "{err:?}"
    );
    assert_eq!(
        std::fs::read_dir(dir.path()).unwrap().count(),
        0,
        "no file appeared"
    );
}

#[test]
fn busy_database_is_a_typed_error_and_recovers() -> Result<()> {
    let db = TestDb::new(OutboxOptions::default().with_busy_timeout(Duration::from_millis(50)));
    let mut blocker = db.raw();
    let tx = blocker.transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)?;
    let err = db
        .outbox
        .enqueue(&NewDelivery::single("telegram", "1", "x"))
        .unwrap_err();
    assert!(matches!(err, Error::Busy), "{err:?}");
    assert!(matches!(db.outbox.claim(1), Err(Error::Busy)));
    // Readers are not blocked by a writer in WAL mode.
    assert_eq!(db.outbox.health()?.totals.total_deliveries, 0);
    tx.rollback()?;
    let _ = db
        .outbox
        .enqueue(&NewDelivery::single("telegram", "1", "x"))?;
    assert_eq!(claim_all(&db.outbox).len(), 1);
    Ok(())
}

#[test]
fn several_handles_on_one_file_share_the_schema() -> Result<()> {
    let db = TestDb::default();
    let second = db.reopen(OutboxOptions::default());
    let id = enqueue(&second, "1", &["hi"]);
    let claim = claim_one(&db.outbox);
    assert_eq!(claim.delivery_id, id);
    second.ack(&claim, None)?;
    assert_eq!(db.outbox.health()?.totals.delivered_deliveries, 1);
    db.outbox.checkpoint()?;
    Ok(())
}

/// Under sustained writes the WAL never gets a quiet moment to restart from, so it is
/// bounded by the writer's raised automatic checkpoint, not by the write volume — even
/// if the background checkpointer never runs (here its interval is an hour). With it
/// running, a checkpointer preempted while it holds SQLite's checkpoint lock makes the
/// writer skip its own checkpoint for as long as that lasts, so on a busy machine the
/// WAL can overshoot the threshold by the writes of that stall (69 MB seen on a
/// machine under load, against 41 MB): a scheduling figure, not a bound.
#[test]
fn the_wal_stays_bounded_under_sustained_writes() -> Result<()> {
    let db = TestDb::new(
        OutboxOptions::default().with_background_checkpoints(Some(Duration::from_secs(3600))),
    );
    // About 4 pages per enqueue: 15,000 back-to-back enqueues would leave ~240 MB of
    // WAL if nothing checkpointed.
    for n in 0..15_000 {
        let _ = db
            .outbox
            .enqueue(&NewDelivery::single("telegram", format!("c{n}"), "x"))?;
    }
    let wal = std::fs::metadata(format!("{}-wal", db.path().display()))
        .unwrap()
        .len();
    // The threshold plus slack: a commit that crosses it while the background thread
    // holds the checkpoint lock skips its checkpoint, and a later commit does it.
    let frame = 4096 + 24;
    let bound = StorageSettings::BACKGROUND_AUTOCHECKPOINT_PAGES as u64 * 5 / 4 * frame;
    assert!(wal <= bound, "the WAL grew to {wal} bytes (bound {bound})");
    // A checkpoint in a quiet moment gives the space back.
    db.outbox.checkpoint()?;
    let wal = std::fs::metadata(format!("{}-wal", db.path().display()))
        .unwrap()
        .len();
    assert_eq!(wal, 0);
    Ok(())
}

stores! {

    fn purge_removes_old_finished_deliveries_and_keeps_messages() -> Result<()> {
        let db = TestDb::default();
        let ob = &db.outbox;
        let old = ob
            .enqueue(
                &NewDelivery::chunked("telegram", "1", "a b", ["a", "b"]).with_idempotency_key("k"),
            )?
            .id;
        while let Some(c) = claim_all(ob).pop() {
            ob.ack(&c, None)?;
        }
        let dead = enqueue(ob, "2", &["x"]);
        let c = claim_one(ob);
        ob.record(
            &c,
            chunked_outbox::Outcome::Permanent {
                error: "chat not found".into(),
            },
        )?;
        db.advance(Duration::from_secs(3600));
        let recent = enqueue(ob, "3", &["new"]);
        let c = claim_one(ob);
        ob.ack(&c, None)?;
        let unfinished = enqueue(ob, "4", &["pending"]);

        let cutoff = Utc.timestamp_millis_opt(db.now_ms() - 1_000).unwrap();
        // The unacknowledged dead letter is kept.
        let report = ob.purge(cutoff)?;
        assert_eq!((report.deliveries, report.chunks), (1, 2));
        assert!(ob.delivery(old)?.is_none());
        assert!(ob.delivery(dead)?.is_some());
        assert!(ob.delivery(recent)?.is_some());
        assert!(ob.delivery(unfinished)?.is_some());
        assert_eq!(db.messages_for(old)?, ["a b"]);

        // Once acknowledged, the dead letter goes too.
        assert_eq!(ob.dismiss_dead_letters(None)?, 1);
        assert_eq!(ob.purge(cutoff)?.deliveries, 1);
        assert!(ob.delivery(dead)?.is_none());

        let h = ob.health()?;
        assert_eq!(
            (h.totals.total_deliveries, h.totals.delivered_deliveries),
            (2, 1)
        );
        assert_eq!(h.totals.failed_chunks, 0);

        // The retention window is the idempotency window: the key is free again.
        let reused =
            ob.enqueue(&NewDelivery::single("telegram", "1", "other").with_idempotency_key("k"))?;
        assert!(reused.created);
        assert_ne!(reused.id, old);
        Ok(())
    }

    /// Delivery ids are derived from row ids, so purge must never free a row id for reuse:
    /// it keeps the newest delivery, and ids and chunk keys stay distinct across purges.
    fn purge_keeps_the_newest_delivery_so_ids_are_never_reused() -> Result<()> {
        let db = TestDb::default();
        let ob = &db.outbox;
        let mut seen = std::collections::HashSet::new();
        for round in 0..3 {
            for chat in 0..3 {
                let id = enqueue(ob, &format!("{round}-{chat}"), &["x"]);
                assert!(seen.insert(id), "{id} handed out twice");
            }
            for c in claim_all(ob) {
                ob.ack(&c, None)?;
            }
            db.advance(Duration::from_secs(10));
            let cutoff = Utc.timestamp_millis_opt(db.now_ms()).unwrap();
            let report = ob.purge(cutoff)?;
            assert_eq!(report.deliveries, if round == 0 { 2 } else { 3 });
            assert_eq!(ob.health()?.totals.total_deliveries, 1);
        }
        let stored = db.int("SELECT count(DISTINCT delivery_id) FROM outbound_messages");
        assert_eq!(stored, 9);
        Ok(())
    }
}

/// Opening a file whose stored rules the options leave alone takes no write lock: a
/// handle opens while another connection holds the writer's lock, and one that
/// declares a rule waits for it (here: past its busy timeout).
#[test]
fn opening_without_rules_to_declare_takes_no_write_lock() {
    let db = TestDb::default();
    let blocker = db.raw();
    blocker.execute_batch("BEGIN IMMEDIATE").unwrap();
    let quick = || OutboxOptions::default().with_busy_timeout(Duration::from_millis(50));
    let opened = Outbox::open(db.path(), quick());
    assert!(opened.is_ok(), "{opened:?}");
    let declaring = Outbox::open(
        db.path(),
        quick().with_lane_order(chunked_outbox::rules::LaneOrder::Parallel),
    );
    assert!(
        matches!(declaring, Err(chunked_outbox::Error::Busy)),
        "{declaring:?}"
    );
    blocker.execute_batch("ROLLBACK").unwrap();
}
