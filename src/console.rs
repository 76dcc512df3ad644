//! An operator console: HTML pages over a live outbox, for the person on call (feature
//! `console`, part of `cli`; `outbox serve` mounts it under `/console`).
//!
//! Pages: the overview (what [`health`](crate::Outbox::health) says, per channel), the
//! chats whose lanes are held (why, since when, what would free them), the replies
//! that wait for a person (uncertain ones and dead letters, newest first, filtered by
//! channel), a reply's story (every part with its state, attempts, keys, errors, times
//! and platform ids; found by its id or caller key) and the stored rules.
//!
//! Like [`Endpoint`](crate::monitoring::Endpoint) it answers a [`Request`] with a
//! [`Response`], so any HTTP server can mount it. It is safe by construction: who can
//! reach a request's sender ([`Reach`]) decides what it is shown, whatever the server
//! in front was told.
//!
//! - it answers only to its own names ([`AllowedHosts`]; the loopback names by
//!   default): a request whose `Host` is another name is refused with 421, so a web page
//!   that points its own name at the console's address (DNS rebinding) reads nothing;
//! - **without a token it shows nothing but to the file's owner**: a request is
//!   answered only when its server vouches that it came from this process's own
//!   account over a channel nobody else can open ([`Request::owner`]: a Unix socket
//!   whose peer credentials were checked). Over TCP, any account of the machine reaches
//!   a loopback port, so every page answers 403 and says how to turn the console on;
//! - with a token ([`with_actions`](Console::with_actions)) **every page but the
//!   sign-in form and the style sheet needs the sign-in**, and a sign-in from another
//!   machine ([`Reach::Network`]) is taken only over TLS (HTTPS, or a proxy that ends
//!   it: [`with_secure_cookie`](Console::with_secure_cookie)) unless plain HTTP is
//!   accepted by name ([`with_plain_http_sign_in`](Console::with_plain_http_sign_in)):
//!   signing in starts a session kept on the server (the cookie, `HttpOnly`,
//!   `SameSite=Strict`, carries only its random id, never the token; it ends after
//!   [`SESSION_IDLE`] without a request, [`SESSION_LIFETIME`] after sign-in, or at
//!   sign-out), and a person signed in gets buttons to requeue, resolve, resend and
//!   dismiss, each with what it does to the platform written beside it;
//! - every action is a `POST` carrying its session's form token (CSRF), refused when its
//!   `Origin` is another site or `Sec-Fetch-Site` says it came from one, and changes the
//!   outbox in one transaction of the operation it names, as the `outbox` tool would;
//! - failed sign-ins are counted per client and overall: past
//!   [`FREE_SIGN_IN_FAILURES`] of its own a client's next attempt waits, twice as long
//!   each time (429 with `Retry-After`); everyone's failures together only take away the
//!   free ones, so a client that has failed nothing is always heard and nobody's wrong
//!   tokens shut the operator out;
//! - every answer carries [`SECURITY_HEADERS`] (no script runs, nothing is loaded from
//!   elsewhere, no other site frames it), every value is escaped (a reply whose text is
//!   `<script>` renders as text), and a reply's text is shown only when asked for
//!   (`?text=1`).
//!
//! ```
//! use chunked_outbox::console::{Console, Request};
//! use chunked_outbox::{NewDelivery, Outbox, OutboxOptions};
//!
//! let outbox = Outbox::open_in_memory(OutboxOptions::default())?;
//! outbox.enqueue(&NewDelivery::single("telegram", "42", "<b>hi</b>"))?;
//! let console = Console::new(outbox);
//! // Without a token, only the file's owner is shown anything: a server says so of a
//! // request that came over a socket only that account can open.
//! let page = console.respond(&Request::get("/console").from_owner());
//! assert_eq!(page.status, 200);
//! assert!(page.body.contains("telegram"));
//! // Anyone else — a TCP client, even on loopback — reads nothing.
//! let tcp = console.respond(&Request::get("/console").from_peer([127, 0, 0, 1].into()));
//! assert_eq!(tcp.status, 403);
//! assert!(!tcp.body.contains("telegram"));
//! // Read-only: no action is taken.
//! let refused =
//!     console.respond(&Request::post("/console/actions/dismiss", b"channel=").from_owner());
//! assert_eq!(refused.status, 403);
//! # Ok::<(), chunked_outbox::Error>(())
//! ```

mod guard;
mod pages;

use std::net::IpAddr;
use std::sync::{Arc, Mutex};

use subtle::ConstantTimeEq;

use crate::error::{Error, Result};
use crate::ids::DeliveryId;
use crate::inspect::{DeliveryView, ListFilter};
use crate::operator::Resolution;
use crate::outbox::Outbox;
use crate::status::{ChunkStatus, DeliveryStatus};

pub use guard::{
    AllowedHosts, FREE_SIGN_IN_FAILURES, FREE_SIGN_IN_FAILURES_OVERALL, LONGEST_SIGN_IN_WAIT,
    MIN_TOKEN_VARIETY, SESSION_IDLE, SESSION_LIFETIME, client_key, is_loopback_name,
};
use guard::{Sessions, Throttle};
use pages::StuckChat;

/// Where the console's pages live; a server mounts every path under it.
pub const BASE: &str = "/console";

/// The headers every answer carries: no script runs, nothing is loaded from elsewhere,
/// forms post only here, no other site frames the pages, and no page's address leaves
/// in a `Referer`.
pub const SECURITY_HEADERS: [(&str, &str); 4] = [
    (
        "Content-Security-Policy",
        "default-src 'none'; style-src 'self'; img-src 'self'; form-action 'self'; \
         frame-ancestors 'none'; base-uri 'none'",
    ),
    ("X-Content-Type-Options", "nosniff"),
    ("Referrer-Policy", "no-referrer"),
    ("Cache-Control", "no-store"),
];

/// The cookie a signed-in person's browser sends back.
const COOKIE: &str = "outbox_console";

/// The shortest action token accepted: a guessable one would open the actions to
/// anyone who reaches the port.
pub const MIN_TOKEN_LEN: usize = 16;

/// The most a form's body may be; a server may refuse a longer one before reading it.
pub const MAX_FORM_BYTES: usize = 16 * 1024;

/// The headers a proxy adds, most telling first. A request that carries any of them
/// came through a proxy, so others than the file's owner may have sent it; an embedding
/// server passes the first one present as [`Request::forwarded`].
pub const FORWARDING_HEADERS: [&str; 6] = [
    "Forwarded",
    "X-Forwarded-For",
    "X-Real-IP",
    "X-Forwarded-Host",
    "X-Forwarded-Proto",
    "Via",
];

/// Who can have sent a request, as far as the console can tell: it decides what the
/// request is shown.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reach {
    /// The file's owner, and nobody else: the server took the request over a channel
    /// only this process's account can open ([`Request::owner`]), under a loopback name,
    /// with no proxy in between.
    Owner,
    /// Any account of this machine: a TCP client on a loopback address, under a
    /// loopback name, with no proxy in between. Nothing it sends crosses a network.
    ThisMachine,
    /// Anyone the network lets through: a client on another address, a name other than
    /// the loopback names, a proxy in front (any of [`FORWARDING_HEADERS`]), or a peer
    /// the server did not name.
    Network,
}

/// A request as the console needs it. An embedding server fills in every header it
/// received: the `Host` decides whether the console answers at all, `Origin` and
/// `Sec-Fetch-Site` whether a form is taken, the peer (and a proxy's forwarding
/// header) who can have sent it ([`Reach`]) and how long a failed sign-in waits.
#[derive(Debug, Clone, Copy)]
pub struct Request<'a> {
    /// `GET`, `HEAD` or `POST`.
    pub method: &'a str,
    /// The path and query string.
    pub target: &'a str,
    /// The `Host` header; a request without one, or naming a host the console does not
    /// answer to ([`Console::with_allowed_hosts`]), is refused with 421.
    pub host: Option<&'a str>,
    /// The `Cookie` header, if any.
    pub cookie: Option<&'a str>,
    /// The `Origin` header, if any: a `POST` from another origin is refused.
    pub origin: Option<&'a str>,
    /// The `Sec-Fetch-Site` header, if any: a `POST` marked `cross-site` or `same-site`
    /// is refused.
    pub fetch_site: Option<&'a str>,
    /// The TCP peer's address (`None`: a request with no address, counted as one
    /// client with every other such request, and reached from the network unless
    /// [`owner`](Self::owner)).
    pub peer: Option<IpAddr>,
    /// Whether the server vouches that the request came from this process's own
    /// account over a channel no other account can open: a Unix socket whose peer
    /// credentials it checked. Only then does a console without a token show anything.
    pub owner: bool,
    /// The first of [`FORWARDING_HEADERS`] the request carried, if any: it came through
    /// a proxy. From a trusted proxy ([`Console::with_trusted_proxies`]) the client's
    /// address is read from it (a `Forwarded` or `X-Forwarded-For` chain); from anyone
    /// else it is never believed, only noticed.
    pub forwarded: Option<&'a str>,
    /// Whether the request came over HTTPS (the session cookie is `Secure` then).
    pub https: bool,
    /// The body of a `POST` (`application/x-www-form-urlencoded`).
    pub body: &'a [u8],
}

impl<'a> Request<'a> {
    /// A `GET` of `target` to `localhost`, with no cookie, from a sender nobody named
    /// (reached from the network, see [`Reach`]).
    pub fn get(target: &'a str) -> Self {
        Request {
            method: "GET",
            target,
            host: Some("localhost"),
            cookie: None,
            origin: None,
            fetch_site: None,
            peer: None,
            owner: false,
            forwarded: None,
            https: false,
            body: b"",
        }
    }

    /// A `POST` of the form `body` to `target` on `localhost`, with no cookie.
    pub fn post(target: &'a str, body: &'a [u8]) -> Self {
        Request {
            method: "POST",
            body,
            ..Request::get(target)
        }
    }

    /// The same request with the `Cookie` header `cookie`.
    pub fn with_cookie(self, cookie: &'a str) -> Self {
        Request {
            cookie: Some(cookie),
            ..self
        }
    }

    /// The same request with the `Host` header `host`.
    pub fn with_host(self, host: &'a str) -> Self {
        Request {
            host: Some(host),
            ..self
        }
    }

    /// The same request with the `Origin` header `origin`.
    pub fn with_origin(self, origin: &'a str) -> Self {
        Request {
            origin: Some(origin),
            ..self
        }
    }

    /// The same request with the `Sec-Fetch-Site` header `site`.
    pub fn with_fetch_site(self, site: &'a str) -> Self {
        Request {
            fetch_site: Some(site),
            ..self
        }
    }

    /// The same request from the client at `peer`.
    pub fn from_peer(self, peer: IpAddr) -> Self {
        Request {
            peer: Some(peer),
            ..self
        }
    }

    /// The same request, vouched for as coming from this process's own account over a
    /// channel nobody else can open (see [`owner`](Self::owner)).
    pub fn from_owner(self) -> Self {
        Request {
            owner: true,
            ..self
        }
    }

    /// The same request through a proxy that added `value` as its forwarding header
    /// (see [`forwarded`](Self::forwarded)).
    pub fn with_forwarded(self, value: &'a str) -> Self {
        Request {
            forwarded: Some(value),
            ..self
        }
    }

    /// The same request over HTTPS.
    pub fn over_https(self) -> Self {
        Request {
            https: true,
            ..self
        }
    }
}

/// The console's answer: status, headers (the content type and
/// [`SECURITY_HEADERS`] among them) and body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Response {
    /// The HTTP status.
    pub status: u16,
    /// The headers to send, in order.
    pub headers: Vec<(&'static str, String)>,
    /// The body.
    pub body: String,
}

impl Response {
    /// The first value of header `name` (compared ignoring case).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    fn new(status: u16, content_type: &str, body: String) -> Self {
        let mut headers = vec![("Content-Type", content_type.to_owned())];
        headers.extend(SECURITY_HEADERS.map(|(n, v)| (n, v.to_owned())));
        Response {
            status,
            headers,
            body,
        }
    }

    fn html(status: u16, markup: maud::Markup) -> Self {
        Response::new(status, "text/html; charset=utf-8", markup.into_string())
    }

    /// A `303 See Other` to `location` (after an action, so a reload repeats nothing).
    /// A location with a control character (which would split the header) goes to
    /// the overview instead.
    fn see_other(location: String) -> Self {
        let location = if location.bytes().any(|b| b.is_ascii_control()) {
            BASE.to_owned()
        } else {
            location
        };
        let mut answer = Response::new(303, "text/plain; charset=utf-8", String::new());
        answer.headers.push(("Location", location));
        answer
    }
}

/// What a console without a token answers anyone but the file's owner.
const NO_TOKEN: &str = "This console has no token, so it shows nothing over TCP: any account \
    of this machine can reach a loopback port, and the pages show every reply. Start it with \
    a token (outbox serve --console-token-file FILE) to put it behind a sign-in, or on a \
    socket only this account can open (outbox serve --listen unix:PATH) to read it without one.";

/// What a sign-in over plain HTTP from another machine is answered.
const PLAIN_HTTP: &str = "Sign-in refused: this request came from another machine (or through \
    a proxy) over plain HTTP, where the token would cross the network in clear. Put TLS in \
    front (a proxy that ends it, with outbox serve --secure-cookie), or accept plain HTTP by \
    name (outbox serve --allow-plain-http-sign-in).";

/// The pages of the console, answered for one outbox.
#[derive(Clone)]
pub struct Console {
    outbox: Outbox,
    routes: Arc<matchit::Router<Route>>,
    hosts: Arc<AllowedHosts>,
    actions: Option<Arc<Secrets>>,
    secure_cookie: bool,
    plain_http_sign_in: bool,
    trusted_proxies: Arc<[IpAddr]>,
}

/// What turns the actions on: the operator's token, the sign-in form's token, and the
/// sessions and failed sign-ins of this console.
struct Secrets {
    token: String,
    sign_in_csrf: String,
    sessions: Mutex<Sessions>,
    throttle: Mutex<Throttle>,
}

/// The pages, by path.
#[derive(Clone, Copy)]
enum Route {
    Overview,
    Style,
    Chats,
    Delivery,
    Find,
    Waiting(DeliveryStatus),
    Rules,
    SignIn,
    SignOut,
    Act(Action),
}

/// What a person can do, each the outbox operation of the same name.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Action {
    /// [`Outbox::requeue_delivery`].
    Requeue,
    /// [`Outbox::resolve_uncertain`] with [`Resolution::Delivered`].
    ResolveDelivered,
    /// [`Outbox::resolve_uncertain`] with [`Resolution::Resend`].
    Resend,
    /// [`Resolution::Resend`] of every uncertain part of a channel.
    ReplayChannel,
    /// [`Outbox::requeue_dead_letters`].
    RequeueDeadLetters,
    /// [`Outbox::dismiss_dead_letters`].
    Dismiss,
}

/// Who is asking: whether actions are on, and whether this person signed in.
pub(crate) struct Viewer {
    /// The session's form token, when the person signed in.
    pub(crate) csrf: Option<String>,
    /// Whether actions are on at all (a sign-in link is shown then).
    pub(crate) actions_on: bool,
    /// What the last action did (after its redirect).
    pub(crate) notice: Option<String>,
    /// The session, when the person signed in.
    session: Option<String>,
}

/// The most replies a page of uncertain replies or dead letters lists (newest first).
const WAITING_LISTED: usize = 50;
/// The most replies an error filter looks through (newest first).
const ERROR_SEARCHED: usize = 500;
/// The most held chats the chats page lists.
const CHATS_LISTED: usize = 50;
/// The most uncertain parts one replay of a channel resends.
const REPLAY_AT_MOST: usize = 500;

impl Console {
    /// The console of `outbox`, read-only, answering to the loopback names
    /// ([`AllowedHosts::loopback`], any port).
    pub fn new(outbox: Outbox) -> Self {
        let mut routes = matchit::Router::new();
        let pages = [
            ("", Route::Overview),
            ("/", Route::Overview),
            ("/style.css", Route::Style),
            ("/chats", Route::Chats),
            ("/deliveries/{id}", Route::Delivery),
            ("/deliveries", Route::Find),
            ("/uncertain", Route::Waiting(DeliveryStatus::Uncertain)),
            ("/dead-letters", Route::Waiting(DeliveryStatus::Failed)),
            ("/rules", Route::Rules),
            ("/sign-in", Route::SignIn),
            ("/sign-out", Route::SignOut),
            ("/actions/requeue", Route::Act(Action::Requeue)),
            ("/actions/resolve", Route::Act(Action::ResolveDelivered)),
            ("/actions/resend", Route::Act(Action::Resend)),
            ("/actions/replay", Route::Act(Action::ReplayChannel)),
            (
                "/actions/requeue-dead-letters",
                Route::Act(Action::RequeueDeadLetters),
            ),
            ("/actions/dismiss", Route::Act(Action::Dismiss)),
        ];
        for (path, route) in pages {
            // The paths are fixed and distinct.
            routes
                .insert(format!("{BASE}{path}"), route)
                .expect("distinct console routes");
        }
        Self {
            outbox,
            routes: Arc::new(routes),
            hosts: Arc::new(AllowedHosts::loopback(None)),
            actions: None,
            secure_cookie: false,
            plain_http_sign_in: false,
            trusted_proxies: Arc::new([]),
        }
    }

    /// Answers only requests whose `Host` is one of `hosts` (instead of the loopback
    /// names on any port).
    pub fn with_allowed_hosts(mut self, hosts: AllowedHosts) -> Self {
        self.hosts = Arc::new(hosts);
        self
    }

    /// Says that TLS ends in front of this console (a proxy that ends it): every
    /// request counts as come over HTTPS ([`Request::https`]), so a sign-in from
    /// another machine is taken and the session cookie is marked `Secure` on every
    /// answer.
    pub fn with_secure_cookie(mut self, secure: bool) -> Self {
        self.secure_cookie = secure;
        self
    }

    /// Takes a sign-in from another machine ([`Reach::Network`]) over plain HTTP too,
    /// where the token crosses the network in clear: only for a network the operator
    /// trusts with it. Off by default.
    pub fn with_plain_http_sign_in(mut self, accept: bool) -> Self {
        self.plain_http_sign_in = accept;
        self
    }

    /// The proxies whose forwarding header ([`Request::forwarded`]) names the client:
    /// behind one, every request's peer is the proxy, so without this every client
    /// shares one count of failed sign-ins. A request from any other peer is counted by
    /// its own address, whatever it claims.
    pub fn with_trusted_proxies(mut self, proxies: impl IntoIterator<Item = IpAddr>) -> Self {
        self.trusted_proxies = proxies.into_iter().collect();
        self
    }

    /// Who can have sent `request` (see [`Reach`]).
    pub fn reach(&self, request: &Request<'_>) -> Reach {
        let loopback_name = request.host.is_some_and(guard::is_loopback_name);
        if request.forwarded.is_some() || !loopback_name {
            Reach::Network
        } else if request.owner {
            Reach::Owner
        } else if request.peer.is_some_and(|peer| peer.is_loopback()) {
            Reach::ThisMachine
        } else {
            Reach::Network
        }
    }

    /// The client `request` is counted as: its peer, or behind a trusted proxy
    /// ([`with_trusted_proxies`](Self::with_trusted_proxies)) the address the proxy
    /// forwarded. A server uses it to bound what one client may hold.
    pub fn client(&self, request: &Request<'_>) -> Option<IpAddr> {
        guard::client(request.peer, request.forwarded, &self.trusted_proxies)
    }

    /// Turns the actions on for whoever signs in with `token`, and puts every page
    /// behind that sign-in. The token needs at least [`MIN_TOKEN_LEN`] characters, of
    /// at least [`MIN_TOKEN_VARIETY`] different ones: `openssl rand -hex 32` makes a
    /// good one. Keep it out of the command line and the logs.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidInput`] for a shorter token, one with too few different
    /// characters, or one with characters a form may garble (only visible ASCII other
    /// than `"`, `,`, `;` and `\`).
    pub fn with_actions(mut self, token: &str) -> Result<Self> {
        let token = token.trim();
        let invalid = |reason: &str| Error::InvalidInput {
            what: "console token",
            reason: reason.into(),
        };
        if token.len() < MIN_TOKEN_LEN {
            return Err(invalid(&format!(
                "{} characters; at least {MIN_TOKEN_LEN} are needed (make one with \
                 `openssl rand -hex 32`)",
                token.len()
            )));
        }
        if !token
            .bytes()
            .all(|b| b.is_ascii_graphic() && !b"\",;\\".contains(&b))
        {
            return Err(invalid(
                "only visible ASCII characters other than \" , ; \\ are taken",
            ));
        }
        if !guard::varied(token) {
            return Err(invalid(&format!(
                "fewer than {MIN_TOKEN_VARIETY} different characters: a token like that \
                 is guessed first (make one with `openssl rand -hex 32`)"
            )));
        }
        self.actions = Some(Arc::new(Secrets {
            token: token.to_owned(),
            sign_in_csrf: guard::random_hex()?,
            sessions: Mutex::default(),
            throttle: Mutex::default(),
        }));
        Ok(self)
    }

    /// Whether a person who signs in may act (see [`with_actions`](Self::with_actions)).
    pub fn takes_actions(&self) -> bool {
        self.actions.is_some()
    }

    /// The names this console answers to.
    pub fn allowed_hosts(&self) -> &AllowedHosts {
        &self.hosts
    }

    /// The answer to `request`. It blocks for the reads of one page, or for one
    /// action's transactions.
    pub fn respond(&self, request: &Request<'_>) -> Response {
        let https = request.https || self.secure_cookie;
        if !request
            .host
            .is_some_and(|host| self.hosts.permits_over(host, https))
        {
            return Response::new(
                421,
                "text/plain; charset=utf-8",
                "this console does not answer to that host name\n".into(),
            );
        }
        let (path, query) = request
            .target
            .split_once('?')
            .unwrap_or((request.target, ""));
        let Ok(found) = self.routes.at(path) else {
            return not_found("No such page.");
        };
        let route = *found.value;
        let posting = matches!(route, Route::SignIn | Route::SignOut | Route::Act(_));
        let mut viewer = self.viewer(request.cookie);
        // Without a token, nobody signs in: the pages are shown to the owner alone.
        if self.actions.is_none()
            && self.reach(request) != Reach::Owner
            && !matches!(route, Route::Style)
        {
            return refused(&viewer, NO_TOKEN);
        }
        match (request.method, posting) {
            ("GET" | "HEAD", _) => {}
            ("POST", true) => return self.post(route, request, &viewer),
            _ => {
                let allowed = if posting { "GET or POST" } else { "GET" };
                let mut answer = Response::new(
                    405,
                    "text/plain; charset=utf-8",
                    format!("this page answers only {allowed}\n"),
                );
                answer
                    .headers
                    .push(("Allow", allowed.replace(" or ", ", ")));
                return answer;
            }
        }
        // With a token, reading needs the sign-in too: the pages show every reply.
        if self.actions.is_some()
            && viewer.session.is_none()
            && !matches!(route, Route::SignIn | Route::Style)
        {
            return Response::see_other(format!("{BASE}/sign-in"));
        }
        // Only the fixed notices of `pages::notice`: nothing of the query is echoed.
        viewer.notice = parameter(query, "done")
            .and_then(|done| pages::notice(&done, parameter(query, "n").as_deref()));
        let v = &viewer;
        let read = || -> Result<Response> {
            Ok(match route {
                Route::Style => {
                    Response::new(200, "text/css; charset=utf-8", pages::STYLE.to_owned())
                }
                Route::Overview => Response::html(200, pages::overview(v, &self.overview()?)),
                Route::Chats => Response::html(200, pages::chats(v, &self.stuck_chats()?)),
                Route::Delivery => self.delivery(v, found.params.get("id"), query)?,
                Route::Find => self.find(v, query)?,
                Route::Waiting(status) => {
                    let asked = |name| parameter(query, name).filter(|c| !c.trim().is_empty());
                    let filter = pages::Filter {
                        channel: asked("channel"),
                        error: asked("error"),
                    };
                    let views = self.waiting(status, &filter)?;
                    Response::html(200, pages::waiting(v, status, &filter, &views))
                }
                Route::Rules => Response::html(200, pages::rules(v, &self.outbox.rules()?)),
                Route::SignIn => Response::html(200, pages::sign_in(v, self.sign_in_csrf(), None)),
                Route::SignOut | Route::Act(_) => Response::html(
                    200,
                    pages::message(v, "Actions", "Actions are taken with the page's buttons."),
                ),
            })
        };
        read().unwrap_or_else(|e| unreadable(v, &e))
    }

    fn now_ms(&self) -> i64 {
        self.outbox.options().now_ms()
    }

    /// Who sent `cookie`: a person signed in, if it names a live session.
    fn viewer(&self, cookie: Option<&str>) -> Viewer {
        let session = self.actions.as_ref().and_then(|secrets| {
            let id = session_id(cookie?)?;
            let session = lock(&secrets.sessions).touch(id, self.now_ms())?;
            Some((id.to_owned(), session.csrf))
        });
        let (session, csrf) = session.unzip();
        Viewer {
            csrf,
            actions_on: self.actions.is_some(),
            notice: None,
            session,
        }
    }

    fn sign_in_csrf(&self) -> Option<&str> {
        self.actions.as_deref().map(|s| s.sign_in_csrf.as_str())
    }

    /// A `POST`: sign in, sign out, or an action.
    fn post(&self, route: Route, request: &Request<'_>, viewer: &Viewer) -> Response {
        let Some(secrets) = &self.actions else {
            return refused(
                viewer,
                "The console is read-only: it was started without an action token \
                 (outbox serve --console-token-file).",
            );
        };
        if let Some(why) = foreign(request) {
            return refused(viewer, why);
        }
        if request.body.len() > MAX_FORM_BYTES {
            return Response::new(413, "text/plain; charset=utf-8", "form too large\n".into());
        }
        let form = Form(form_urlencoded::parse(request.body).into_owned().collect());
        let expected = match route {
            Route::SignIn => Some(secrets.sign_in_csrf.as_str()),
            _ => viewer.csrf.as_deref(),
        };
        if !form
            .get("csrf")
            .zip(expected)
            .is_some_and(|(given, expected)| same(given, expected))
        {
            let why = if expected.is_none() {
                "Sign in with the console's token to act."
            } else {
                "The form's token is missing or out of date (the console was restarted, you \
                 signed in again, or the form came from another site). Reload the page and \
                 try again."
            };
            return refused(viewer, why);
        }
        match route {
            Route::SignIn => self.sign_in(secrets, request, viewer, &form),
            Route::SignOut => {
                if let Some(id) = &viewer.session {
                    lock(&secrets.sessions).end(id);
                }
                let mut answer = Response::see_other(format!("{BASE}/sign-in"));
                answer
                    .headers
                    .push(("Set-Cookie", self.cookie("", request, Some(0))));
                answer
            }
            Route::Act(action) => {
                let back = form
                    .get("back")
                    .filter(|back| self.is_page(back))
                    .unwrap_or(BASE)
                    .to_owned();
                match self.act(action, &form) {
                    Ok(count) => {
                        Response::see_other(format!("{back}?done={}&n={count}", action.notice()))
                    }
                    Err(e) => Response::html(
                        409,
                        pages::message(viewer, "Not done", &format!("Nothing was changed: {e}")),
                    ),
                }
            }
            _ => refused(viewer, "Nothing is done here."),
        }
    }

    /// A sign-in: a new session if the token is right, unless this peer (or everyone)
    /// failed too often lately.
    fn sign_in(
        &self,
        secrets: &Secrets,
        request: &Request<'_>,
        viewer: &Viewer,
        form: &Form,
    ) -> Response {
        if self.reach(request) == Reach::Network
            && !(request.https || self.secure_cookie || self.plain_http_sign_in)
        {
            return refused(viewer, PLAIN_HTTP);
        }
        let now = self.now_ms();
        let client = self.client(request);
        let waiting = lock(&secrets.throttle).wait(client, now);
        if let Some(wait) = waiting {
            let seconds = wait.as_millis().div_ceil(1000).max(1);
            let mut answer = Response::html(
                429,
                pages::message(
                    viewer,
                    "Too many failed sign-ins",
                    &format!("Too many wrong tokens lately: try again in {seconds} s."),
                ),
            );
            answer.headers.push(("Retry-After", seconds.to_string()));
            return answer;
        }
        if !form
            .get("token")
            .is_some_and(|t| same(t.trim(), &secrets.token))
        {
            let failures = lock(&secrets.throttle).fail(client, now);
            tracing::warn!(
                client = ?client,
                failures,
                "console: a sign-in with a wrong token"
            );
            return Response::html(
                403,
                pages::sign_in(
                    viewer,
                    Some(&secrets.sign_in_csrf),
                    Some("That is not the token."),
                ),
            );
        }
        lock(&secrets.throttle).succeed(client);
        let mut sessions = lock(&secrets.sessions);
        if let Some(old) = &viewer.session {
            sessions.end(old);
        }
        match sessions.start(now) {
            Ok((id, _)) => {
                let mut answer = Response::see_other(BASE.to_owned());
                answer
                    .headers
                    .push(("Set-Cookie", self.cookie(&id, request, None)));
                answer
            }
            Err(e) => unreadable(viewer, &e),
        }
    }

    /// The session cookie carrying `value`; `max_age` 0 removes it.
    fn cookie(&self, value: &str, request: &Request<'_>, max_age: Option<u64>) -> String {
        let mut cookie = format!("{COOKIE}={value}; Path={BASE}; HttpOnly; SameSite=Strict");
        if self.secure_cookie || request.https {
            cookie.push_str("; Secure");
        }
        if let Some(age) = max_age {
            cookie.push_str(&format!("; Max-Age={age}"));
        }
        cookie
    }

    /// Whether `target` is one of the console's pages to go back to after an action:
    /// a path it answers with a page (no query, nothing but a path's characters).
    fn is_page(&self, target: &str) -> bool {
        target
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"/-_".contains(&b))
            && self.routes.at(target).is_ok_and(|found| {
                matches!(
                    found.value,
                    Route::Overview
                        | Route::Chats
                        | Route::Delivery
                        | Route::Waiting(_)
                        | Route::Rules
                )
            })
    }

    /// Carries out `action` as the form asks; how many replies it touched.
    fn act(&self, action: Action, form: &Form) -> Result<u64> {
        let channel = form.get("channel").filter(|c| !c.is_empty());
        match action {
            Action::RequeueDeadLetters => self.outbox.requeue_dead_letters(channel),
            Action::Dismiss => self.outbox.dismiss_dead_letters(channel),
            Action::ReplayChannel => {
                let channel = channel.ok_or_else(|| Error::InvalidInput {
                    what: "channel",
                    reason: "a replay names the channel whose uncertain parts to resend".into(),
                })?;
                let filter = ListFilter::default()
                    .status(DeliveryStatus::Uncertain)
                    .channel(channel)
                    .limit(REPLAY_AT_MOST);
                let mut resent = 0;
                for listed in self.outbox.list(&filter)? {
                    for part in self.uncertain_parts(listed.id)?.1 {
                        self.outbox.resolve_uncertain(part, Resolution::Resend)?;
                        resent += 1;
                    }
                }
                Ok(resent)
            }
            Action::Requeue | Action::ResolveDelivered | Action::Resend => {
                let id = form
                    .get("delivery")
                    .and_then(|id| id.parse::<DeliveryId>().ok())
                    .ok_or_else(|| Error::InvalidInput {
                        what: "delivery",
                        reason: "the form names no reply id".into(),
                    })?;
                if action == Action::Requeue {
                    self.outbox.requeue_delivery(id)?;
                    return Ok(1);
                }
                let resolution = if action == Action::Resend {
                    Resolution::Resend
                } else {
                    Resolution::Delivered {
                        platform_message_id: form
                            .get("platform_id")
                            .map(str::trim)
                            .filter(|p| !p.is_empty())
                            .map(str::to_owned),
                    }
                };
                let (status, parts) = self.uncertain_parts(id)?;
                let part = parts.first().ok_or(Error::DeliveryState {
                    delivery: id,
                    status,
                    action: "resolve",
                    expected: "uncertain",
                })?;
                self.outbox.resolve_uncertain(*part, resolution)?;
                Ok(1)
            }
        }
    }

    /// The reply's status and its uncertain parts, in one read.
    fn uncertain_parts(
        &self,
        id: DeliveryId,
    ) -> Result<(DeliveryStatus, Vec<crate::ids::ChunkId>)> {
        let view = self
            .outbox
            .delivery(id)?
            .ok_or(Error::DeliveryNotFound(id))?;
        let parts = view
            .chunks
            .iter()
            .filter(|c| c.status == ChunkStatus::Uncertain)
            .map(|c| c.id)
            .collect();
        Ok((view.status, parts))
    }

    /// What the overview shows: health, the rules, the channels paused, and the
    /// finished replies of the last hour (per minute) and day (per half hour).
    fn overview(&self) -> Result<pages::Overview> {
        const HOUR: std::time::Duration = std::time::Duration::from_secs(3600);
        Ok(pages::Overview {
            health: self.outbox.health()?,
            rules: self.outbox.rules()?,
            pauses: self.outbox.channel_pauses()?,
            hour: self.outbox.activity(HOUR, 60)?,
            day: self.outbox.activity(24 * HOUR, 48)?,
        })
    }

    /// Uncertain replies or dead letters, newest first, each with its parts (their
    /// last error is the reason shown): of one channel, whose last error contains a
    /// text, as `filter` asks. An error is looked for among the newest
    /// [`ERROR_SEARCHED`] only.
    fn waiting(&self, status: DeliveryStatus, filter: &pages::Filter) -> Result<Vec<DeliveryView>> {
        let searched = if filter.error.is_some() {
            ERROR_SEARCHED
        } else {
            WAITING_LISTED
        };
        let mut list = ListFilter::default().status(status).limit(searched);
        if let Some(channel) = &filter.channel {
            list = list.channel(channel.clone());
        }
        let wanted = filter.error.as_deref().map(str::to_lowercase);
        let mut views = Vec::new();
        for listed in self.outbox.list(&list)? {
            let view = self.outbox.delivery(listed.id)?.unwrap_or(listed);
            let matches = wanted.as_deref().is_none_or(|wanted| {
                pages::last_error(&view).is_some_and(|e| e.to_lowercase().contains(wanted))
            });
            if matches {
                views.push(view);
                if views.len() == WAITING_LISTED {
                    break;
                }
            }
        }
        Ok(views)
    }

    /// The chats with replies queued behind one that is not going out as it should
    /// (not being sent under a live lease, nor due now), oldest wait first, with what
    /// holds them.
    fn stuck_chats(&self) -> Result<Vec<StuckChat>> {
        let queued = self.outbox.list(
            &ListFilter::default()
                .status(DeliveryStatus::Queued)
                .limit(crate::inspect::MAX_LIST_LIMIT),
        )?;
        let mut lanes: Vec<(String, String)> = Vec::new();
        // Newest first: the last one seen of a lane is its oldest queued reply.
        for view in queued.iter().rev() {
            let lane = (view.channel.clone(), view.chat_id.clone());
            if !lanes.contains(&lane) {
                lanes.push(lane);
            }
        }
        lanes.truncate(CHATS_LISTED);
        let rules = self.outbox.rules()?;
        let now = self.outbox.now();
        lanes
            .into_iter()
            .map(|(channel, chat_id)| {
                let unfinished = self.outbox.list(
                    &ListFilter::default()
                        .channel(channel.clone())
                        .chat_id(chat_id.clone())
                        .unfinished()
                        .limit(crate::inspect::MAX_LIST_LIMIT),
                )?;
                // Oldest first. The active reply holds its chat; one set aside holds it
                // as the lanes decide, asked of the store as they ask it.
                let (queued, others): (Vec<_>, Vec<_>) = unfinished
                    .into_iter()
                    .rev()
                    .partition(|view| view.status == DeliveryStatus::Queued);
                let held = self.outbox.lane_holder(&rules, &channel, &chat_id)?;
                let mut holder = None;
                for view in others {
                    let holds = match view.status {
                        DeliveryStatus::Uncertain | DeliveryStatus::Failed => {
                            held == Some(self.outbox.delivery_rowid(view.id))
                        }
                        _ => true,
                    };
                    if holds {
                        // Read whole for its parts.
                        holder = Some(self.outbox.delivery(view.id)?.unwrap_or(view));
                        break;
                    }
                }
                Ok(
                    (!holder.as_ref().is_some_and(|h| moving(h, now))).then_some(StuckChat {
                        channel,
                        chat_id,
                        holder,
                        queued,
                    }),
                )
            })
            .filter_map(Result::transpose)
            .collect()
    }

    /// A reply's story, by its id as text.
    fn delivery(&self, viewer: &Viewer, id: Option<&str>, query: &str) -> Result<Response> {
        let Some(id) = id.and_then(|id| id.trim().parse::<DeliveryId>().ok()) else {
            return Ok(not_found("That is not a reply id."));
        };
        Ok(match self.outbox.delivery(id)? {
            Some(view) => Response::html(200, pages::story(viewer, &view, asked_for_text(query))),
            None => not_found("No reply has that id (it may have been purged)."),
        })
    }

    /// A reply found by its id or its caller key; else the unfinished replies to the
    /// chats of that id (a delivered reply is found by its id or key).
    fn find(&self, viewer: &Viewer, query: &str) -> Result<Response> {
        let asked = parameter(query, "id").unwrap_or_default();
        let asked = asked.trim();
        if asked.parse::<DeliveryId>().is_ok() {
            return self.delivery(viewer, Some(asked), query);
        }
        if asked.is_empty() {
            return Ok(not_found("Give a reply id, a caller key or a chat id."));
        }
        let by_key = ListFilter::default().idempotency_key(asked).limit(1);
        if let Some(view) = self.outbox.list(&by_key)?.pop() {
            return Ok(Response::see_other(format!(
                "{BASE}/deliveries/{}",
                view.id
            )));
        }
        let by_chat = ListFilter::default()
            .chat_id(asked)
            .unfinished()
            .limit(WAITING_LISTED);
        let views = self.outbox.list(&by_chat)?;
        if views.is_empty() {
            return Ok(not_found(
                "No reply has that id or caller key, and no unfinished reply goes to a chat \
                 of that id.",
            ));
        }
        Ok(Response::html(200, pages::chat(viewer, asked, &views)))
    }
}

/// Whether an active reply's next part goes out as it should: sent under a live lease,
/// or due now.
/// (An uncertain, failed or unfinalized reply's first undelivered part, if any, is
/// neither.)
fn moving(view: &DeliveryView, now: chrono::DateTime<chrono::Utc>) -> bool {
    view.chunks
        .iter()
        .find(|c| c.status != ChunkStatus::Delivered)
        .is_some_and(|part| match part.status {
            ChunkStatus::Sending => part.lease_until.is_some_and(|until| until > now),
            ChunkStatus::Pending | ChunkStatus::Retry => {
                part.next_attempt_at.is_some_and(|at| at <= now)
            }
            _ => false,
        })
}

impl Action {
    /// The notice shown after it (see `pages::notice`).
    fn notice(self) -> &'static str {
        match self {
            Action::Requeue => "requeued",
            Action::ResolveDelivered => "resolved",
            Action::Resend => "resent",
            Action::ReplayChannel => "replayed",
            Action::RequeueDeadLetters => "requeued-all",
            Action::Dismiss => "dismissed",
        }
    }
}

/// A form's fields.
struct Form(Vec<(String, String)>);

impl Form {
    fn get(&self, name: &str) -> Option<&str> {
        self.0
            .iter()
            .find(|(key, _)| key == name)
            .map(|(_, value)| value.as_str())
    }
}

/// Whether two secrets are equal, in a time that does not tell where they differ.
fn same(given: &str, secret: &str) -> bool {
    given.len() == secret.len() && bool::from(given.as_bytes().ct_eq(secret.as_bytes()))
}

/// Whether the query asks for the reply's text (`text=1`).
fn asked_for_text(query: &str) -> bool {
    parameter(query, "text").as_deref() == Some("1")
}

/// The value of `name` in a query string, decoded.
fn parameter(query: &str, name: &str) -> Option<String> {
    form_urlencoded::parse(query.as_bytes())
        .find(|(key, _)| key == name)
        .map(|(_, value)| value.into_owned())
}

/// The session id the `Cookie` header carries, if any.
fn session_id(cookie: &str) -> Option<&str> {
    cookie.split(';').find_map(|pair| {
        pair.trim()
            .strip_prefix(COOKIE)
            .and_then(|rest| rest.strip_prefix('='))
            .filter(|id| !id.is_empty())
    })
}

/// Why a form must not be taken: it came from another site. A browser that sends
/// `Sec-Fetch-Site` is believed (`same-origin` or `none` is the console's own; these
/// pages' `Referrer-Policy: no-referrer` makes Chromium send `Origin: null` with them);
/// otherwise an `Origin` must be the console's own. `None` if it may be taken.
fn foreign(request: &Request<'_>) -> Option<&'static str> {
    match request.fetch_site {
        Some("same-origin" | "none") => return None,
        Some(_) => return Some("The form came from another site."),
        None => {}
    }
    let origin = request.origin?;
    let own = request.host.is_some_and(|host| {
        origin
            .strip_prefix("http://")
            .or_else(|| origin.strip_prefix("https://"))
            .is_some_and(|rest| rest.eq_ignore_ascii_case(host))
    });
    (!own).then_some("The form came from another origin.")
}

/// The lock of `mutex`, also after a thread panicked holding it (what it guards is
/// whole after every call).
fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn not_found(why: &str) -> Response {
    let nobody = Viewer {
        csrf: None,
        actions_on: false,
        notice: None,
        session: None,
    };
    Response::html(404, pages::message(&nobody, "Not found", why))
}

fn refused(viewer: &Viewer, why: &str) -> Response {
    Response::html(403, pages::message(viewer, "Not allowed", why))
}

fn unreadable(viewer: &Viewer, e: &Error) -> Response {
    Response::html(
        503,
        pages::message(
            viewer,
            "Cannot read the outbox",
            &format!("The outbox cannot be read: {e}"),
        ),
    )
}

#[cfg(test)]
mod tests;
