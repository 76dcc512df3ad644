//! Every verdict of the torture and the demo can fail: each planted fault (feature
//! `sabotage`, chosen by `OUTBOX_SABOTAGE`; see `src/sabotage.rs`) breaks one promise in
//! the code that keeps it, and a short torture and a small demo of the real `outbox-lab`
//! tool must each report it in their verdict and exit non-zero. A fault that goes
//! unnoticed fails this test, so a verifier cannot rot unseen.

use std::process::Command;

use serde_json::Value;

/// Runs `outbox-lab <args>` with `fault` planted; the exit code and the last line (the
/// verdict, JSON).
fn run(fault: &str, args: &[&str]) -> (Option<i32>, Value) {
    let out = Command::new(env!("CARGO_BIN_EXE_outbox-lab"))
        .args(args)
        .env_remove("OUTBOX_DB")
        .env("OUTBOX_SABOTAGE", fault)
        .output()
        .expect("run the outbox tool");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let last = stdout.lines().last().unwrap_or_default();
    let verdict = serde_json::from_str(last).unwrap_or_else(|e| {
        panic!(
            "{fault}: no verdict ({e}): {stdout}\n{}",
            String::from_utf8_lossy(&out.stderr)
        )
    });
    (out.status.code(), verdict)
}

/// Whether `verdict` reports `fault`: both harnesses name each verdict as the fault
/// that must trip it, so one name serves the demo and the torture.
fn caught(fault: &str, verdict: &Value) -> bool {
    let n = |name: &str| verdict[name].as_u64();
    if fault == "max_uncertain_per_kill" {
        return n("max_uncertain_per_kill") > n("max_sends_in_flight");
    }
    n(fault).is_some_and(|v| v > 0)
}

/// The torture's arguments, with `kills` kills.
fn torture(kills: &str) -> [&str; 7] {
    [
        "torture",
        "--kills",
        kills,
        "--seed",
        "5",
        "--settle-timeout",
        "20s",
    ]
}

/// Runs `harness` (`args`) with `fault` planted: its verdict must report the fault and
/// its exit code say it failed. Returns the verdict.
fn assert_reported(harness: &str, fault: &str, args: &[&str]) -> Value {
    let (code, verdict) = run(fault, args);
    assert!(
        caught(fault, &verdict),
        "{harness} missed the planted fault {fault}: {verdict}"
    );
    assert!(
        code.is_some_and(|c| c != 0),
        "{harness} reported {fault} but exited {code:?}: {verdict}"
    );
    verdict
}

fn check(fault: &str) {
    // Two faults show only when a kill lands at the right moment: while a dispatcher
    // holds more sends than its bound, or while it holds a part of a channel the
    // operator cannot ask about, which the operator then resends blind (the dispatchers'
    // settlers settle the others first, faster on a fast machine). Both are likelier
    // with more kills, which a busy machine (the other faults' runs beside this one)
    // needs too.
    let (kills, crashes) = if fault == "max_uncertain_per_kill" || fault == "uncertain_left" {
        ("90", "6")
    } else {
        ("30", "2")
    };
    assert_reported("torture", fault, &torture(kills));
    assert_reported(
        "demo",
        fault,
        &[
            "demo",
            "--json",
            "--replies",
            "600",
            "--chats",
            "60",
            "--crashes",
            crashes,
            "--seed",
            "3",
            "--settle-timeout",
            "20s",
        ],
    );
}

/// The dead letters' counts, kept by SQLite's writers: a short torture, which makes
/// dead letters (replies to chats that no longer exist) and lists them as an operator
/// does, must report the counts it plants wrong. A run that made no dead letter would
/// prove nothing, so it fails too.
#[test]
fn dead_letters_miscounted() {
    let fault = "dead_letters_miscounted";
    assert_eq!(chunked_outbox::sabotage::COUNT_FAULTS, [fault]);
    let verdict = assert_reported("torture", fault, &torture("30"));
    assert!(
        verdict["dead_letters"].as_u64() > Some(0),
        "the run made no dead letter to count: {verdict}"
    );
}

macro_rules! faults {
    ($($fault:ident),* $(,)?) => {
        $(#[test] fn $fault() { check(stringify!($fault)) })*

        /// Every planted fault has its test above.
        #[test]
        fn every_fault_is_checked() {
            assert_eq!(chunked_outbox::sabotage::FAULTS, [$(stringify!($fault)),*]);
        }
    };
}

faults!(
    lost,
    out_of_order,
    unexplained_duplicates,
    missing_finalizations,
    wrong_finalizations,
    max_uncertain_per_kill,
    uncertain_left,
    unexpected_dead_letters,
);
