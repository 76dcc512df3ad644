//! The README's quick start, as a newcomer meets it: the first Rust block of
//! `README.md`, cut out of the page, is built as a project of its own with exactly the
//! dependencies the page's `cargo add` lines name (this checkout standing in for the
//! published crate), and run against an emulated Telegram Bot API. If the page's example
//! stops compiling, or stops delivering, this fails: the page cannot rot.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::emulator;
use serde_json::json;

const TOKEN: &str = "123:README";
const CHAT: &str = "4242";
const README: &str = include_str!("../README.md");

/// The fenced blocks of `markdown` whose info string starts with `lang`, in order.
fn blocks<'a>(markdown: &'a str, lang: &str) -> Vec<&'a str> {
    let mut found = Vec::new();
    let mut rest = markdown;
    while let Some(start) = rest.find("\n```") {
        let after = &rest[start + 4..];
        let Some(info_end) = after.find('\n') else {
            break;
        };
        let info = &after[..info_end];
        let body = &after[info_end + 1..];
        let Some(end) = body.find("\n```") else { break };
        if info.split(',').next() == Some(lang) {
            found.push(&body[..end + 1]);
        }
        rest = &body[end + 4..];
    }
    found
}

/// `[dependencies]` for the `cargo add` lines of the README's first block that has any:
/// each line names one crate, with `--features a,b` and `--no-default-features`.
fn dependencies(readme: &str) -> String {
    let adds = blocks(readme, "sh")
        .into_iter()
        .find(|b| b.contains("cargo add "))
        .expect("the README says what to `cargo add`");
    let mut toml = String::from("[dependencies]\n");
    for line in adds.lines().filter(|l| l.starts_with("cargo add ")) {
        let words: Vec<&str> = line["cargo add ".len()..].split_whitespace().collect();
        let name = words[0];
        assert!(
            !name.starts_with('-'),
            "one crate per `cargo add` line: {line}"
        );
        let mut features = Vec::new();
        let mut default_features = true;
        let mut i = 1;
        while i < words.len() {
            match words[i] {
                "--features" => {
                    features.extend(words[i + 1].split(',').map(|f| format!("{f:?}")));
                    i += 1;
                }
                "--no-default-features" => default_features = false,
                other => panic!("an option this check does not know: {other} in {line}"),
            }
            i += 1;
        }
        let source = if name == "chunked-outbox" {
            format!("path = {:?}", env!("CARGO_MANIFEST_DIR"))
        } else {
            "version = \"*\"".to_owned()
        };
        toml += &format!(
            "{name} = {{ {source}, default-features = {default_features}, features = [{}] }}\n",
            features.join(", ")
        );
    }
    toml
}

/// What the emulated Bot API accepted: (chat, text), in arrival order.
type Sent = Mutex<Vec<(String, String)>>;

fn answer(request: tiny_http::Request, sent: &Sent) {
    let Some((request, _, chat, text)) = emulator::telegram_send(request, TOKEN) else {
        return;
    };
    if text.encode_utf16().count() > 4096 {
        let long = json!({"ok": false, "error_code": 400, "description": "Bad Request: message is too long"});
        return emulator::respond(request, 400, &long.to_string(), &[]);
    }
    let id = {
        let mut sent = sent.lock().unwrap();
        sent.push((chat.clone(), text.clone()));
        sent.len()
    };
    let message = json!({"ok": true, "result": {
        "message_id": id, "date": 0, "chat": {"id": chat.parse::<i64>().unwrap_or(0), "type": "private"},
        "text": text,
    }});
    emulator::respond(request, 200, &message.to_string(), &[]);
}

/// Runs `command` to its end, or fails the test after `limit`.
fn run(command: &mut Command, limit: Duration) -> std::process::Output {
    let mut child = command
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("start");
    let start = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if start.elapsed() > limit {
            let _ = child.kill();
            panic!("{command:?} did not finish in {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    child.wait_with_output().unwrap()
}

/// The quick start's outbox, and what its "same API" table says to write instead for
/// PostgreSQL (the server from `DATABASE_URL`).
const OPEN: &str = r#"Outbox::open("replies.db", OutboxOptions::default())?"#;
const CONNECT: &str =
    r#"Outbox::connect(&std::env::var("DATABASE_URL")?, OutboxOptions::default())?"#;

/// Builds the quick start as its own project — with `postgres`, its outbox swapped for
/// a PostgreSQL one and the crate's `postgres` feature added — and returns the binary.
fn build_quick_start(project: &Path, postgres: bool) -> PathBuf {
    let mut example = blocks(README, "rust")
        .into_iter()
        .next()
        .expect("a Rust block")
        .to_owned();
    let mut dependencies = dependencies(README);
    if postgres {
        assert!(example.contains(OPEN), "the quick start opens {OPEN}");
        example = example.replace(OPEN, CONNECT);
        let line = dependencies
            .lines()
            .find(|l| l.starts_with("chunked-outbox = "))
            .expect("the crate's own line")
            .to_owned();
        dependencies = dependencies.replace(
            &line,
            &line.replace("features = [", "features = [\"postgres\", "),
        );
    }
    std::fs::create_dir_all(project.join("src")).unwrap();
    std::fs::write(project.join("src/main.rs"), example).unwrap();
    std::fs::write(
        project.join("Cargo.toml"),
        format!(
            "[package]\nname = \"readme-quick-start\"\nversion = \"0.0.0\"\nedition = \"2024\"\npublish = false\n\n[workspace]\n\n{dependencies}",
        ),
    )
    .unwrap();
    // This checkout's lock file, so the project builds with the versions CI tested.
    std::fs::copy(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("Cargo.lock"),
        project.join("Cargo.lock"),
    )
    .unwrap();
    let target = Path::new(env!("CARGO_TARGET_TMPDIR")).join(if postgres {
        "readme-quick-start-postgres"
    } else {
        "readme-quick-start"
    });
    let built = run(
        Command::new(env!("CARGO"))
            .args(["build", "--quiet", "--manifest-path"])
            .arg(project.join("Cargo.toml"))
            .env("CARGO_TARGET_DIR", &target),
        Duration::from_secs(1200),
    );
    assert!(
        built.status.success(),
        "the README's quick start does not build:\n{}",
        String::from_utf8_lossy(&built.stderr)
    );
    target.join("debug/readme-quick-start")
}

#[test]
fn the_readme_quick_start_builds_and_delivers_its_reply_once() {
    let project = tempfile::tempdir().unwrap();
    let binary = build_quick_start(project.path(), false);
    let history = |project: &Path| {
        let db = rusqlite::Connection::open(project.join("replies.db")).unwrap();
        db.query_row(
            "SELECT count(*), max(content), max(chunk_count) FROM outbound_messages",
            [],
            |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)),
        )
        .unwrap()
    };
    delivers_its_reply_once(project.path(), &binary, &[], history);
}

/// The same on PostgreSQL, as the README's "same API" table invites: `Outbox::connect`
/// in `#[tokio::main]`, used and dropped there.
#[cfg(feature = "postgres")]
#[test]
fn the_readme_quick_start_runs_on_postgresql() {
    let url = common::postgres::fresh_schema_url().expect("the PostgreSQL test server");
    let project = tempfile::tempdir().unwrap();
    let binary = build_quick_start(project.path(), true);
    let history = |_: &Path| {
        let mut db = postgres::Client::connect(&url, postgres::NoTls).unwrap();
        let r = db
            .query_one(
                "SELECT count(*), max(content), max(chunk_count)::int8 FROM outbound_messages",
                &[],
            )
            .unwrap();
        (r.get(0), r.get(1), r.get(2))
    };
    delivers_its_reply_once(project.path(), &binary, &[("DATABASE_URL", &url)], history);
}

/// Runs the quick start twice against the emulated Bot API: the reply arrives in parts,
/// in order, is the one row of the history, and the second run sends nothing.
fn delivers_its_reply_once(
    project: &Path,
    binary: &Path,
    env: &[(&str, &str)],
    history: impl Fn(&Path) -> (i64, String, i64),
) {
    let sent: Arc<Sent> = Arc::default();
    let api = format!("{}/", emulator::serve(sent.clone(), answer));
    let quick_start = || {
        let out = run(
            Command::new(binary)
                .current_dir(project)
                .envs(env.iter().copied())
                .env("TELOXIDE_TOKEN", TOKEN)
                .env("TELOXIDE_API_URL", &api)
                .env("CHAT_ID", CHAT),
            Duration::from_secs(60),
        );
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(
            out.status.success(),
            "{stdout}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        stdout
    };

    let stdout = quick_start();
    assert!(stdout.starts_with("delivered "), "{stdout}");
    let received = sent.lock().unwrap().clone();
    assert!(received.len() >= 2, "a reply split in parts: {received:?}");
    assert!(
        received.iter().all(|(chat, _)| chat == CHAT),
        "{received:?}"
    );

    // What the chat shows, in order, is the reply the history holds, once.
    let (rows, content, parts) = history(project);
    assert_eq!(rows, 1);
    assert_eq!(parts as usize, received.len());
    let shown: String = received.iter().map(|(_, text)| text.as_str()).collect();
    let words = |s: &str| s.split_whitespace().map(str::to_owned).collect::<Vec<_>>();
    assert_eq!(
        words(&shown),
        words(&content),
        "the parts, in order, are the reply"
    );

    // Run again, as after a restart: the same update is stored once and sent once.
    quick_start();
    assert_eq!(
        sent.lock().unwrap().len(),
        received.len(),
        "nothing sent twice"
    );
}
