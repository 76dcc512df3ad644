//! A loopback proxy between the outbox and the test server that can lose a
//! connection at the worst moments: right after a `COMMIT` reached the server (the
//! transaction committed, its answer is lost), right before (the server rolls it
//! back), swallow a commit and all after it (a network cut nobody reports), or every
//! connection at once, and refuse new ones for a while (a network that is down).
//!
//! It reads the client's side of the protocol message by message (a startup message,
//! then a type byte and a length per message), so it cuts exactly at a commit sent as
//! a simple query, as the outbox sends it.
#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

/// What to do with the next commit that passes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cut {
    /// Let it pass.
    Nothing,
    /// Pass it to the server, then cut the connection before its answer comes back.
    AfterCommit,
    /// Cut the connection instead of passing it on.
    BeforeCommit,
    /// Swallow it, and everything the client sends after it, without closing anything:
    /// the client's messages fall into a hole (a network cut that nobody reports) while
    /// what the server says still reaches the client.
    SwallowCommit,
}

#[derive(Default)]
struct State {
    next_commit: Mutex<Option<Cut>>,
    refuse: AtomicBool,
    cut: AtomicUsize,
    live: Mutex<Vec<Stream>>,
}

/// A running proxy (its threads live as long as the test process).
pub struct Proxy {
    port: u16,
    user: String,
    dbname: String,
    state: Arc<State>,
}

impl Proxy {
    /// A proxy in front of the test server, or `None` without one.
    pub fn start() -> Option<Proxy> {
        let url = super::postgres::server_url()?;
        let config: postgres::Config = url.parse().expect("the test server's URL");
        let upstream = Upstream::of(&config);
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind the proxy");
        let port = listener.local_addr().unwrap().port();
        let state = Arc::new(State::default());
        let shared = state.clone();
        std::thread::spawn(move || {
            for client in listener.incoming() {
                let Ok(client) = client else { continue };
                if shared.refuse.load(Ordering::SeqCst) {
                    drop(client);
                    continue;
                }
                let Ok(server) = upstream.connect() else {
                    continue;
                };
                let shared = shared.clone();
                std::thread::spawn(move || serve(Stream::Tcp(client), server, &shared));
            }
        });
        Some(Proxy {
            port,
            user: config.get_user().unwrap_or("postgres").to_owned(),
            dbname: config.get_dbname().unwrap_or("postgres").to_owned(),
            state,
        })
    }

    /// A URL through the proxy whose sessions use `schema` and carry `application`
    /// as their name (so a test can find their backends).
    pub fn url(&self, schema: &str, application: &str) -> String {
        format!(
            "postgresql://{}@127.0.0.1:{}/{}?application_name={application}&options=-c%20search_path%3D{schema}",
            self.user, self.port, self.dbname
        )
    }

    /// Cuts the connection of the next commit that passes, as `cut` says.
    pub fn cut_next_commit(&self, cut: Cut) {
        *self.state.next_commit.lock().unwrap() = Some(cut);
    }

    /// Whether the commit armed by [`cut_next_commit`](Self::cut_next_commit) has
    /// passed (and been cut).
    pub fn commit_cut(&self) -> bool {
        self.state.next_commit.lock().unwrap().is_none()
    }

    /// Refuses (closes at once) every new connection while `on`.
    pub fn refuse(&self, on: bool) {
        self.state.refuse.store(on, Ordering::SeqCst);
    }

    /// Cuts every open connection.
    pub fn cut_all(&self) {
        for s in self.state.live.lock().unwrap().drain(..) {
            s.shutdown();
        }
    }

    /// How many connections were cut so far.
    pub fn cuts(&self) -> usize {
        self.state.cut.load(Ordering::SeqCst)
    }
}

/// Where the server listens.
#[derive(Clone)]
enum Upstream {
    Unix(std::path::PathBuf),
    Tcp(String),
}

impl Upstream {
    fn of(config: &postgres::Config) -> Upstream {
        let port = config.get_ports().first().copied().unwrap_or(5432);
        match config.get_hosts().first() {
            Some(postgres::config::Host::Unix(dir)) => {
                Upstream::Unix(dir.join(format!(".s.PGSQL.{port}")))
            }
            Some(postgres::config::Host::Tcp(host)) => Upstream::Tcp(format!("{host}:{port}")),
            None => Upstream::Tcp(format!("localhost:{port}")),
        }
    }

    fn connect(&self) -> std::io::Result<Stream> {
        Ok(match self {
            Upstream::Unix(path) => Stream::Unix(UnixStream::connect(path)?),
            Upstream::Tcp(addr) => Stream::Tcp(TcpStream::connect(addr)?),
        })
    }
}

enum Stream {
    Tcp(TcpStream),
    Unix(UnixStream),
}

impl Stream {
    fn try_clone(&self) -> std::io::Result<Stream> {
        Ok(match self {
            Stream::Tcp(s) => Stream::Tcp(s.try_clone()?),
            Stream::Unix(s) => Stream::Unix(s.try_clone()?),
        })
    }

    fn shutdown(&self) {
        self.shutdown_as(Shutdown::Both);
    }

    fn shutdown_as(&self, how: Shutdown) {
        let _ = match self {
            Stream::Tcp(s) => s.shutdown(how),
            Stream::Unix(s) => s.shutdown(how),
        };
    }
}

impl Read for Stream {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        match self {
            Stream::Tcp(s) => s.read(buf),
            Stream::Unix(s) => s.read(buf),
        }
    }
}

impl Write for Stream {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        match self {
            Stream::Tcp(s) => s.write(buf),
            Stream::Unix(s) => s.write(buf),
        }
    }

    fn flush(&mut self) -> std::io::Result<()> {
        match self {
            Stream::Tcp(s) => s.flush(),
            Stream::Unix(s) => s.flush(),
        }
    }
}

/// Pumps one connection: the server's bytes back as they come, the client's message
/// by message, cutting at an armed commit.
fn serve(mut client: Stream, mut server: Stream, state: &State) {
    let (Ok(mut client_back), Ok(mut server_in)) = (client.try_clone(), server.try_clone()) else {
        return;
    };
    {
        let mut live = state.live.lock().unwrap();
        for s in [&client, &server] {
            if let Ok(s) = s.try_clone() {
                live.push(s);
            }
        }
    }
    std::thread::spawn(move || {
        let _ = std::io::copy(&mut server_in, &mut client_back);
        client_back.shutdown();
    });
    let close = |client: &Stream, server: &Stream| {
        server.shutdown();
        client.shutdown();
    };
    let cut = |client: &Stream, server: &Stream| {
        state.cut.fetch_add(1, Ordering::SeqCst);
        close(client, server);
    };
    // The startup message: a length (itself included), then the rest.
    let Some(startup) = read_sized(&mut client) else {
        return close(&client, &server);
    };
    if server.write_all(&startup).is_err() {
        return close(&client, &server);
    }
    loop {
        let mut kind = [0u8; 1];
        if client.read_exact(&mut kind).is_err() {
            return close(&client, &server);
        }
        let Some(message) = read_sized(&mut client) else {
            return close(&client, &server);
        };
        let is_commit = kind[0] == b'Q'
            && String::from_utf8_lossy(&message[4..])
                .trim_end_matches('\0')
                .trim_end()
                .ends_with("COMMIT");
        let armed = if is_commit {
            state.next_commit.lock().unwrap().take()
        } else {
            None
        };
        if armed == Some(Cut::BeforeCommit) {
            return cut(&client, &server);
        }
        if armed == Some(Cut::SwallowCommit) {
            state.cut.fetch_add(1, Ordering::SeqCst);
            while client.read(&mut [0u8; 4096]).is_ok_and(|n| n > 0) {}
            return close(&client, &server);
        }
        if armed == Some(Cut::AfterCommit) {
            // The client's side first, so no answer can reach it, then the commit. The
            // server's side is closed for its reading only: it runs what it was sent
            // (statements sent with the commit too) and its answers, which it can
            // still write, go nowhere — a network that lost them.
            client.shutdown();
            let _ = server.write_all(&kind);
            let _ = server.write_all(&message);
            let _ = server.flush();
            state.cut.fetch_add(1, Ordering::SeqCst);
            server.shutdown_as(Shutdown::Write);
            return;
        }
        if server.write_all(&kind).is_err() || server.write_all(&message).is_err() {
            return close(&client, &server);
        }
    }
}

/// A length-prefixed message (the 4-byte length counts itself), length included.
fn read_sized(stream: &mut Stream) -> Option<Vec<u8>> {
    let mut len = [0u8; 4];
    stream.read_exact(&mut len).ok()?;
    let n = u32::from_be_bytes(len) as usize;
    if !(4..=1 << 30).contains(&n) {
        return None;
    }
    let mut message = len.to_vec();
    message.resize(n, 0);
    stream.read_exact(&mut message[4..]).ok()?;
    Some(message)
}
