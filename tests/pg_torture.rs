//! The torture on PostgreSQL with the server's own faults: two dispatcher processes, a
//! producer and a maintenance process are SIGKILLed and restarted, while the server
//! ends all their connections (`pg_terminate_backend`) and is itself restarted as
//! after a crash (`pg_ctl restart -m immediate`). The verdict is the torture's:
//! nothing lost, order kept, every finalization once and right, no duplicate nobody
//! decided on, no kill leaving more uncertain than it had in flight, everything
//! settled.
//!
//! Alone in its test binary: a restart of the server ends every other test's
//! connections too.

mod common;

use std::path::Path;

use assert_cmd::Command;

#[test]
fn torture_holds_through_connection_kills_and_server_restarts() {
    torture_with(None);
}

/// The same with one dispatcher process's clock 2 minutes ahead (300 leases of the
/// torture's 400 ms) ...
#[test]
fn torture_holds_with_a_dispatcher_host_two_minutes_ahead() {
    torture_with(Some("2m"));
}

/// ... and 2 minutes behind.
#[test]
fn torture_holds_with_a_dispatcher_host_two_minutes_behind() {
    torture_with(Some("-2m"));
}

fn torture_with(skew: Option<&str>) {
    // One run at a time: each restarts the one test server.
    static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let Some(url) = common::postgres::server_url() else {
        return;
    };
    let restart = common::postgres::restart_command().expect(
        "the test server was started by scripts/with-postgres, which says how to restart it",
    );
    let out = Command::cargo_bin("outbox-lab")
        .unwrap()
        .arg("--db")
        .arg(Path::new(&url))
        .env_remove("OUTBOX_DB")
        .args([
            "torture",
            "--kills",
            "20",
            "--seed",
            "5",
            "--connection-kills",
            "10",
            "--server-restarts",
            "2",
            "--restart-command",
            &restart,
        ])
        .args(skew.map(|s| format!("--skew={s}")))
        .output()
        .unwrap();
    let verdict = common::clean_torture_verdict(&out);
    assert!(verdict["max_uncertain_per_kill"].as_u64() <= verdict["max_sends_in_flight"].as_u64());
    assert_eq!(verdict["kills"], 20);
    assert_eq!(verdict["server_restarts"], 2);
    assert!(
        verdict["connections_killed"].as_u64().unwrap() > 0,
        "{verdict}"
    );
    assert!(verdict["deliveries"].as_u64().unwrap() > 0, "{verdict}");
}
