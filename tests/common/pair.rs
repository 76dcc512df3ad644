//! A PostgreSQL primary with a synchronous hot standby of its own (`scripts/pg-pair`),
//! for failover tests: each test gets a pair it may crash, fence and promote.
//!
//! Without server binaries the pair tests are skipped and say so on the terminal; with
//! `OUTBOX_REQUIRE_POSTGRES` set (as `.ci/run` sets it) they fail instead.

use std::process::Command;

/// A primary (node `a` at first) and its standby (`b`), removed when dropped.
pub struct Pair {
    pub dir: String,
    /// The key-value connection string naming both nodes, writes on the primary
    /// (`target_session_attrs=read-write`).
    pub url: String,
    /// Each node alone, `[a, b]`.
    pub nodes: [String; 2],
}

const SCRIPT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/pg-pair");

impl Pair {
    /// A new pair, or `None` (after saying so) when this machine cannot make one.
    pub fn new() -> Option<Pair> {
        let out = Command::new("bash")
            .args([SCRIPT, "new", &std::process::id().to_string()])
            .output()
            .expect("run scripts/pg-pair");
        let stdout = String::from_utf8_lossy(&out.stdout);
        let lines: Vec<&str> = stdout.lines().collect();
        if !out.status.success() || lines.len() < 4 {
            let why = format!(
                "\n*** PostgreSQL failover tests SKIPPED: scripts/pg-pair could not make a pair.\n{}***\n",
                String::from_utf8_lossy(&out.stderr)
            );
            if std::env::var_os("OUTBOX_REQUIRE_POSTGRES").is_some() {
                panic!(
                    "{why}OUTBOX_REQUIRE_POSTGRES is set: a test that needs a server may not pass without one"
                );
            }
            eprint!("{why}");
            return None;
        }
        Some(Pair {
            dir: lines[0].to_owned(),
            url: lines[1].to_owned(),
            nodes: [lines[2].to_owned(), lines[3].to_owned()],
        })
    }

    /// Runs an action of `scripts/pg-pair` on the pair (`crash-primary`, `promote`…).
    pub fn act(&self, action: &[&str]) {
        let out = Command::new("bash")
            .arg(SCRIPT)
            .arg(&self.dir)
            .args(action)
            .output()
            .expect("run scripts/pg-pair");
        assert!(
            out.status.success(),
            "pg-pair {action:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// A shell command running `action` on the pair (for the torture's
    /// `--restart-command`).
    pub fn command(&self, action: &str) -> String {
        format!("bash {SCRIPT} {} {action}", self.dir)
    }

    /// The node that is primary now (0 for `a`, 1 for `b`).
    pub fn primary(&self) -> usize {
        let out = Command::new("bash")
            .args([SCRIPT, &self.dir, "primary"])
            .output()
            .expect("run scripts/pg-pair");
        usize::from(String::from_utf8_lossy(&out.stdout).trim() == "b")
    }

    /// A direct connection to node `i`.
    pub fn admin(&self, i: usize) -> postgres::Client {
        postgres::Client::connect(&self.nodes[i], postgres::NoTls)
            .unwrap_or_else(|e| panic!("connect to node {i}: {e}"))
    }
}

impl Drop for Pair {
    fn drop(&mut self) {
        let _ = Command::new("bash")
            .args([SCRIPT, &self.dir, "remove"])
            .output();
    }
}
