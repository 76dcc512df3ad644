//! One truth per database: the rules whose effects are stored (lane order, lane failure
//! policy, replay policy, pacing, retries) are read from the file by every handle, so
//! processes sharing a file act on the same rows by the same rules; pacing holds
//! across replies and processes; a corrupt row is set aside; opening a file harms
//! nothing it cannot finish. Each handle here stands for another process (the `outbox`
//! tool, a cron job, a second dispatcher): it opens the file with default options,
//! declaring no rules.

mod common;

use std::sync::Arc;
use std::time::Duration;

use chunked_outbox::maintenance::RecoverScope;
use chunked_outbox::monitoring::{ChunkStatus, DeliveryStatus};
use chunked_outbox::rules::{
    ChannelPolicy, LaneFailurePolicy, LaneOrder, ReplayPolicy, RetryPolicy,
};
use chunked_outbox::{Error, NewDelivery, Outbox, OutboxOptions, Outcome, Result};
use common::*;

fn tool(db: &TestDb) -> Outbox {
    db.reopen(OutboxOptions::default())
}

/// A file whose channel `telegram` sends at most once per `interval`, with a reply
/// queued for each of `chats` chats.
fn paced_chats(interval: Duration, chats: usize) -> TestDb {
    let rules = ChannelPolicy::default().with_channel_interval(interval);
    let db = TestDb::new(OutboxOptions::default().with_channel("telegram", rules));
    for n in 0..chats {
        enqueue(&db.outbox, &format!("c{n}"), &["x"]);
    }
    db
}

/// Found: opening an application's database that could not be migrated failed, and
/// left the application's file switched to WAL for good.
#[test]
fn a_failed_upgrade_leaves_the_applications_file_as_it_was() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("app.db");
    let app = rusqlite::Connection::open(&path).unwrap();
    // A table the outbox's schema would create too, with columns of the application's.
    app.execute_batch("CREATE TABLE outbound_lanes (id INTEGER PRIMARY KEY, body TEXT);")
        .unwrap();
    drop(app);
    let err = Outbox::open(&path, OutboxOptions::default()).unwrap_err();
    // The error names the statement that failed, not the whole migration.
    match &err {
        Error::Migration {
            version,
            statement,
            message,
        } => {
            assert_eq!(*version, 2, "the table comes with migration 2");
            assert!(
                statement.starts_with("CREATE TABLE outbound_lanes") && statement.len() < 400,
                "{statement}"
            );
            assert!(message.contains("already exists"), "{message}");
        }
        other => panic!("{other:?}"),
    }
    assert!(err.to_string().len() < 600, "{err}");
    let app = rusqlite::Connection::open(&path).unwrap();
    let journal: String = app
        .query_row("PRAGMA journal_mode", [], |r| r.get(0))
        .unwrap();
    assert_eq!(journal, "delete");
    let tables: i64 = app
        .query_row(
            "SELECT count(*) FROM sqlite_master WHERE type = 'table'",
            [],
            |r| r.get(0),
        )
        .unwrap();
    assert_eq!(tables, 1, "no table of the outbox stayed behind");
}

/// Found: of several processes creating the same new file at once, one usually failed
/// with `Busy` at once (the switch to WAL did not wait out the busy timeout); and with
/// rules of their own, all but the first failed with `PolicyConflict` (each compared
/// its rules with the file's before the first had stored them). Processes, not threads:
/// SQLite arbitrates connections of one process among themselves.
#[test]
fn several_processes_create_one_new_file_at_once() {
    // Half the runs of 5 rounds failed before the fix: 12 rounds catch a regression
    // nearly always.
    for round in 0..12 {
        let dir = tempfile::tempdir().unwrap();
        let (path, go) = (dir.path().join("new.db"), dir.path().join("go"));
        let children: Vec<_> = (0..6)
            .map(|child| {
                std::process::Command::new(std::env::current_exe().unwrap())
                    .args(["--ignored", "--exact", "opener_process", "--nocapture"])
                    .env("CHUNKED_OUTBOX_OPEN", &path)
                    .env("CHUNKED_OUTBOX_GO", &go)
                    .env("CHUNKED_OUTBOX_DECLARE", (child % 3 != 0).to_string())
                    .stdout(std::process::Stdio::null())
                    .stderr(std::process::Stdio::piped())
                    .spawn()
                    .unwrap()
            })
            .collect();
        // Let them all start and wait at the line, then let them go at once.
        std::thread::sleep(Duration::from_millis(150));
        std::fs::write(&go, b"").unwrap();
        for child in children {
            let out = child.wait_with_output().unwrap();
            assert!(
                out.status.success(),
                "round {round}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
    }
}

/// The child of `several_processes_create_one_new_file_at_once`: waits for the go
/// file, then opens (and so creates) the outbox.
#[test]
#[ignore = "run as a child process"]
fn opener_process() {
    let (Ok(path), Ok(go)) = (
        std::env::var("CHUNKED_OUTBOX_OPEN"),
        std::env::var("CHUNKED_OUTBOX_GO"),
    ) else {
        return;
    };
    while !std::path::Path::new(&go).exists() {
        std::thread::sleep(Duration::from_micros(200));
    }
    // Most children declare rules of their own (the same for all of them).
    let options = if std::env::var("CHUNKED_OUTBOX_DECLARE").as_deref() == Ok("true") {
        OutboxOptions::default()
            .with_lane_order(LaneOrder::Parallel)
            .with_channel("telegram", ChannelPolicy::replayable())
    } else {
        OutboxOptions::default()
    };
    Outbox::open(&path, options).expect("open a file others create too");
}

/// Found: each `Outbox::open` left three reader-pool threads alive for about 30 s after
/// the last handle was dropped, so a CLI agent opening the outbox per command
/// accumulated them (300 after 100 opens). Counted in a process of its own: the other
/// tests of this binary start and end threads of their own meanwhile.
#[test]
fn opening_and_dropping_outboxes_leaves_no_threads_behind() {
    let dir = tempfile::tempdir().unwrap();
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--ignored",
            "--exact",
            "thread_counting_process",
            "--nocapture",
        ])
        .env("CHUNKED_OUTBOX_COUNT_THREADS", dir.path().join("outbox.db"))
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.contains("threads before"),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The child of `opening_and_dropping_outboxes_leaves_no_threads_behind`: opens and
/// drops the outbox 30 times and counts its own threads before and after.
#[test]
#[ignore = "run as a child process"]
fn thread_counting_process() -> Result<()> {
    let Ok(path) = std::env::var("CHUNKED_OUTBOX_COUNT_THREADS") else {
        return Ok(());
    };
    let threads = || {
        std::fs::read_dir("/proc/self/task")
            .map(|d| d.count())
            .unwrap_or(0)
    };
    Outbox::open(&path, OutboxOptions::default())?.health()?; // the shared upkeep thread starts
    let before = threads();
    for _ in 0..30 {
        let outbox = Outbox::open(&path, OutboxOptions::default())?;
        outbox.health()?;
    }
    let after = threads();
    println!("{before} threads before 30 opens, {after} after");
    assert!(
        after <= before + 2,
        "{before} threads before 30 opens, {after} after"
    );
    Ok(())
}

/// The statements of version 1, to build a real version-1 file.
/// The schema version 1 wrote, as it shipped (the migration file has moved on since).
const V1_SCHEMA: &str = include_str!("fixtures/v1_schema.sql");

/// Writes a version-1 file at `path` and runs `sql` on it.
fn v1_file(path: &std::path::Path, sql: &str) -> Result<()> {
    let v1 = rusqlite::Connection::open(path)?;
    v1.execute_batch(V1_SCHEMA)?;
    v1.execute_batch("PRAGMA user_version = 1")?;
    v1.execute_batch(sql)?;
    Ok(())
}

/// A file written by version 1 upgrades to version 2 with its rows, and with the
/// rules every process followed then (or the ones given at open).
#[test]
fn a_version_one_file_is_upgraded_with_its_rows() -> Result<()> {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("v1.db");
    v1_file(
        &path,
        "INSERT INTO outbound_deliveries (id, uid, channel, chat_id, status, chunk_count,
                created_at, updated_at, text)
         VALUES (1, '0199d6a2-0c0c-7000-8000-000000000001', 'telegram', '42', 'pending', 2,
                 1000, 1000, 'a b'),
                (2, '0199d6a2-0c0c-7000-8000-000000000002', 'slack', 'C1', 'pending', 1,
                 1000, 1000, 'hi');
         INSERT INTO outbound_delivery_chunks (id, delivery_id, chunk_index, status, due_at, text)
         VALUES (16384, 1, 0, 'pending', 1000, 'a'), (16385, 1, 1, 'pending', NULL, 'b'),
                (32768, 2, 0, 'pending', 9000000000000, NULL);
         INSERT INTO outbound_lane_pauses VALUES ('slack', 'C1', 9000000000000);
         INSERT INTO messages (delivery_id, channel, chat_id, content, chunk_count,
                created_at, delivered_at)
         VALUES ('0199d6a2-0c0c-7000-8000-00000000000f', 'telegram', '7', 'old reply', 1,
                 500, 600);",
    )?;
    let outbox = Outbox::open(
        &path,
        OutboxOptions::default().with_lane_failure(LaneFailurePolicy::Block),
    )?;
    assert_eq!(
        common::raw(&path).query_row("PRAGMA user_version", [], |r| r.get::<_, i64>(0))?,
        chunked_outbox::store::sqlite::SCHEMA_VERSION
    );
    let policy = outbox.rules()?;
    assert_eq!(policy.lane_order, LaneOrder::Fifo);
    assert_eq!(
        policy.lane_failure,
        LaneFailurePolicy::Block,
        "given at the upgrade: stored"
    );
    assert_eq!(policy.retry, RetryPolicy::default());
    // Both channels are found in their own part of the claim index; Slack's pause came
    // along (its chunk is due when the pause ends).
    let telegram = outbox.claim_channels(&["telegram"], 10)?;
    assert_eq!((telegram.len(), telegram[0].text.as_str()), (1, "a"));
    assert!(
        outbox.claim_channels(&["slack"], 10)?.is_empty(),
        "still paused"
    );
    let slack = outbox.next_due(Some(&["slack"]))?.unwrap();
    assert_eq!(slack.timestamp_millis(), 9_000_000_000_000);
    outbox.ack(&telegram[0], None)?;
    assert_eq!(outbox.claim_channels(&["telegram"], 10)?[0].text, "b");
    let h = outbox.health()?;
    assert_eq!(
        (h.totals.pending_deliveries, h.totals.partial_deliveries),
        (1, 1)
    );
    // Its history moved to the name that cannot collide with an application's table.
    assert_eq!(tables_named(&path, "messages"), 0);
    let old: String = common::raw(&path).query_row(
        "SELECT content FROM outbound_messages WHERE delivery_id = '0199d6a2-0c0c-7000-8000-00000000000f'",
        [],
        |r| r.get(0),
    )?;
    assert_eq!(old, "old reply");
    Ok(())
}

fn tables_named(path: &std::path::Path, name: &str) -> i64 {
    common::raw(path)
        .query_row(
            "SELECT count(*) FROM sqlite_master WHERE type = 'table' AND name = ?1",
            [name],
            |r| r.get(0),
        )
        .unwrap()
}

/// A file written by version 2 (version 1 and its second migration) has its history
/// table renamed too, with its rows, and its stored rules kept.
#[test]
fn a_version_two_file_keeps_its_history_under_the_new_name() -> Result<()> {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("v2.db");
    let v2 = rusqlite::Connection::open(&path)?;
    v2.execute_batch(V1_SCHEMA)?;
    v2.execute_batch(include_str!("../migrations/sqlite/0002_stored_policy.sql"))?;
    v2.execute_batch(
        "PRAGMA user_version = 2;
         UPDATE outbound_policy SET lane_order = 'parallel';
         INSERT INTO messages (delivery_id, channel, chat_id, content, chunk_count,
                created_at, delivered_at)
         VALUES ('d', 'slack', 'C1', 'kept', 1, 1, 2);",
    )?;
    drop(v2);
    let outbox = Outbox::open(&path, OutboxOptions::default())?;
    assert_eq!(outbox.rules()?.lane_order, LaneOrder::Parallel);
    assert_eq!(tables_named(&path, "messages"), 0);
    let kept: String = common::raw(&path).query_row(
        "SELECT content FROM outbound_messages WHERE delivery_id = 'd'",
        [],
        |r| r.get(0),
    )?;
    assert_eq!(kept, "kept");
    Ok(())
}

/// Found: on a database that already has a `messages` table (most chat applications),
/// every command failed with "table messages already exists". The outbox now lives
/// beside the application's history and leaves it as it was.
#[test]
fn an_applications_own_messages_table_is_left_as_it_was() -> Result<()> {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("app.db");
    let app = rusqlite::Connection::open(&path)?;
    app.execute_batch(APP_HISTORY)?;
    let before = app_history(&app);
    drop(app);
    let outbox = Outbox::open(&path, OutboxOptions::default())?;
    let id = outbox
        .enqueue(&NewDelivery::single("telegram", "77", "hello"))?
        .id;
    let claim = outbox.claim(1)?.pop().unwrap();
    assert!(outbox.ack(&claim, None)?.finalized);
    let app = common::raw(&path);
    assert_eq!(
        app_history(&app),
        before,
        "the application's table and rows"
    );
    let ours: String = app.query_row(
        "SELECT content FROM outbound_messages WHERE delivery_id = ?1",
        [id.to_string()],
        |r| r.get(0),
    )?;
    assert_eq!(ours, "hello");
    Ok(())
}

/// Item 7 of the review: the migrations that rebuild the outbox's tables (4, 5, 7) keep
/// the application's own indexes and triggers on them. A version-1 file with an index
/// and a trigger of the application's on each table upgrades with both in place, and
/// the trigger still fires.
#[test]
fn an_upgrade_keeps_the_applications_indexes_and_triggers_on_the_outbox_tables() -> Result<()> {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("v1.db");
    v1_file(
        &path,
        "CREATE TABLE app_audit (what TEXT);
         CREATE INDEX app_by_sender ON outbound_deliveries (sender);
         CREATE INDEX app_chunks_by_error ON outbound_delivery_chunks (last_error);
         CREATE TRIGGER app_audit_delivery AFTER UPDATE OF status ON outbound_deliveries
         BEGIN INSERT INTO app_audit VALUES ('delivery ' || new.status); END;
         CREATE TRIGGER app_audit_chunk AFTER UPDATE OF status ON outbound_delivery_chunks
         BEGIN INSERT INTO app_audit VALUES ('chunk ' || new.status); END;",
    )?;
    let outbox = Outbox::open(&path, OutboxOptions::default())?;
    let raw = common::raw(&path);
    let objects: Vec<String> = raw
        .prepare("SELECT name FROM sqlite_master WHERE name LIKE 'app_%' ORDER BY name")?
        .query_map([], |r| r.get(0))?
        .collect::<rusqlite::Result<_>>()?;
    assert_eq!(
        objects,
        [
            "app_audit",
            "app_audit_chunk",
            "app_audit_delivery",
            "app_by_sender",
            "app_chunks_by_error"
        ]
    );
    outbox.enqueue(&NewDelivery::single("telegram", "1", "x"))?;
    let claim = outbox.claim(1)?.remove(0);
    outbox.ack(&claim, None)?;
    let audit: Vec<String> = raw
        .prepare("SELECT what FROM app_audit")?
        .query_map([], |r| r.get(0))?
        .collect::<rusqlite::Result<_>>()?;
    assert!(audit.contains(&"chunk delivered".to_owned()), "{audit:?}");
    assert!(
        audit.contains(&"delivery delivered".to_owned()),
        "{audit:?}"
    );
    Ok(())
}

/// Issue 37, item 1: the migrations that rebuild the outbox's tables failed on a view
/// of the application's that reads them, and on a trigger of its own table whose body
/// names them ("error in view app_open_replies: no such table"). A version-1 file with
/// both upgrades; the view reads the new tables and the trigger writes them.
#[test]
fn an_upgrade_keeps_the_applications_views_and_triggers_that_read_the_outbox() -> Result<()> {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("v1.db");
    v1_file(
        &path,
        "CREATE VIEW app_open_replies AS
             SELECT d.uid, d.chat_id, c.chunk_index, c.status
             FROM outbound_deliveries d JOIN outbound_delivery_chunks c ON c.delivery_id = d.id
             WHERE d.status IN ('pending', 'partial');
         CREATE TABLE app_muted (chat_id TEXT);
         CREATE TRIGGER app_mutes AFTER INSERT ON app_muted
         BEGIN UPDATE outbound_deliveries SET sender = 'muted' WHERE chat_id = new.chat_id; END;",
    )?;
    let outbox = Outbox::open(&path, OutboxOptions::default())?;
    let id = outbox
        .enqueue(&NewDelivery::chunked("telegram", "42", "a b", ["a", "b"]))?
        .id;
    let raw = common::raw(&path);
    let open: Vec<(String, i64)> = raw
        .prepare("SELECT uid, chunk_index FROM app_open_replies ORDER BY chunk_index")?
        .query_map([], |r| Ok((r.get(0)?, r.get(1)?)))?
        .collect::<rusqlite::Result<_>>()?;
    assert_eq!(open, [(id.to_string(), 0), (id.to_string(), 1)]);
    raw.execute("INSERT INTO app_muted VALUES ('42')", [])?;
    let sender: Option<String> = raw.query_row(
        "SELECT sender FROM outbound_deliveries WHERE uid = ?1",
        [id.to_string()],
        |r| r.get(0),
    )?;
    assert_eq!(sender.as_deref(), Some("muted"));
    Ok(())
}

/// A view of the application's that reads what an upgrade removes (version 1's lane
/// pauses) fails the upgrade before anything changes, naming the view and what to do.
#[test]
fn an_upgrade_that_would_break_an_applications_view_names_it_and_changes_nothing() -> Result<()> {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("v1.db");
    v1_file(
        &path,
        "CREATE VIEW app_paused AS SELECT chat_id FROM outbound_lane_pauses;",
    )?;
    let before = std::fs::read(&path).unwrap();
    let err = Outbox::open(&path, OutboxOptions::default()).unwrap_err();
    let message = err.to_string();
    assert!(matches!(err, Error::Migration { .. }), "{err:?}");
    assert!(
        message.contains("app_paused") && message.contains("drop it"),
        "{message}"
    );
    assert_eq!(std::fs::read(&path).unwrap(), before, "the file as it was");
    Ok(())
}

stores! {
    /// Found: one row with an unparsable uid made every claim fail (as `InvalidInput`).
    /// It is set aside as corrupt, reported, and the others are served.
    fn a_corrupt_row_is_set_aside_and_claims_go_on() -> Result<()> {
        let db = TestDb::default();
        let ids: Vec<_> = (0..3)
            .map(|n| enqueue(&db.outbox, &format!("c{n}"), &["x"]))
            .collect();
        db.exec(&format!(
            "UPDATE outbound_deliveries SET uid = 'not-a-uuid' WHERE uid = '{}'",
            ids[1]
        ));
        assert_eq!(
            db.outbox.corrupt_rows()?.len(),
            1,
            "found before any claim met it"
        );
        assert_eq!(
            db.outbox.list(&Default::default())?.len(),
            2,
            "listed without it"
        );
        let claims = claim_all(&db.outbox);
        assert_eq!(claims.len(), 2);
        assert!(claims.iter().all(|c| c.delivery_id != ids[1]));
        let h = db.outbox.health()?;
        assert_eq!(
            (h.totals.corrupt_deliveries, h.totals.failed_deliveries),
            (1, 1)
        );
        let corrupt = db.outbox.corrupt_rows()?;
        assert_eq!(corrupt.len(), 1);
        assert!(corrupt[0].reason.contains("not-a-uuid"), "{corrupt:?}");
        assert!(
            claim_all(&db.outbox).is_empty(),
            "and it is never claimed again"
        );
        Ok(())
    }


    /// Found: an application on `LaneOrder::Parallel` requeued a dead letter through the
    /// tool (which used FIFO) while another reply to that chat was in flight; the reply was
    /// left `queued` and a Parallel process never advanced it.
    fn a_requeue_by_another_process_follows_the_files_lane_order() -> Result<()> {
        let db = TestDb::new(OutboxOptions::default().with_lane_order(LaneOrder::Parallel));
        let app = &db.outbox;
        let dead = enqueue(app, "c", &["x"]);
        let live = enqueue(app, "c", &["y"]);
        for claim in claim_all(app) {
            if claim.delivery_id == dead {
                app.record(
                    &claim,
                    Outcome::Permanent {
                        error: "chat not found".into(),
                    },
                )?;
            }
        }
        assert_eq!(view(app, live).chunks[0].status, ChunkStatus::Sending);
        tool(&db).requeue_delivery(dead)?;
        assert_eq!(
            view(app, dead).status,
            DeliveryStatus::Pending,
            "active, not queued"
        );
        let again = claim_all(app);
        assert_eq!(again.len(), 1);
        assert_eq!(again[0].delivery_id, dead);
        Ok(())
    }

    /// Found: recovering an expired lease on a `Replay` channel from another process (or
    /// before the dispatcher registered the channel) held it `uncertain`.
    fn recovery_by_another_process_follows_the_stored_replay_policy() -> Result<()> {
        let options = OutboxOptions::default()
            .with_channel("discord", ChannelPolicy::replayable())
            .with_lease(Duration::from_secs(10));
        let db = TestDb::new(options);
        db.outbox
            .enqueue(&NewDelivery::single("discord", "c", "x"))?;
        let _abandoned = claim_one(&db.outbox);
        db.advance(Duration::from_secs(11));
        let report = tool(&db).recover(RecoverScope::ExpiredLeases)?;
        assert_eq!((report.retried, report.held_uncertain), (1, 0));
        Ok(())
    }

    /// Found: with `LaneFailurePolicy::Block`, a recovery by another process (default
    /// `Skip`) started the next reply ahead of the held one.
    fn recovery_by_another_process_keeps_a_blocked_lane_blocked() -> Result<()> {
        let options = OutboxOptions::default()
            .with_lane_failure(LaneFailurePolicy::Block)
            .with_lease(Duration::from_secs(10));
        let db = TestDb::new(options);
        let held = enqueue(&db.outbox, "c", &["x"]);
        let next = enqueue(&db.outbox, "c", &["y"]);
        let _abandoned = claim_one(&db.outbox);
        db.advance(Duration::from_secs(11));
        assert_eq!(
            tool(&db)
                .recover(RecoverScope::ExpiredLeases)?
                .held_uncertain,
            1
        );
        assert_eq!(view(&db.outbox, held).status, DeliveryStatus::Uncertain);
        assert_eq!(view(&db.outbox, next).status, DeliveryStatus::Queued);
        assert!(
            claim_all(&db.outbox).is_empty(),
            "the lane waits for the held reply"
        );
        Ok(())
    }

    /// Found: a reply enqueued into an idle lane was due at once, so the second reply to a
    /// chat left 10 ms after the first despite a 1 s lane interval.
    fn the_lane_interval_holds_between_consecutive_replies() -> Result<()> {
        let rules = ChannelPolicy::default().with_lane_interval(Duration::from_secs(1));
        let db = TestDb::new(OutboxOptions::default().with_channel("telegram", rules));
        enqueue(&db.outbox, "c", &["first"]);
        let first = claim_one(&db.outbox);
        db.advance(Duration::from_millis(10));
        db.outbox.ack(&first, None)?;
        db.advance(Duration::from_millis(10));
        // The lane is idle now; another process enqueues the next reply.
        enqueue(&tool(&db), "c", &["second"]);
        assert!(
            claim_all(&db.outbox).is_empty(),
            "due only a lane interval after the first send"
        );
        db.advance(Duration::from_millis(979));
        assert!(claim_all(&db.outbox).is_empty());
        db.advance(Duration::from_millis(1));
        assert_eq!(claim_one(&db.outbox).text, "second");
        Ok(())
    }

    /// Found: the channel-wide rate was kept per dispatcher process: two processes sent
    /// twice as fast as the channel allows.
    fn the_channel_rate_holds_across_processes() -> Result<()> {
        let db = paced_chats(Duration::from_secs(1), 10);
        let other = tool(&db);
        let mut claimed = 0;
        for second in 0..5 {
            let now = db.outbox.claim(10)?.len() + other.claim(10)?.len();
            assert_eq!(
                now, 1,
                "one send per second across both processes (second {second})"
            );
            claimed += now;
            db.advance(Duration::from_millis(999));
            assert_eq!(db.outbox.claim(10)?.len() + other.claim(10)?.len(), 0);
            db.advance(Duration::from_millis(1));
        }
        assert_eq!(claimed, 5);
        // The next send of the channel is the next due time of its chunks.
        let next = other.next_due(Some(&["telegram"]))?.unwrap();
        assert_eq!(next.timestamp_millis(), db.now_ms());
        Ok(())
    }

    /// A channel keeps a schedule: a send that starts up to the clock's millisecond late
    /// does not push the next one back (a worker waking a little late costs no rate), one
    /// later than that starts a new schedule (lateness never becomes a burst), and
    /// sub-millisecond rates are kept as asked.
    fn the_channel_rate_keeps_its_schedule_when_a_send_starts_late() -> Result<()> {
        let db = paced_chats(Duration::from_millis(10), 20);
        let start = db.now_ms();
        let mut sends = Vec::new();
        // A worker that always comes `late` ms after the time it was told.
        let mut run = |late: u64, until: i64| -> Result<()> {
            while db.now_ms() - start <= until {
                if db.outbox.claim(10)?.len() == 1 {
                    sends.push(db.now_ms() - start);
                }
                let next = db.outbox.next_due(None)?.unwrap().timestamp_millis();
                db.advance(Duration::from_millis(
                    (next - db.now_ms()).max(0) as u64 + late,
                ));
            }
            Ok(())
        };
        run(1, 50)?;
        run(3, 100)?;
        assert_eq!(sends, [0, 11, 21, 31, 41, 51, 63, 76, 89]);
        Ok(())
    }

    /// A channel whose rate is lifted sends at once: the slot its last paced send left
    /// behind no longer counts.
    fn lifting_a_channel_rate_frees_its_next_send_at_once() -> Result<()> {
        let db = paced_chats(Duration::from_secs(60), 3);
        assert_eq!(db.outbox.claim(10)?.len(), 1);
        assert_eq!(
            db.outbox.claim(10)?.len(),
            0,
            "the next slot is a minute away"
        );
        db.outbox
            .set_channel_policy("telegram", Some(ChannelPolicy::default()))?;
        assert_eq!(
            db.outbox.claim(10)?.len(),
            2,
            "no rate, no slot to wait for"
        );
        Ok(())
    }

    /// Rules given in finer units than the file keeps are compared as stored: opening the
    /// file again with the same options is no conflict.
    fn rules_in_finer_units_than_stored_reopen_without_a_conflict() -> Result<()> {
        let rules = ChannelPolicy::default()
            .with_lane_interval(Duration::from_micros(1_500))
            .with_channel_interval(Duration::from_nanos(5_128_500));
        let options = || OutboxOptions::default().with_channel("telegram", rules.clone());
        let db = TestDb::new(options());
        let stored = db.outbox.rules()?.channel("telegram").clone();
        assert_eq!(stored.lane_interval, Duration::from_millis(2));
        assert_eq!(stored.channel_interval, Duration::from_micros(5_129));
        let again = db.reopen(options());
        assert_eq!(again.rules()?.channel("telegram"), &stored);
        Ok(())
    }

    /// The stored channel interval keeps microseconds.
    fn a_channel_rate_is_stored_to_the_microsecond() -> Result<()> {
        let db = TestDb::default();
        // 195 sends a second is 5,129 µs between them, not 6 ms (167/s).
        db.outbox.set_channel_policy(
            "telegram",
            Some(ChannelPolicy::default().with_rate_per_second(195.0)),
        )?;
        let stored = db.outbox.rules()?.channel("telegram").channel_interval;
        assert_eq!(stored, Duration::from_micros(5_129));
        Ok(())
    }

    /// Found: a lane interval given at open was replaced by the adapter's declaration. The
    /// stored interval is now the only one, and a dispatcher keeps it.
    fn a_dispatcher_keeps_the_stored_lane_interval() -> Result<()> {
        /// Notes the (manual) time of every send.
        #[derive(Clone)]
        struct Stamps(chunked_outbox::clock::ManualClock, Arc<std::sync::Mutex<Vec<i64>>>);
        impl chunked_outbox::ChannelAdapter for Stamps {
            fn send(&self, _: &chunked_outbox::Claim) -> Outcome {
                self.1
                    .lock()
                    .unwrap()
                    .push(chunked_outbox::clock::Clock::now_ms(&self.0));
                Outcome::delivered(None)
            }
        }
        let rules = ChannelPolicy::default().with_lane_interval(Duration::from_secs(2));
        let db = TestDb::new(OutboxOptions::default().with_channel("telegram", rules));
        enqueue(&db.outbox, "c", &["a", "b", "c"]);
        let platform = Stamps(db.clock.clone(), Arc::default());
        let dispatcher = chunked_outbox::Dispatcher::builder(db.outbox.clone())
            .adapter("telegram", platform.clone())
            .build()?;
        for _ in 0..40 {
            if dispatcher.run_once()? == 0 {
                db.advance(Duration::from_millis(250));
            }
        }
        let sent = platform.1.lock().unwrap().clone();
        assert_eq!(sent.len(), 3);
        assert!(sent.windows(2).all(|w| w[1] - w[0] >= 2_000), "{sent:?}");
        Ok(())
    }

    /// Found: under `LaneOrder::Parallel`, a chunk rate-limited for 1 s went out after 2 s
    /// although its chat was paused for 60 s: the shorter pause replaced the stored one.
    fn a_shorter_rate_limit_keeps_the_longer_stored_pause() -> Result<()> {
        let db = TestDb::new(OutboxOptions::default().with_lane_order(LaneOrder::Parallel));
        enqueue(&db.outbox, "c", &["a"]);
        enqueue(&db.outbox, "c", &["b"]);
        let claims = claim_all(&db.outbox);
        assert_eq!(claims.len(), 2, "parallel: both replies active");
        let limited = |secs| Outcome::RateLimited {
            retry_after: Duration::from_secs(secs),
            error: "429".into(),
        };
        db.outbox.record(&claims[0], limited(60))?;
        let second = db.outbox.record(&claims[1], limited(1))?;
        assert_eq!(
            second.next_attempt_at.unwrap().timestamp_millis(),
            db.now_ms() + 60_000,
            "the chat stays paused for the longer pause"
        );
        db.advance(Duration::from_secs(2));
        assert!(claim_all(&db.outbox).is_empty());
        db.advance(Duration::from_secs(58));
        assert_eq!(claim_all(&db.outbox).len(), 2);
        Ok(())
    }

    /// A rule given at open that differs from the one the file stores is an error naming
    /// the rule, or an explicit update; every other handle then follows the stored rule. A
    /// rule nobody declared yet is stored by the first handle that gives it.
    fn a_conflicting_rule_at_open_is_an_error_unless_it_is_an_update() -> Result<()> {
        let place = Place::new();
        let retry = RetryPolicy::default().with_max_attempts(9);
        let first = place.open(OutboxOptions::default().with_retry(RetryPolicy::default()),
        )?;
        let conflicting = OutboxOptions::default().with_retry(retry.clone());
        match place.open(conflicting.clone()) {
            Err(Error::PolicyConflict { rule, .. }) => assert_eq!(rule, "retry policy"),
            other => panic!("expected a conflict, got {other:?}"),
        }
        assert_eq!(first.rules()?.retry.max_attempts, 5, "nothing changed");
        let updater = place.open(conflicting.with_policy_update(true))?;
        assert_eq!(updater.rules()?.retry, retry);
        assert_eq!(
            first.rules()?.retry.max_attempts,
            9,
            "every handle reads the update"
        );
        // The lane order was never declared: the first handle to give one stores it, and
        // a handle giving another is refused.
        place.open(OutboxOptions::default().with_lane_order(LaneOrder::Parallel),
        )?;
        assert_eq!(first.rules()?.lane_order, LaneOrder::Parallel);
        assert!(matches!(
            place.open(OutboxOptions::default().with_lane_order(LaneOrder::Fifo)
            ),
            Err(Error::PolicyConflict { .. })
        ));
        // A channel with no rules of its own takes the rules given for it.
        let matrix = OutboxOptions::default().with_channel("matrix", ChannelPolicy::replayable());
        place.open(matrix)?;
        assert_eq!(
            first.rules()?.channel("matrix").replay,
            ReplayPolicy::Replay
        );
        Ok(())
    }

    /// Found: a file created by a handle that declared no rules (`outbox migrate`, or an
    /// enqueuer on the defaults) refused the application's own rules as a conflict with
    /// defaults nobody had chosen.
    fn rules_nobody_declared_are_stored_by_the_first_handle_that_gives_them() -> Result<()> {
        let place = Place::new();
        let tool = place.open(OutboxOptions::default())?;
        // An operator changes one rule (as `outbox config set --max-attempts 9` does): that
        // one is declared, the others stay free.
        let mut policy = tool.rules()?;
        policy.retry.max_attempts = 9;
        tool.set_rules(policy)?;
        let app = OutboxOptions::default()
            .with_lane_order(LaneOrder::Parallel)
            .with_lane_failure(LaneFailurePolicy::Block)
            .with_default_channel(ChannelPolicy::replayable());
        place.open(app.clone())?;
        let policy = tool.rules()?;
        assert_eq!(
            (
                policy.lane_order,
                policy.lane_failure,
                policy.default_channel.replay
            ),
            (
                LaneOrder::Parallel,
                LaneFailurePolicy::Block,
                ReplayPolicy::Replay
            )
        );
        place.open(app)?; // the same rules again: no conflict
        assert!(matches!(
            place.open(OutboxOptions::default().with_retry(RetryPolicy::default())
            ),
            Err(Error::PolicyConflict { .. })
        ));
        Ok(())
    }

    /// The stored rows move with a change of the lane rules, made by another process: a
    /// switch to parallel lanes starts every reply queued behind another, a switch from
    /// Block to Skip lets a lane held by its dead letter move on, and a switch back to FIFO
    /// lets the replies under way finish while new ones queue.
    fn a_change_of_the_lane_rules_moves_the_replies_already_stored() -> Result<()> {
        let db = TestDb::new(OutboxOptions::default().with_lane_failure(LaneFailurePolicy::Block));
        let app = &db.outbox;
        let doomed = enqueue(app, "held", &["x"]);
        let behind = enqueue(app, "held", &["y"]);
        let claim = claim_one(app);
        app.record(
            &claim,
            Outcome::Permanent {
                error: "chat not found".into(),
            },
        )?;
        let first = enqueue(app, "busy", &["a"]);
        let queued = [enqueue(app, "busy", &["b"]), enqueue(app, "busy", &["c"])];
        let operator = tool(&db);
        let mut policy = operator.rules()?;

        policy.lane_failure = LaneFailurePolicy::Skip;
        operator.set_rules(policy.clone())?;
        let mut due: Vec<_> = claim_all(app).into_iter().map(|c| c.delivery_id).collect();
        due.sort();
        let mut expected = vec![first, behind];
        expected.sort();
        assert_eq!(
            due, expected,
            "the held lane moved on, the busy one did not"
        );
        assert_eq!(view(app, doomed).status, DeliveryStatus::Failed);
        assert!(
            queued
                .iter()
                .all(|q| view(app, *q).status == DeliveryStatus::Queued)
        );

        policy.lane_order = LaneOrder::Parallel;
        operator.set_rules(policy.clone())?;
        let mut due: Vec<_> = claim_all(app).into_iter().map(|c| c.delivery_id).collect();
        due.sort();
        let mut expected = queued.to_vec();
        expected.sort();
        assert_eq!(due, expected, "every queued reply started");

        policy.lane_order = LaneOrder::Fifo;
        operator.set_rules(policy)?;
        let later = enqueue(app, "busy", &["d"]);
        assert_eq!(view(app, later).status, DeliveryStatus::Queued);
        assert!(
            queued
                .iter()
                .all(|q| view(app, *q).status == DeliveryStatus::Pending),
            "the replies under way go on"
        );
        Ok(())
    }
}
