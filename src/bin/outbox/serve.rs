//! `outbox serve`: the health snapshot over HTTP, for scrapers and load balancers, and
//! the operator console (`chunked_outbox::console`) under `/console`.
//!
//! Meant to be reachable on a network, so no client can hold it up: each connection is
//! a task of its own (a client that pipelines requests and never reads its answers
//! stalls only its own connection), a request's head must arrive whole within the
//! header timeout and fit in a bounded buffer (a header line that never ends, or a
//! request sent a byte a minute, is cut off), a connection lives at most
//! [`CONNECTION_LIFETIME`], and at most [`MAX_CONNECTIONS`] are open at once (more are
//! closed at once), so memory stays bounded whatever arrives.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use chunked_outbox::Outbox;
use chunked_outbox::console::{self, Console};
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

#[derive(Args)]
pub struct ServeArgs {
    /// The address to listen on (port 0: any free port; the first line printed names
    /// it). The loopback address by default: the console shows what the bot sends, so
    /// reaching it from elsewhere is a choice to make.
    #[arg(long, value_name = "ADDR", default_value = "127.0.0.1:9464")]
    listen: String,
    /// How long a client may take to send a request's head; a connection that has not
    /// sent one whole by then is closed (such as 10s, 500ms).
    #[arg(long, value_name = "DURATION", default_value = "10s", value_parser = humantime::parse_duration)]
    header_timeout: Duration,
    /// A file holding the console's action token (at least 16 characters): whoever
    /// signs in with it may requeue, resolve, resend and dismiss from the console.
    /// Without it the console is read-only. A file, so the token stays out of the
    /// process list and the shell's history.
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
    let mut console = Console::new(outbox.clone());
    if let Some(path) = &args.console_token_file {
        let token = std::fs::read_to_string(path)
            .map_err(|e| format!("cannot read the console token file {}: {e}", path.display()))?;
        console = console.with_actions(&token)?;
    }
    let pages = Arc::new(Pages {
        endpoint: Endpoint::new(outbox.clone(), args.thresholds.to_library()),
        console,
    });
    runtime.block_on(accept(pages, args))
}

/// What the server answers: the health endpoint and the console (under
/// [`console::BASE`]).
struct Pages {
    endpoint: Endpoint,
    console: Console,
}

async fn accept(pages: Arc<Pages>, args: &ServeArgs) -> CliResult<u8> {
    let listener = tokio::net::TcpListener::bind(&args.listen)
        .await
        .map_err(|e| format!("cannot listen on {}: {e}", args.listen))?;
    let addr = listener.local_addr()?;
    println!(
        "serving http://{addr}/metrics, /healthz, /health.json and the console at {} ({})",
        console::BASE,
        if pages.console.takes_actions() {
            "actions on for whoever signs in with the token"
        } else {
            "read-only"
        }
    );
    std::io::Write::flush(&mut std::io::stdout())?;
    let slots = Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
    loop {
        let stream = match listener.accept().await {
            Ok((stream, _)) => stream,
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
        let header_timeout = args.header_timeout;
        tokio::spawn(async move {
            let _slot = slot;
            let service = service_fn(move |request: hyper::Request<hyper::body::Incoming>| {
                let pages = pages.clone();
                async move { Ok::<_, Infallible>(answer(pages, request).await) }
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

/// The answer to `request`, read on the blocking pool (a snapshot is a database read):
/// the console's pages (with their own headers), else the health endpoint's.
async fn answer(
    pages: Arc<Pages>,
    request: hyper::Request<hyper::body::Incoming>,
) -> hyper::Response<Full<Bytes>> {
    let target = request
        .uri()
        .path_and_query()
        .map_or("/", |p| p.as_str())
        .to_owned();
    let method = request.method().as_str().to_owned();
    let cookie = request
        .headers()
        .get(hyper::header::COOKIE)
        .and_then(|c| c.to_str().ok())
        .map(str::to_owned);
    let path = target.split('?').next().unwrap_or_default();
    let in_console = path
        .strip_prefix(console::BASE)
        .is_some_and(|rest| rest.is_empty() || rest.starts_with('/'));
    // A form's body, read only for the console, and only up to what a form may be.
    let body = if in_console && method == "POST" {
        let limited = Limited::new(request.into_body(), console::MAX_FORM_BYTES);
        match limited.collect().await {
            Ok(body) => body.to_bytes(),
            Err(_) => return plain(413, "form too large or cut off\n"),
        }
    } else {
        Bytes::new()
    };
    let read = move || {
        if in_console {
            let mut asked = console::Request::get(&target);
            asked.method = &method;
            asked.cookie = cookie.as_deref();
            asked.body = &body;
            let page = pages.console.respond(&asked);
            (page.status, page.headers, page.body)
        } else {
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
