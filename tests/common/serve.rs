//! `outbox serve` started for a test (on 127.0.0.1, any free port, unless told
//! otherwise), stopped when dropped; and raw HTTP to it from a chosen address.

use std::ffi::OsStr;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{IpAddr, SocketAddr};
use std::process::{Child, Command, Output, Stdio};
use std::time::Duration;

/// A running `outbox serve`.
pub struct Serving {
    child: Child,
    /// Where it listens: `host:port`, or `unix:PATH`.
    pub addr: String,
    /// The first line it printed (what it serves, and who can read the console).
    pub banner: String,
}

impl Serving {
    /// `outbox --db DB serve --listen 127.0.0.1:0 EXTRA…`, once it listens.
    pub fn start(db: impl AsRef<OsStr>, extra: &[&OsStr]) -> Serving {
        Serving::listening(db, "127.0.0.1:0", extra, Stdio::inherit())
    }

    /// `outbox --db DB serve --listen LISTEN EXTRA…`, its standard error to `stderr`,
    /// once it listens.
    pub fn listening(
        db: impl AsRef<OsStr>,
        listen: &str,
        extra: &[&OsStr],
        stderr: impl Into<Stdio>,
    ) -> Serving {
        match Serving::try_listening(db, listen, extra, stderr) {
            Ok(serving) => serving,
            Err(refused) => panic!(
                "outbox serve --listen {listen} did not start: {}",
                String::from_utf8_lossy(&refused.stderr)
            ),
        }
    }

    /// As [`listening`](Self::listening), or what it printed when it refused to start.
    pub fn try_listening(
        db: impl AsRef<OsStr>,
        listen: &str,
        extra: &[&OsStr],
        stderr: impl Into<Stdio>,
    ) -> Result<Serving, Output> {
        let mut child = Command::new(assert_cmd::cargo::cargo_bin("outbox"))
            .arg("--db")
            .arg(db)
            .args(["serve", "--listen", listen])
            .args(extra)
            .env_remove("OUTBOX_DB")
            .env_remove("OUTBOX_CONSOLE_TOKEN_FILE")
            .stdout(Stdio::piped())
            .stderr(stderr)
            .spawn()
            .expect("spawn outbox serve");
        let mut banner = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut banner)
            .unwrap();
        if banner.is_empty() {
            return Err(child.wait_with_output().unwrap());
        }
        let addr = banner
            .split_whitespace()
            .nth(1)
            .and_then(|url| url.strip_suffix("/metrics,"))
            .map(|url| url.strip_prefix("http://").unwrap_or(url))
            .unwrap_or_else(|| panic!("no address in {banner:?}"))
            .to_owned();
        Ok(Serving {
            child,
            addr,
            banner,
        })
    }

    /// Its process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// `http://host:port`.
    pub fn base(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Its port.
    pub fn port(&self) -> u16 {
        self.addr.rsplit(':').next().unwrap().parse().unwrap()
    }

    /// Sends `request` as written (`Connection: close` is up to it) to 127.0.0.1 on its
    /// port, and reads the whole answer, waiting at most 10 s.
    pub fn raw(&self, request: &str) -> String {
        self.raw_from(IpAddr::from([127, 0, 0, 1]), request)
    }

    /// As [`raw`](Self::raw), from the local address `from` (any address of the
    /// loopback, `127.0.0.0/8`, is this machine's), to its listen address (127.0.0.1
    /// if it listens on every interface).
    pub fn raw_from(&self, from: IpAddr, request: &str) -> String {
        let mut stream = self.connect_from(from);
        stream.write_all(request.as_bytes()).unwrap();
        read_answer(&mut stream)
    }

    /// A connection from the local address `from`, nothing sent.
    pub fn connect_from(&self, from: IpAddr) -> std::net::TcpStream {
        connect_from(from, self.target())
    }

    /// Where a client connects to reach it over TCP.
    pub fn target(&self) -> SocketAddr {
        let addr: SocketAddr = self.addr.parse().expect("a TCP listener");
        if addr.ip().is_unspecified() {
            SocketAddr::from(([127, 0, 0, 1], addr.port()))
        } else {
            addr
        }
    }

    /// Sends `request` over its Unix socket, and reads the whole answer.
    #[cfg(unix)]
    pub fn raw_unix(&self, request: &str) -> String {
        let path = self.addr.strip_prefix("unix:").expect("a Unix socket");
        let mut stream = std::os::unix::net::UnixStream::connect(path).unwrap();
        stream
            .set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        stream.write_all(request.as_bytes()).unwrap();
        let mut answer = Vec::new();
        let _ = stream.read_to_end(&mut answer);
        String::from_utf8_lossy(&answer).into_owned()
    }
}

/// A TCP connection to `to` from the local address `from` (any port), reading with a
/// 10 s timeout.
pub fn connect_from(from: IpAddr, to: SocketAddr) -> std::net::TcpStream {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .build()
        .unwrap();
    let stream = runtime.block_on(async {
        let socket = match from {
            IpAddr::V4(_) => tokio::net::TcpSocket::new_v4(),
            IpAddr::V6(_) => tokio::net::TcpSocket::new_v6(),
        }
        .unwrap();
        socket.bind(SocketAddr::new(from, 0)).unwrap();
        socket.connect(to).await.unwrap().into_std().unwrap()
    });
    stream.set_nonblocking(false).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    stream
}

/// The whole answer on `stream`, until the server closes it or 10 s pass.
pub fn read_answer(stream: &mut impl Read) -> String {
    let mut answer = Vec::new();
    let _ = stream.read_to_end(&mut answer);
    String::from_utf8_lossy(&answer).into_owned()
}

impl Drop for Serving {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
