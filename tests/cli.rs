//! The `outbox` binary on prepared databases: every subcommand, exit statuses for
//! monitoring, parseable `--json` and Prometheus output, read-only commands that never
//! create a file, and a small `demo --json` and `torture` whose verdicts hold (nothing
//! lost, nothing out of order, every finalization present and right, no duplicate
//! nobody decided on, no crash leaving more uncertain than it had in flight).

mod common;

use std::path::Path;
use std::time::Duration;

use assert_cmd::Command;
use chunked_outbox::{Outcome, Result};
use common::*;

fn outbox(db: &Path) -> Command {
    let mut cmd = Command::cargo_bin("outbox").expect("binary");
    cmd.arg("--db").arg(db).env_remove("OUTBOX_DB");
    cmd
}

/// Runs a command that must succeed and end with one JSON object; returns it.
fn json_verdict(cmd: &mut Command) -> serde_json::Value {
    let out = cmd.output().expect("run");
    let text = String::from_utf8(out.stdout).unwrap();
    assert_eq!(
        out.status.code(),
        Some(0),
        "{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let last = text.lines().last().expect("a last line");
    serde_json::from_str(last).unwrap_or_else(|e| panic!("last line is not JSON ({e}): {last}"))
}

/// The tool with no database named, for subcommands that make their own.
fn outbox_without_db() -> Command {
    let mut cmd = Command::cargo_bin("outbox").expect("binary");
    cmd.env_remove("OUTBOX_DB");
    cmd
}

/// The test lab (`demo`, `torture`, `stress`) on `db`.
fn lab(db: &Path) -> Command {
    let mut cmd = lab_without_db();
    cmd.arg("--db").arg(db);
    cmd
}

/// The test lab with no database named: its harnesses make their own.
fn lab_without_db() -> Command {
    let mut cmd = Command::cargo_bin("outbox-lab").expect("binary");
    cmd.env_remove("OUTBOX_DB");
    cmd
}

fn stdout(cmd: &mut Command) -> (i32, String) {
    let out = cmd.output().expect("run");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8(out.stdout).unwrap(),
    )
}

/// A database with one delivered reply, one dead letter, one uncertain chunk and one
/// chunk whose lease has expired (the test clock stands in the past).
struct Prepared {
    db: TestDb,
    delivered: chunked_outbox::DeliveryId,
    dead: chunked_outbox::DeliveryId,
    uncertain: chunked_outbox::DeliveryId,
}

fn prepared() -> Result<Prepared> {
    let db = TestDb::default();
    let ob = &db.outbox;
    let delivered = enqueue(ob, "ok", &["fine"]);
    let dead = enqueue(ob, "gone", &["x"]);
    let uncertain = enqueue(ob, "unsure", &["y"]);
    let _ = enqueue(ob, "stuck", &["z"]);
    let claims = claim_all(ob);
    let by_chat = |chat: &str| claims.iter().find(|c| c.chat_id == chat).unwrap();
    ob.ack(by_chat("ok"), Some("m1"))?;
    ob.record(
        by_chat("gone"),
        Outcome::Permanent {
            error: "Bad Request: chat not found".into(),
        },
    )?;
    ob.record(
        by_chat("unsure"),
        Outcome::Ambiguous {
            error: "timeout".into(),
        },
    )?;
    // "stuck" stays sending; its lease ended in 2026-01, long before the CLI's clock.
    Ok(Prepared {
        delivered,
        dead,
        uncertain,
        db,
    })
}

#[test]
fn read_only_commands_never_create_a_database() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("nope.db");
    for args in [
        vec!["health"],
        vec!["health", "--json"],
        vec!["list"],
        vec!["show", "01890a5d-ac96-774b-bcce-b302099a8057"],
        vec!["requeue", "--failed"],
        vec!["resolve", "1", "--resend"],
        vec!["dismiss-dead-letters"],
        vec!["purge", "--older-than", "7d"],
        vec!["recover"],
    ] {
        let out = outbox(&missing).args(&args).output().unwrap();
        assert_eq!(out.status.code(), Some(3), "{args:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains("nope.db") && err.contains("does not exist"),
            "{args:?}: {err}"
        );
        assert!(!missing.exists(), "{args:?} created the file");
    }
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);

    let out = outbox_without_db().arg("health").output().unwrap();
    assert_eq!(out.status.code(), Some(3));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--db"));
}

#[test]
fn health_exit_status_follows_the_state() -> Result<()> {
    let p = prepared()?;
    let path = p.db.path();
    let (code, text) = stdout(outbox(&path).arg("health"));
    assert_eq!(code, 2, "dead letter and uncertain chunk: fail\n{text}");
    assert!(
        text.contains("status: fail") && text.contains("unacknowledged dead letters"),
        "{text}"
    );
    assert!(text.contains("telegram"), "{text}");

    // Thresholds as flags: tolerate those, and only the expired lease remains: warn.
    let (code, text) = stdout(outbox(&path).args([
        "health",
        "--fail-dead-letters",
        "5",
        "--fail-uncertain",
        "5",
    ]));
    assert_eq!(code, 1, "{text}");
    assert!(text.contains("expired leases"), "{text}");

    let (code, _) = stdout(outbox(&path).args([
        "health",
        "--fail-dead-letters",
        "5",
        "--fail-uncertain",
        "5",
        "--warn-expired-leases",
        "5",
        "--warn-due-age",
        "1000d",
    ]));
    assert_eq!(code, 0);

    let clean = TestDb::default();
    let _ = enqueue(&clean.outbox, "1", &["x"]);
    let c = claim_one(&clean.outbox);
    clean.outbox.ack(&c, None)?;
    assert_eq!(stdout(outbox(&clean.path()).arg("health")).0, 0);
    Ok(())
}

#[test]
fn health_json_and_prometheus_parse() -> Result<()> {
    let p = prepared()?;
    let (_, json) = stdout(outbox(&p.db.path()).args(["health", "--json"]));
    let v: serde_json::Value = serde_json::from_str(&json).expect("health --json is JSON");
    assert_eq!(v["total_deliveries"], 4);
    assert_eq!(v["delivered_deliveries"], 1);
    assert_eq!(v["uncertain_chunks"], 1);
    assert_eq!(v["channels"]["telegram"]["failed_chunks"], 1);

    let (_, text) = stdout(outbox(&p.db.path()).args(["health", "--prometheus"]));
    // The one finalized reply is counted and timed, and stays so after a purge.
    assert!(
        text.contains("outbox_file_finalized_total{channel=\"telegram\"} 1"),
        "{text}"
    );
    assert!(
        text.contains(
            "outbox_file_reply_latency_seconds_bucket{channel=\"telegram\",le=\"+Inf\"} 1"
        ),
        "{text}"
    );
    let mut helped = std::collections::HashSet::new();
    let mut typed = std::collections::HashSet::new();
    let mut samples = 0;
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# HELP ") {
            helped.insert(rest.split_whitespace().next().unwrap().to_owned());
        } else if let Some(rest) = line.strip_prefix("# TYPE ") {
            let mut parts = rest.split_whitespace();
            let name = parts.next().unwrap().to_owned();
            let kind = parts.next().unwrap();
            match kind {
                "counter" => assert!(name.ends_with("_total"), "{line}"),
                "histogram" => assert!(name.ends_with("_seconds"), "{line}"),
                _ => assert_eq!(kind, "gauge", "{line}"),
            }
            typed.insert(name);
        } else {
            let (series, value) = line.rsplit_once(' ').expect("sample line");
            value.parse::<f64>().expect("numeric value");
            let (name, labels) = series.split_once('{').expect("labelled sample");
            assert!(name.starts_with("outbox_"), "{line}");
            assert!(
                labels.starts_with("channel=\"") && labels.ends_with("\"}"),
                "{line}"
            );
            let family = ["_bucket", "_sum", "_count"]
                .iter()
                .find_map(|s| name.strip_suffix(s).filter(|f| typed.contains(*f)))
                .unwrap_or(name);
            assert!(
                typed.contains(family) && helped.contains(family),
                "sample before its HELP/TYPE: {line}"
            );
            samples += 1;
        }
    }
    assert!(
        text.contains("outbox_unacknowledged_dead_letters{channel=\"telegram\"} 1"),
        "{text}"
    );
    assert!(samples >= 15);
    Ok(())
}

#[test]
fn ids_and_times_are_never_wrapped_in_a_table() -> Result<()> {
    let db = TestDb::default();
    let chat = "a-chat-with-a-rather-long-identifier";
    let id = enqueue(&db.outbox, chat, &["hello"]);
    let (code, table) = stdout(outbox(&db.path()).arg("list"));
    assert_eq!(code, 0);
    let row = table
        .lines()
        .find(|l| l.contains(&id.to_string()))
        .unwrap_or_else(|| panic!("the id whole on one line:\n{table}"));
    assert!(
        row.contains("2026-01-01T00:00:00Z"),
        "the time whole:\n{table}"
    );
    Ok(())
}

#[test]
fn show_prints_a_replys_metadata_escaped() -> Result<()> {
    let db = TestDb::default();
    let id = db
        .outbox
        .enqueue(
            &chunked_outbox::NewDelivery::single("telegram", "42", "hi")
                .with_metadata("{\"thread\": 7}\u{1b}[2J"),
        )?
        .id;
    let (code, shown) = stdout(outbox(&db.path()).args(["show", &id.to_string()]));
    assert_eq!(code, 0);
    assert!(
        shown.contains("metadata  {\"thread\": 7}\\u{1b}[2J"),
        "{shown}"
    );
    let (_, json) = stdout(outbox(&db.path()).args(["show", &id.to_string(), "--json"]));
    let v: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert_eq!(v["metadata"], "{\"thread\": 7}\u{1b}[2J");
    Ok(())
}

#[test]
fn list_and_show() -> Result<()> {
    let p = prepared()?;
    let path = p.db.path();
    let (code, table) = stdout(outbox(&path).arg("list"));
    assert_eq!(code, 0);
    assert!(
        table.contains(&p.dead.to_string()) && table.contains("4 deliveries"),
        "{table}"
    );
    let (_, health) = stdout(outbox(&path).args(["health", "--exit-zero"]));
    // The uncertain chunk and the dead letter wait for a human; the expired lease is
    // still the outbox's to settle.
    assert!(
        health.contains("moving chunks      1   awaiting a decision  2"),
        "{health}"
    );

    let (_, json) = stdout(outbox(&path).args(["list", "--status", "failed", "--json"]));
    let v: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert_eq!(v.as_array().unwrap().len(), 1);
    assert_eq!(v[0]["id"], p.dead.to_string());

    let (code, shown) = stdout(outbox(&path).args(["show", &p.dead.to_string()]));
    assert_eq!(code, 0);
    for needle in [
        "failed",
        &format!("a chunk's key is {}:<chunk>", p.dead),
        "chat not found",
        "attempts",
    ] {
        assert!(shown.contains(needle), "missing {needle}:\n{shown}");
    }
    let (_, json) = stdout(outbox(&path).args(["show", &p.delivered.to_string(), "--json"]));
    let v: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert_eq!(v["status"], "delivered");
    assert_eq!(v["chunks"][0]["platform_message_id"], "m1");

    let out = outbox(&path)
        .args(["show", "01890a5d-ac96-774b-bcce-b302099a8057"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(3));
    assert!(String::from_utf8_lossy(&out.stderr).contains("not found"));
    Ok(())
}

#[test]
fn repair_commands() -> Result<()> {
    let p = prepared()?;
    let path = p.db.path();
    let (code, out) = stdout(outbox(&path).args(["requeue", &p.dead.to_string()]));
    assert_eq!((code, out.trim()), (0, "requeued 1 delivery"));
    let (_, out) = stdout(outbox(&path).args(["requeue", "--failed"]));
    assert_eq!(out.trim(), "requeued 0 deliveries");

    // A chunk is named by its key; a bare number (a row of some file) is refused.
    let out = outbox(&path)
        .args(["resolve", "3", "--resend"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(3));
    assert!(String::from_utf8_lossy(&out.stderr).contains("\"3\" is not a chunk key"));
    let chunk = format!("{}:1", p.uncertain);
    let (code, out) =
        stdout(outbox(&path).args(["resolve", &chunk, "--delivered", "--platform-id", "p9"]));
    assert_eq!(code, 0, "{out}");
    assert!(
        out.contains("delivered") && out.contains("finalized"),
        "{out}"
    );
    let out = outbox(&path)
        .args(["resolve", &chunk, "--resend"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(3), "no longer uncertain");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains(&format!("{chunk} is delivered")), "{err}");

    let (_, out) = stdout(outbox(&path).arg("ack-dead-letters"));
    assert_eq!(out.trim(), "dismissed 0 dead letters");
    let (_, out) = stdout(outbox(&path).arg("recover"));
    assert!(
        out.contains("held uncertain 1"),
        "the expired lease of a no-replay channel: {out}"
    );
    let (_, out) = stdout(outbox(&path).args(["purge", "--older-than", "1s"]));
    // Only "ok" finished long ago; "unsure" was finalized just now by `resolve`.
    assert!(out.starts_with("purged 1 delivery (1 chunk)"), "{out}");
    assert_eq!(
        messages_for(&p.db.raw(), p.delivered)?.len(),
        1,
        "messages survive the purge"
    );

    // Usage errors are exit 3 too, never a health verdict.
    assert_eq!(
        outbox(&path)
            .args(["resolve", &chunk])
            .output()
            .unwrap()
            .status
            .code(),
        Some(3)
    );
    Ok(())
}

#[test]
fn cancel_withdraws_an_unstarted_reply_and_refuses_a_started_one() -> Result<()> {
    let db = TestDb::default();
    let sending = enqueue(&db.outbox, "2", &["on its way"]);
    let claim = claim_one(&db.outbox);
    let started = enqueue(&db.outbox, "1", &["already", "going"]);
    db.outbox.ack(&claim_one(&db.outbox), None)?;
    let unstarted = enqueue(&db.outbox, "3", &["withdrawn"]);
    let path = db.path();

    let (code, out) = stdout(outbox(&path).args(["cancel", &unstarted.to_string()]));
    assert_eq!(
        (code, out.trim()),
        (0, format!("delivery {unstarted} is cancelled").as_str())
    );
    let (_, shown) = stdout(outbox(&path).args(["show", &unstarted.to_string()]));
    assert!(
        shown.contains("status    cancelled (0/1 chunks delivered)"),
        "{shown}"
    );
    assert!(shown.contains("nothing of it reached the chat"), "{shown}");
    let (_, listed) = stdout(outbox(&path).args(["list", "--status", "cancelled"]));
    assert!(listed.contains(&unstarted.to_string()), "{listed}");

    let out = outbox(&path)
        .args(["cancel", &started.to_string()])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(3));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains(&format!("delivery {started} is partial; cancel needs")),
        "{err}"
    );
    assert_eq!(
        view(&db.outbox, started).status,
        chunked_outbox::monitoring::DeliveryStatus::Partial
    );
    let out = outbox(&path)
        .args(["cancel", &sending.to_string()])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(3));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains(&format!(
            "its chunk {sending}:1 is sending after 1 send attempt(s)"
        )),
        "{err}"
    );
    assert!(db.outbox.ack(&claim, None)?.finalized, "it goes on");
    Ok(())
}

/// `outbox migrate` on a chat application's database that has its own `messages`
/// history: it succeeds and leaves that table and its rows as they were.
#[test]
fn migrate_leaves_an_applications_history_table_as_it_was() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("app.db");
    let app = rusqlite::Connection::open(&db).unwrap();
    app.execute_batch(APP_HISTORY).unwrap();
    let before = app_history(&app);
    drop(app);
    let out = outbox(&db).arg("migrate").output().unwrap();
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let app = rusqlite::Connection::open(&db).unwrap();
    assert_eq!(app_history(&app), before);
    let version: i64 = app
        .query_row("PRAGMA user_version", [], |r| r.get(0))
        .unwrap();
    assert_eq!(version, chunked_outbox::store::sqlite::SCHEMA_VERSION);
}

#[test]
fn migrate_creates_and_is_idempotent() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("new.db");
    for _ in 0..2 {
        let (code, out) = stdout(outbox(&path).arg("migrate"));
        assert_eq!(code, 0);
        let version = format!(
            "schema version {}",
            chunked_outbox::store::sqlite::SCHEMA_VERSION
        );
        assert!(out.contains(&version), "{out}");
    }
    assert!(path.exists());
}

/// Found: a stop signal left beside `--db` by an earlier run stopped the new run's worker
/// at once; the demo then waited out its ten-minute deadline with 7 of 3,000 replies sent.
#[test]
fn the_demo_refuses_files_an_earlier_run_left_beside_its_database() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("demo.db");
    for left in [
        "demo.platform.stop",
        "demo.platform.db",
        "demo.claimants.log",
    ] {
        std::fs::write(dir.path().join(left), b"").unwrap();
        let out = lab(&db)
            .args(["demo", "--replies", "3", "--chats", "1", "--crashes", "0"])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(3), "{err}");
        assert!(err.contains(left) && err.contains("another --db"), "{err}");
        assert!(!db.exists(), "nothing written");
        std::fs::remove_file(dir.path().join(left)).unwrap();
    }
    // A finished run leaves no stop signal behind, so the next run at a new path is not
    // stopped by it either.
    let out = lab(&db)
        .args(["demo", "--replies", "3", "--chats", "1", "--crashes", "0"])
        .output()
        .unwrap();
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!dir.path().join("demo.platform.stop").exists());
}

#[test]
fn small_demo_proves_the_invariants() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("demo.db");
    let v = json_verdict(lab(&db).args([
        "demo",
        "--json",
        "--replies",
        "300",
        "--chats",
        "30",
        "--crashes",
        "2",
        "--seed",
        "11",
    ]));
    let last = v.to_string();
    for field in [
        "deliveries",
        "chunks",
        "delivered",
        "failed",
        "uncertain_left",
        "elapsed_ms",
    ] {
        assert!(v[field].is_u64(), "{field} missing: {last}");
    }
    assert_eq!(v["deliveries"], 300);
    for zero in [
        "lost",
        "out_of_order",
        "missing_finalizations",
        "wrong_finalizations",
        "unexplained_duplicates",
        "uncertain_left",
    ] {
        assert_eq!(v[zero], 0, "{zero}: {last}");
    }
    assert!(v["max_uncertain_per_kill"].as_u64() <= v["max_sends_in_flight"].as_u64());
    assert!(v["crashes"].as_u64().unwrap() >= 1);
    assert_eq!(
        v["delivered"].as_u64().unwrap() + v["failed"].as_u64().unwrap(),
        300
    );
}

#[test]
fn torture_survives_twenty_kills() {
    let v = json_verdict(lab_without_db().args(["torture", "--kills", "25", "--seed", "17"]));
    let text = v.to_string();
    assert_eq!(v["kills"], 25);
    assert_eq!(v["seed"], 17);
    for zero in [
        "lost",
        "out_of_order",
        "missing_finalizations",
        "wrong_finalizations",
        "unexplained_duplicates",
        "uncertain_left",
    ] {
        assert_eq!(v[zero], 0, "{zero}: {text}");
    }
    let (held, bound) = (
        v["max_uncertain_per_kill"].as_u64(),
        v["max_sends_in_flight"].as_u64(),
    );
    assert!(bound.is_some() && held <= bound, "{text}");
    assert!(v["deliveries"].as_u64().unwrap() >= 100);
}

#[test]
fn contention_reaches_no_caller_and_claims_nothing_twice() {
    let v = json_verdict(lab_without_db().args([
        "stress",
        "--dispatchers",
        "4",
        "--workers",
        "2",
        "--replies",
        "3000",
    ]));
    assert_eq!(v["busy_errors"], 0);
    assert_eq!(v["other_errors"], 0);
    assert_eq!(v["claimed_twice"], 0);
    assert_eq!(v["sent"], 3000);
    println!("contention throughput: {} chunks/s", v["chunks_per_s"]);
}

/// An SQLite file of some other application: a table of its own, rollback journal.
fn foreign_file(dir: &Path) -> std::path::PathBuf {
    let path = dir.join("app.db");
    let conn = rusqlite::Connection::open(&path).unwrap();
    conn.execute_batch(
        "CREATE TABLE orders (id INTEGER PRIMARY KEY, item TEXT);
         INSERT INTO orders (item) VALUES ('tea'), ('cake');",
    )
    .unwrap();
    path
}

/// Found: `outbox --db app.db health` on another application's SQLite file added six
/// tables, set `user_version`, switched the file to WAL and printed `status: ok`.
#[test]
fn read_only_commands_refuse_a_foreign_file_and_leave_it_byte_identical() {
    let dir = tempfile::tempdir().unwrap();
    let path = foreign_file(dir.path());
    let before = std::fs::read(&path).unwrap();
    for args in [
        vec!["health"],
        vec!["health", "--prometheus"],
        vec!["list"],
        vec!["show", "01890a5d-ac96-774b-bcce-b302099a8057"],
        vec!["config", "show", "--json"],
        vec!["purge", "--older-than", "1d", "--dry-run"],
        // Repair commands refuse it too: only `migrate` adds a schema.
        vec!["requeue", "--failed"],
        vec!["recover"],
    ] {
        let out = outbox(&path).args(&args).output().unwrap();
        assert_eq!(out.status.code(), Some(3), "{args:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("not an outbox"), "{args:?}: {err}");
        assert_eq!(
            std::fs::read(&path).unwrap(),
            before,
            "{args:?} changed the file"
        );
    }
    assert!(!dir.path().join("app.db-wal").exists());
}

/// Read-only commands refuse an outbox at an older schema (run `outbox migrate`) and
/// change nothing; repair commands too.
#[test]
fn commands_other_than_migrate_never_upgrade_a_schema() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("v1.db");
    let v1 = rusqlite::Connection::open(&path).unwrap();
    v1.execute_batch(include_str!("../migrations/sqlite/0001_initial.sql"))
        .unwrap();
    v1.execute_batch("PRAGMA user_version = 1").unwrap();
    drop(v1);
    let before = std::fs::read(&path).unwrap();
    for args in [vec!["health"], vec!["recover"], vec!["config", "show"]] {
        let out = outbox(&path).args(&args).output().unwrap();
        assert_eq!(out.status.code(), Some(3), "{args:?}");
        assert!(String::from_utf8_lossy(&out.stderr).contains("run `outbox migrate`"));
        assert_eq!(std::fs::read(&path).unwrap(), before, "{args:?}");
    }
    let (code, out) = stdout(outbox(&path).arg("migrate"));
    assert_eq!(code, 0, "{out}");
    assert_eq!(
        outbox(&path).arg("health").output().unwrap().status.code(),
        Some(0)
    );
}

#[test]
fn config_show_lists_every_stored_rule_and_config_set_changes_them() {
    let db = TestDb::new(chunked_outbox::OutboxOptions::default().with_channel(
        "discord",
        chunked_outbox::rules::ChannelPolicy::replayable(),
    ));
    let _ = enqueue(&db.outbox, "42", &["x"]);
    let path = db.path();
    let (code, json) = stdout(outbox(&path).args(["config", "show", "--json"]));
    assert_eq!(code, 0);
    let v: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert_eq!(v["lane_order"], "fifo");
    assert_eq!(v["lane_failure"], "skip");
    assert_eq!(v["channels"]["discord"]["replay"], "replay");
    assert_eq!(v["channels"]["discord"]["own_rules"], true);
    assert_eq!(v["channels"]["telegram"]["replay"], "hold");
    assert_eq!(v["channels"]["telegram"]["lane_interval_ms"], 0);
    assert_eq!(
        v["channels"]["telegram"]["rate_per_second"],
        serde_json::Value::Null
    );

    let (code, out) = stdout(outbox(&path).args([
        "config",
        "set",
        "--channel",
        "telegram",
        "--lane-interval",
        "1s",
        "--rate",
        "30",
    ]));
    assert_eq!(code, 0, "{out}");
    let (code, out) = stdout(outbox(&path).args(["config", "set", "--lane-order", "parallel"]));
    assert_eq!(code, 0, "{out}");
    // The library reads what the tool stored.
    let policy = db.outbox.rules().unwrap();
    assert_eq!(
        policy.lane_order,
        chunked_outbox::rules::LaneOrder::Parallel
    );
    let telegram = policy.channel("telegram");
    assert_eq!(telegram.lane_interval, Duration::from_secs(1));
    // 30/s is stored as 33,334 µs between sends: rounded so as never to exceed it.
    assert_eq!(telegram.channel_interval, Duration::from_micros(33_334));
    assert_eq!(
        policy.channel("discord").replay,
        chunked_outbox::rules::ReplayPolicy::Replay
    );
    let (_, json) = stdout(outbox(&path).args(["config", "show", "--json"]));
    let v: serde_json::Value = serde_json::from_str(&json).unwrap();
    let rate = v["channels"]["telegram"]["rate_per_second"]
        .as_f64()
        .unwrap();
    assert!((29.0..30.0).contains(&rate), "{rate}");

    let out = outbox(&path)
        .args(["config", "set", "--replay", "replay"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(3), "a channel rule needs a channel");
    assert!(String::from_utf8_lossy(&out.stderr).contains("--channel NAME"));
}

/// The finalization statement is set, shown and removed through the tool, and a
/// statement that cannot run is refused with SQLite's reason, storing nothing.
#[test]
fn config_sets_and_shows_the_finalization_statement() {
    let db = TestDb::default();
    db.raw().execute_batch(APP_HISTORY).unwrap();
    let path = db.path();
    let sql = "INSERT INTO messages (id, chat_id, sender_name, content, timestamp)
               VALUES (:delivery_id, :chat_id, 'bot', :content, :delivered_at_rfc3339)";
    let (code, out) = stdout(outbox(&path).args(["config", "set", "--finalize-sql", sql]));
    assert_eq!(code, 0, "{out}");
    assert!(
        out.contains("finalization   outbound_messages, then: INSERT INTO messages"),
        "{out}"
    );
    assert_eq!(db.outbox.finalization().unwrap().as_deref(), Some(sql));
    let (_, json) = stdout(outbox(&path).args(["config", "show", "--json"]));
    let v: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert_eq!(v["finalize_sql"], sql);

    let out = outbox(&path)
        .args([
            "config",
            "set",
            "--finalize-sql",
            "INSERT INTO nowhere VALUES (:content)",
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(3));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("no such table: nowhere"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        db.outbox.finalization().unwrap().as_deref(),
        Some(sql),
        "kept"
    );

    let (code, out) = stdout(outbox(&path).args(["config", "set", "--no-finalize-sql"]));
    assert_eq!(code, 0, "{out}");
    assert_eq!(db.outbox.finalization().unwrap(), None);
}

/// Found: `purge --older-than 99999999999d` panicked (exit 101); `purge --older-than 0s`
/// removed everything with no way to see first what would go.
#[test]
fn purge_refuses_an_impossible_age_and_previews_with_dry_run() -> Result<()> {
    let p = prepared()?;
    let path = p.db.path();
    let out = outbox(&path)
        .args(["purge", "--older-than", "99999999999d"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(3), "a usage error, not a crash");
    assert!(String::from_utf8_lossy(&out.stderr).contains("further back than any date"));
    let (code, out) = stdout(outbox(&path).args(["purge", "--older-than", "0s", "--dry-run"]));
    assert_eq!(code, 0);
    assert!(out.starts_with("would purge 1 delivery (1 chunk)"), "{out}");
    assert_eq!(
        p.db.outbox.list(&Default::default())?.len(),
        4,
        "nothing removed"
    );
    Ok(())
}

/// Found: `resolve --resend --platform-id x` ignored the id; `requeue` of a delivered
/// delivery answered with a chunk id the user never saw; stored text with terminal
/// escapes was printed raw.
#[test]
fn the_tool_refuses_what_it_would_ignore_and_names_what_it_was_given() -> Result<()> {
    let p = prepared()?;
    let path = p.db.path();
    let key = format!("{}:1", p.uncertain);
    let out = outbox(&path)
        .args(["resolve", &key, "--resend", "--platform-id", "x"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(3));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--platform-id"));

    let out = outbox(&path)
        .args(["requeue", &p.delivered.to_string()])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(3));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains(&p.delivered.to_string()) && err.contains("is delivered"),
        "{err}"
    );

    let out = outbox(&path).args(["show", "not-a-uuid"]).output().unwrap();
    assert!(String::from_utf8_lossy(&out.stderr).contains("\"not-a-uuid\" is not a delivery id"));

    let evil =
        p.db.outbox
            .enqueue(&chunked_outbox::NewDelivery::single(
                "telegram",
                "\u{1b}]0;owned\u{7}",
                "x",
            ))?
            .id;
    let (code, shown) = stdout(outbox(&path).args(["show", &evil.to_string()]));
    assert_eq!(code, 0);
    assert!(!shown.contains('\u{1b}'), "{shown:?}");
    assert!(shown.contains("\\u{1b}]0;owned\\u{7}"), "{shown}");
    Ok(())
}

/// `list --key`, `--channel` on `requeue --failed` and `ack-dead-letters`, and
/// `health --prometheus --exit-zero` for textfile collectors.
#[test]
fn filters_by_caller_key_and_channel_and_a_health_that_exits_zero() -> Result<()> {
    let p = prepared()?;
    let path = p.db.path();
    let keyed =
        p.db.outbox
            .enqueue(
                &chunked_outbox::NewDelivery::single("slack", "C1", "hi")
                    .with_idempotency_key("order-7"),
            )?
            .id;
    let (_, json) = stdout(outbox(&path).args(["list", "--key", "order-7", "--json"]));
    let v: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert_eq!(
        (v.as_array().unwrap().len(), &v[0]["id"]),
        (1, &serde_json::json!(keyed.to_string()))
    );

    let (_, out) = stdout(outbox(&path).args(["dismiss-dead-letters", "--channel", "slack"]));
    assert_eq!(out.trim(), "dismissed 0 dead letters");
    let (_, out) = stdout(outbox(&path).args(["requeue", "--failed", "--channel", "slack"]));
    assert_eq!(out.trim(), "requeued 0 deliveries");
    let (_, out) = stdout(outbox(&path).args(["requeue", "--failed", "--channel", "telegram"]));
    assert_eq!(out.trim(), "requeued 1 delivery");

    let out = outbox(&path)
        .args(["health", "--prometheus", "--exit-zero"])
        .output()
        .unwrap();
    assert_eq!(
        out.status.code(),
        Some(0),
        "the uncertain chunk does not fail the collector"
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("# TYPE outbox_pending_chunks gauge"));
    assert!(String::from_utf8_lossy(&out.stderr).contains("status: fail"));
    Ok(())
}

/// Found: the health table was about 130 columns wide. Every line fits 100 columns,
/// CJK and emoji channel names included (two columns each).
#[test]
fn tables_fit_one_hundred_columns() -> Result<()> {
    let p = prepared()?;
    p.db.outbox.enqueue(&chunked_outbox::NewDelivery::single(
        "ライン通知チャンネル🚀🚀",
        "チャット",
        "x",
    ))?;
    let path = p.db.path();
    for args in [
        vec!["health"],
        vec!["list"],
        vec!["show", &p.dead.to_string()],
        vec!["config", "show"],
    ] {
        let (_, text) = stdout(outbox(&path).args(&args));
        for line in text.lines() {
            let columns: usize = line
                .chars()
                .map(|c| {
                    if matches!(c as u32, 0x3000..=0x9fff | 0xff00..=0xffef | 0x1f300..=0x1faff) {
                        2
                    } else {
                        1
                    }
                })
                .sum();
            assert!(columns <= 100, "{args:?}: {columns} columns: {line}");
        }
    }
    Ok(())
}

/// Found (through the tool): `outbox requeue` on a Parallel application's file stranded
/// the reply; `outbox recover` held a replayable channel's chunk uncertain.
#[test]
fn the_tools_repairs_follow_the_files_rules() -> Result<()> {
    let db = TestDb::new(
        chunked_outbox::OutboxOptions::default()
            .with_lane_order(chunked_outbox::rules::LaneOrder::Parallel)
            .with_channel(
                "discord",
                chunked_outbox::rules::ChannelPolicy::replayable(),
            )
            .with_lease(Duration::from_secs(10)),
    );
    let dead = enqueue(&db.outbox, "c", &["x"]);
    let _live = enqueue(&db.outbox, "c", &["y"]);
    let _ = db
        .outbox
        .enqueue(&chunked_outbox::NewDelivery::single("discord", "d", "z"))?;
    for claim in claim_all(&db.outbox) {
        if claim.delivery_id == dead {
            db.outbox.record(
                &claim,
                Outcome::Permanent {
                    error: "gone".into(),
                },
            )?;
        }
    }
    // The tool's clock is the real one: every lease of the test clock ended long ago.
    let path = db.path();
    let (code, out) = stdout(outbox(&path).args(["requeue", &dead.to_string()]));
    assert_eq!((code, out.trim()), (0, "requeued 1 delivery"));
    assert_eq!(
        view(&db.outbox, dead).status,
        chunked_outbox::monitoring::DeliveryStatus::Pending
    );
    let (_, out) = stdout(outbox(&path).arg("recover"));
    assert!(
        out.contains("retried 1, held uncertain 1"),
        "discord replays, telegram holds: {out}"
    );
    Ok(())
}

/// `outbox serve` answered by a real HTTP client: Prometheus text with counters and a
/// histogram, `/healthz` 200 on a healthy file and 503 with the reason on one with a
/// dead letter, the snapshot as JSON, 404 elsewhere.
#[test]
fn serve_answers_scrapers_and_load_balancers() -> Result<()> {
    let serve = |db: &Path| {
        let serving = common::serve::Serving::start(db, &[]);
        let base = serving.base();
        (serving, base)
    };
    let get = |url: String| {
        let response = reqwest::blocking::get(url).expect("HTTP answer");
        (response.status().as_u16(), response.text().unwrap())
    };

    let healthy = TestDb::default();
    enqueue(&healthy.outbox, "1", &["hello"]);
    healthy.outbox.ack(&claim_one(&healthy.outbox), None)?;
    let (_server, base) = serve(&healthy.path());
    let (status, metrics) = get(format!("{base}/metrics"));
    assert_eq!(status, 200);
    assert!(
        metrics.contains("outbox_file_finalized_total{channel=\"telegram\"} 1"),
        "{metrics}"
    );
    assert!(
        metrics
            .contains("outbox_file_reply_latency_seconds_bucket{channel=\"telegram\",le=\"1\"} 1"),
        "{metrics}"
    );
    assert_eq!(get(format!("{base}/healthz")), (200, "ok\n".to_owned()));
    let (status, json) = get(format!("{base}/health.json"));
    let v: serde_json::Value = serde_json::from_str(&json).expect("JSON");
    assert_eq!((status, v["finalized_total"].as_u64()), (200, Some(1)));
    assert_eq!(get(format!("{base}/nothing-here")).0, 404);

    let p = prepared()?; // a dead letter, an uncertain chunk
    let (_server, base) = serve(&p.db.path());
    let (status, body) = get(format!("{base}/healthz"));
    assert_eq!(status, 503);
    assert!(
        body.starts_with("fail: ") && body.contains("1 unacknowledged dead letters"),
        "{body}"
    );

    // The console, under /console, with its security headers: without a token it shows
    // nothing over TCP, and says how to turn it on.
    let response = reqwest::blocking::get(format!("{base}/console")).expect("HTTP answer");
    assert_eq!(response.status().as_u16(), 403);
    let header = |name: &str| {
        response
            .headers()
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
    };
    let csp = header("content-security-policy").unwrap_or_default();
    assert!(csp.contains("default-src 'none'"), "{csp:?}");
    assert_eq!(header("x-content-type-options").as_deref(), Some("nosniff"));
    let page = response.text().unwrap();
    assert!(page.contains("--console-token-file"), "{page}");
    assert!(!page.contains("telegram"), "{page}");
    assert_eq!(get(format!("{base}/console/nowhere")).0, 404);
    Ok(())
}

/// The tool on a PostgreSQL outbox: a read-only command refuses a schema with no outbox
/// and creates nothing; `migrate` makes one; reads, repairs and the rules work on it as
/// on a file; what only a file has is refused with a message saying so.
#[cfg(feature = "postgres")]
#[test]
fn every_command_works_on_a_postgresql_outbox() -> Result<()> {
    let Some(url) = common::postgres::fresh_schema_url() else {
        return Ok(());
    };
    let db = Path::new(&url);
    let (code, out) = stdout(outbox(db).arg("health"));
    assert_ne!(code, 0, "{out}");
    let tables = |url: &str| {
        let mut client = ::postgres::Client::connect(url, ::postgres::NoTls).unwrap();
        let n: i64 = client
            .query_one(
                "SELECT count(*) FROM pg_tables WHERE schemaname = current_schema()",
                &[],
            )
            .unwrap()
            .get(0);
        n
    };
    assert_eq!(tables(&url), 0, "a read-only command created nothing");

    let (code, out) = stdout(outbox(db).arg("migrate"));
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("PostgreSQL schema version"), "{out}");
    assert!(!out.contains("password"));

    let app = chunked_outbox::Outbox::connect(&url, chunked_outbox::OutboxOptions::default())?;
    let id = enqueue(&app, "7", &["hello"]);
    let failed = enqueue(&app, "8", &["no"]);
    let claims = claim_all(&app);
    for claim in &claims {
        let outcome = if claim.delivery_id == failed {
            Outcome::Permanent {
                error: "blocked".into(),
            }
        } else {
            Outcome::delivered(None)
        };
        app.record(claim, outcome)?;
    }

    // A dead letter nobody acknowledged: health fails (exit 2), and says why.
    let (code, out) = stdout(outbox(db).args(["health", "--json"]));
    assert_eq!(code, 2, "{out}");
    let health: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(health["delivered_deliveries"], 1, "{health}");
    assert_eq!(health["failed_deliveries"], 1, "{health}");
    let (code, out) = stdout(outbox(db).arg("list"));
    assert_eq!(code, 0);
    assert!(out.contains(&id.to_string()) && out.contains(&failed.to_string()));
    let (code, out) = stdout(outbox(db).args(["show", &id.to_string()]));
    assert_eq!(code, 0);
    assert!(out.contains("delivered (1/1 chunks delivered)"), "{out}");
    let (code, out) = stdout(outbox(db).args(["requeue", &failed.to_string()]));
    assert_eq!(code, 0, "{out}");
    assert_eq!(claim_all(&app).len(), 1, "the requeued reply is due again");
    let (code, out) = stdout(outbox(db).args(["config", "set", "--max-attempts", "9"]));
    assert_eq!(code, 0, "{out}");
    assert_eq!(app.rules()?.retry.max_attempts, 9);
    let (code, out) = stdout(outbox(db).args(["purge", "--older-than", "7d", "--dry-run"]));
    assert_eq!(code, 0, "{out}");

    // A read-only handle reads, and a write through it is refused by the server.
    let reader =
        chunked_outbox::Outbox::connect_read_only(&url, chunked_outbox::OutboxOptions::default())?;
    assert_eq!(reader.health()?.totals.total_deliveries, 2);
    let refused = reader.enqueue(&chunked_outbox::NewDelivery::single("telegram", "9", "no"));
    assert!(
        matches!(refused, Err(chunked_outbox::Error::ReadOnly(_))),
        "{refused:?}"
    );

    // A file-only operation says that it does not apply.
    assert!(matches!(
        app.checkpoint(),
        Err(chunked_outbox::Error::Unsupported { .. })
    ));
    Ok(())
}

/// The torture and the demo on PostgreSQL: the outbox in a fresh schema of the server,
/// the world's files in a temporary directory, the same verdict fields as on a file.
#[cfg(feature = "postgres")]
#[test]
fn torture_and_demo_run_on_postgresql() {
    let Some(url) = common::postgres::server_url() else {
        return;
    };
    let db = Path::new(&url);
    let torture = json_verdict(lab(db).args(["torture", "--kills", "8", "--seed", "3"]));
    let demo = json_verdict(lab(db).args(["demo", "--replies", "40", "--json"]));
    for (name, verdict) in [("torture", &torture), ("demo", &demo)] {
        assert!(
            verdict["deliveries"].as_u64().unwrap() > 0,
            "{name}: {verdict}"
        );
        for field in [
            "lost",
            "out_of_order",
            "missing_finalizations",
            "wrong_finalizations",
        ] {
            assert_eq!(verdict[field], 0, "{name}: {verdict}");
        }
    }
    assert_eq!(torture["kills"], 8);
}

#[test]
fn a_channel_asks_its_platform_and_show_prints_what_it_answered() -> Result<()> {
    let db = TestDb::default();
    let (code, _) =
        stdout(outbox(&db.path()).args(["config", "set", "--channel", "slack", "--replay", "ask"]));
    assert_eq!(code, 0);
    let (_, config) = stdout(outbox(&db.path()).args(["config", "show"]));
    assert!(config.contains("ask"), "{config}");
    // The tool's rules are the file's: the dispatcher's outbox holds and asks.
    let ob = db.reopen(chunked_outbox::OutboxOptions::default());
    assert_eq!(
        ob.rules()?.channel("slack").replay,
        chunked_outbox::rules::ReplayPolicy::Ask
    );
    let id = ob
        .enqueue(&chunked_outbox::NewDelivery::single("slack", "C1", "hi"))?
        .id;
    let claim = claim_one(&ob);
    ob.record(
        &claim,
        Outcome::Ambiguous {
            error: "timeout".into(),
        },
    )?;
    let part = ob.possibly_sent("slack", 4)?.remove(0);
    let answer = chunked_outbox::settle::Settlement::hold(
        "conversations.history of C1",
        "internal_error \u{1b}[2J",
    );
    ob.settle(&part, &answer)?;
    let (_, shown) = stdout(outbox(&db.path()).args(["show", &id.to_string()]));
    assert!(
        shown.contains("chunk 1: asked: conversations.history of C1; answered: internal_error \\u{1b}[2J; held for a person"),
        "{shown}"
    );
    Ok(())
}
