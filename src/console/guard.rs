//! What stands between the network and the console's pages: the names it answers to,
//! who can reach a request's sender, the sessions of the people signed in, and the count
//! of failed sign-ins.

use std::collections::HashMap;
use std::net::IpAddr;
use std::time::Duration;

use crate::error::{Error, Result};

/// The names a console (or `outbox serve`) answers to: a request whose `Host` header
/// is not one of them is refused (`421 Misdirected Request`).
///
/// This is what defeats DNS rebinding: a web page the operator opens can point its own
/// name at `127.0.0.1`, but the browser then sends that name as the `Host`, and the
/// console does not answer to it. A name is given with or without a port; without
/// one, any port matches.
///
/// ```
/// use chunked_outbox::console::AllowedHosts;
///
/// let hosts = AllowedHosts::loopback(Some(9464)).allow("outbox.internal.example")?;
/// assert!(hosts.permits("localhost:9464"));
/// assert!(hosts.permits("[::1]:9464"));
/// assert!(hosts.permits("Outbox.Internal.Example:443"));
/// assert!(!hosts.permits("localhost:8080"));
/// assert!(!hosts.permits("rebind.attacker.example:9464"));
/// # Ok::<(), chunked_outbox::Error>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AllowedHosts {
    /// Lower-case names (an IPv6 address in brackets), each with its port if one is
    /// required.
    names: Vec<(String, Option<u16>)>,
    /// Any IP address as the host, on this port: a listener on every interface
    /// (`0.0.0.0`) is reached by its addresses, and a rebinding page can only ever
    /// send a name.
    any_address_on: Option<u16>,
}

impl AllowedHosts {
    /// The loopback names — `localhost`, `127.0.0.1`, `[::1]` — on `port` (any port
    /// when `None`).
    pub fn loopback(port: Option<u16>) -> Self {
        AllowedHosts {
            names: ["localhost", "127.0.0.1", "[::1]"]
                .into_iter()
                .map(|name| (name.to_owned(), port))
                .collect(),
            any_address_on: None,
        }
    }

    /// Also `name`: `host` or `host:port` (`[v6]:port` for an IPv6 address).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidInput`] for an empty name, one with characters no host name
    /// has, or a port that is not a number.
    pub fn allow(mut self, name: &str) -> Result<Self> {
        let invalid = |reason: &str| Error::InvalidInput {
            what: "allowed host",
            reason: format!("{name:?}: {reason}"),
        };
        let (host, port) = split_host(name.trim())
            .ok_or_else(|| invalid("not a host name, an address, or either with :port after it"))?;
        if host.is_empty()
            || !host
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"-._[]:".contains(&b))
        {
            return Err(invalid("a host name has only letters, digits, - and ."));
        }
        if !self.names.contains(&(host.clone(), port)) {
            self.names.push((host, port));
        }
        Ok(self)
    }

    /// Also any IP address as the host, on `port`: for a listener on every interface,
    /// which is reached by whichever address a client used. (A name still has to be
    /// allowed by [`allow`](Self::allow).)
    pub fn any_address(mut self, port: u16) -> Self {
        self.any_address_on = Some(port);
        self
    }

    /// Whether a request over plain HTTP whose `Host` header is `host` is answered. A
    /// `Host` without a port names HTTP's default port, 80 (what browsers and curl send
    /// there).
    pub fn permits(&self, host: &str) -> bool {
        self.permits_over(host, false)
    }

    /// Whether a request whose `Host` header is `host` is answered, over HTTPS when
    /// `https` (a `Host` without a port then names port 443).
    pub fn permits_over(&self, host: &str, https: bool) -> bool {
        let Some((name, port)) = split_host(host.trim()) else {
            return false;
        };
        let port = port.or(Some(if https { 443 } else { 80 }));
        let named = self
            .names
            .iter()
            .any(|(allowed, at)| *allowed == name && at.is_none_or(|at| Some(at) == port));
        named
            || self.any_address_on.is_some_and(|on| {
                port == Some(on) && name.trim_matches(['[', ']']).parse::<IpAddr>().is_ok()
            })
    }
}

/// Whether the name in `host` (a `Host` header's value, with or without its port) is a
/// loopback name: `localhost` or a loopback address. Only a client on this machine
/// sends one (or a proxy that rewrote the name, which says so in a forwarding header).
pub fn is_loopback_name(host: &str) -> bool {
    split_host(host.trim()).is_some_and(|(name, _)| {
        name == "localhost"
            || name
                .trim_matches(['[', ']'])
                .parse::<IpAddr>()
                .is_ok_and(|ip| ip.is_loopback())
    })
}

impl std::fmt::Display for AllowedHosts {
    /// The names, each with its port (`:*` for any), comma-separated; `any address:PORT`
    /// for [`any_address`](Self::any_address).
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut names: Vec<String> = self
            .names
            .iter()
            .map(|(name, port)| match port {
                Some(port) => format!("{name}:{port}"),
                None => format!("{name}:*"),
            })
            .collect();
        if let Some(port) = self.any_address_on {
            names.push(format!("any address:{port}"));
        }
        f.write_str(&names.join(", "))
    }
}

/// `host[:port]` as (lower-case host, port); `None` if the port is not a number or
/// the brackets of an IPv6 address are unbalanced.
fn split_host(value: &str) -> Option<(String, Option<u16>)> {
    let value = value.to_ascii_lowercase();
    let (host, port) = if value.starts_with('[') {
        let end = value.find(']')?;
        let rest = &value[end + 1..];
        let port = match rest.strip_prefix(':') {
            Some(port) => Some(port),
            None if rest.is_empty() => None,
            None => return None,
        };
        (value[..=end].to_owned(), port)
    } else {
        match value.rsplit_once(':') {
            Some((host, port)) if !host.contains(':') => (host.to_owned(), Some(port)),
            Some(_) => return None, // an IPv6 address without brackets
            None => (value.clone(), None),
        }
    };
    let port = match port {
        Some(port) => Some(port.parse::<u16>().ok()?),
        None => None,
    };
    Some((host, port))
}

/// How long a session lasts from sign-in, however busy.
pub const SESSION_LIFETIME: Duration = Duration::from_secs(12 * 3600);
/// How long a session lasts without a request.
pub const SESSION_IDLE: Duration = Duration::from_secs(30 * 60);
/// The most sessions kept at once; one more ends the one least recently used.
pub(crate) const MAX_SESSIONS: usize = 64;

/// A signed-in person's session, kept on the server: the cookie carries only its id.
#[derive(Debug, Clone)]
pub(crate) struct Session {
    /// The form token of this session's pages (actions and sign-out).
    pub(crate) csrf: String,
    started: i64,
    seen: i64,
}

/// The sessions of the people signed in, by id.
#[derive(Debug, Default)]
pub(crate) struct Sessions(HashMap<String, Session>);

impl Sessions {
    /// A new session at `now` (ms): its id and form token.
    pub(crate) fn start(&mut self, now: i64) -> Result<(String, String)> {
        self.0.retain(|_, s| live(s, now));
        if self.0.len() >= MAX_SESSIONS {
            let oldest = self
                .0
                .iter()
                .min_by_key(|(_, s)| s.seen)
                .map(|(id, _)| id.clone());
            if let Some(oldest) = oldest {
                self.0.remove(&oldest);
            }
        }
        let id = random_hex()?;
        let csrf = random_hex()?;
        self.0.insert(
            id.clone(),
            Session {
                csrf: csrf.clone(),
                started: now,
                seen: now,
            },
        );
        Ok((id, csrf))
    }

    /// The live session `id`, seen again at `now`; an expired one is ended.
    pub(crate) fn touch(&mut self, id: &str, now: i64) -> Option<Session> {
        let session = self.0.get_mut(id)?;
        if !live(session, now) {
            self.0.remove(id);
            return None;
        }
        session.seen = now;
        Some(session.clone())
    }

    /// Ends session `id` (sign-out).
    pub(crate) fn end(&mut self, id: &str) {
        self.0.remove(id);
    }
}

fn live(session: &Session, now: i64) -> bool {
    now - session.started < SESSION_LIFETIME.as_millis() as i64
        && now - session.seen < SESSION_IDLE.as_millis() as i64
}

/// 128 random bits, as 32 hex digits.
pub(crate) fn random_hex() -> Result<String> {
    let mut random = [0u8; 16];
    getrandom::fill(&mut random).map_err(|e| Error::Io {
        path: "the system's random source".into(),
        source: std::io::Error::other(e.to_string()),
    })?;
    Ok(random.iter().map(|b| format!("{b:02x}")).collect())
}

/// Failed sign-ins a client may make before it has to wait.
pub const FREE_SIGN_IN_FAILURES: u32 = 3;
/// Failed sign-ins from everyone together past which each client's allowance is gone:
/// every client's next failure then earns a wait at once. A client with no failures of
/// its own is always heard, so nobody else's wrong tokens keep the operator out.
pub const FREE_SIGN_IN_FAILURES_OVERALL: u32 = 30;
/// The longest wait a failed sign-in earns.
pub const LONGEST_SIGN_IN_WAIT: Duration = Duration::from_secs(15 * 60);
/// The most clients whose failures are remembered (the oldest is forgotten first).
const PEERS_REMEMBERED: usize = 4096;

/// Failed sign-ins of one client, or of everyone.
#[derive(Debug, Clone, Copy, Default)]
struct Failures {
    count: u32,
    last: i64,
}

impl Failures {
    /// When another attempt may be made, with `free` failures allowed before any wait:
    /// each failure past them doubles the wait, from a second up to
    /// [`LONGEST_SIGN_IN_WAIT`].
    fn open_at(&self, free: u32) -> i64 {
        if self.count <= free {
            return self.last;
        }
        let doublings = (self.count - free - 1).min(20);
        let wait = (1000i64 << doublings).min(LONGEST_SIGN_IN_WAIT.as_millis() as i64);
        self.last + wait
    }

    /// Forgotten once a longest wait has passed without a failure.
    fn stale(&self, now: i64) -> bool {
        now - self.last >= LONGEST_SIGN_IN_WAIT.as_millis() as i64
    }

    fn fail(&mut self, now: i64) {
        if self.stale(now) {
            self.count = 0;
        }
        self.count += 1;
        self.last = now;
    }
}

/// The failed sign-ins, per client and overall. A client's own failures make it wait,
/// longer each time; everyone's together only take away each client's free failures.
/// So a client that has failed nothing is always heard, and a correct token from it
/// always signs in, however many wrong ones others send.
#[derive(Debug, Default)]
pub(crate) struct Throttle {
    peers: HashMap<Option<IpAddr>, Failures>,
    overall: Failures,
}

impl Throttle {
    /// How long `client` has to wait before its sign-in is even looked at; `None` if it
    /// need not.
    pub(crate) fn wait(&self, client: Option<IpAddr>, now: i64) -> Option<Duration> {
        let own = self.peers.get(&client_key(client))?;
        let crowded =
            self.overall.count > FREE_SIGN_IN_FAILURES_OVERALL && !self.overall.stale(now);
        let free = if crowded { 0 } else { FREE_SIGN_IN_FAILURES };
        let open = own.open_at(free);
        (open > now).then(|| Duration::from_millis((open - now) as u64))
    }

    /// Counts a failed sign-in of `client` at `now`; how many it has made in a row.
    pub(crate) fn fail(&mut self, client: Option<IpAddr>, now: i64) -> u32 {
        let key = client_key(client);
        if self.peers.len() >= PEERS_REMEMBERED && !self.peers.contains_key(&key) {
            self.peers.retain(|_, f| !f.stale(now));
            if self.peers.len() >= PEERS_REMEMBERED {
                let oldest = self
                    .peers
                    .iter()
                    .min_by_key(|(_, f)| f.last)
                    .map(|(p, _)| *p);
                if let Some(oldest) = oldest {
                    self.peers.remove(&oldest);
                }
            }
        }
        self.overall.fail(now);
        let failures = self.peers.entry(key).or_default();
        failures.fail(now);
        failures.count
    }

    /// A client that signed in starts afresh.
    pub(crate) fn succeed(&mut self, client: Option<IpAddr>) {
        self.peers.remove(&client_key(client));
    }
}

/// What one client is counted as: its IPv4 address, or its IPv6 network (the first 64
/// bits: one host is given a whole /64 and may use any address in it).
pub fn client_key(client: Option<IpAddr>) -> Option<IpAddr> {
    Some(match client? {
        IpAddr::V4(v4) => IpAddr::V4(v4),
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => IpAddr::V6(std::net::Ipv6Addr::from(
                u128::from(v6) & !((1u128 << 64) - 1),
            )),
        },
    })
}

/// The client behind a request from `peer`: `peer` itself, unless it is one of the
/// `trusted` proxies, and then the last address of the `forwarded` chain (a
/// `Forwarded` or `X-Forwarded-For` value) that is not a trusted proxy: the one a
/// trusted proxy saw. A chain that names no address leaves the proxy as the client.
pub(crate) fn client(
    peer: Option<IpAddr>,
    forwarded: Option<&str>,
    trusted: &[IpAddr],
) -> Option<IpAddr> {
    let peer = peer?;
    if !trusted.contains(&peer) {
        return Some(peer);
    }
    for hop in forwarded.unwrap_or_default().rsplit(',') {
        match hop_address(hop) {
            Some(address) if trusted.contains(&address) => continue,
            Some(address) => return Some(address),
            None => break,
        }
    }
    Some(peer)
}

/// The address of one hop of a forwarding chain: `for=…` of a `Forwarded` element
/// (`for=192.0.2.7;proto=https`, `for="[2001:db8::1]:4711"`), or an `X-Forwarded-For`
/// entry, with or without a port.
fn hop_address(hop: &str) -> Option<IpAddr> {
    let hop = hop.trim();
    let value = if hop.contains('=') {
        hop.split(';').find_map(|pair| {
            let (name, value) = pair.split_once('=')?;
            name.trim()
                .eq_ignore_ascii_case("for")
                .then_some(value.trim())
        })?
    } else {
        hop
    };
    let value = value.trim_matches('"');
    if let Ok(ip) = value.parse::<IpAddr>() {
        return Some(ip);
    }
    let (host, _) = split_host(value)?;
    host.trim_matches(['[', ']']).parse().ok()
}

/// The fewest different characters a console token may have: a token of one repeated
/// character, or a short pattern, is guessed first.
pub const MIN_TOKEN_VARIETY: usize = 10;

/// Whether `token` has enough different characters (see [`MIN_TOKEN_VARIETY`]).
pub(crate) fn varied(token: &str) -> bool {
    let mut seen = [false; 256];
    for b in token.bytes() {
        seen[usize::from(b)] = true;
    }
    seen.iter().filter(|s| **s).count() >= MIN_TOKEN_VARIETY
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hosts_are_matched_by_name_and_port() {
        let hosts = AllowedHosts::loopback(Some(9464));
        for ok in [
            "localhost:9464",
            "127.0.0.1:9464",
            "[::1]:9464",
            "LOCALHOST:9464",
        ] {
            assert!(hosts.permits(ok), "{ok}");
        }
        for refused in [
            "localhost",
            "localhost:9465",
            "rebind.example:9464",
            "127.0.0.1.nip.io:9464",
            "10.0.0.5:9464",
            "",
            "[::1",
            "::1:9464",
            "localhost:http",
        ] {
            assert!(!hosts.permits(refused), "{refused}");
        }
        let any_port = AllowedHosts::loopback(None);
        assert!(any_port.permits("localhost") && any_port.permits("127.0.0.1:1"));
        let wide = AllowedHosts::loopback(Some(80))
            .any_address(80)
            .allow("Box.example")
            .unwrap();
        assert!(wide.permits("10.0.0.5:80") && wide.permits("[fe80::1]:80"));
        assert!(!wide.permits("10.0.0.5:81") && !wide.permits("10.0.0.5:8080"));
        // Without a port: HTTP's 80 (HTTPS's 443).
        assert!(wide.permits("10.0.0.5") && wide.permits("box.example"));
        assert!(!wide.permits_over("10.0.0.5", true));
        let tls = AllowedHosts::loopback(Some(443));
        assert!(tls.permits_over("localhost", true) && !tls.permits("localhost"));
        assert!(wide.permits("box.example:80") && wide.permits("box.example"));
        assert!(!wide.permits("rebind.example:80"));
        for bad in ["", "a b", "x:port", "<x>", "::1", "fe80::1:80", "[::1]x"] {
            assert!(AllowedHosts::loopback(None).allow(bad).is_err(), "{bad:?}");
        }
        // An IPv6 address is written in brackets, with or without a port after them.
        assert!(any_port.permits("[::1]") && any_port.permits("[::1]:1"));
        assert!(!any_port.permits("[::1]x") && !any_port.permits("[::1]x:1"));
        assert_eq!(split_host("[::1]"), Some(("[::1]".to_owned(), None)));
        assert_eq!(split_host("::1"), None);
    }

    #[test]
    fn a_session_ends_when_idle_past_its_lifetime_or_signed_out() {
        let mut sessions = Sessions::default();
        let idle = SESSION_IDLE.as_millis() as i64;
        let (id, csrf) = sessions.start(0).unwrap();
        assert_eq!(id.len(), 32);
        assert_ne!(id, csrf);
        assert_eq!(sessions.touch(&id, idle - 1).unwrap().csrf, csrf);
        // Seen just now: the idle time counts from there.
        assert!(sessions.touch(&id, 2 * idle - 2).is_some());
        assert!(sessions.touch(&id, 3 * idle).is_none(), "idle");
        assert!(sessions.touch(&id, 0).is_none(), "ended, not revived");
        let (busy, _) = sessions.start(0).unwrap();
        let lifetime = SESSION_LIFETIME.as_millis() as i64;
        let mut at = 0;
        while at + idle / 2 < lifetime {
            at += idle / 2;
            assert!(sessions.touch(&busy, at).is_some());
        }
        assert!(sessions.touch(&busy, lifetime).is_none(), "lifetime");
        // Twelve hours, however busy: seen every 20 minutes, alive at 11:59, ended at 12.
        let (day, _) = sessions.start(0).unwrap();
        let minute = 60_000;
        for at in (20..12 * 60).step_by(20) {
            assert!(sessions.touch(&day, at * minute).is_some(), "at {at} min");
        }
        assert!(sessions.touch(&day, (12 * 60 - 1) * minute).is_some());
        assert!(sessions.touch(&day, 12 * 60 * minute).is_none());
        // Thirty minutes without a request.
        let (quiet, _) = sessions.start(0).unwrap();
        assert!(sessions.touch(&quiet, 29 * minute).is_some());
        assert!(sessions.touch(&quiet, 59 * minute).is_none());
        let (out, _) = sessions.start(0).unwrap();
        sessions.end(&out);
        assert!(sessions.touch(&out, 1).is_none());
        // Bounded: the least recently used goes first.
        let ids: Vec<String> = (0..MAX_SESSIONS as i64 + 1)
            .map(|n| sessions.start(n).unwrap().0)
            .collect();
        assert!(sessions.touch(&ids[0], 100).is_none());
        assert!(sessions.touch(&ids[MAX_SESSIONS], 100).is_some());
    }

    #[test]
    fn failed_sign_ins_earn_a_growing_wait_per_client() {
        let mut throttle = Throttle::default();
        let peer = Some(IpAddr::from([10, 0, 0, 1]));
        let other = Some(IpAddr::from([10, 0, 0, 2]));
        for n in 1..=FREE_SIGN_IN_FAILURES {
            assert_eq!(throttle.wait(peer, 0), None, "failure {n} is free");
            assert_eq!(throttle.fail(peer, 0), n);
        }
        assert_eq!(throttle.wait(peer, 0), None);
        throttle.fail(peer, 0);
        assert_eq!(throttle.wait(peer, 0), Some(Duration::from_secs(1)));
        assert_eq!(throttle.wait(peer, 1000), None);
        throttle.fail(peer, 1000);
        assert_eq!(throttle.wait(peer, 1000), Some(Duration::from_secs(2)));
        assert_eq!(
            throttle.wait(other, 1000),
            None,
            "another client is not held"
        );
        for _ in 0..30 {
            throttle.fail(peer, 1000);
        }
        // At most fifteen minutes, however many.
        assert_eq!(
            throttle.wait(peer, 1000),
            Some(Duration::from_secs(15 * 60))
        );
        throttle.succeed(peer);
        let later = 1000 + LONGEST_SIGN_IN_WAIT.as_millis() as i64;
        assert_eq!(throttle.wait(peer, later), None);
        // Forgotten after a longest wait without a failure.
        throttle.fail(other, later);
        assert_eq!(throttle.wait(other, later), None);
    }

    /// Everyone's allowance is gone only past its last free failure: at exactly
    /// [`FREE_SIGN_IN_FAILURES_OVERALL`] each client still has its own free ones.
    #[test]
    fn the_overall_allowance_ends_past_its_last_free_failure() {
        let mut throttle = Throttle::default();
        let client = Some(IpAddr::from([198, 51, 100, 7]));
        throttle.fail(client, 0);
        for n in 1..FREE_SIGN_IN_FAILURES_OVERALL {
            throttle.fail(Some(IpAddr::from([203, 0, 113, n as u8])), 0);
        }
        assert_eq!(throttle.overall.count, FREE_SIGN_IN_FAILURES_OVERALL);
        assert_eq!(
            throttle.wait(client, 0),
            None,
            "its own failure is still free"
        );
        throttle.fail(Some(IpAddr::from([203, 0, 114, 1])), 0);
        assert_eq!(throttle.wait(client, 0), Some(Duration::from_secs(1)));
    }

    /// The names are printed each with its port, `:*` for any, and any address last.
    #[test]
    fn the_names_print_as_they_are_answered() {
        let hosts = AllowedHosts::loopback(Some(9464))
            .any_address(9464)
            .allow("box.example")
            .unwrap()
            .allow("box.example")
            .unwrap();
        assert_eq!(
            hosts.to_string(),
            "localhost:9464, 127.0.0.1:9464, [::1]:9464, box.example:*, any address:9464"
        );
        assert_eq!(
            AllowedHosts::loopback(None).to_string(),
            "localhost:*, 127.0.0.1:*, [::1]:*"
        );
    }

    /// Everyone's failures together never keep out a client that has failed nothing:
    /// they only take away the free failures of those that have.
    #[test]
    fn nobody_elses_failures_refuse_a_client_with_none() {
        let mut throttle = Throttle::default();
        let nth = |n: u8| Some(IpAddr::from([203, 0, 113, n]));
        // A few addresses, each within its own allowance, past everyone's together.
        for n in 0..=FREE_SIGN_IN_FAILURES_OVERALL as u8 / FREE_SIGN_IN_FAILURES as u8 {
            for _ in 0..FREE_SIGN_IN_FAILURES {
                throttle.fail(nth(n), 0);
            }
        }
        assert!(throttle.overall.count > FREE_SIGN_IN_FAILURES_OVERALL);
        let operator = Some(IpAddr::from([198, 51, 100, 7]));
        assert_eq!(throttle.wait(operator, 0), None, "no failures of its own");
        assert_eq!(throttle.wait(None, 0), None);
        // Their allowance is gone: each of them now waits.
        assert_eq!(throttle.wait(nth(0), 0), Some(Duration::from_secs(4)));
        // The operator mistypes once: a second's wait, not a lock-out.
        throttle.fail(operator, 0);
        assert_eq!(throttle.wait(operator, 0), Some(Duration::from_secs(1)));
        assert_eq!(throttle.wait(operator, 1000), None);
        // Once everyone's failures are stale, the allowance is back.
        let later = LONGEST_SIGN_IN_WAIT.as_millis() as i64;
        throttle.fail(operator, later);
        assert_eq!(throttle.wait(operator, later), None);
    }

    /// Behind a trusted proxy the client is the last address it forwarded that is not
    /// a trusted proxy; from anyone else the header is never believed.
    #[test]
    fn the_client_is_read_from_trusted_proxies_only() {
        let proxy = IpAddr::from([10, 0, 0, 9]);
        let inner = IpAddr::from([10, 0, 0, 8]);
        let trusted = [proxy, inner];
        let client_at = |peer: IpAddr, forwarded| client(Some(peer), forwarded, &trusted);
        let alice = IpAddr::from([198, 51, 100, 7]);
        assert_eq!(
            client_at(alice, Some("1.2.3.4")),
            Some(alice),
            "not a proxy"
        );
        assert_eq!(client_at(proxy, Some("1.2.3.4, 198.51.100.7")), Some(alice));
        assert_eq!(
            client_at(proxy, Some("198.51.100.7:5120, 10.0.0.8")),
            Some(alice)
        );
        assert_eq!(
            client_at(
                proxy,
                Some("for=1.2.3.4, for=\"[2001:db8::1]:4711\";proto=https")
            ),
            Some(IpAddr::from([0x2001, 0xdb8, 0, 0, 0, 0, 0, 1]))
        );
        assert_eq!(
            client_at(proxy, Some("For=198.51.100.7;proto=http")),
            Some(alice)
        );
        assert_eq!(client_at(proxy, Some("unknown")), Some(proxy));
        assert_eq!(
            client_at(proxy, Some("10.0.0.8")),
            Some(proxy),
            "only proxies"
        );
        assert_eq!(client_at(proxy, None), Some(proxy));
        assert_eq!(client(None, Some("1.2.3.4"), &trusted), None);
        // One client: an IPv4 address, or an IPv6 /64.
        let v6 = |last| Some(IpAddr::from([0x2001, 0xdb8, 0, 1, 0, 0, 0, last]));
        assert_eq!(client_key(v6(1)), client_key(v6(2)));
        assert_ne!(
            client_key(v6(1)),
            client_key(Some(IpAddr::from([0x2001, 0xdb8, 0, 2, 0, 0, 0, 1])))
        );
        let mapped = "::ffff:198.51.100.7".parse::<IpAddr>().ok();
        assert_eq!(client_key(mapped), Some(alice));
        assert_eq!(client_key(None), None);
        assert!(is_loopback_name("127.0.0.2:80") && is_loopback_name("[::1]"));
        assert!(is_loopback_name("LOCALHOST") && !is_loopback_name("10.0.0.1"));
        assert!(!is_loopback_name("localhost.example") && !is_loopback_name("::1"));
    }

    /// A peer that signs in starts afresh; the peers remembered are bounded, the
    /// oldest forgotten first and the stale ones before any.
    #[test]
    fn a_sign_in_clears_its_peer_and_the_peers_remembered_are_bounded() {
        let mut throttle = Throttle::default();
        let peer = Some(IpAddr::from([10, 0, 0, 1]));
        for _ in 0..=FREE_SIGN_IN_FAILURES {
            throttle.fail(peer, 0);
        }
        assert!(throttle.wait(peer, 0).is_some());
        throttle.succeed(peer);
        assert_eq!(throttle.wait(peer, 0), None, "signed in: no wait");

        let mut throttle = Throttle::default();
        let nth = |n: usize| Some(IpAddr::from([10, 1, (n >> 8) as u8, n as u8]));
        for n in 0..PEERS_REMEMBERED {
            throttle.fail(nth(n), n as i64);
        }
        assert_eq!(throttle.peers.len(), PEERS_REMEMBERED);
        // A peer already remembered forgets nobody.
        throttle.fail(nth(5), 5_000);
        assert_eq!(throttle.peers.len(), PEERS_REMEMBERED);
        assert!(throttle.peers.contains_key(&nth(0)));
        // A new one: the oldest goes.
        let newcomer = Some(IpAddr::from([192, 168, 0, 1]));
        throttle.fail(newcomer, 6_000);
        assert_eq!(throttle.peers.len(), PEERS_REMEMBERED);
        assert!(!throttle.peers.contains_key(&nth(0)) && throttle.peers.contains_key(&newcomer));
        assert!(throttle.peers.contains_key(&nth(1)));
        // Long after: the stale ones go first, all of them.
        let later = 7_000 + LONGEST_SIGN_IN_WAIT.as_millis() as i64;
        throttle.fail(Some(IpAddr::from([192, 168, 0, 2])), later);
        assert_eq!(throttle.peers.len(), 1);
    }

    #[test]
    fn a_token_needs_variety() {
        assert!(!varied(&"a".repeat(16)));
        assert!(!varied("abcdabcdabcdabcd"));
        assert!(!varied("012345678"));
        assert!(varied("0123456789"));
    }
}
