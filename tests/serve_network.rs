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
    fail_for_good(&db);
    (db, id)
}

/// Claims the part due and records that it failed for good: the user blocked the bot.
fn fail_for_good(db: &TestDb) {
    let claim = claim_one(&db.outbox);
    db.outbox
        .record(
            &claim,
            Outcome::Permanent {
                error: "Forbidden: bot was blocked by the user".into(),
            },
        )
        .unwrap();
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
    let (signed, _file) = with_token(&db);
    for own in [
        format!("127.0.0.1:{}", signed.port()),
        format!("localhost:{}", signed.port()),
    ] {
        let (cookie, _) = sign_in(&signed, &own);
        let page = get(
            &signed,
            &format!("/console/deliveries/{id}?text=1"),
            &own,
            Some(&cookie),
        );
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
        &["--allowed-host", "outbox.ops.example", "--no-console"],
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

/// `outbox serve` as it starts, or what it said when it refused.
fn try_serve(db: &TestDb, listen: &str, extra: &[&str]) -> Result<Serving, String> {
    let extra: Vec<&std::ffi::OsStr> = extra.iter().map(std::ffi::OsStr::new).collect();
    Serving::try_listening(db.path(), listen, &extra, Stdio::piped()).map_err(|refused| {
        assert!(!refused.status.success());
        assert!(refused.stdout.is_empty(), "nothing served");
        String::from_utf8_lossy(&refused.stderr).into_owned()
    })
}

/// Review 2, item 1: the reverse-proxy recipe without a token — a name the proxy uses,
/// `--secure-cookie` — does not start (it published every reply), and says which flag
/// mends it; so does any address other machines reach. With `--no-console` only the
/// health endpoints are served, on any address.
#[test]
fn a_console_others_reach_does_not_start_without_a_token() {
    let (db, _) = outbox_with_a_dead_letter();
    for (listen, extra) in [
        (
            "127.0.0.1:0",
            vec!["--allowed-host", "outbox.example.org", "--secure-cookie"],
        ),
        ("127.0.0.1:0", vec!["--allowed-host", "outbox.example.org"]),
        ("0.0.0.0:0", vec![]),
    ] {
        let Err(said) = try_serve(&db, listen, &extra) else {
            panic!("{listen} {extra:?}: served without a token");
        };
        assert!(said.contains("reachable from other machines"), "{said}");
        assert!(
            said.contains("--console-token-file") && said.contains("--no-console"),
            "{said}"
        );
    }
    let said = try_serve(&db, "127.0.0.1:0", &["--secure-cookie"])
        .err()
        .unwrap();
    assert!(
        said.contains("--secure-cookie is about the console's sign-in"),
        "{said}"
    );

    let metrics_only = serve(&db.path(), "0.0.0.0:0", &["--no-console"]);
    assert!(
        metrics_only.banner.contains("no console"),
        "{}",
        metrics_only.banner
    );
    let port = metrics_only.port();
    assert_eq!(
        status(&get(
            &metrics_only,
            "/console/dead-letters",
            &format!("127.0.0.1:{port}"),
            None
        )),
        404
    );
    // Any address of the machine is its own; a name is not.
    assert_eq!(
        status(&get(
            &metrics_only,
            "/metrics",
            &format!("10.1.2.3:{port}"),
            None
        )),
        200
    );
    assert_eq!(
        status(&get(
            &metrics_only,
            "/metrics",
            &format!("rebind.example:{port}"),
            None
        )),
        421
    );
    // A console on loopback, reached through a proxy that keeps the name or adds its
    // forwarding header, shows nothing without a token.
    let s = serve(&db.path(), "127.0.0.1:0", &[]);
    let host = format!("127.0.0.1:{}", s.port());
    let proxied = s.raw(&format!(
        "GET /console/dead-letters HTTP/1.1\r\nHost: {host}\r\nX-Forwarded-For: 203.0.113.9\r\n\
         Connection: close\r\n\r\n"
    ));
    assert_eq!(status(&proxied), 403);
    assert!(!proxied.contains("bot was blocked") && !proxied.contains("chat-7"));
}

/// A directory under the system's temporary one that every account may enter (a test
/// directory is its owner's alone, which would hide what the socket itself allows).
#[cfg(unix)]
fn open_directory() -> tempfile::TempDir {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::Builder::new()
        .prefix("outbox-serve-")
        .tempdir_in("/tmp")
        .unwrap();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    dir
}

/// What another account (`nobody`, uid 65534) reads from the Unix socket at `path`:
/// `None` if this process cannot act as another account (it is not root).
#[cfg(unix)]
fn as_another_account(path: &Path, request: &str) -> Option<String> {
    use std::os::unix::process::CommandExt;
    if !std::fs::metadata("/proc/self").is_ok_and(|m| std::os::unix::fs::MetadataExt::uid(&m) == 0)
    {
        return None;
    }
    // A server that closes at once makes the write fail: not a reason to die of SIGPIPE.
    let script = "use IO::Socket::UNIX; $SIG{PIPE} = 'IGNORE'; \
                  my $s = IO::Socket::UNIX->new(Peer => $ARGV[0]) \
                  or do { print \"refused:$!\"; exit 0 }; print $s $ARGV[1]; local $/; \
                  my $d = <$s>; print 'read:' . ($d // '');";
    let out = std::process::Command::new("/usr/bin/perl")
        .args(["-e", script])
        .arg(path)
        .arg(request)
        .uid(65534)
        .gid(65534)
        .output()
        .expect("perl (Debian's perl-base), to connect as another account");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    Some(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Review 2, item 2: a console without a token shows every reply to nobody but the
/// file's owner. Over TCP (even on loopback, which every account of the machine
/// reaches) it shows nothing and says how to turn it on; on a Unix socket it shows the
/// owner everything, and another account can neither open the socket (mode 0600) nor,
/// if the mode is loosened, be answered (its credentials are checked).
#[cfg(unix)]
#[test]
fn another_account_reads_nothing_from_a_console_without_a_token() {
    use std::os::unix::fs::PermissionsExt;
    let (db, id) = outbox_with_a_dead_letter();
    let page = format!("/console/deliveries/{id}?text=1");
    let tcp = serve(&db.path(), "127.0.0.1:0", &[]);
    assert!(tcp.banner.contains("shows nothing"), "{}", tcp.banner);
    let answer = get(&tcp, &page, &format!("127.0.0.1:{}", tcp.port()), None);
    assert_eq!(status(&answer), 403, "{answer}");
    assert!(
        !answer.contains(SECRET) && !answer.contains("chat-7"),
        "{answer}"
    );
    assert!(answer.contains("unix:PATH"), "says how: {answer}");

    let dir = open_directory();
    let path = dir.path().join("outbox.sock");
    let listen = format!("unix:{}", path.display());
    let socket = serve(&db.path(), &listen, &[]);
    assert!(
        socket.banner.contains("for this account alone"),
        "{}",
        socket.banner
    );
    let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600);
    let request = format!("GET {page} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n");
    let owner = socket.raw_unix(&request);
    assert_eq!(status(&owner), 200, "{owner}");
    assert!(owner.contains(SECRET));
    // The health endpoints answer there too.
    let health =
        socket.raw_unix("GET /metrics HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n");
    assert_eq!(status(&health), 200);
    match as_another_account(&path, &request) {
        Some(other) => {
            assert!(other.starts_with("refused:"), "mode 0600: {other}");
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o666)).unwrap();
            let other = as_another_account(&path, &request).unwrap();
            assert!(
                !other.contains(SECRET) && !other.contains("HTTP/1.1"),
                "credentials: {other}"
            );
            assert!(
                other.starts_with("read:") || other.starts_with("refused:"),
                "{other}"
            );
        }
        None => eprintln!("not root: another account's view of the socket is not tried"),
    }
    // A file that is not a socket is never replaced.
    drop(socket);
    std::fs::remove_file(&path).unwrap();
    std::fs::write(&path, "not a socket").unwrap();
    let said = try_serve(&db, &listen, &[]).err().expect("refused");
    assert!(said.contains("not a socket"), "{said}");
    assert_eq!(std::fs::read_to_string(&path).unwrap(), "not a socket");
}

/// Review 2, item 7: a console other machines reach takes the token over TLS only:
/// without `--secure-cookie` (TLS in front) or `--allow-plain-http-sign-in` it does not
/// start; with TLS in front its cookie is `Secure`; a sign-in through a proxy to a
/// loopback console over plain HTTP is refused.
#[test]
fn an_exposed_console_takes_the_token_over_tls_only() {
    let (db, _) = outbox_with_a_dead_letter();
    let file = token_file(&db, 0o600);
    let token = ["--console-token-file", file.to_str().unwrap()];
    for (listen, extra) in [
        ("0.0.0.0:0", vec![]),
        ("127.0.0.1:0", vec!["--allowed-host", "outbox.example.org"]),
    ] {
        let args: Vec<&str> = token.iter().chain(&extra).copied().collect();
        let said = try_serve(&db, listen, &args).err().expect("refused");
        assert!(said.contains("plain HTTP"), "{said}");
        assert!(
            said.contains("--secure-cookie") && said.contains("--allow-plain-http-sign-in"),
            "{said}"
        );
    }
    let here = local_address();
    let sign_in_from = |s: &Serving, extra: &str| {
        let host = format!("{here}:{}", s.port());
        let form = s.raw_from(
            here,
            &format!("GET /console/sign-in HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n"),
        );
        let body = format!("csrf={}&token={TOKEN}", form_token(&form));
        s.raw_from(
            here,
            &format!(
                "POST /console/sign-in HTTP/1.1\r\nHost: {host}\r\n{extra}Content-Type: \
                 application/x-www-form-urlencoded\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                body.len()
            ),
        )
    };
    let listen = format!("{here}:0");
    let tls = serve(
        &db.path(),
        &listen,
        &[token[0], token[1], "--secure-cookie"],
    );
    assert!(tls.banner.contains("over TLS only"), "{}", tls.banner);
    let signed = sign_in_from(&tls, "");
    assert_eq!(status(&signed), 303, "{signed}");
    assert!(header(&signed, "Set-Cookie").unwrap().contains("; Secure"));
    let plain = serve(
        &db.path(),
        &listen,
        &[token[0], token[1], "--allow-plain-http-sign-in"],
    );
    assert!(plain.banner.contains("in clear"), "{}", plain.banner);
    let signed = sign_in_from(&plain, "");
    assert_eq!(status(&signed), 303, "{signed}");
    assert!(!header(&signed, "Set-Cookie").unwrap().contains("Secure"));
    // A proxy on this machine in front of a loopback console, over plain HTTP.
    let (s, _file) = with_token(&db);
    let host = format!("127.0.0.1:{}", s.port());
    let csrf = form_token(&get(&s, "/console/sign-in", &host, None));
    let proxied = post(
        &s,
        "/console/sign-in",
        &host,
        "X-Forwarded-For: 203.0.113.9\r\n",
        &format!("csrf={csrf}&token={TOKEN}"),
    );
    assert_eq!(status(&proxied), 403, "{proxied}");
    assert!(proxied.contains("in clear") && header(&proxied, "Set-Cookie").is_none());
}

/// This machine's address on a network (not the loopback): what another machine would
/// connect to.
fn local_address() -> std::net::IpAddr {
    let probe = std::net::UdpSocket::bind("0.0.0.0:0").unwrap();
    ["192.0.2.1:9", "10.255.255.254:9", "172.31.255.254:9"]
        .iter()
        .find_map(|target| {
            probe.connect(target).ok()?;
            probe
                .local_addr()
                .ok()
                .map(|a| a.ip())
                .filter(|ip| !ip.is_loopback())
        })
        .expect("a network address of this machine (the test connects as another machine would)")
}

/// Review 2, item 6: every address and name the start-up line prints is answered — on
/// another loopback address too — and a `Host` without a port on port 80.
#[test]
fn every_name_the_start_up_line_prints_is_answered() {
    let (db, _) = outbox_with_a_dead_letter();
    let other_loopback = std::net::IpAddr::from([127, 0, 0, 2]);
    let s = serve(&db.path(), "127.0.0.2:0", &[]);
    assert!(
        s.banner
            .starts_with(&format!("serving http://127.0.0.2:{}/metrics", s.port())),
        "{}",
        s.banner
    );
    let names = s
        .banner
        .trim()
        .rsplit("answering to ")
        .next()
        .unwrap()
        .to_owned();
    let names: Vec<String> = names
        .split(", ")
        .map(|n| n.replace(":*", ":8080"))
        .collect();
    assert!(
        names.contains(&format!("127.0.0.2:{}", s.port())),
        "{names:?}"
    );
    for name in &names {
        let answer = s.raw_from(
            other_loopback,
            &format!("GET /metrics HTTP/1.1\r\nHost: {name}\r\nConnection: close\r\n\r\n"),
        );
        assert_eq!(status(&answer), 200, "{name}: {answer}");
    }
    // Port 80, where browsers and curl send the name alone (binding it needs root).
    let eighty = std::net::SocketAddr::from(([127, 0, 0, 3], 80));
    match std::net::TcpListener::bind(eighty) {
        Ok(probe) => {
            drop(probe);
            let s = serve(&db.path(), "127.0.0.3:80", &[]);
            for name in ["localhost", "127.0.0.3", "127.0.0.1"] {
                let answer = s.raw_from(
                    other_loopback,
                    &format!("GET /metrics HTTP/1.1\r\nHost: {name}\r\nConnection: close\r\n\r\n"),
                );
                assert_eq!(status(&answer), 200, "{name}: {answer}");
            }
        }
        Err(e) => eprintln!("port 80 not tried ({e}): the names are checked in serve's unit tests"),
    }
}

/// Review 2, item 3: one client holding idle connections takes its share, not every
/// slot: another address is answered at once. Many addresses together run the slots
/// short, and then idle connections are closed within seconds, not a minute.
#[test]
fn one_client_holding_idle_connections_shuts_nobody_out() {
    let (db, _) = outbox_with_a_dead_letter();
    let s = serve(&db.path(), "127.0.0.1:0", &[]);
    let host = format!("127.0.0.1:{}", s.port());
    let hog = std::net::IpAddr::from([127, 0, 0, 2]);
    let held: Vec<std::net::TcpStream> = (0..256).map(|_| s.connect_from(hog)).collect();
    assert_eq!(status(&get(&s, "/metrics", &host, None)), 200);
    drop(held);
    // Eight addresses, 32 each: past three quarters of the slots.
    let many: Vec<std::net::TcpStream> = (2..10u8)
        .flat_map(|n| (0..32).map(move |_| n))
        .map(|n| s.connect_from(std::net::IpAddr::from([127, 0, 0, n])))
        .collect();
    let newcomer = std::net::IpAddr::from([127, 0, 0, 50]);
    let answer = s.raw_from(
        newcomer,
        &format!("GET /healthz HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n"),
    );
    assert_eq!(
        status(&answer),
        503,
        "answered (a dead letter: fail): {answer}"
    );
    let started = Instant::now();
    let mut closed = 0;
    for mut stream in many {
        stream
            .set_read_timeout(Some(Duration::from_secs(20)))
            .unwrap();
        let mut byte = [0u8; 1];
        if matches!(std::io::Read::read(&mut stream, &mut byte), Ok(0) | Err(_)) {
            closed += 1;
        }
    }
    assert!(closed >= 200, "{closed} of 256 idle connections closed");
    assert!(
        started.elapsed() < Duration::from_secs(20),
        "{:?}",
        started.elapsed()
    );
}

/// Review 2, item 4: one client holding unfinished form bodies takes its share of the
/// body slots: a sign-in from another address goes through.
#[test]
fn one_client_holding_form_bodies_shuts_nobody_out() {
    let (db, _) = outbox_with_a_dead_letter();
    let file = token_file(&db, 0o600);
    // Bodies awaited far longer than the test takes: a held one is never answered.
    let s = serve(
        &db.path(),
        "127.0.0.1:0",
        &[
            "--console-token-file",
            file.to_str().unwrap(),
            "--body-timeout",
            "5m",
        ],
    );
    let host = format!("127.0.0.1:{}", s.port());
    let hog = std::net::IpAddr::from([127, 0, 0, 2]);
    let head = format!(
        "POST /console/sign-in HTTP/1.1\r\nHost: {host}\r\nContent-Length: 100\r\n\r\ncsrf="
    );
    let mut slow: Vec<std::net::TcpStream> = (0..40)
        .map(|_| {
            let mut stream = s.connect_from(hog);
            stream.write_all(head.as_bytes()).unwrap();
            stream
        })
        .collect();
    // Each is closed (past the connections one client may hold), answered (503: past
    // its share of bodies), or held, its body awaited: wait until no more than the
    // hog's share is left unanswered (or a minute has passed: a broken build).
    for stream in &slow {
        stream.set_nonblocking(true).unwrap();
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    while slow.len() > 4 && Instant::now() < deadline {
        slow.retain_mut(|stream| {
            let mut answer = [0u8; 12];
            match std::io::Read::read(stream, &mut answer) {
                Ok(0) => false,
                Ok(_) => {
                    assert!(answer.starts_with(b"HTTP/1.1 503"), "{answer:?}");
                    false
                }
                Err(e) => e.kind() == std::io::ErrorKind::WouldBlock,
            }
        });
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(slow.len(), 4, "the hog holds its share of the bodies");
    let (cookie, _) = sign_in(&s, &host);
    assert!(cookie.starts_with("outbox_console="));
}

/// Review 2, item 5: wrong tokens from other addresses — many of them, within each
/// one's own allowance — never keep the right token from an address with no failures
/// out; behind a trusted proxy the clients it forwards are counted apart.
#[test]
fn wrong_tokens_from_others_never_lock_the_operator_out() {
    let (db, _) = outbox_with_a_dead_letter();
    let (s, _file) = with_token(&db);
    let host = format!("127.0.0.1:{}", s.port());
    let csrf = form_token(&get(&s, "/console/sign-in", &host, None));
    let attempt = |from: std::net::IpAddr, extra: &str, token: &str| {
        let form = format!("csrf={csrf}&token={token}");
        status(&s.raw_from(
            from,
            &format!(
                "POST /console/sign-in HTTP/1.1\r\nHost: {host}\r\n{extra}Content-Type: \
                 application/x-www-form-urlencoded\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{form}",
                form.len()
            ),
        ))
    };
    for n in 0..40u8 {
        let from = std::net::IpAddr::from([127, 0, 1, n % 13]);
        let answer = attempt(from, "", "wrong-token-0123456789");
        assert!(answer == 403 || answer == 429, "{answer}");
    }
    assert_eq!(
        attempt(std::net::IpAddr::from([127, 0, 0, 1]), "", TOKEN),
        303
    );

    // Behind a proxy every peer is the proxy; trusted, its header names the clients.
    let file = token_file(&db, 0o600);
    let behind = serve(
        &db.path(),
        "127.0.0.1:0",
        &[
            "--console-token-file",
            file.to_str().unwrap(),
            "--trusted-proxy",
            "127.0.0.1",
            "--secure-cookie",
        ],
    );
    let host = format!("127.0.0.1:{}", behind.port());
    let csrf = form_token(&get(&behind, "/console/sign-in", &host, None));
    let through = |client: &str, token: &str| {
        let form = format!("csrf={csrf}&token={token}");
        status(&post(
            &behind,
            "/console/sign-in",
            &host,
            &format!("X-Forwarded-For: {client}\r\n"),
            &form,
        ))
    };
    for _ in 0..10 {
        through("203.0.113.50", "wrong-token-0123456789");
    }
    assert_eq!(through("203.0.113.50", TOKEN), 429, "its own failures");
    assert_eq!(
        through("198.51.100.8", TOKEN),
        303,
        "another client behind the proxy"
    );
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

/// `count` sign-in forms whose heads arrive and whose bodies never do, four from each
/// of many loopback addresses (as many clients would send them).
fn slow_forms(s: &Serving, host: &str, count: usize) -> Vec<std::net::TcpStream> {
    let head = format!(
        "POST /console/sign-in HTTP/1.1\r\nHost: {host}\r\nContent-Length: 100\r\n\r\ncsrf="
    );
    (0..count)
        .filter_map(|n| {
            let from = std::net::IpAddr::from([127, 0, 2, (n / 4) as u8]);
            let mut stream = s.connect_from(from);
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

/// One row of OPERATING.md's table of the console: how `serve` is started, and who can
/// read and act.
#[derive(Debug)]
struct Row {
    listen: String,
    proxy: bool,
    token: bool,
    tls: Vec<String>,
    no_console: bool,
    reads: String,
    acts: String,
}

/// The rows of the table under "## The console" in docs/OPERATING.md.
fn console_table() -> Vec<Row> {
    let doc =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/OPERATING.md"))
            .unwrap();
    let at = doc
        .find("| where it listens (`--listen`)")
        .expect("the console's table");
    let flag = |cell: &str| -> Vec<String> {
        cell.split('`')
            .skip(1)
            .step_by(2)
            .filter(|c| c.starts_with("--"))
            .map(str::to_owned)
            .collect()
    };
    doc[at..]
        .lines()
        .skip(2)
        .take_while(|line| line.starts_with('|'))
        .map(|line| {
            let cells: Vec<&str> = line.trim_matches('|').split('|').map(str::trim).collect();
            assert_eq!(cells.len(), 5, "{line}");
            let listen = cells[0]
                .split('`')
                .skip(1)
                .step_by(2)
                .find(|c| !c.starts_with("--"))
                .unwrap_or_default()
                .to_owned();
            Row {
                proxy: cells[0].contains("`--allowed-host NAME`"),
                no_console: cells[0].contains("`--no-console`"),
                listen,
                token: match cells[1] {
                    "yes" => true,
                    "no" | "–" => false,
                    other => panic!("token {other:?}"),
                },
                tls: flag(cells[2]),
                reads: cells[3].to_owned(),
                acts: cells[4].to_owned(),
            }
        })
        .collect()
}

/// Each row of OPERATING.md's table of the console, started as it says and read and
/// acted on as the people it names would: the table is what `serve` does.
#[test]
fn the_console_table_is_what_serve_does() {
    let rows = console_table();
    assert_eq!(rows.len(), 13, "{rows:#?}");
    let (db, id) = outbox_with_a_dead_letter();
    let file = token_file(&db, 0o600);
    let dir = tempfile::tempdir().unwrap();
    let here = local_address();
    for row in rows {
        let mut args: Vec<String> = Vec::new();
        let listen = match row.listen.as_str() {
            "unix:PATH" => format!("unix:{}", dir.path().join("console.sock").display()),
            "" => "127.0.0.1:0".to_owned(),
            tcp => tcp.replace(":9464", ":0"),
        };
        if row.proxy {
            args.extend(["--allowed-host".into(), "outbox.example.org".into()]);
        }
        if row.token {
            args.extend(["--console-token-file".into(), file.display().to_string()]);
        }
        if row.no_console {
            args.push("--no-console".into());
        }
        args.extend(row.tls.iter().cloned());
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let started = try_serve(&db, &listen, &args);
        if row.reads == "refuses to start" {
            assert_eq!(row.acts, row.reads, "{row:?}");
            let said = started
                .err()
                .unwrap_or_else(|| panic!("{row:?}: it started"));
            assert!(
                said.contains("--"),
                "{row:?}: names the flag that mends it: {said}"
            );
            continue;
        }
        let s = started.unwrap_or_else(|said| panic!("{row:?}: {said}"));
        // The person the row is about: the owner on the socket, someone on this
        // machine, or someone on another machine (through the proxy, or directly).
        let (host, from_network, forwarded) = if listen.starts_with("unix:") {
            ("localhost".to_owned(), false, "")
        } else if row.proxy {
            (
                "outbox.example.org".to_owned(),
                true,
                "X-Forwarded-For: 203.0.113.9\r\n",
            )
        } else if listen.starts_with("0.0.0.0") {
            (format!("{here}:{}", s.port()), true, "")
        } else {
            (format!("127.0.0.1:{}", s.port()), false, "")
        };
        let send = |request: String| {
            if listen.starts_with("unix:") {
                s.raw_unix(&request)
            } else if from_network && !row.proxy {
                s.raw_from(here, &request)
            } else {
                s.raw(&request)
            }
        };
        let get = |path: &str, cookie: &str| {
            send(format!(
                "GET {path} HTTP/1.1\r\nHost: {host}\r\n{forwarded}{cookie}Connection: close\r\n\r\n"
            ))
        };
        let post = |path: &str, cookie: &str, form: &str| {
            send(format!(
                "POST {path} HTTP/1.1\r\nHost: {host}\r\n{forwarded}{cookie}Content-Type: \
                 application/x-www-form-urlencoded\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{form}",
                form.len()
            ))
        };
        let page = format!("/console/deliveries/{id}?text=1");
        let unsigned = get(&page, "");
        // Who can read.
        let mut session = None;
        match row.reads.as_str() {
            "this account" => assert!(unsigned.contains(SECRET), "{row:?}: {unsigned}"),
            "nobody" => {
                assert_eq!(status(&unsigned), 403, "{row:?}: {unsigned}");
                assert!(!unsigned.contains(SECRET));
            }
            "nobody (health endpoints only)" => {
                assert_eq!(status(&unsigned), 404, "{row:?}");
                assert_eq!(status(&get("/metrics", "")), 200, "{row:?}");
            }
            signed_in => {
                assert_eq!(status(&unsigned), 303, "{row:?}: {unsigned}");
                assert!(!unsigned.contains(SECRET));
                let form = get("/console/sign-in", "");
                let signed = post(
                    "/console/sign-in",
                    "",
                    &format!("csrf={}&token={TOKEN}", form_token(&form)),
                );
                assert_eq!(status(&signed), 303, "{row:?}: {signed}");
                let cookie = header(&signed, "Set-Cookie").unwrap();
                assert_eq!(
                    cookie.contains("; Secure"),
                    signed_in.ends_with("over TLS"),
                    "{row:?}: {cookie}"
                );
                let cookie = format!("Cookie: {}\r\n", cookie.split(';').next().unwrap());
                let read = get(&page, &cookie);
                assert!(read.contains(SECRET), "{row:?}: {read}");
                let who = match signed_in {
                    "this account, signed in" => !from_network && listen.starts_with("unix:"),
                    "this machine, signed in" => !from_network && !listen.starts_with("unix:"),
                    "anyone, signed in over TLS" | "anyone, signed in in clear" => from_network,
                    other => panic!("{row:?}: who can read? {other:?}"),
                };
                assert!(who, "{row:?}");
                if signed_in == "this machine, signed in" {
                    // Through a proxy, over plain HTTP: not taken.
                    let proxied = send(format!(
                        "POST /console/sign-in HTTP/1.1\r\nHost: {host}\r\nX-Forwarded-For: 203.0.113.9\r\n\
                         Content-Length: 0\r\nConnection: close\r\n\r\n"
                    ));
                    assert_eq!(status(&proxied), 403, "{row:?}: {proxied}");
                }
                session = Some((cookie.clone(), form_token(&read)));
            }
        }
        // Who can act: dismiss the dead letter (requeued again after).
        let acted = match &session {
            Some((cookie, csrf)) => {
                post("/console/actions/dismiss", cookie, &format!("csrf={csrf}"))
            }
            None => post("/console/actions/dismiss", "", "csrf=x"),
        };
        match row.acts.as_str() {
            "whoever signs in" => {
                assert!(session.is_some(), "{row:?}");
                assert_eq!(status(&acted), 303, "{row:?}: {acted}");
                db.outbox.requeue_dead_letters(None).unwrap();
                fail_for_good(&db);
            }
            "nobody" => assert!(matches!(status(&acted), 403 | 404), "{row:?}: {acted}"),
            other => panic!("{row:?}: who can act? {other:?}"),
        }
    }
}
