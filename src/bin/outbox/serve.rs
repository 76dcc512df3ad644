//! `outbox serve`: the health snapshot over HTTP, for scrapers and load balancers, and
//! the operator console (`chunked_outbox::console`) under `/console`.
//!
//! Who can reach it decides what it shows: the console's pages go to the file's owner
//! alone without a token (over a Unix socket only that account can open,
//! `--listen unix:PATH`), and behind the token's sign-in everywhere else; a console
//! reachable from other machines (a non-loopback address, a name a proxy uses) does not
//! start without a token, nor take a sign-in over plain HTTP unless told so by name
//! (`--allow-plain-http-sign-in`).
//!
//! Meant to be reachable on a network, so no client can hold it up or shut another
//! out: each connection is a task of its own (a client that pipelines requests and
//! never reads its answers stalls only its own connection), a request's head must
//! arrive whole within the header timeout and fit in a bounded buffer, a connection
//! lives at most [`CONNECTION_LIFETIME`], and the connections open at once are bounded
//! overall and per client, with room kept for a client that holds none; once they run
//! short, connections idle for [`SHED_IDLE`] are closed. A form's body must arrive
//! within [`ServeArgs::body_timeout`] (408 after it), and the bodies read at once are
//! bounded the same way (503 past that).
//!
//! It answers only to its own names (`console::AllowedHosts`: the loopback names and the
//! port, the listen address, `--allowed-host`), so a web page cannot read it through
//! DNS rebinding.

use std::collections::HashMap;
use std::convert::Infallible;
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use chunked_outbox::Outbox;
use chunked_outbox::console::{self, AllowedHosts, Console, FORWARDING_HEADERS};
use chunked_outbox::monitoring::Endpoint;
use clap::Args;
use http_body_util::{BodyExt, Full, Limited};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::sync::watch;

use crate::{CliResult, Thresholds};

/// Connections open at once; one more is closed as soon as it is accepted.
const MAX_CONNECTIONS: usize = 256;
/// Connections one client may hold at once (an IPv4 address, or an IPv6 /64).
const CONNECTIONS_PER_CLIENT: usize = 32;
/// Connection slots kept for clients that hold none: `/healthz`, `/metrics` and a
/// sign-in always find one.
const CONNECTIONS_KEPT: usize = 16;
/// Connections open at once past which idle ones are closed after [`SHED_IDLE`].
const CONNECTIONS_SHORT: usize = MAX_CONNECTIONS * 3 / 4;
/// How long a connection may sit idle between requests once slots run short.
const SHED_IDLE: Duration = Duration::from_secs(2);
/// The longest a connection stays open, however busy (a scraper reconnects).
const CONNECTION_LIFETIME: Duration = Duration::from_secs(60);
/// The most a request's head may take in memory (hyper's smallest read buffer); a
/// longer one is answered 431 and the connection closed.
const MAX_HEAD_BYTES: usize = 8 * 1024;
/// Forms whose bodies are read at once; one more is answered 503 at once, so slow
/// bodies hold at most this many connections.
const MAX_BODY_READS: usize = 32;
/// Form bodies one client may have arriving at once.
const BODIES_PER_CLIENT: usize = 4;
/// Body slots kept for clients reading none.
const BODIES_KEPT: usize = 4;

#[derive(Args)]
pub struct ServeArgs {
    /// Where to listen: `host:port` (port 0: any free port; the first line printed
    /// names it), or `unix:PATH` for a Unix socket only this account can open, where the
    /// console needs no token. The loopback address by default.
    #[arg(long, value_name = "ADDR", default_value = "127.0.0.1:9464")]
    listen: String,
    /// Another name this server answers to, `host` or `host:port` (repeatable): a
    /// request whose Host header names neither it, the loopback names nor the listen
    /// address is refused (421), so no web page can read it through DNS rebinding.
    /// Give the name a reverse proxy or a scraper uses. A name other than a loopback
    /// name makes the console reachable from other machines: it then needs a token.
    #[arg(long, value_name = "NAME")]
    allowed_host: Vec<String>,
    /// Serve /metrics, /healthz and /health.json only: no console.
    #[arg(long, conflicts_with_all = ["console_token_file", "secure_cookie", "allow_plain_http_sign_in"])]
    no_console: bool,
    /// TLS ends in front of this server (a proxy that ends it): sign-ins from other
    /// machines are taken, and the session cookie is marked Secure.
    #[arg(long)]
    secure_cookie: bool,
    /// Take sign-ins from other machines over plain HTTP, where the token crosses the
    /// network in clear: only on a network you trust with it.
    #[arg(long)]
    allow_plain_http_sign_in: bool,
    /// A proxy in front (its address; repeatable) whose Forwarded or X-Forwarded-For
    /// header names the client: failed sign-ins, connections and forms are then counted
    /// per client, not for the proxy as a whole. Never believed from anyone else.
    #[arg(long, value_name = "ADDR")]
    trusted_proxy: Vec<IpAddr>,
    /// How long a client may take to send a request's head; a connection that has not
    /// sent one whole by then is closed (such as 10s, 500ms).
    #[arg(long, value_name = "DURATION", default_value = "10s", value_parser = humantime::parse_duration)]
    header_timeout: Duration,
    /// How long a client may take to send a form's body once its head arrived (408
    /// after it).
    #[arg(long, value_name = "DURATION", default_value = "10s", value_parser = humantime::parse_duration)]
    body_timeout: Duration,
    /// A file holding the console's token (at least 16 characters, 10 of them
    /// different: `openssl rand -hex 32 > token && chmod 600 token`): every page then
    /// needs the sign-in, and whoever signs in may requeue, resolve, resend and dismiss.
    /// Without it the console shows nothing over TCP, and is read-only on a Unix
    /// socket. A file readable by others is refused; a file, so the token stays out of
    /// the process list and the shell's history.
    #[arg(long, value_name = "PATH", env = "OUTBOX_CONSOLE_TOKEN_FILE")]
    console_token_file: Option<PathBuf>,
    #[command(flatten)]
    thresholds: Thresholds,
}

impl ServeArgs {
    /// Whether the console may act (a token file is given): the outbox is opened for
    /// writing then.
    pub fn takes_actions(&self) -> bool {
        self.console_token_file.is_some() && !self.no_console
    }
}

/// Where `serve` listens.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Listen {
    Tcp(SocketAddr),
    Unix(PathBuf),
}

impl std::fmt::Display for Listen {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Listen::Tcp(addr) => write!(f, "http://{addr}"),
            Listen::Unix(path) => write!(f, "unix:{}", path.display()),
        }
    }
}

/// Answers requests until the process is stopped. Each answer reads a fresh snapshot,
/// so it shows what every process on the file has done.
pub fn serve(outbox: &Outbox, args: &ServeArgs) -> CliResult<u8> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("outbox-serve")
        .enable_all()
        .build()?;
    let listener = runtime.block_on(Listener::bind(&args.listen))?;
    let listen = listener.listen()?;
    let hosts = allowed_hosts(&listen, &args.allowed_host)?;
    let (console, said) = mounted_console(outbox, args, &listen, &hosts)?;
    println!("serving {listen}/metrics, /healthz, /health.json; {said}; answering to {hosts}");
    std::io::Write::flush(&mut std::io::stdout())?;
    let (short, pressure) = watch::channel(false);
    let pages = Arc::new(Pages {
        endpoint: Endpoint::new(outbox.clone(), args.thresholds.to_library()),
        console,
        hosts,
        bodies: Slots::new(MAX_BODY_READS, BODIES_PER_CLIENT, BODIES_KEPT, None),
        body_timeout: args.body_timeout,
        header_timeout: args.header_timeout,
        connections: Slots::new(
            MAX_CONNECTIONS,
            CONNECTIONS_PER_CLIENT,
            CONNECTIONS_KEPT,
            Some((CONNECTIONS_SHORT, short)),
        ),
        pressure,
        trusted_proxies: args.trusted_proxy.clone(),
    });
    runtime.block_on(accept(listener, pages))
}

/// The names a request to `listen` may give as its host: the loopback names on its
/// port, the address itself (any address, if it listens on every interface), and
/// `extra`. On a Unix socket, the loopback names on any port (what `curl
/// --unix-socket` sends) and `extra`.
fn allowed_hosts(listen: &Listen, extra: &[String]) -> CliResult<AllowedHosts> {
    let mut hosts = match listen {
        Listen::Unix(_) => AllowedHosts::loopback(None),
        Listen::Tcp(addr) if addr.ip().is_unspecified() => {
            AllowedHosts::loopback(Some(addr.port())).any_address(addr.port())
        }
        Listen::Tcp(addr) => AllowedHosts::loopback(Some(addr.port())).allow(&addr.to_string())?,
    };
    for name in extra {
        hosts = hosts.allow(name)?;
    }
    Ok(hosts)
}

/// Why the console at `listen`, answering to `names`, is reachable from other
/// machines; `None` if it is not.
fn exposed(listen: &Listen, names: &[String]) -> Option<String> {
    if let Listen::Tcp(addr) = listen
        && !addr.ip().is_loopback()
    {
        return Some(format!("{} is not a loopback address", addr.ip()));
    }
    let named = names.iter().find(|name| !console::is_loopback_name(name));
    named.map(|name| format!("--allowed-host {name} is a name a proxy or another machine uses"))
}

/// The console, if it is mounted here, and what the banner says of who can read and
/// act; an error, naming the flag that mends it, for a console that would show the
/// replies to more people than its flags say.
fn mounted_console(
    outbox: &Outbox,
    args: &ServeArgs,
    listen: &Listen,
    hosts: &AllowedHosts,
) -> CliResult<(Option<Console>, String)> {
    if args.no_console {
        return Ok((None, "no console (--no-console)".into()));
    }
    let token = args.console_token_file.as_deref();
    let exposure = exposed(listen, &args.allowed_host);
    if let (Some(why), None) = (&exposure, token) {
        return Err(format!(
            "the console would be reachable from other machines ({why}), and it shows every \
             reply: give --console-token-file FILE to put it behind a sign-in, or \
             --no-console to serve the health endpoints alone"
        )
        .into());
    }
    for (set, flag) in [
        (args.secure_cookie, "--secure-cookie"),
        (args.allow_plain_http_sign_in, "--allow-plain-http-sign-in"),
    ] {
        if set && token.is_none() {
            return Err(format!(
                "{flag} is about the console's sign-in, and there is none without a token: \
                 give --console-token-file FILE"
            )
            .into());
        }
    }
    let tls = args.secure_cookie;
    if let (Some(why), false, false) = (&exposure, tls, args.allow_plain_http_sign_in) {
        return Err(format!(
            "a sign-in from another machine ({why}) would send the console's token over \
             plain HTTP: put TLS in front (a proxy that ends it) and give --secure-cookie, \
             or accept plain HTTP by name with --allow-plain-http-sign-in"
        )
        .into());
    }
    let mut console = Console::new(outbox.clone())
        .with_allowed_hosts(hosts.clone())
        .with_secure_cookie(tls)
        .with_plain_http_sign_in(args.allow_plain_http_sign_in)
        .with_trusted_proxies(args.trusted_proxy.iter().copied());
    if let Some(path) = token {
        console = console.with_actions(&read_token(path)?)?;
    }
    let at = console::BASE;
    let said = match (listen, token, &exposure) {
        (Listen::Unix(_), None, _) => format!(
            "the console at {at}, read-only, for this account alone (a socket only it can open)"
        ),
        (Listen::Unix(_), Some(_), _) => format!(
            "the console at {at}, behind the sign-in, on a socket only this account can open"
        ),
        (Listen::Tcp(_), None, _) => format!(
            "the console at {at} shows nothing: without a token any account of this machine \
             could read it (--console-token-file puts it behind a sign-in; --listen unix:PATH \
             shows it to this account alone)"
        ),
        (Listen::Tcp(_), Some(_), None) => format!(
            "the console at {at}, behind the sign-in, for whoever on this machine has the token"
        ),
        (Listen::Tcp(_), Some(_), Some(_)) if tls => format!(
            "the console at {at}, behind the sign-in, for whoever has the token, signing in \
             over TLS only"
        ),
        (Listen::Tcp(_), Some(_), Some(_)) => format!(
            "the console at {at}, behind the sign-in, for whoever has the token; sign-ins over \
             plain HTTP taken (--allow-plain-http-sign-in: the token crosses the network in \
             clear)"
        ),
    };
    Ok((Some(console), said))
}

/// The token in the file at `path`, which nobody but its owner may read or write.
fn read_token(path: &std::path::Path) -> CliResult<String> {
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(path)
            .map_err(|e| format!("cannot read the console token file {}: {e}", path.display()))?
            .permissions()
            .mode();
        if mode & 0o077 != 0 {
            return Err(format!(
                "the console token file {} may be read or written by others (mode {:o}): \
                 `chmod 600 {}` keeps it its owner's",
                path.display(),
                mode & 0o777,
                path.display()
            )
            .into());
        }
    }
    Ok(std::fs::read_to_string(path)
        .map_err(|e| format!("cannot read the console token file {}: {e}", path.display()))?)
}

/// What the server answers: the health endpoint and the console (under
/// [`console::BASE`], when mounted), to the names in `hosts`.
struct Pages {
    endpoint: Endpoint,
    console: Option<Console>,
    hosts: AllowedHosts,
    /// A slot per form body being read.
    bodies: Arc<Slots>,
    body_timeout: Duration,
    header_timeout: Duration,
    /// A slot per open connection.
    connections: Arc<Slots>,
    /// Whether connection slots run short (idle connections are closed then).
    pressure: watch::Receiver<bool>,
    /// Proxies whose connections count as many clients' (no per-client bound).
    trusted_proxies: Vec<IpAddr>,
}

/// A bounded number of slots, overall and per client, with a few kept for clients that
/// hold none, so no client can shut another out by holding them all.
struct Slots {
    limit: usize,
    per_client: usize,
    kept: usize,
    /// Past how many taken slots they run short, and whom to tell.
    short: Option<(usize, watch::Sender<bool>)>,
    taken: Mutex<Taken>,
}

#[derive(Default)]
struct Taken {
    total: usize,
    by_client: HashMap<Option<IpAddr>, usize>,
}

/// A slot held until dropped.
struct Slot {
    slots: Arc<Slots>,
    client: Option<IpAddr>,
}

impl Slots {
    fn new(
        limit: usize,
        per_client: usize,
        kept: usize,
        short: Option<(usize, watch::Sender<bool>)>,
    ) -> Arc<Slots> {
        Arc::new(Slots {
            limit,
            per_client,
            kept,
            short,
            taken: Mutex::default(),
        })
    }

    /// A slot for `client` (counted by [`console::client_key`]), unless every slot is
    /// taken, it holds its share already (`bounded`: a trusted proxy's is not), or
    /// only the slots kept for clients holding none are left and it holds one.
    fn take(self: &Arc<Self>, client: Option<IpAddr>, bounded: bool) -> Option<Slot> {
        let client = console::client_key(client);
        let mut taken = self.lock();
        let held = taken.by_client.get(&client).copied().unwrap_or(0);
        if taken.total >= self.limit
            || (bounded && held >= self.per_client)
            || (held > 0 && taken.total >= self.limit - self.kept)
        {
            return None;
        }
        taken.total += 1;
        *taken.by_client.entry(client).or_default() += 1;
        self.tell(taken.total);
        Some(Slot {
            slots: self.clone(),
            client,
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Taken> {
        self.taken
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Tells whoever watches whether `total` taken slots are running short.
    fn tell(&self, total: usize) {
        if let Some((at, short)) = &self.short {
            short.send_if_modified(|was| std::mem::replace(was, total >= *at) != (total >= *at));
        }
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut taken = self.slots.lock();
        taken.total -= 1;
        if let Some(held) = taken.by_client.get_mut(&self.client) {
            *held -= 1;
            if *held == 0 {
                taken.by_client.remove(&self.client);
            }
        }
        self.slots.tell(taken.total);
    }
}

/// A TCP listener, or a Unix socket only this account can open.
enum Listener {
    Tcp(tokio::net::TcpListener),
    #[cfg(unix)]
    Unix {
        listener: tokio::net::UnixListener,
        path: PathBuf,
        /// The account the socket belongs to: a peer running as anyone else is closed.
        owner: u32,
    },
}

impl Listener {
    async fn bind(listen: &str) -> CliResult<Listener> {
        if let Some(path) = listen.strip_prefix("unix:") {
            #[cfg(unix)]
            return Listener::bind_unix(PathBuf::from(path));
            #[cfg(not(unix))]
            return Err(format!("cannot listen on {listen}: Unix sockets need a Unix").into());
        }
        Ok(Listener::Tcp(
            tokio::net::TcpListener::bind(listen)
                .await
                .map_err(|e| format!("cannot listen on {listen}: {e}"))?,
        ))
    }

    /// Binds a socket at `path` that only its owner may open: mode 0600, and every
    /// peer's credentials checked (so the moment before the mode is set, and any later
    /// change of it, admits nobody else). A socket left there by an earlier run is
    /// replaced; any other file is not.
    #[cfg(unix)]
    fn bind_unix(path: PathBuf) -> CliResult<Listener> {
        use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
        let cannot = |e: std::io::Error| format!("cannot listen on unix:{}: {e}", path.display());
        match std::fs::symlink_metadata(&path) {
            Ok(found) if found.file_type().is_socket() => {
                std::fs::remove_file(&path).map_err(cannot)?
            }
            Ok(_) => {
                return Err(format!(
                    "cannot listen on unix:{}: a file that is not a socket is there",
                    path.display()
                )
                .into());
            }
            Err(_) => {}
        }
        let listener = tokio::net::UnixListener::bind(&path).map_err(cannot)?;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).map_err(cannot)?;
        let owner = std::fs::metadata(&path).map_err(cannot)?.uid();
        Ok(Listener::Unix {
            listener,
            path,
            owner,
        })
    }

    fn listen(&self) -> CliResult<Listen> {
        Ok(match self {
            Listener::Tcp(listener) => Listen::Tcp(listener.local_addr()?),
            #[cfg(unix)]
            Listener::Unix { path, .. } => Listen::Unix(path.clone()),
        })
    }
}

/// Who is at the other end of a connection.
#[derive(Clone, Copy)]
struct Peer {
    address: Option<IpAddr>,
    /// A Unix socket's peer running as the socket's owner.
    owner: bool,
}

async fn accept(listener: Listener, pages: Arc<Pages>) -> CliResult<u8> {
    loop {
        let accepted = match &listener {
            Listener::Tcp(listener) => listener.accept().await.map(|(stream, addr)| {
                let peer = Peer {
                    address: Some(addr.ip()),
                    owner: false,
                };
                (Box::new(stream) as Box<dyn Io>, Some(peer))
            }),
            #[cfg(unix)]
            Listener::Unix {
                listener, owner, ..
            } => listener.accept().await.map(|(stream, _)| {
                let own = stream.peer_cred().is_ok_and(|c| c.uid() == *owner);
                let peer = own.then_some(Peer {
                    address: None,
                    owner: true,
                });
                (Box::new(stream) as Box<dyn Io>, peer)
            }),
        };
        let (stream, peer) = match accepted {
            Ok(accepted) => accepted,
            // Out of file descriptors, a connection reset before it was taken, ...:
            // the next one may do, and a tight loop would not help.
            Err(e) => {
                eprintln!("outbox serve: accept failed: {e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        // Another account on the socket: closed at once.
        let Some(peer) = peer else { continue };
        let bounded = !peer.owner
            && !peer
                .address
                .is_some_and(|a| pages.trusted_proxies.contains(&a));
        let Some(slot) = pages.connections.take(peer.address, bounded) else {
            continue; // dropped: closed at once
        };
        tokio::spawn(connection(stream, peer, pages.clone(), slot));
    }
}

/// What a connection is read and written through.
trait Io: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> Io for T {}

/// Serves one connection for at most [`CONNECTION_LIFETIME`], closing it once it has
/// been idle for [`SHED_IDLE`] while connection slots run short.
async fn connection(stream: Box<dyn Io>, peer: Peer, pages: Arc<Pages>, _slot: Slot) {
    let activity = Arc::new(Activity::new());
    let mut pressure = pages.pressure.clone();
    let header_timeout = pages.header_timeout;
    let service = {
        let activity = activity.clone();
        service_fn(move |request: hyper::Request<hyper::body::Incoming>| {
            let pages = pages.clone();
            let busy = activity.enter();
            async move {
                let answer = answer(pages, peer, request).await;
                drop(busy);
                Ok::<_, Infallible>(answer)
            }
        })
    };
    let connection = http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(header_timeout)
        .max_buf_size(MAX_HEAD_BYTES)
        .serve_connection(TokioIo::new(stream), service);
    tokio::pin!(connection);
    // A client that went away, or outstayed its time, is its own business.
    tokio::select! {
        _ = connection.as_mut() => return,
        _ = tokio::time::sleep(CONNECTION_LIFETIME) => return,
        () = idle_while_short(&activity, &mut pressure) => {}
    }
    connection.as_mut().graceful_shutdown();
    let _ = tokio::time::timeout(SHED_IDLE, connection).await;
}

/// Returns once the connection has been idle for [`SHED_IDLE`] while slots run short.
async fn idle_while_short(activity: &Activity, pressure: &mut watch::Receiver<bool>) {
    loop {
        if pressure.wait_for(|short| *short).await.is_err() {
            return std::future::pending().await;
        }
        match activity.idle_for() {
            Some(idle) if idle >= SHED_IDLE => return,
            Some(idle) => tokio::time::sleep(SHED_IDLE - idle).await,
            None => tokio::time::sleep(SHED_IDLE).await,
        }
    }
}

/// Whether a connection is answering a request, and since when it has not been.
struct Activity {
    busy: AtomicUsize,
    since: Mutex<Instant>,
}

/// A request being answered, until dropped.
struct Busy(Arc<Activity>);

impl Activity {
    fn new() -> Activity {
        Activity {
            busy: AtomicUsize::new(0),
            since: Mutex::new(Instant::now()),
        }
    }

    fn enter(self: &Arc<Self>) -> Busy {
        self.busy.fetch_add(1, Ordering::SeqCst);
        Busy(self.clone())
    }

    /// How long no request has been answered; `None` while one is.
    fn idle_for(&self) -> Option<Duration> {
        if self.busy.load(Ordering::SeqCst) > 0 {
            return None;
        }
        Some(
            self.since
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .elapsed(),
        )
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        *self
            .0
            .since
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Instant::now();
        self.0.busy.fetch_sub(1, Ordering::SeqCst);
    }
}

/// The answer to `request` from `peer`, read on the blocking pool (a snapshot is a
/// database read): refused if it names another host, else the console's pages (with
/// their own headers) or the health endpoint's.
async fn answer(
    pages: Arc<Pages>,
    peer: Peer,
    request: hyper::Request<hyper::body::Incoming>,
) -> hyper::Response<Full<Bytes>> {
    let header = |name: &str| {
        request
            .headers()
            .get(name)
            .and_then(|c| c.to_str().ok())
            .map(str::to_owned)
    };
    let host = header("host");
    if !host
        .as_deref()
        .is_some_and(|host| pages.hosts.permits(host))
    {
        return plain(421, "this server does not answer to that host name\n");
    }
    let cookie = header("cookie");
    let origin = header("origin");
    let fetch_site = header("sec-fetch-site");
    let forwarded = FORWARDING_HEADERS.iter().find_map(|name| header(name));
    let target = request
        .uri()
        .path_and_query()
        .map_or("/", |p| p.as_str())
        .to_owned();
    let method = request.method().as_str().to_owned();
    let path = target.split('?').next().unwrap_or_default().to_owned();
    let console = pages.console.as_ref().filter(|_| {
        path.strip_prefix(console::BASE)
            .is_some_and(|rest| rest.is_empty() || rest.starts_with('/'))
    });
    // A form's body, read only for the console, only up to what a form may be, and only
    // for as long as a body may take; a few at once, fewer from one client.
    let (body, client) = match console {
        Some(console) if method == "POST" => {
            let asked = console::Request {
                peer: peer.address,
                forwarded: forwarded.as_deref(),
                ..console::Request::get(&target)
            };
            let client = console.client(&asked);
            let Some(_reading) = pages.bodies.take(client, true) else {
                return plain(503, "busy: too many forms arriving at once\n");
            };
            let limited = Limited::new(request.into_body(), console::MAX_FORM_BYTES);
            match tokio::time::timeout(pages.body_timeout, limited.collect()).await {
                Ok(Ok(body)) => (body.to_bytes(), client),
                Ok(Err(_)) => return plain(413, "form too large or cut off\n"),
                Err(_) => return plain(408, "the form's body did not arrive in time\n"),
            }
        }
        _ => (Bytes::new(), peer.address),
    };
    let in_console = console.is_some();
    let read = move || match (&pages.console, in_console) {
        (Some(console), true) => {
            let asked = console::Request {
                method: &method,
                target: &target,
                host: host.as_deref(),
                cookie: cookie.as_deref(),
                origin: origin.as_deref(),
                fetch_site: fetch_site.as_deref(),
                peer: peer.address,
                owner: peer.owner,
                forwarded: forwarded.as_deref(),
                https: false,
                body: &body,
            };
            let page = console.respond(&asked);
            if let Some(line) = sign_in_note(&method, &path, page.status, client) {
                eprintln!("{line}");
            }
            (page.status, page.headers, page.body)
        }
        _ => {
            let answer = pages.endpoint.respond(&target);
            let headers = vec![("Content-Type", answer.content_type.to_owned())];
            (answer.status, headers, answer.body)
        }
    };
    let Ok((status, headers, body)) = tokio::task::spawn_blocking(read).await else {
        return plain(500, "fail: the page could not be read\n");
    };
    let mut response = hyper::Response::builder().status(status);
    for (name, value) in headers {
        response = response.header(name, value);
    }
    response
        .body(Full::new(Bytes::from(body)))
        .unwrap_or_else(|_| plain(500, "fail\n"))
}

fn plain(status: u16, text: &'static str) -> hyper::Response<Full<Bytes>> {
    let mut response = hyper::Response::new(Full::new(Bytes::from_static(text.as_bytes())));
    *response.status_mut() = hyper::StatusCode::from_u16(status).unwrap_or_default();
    response
}

/// The line on stderr for an answer to a sign-in: a refused token, or one made to wait;
/// `None` for every other answer.
fn sign_in_note(method: &str, path: &str, status: u16, client: Option<IpAddr>) -> Option<String> {
    if method != "POST" || path != format!("{}/sign-in", console::BASE) {
        return None;
    }
    let peer = client.map_or_else(|| "this account's socket".to_owned(), |c| c.to_string());
    match status {
        403 => Some(format!("outbox serve: a sign-in from {peer} was refused")),
        429 => Some(format!(
            "outbox serve: a sign-in from {peer} waits: too many wrong tokens lately"
        )),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tcp(addr: &str) -> Listen {
        Listen::Tcp(addr.parse().unwrap())
    }

    /// Every name the banner prints is answered; a listener on every interface answers
    /// any address on its port, and a name only when allowed.
    #[test]
    fn every_name_the_banner_prints_is_answered() {
        for (listen, extra) in [
            ("10.0.0.5:9464", vec![]),
            ("127.0.0.1:9464", vec![]),
            ("127.0.0.2:9464", vec![]),
            ("[::1]:9464", vec![]),
            ("127.0.0.1:80", vec!["box.example".to_owned()]),
            ("127.0.0.1:9464", vec!["box.example:443".to_owned()]),
        ] {
            let hosts = allowed_hosts(&tcp(listen), &extra).unwrap();
            let printed = hosts.to_string();
            for name in printed.split(", ") {
                let name = name.replace(":*", ":8080");
                assert!(hosts.permits(&name), "{listen}: {name} of {printed}");
            }
            assert!(hosts.permits(listen), "{listen}");
            assert!(!hosts.permits("rebind.example:9464"), "{listen}");
        }
        let one = allowed_hosts(&tcp("10.0.0.5:9464"), &[]).unwrap();
        assert!(!one.permits("10.0.0.6:9464"));
        assert!(
            !allowed_hosts(&tcp("127.0.0.1:9464"), &[])
                .unwrap()
                .permits("10.0.0.5:9464")
        );
        let every = allowed_hosts(&tcp("0.0.0.0:9464"), &["box.example".into()]).unwrap();
        assert!(every.permits("10.0.0.6:9464") && every.permits("box.example"));
        assert!(
            every
                .to_string()
                .ends_with("box.example:*, any address:9464"),
            "{every}"
        );
        // On port 80 a Host without a port is what browsers and curl send.
        let eighty = allowed_hosts(&tcp("127.0.0.1:80"), &[]).unwrap();
        assert!(eighty.permits("localhost") && eighty.permits("127.0.0.1"));
        assert!(
            !allowed_hosts(&tcp("127.0.0.1:81"), &[])
                .unwrap()
                .permits("localhost")
        );
        let socket = allowed_hosts(&Listen::Unix("/run/o.sock".into()), &[]).unwrap();
        assert!(socket.permits("localhost") && !socket.permits("rebind.example"));
    }

    /// Reachable from other machines: a non-loopback address, or a name other than a
    /// loopback name.
    #[test]
    fn exposure_is_the_address_or_a_name_not_of_the_loopback() {
        assert_eq!(exposed(&tcp("127.0.0.1:1"), &[]), None);
        assert_eq!(exposed(&tcp("127.0.0.2:1"), &[]), None);
        assert_eq!(
            exposed(&tcp("[::1]:1"), &["localhost:9".into(), "127.0.0.3".into()]),
            None
        );
        assert_eq!(exposed(&Listen::Unix("/s".into()), &[]), None);
        assert!(exposed(&tcp("0.0.0.0:1"), &[]).unwrap().contains("0.0.0.0"));
        assert!(
            exposed(&tcp("10.0.0.5:1"), &[])
                .unwrap()
                .contains("10.0.0.5")
        );
        let named = exposed(
            &tcp("127.0.0.1:1"),
            &["localhost".into(), "box.example".into()],
        );
        assert!(named.unwrap().contains("--allowed-host box.example"));
        assert!(exposed(&Listen::Unix("/s".into()), &["box.example".into()]).is_some());
    }

    /// Slots are bounded overall and per client; the last few go only to a client that
    /// holds none; a trusted proxy is not bounded per client; a slot dropped is free
    /// again; running short is told, and told again when it ends.
    #[test]
    fn no_client_holds_another_out_of_the_slots() {
        let (short, watching) = watch::channel(false);
        let slots = Slots::new(10, 3, 2, Some((6, short)));
        let a = Some(IpAddr::from([10, 0, 0, 1]));
        let held: Vec<Slot> = (0..3).map(|_| slots.take(a, true).unwrap()).collect();
        assert!(slots.take(a, true).is_none(), "its share");
        // The same /64 of IPv6 is one client.
        let v6 = |last: u16| Some(IpAddr::from([0x2001, 0xdb8, 0, 1, 0, 0, 0, last]));
        let mut more: Vec<Slot> = (1..=3).map(|n| slots.take(v6(n), true).unwrap()).collect();
        assert!(slots.take(v6(9), true).is_none());
        assert!(*watching.borrow(), "6 of 10: short");
        let b = Some(IpAddr::from([10, 0, 0, 2]));
        more.push(slots.take(b, true).unwrap());
        more.push(slots.take(b, true).unwrap());
        assert_eq!(slots.lock().total, 8);
        // The last two are kept for clients holding none.
        assert!(slots.take(b, true).is_none());
        assert!(
            slots.take(a, false).is_none(),
            "unbounded, but it holds some"
        );
        let c = slots.take(Some(IpAddr::from([10, 0, 0, 3])), true).unwrap();
        let d = slots.take(Some(IpAddr::from([10, 0, 0, 4])), true).unwrap();
        assert!(
            slots
                .take(Some(IpAddr::from([10, 0, 0, 5])), true)
                .is_none(),
            "all taken"
        );
        drop((c, d));
        drop(more);
        assert!(!*watching.borrow(), "3 of 10: no longer short");
        drop(held);
        assert_eq!(slots.lock().total, 0);
        assert!(slots.lock().by_client.is_empty());
        // A trusted proxy carries many clients: only the total bounds it.
        let proxy = Some(IpAddr::from([10, 9, 9, 9]));
        let carried: Vec<Slot> = (0..8).map(|_| slots.take(proxy, false).unwrap()).collect();
        assert_eq!(carried.len(), 8);
        assert!(
            slots.take(proxy, false).is_none(),
            "the kept two are not its"
        );
    }

    /// Only a sign-in's refusal or wait is a line on stderr.
    #[test]
    fn only_sign_ins_are_noted() {
        let peer = Some(IpAddr::from([10, 0, 0, 1]));
        let sign_in = format!("{}/sign-in", console::BASE);
        assert!(
            sign_in_note("POST", &sign_in, 403, peer)
                .unwrap()
                .contains("refused")
        );
        assert!(
            sign_in_note("POST", &sign_in, 429, peer)
                .unwrap()
                .contains("waits")
        );
        assert_eq!(sign_in_note("POST", &sign_in, 303, peer), None);
        assert_eq!(sign_in_note("GET", &sign_in, 403, peer), None);
        let action = format!("{}/dead-letters/dismiss", console::BASE);
        assert_eq!(sign_in_note("POST", &action, 403, peer), None);
        let socket = sign_in_note("POST", &sign_in, 403, None).unwrap();
        assert!(socket.contains("this account's socket"), "{socket}");
    }
}
