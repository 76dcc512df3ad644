//! The `outbox` binary on prepared databases: every subcommand, exit statuses for
//! monitoring, parseable `--json` and Prometheus output, read-only commands that never
//! create a file, and a small `demo --json` and `torture` whose verdicts hold (nothing
//! lost, nothing out of order, every finalization present and right, no duplicate
//! nobody decided on, no crash leaving more uncertain than it had in flight).

mod common;

use std::path::Path;

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
    uncertain_chunk: chunked_outbox::ChunkId,
}

fn prepared() -> Result<Prepared> {
    let db = TestDb::default();
    let ob = &db.outbox;
    let delivered = enqueue(ob, "ok", &["fine"]);
    let dead = enqueue(ob, "gone", &["x"]);
    let _ = enqueue(ob, "unsure", &["y"]);
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
        uncertain_chunk: by_chat("unsure").chunk_id,
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
        vec!["ack-dead-letters"],
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
    let mut helped = std::collections::HashSet::new();
    let mut typed = std::collections::HashSet::new();
    let mut samples = 0;
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# HELP ") {
            helped.insert(rest.split_whitespace().next().unwrap().to_owned());
        } else if let Some(rest) = line.strip_prefix("# TYPE ") {
            let mut parts = rest.split_whitespace();
            typed.insert(parts.next().unwrap().to_owned());
            assert_eq!(parts.next(), Some("gauge"));
        } else {
            let (series, value) = line.rsplit_once(' ').expect("sample line");
            value.parse::<f64>().expect("numeric value");
            let (name, labels) = series.split_once('{').expect("labelled sample");
            assert!(name.starts_with("outbox_"), "{line}");
            assert!(
                labels.starts_with("channel=\"") && labels.ends_with("\"}"),
                "{line}"
            );
            assert!(
                typed.contains(name) && helped.contains(name),
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
fn list_and_show() -> Result<()> {
    let p = prepared()?;
    let path = p.db.path();
    let (code, table) = stdout(outbox(&path).arg("list"));
    assert_eq!(code, 0);
    assert!(
        table.contains(&p.dead.to_string()) && table.contains("4 deliveries"),
        "{table}"
    );

    let (_, json) = stdout(outbox(&path).args(["list", "--status", "failed", "--json"]));
    let v: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert_eq!(v.as_array().unwrap().len(), 1);
    assert_eq!(v[0]["id"], p.dead.to_string());

    let (code, shown) = stdout(outbox(&path).args(["show", &p.dead.to_string()]));
    assert_eq!(code, 0);
    for needle in [
        "failed",
        &format!("{}:1", p.dead),
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

    let chunk = p.uncertain_chunk.to_string();
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
    assert!(String::from_utf8_lossy(&out.stderr).contains("needs uncertain"));

    let (_, out) = stdout(outbox(&path).arg("ack-dead-letters"));
    assert_eq!(out.trim(), "acknowledged 0 dead letters");
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
fn migrate_creates_and_is_idempotent() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("new.db");
    for _ in 0..2 {
        let (code, out) = stdout(outbox(&path).arg("migrate"));
        assert_eq!(code, 0);
        let version = format!("schema version {}", chunked_outbox::SCHEMA_VERSION);
        assert!(out.contains(&version), "{out}");
    }
    assert!(path.exists());
}

#[test]
fn small_demo_proves_the_invariants() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("demo.db");
    let v = json_verdict(outbox(&db).args([
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
        "uncertain",
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
        "duplicates_unexplained",
        "uncertain",
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
    let v = json_verdict(outbox_without_db().args(["torture", "--kills", "25", "--seed", "17"]));
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
    let v = json_verdict(outbox_without_db().args([
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
