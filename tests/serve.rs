//! `outbox serve` meets hostile and broken clients (items 12 and 13 of the review): one
//! that pipelines requests and never reads, a header line that never ends, requests
//! that are never finished. None of them keeps `/healthz` from answering, memory stays
//! bounded, and a half-sent request is closed after the header timeout. All traffic is
//! on 127.0.0.1, bounded in count and time.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::time::{Duration, Instant};

use common::*;

/// A running `outbox serve`, stopped when dropped.
struct Serving(common::serve::Serving);

impl Serving {
    fn start(db: &Path, extra: &[&str]) -> Serving {
        let extra: Vec<&std::ffi::OsStr> = extra.iter().map(std::ffi::OsStr::new).collect();
        Serving(common::serve::Serving::start(db, &extra))
    }

    /// `/healthz` from a well-behaved client, which gives up after 10 s.
    fn healthz(&self) -> u16 {
        let client = reqwest::blocking::Client::builder()
            .timeout(Duration::from_secs(10))
            .build()
            .unwrap();
        client
            .get(format!("http://{}/healthz", self.0.addr))
            .send()
            .expect("/healthz answers while the others misbehave")
            .status()
            .as_u16()
    }

    /// The server's resident memory, KiB.
    fn rss_kib(&self) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.0.pid())).unwrap();
        status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .expect("VmRSS")
    }

    /// A connection from a misbehaving client: 127.0.0.2, another address than the
    /// well-behaved one's (a client only ever holds its own share of the slots).
    fn connect(&self) -> TcpStream {
        let stream = common::serve::connect_from([127, 0, 0, 2].into(), self.0.target());
        stream
            .set_write_timeout(Some(Duration::from_secs(2)))
            .unwrap();
        stream
    }
}

fn served() -> (TestDb, Serving, Serving) {
    let db = TestDb::default();
    enqueue(&db.outbox, "1", &["hello"]);
    let default = Serving::start(&db.path(), &[]);
    let quick = Serving::start(&db.path(), &["--header-timeout", "300ms"]);
    (db, default, quick)
}

/// Item 12: a client that pipelines thousands of requests and never reads the answers
/// stalls only its own connection.
#[test]
fn a_client_that_pipelines_and_never_reads_holds_up_no_one() {
    let (_db, server, _) = served();
    let mut greedy = server.connect();
    let request = b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n";
    let mut sent = 0;
    // Until the server stops reading (its answers fill the socket), at most 20,000.
    while sent < 20_000 && greedy.write_all(request).is_ok() {
        sent += 1;
    }
    assert!(sent > 100, "{sent} requests written");
    assert_eq!(server.healthz(), 200);
    drop(greedy);
}

/// Item 13: a header line that never ends is cut off after a bounded buffer: the
/// server closes the connection long before 64 MiB have been sent, its memory does not
/// grow with what was sent, and others are served meanwhile.
#[test]
fn an_endless_header_line_is_cut_off() {
    let (_db, server, _) = served();
    let before = server.rss_kib();
    let mut endless = server.connect();
    endless
        .write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Endless: ")
        .unwrap();
    let chunk = vec![b'a'; 64 * 1024];
    let mut sent = 0usize;
    while sent < 64 << 20 {
        if endless.write_all(&chunk).is_err() {
            break;
        }
        sent += chunk.len();
    }
    assert!(
        sent < 16 << 20,
        "the server took {sent} bytes of one header line"
    );
    assert_eq!(server.healthz(), 200);
    let after = server.rss_kib();
    assert!(
        after < before + 16 * 1024,
        "memory grew from {before} KiB to {after} KiB"
    );
}

/// Item 13: requests that are never finished (a slowloris) hold no one up, and each
/// such connection is closed once the header timeout has passed.
#[test]
fn half_sent_requests_are_closed_after_the_header_timeout() {
    let (_db, _, server) = served();
    let mut slow: Vec<TcpStream> = (0..50)
        .map(|_| {
            let mut s = server.connect();
            s.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: ")
                .unwrap();
            s
        })
        .collect();
    assert_eq!(server.healthz(), 200);
    let deadline = Instant::now() + Duration::from_secs(30);
    for s in &mut slow {
        s.set_read_timeout(Some(deadline.saturating_duration_since(Instant::now())))
            .unwrap();
        let mut rest = Vec::new();
        match s.read_to_end(&mut rest) {
            Ok(_) => {} // closed, possibly after a 408
            Err(e) => assert!(
                !matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ),
                "a half-sent request was still open after 30 s: {e}"
            ),
        }
    }
}
