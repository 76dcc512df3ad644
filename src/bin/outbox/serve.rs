//! `outbox serve`: the health snapshot over HTTP, for scrapers and load balancers, and
//! the operator console (`chunked_outbox::console`) under `/console`.
//!
//! Meant to be reachable on a network, so no client can hold it up: each connection is
//! a task of its own (a client that pipelines requests and never reads its answers
//! stalls only its own connection), a request's head must arrive whole within the
//! header timeout and fit in a bounded buffer (a header line that never ends, or a
//! request sent a byte a minute, is cut off), a connection lives at most
//! [`CONNECTION_LIFETIME`], and at most [`MAX_CONNECTIONS`] are open at once (more are
//! closed at once), so memory stays bounded whatever arrives. A form's body must arrive
//! within [`ServeArgs::body_timeout`] (408 after it), and at most [`MAX_BODY_READS`]
//! bodies are read at once (503 past that), so slow bodies never take the slots
//! `/healthz` needs.
//!
//! It answers only to its own names (`console::AllowedHosts`: the loopback names and the
//! port, the listen address, `--allowed-host`), so a web page cannot read it through
//! DNS rebinding; and it mounts the console on a non-loopback address only when asked
//! to (`--expose-console`), and then only behind the token's sign-in.

use std::convert::Infallible;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use chunked_outbox::Outbox;
use chunked_outbox::console::{self, AllowedHosts, Console};
use chunked_outbox::monitoring::Endpoint;
use clap::Args;
use http_body_util::{BodyExt, Full, Limited};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};

use crate::{CliResult, Thresholds};

/// Connections open at once; one more is closed as soon as it is accepted.
const MAX_CONNECTIONS: usize = 256;
/// The longest a connection stays open, however busy (a scraper reconnects).
const CONNECTION_LIFETIME: Duration = Duration::from_secs(60);
/// The most a request's head may take in memory (hyper's smallest read buffer); a
/// longer one is answered 431 and the connection closed.
const MAX_HEAD_BYTES: usize = 8 * 1024;
/// Forms whose bodies are read at once; one more is answered 503 at once, so slow
/// bodies hold at most this many of the [`MAX_CONNECTIONS`] slots.
const MAX_BODY_READS: usize = 32;

#[derive(Args)]
pub struct ServeArgs {
    /// The address to listen on (port 0: any free port; the first line printed names
    /// it). The loopback address by default: the console shows what the bot sends, so
    /// it is mounted on another address only with --expose-console and a token.
    #[arg(long, value_name = "ADDR", default_value = "127.0.0.1:9464")]
    listen: String,
    /// Another name this server answers to, `host` or `host:port` (repeatable): a
    /// request whose Host header names neither it, the loopback names nor the listen
    /// address is refused (421), so no web page can read it through DNS rebinding.
    /// Give the name a reverse proxy or a scraper uses.
    #[arg(long, value_name = "NAME")]
    allowed_host: Vec<String>,
    /// Serve /metrics, /healthz and /health.json only: no console.
    #[arg(long, conflicts_with_all = ["expose_console", "console_token_file"])]
    no_console: bool,
    /// Mount the console on a non-loopback listen address too. It shows every reply's
    /// text, so it needs --console-token-file: every page then needs the sign-in.
    #[arg(long)]
    expose_console: bool,
    /// Mark the console's session cookie Secure (behind a proxy that ends TLS).
    #[arg(long)]
    secure_cookie: bool,
    /// How long a client may take to send a request's head; a connection that has not
    /// sent one whole by then is closed (such as 10s, 500ms).
    #[arg(long, value_name = "DURATION", default_value = "10s", value_parser = humantime::parse_duration)]
    header_timeout: Duration,
    /// How long a client may take to send a form's body once its head arrived (408
    /// after it).
    #[arg(long, value_name = "DURATION", default_value = "10s", value_parser = humantime::parse_duration)]
    body_timeout: Duration,
    /// A file holding the console's action token (at least 16 characters, 10 of them
    /// different: `openssl rand -hex 32 > token && chmod 600 token`): whoever signs in
    /// with it may read the console and requeue, resolve, resend and dismiss from it.
    /// Without it the console is read-only, and mounted on loopback only. A file
    /// readable by others is refused; a file, so the token stays out of the process
    /// list and the shell's history.
    #[arg(long, value_name = "PATH", env = "OUTBOX_CONSOLE_TOKEN_FILE")]
    console_token_file: Option<std::path::PathBuf>,
    #[command(flatten)]
    thresholds: Thresholds,
}

impl ServeArgs {
    /// Whether the console may act (a token file is given): the outbox is opened for
    /// writing then.
    pub fn takes_actions(&self) -> bool {
        self.console_token_file.is_some()
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
    let listener = runtime
        .block_on(tokio::net::TcpListener::bind(&args.listen))
        .map_err(|e| format!("cannot listen on {}: {e}", args.listen))?;
    let addr = listener.local_addr()?;
    let hosts = allowed_hosts(addr, &args.allowed_host)?;
    let (console, said) = mounted_console(outbox, args, addr, &hosts)?;
    println!(
        "serving http://{addr}/metrics, /healthz, /health.json; {said}; answering to {}",
        answering(addr, &args.allowed_host)
    );
    std::io::Write::flush(&mut std::io::stdout())?;
    let pages = Arc::new(Pages {
        endpoint: Endpoint::new(outbox.clone(), args.thresholds.to_library()),
        console,
        hosts,
        bodies: Arc::new(tokio::sync::Semaphore::new(MAX_BODY_READS)),
        body_timeout: args.body_timeout,
    });
    runtime.block_on(accept(listener, pages, args.header_timeout))
}

/// The names a request to `addr` may give as its host: the loopback names on its port,
/// the address itself (any address, if it listens on every interface), and `extra`.
fn allowed_hosts(addr: SocketAddr, extra: &[String]) -> CliResult<AllowedHosts> {
    let port = addr.port();
    let mut hosts = AllowedHosts::loopback(Some(port));
    if addr.ip().is_unspecified() {
        hosts = hosts.any_address(port);
    } else if !addr.ip().is_loopback() {
        hosts = hosts.allow(&addr.to_string())?;
    }
    for name in extra {
        hosts = hosts.allow(name)?;
    }
    Ok(hosts)
}

/// What the banner says of the names answered to.
fn answering(addr: SocketAddr, extra: &[String]) -> String {
    let mut names = vec![format!("localhost:{}", addr.port())];
    if addr.ip().is_unspecified() {
        names.push(format!("any address:{}", addr.port()));
    } else if !addr.ip().is_loopback() {
        names.push(addr.to_string());
    }
    names.extend(extra.iter().cloned());
    names.join(", ")
}

/// The console, if it is mounted here, and what the banner says of it: on loopback
/// always (read-only without a token); elsewhere only with --expose-console and a
/// token; never with --no-console.
fn mounted_console(
    outbox: &Outbox,
    args: &ServeArgs,
    addr: SocketAddr,
    hosts: &AllowedHosts,
) -> CliResult<(Option<Console>, String)> {
    if args.no_console {
        return Ok((None, "no console (--no-console)".into()));
    }
    if !addr.ip().is_loopback() && !args.expose_console {
        return Ok((
            None,
            format!(
                "no console: it shows every reply, and {} is not a loopback address \
                 (--expose-console with --console-token-file mounts it)",
                addr.ip()
            ),
        ));
    }
    let mut console = Console::new(outbox.clone())
        .with_allowed_hosts(hosts.clone())
        .with_secure_cookie(args.secure_cookie);
    match &args.console_token_file {
        Some(path) => console = console.with_actions(&read_token(path)?)?,
        None if !addr.ip().is_loopback() => {
            return Err(
                "--expose-console needs --console-token-file: on a network, every \
                        page of the console needs the sign-in"
                    .into(),
            );
        }
        None => {}
    }
    let said = if console.takes_actions() {
        format!(
            "the console at {}, behind the sign-in (actions on for whoever signs in with the token)",
            console::BASE
        )
    } else {
        format!(
            "the console at {} (read-only, loopback only)",
            console::BASE
        )
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
    bodies: Arc<tokio::sync::Semaphore>,
    body_timeout: Duration,
}

async fn accept(
    listener: tokio::net::TcpListener,
    pages: Arc<Pages>,
    header_timeout: Duration,
) -> CliResult<u8> {
    let slots = Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
    loop {
        let (stream, peer) = match listener.accept().await {
            Ok(accepted) => accepted,
            // Out of file descriptors, a connection reset before it was taken, ...:
            // the next one may do, and a tight loop would not help.
            Err(e) => {
                eprintln!("outbox serve: accept failed: {e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            continue; // dropped: closed at once
        };
        let pages = pages.clone();
        tokio::spawn(async move {
            let _slot = slot;
            let service = service_fn(move |request: hyper::Request<hyper::body::Incoming>| {
                let pages = pages.clone();
                async move { Ok::<_, Infallible>(answer(pages, peer.ip(), request).await) }
            });
            let connection = http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(header_timeout)
                .max_buf_size(MAX_HEAD_BYTES)
                .serve_connection(TokioIo::new(stream), service);
            // A client that went away, or outstayed its time, is its own business.
            let _ = tokio::time::timeout(CONNECTION_LIFETIME, connection).await;
        });
    }
}

/// The answer to `request` from `peer`, read on the blocking pool (a snapshot is a
/// database read): refused if it names another host, else the console's pages (with
/// their own headers) or the health endpoint's.
async fn answer(
    pages: Arc<Pages>,
    peer: IpAddr,
    request: hyper::Request<hyper::body::Incoming>,
) -> hyper::Response<Full<Bytes>> {
    let header = |name: hyper::header::HeaderName| {
        request
            .headers()
            .get(name)
            .and_then(|c| c.to_str().ok())
            .map(str::to_owned)
    };
    let host = header(hyper::header::HOST);
    if !host
        .as_deref()
        .is_some_and(|host| pages.hosts.permits(host))
    {
        return plain(421, "this server does not answer to that host name\n");
    }
    let cookie = header(hyper::header::COOKIE);
    let origin = header(hyper::header::ORIGIN);
    let fetch_site = header(hyper::header::HeaderName::from_static("sec-fetch-site"));
    let target = request
        .uri()
        .path_and_query()
        .map_or("/", |p| p.as_str())
        .to_owned();
    let method = request.method().as_str().to_owned();
    let path = target.split('?').next().unwrap_or_default().to_owned();
    let in_console = pages.console.is_some()
        && path
            .strip_prefix(console::BASE)
            .is_some_and(|rest| rest.is_empty() || rest.starts_with('/'));
    // A form's body, read only for the console, only up to what a form may be, and only
    // for as long as a body may take; a few at once.
    let body = if in_console && method == "POST" {
        let Ok(_reading) = pages.bodies.clone().try_acquire_owned() else {
            return plain(503, "busy: too many forms arriving at once\n");
        };
        let limited = Limited::new(request.into_body(), console::MAX_FORM_BYTES);
        match tokio::time::timeout(pages.body_timeout, limited.collect()).await {
            Ok(Ok(body)) => body.to_bytes(),
            Ok(Err(_)) => return plain(413, "form too large or cut off\n"),
            Err(_) => return plain(408, "the form's body did not arrive in time\n"),
        }
    } else {
        Bytes::new()
    };
    let read = move || match (&pages.console, in_console) {
        (Some(console), true) => {
            let asked = console::Request {
                method: &method,
                target: &target,
                host: host.as_deref(),
                cookie: cookie.as_deref(),
                origin: origin.as_deref(),
                fetch_site: fetch_site.as_deref(),
                peer: Some(peer),
                https: false,
                body: &body,
            };
            let page = console.respond(&asked);
            if let Some(line) = sign_in_note(&method, &path, page.status, peer) {
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
fn sign_in_note(method: &str, path: &str, status: u16, peer: IpAddr) -> Option<String> {
    if method != "POST" || path != format!("{}/sign-in", console::BASE) {
        return None;
    }
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

    /// A listener on one address answers to its own address and the loopback names; one
    /// on every interface to any address on its port.
    #[test]
    fn the_names_answered_to_follow_the_listen_address() {
        let one: SocketAddr = "10.0.0.5:9464".parse().unwrap();
        let hosts = allowed_hosts(one, &[]).unwrap();
        assert!(hosts.permits("10.0.0.5:9464") && hosts.permits("localhost:9464"));
        assert!(!hosts.permits("10.0.0.6:9464"));
        assert_eq!(answering(one, &[]), "localhost:9464, 10.0.0.5:9464");
        let local: SocketAddr = "127.0.0.1:9464".parse().unwrap();
        assert_eq!(answering(local, &[]), "localhost:9464");
        assert!(!allowed_hosts(local, &[]).unwrap().permits("10.0.0.5:9464"));
        let every: SocketAddr = "0.0.0.0:9464".parse().unwrap();
        assert!(allowed_hosts(every, &[]).unwrap().permits("10.0.0.6:9464"));
        assert_eq!(
            answering(every, &["box.example".into()]),
            "localhost:9464, any address:9464, box.example"
        );
    }

    /// Only a sign-in's refusal or wait is a line on stderr.
    #[test]
    fn only_sign_ins_are_noted() {
        let peer = IpAddr::from([10, 0, 0, 1]);
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
    }
}
