//! Faults: a full disk during enqueue and during ack, a read-only file and directory, a
//! truncated database, and a `-wal` file removed after a crash. Each gives a typed
//! error naming what happened (or, for the lost WAL, a valid database without the
//! unwritten tail), leaves nothing half-written, and the outbox works again once the
//! cause is gone. (A busy database, a newer schema and a non-database file are in
//! `storage.rs`.)

mod common;

use std::path::{Path, PathBuf};

use chunked_outbox::{Error, NewDelivery, Outbox, OutboxOptions, Result};
use common::*;

fn integrity(path: &Path) -> String {
    raw(path)
        .query_row("PRAGMA integrity_check", [], |r| r.get(0))
        .unwrap()
}

fn counts(path: &Path) -> (i64, i64, i64) {
    raw(path)
        .query_row(
            "SELECT (SELECT count(*) FROM outbound_deliveries),
                    (SELECT count(*) FROM outbound_delivery_chunks),
                    (SELECT count(*) FROM outbound_messages)",
            [],
            |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)),
        )
        .unwrap()
}

fn big(chat: usize) -> NewDelivery {
    let text = format!("{chat} {}", "lorem ipsum ".repeat(300));
    NewDelivery::single("telegram", chat.to_string(), text)
}

fn small(chat: usize) -> NewDelivery {
    NewDelivery::single("telegram", chat.to_string(), "ok")
}

/// Enqueues until the size cap refuses; returns how many went in.
fn fill(outbox: &Outbox, path: &Path, make: fn(usize) -> NewDelivery) -> usize {
    for n in 0..100_000 {
        let before = counts(path);
        match outbox.enqueue(&make(n)) {
            Ok(_) => {}
            Err(Error::DiskFull) => {
                assert_eq!(counts(path), before, "a refused enqueue wrote nothing");
                return n;
            }
            Err(e) => panic!("expected DiskFull, got {e:?}"),
        }
    }
    panic!("the cap never refused");
}

#[test]
fn disk_full_during_enqueue() -> Result<()> {
    let db = TestDb::new(OutboxOptions::default().with_max_size(Some(128 * 1024)));
    let path = db.path();
    let accepted = fill(&db.outbox, &path, big);
    assert!(accepted > 0);
    assert!(Error::DiskFull.to_string().contains("full"));
    assert_eq!(integrity(&path), "ok");
    // The cause goes away: the same file opened without the cap takes more.
    let roomy = db.reopen(OutboxOptions::default());
    let _ = roomy.enqueue(&big(accepted))?;
    assert_eq!(counts(&path).0, accepted as i64 + 1);
    Ok(())
}

#[test]
fn disk_full_during_ack_keeps_the_claim_valid() -> Result<()> {
    let db = TestDb::new(OutboxOptions::default().with_max_size(Some(128 * 1024)));
    let path = db.path();
    // Leave a chunk claimed, then fill the file so the ack's `outbound_messages` row cannot fit
    // (one finalized delivery first, so `outbound_messages` has no empty root page to spare).
    let _ = db.outbox.enqueue(&big(999_998))?;
    let _ = db.outbox.enqueue(&big(999_999))?;
    let mut claims = claim_all(&db.outbox);
    assert_eq!(claims.len(), 2);
    db.outbox.ack(&claims.pop().unwrap(), None)?;
    let claim = claims.pop().unwrap();
    fill(&db.outbox, &path, big);
    fill(&db.outbox, &path, small); // and the last crumbs of room
    let before = counts(&path);
    let err = db.outbox.ack(&claim, Some("m")).unwrap_err();
    println!("disk full during ack: {err}");
    assert!(matches!(err, Error::DiskFull), "{err:?}");
    assert_eq!(counts(&path), before, "no half-written ack");
    assert_eq!(
        view(&db.outbox, claim.delivery_id).chunks[0].status,
        chunked_outbox::monitoring::ChunkStatus::Sending
    );
    assert_eq!(integrity(&path), "ok");
    // With room again, the same claim (its token is still current) is acked and finalized.
    let roomy = db.reopen(OutboxOptions::default());
    assert!(roomy.ack(&claim, Some("m"))?.finalized);
    assert_eq!(db.messages_for(claim.delivery_id)?.len(), 1);
    Ok(())
}

/// Makes a path immutable (even for root) for the guard's lifetime, with `chattr +i`.
struct Immutable(PathBuf);

impl Immutable {
    fn set(path: &Path) -> Immutable {
        let ok = std::process::Command::new("chattr")
            .arg("+i")
            .arg(path)
            .status()
            .is_ok_and(|s| s.success());
        assert!(
            ok,
            "chattr +i failed on {}: this test needs a filesystem with immutable files",
            path.display()
        );
        Immutable(path.to_owned())
    }
}

impl Drop for Immutable {
    fn drop(&mut self) {
        let _ = std::process::Command::new("chattr")
            .arg("-i")
            .arg(&self.0)
            .status();
    }
}

/// Closes every connection (checkpointing the WAL away) and returns the path.
fn closed_db_with_one_delivery() -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("outbox.db");
    let outbox = Outbox::open(&path, OutboxOptions::default()).unwrap();
    let _ = outbox
        .enqueue(&NewDelivery::single("telegram", "1", "kept"))
        .unwrap();
    drop(outbox);
    (dir, path)
}

fn is_read_only_refusal(e: &Error) -> bool {
    matches!(e, Error::ReadOnly(_) | Error::CannotOpen { .. })
}

#[test]
fn read_only_file_is_refused_and_recovers() -> Result<()> {
    let (_dir, path) = closed_db_with_one_delivery();
    let before = std::fs::read(&path).unwrap();
    {
        let _guard = Immutable::set(&path);
        match Outbox::open(&path, OutboxOptions::default()) {
            Err(e) => {
                println!("read-only file, open: {e}");
                assert!(is_read_only_refusal(&e), "{e:?}");
            }
            Ok(outbox) => {
                let err = outbox
                    .enqueue(&NewDelivery::single("telegram", "2", "x"))
                    .unwrap_err();
                println!("read-only file, enqueue: {err}");
                assert!(matches!(err, Error::ReadOnly(_)), "{err:?}");
                assert!(err.to_string().contains("read-only"));
            }
        }
        assert!(
            std::fs::read(&path).unwrap() == before,
            "the file was modified"
        );
    }
    let outbox = Outbox::open(&path, OutboxOptions::default())?;
    let _ = outbox.enqueue(&NewDelivery::single("telegram", "2", "now it works"))?;
    assert_eq!(outbox.health()?.totals.total_deliveries, 2);
    Ok(())
}

#[test]
fn read_only_directory_is_refused_and_recovers() -> Result<()> {
    let (dir, path) = closed_db_with_one_delivery();
    {
        let _guard = Immutable::set(dir.path());
        // WAL mode needs to create -wal and -shm next to the file.
        let outcome = Outbox::open(&path, OutboxOptions::default()).and_then(|o| {
            o.enqueue(&NewDelivery::single("telegram", "2", "x"))
                .map(|_| ())
        });
        let err = outcome.unwrap_err();
        println!("read-only directory: {err}");
        assert!(
            matches!(&err, Error::CannotOpen { path: p, .. } if p == &path),
            "{err:?}"
        );
    }
    let outbox = Outbox::open(&path, OutboxOptions::default())?;
    let _ = outbox.enqueue(&NewDelivery::single("telegram", "2", "x"))?;
    assert_eq!(outbox.health()?.totals.total_deliveries, 2);
    Ok(())
}

#[test]
fn truncated_database_is_refused_and_untouched() {
    let (_dir, path) = closed_db_with_one_delivery();
    {
        let outbox = Outbox::open(&path, OutboxOptions::default()).unwrap();
        for n in 0..200 {
            let _ = outbox.enqueue(&big(n)).unwrap();
        }
    }
    let full = std::fs::read(&path).unwrap();
    std::fs::write(&path, &full[..full.len() / 2]).unwrap();
    let cut = std::fs::read(&path).unwrap();
    let err = Outbox::open(&path, OutboxOptions::default()).unwrap_err();
    println!("truncated: {err}");
    match &err {
        Error::Corrupt { path: p, reason } => {
            assert_eq!(p, &path);
            assert!(reason.contains("truncated"), "{reason}");
        }
        other => panic!("expected Corrupt, got {other:?}"),
    }
    assert!(err.to_string().contains("outbox.db"));
    assert!(
        std::fs::read(&path).unwrap() == cut,
        "the file was modified"
    );
}

/// Child side of the lost-WAL test: commits into the WAL, then dies without closing.
#[test]
#[ignore = "run as a child process by wal_removed_after_a_crash"]
fn child_commits_then_aborts() {
    let Ok(db) = std::env::var("CHUNKED_OUTBOX_FAULT_DB") else {
        return;
    };
    let outbox = Outbox::open(&db, OutboxOptions::default()).unwrap();
    for n in 0..5 {
        let _ = outbox
            .enqueue(&NewDelivery::single(
                "telegram",
                "c",
                format!("only in the wal {n}"),
            ))
            .unwrap();
    }
    std::process::abort();
}

#[test]
fn wal_removed_after_a_crash_loses_only_the_unwritten_tail() -> Result<()> {
    let (_dir, path) = closed_db_with_one_delivery();
    let status = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--ignored", "--exact", "child_commits_then_aborts"])
        .env("CHUNKED_OUTBOX_FAULT_DB", &path)
        .stderr(std::process::Stdio::null())
        .status()
        .unwrap();
    assert!(!status.success(), "the child aborts");
    let wal = PathBuf::from(format!("{}-wal", path.display()));
    assert!(
        std::fs::metadata(&wal).map(|m| m.len()).unwrap_or(0) > 0,
        "the crash left a WAL"
    );
    std::fs::remove_file(&wal).unwrap();
    let _ = std::fs::remove_file(format!("{}-shm", path.display()));

    let outbox = Outbox::open(&path, OutboxOptions::default())?;
    assert_eq!(integrity(&path), "ok");
    // The checkpointed delivery is there; the five that lived only in the WAL are not.
    let h = outbox.health()?;
    assert_eq!(h.totals.total_deliveries, 1);
    assert_eq!(counts(&path), (1, 1, 0));
    let _ = outbox.enqueue(&NewDelivery::single("telegram", "c", "works again"))?;
    assert_eq!(claim_all(&outbox).len(), 2);
    Ok(())
}
