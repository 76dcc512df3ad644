//! A PostgreSQL server for tests, and a fresh schema per outbox on it.
//!
//! The server is `DATABASE_URL` when set (CI runs the tests under
//! `scripts/with-postgres`). Otherwise the first test that needs one starts a private
//! throwaway server with that same script, once per test process; it stops when the
//! process ends. Without server binaries the PostgreSQL tests are skipped and say so
//! on the terminal; with `OUTBOX_REQUIRE_POSTGRES` set (as `.ci/run` sets it) they
//! fail instead.
//!
//! Shared by the library's unit tests (`#[path]`) and the integration tests.
#![allow(dead_code)]

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU32, Ordering};

/// The server's URL, or `None` (after saying so once) when there is none.
pub fn server_url() -> Option<String> {
    server().map(|(url, _)| url)
}

/// A shell command that restarts the server as after a crash and returns once it is
/// back (`OUTBOX_PG_RESTART` of `scripts/with-postgres`), if known.
pub fn restart_command() -> Option<String> {
    server().and_then(|(_, restart)| restart)
}

fn server() -> Option<(String, Option<String>)> {
    static SERVER: OnceLock<Option<(String, Option<String>)>> = OnceLock::new();
    SERVER
        .get_or_init(|| match std::env::var("DATABASE_URL") {
            Ok(url) if !url.is_empty() => Some((
                url,
                std::env::var("OUTBOX_PG_RESTART")
                    .ok()
                    .filter(|c| !c.is_empty()),
            )),
            _ => start_server(),
        })
        .clone()
}

/// Starts `scripts/with-postgres` with a command that prints the server's URL and then
/// waits for this process to end; the script then stops the server and removes it.
fn start_server() -> Option<(String, Option<String>)> {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/with-postgres");
    let watch = format!(
        "printf '%s\\n' \"$DATABASE_URL\" \"$OUTBOX_PG_RESTART\"; while kill -0 {} 2>/dev/null; do sleep 0.5; done",
        std::process::id()
    );
    let mut child = Command::new("bash")
        .args([script, "sh", "-c", &watch])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .ok()?;
    let mut out = BufReader::new(child.stdout.take()?);
    let mut line = String::new();
    out.read_line(&mut line).ok()?;
    let url = line.trim().to_owned();
    let mut restart = String::new();
    if !url.is_empty() {
        out.read_line(&mut restart).ok()?;
    }
    let restart = Some(restart.trim().to_owned()).filter(|c| !c.is_empty());
    if url.is_empty() {
        let mut why = String::new();
        if let Some(err) = child.stderr.take() {
            for l in BufReader::new(err).lines().map_while(|l| l.ok()) {
                why.push_str(&l);
                why.push('\n');
            }
        }
        let _ = child.wait();
        skipped(&why);
        return None;
    }
    // The server lives until this process ends; the watcher is not waited for.
    std::mem::forget(child);
    Some((url, restart))
}

/// Says, on the terminal itself (past the test harness's capture), that the
/// PostgreSQL tests do not run; or fails if they must.
fn skipped(why: &str) {
    let message = format!(
        "\n*** PostgreSQL tests SKIPPED: no DATABASE_URL and no server could be started.\n{why}***\n"
    );
    if std::env::var_os("OUTBOX_REQUIRE_POSTGRES").is_some() {
        panic!(
            "{message}OUTBOX_REQUIRE_POSTGRES is set: a test that needs a server may not pass without one"
        );
    }
    let _ = std::io::stderr().write_all(message.as_bytes());
}

/// A URL of a new, empty schema on the server: the outbox connected with it keeps its
/// tables there, apart from every other test's.
pub fn fresh_schema_url() -> Option<String> {
    let schema = fresh_schema()?;
    Some(with_search_path(&server_url()?, &schema))
}

/// The name of a new, empty schema on the server.
pub fn fresh_schema() -> Option<String> {
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let url = server_url()?;
    let schema = format!(
        "t_{}_{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    );
    let mut client = postgres::Client::connect(&url, postgres::NoTls)
        .unwrap_or_else(|e| panic!("connect to the test server {url}: {e}"));
    client
        .batch_execute(&format!("CREATE SCHEMA {schema}"))
        .expect("create the test schema");
    Some(schema)
}

/// `url` whose sessions use `schema`.
pub fn with_search_path(url: &str, schema: &str) -> String {
    let sep = if url.contains('?') { '&' } else { '?' };
    format!("{url}{sep}options=-c%20search_path%3D{schema}")
}
