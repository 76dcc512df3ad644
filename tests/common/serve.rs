//! `outbox serve` started for a test on 127.0.0.1 (any free port), stopped when dropped.

use std::ffi::OsStr;
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};

/// A running `outbox serve`.
pub struct Serving {
    child: Child,
    /// Where it listens, `host:port`.
    pub addr: String,
    /// The first line it printed (what it serves, and whether the console may act).
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
        let addr = banner
            .split_whitespace()
            .nth(1)
            .and_then(|url| url.strip_prefix("http://"))
            .and_then(|url| url.strip_suffix("/metrics,"))
            .unwrap_or_else(|| panic!("no address in {banner:?}"))
            .to_owned();
        Serving {
            child,
            addr,
            banner,
        }
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
        use std::io::{Read, Write};
        let mut stream = std::net::TcpStream::connect(("127.0.0.1", self.port())).unwrap();
        stream
            .set_read_timeout(Some(std::time::Duration::from_secs(10)))
            .unwrap();
        stream.write_all(request.as_bytes()).unwrap();
        let mut answer = Vec::new();
        let _ = stream.read_to_end(&mut answer);
        String::from_utf8_lossy(&answer).into_owned()
    }
}

impl Drop for Serving {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
