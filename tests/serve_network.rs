//! `outbox serve` as an attacker on the network, or a web page in the operator's browser,
//! meets it: the review's items 1 to 9, each from outside, in raw HTTP on 127.0.0.1
//! (bounded in count and time). The console's own checks, one by one, are in
//! `src/console/tests.rs`; item 10 (pages that cost what they show) is
//! `examples/console_scale.rs`.

mod common;

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use chunked_outbox::monitoring::DeliveryStatus;
use chunked_outbox::{DeliveryId, Outcome};
use common::serve::Serving;
use common::*;

const TOKEN: &str = "b7f3e0c2a91d4e6f8a0b1c2d3e4f5a6b";
const SECRET: &str = "the secret reply text";

/// An outbox with a dead letter whose text is [`SECRET`].
fn outbox_with_a_dead_letter() -> (TestDb, DeliveryId) {
    let db = TestDb::default();
    let id = enqueue(&db.outbox, "chat-7", &[SECRET]);
    let claim = claim_one(&db.outbox);
    db.outbox
        .record(
            &claim,
            Outcome::Permanent {
                error: "Forbidden: bot was blocked by the user".into(),
            },
        )
        .unwrap();
    (db, id)
}

/// A token file readable by its owner only (or with `mode`).
fn token_file(db: &TestDb, mode: u32) -> PathBuf {
    let path = db.dir.path().join("console-token");
    std::fs::write(&path, format!("{TOKEN}\n")).unwrap();
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).unwrap();
    }
    path
}

fn serve(db: &Path, listen: &str, extra: &[&str]) -> Serving {
    let extra: Vec<&std::ffi::OsStr> = extra.iter().map(std::ffi::OsStr::new).collect();
    Serving::listening(db, listen, &extra, Stdio::inherit())
}

fn with_token(db: &TestDb) -> (Serving, PathBuf) {
    let file = token_file(db, 0o600);
    let serving = serve(
        &db.path(),
        "127.0.0.1:0",
        &["--console-token-file", file.to_str().unwrap()],
    );
    (serving, file)
}

fn status(answer: &str) -> u16 {
    answer
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no status in {answer:?}"))
}

fn header(answer: &str, name: &str) -> Option<String> {
    let head = answer.split("\r\n\r\n").next().unwrap_or_default();
    head.lines().skip(1).find_map(|line| {
        let (n, v) = line.split_once(':')?;
        n.eq_ignore_ascii_case(name).then(|| v.trim().to_owned())
    })
}

/// `GET path` under `Host: host`, with `cookie` if any.
fn get(s: &Serving, path: &str, host: &str, cookie: Option<&str>) -> String {
    let cookie = cookie.map_or(String::new(), |c| format!("Cookie: {c}\r\n"));
    s.raw(&format!(
        "GET {path} HTTP/1.1\r\nHost: {host}\r\n{cookie}Connection: close\r\n\r\n"
    ))
}

/// `POST path` of `form` under `Host: host`, with the extra header lines `extra`.
fn post(s: &Serving, path: &str, host: &str, extra: &str, form: &str) -> String {
    s.raw(&format!(
        "POST {path} HTTP/1.1\r\nHost: {host}\r\n{extra}Content-Type: application/x-www-form-urlencoded\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{form}",
        form.len()
    ))
}

fn form_token(page: &str) -> String {
    let at = page.find("name=\"csrf\" value=\"").expect("a form token") + 19;
    page[at..at + 32].to_owned()
}

/// Signs in as a browser on the console's own origin would: the cookie (`name=value`)
/// and the session's form token.
fn sign_in(s: &Serving, host: &str) -> (String, String) {
    let form = get(s, "/console/sign-in", host, None);
    assert_eq!(status(&form), 200, "{form}");
    let signed = post(
        s,
        "/console/sign-in",
        host,
        &format!("Origin: http://{host}\r\n"),
        &format!("csrf={}&token={TOKEN}", form_token(&form)),
    );
    assert_eq!(status(&signed), 303, "{signed}");
    let cookie = header(&signed, "Set-Cookie").expect("a session cookie");
    let cookie = cookie.split(';').next().unwrap().to_owned();
    let page = get(s, "/console", host, Some(&cookie));
    assert_eq!(status(&page), 200, "{page}");
    (cookie, form_token(&page))
}

fn delivery_status(db: &TestDb, id: DeliveryId) -> DeliveryStatus {
    db.outbox.delivery(id).unwrap().unwrap().status
}

/// Item 1: under a name that is not its own (a rebinding page's), nothing is answered:
/// not the console, not the metrics, not the snapshot. Its own names are.
#[test]
fn another_host_name_reads_nothing() {
    let (db, id) = outbox_with_a_dead_letter();
    let s = serve(&db.path(), "127.0.0.1:0", &[]);
    let rebound = format!("rebind.example:{}", s.port());
    for path in [
        format!("/console/deliveries/{id}?text=1"),
        "/console/dead-letters".into(),
        "/metrics".into(),
        "/health.json".into(),
        "/healthz".into(),
    ] {
        let answer = get(&s, &path, &rebound, None);
        assert_eq!(status(&answer), 421, "{path}: {answer}");
        assert!(
            !answer.contains(SECRET) && !answer.contains("chat-7"),
            "{answer}"
        );
    }
    let no_host = s.raw("GET /metrics HTTP/1.0\r\n\r\n");
    assert_eq!(status(&no_host), 421, "{no_host}");
    for own in [
        format!("127.0.0.1:{}", s.port()),
        format!("localhost:{}", s.port()),
    ] {
        let page = get(&s, &format!("/console/deliveries/{id}?text=1"), &own, None);
        assert_eq!(status(&page), 200, "{own}");
        assert!(page.contains(SECRET));
    }
    // Another port of the loopback is another server.
    let other_port = get(&s, "/metrics", "localhost:1", None);
    assert_eq!(status(&other_port), 421);
    // A name the operator allowed, for a reverse proxy.
    let named = serve(
        &db.path(),
        "127.0.0.1:0",
        &["--allowed-host", "outbox.ops.example"],
    );
    assert_eq!(
        status(&get(&named, "/metrics", "outbox.ops.example", None)),
        200
    );
}

/// Item 2: with a token, no page but the sign-in form and the style sheet is read
/// without signing in.
#[test]
fn with_a_token_no_page_is_read_without_the_sign_in() {
    let (db, id) = outbox_with_a_dead_letter();
    let (s, _file) = with_token(&db);
    let host = format!("127.0.0.1:{}", s.port());
    for path in [
        format!("/console/deliveries/{id}?text=1"),
        "/console".into(),
        "/console/dead-letters".into(),
        "/console/deliveries?id=chat-7".into(),
    ] {
        let answer = get(&s, &path, &host, None);
        assert_eq!(status(&answer), 303, "{path}: {answer}");
        assert_eq!(
            header(&answer, "Location").as_deref(),
            Some("/console/sign-in")
        );
        assert!(!answer.contains(SECRET) && !answer.contains("chat-7"));
        assert!(!answer.contains("bot was blocked"));
    }
    assert_eq!(status(&get(&s, "/console/style.css", &host, None)), 200);
    let (cookie, _) = sign_in(&s, &host);
    let page = get(
        &s,
        &format!("/console/deliveries/{id}?text=1"),
        &host,
        Some(&cookie),
    );
    assert!(page.contains(SECRET), "{page}");
}

/// Item 3: on a non-loopback address the console is not mounted unless asked for, and
/// then only with a token; `--no-console` leaves only the metrics anywhere.
#[test]
fn a_public_address_mounts_no_console_unless_asked_with_a_token() {
    let (db, _) = outbox_with_a_dead_letter();
    let s = serve(&db.path(), "0.0.0.0:0", &[]);
    assert!(s.banner.contains("no console"), "{}", s.banner);
    let host = format!("127.0.0.1:{}", s.port());
    assert_eq!(status(&get(&s, "/console", &host, None)), 404);
    assert_eq!(status(&get(&s, "/console/dead-letters", &host, None)), 404);
    let metrics = get(&s, "/metrics", &host, None);
    assert_eq!(status(&metrics), 200);
    // Any address of the machine is its own; a name is not.
    assert_eq!(
        status(&get(
            &s,
            "/metrics",
            &format!("10.1.2.3:{}", s.port()),
            None
        )),
        200
    );
    assert_eq!(
        status(&get(
            &s,
            "/metrics",
            &format!("rebind.example:{}", s.port()),
            None
        )),
        421
    );

    let refused = std::process::Command::new(assert_cmd::cargo::cargo_bin("outbox"))
        .arg("--db")
        .arg(db.path())
        .args(["serve", "--listen", "0.0.0.0:0", "--expose-console"])
        .env_remove("OUTBOX_CONSOLE_TOKEN_FILE")
        .output()
        .unwrap();
    assert!(!refused.status.success());
    let said = String::from_utf8_lossy(&refused.stderr);
    assert!(
        said.contains("--expose-console needs --console-token-file"),
        "{said}"
    );

    let file = token_file(&db, 0o600);
    let exposed = serve(
        &db.path(),
        "0.0.0.0:0",
        &[
            "--expose-console",
            "--console-token-file",
            file.to_str().unwrap(),
        ],
    );
    assert!(
        exposed.banner.contains("behind the sign-in"),
        "{}",
        exposed.banner
    );
    let host = format!("127.0.0.1:{}", exposed.port());
    let page = get(&exposed, "/console/dead-letters", &host, None);
    assert_eq!(status(&page), 303);
    assert!(!page.contains("bot was blocked"));

    let metrics_only = serve(&db.path(), "127.0.0.1:0", &["--no-console"]);
    let host = format!("127.0.0.1:{}", metrics_only.port());
    assert_eq!(status(&get(&metrics_only, "/console", &host, None)), 404);
    assert_eq!(status(&get(&metrics_only, "/healthz", &host, None)), 503);
}

/// Items 4 and 5: a form posted from another origin of the same host (another port:
/// same site, so the cookie goes along) is refused with the right form token; the
/// cookie is a session's id, and signing out ends it.
#[test]
fn a_form_from_another_origin_is_refused_and_sign_out_ends_the_session() {
    let (db, id) = outbox_with_a_dead_letter();
    let (s, _file) = with_token(&db);
    let host = format!("localhost:{}", s.port());
    let (cookie, csrf) = sign_in(&s, &host);
    assert!(!cookie.contains(TOKEN), "{cookie}");
    let form = format!("csrf={csrf}&delivery={id}");
    for extra in [
        "Origin: http://localhost:8000\r\n".to_owned(),
        "Sec-Fetch-Site: same-site\r\n".to_owned(),
        "Sec-Fetch-Site: cross-site\r\n".to_owned(),
    ] {
        let forged = post(
            &s,
            "/console/actions/requeue",
            &host,
            &format!("Cookie: {cookie}\r\n{extra}"),
            &form,
        );
        assert_eq!(status(&forged), 403, "{extra}: {forged}");
        assert_eq!(delivery_status(&db, id), DeliveryStatus::Failed);
    }
    // The sign-in page shows no form token an action takes.
    let public = form_token(&get(&s, "/console/sign-in", &host, None));
    let with_public = post(
        &s,
        "/console/actions/requeue",
        &host,
        &format!("Cookie: {cookie}\r\n"),
        &format!("csrf={public}&delivery={id}"),
    );
    assert_eq!(status(&with_public), 403);
    assert_eq!(delivery_status(&db, id), DeliveryStatus::Failed);
    // Signed out, the old cookie reads nothing and does nothing.
    let out = post(
        &s,
        "/console/sign-out",
        &host,
        &format!("Cookie: {cookie}\r\nOrigin: http://{host}\r\n"),
        &format!("csrf={csrf}"),
    );
    assert_eq!(status(&out), 303, "{out}");
    assert_eq!(status(&get(&s, "/console", &host, Some(&cookie))), 303);
    let after = post(
        &s,
        "/console/actions/requeue",
        &host,
        &format!("Cookie: {cookie}\r\n"),
        &form,
    );
    assert_eq!(status(&after), 403);
    assert_eq!(delivery_status(&db, id), DeliveryStatus::Failed);
}

/// Item 6: a token file others may read is refused, naming the `chmod` that mends it;
/// nothing is served.
#[cfg(unix)]
#[test]
fn a_token_file_others_may_read_is_refused() {
    let (db, _) = outbox_with_a_dead_letter();
    for mode in [0o644, 0o640, 0o606] {
        let file = token_file(&db, mode);
        let mut child = std::process::Command::new(assert_cmd::cargo::cargo_bin("outbox"))
            .arg("--db")
            .arg(db.path())
            .args(["serve", "--listen", "127.0.0.1:0", "--console-token-file"])
            .arg(&file)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(20);
        let status = loop {
            if let Some(status) = child.try_wait().unwrap() {
                break status;
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                panic!("mode {mode:o}: the token file was taken and the console served");
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        let refused = child.wait_with_output().unwrap();
        assert!(!status.success(), "{mode:o}");
        let said = String::from_utf8_lossy(&refused.stderr);
        assert!(
            said.contains(&format!("chmod 600 {}", file.display())),
            "{said}"
        );
        assert!(refused.stdout.is_empty(), "nothing served");
    }
}

/// Item 7: forms whose bodies never arrive hold no one up: `/healthz` answers at once
/// beside 300 of them.
#[test]
fn bodies_that_never_arrive_leave_room_for_healthz() {
    let (db, _) = outbox_with_a_dead_letter();
    let (s, _file) = with_token(&db);
    let host = format!("127.0.0.1:{}", s.port());
    let _slow = slow_forms(&s, &host, 300);
    let started = Instant::now();
    let health = get(&s, "/healthz", &host, None);
    assert_eq!(status(&health), 503, "{health}"); // a dead letter: fail, but answered
    assert!(started.elapsed() < Duration::from_secs(5));
}

/// Item 7: a form's body has a deadline, as its head has: 408 once it has passed (503
/// at once for those past the bodies read at once).
#[test]
fn a_body_that_never_arrives_is_answered_408() {
    let (db, _) = outbox_with_a_dead_letter();
    let file = token_file(&db, 0o600);
    let s = serve(
        &db.path(),
        "127.0.0.1:0",
        &[
            "--console-token-file",
            file.to_str().unwrap(),
            "--body-timeout",
            "500ms",
        ],
    );
    let host = format!("127.0.0.1:{}", s.port());
    let mut slow = slow_forms(&s, &host, 40);
    let mut timed_out = 0;
    for stream in &mut slow {
        stream
            .set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        let mut answer = String::new();
        let _ = std::io::Read::read_to_string(stream, &mut answer);
        let code = status(&answer);
        assert!(code == 408 || code == 503, "{answer}");
        timed_out += usize::from(code == 408);
    }
    assert!(timed_out > 0, "no form was timed out");
}

/// `count` sign-in forms whose heads arrive and whose bodies never do.
fn slow_forms(s: &Serving, host: &str, count: usize) -> Vec<std::net::TcpStream> {
    let head = format!(
        "POST /console/sign-in HTTP/1.1\r\nHost: {host}\r\nContent-Length: 100\r\n\r\ncsrf="
    );
    (0..count)
        .filter_map(|_| {
            let mut stream = std::net::TcpStream::connect(("127.0.0.1", s.port())).ok()?;
            stream.write_all(head.as_bytes()).ok()?;
            Some(stream)
        })
        .collect()
}

/// Item 8: wrong tokens are logged and, past the allowance, make the next sign-in wait
/// (429 with `Retry-After`), even with the right token.
#[test]
fn wrong_tokens_are_logged_and_made_to_wait() {
    let (db, _) = outbox_with_a_dead_letter();
    let file = token_file(&db, 0o600);
    let log = db.dir.path().join("serve.log");
    let s = Serving::listening(
        db.path(),
        "127.0.0.1:0",
        &["--console-token-file".as_ref(), file.as_os_str()],
        std::fs::File::create(&log).unwrap(),
    );
    let host = format!("127.0.0.1:{}", s.port());
    let csrf = form_token(&get(&s, "/console/sign-in", &host, None));
    let attempt = |token: &str| {
        post(
            &s,
            "/console/sign-in",
            &host,
            "",
            &format!("csrf={csrf}&token={token}"),
        )
    };
    for _ in 0..4 {
        assert_eq!(status(&attempt("not-the-token-0123456789")), 403);
    }
    let waiting = attempt(TOKEN);
    assert_eq!(status(&waiting), 429, "{waiting}");
    assert!(header(&waiting, "Retry-After").is_some());
    assert!(header(&waiting, "Set-Cookie").is_none());
    let logged = std::fs::read_to_string(&log).unwrap();
    assert_eq!(
        logged
            .matches("a sign-in from 127.0.0.1 was refused")
            .count(),
        4,
        "{logged}"
    );
    assert!(logged.contains("waits: too many wrong tokens"), "{logged}");
}

/// Item 9: a CR/LF in an action's `back` never reaches a header: the action is done
/// and answered 303 to a console page (before: 500 for an action already carried out).
#[test]
fn a_line_break_in_back_reaches_no_header() {
    let (db, _) = outbox_with_a_dead_letter();
    let (s, _file) = with_token(&db);
    let host = format!("127.0.0.1:{}", s.port());
    let (cookie, csrf) = sign_in(&s, &host);
    let answer = post(
        &s,
        "/console/actions/dismiss",
        &host,
        &format!("Cookie: {cookie}\r\n"),
        &format!("csrf={csrf}&back=/console/chats%0d%0aSet-Cookie:%20outbox_console=planted"),
    );
    assert_eq!(status(&answer), 303, "{answer}");
    assert_eq!(
        header(&answer, "Location").as_deref(),
        Some("/console?done=dismissed&n=1")
    );
    assert!(!answer.contains("planted"), "{answer}");
}
