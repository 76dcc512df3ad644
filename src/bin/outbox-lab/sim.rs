//! The simulated world shared by `outbox-lab demo` and `outbox-lab torture`: four platforms
//! that fail in the ways real ones do and record what they accept in their own SQLite
//! file, replies of realistic shapes, and the operator who settles uncertain chunks.
//!
//! Slack, Discord and Matrix are declared [`ReplayPolicy::Ask`]:
//! the dispatchers ask them about a possibly-sent part (Slack answers a lookup by the
//! key in the message metadata; Discord deduplicates a nonce for a few minutes; a
//! Matrix homeserver a transaction id for 30 minutes, every process sending as one
//! device) and settle it without a person. Telegram cannot be asked: its possibly-sent
//! parts are held for the operator.
//!
//! With `OUTBOX_LAB_SLACK_TIER=1` in the environment, Slack's history reads are limited
//! as Tier 1 limits them (since 2025 for apps outside the Marketplace): one a minute
//! for the whole workspace, whichever process asks, the others answered `ratelimited`
//! with the seconds left in `Retry-After`.
//!
//! The operator knows only what a real one could: what the outbox shows, and what a
//! platform's own API answers where it has one (Slack lets a bot look its messages up
//! by metadata; Telegram has no such call). It never reads the platforms' record — that
//! is for the verdict alone.

use std::collections::{HashMap, HashSet};
use std::path::Path;
use std::sync::Mutex;
use std::time::Duration;

use chunked_outbox::maintenance::Resolution;
use chunked_outbox::monitoring::{ChunkStatus, DeliveryStatus, ListFilter};
use chunked_outbox::platforms::{self, HttpReply};
use chunked_outbox::rules::{Backoff, ChannelPolicy, LaneFailurePolicy, ReplayPolicy, RetryPolicy};
use chunked_outbox::settle::{Decision, PossiblySent, Settlement};
use chunked_outbox::{ChannelAdapter, Claim, Outbox, OutboxOptions, Outcome, Splitter};
use rusqlite::{Connection, OptionalExtension, params};

use crate::CliResult;

/// Which real API a simulated platform answers like.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Api {
    /// Telegram Bot API: no idempotency key, messages of at most 4,096 UTF-16 units,
    /// 429 with `parameters.retry_after` in whole seconds.
    Telegram,
    /// Discord: deduplicates by `nonce` (at most 25 characters, with `enforce_nonce`),
    /// messages of at most 2,000 characters, 429 with a float `retry_after`.
    Discord,
    /// Slack `chat.postMessage`: no idempotency key, text of at most 40,000 characters,
    /// errors as `{"ok": false, "error": ...}`, 429 with a `Retry-After` header.
    Slack,
    /// Matrix `PUT …/send/m.room.message/{txnId}`: the transaction id deduplicates a
    /// resend from the same device for 30 minutes (Synapse), events of at most 65,536
    /// bytes, `M_LIMIT_EXCEEDED` with `retry_after_ms`, a 502 from the proxy in front.
    Matrix,
}

/// One simulated platform's traits.
pub struct SimChannel {
    pub name: &'static str,
    pub api: Api,
    pub splitter: Splitter,
    /// The platform has an API that tells whether a message arrived (Slack:
    /// `conversations.history` with the message metadata the bot sent). Telegram has
    /// none; Discord cannot be asked, but deduplicates.
    pub lookup: bool,
}

pub const CHANNELS: [SimChannel; 4] = [
    SimChannel {
        name: "telegram",
        api: Api::Telegram,
        splitter: Splitter::telegram(),
        lookup: false,
    },
    SimChannel {
        name: "discord",
        api: Api::Discord,
        splitter: Splitter::discord(),
        lookup: false,
    },
    SimChannel {
        name: "slack",
        api: Api::Slack,
        splitter: Splitter::slack(),
        lookup: true,
    },
    SimChannel {
        name: "matrix",
        api: Api::Matrix,
        splitter: Splitter::matrix(),
        lookup: false,
    },
];

/// The simulation's outbox settings, shared by the engine and every worker: a retry schedule
/// in milliseconds instead of seconds (so the demo finishes quickly), a short lease,
/// and strict lane order (a lane waits for its uncertain or dead head to be settled).
pub fn sim_options() -> OutboxOptions {
    OutboxOptions::default()
        .with_retry(
            RetryPolicy::default()
                .with_backoff(Backoff::Schedule(
                    [50, 100, 200, 400].map(Duration::from_millis).to_vec(),
                ))
                .with_max_attempts(8),
        )
        .with_lease(Duration::from_secs(2))
        .with_lane_failure(LaneFailurePolicy::Block)
        // Stored rules: every process that recovers expired leases (the operator, a
        // restarted worker before its dispatcher is built) follows the same replay
        // policy.
        .with_channel("discord", ChannelPolicy::asking())
        .with_channel("slack", ChannelPolicy::asking())
        .with_channel("matrix", ChannelPolicy::asking())
}

/// How long the simulated Discord remembers a nonce: "a few minutes".
const NONCE_MEMORY_MS: i64 = 3 * 60 * 1000;

/// How long the simulated homeserver remembers a transaction id (Synapse's 30 minutes).
const TRANSACTION_MEMORY_MS: i64 = 30 * 60 * 1000;

/// Whether Slack's history reads are limited as Tier 1 limits them (one a minute), from
/// `OUTBOX_LAB_SLACK_TIER=1`.
fn slack_tier_1() -> bool {
    std::env::var("OUTBOX_LAB_SLACK_TIER").is_ok_and(|tier| tier.trim() == "1")
}

fn wall_ms() -> i64 {
    chrono::Utc::now().timestamp_millis()
}

pub fn open_platform(path: &Path) -> rusqlite::Result<Connection> {
    let conn = Connection::open(path)?;
    conn.busy_timeout(Duration::from_secs(10))?;
    conn.execute_batch(
        "PRAGMA journal_mode = WAL;
         CREATE TABLE IF NOT EXISTS received (
             id INTEGER PRIMARY KEY, channel TEXT NOT NULL, chat TEXT NOT NULL, key TEXT NOT NULL,
             nonce TEXT, at INTEGER NOT NULL DEFAULT 0);
         CREATE INDEX IF NOT EXISTS received_key ON received (key);
         CREATE INDEX IF NOT EXISTS received_nonce ON received (nonce) WHERE nonce IS NOT NULL;
         CREATE TABLE IF NOT EXISTS deduplicated (key TEXT NOT NULL);
         CREATE TABLE IF NOT EXISTS history_reads (at INTEGER NOT NULL);",
    )?;
    Ok(conn)
}

/// A send as the platform's HTTP API receives it.
#[derive(Debug, Clone)]
pub struct Request<'a> {
    pub chat: &'a str,
    pub text: &'a str,
    /// Discord's `nonce` (sent with `enforce_nonce: true`) or Matrix's transaction id,
    /// if the client sent one.
    pub nonce: Option<String>,
    /// What identifies the message in the platform's record, for the verdict alone (a
    /// real record would hold the text; the key is shorter).
    pub key: &'a str,
}

/// What the platform answered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Answer {
    Http {
        status: u16,
        retry_after: Option<String>,
        body: String,
    },
    /// The connection timed out after the request was written.
    Timeout,
}

impl Answer {
    fn http(status: u16, body: impl Into<String>) -> Answer {
        Answer::Http {
            status,
            retry_after: None,
            body: body.into(),
        }
    }
}

/// One simulated platform. It enforces the real API's limits (message length, nonce
/// length), accepts most sends, fails some transiently, rate-limits some, times out on
/// some after (maybe) accepting them, and rejects chats that are gone — each answered
/// in that API's own shape, so the adapter maps it with the crate's typed mapping.
pub struct SimPlatform {
    channel: &'static str,
    api: Api,
    record: Mutex<Connection>,
    rng: Mutex<fastrand::Rng>,
    /// Where each answer about a possibly-sent part is logged for the verdict, as
    /// `settle <claimant or -> <attempts> <key> <decision>`.
    settle_log: Option<Mutex<std::fs::File>>,
}

/// Discord's limit on a nonce.
const DISCORD_NONCE_MAX: usize = 25;

impl SimPlatform {
    /// A platform for `channel` recording into `record`, with its own random stream.
    pub fn new(channel: &SimChannel, record: Connection, seed: u64) -> SimPlatform {
        SimPlatform {
            channel: channel.name,
            api: channel.api,
            record: Mutex::new(record),
            rng: Mutex::new(fastrand::Rng::with_seed(seed)),
            settle_log: None,
        }
    }

    /// The same platform, logging its answers about possibly-sent parts to `log`.
    pub fn logging_settlements(self, log: &Path) -> std::io::Result<SimPlatform> {
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(log)?;
        Ok(SimPlatform {
            settle_log: Some(Mutex::new(file)),
            ..self
        })
    }

    /// The platform's answer about a possibly-sent part. Slack looks its history up by
    /// the key in the message metadata (a lookup is rate-limited one time in twenty, or
    /// under Tier 1 whenever another was made less than a minute ago: asked again
    /// later); Discord deduplicates a resend inside its nonce window, a Matrix
    /// homeserver inside its transaction window.
    fn answer_about(&self, part: &PossiblySent) -> Settlement {
        match self.api {
            Api::Slack => {
                if slack_tier_1() {
                    match self.tier_1_wait() {
                        Ok(Some(wait)) => {
                            return Settlement::later_after(
                                "conversations.history",
                                format!("ratelimited (Tier 1), retry after {} s", wait.as_secs()),
                                wait,
                            );
                        }
                        Ok(None) => {}
                        Err(e) => return Settlement::later("conversations.history", e.to_string()),
                    }
                } else if self.rng.lock().unwrap_or_else(|e| e.into_inner()).u8(0..20) == 0 {
                    return Settlement::later("conversations.history", "ratelimited");
                }
                let asked = format!(
                    "conversations.history of {} for the key {}",
                    part.claim.chat_id, part.claim.idempotency_key
                );
                let found: rusqlite::Result<Option<i64>> = self
                    .record
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .query_row(
                        "SELECT id FROM received WHERE key = ?1 AND channel = ?2 AND chat = ?3",
                        params![part.claim.idempotency_key, self.channel, part.claim.chat_id],
                        |r| r.get(0),
                    )
                    .optional();
                match found {
                    Ok(Some(id)) => Settlement::found(
                        asked,
                        format!("a message with the key, ts 1700000000.{id:06}"),
                        Some(format!("1700000000.{id:06}")),
                    ),
                    Ok(None) => Settlement::resend(asked, "no message with the key"),
                    Err(e) => Settlement::later(asked, e.to_string()),
                }
            }
            Api::Discord => platforms::discord::settle(part, platforms::discord::NONCE_WINDOW),
            Api::Matrix => {
                platforms::matrix::settle(part, platforms::matrix::SYNAPSE_TRANSACTION_WINDOW)
            }
            Api::Telegram => Settlement::hold("telegram", "no way to ask"),
        }
    }

    /// Under Tier 1: how long before the workspace may read Slack's history again, or
    /// `None` if now (this read is then counted, for every process).
    fn tier_1_wait(&self) -> rusqlite::Result<Option<Duration>> {
        let mut conn = self.record.lock().unwrap_or_else(|e| e.into_inner());
        let tx = conn.transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)?;
        let now = wall_ms();
        let last: Option<i64> =
            tx.query_row("SELECT max(at) FROM history_reads", [], |r| r.get(0))?;
        if let Some(last) = last.filter(|at| now - at < 60_000) {
            let left = (last + 60_000 - now) as u64;
            return Ok(Some(Duration::from_secs(left.div_ceil(1000))));
        }
        tx.execute("DELETE FROM history_reads", [])?;
        tx.execute("INSERT INTO history_reads (at) VALUES (?1)", [now])?;
        tx.commit()?;
        Ok(None)
    }

    /// Records an accepted message and returns its id; a replay with a nonce seen in
    /// the last few minutes (Discord) is dropped and answered with the first message's
    /// id.
    fn accept(&self, request: &Request<'_>) -> rusqlite::Result<i64> {
        let conn = self.record.lock().unwrap_or_else(|e| e.into_inner());
        let now = wall_ms();
        let memory = match self.api {
            Api::Matrix => TRANSACTION_MEMORY_MS,
            _ => NONCE_MEMORY_MS,
        };
        if let Some(nonce) = &request.nonce {
            let seen: Option<i64> = conn
                .query_row(
                    "SELECT id FROM received WHERE nonce = ?1 AND channel = ?2 AND at > ?3
                     ORDER BY id LIMIT 1",
                    params![nonce, self.channel, now - memory],
                    |r| r.get(0),
                )
                .optional()?;
            if let Some(id) = seen {
                conn.execute("INSERT INTO deduplicated (key) VALUES (?1)", [request.key])?;
                return Ok(id);
            }
        }
        conn.execute(
            "INSERT INTO received (channel, chat, key, nonce, at) VALUES (?1, ?2, ?3, ?4, ?5)",
            params![self.channel, request.chat, request.key, request.nonce, now],
        )?;
        Ok(conn.last_insert_rowid())
    }

    /// The platform's answer to one send.
    pub fn post(&self, request: &Request<'_>) -> Answer {
        let (roll, delivered_anyway, latency) = {
            let mut rng = self.rng.lock().unwrap_or_else(|e| e.into_inner());
            (rng.u32(0..1000), rng.bool(), rng.u64(0..1500))
        };
        std::thread::sleep(Duration::from_micros(latency)); // the network round trip
        if let Some(refusal) = self.refuse(request) {
            return refusal;
        }
        match roll {
            0..40 => return self.unavailable(),
            40..55 => return self.rate_limited(),
            55..75 => {
                // A timeout after the request was written: it may or may not have landed.
                if delivered_anyway && self.accept(request).is_err() {
                    return self.unavailable();
                }
                return Answer::Timeout;
            }
            _ => {}
        }
        match self.accept(request) {
            Ok(id) => self.created(id),
            Err(_) => self.unavailable(),
        }
    }

    /// A request the real API refuses whatever the moment: too long, a nonce over
    /// Discord's limit, a chat that is gone.
    fn refuse(&self, request: &Request<'_>) -> Option<Answer> {
        let gone = chat_is_gone(request.chat);
        Some(match self.api {
            Api::Telegram if gone => Answer::http(
                403,
                r#"{"ok":false,"error_code":403,"description":"Forbidden: bot was blocked by the user"}"#,
            ),
            Api::Telegram if request.text.encode_utf16().count() > 4096 => Answer::http(
                400,
                r#"{"ok":false,"error_code":400,"description":"Bad Request: message is too long"}"#,
            ),
            Api::Discord
                if request
                    .nonce
                    .as_ref()
                    .is_some_and(|n| n.chars().count() > DISCORD_NONCE_MAX) =>
            {
                Answer::http(
                    400,
                    r#"{"code": 50035, "errors": {"nonce": {"_errors": [{"code": "BASE_TYPE_MAX_LENGTH", "message": "Must be 25 or fewer in length."}]}}, "message": "Invalid Form Body"}"#,
                )
            }
            Api::Discord if gone => {
                Answer::http(404, r#"{"message": "Unknown Channel", "code": 10003}"#)
            }
            Api::Discord if request.text.chars().count() > 2000 => Answer::http(
                400,
                r#"{"code": 50035, "errors": {"content": {"_errors": [{"code": "BASE_TYPE_MAX_LENGTH", "message": "Must be 2000 or fewer in length."}]}}, "message": "Invalid Form Body"}"#,
            ),
            Api::Slack if gone => {
                Answer::http(200, r#"{"ok": false, "error": "channel_not_found"}"#)
            }
            Api::Slack if request.text.chars().count() > 40_000 => {
                Answer::http(200, r#"{"ok": false, "error": "msg_too_long"}"#)
            }
            Api::Matrix if gone => Answer::http(
                403,
                r#"{"errcode": "M_FORBIDDEN", "error": "User not in room"}"#,
            ),
            Api::Matrix if request.text.len() > 65_536 => Answer::http(
                413,
                r#"{"errcode": "M_TOO_LARGE", "error": "event too large"}"#,
            ),
            _ => return None,
        })
    }

    /// Service unavailable: nothing was done.
    fn unavailable(&self) -> Answer {
        match self.api {
            Api::Telegram => Answer::http(
                503,
                r#"{"ok":false,"error_code":503,"description":"Service Unavailable"}"#,
            ),
            Api::Discord => Answer::http(502, "<html>502 Bad Gateway</html>"),
            Api::Slack => Answer::http(200, r#"{"ok": false, "error": "service_unavailable"}"#),
            // (The proxy in front of a homeserver; ambiguous to the client.)
            Api::Matrix => Answer::http(502, "<html>502 Bad Gateway</html>"),
        }
    }

    fn rate_limited(&self) -> Answer {
        match self.api {
            Api::Telegram => Answer::http(
                429,
                r#"{"ok":false,"error_code":429,"description":"Too Many Requests: retry after 1","parameters":{"retry_after":1}}"#,
            ),
            Api::Discord => Answer::http(
                429,
                r#"{"message": "You are being rate limited.", "retry_after": 0.3, "global": false}"#,
            ),
            Api::Slack => Answer::Http {
                status: 429,
                retry_after: Some("1".into()),
                body: r#"{"ok": false, "error": "ratelimited"}"#.into(),
            },
            Api::Matrix => Answer::http(
                429,
                r#"{"errcode": "M_LIMIT_EXCEEDED", "error": "Too many requests", "retry_after_ms": 300}"#,
            ),
        }
    }

    fn created(&self, id: i64) -> Answer {
        match self.api {
            Api::Telegram => Answer::http(
                200,
                format!(r#"{{"ok":true,"result":{{"message_id":{id},"date":1700000000}}}}"#),
            ),
            Api::Discord => Answer::http(200, format!(r#"{{"id":"{}"}}"#, 1_000_000_000_000 + id)),
            Api::Slack => Answer::http(
                200,
                format!(r#"{{"ok": true, "channel": "C1", "ts": "1700000000.{id:06}"}}"#),
            ),
            Api::Matrix => Answer::http(200, format!(r#"{{"event_id": "${id}:example.org"}}"#)),
        }
    }

    /// The adapter's side: what a bot's client sends for a claim, and the crate's typed
    /// mapping of the answer.
    pub fn outcome(&self, answer: &Answer) -> Outcome {
        match answer {
            Answer::Timeout => platforms::no_reply(
                platforms::NoReply::MaybeSent,
                "read timeout after the request was sent",
            ),
            Answer::Http {
                status,
                retry_after,
                body,
            } => {
                let mut reply = HttpReply::new(*status, body);
                if let Some(wait) = retry_after {
                    reply = reply.with_retry_after(wait);
                }
                match self.api {
                    Api::Telegram => platforms::telegram::outcome(&reply),
                    Api::Discord => platforms::discord::outcome(&reply),
                    Api::Slack => platforms::slack::outcome(&reply),
                    Api::Matrix => platforms::matrix::outcome(&reply),
                }
            }
        }
    }
}

impl ChannelAdapter for SimPlatform {
    fn send(&self, claim: &Claim) -> Outcome {
        let request = Request {
            chat: &claim.chat_id,
            text: &claim.text,
            // The full key is 38 characters; Discord takes at most 25. A Matrix
            // transaction id is the key (URL-encoded by a real client).
            nonce: match self.api {
                Api::Discord if chunked_outbox::sabotage::planted("unexpected_dead_letters") => {
                    Some(claim.idempotency_key.clone())
                }
                Api::Discord => Some(claim.compact_key()),
                Api::Matrix => Some(claim.idempotency_key.clone()),
                _ => None,
            },
            key: &claim.idempotency_key,
        };
        self.outcome(&self.post(&request))
    }

    fn settle(&self, part: &PossiblySent) -> Settlement {
        let answer = self.answer_about(part);
        if let Some(log) = &self.settle_log
            && answer.decision != Decision::Later
        {
            let claimant = part.claimant.map_or("-".to_owned(), |c| c.to_string());
            let line = format!(
                "settle {claimant} {} {} {}\n",
                part.claim.attempt,
                part.claim.idempotency_key,
                answer.decision.as_str()
            );
            // One write of one line: lines of several processes do not interleave.
            let _ = std::io::Write::write_all(
                &mut *log.lock().unwrap_or_else(|e| e.into_inner()),
                line.as_bytes(),
            );
        }
        answer
    }
}

/// About one chat in a hundred no longer exists: its replies become dead letters.
pub fn chat_is_gone(chat: &str) -> bool {
    chat.rsplit('-')
        .next()
        .and_then(|n| n.parse::<u32>().ok())
        .is_some_and(|n| n % 97 == 13)
}

/// Words for replies of realistic shapes.
const WORDS: &[&str] = &[
    "the",
    "deploy",
    "finished",
    "and",
    "all",
    "checks",
    "passed",
    "your",
    "order",
    "ships",
    "tomorrow",
    "here",
    "is",
    "a",
    "summary",
    "of",
    "meeting",
    "we",
    "agreed",
    "to",
    "move",
    "release",
    "next",
    "week",
    "because",
    "tests",
    "on",
    "arm",
    "were",
    "flaky",
    "thanks",
    "for",
    "patience",
    "émigré",
    "naïve",
    "日本語",
    "🚀",
    "👍🏽",
    "café",
];

pub fn reply_text(rng: &mut fastrand::Rng, n: usize) -> String {
    // Mostly short replies, some long answers with paragraphs and code.
    let words = match rng.u32(0..100) {
        0..60 => rng.usize(5..60),
        60..90 => rng.usize(60..400),
        _ => rng.usize(400..2500),
    };
    let mut text = format!("Reply {n}:");
    for i in 0..words {
        text.push(' ');
        text.push_str(WORDS[rng.usize(0..WORDS.len())]);
        if i % 40 == 39 {
            text.push_str(".\n\n");
        }
        if words > 300 && i % 300 == 150 {
            text.push_str("\n```rust\nfn main() {\n    println!(\"hello\");\n}\n```\n");
        }
    }
    text
}

/// The platforms' public API as a client sees it: only the calls real platforms offer.
pub struct PlatformApi(Connection);

impl PlatformApi {
    pub fn open(path: &Path) -> rusqlite::Result<PlatformApi> {
        open_platform(path).map(PlatformApi)
    }

    /// Whether the message with this key reached this chat, on a platform that can be
    /// asked (see [`SimChannel::lookup`]); `None` where the platform offers no way.
    pub fn lookup(&self, channel: &str, chat: &str, key: &str) -> CliResult<Option<bool>> {
        if !CHANNELS.iter().any(|c| c.name == channel && c.lookup) {
            return Ok(None);
        }
        let found = self.0.query_row(
            "SELECT EXISTS (SELECT 1 FROM received WHERE key = ?1 AND channel = ?2 AND chat = ?3)",
            params![key, channel, chat],
            |r| r.get(0),
        )?;
        Ok(Some(found))
    }
}

/// What the operator did in one pass.
#[derive(Debug, Default, Clone, Copy)]
pub struct Settled {
    /// Uncertain chunks settled by asking the platform.
    pub looked_up: u64,
    /// Uncertain chunks on platforms that cannot be asked, resent by policy (a
    /// duplicate is possible and is counted against this decision).
    pub resent_blind: u64,
}

/// What an operator (or the application's reconciliation job) does: for every chunk
/// held as uncertain for longer than `grace` (a live worker may still report it), ask
/// the platform where it can be asked, and otherwise follow the explicit policy for
/// platforms without a lookup — resend, accepting a possible duplicate. Then
/// acknowledge dead letters so their chats move on. A part on a channel whose stored
/// replay policy is `ask` is left to the dispatchers until its platform has been asked
/// (`outbox show` says so: no settlement yet); one the platform could not settle is
/// the operator's, logged as `person <key>`.
///
/// Every decision is appended to `log` before it is carried out, as lines
/// `uncertain <claimant or -> <attempts> <key>`, then `lookup <key>` or `blind <key>`,
/// and every stored dead letter as `dead <delivery>` after acknowledging them,
/// so the verdict can
/// tell a duplicate this policy caused from one nobody chose, and can attribute chunks
/// held after a crash to the process that died holding them.
pub fn settle_like_an_operator(
    outbox: &Outbox,
    api: &PlatformApi,
    grace: Duration,
    log: &mut impl std::io::Write,
) -> CliResult<Settled> {
    let mut settled = Settled::default();
    let filter = ListFilter::default()
        .status(DeliveryStatus::Uncertain)
        .limit(10_000);
    let ripe = chrono::Utc::now() - grace;
    let rules = outbox.rules()?;
    for d in outbox.list(&filter)? {
        let Some(view) = outbox.delivery(d.id)? else {
            continue;
        };
        if view.updated_at > ripe {
            continue;
        }
        let asking = rules.channel(&view.channel).replay == ReplayPolicy::Ask;
        for chunk in view
            .chunks
            .iter()
            .filter(|c| c.status == ChunkStatus::Uncertain)
        {
            if asking {
                if chunk.settlement.is_none() {
                    continue; // the dispatchers have not asked the platform yet
                }
                writeln!(log, "person {}", chunk.idempotency_key)?;
            }
            let claimant = chunk.claimant.map_or("-".to_owned(), |c| c.to_string());
            writeln!(
                log,
                "uncertain {claimant} {} {}",
                chunk.attempts, chunk.idempotency_key
            )?;
            let resolution =
                match api.lookup(&view.channel, &view.chat_id, &chunk.idempotency_key)? {
                    Some(arrived) => {
                        writeln!(log, "lookup {}", chunk.idempotency_key)?;
                        settled.looked_up += 1;
                        if arrived {
                            Resolution::Delivered {
                                platform_message_id: None,
                            }
                        } else {
                            Resolution::Resend
                        }
                    }
                    None => {
                        writeln!(log, "blind {}", chunk.idempotency_key)?;
                        settled.resent_blind += 1;
                        Resolution::Resend
                    }
                };
            match outbox.resolve_uncertain(chunk.id, resolution) {
                // Settled meanwhile by the worker that held it: nothing to decide.
                Ok(_) | Err(chunked_outbox::Error::InvalidState { .. }) => {}
                Err(e) => return Err(e.into()),
            }
        }
    }
    outbox.dismiss_dead_letters(None)?;
    // Every dead letter still stored, acknowledged ones included, before anything can
    // purge them: the verdict tells a purged dead letter from a lost reply by this.
    let dead = ListFilter::default()
        .status(DeliveryStatus::Failed)
        .limit(10_000);
    for d in outbox.list(&dead)? {
        writeln!(log, "dead {}", d.id)?;
    }
    Ok(settled)
}

/// What an operator's log says (see [`settle_like_an_operator`]), with the platforms'
/// answers the dispatchers logged (see [`SimPlatform::logging_settlements`]).
#[derive(Debug, Default)]
pub struct OperatorLog {
    /// Keys resent without being able to ask the platform.
    pub blind: HashSet<String>,
    /// Decisions taken by asking the platform.
    pub looked_up: u64,
    /// Parts of channels that ask their platform, left to a person (the platform could
    /// not tell), by key.
    pub for_a_person: HashSet<String>,
    /// The platforms' answers to the dispatchers, by decision (`delivered`, `resend`,
    /// `hold`).
    pub platform_answers: HashMap<String, u64>,
    /// Per claimant, the distinct (attempts, key) of chunks it left uncertain.
    pub uncertain_by_claimant: HashMap<String, HashSet<(u32, String)>>,
    /// Deliveries the operator saw as dead letters (and may have purged since).
    pub dead: HashSet<String>,
}

impl OperatorLog {
    pub fn read(text: &str) -> OperatorLog {
        let mut log = OperatorLog::default();
        for line in text.lines() {
            let words: Vec<&str> = line.split(' ').collect();
            match words[..] {
                ["blind", key] => {
                    log.blind.insert(key.to_owned());
                }
                ["lookup", _] => log.looked_up += 1,
                ["person", key] => {
                    log.for_a_person.insert(key.to_owned());
                }
                ["settle", claimant, attempts, key, decision] => {
                    *log.platform_answers.entry(decision.to_owned()).or_default() += 1;
                    if claimant != "-"
                        && let Ok(attempts) = attempts.parse()
                    {
                        log.uncertain_by_claimant
                            .entry(claimant.to_owned())
                            .or_default()
                            .insert((attempts, key.to_owned()));
                    }
                }
                ["dead", delivery] => {
                    log.dead.insert(delivery.to_owned());
                }
                ["uncertain", claimant, attempts, key] if claimant != "-" => {
                    if let Ok(attempts) = attempts.parse() {
                        log.uncertain_by_claimant
                            .entry(claimant.to_owned())
                            .or_default()
                            .insert((attempts, key.to_owned()));
                    }
                }
                _ => {} // a torn last line, or a chunk no claimant left behind
            }
        }
        log
    }
}

/// What the platforms recorded: every accepted send in arrival order, and how many
/// replays the deduplicating ones dropped.
pub struct PlatformRecord {
    /// (channel, chat, idempotency key), in arrival order.
    pub received: Vec<(String, String, String)>,
    pub replays_dropped: u64,
}

impl PlatformRecord {
    pub fn read(platform: &Connection) -> CliResult<PlatformRecord> {
        let mut stmt = platform.prepare("SELECT channel, chat, key FROM received ORDER BY id")?;
        let received = stmt
            .query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))?
            .collect::<rusqlite::Result<_>>()?;
        let replays: i64 =
            platform.query_row("SELECT count(*) FROM deduplicated", [], |r| r.get(0))?;
        Ok(PlatformRecord {
            received,
            replays_dropped: replays as u64,
        })
    }

    /// The keys that arrived at least once.
    pub fn keys(&self) -> HashSet<&str> {
        self.received.iter().map(|(_, _, k)| k.as_str()).collect()
    }

    /// Resends a platform dropped (its deduplication working: the chat saw nothing),
    /// and the second arrivals of a key the chat did see, by cause: a resend the
    /// operator chose without being able to ask the platform (`blind`), or unexplained
    /// — a duplicate nobody decided on, which the outbox exists to prevent. Per channel
    /// too: what each chat saw twice.
    pub fn duplicates(&self, blind: &HashSet<String>) -> Duplicates {
        let mut d = Duplicates {
            deduplicated: self.replays_dropped,
            ..Duplicates::default()
        };
        let mut seen = HashSet::new();
        for (channel, _, key) in &self.received {
            if seen.insert(key) {
                continue;
            }
            *d.seen_by_channel.entry(channel.clone()).or_default() += 1;
            if blind.contains(key) {
                d.by_policy += 1;
            } else {
                d.unexplained += 1;
            }
        }
        d
    }

    /// Chats whose first arrivals do not follow `position` (enqueue order, then chunk).
    pub fn chats_out_of_order(&self, position: &HashMap<String, (u64, u32)>) -> u64 {
        let mut last: HashMap<&str, (u64, u32)> = HashMap::new();
        let mut first = HashSet::new();
        let mut bad = HashSet::new();
        for (_, chat, key) in &self.received {
            if !first.insert(key) {
                continue;
            }
            let Some(&pos) = position.get(key) else {
                continue;
            };
            if let Some(prev) = last.insert(chat, pos)
                && prev > pos
            {
                bad.insert(chat.as_str());
            }
        }
        bad.len() as u64
    }
}

/// How the possibly-sent parts were settled, and what the chats saw twice: the part of
/// the verdict that says what asking the platforms bought.
#[derive(Debug, Default, Clone, serde::Serialize)]
pub struct Settling {
    /// The platforms' answers to the dispatchers: the part was there (delivered), was
    /// not there or would be deduplicated (sent again), or could not be told (held).
    pub platform_found: u64,
    pub platform_resend: u64,
    pub platform_hold: u64,
    /// Parts of channels that ask their platform that a person had to settle.
    pub left_for_a_person: u64,
    /// Second arrivals each channel's chats saw (Telegram's come from the operator's
    /// blind resends).
    pub duplicates_seen: std::collections::BTreeMap<String, u64>,
}

impl Settling {
    pub fn of(log: &OperatorLog, duplicates: &Duplicates) -> Settling {
        let answers = |d: &str| log.platform_answers.get(d).copied().unwrap_or(0);
        let mut duplicates_seen: std::collections::BTreeMap<String, u64> =
            CHANNELS.iter().map(|c| (c.name.to_owned(), 0)).collect();
        duplicates_seen.extend(duplicates.seen_by_channel.clone());
        Settling {
            platform_found: answers("delivered"),
            platform_resend: answers("resend"),
            platform_hold: answers("hold"),
            left_for_a_person: log.for_a_person.len() as u64,
            duplicates_seen,
        }
    }
}

/// Duplicate arrivals by cause (see [`PlatformRecord::duplicates`]).
#[derive(Debug, Default, Clone)]
pub struct Duplicates {
    pub deduplicated: u64,
    pub by_policy: u64,
    pub unexplained: u64,
    /// Second arrivals the chats saw, per channel.
    pub seen_by_channel: std::collections::BTreeMap<String, u64>,
}

/// The `outbound_messages` rows: delivery id → (content, chunk count).
pub fn history(outbox_db: &Path) -> CliResult<HashMap<String, (String, u32)>> {
    let conn = Connection::open(outbox_db)?;
    let mut stmt =
        conn.prepare("SELECT delivery_id, content, chunk_count FROM outbound_messages")?;
    let rows = stmt
        .query_map([], |r| Ok((r.get(0)?, (r.get(1)?, r.get(2)?))))?
        .collect::<rusqlite::Result<_>>()?;
    Ok(rows)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn platform(api: Api, dir: &tempfile::TempDir) -> SimPlatform {
        let channel = CHANNELS.iter().find(|c| c.api == api).unwrap();
        SimPlatform::new(channel, open_platform(&dir.path().join("p.db")).unwrap(), 1)
    }

    fn request<'a>(text: &'a str, nonce: Option<&str>, key: &'a str) -> Request<'a> {
        Request {
            chat: "chat-1",
            text,
            nonce: nonce.map(str::to_owned),
            key,
        }
    }

    /// Discord refuses a nonce over 25 characters, as the real API does: the full
    /// 38-character key would dead-letter every reply; the compact key passes.
    #[test]
    fn discord_enforces_the_nonce_limit() {
        let dir = tempfile::tempdir().unwrap();
        let discord = platform(Api::Discord, &dir);
        let full = "019b76da-a800-7d20-9061-f318815b746b:1";
        let refusal = discord.refuse(&request("hi", Some(full), full)).unwrap();
        assert!(
            matches!(discord.outcome(&refusal), Outcome::Permanent { error } if error.contains("50035"))
        );
        let compact = "AYkKXayWd0u8zrMCCZqAVwAB";
        assert!(
            discord
                .refuse(&request("hi", Some(compact), full))
                .is_none()
        );
        let long = "x".repeat(2001);
        assert!(
            discord
                .refuse(&request(&long, Some(compact), full))
                .is_some()
        );
    }

    /// A replay with the same nonce is dropped and answered with the first message.
    #[test]
    fn discord_deduplicates_by_nonce() {
        let dir = tempfile::tempdir().unwrap();
        let discord = platform(Api::Discord, &dir);
        let first = discord.accept(&request("hi", Some("n1"), "k1")).unwrap();
        assert_eq!(
            discord.accept(&request("hi", Some("n1"), "k1")).unwrap(),
            first
        );
        assert_ne!(
            discord.accept(&request("hi", Some("n2"), "k2")).unwrap(),
            first
        );
        let record =
            PlatformRecord::read(&open_platform(&dir.path().join("p.db")).unwrap()).unwrap();
        assert_eq!((record.received.len(), record.replays_dropped), (2, 1));
    }

    #[test]
    fn telegram_and_slack_enforce_their_message_limits_and_answer_in_their_shape() {
        let dir = tempfile::tempdir().unwrap();
        let telegram = platform(Api::Telegram, &dir);
        // 4,096 UTF-16 units: 2,048 emoji fit, 2,049 do not.
        let fits = "🚀".repeat(2048);
        let over = "🚀".repeat(2049);
        assert!(telegram.refuse(&request(&fits, None, "k")).is_none());
        let refusal = telegram.refuse(&request(&over, None, "k")).unwrap();
        assert!(matches!(
            telegram.outcome(&refusal),
            Outcome::Permanent { .. }
        ));
        assert!(matches!(
            telegram.outcome(&telegram.rate_limited()),
            Outcome::RateLimited { retry_after, .. } if retry_after == Duration::from_secs(1)
        ));
        assert!(matches!(
            telegram.outcome(&telegram.unavailable()),
            Outcome::Transient { .. }
        ));
        assert!(matches!(
            telegram.outcome(&Answer::Timeout),
            Outcome::Ambiguous { .. }
        ));
        assert_eq!(
            telegram.outcome(&telegram.created(7)),
            Outcome::delivered(Some("7".into()))
        );

        let slack = platform(Api::Slack, &dir);
        let over = "a".repeat(40_001);
        let refusal = slack.refuse(&request(&over, None, "k")).unwrap();
        assert_eq!(
            slack.outcome(&refusal),
            Outcome::Permanent {
                error: "msg_too_long".into()
            }
        );
        let gone = Request {
            chat: "chat-13",
            ..request("hi", None, "k")
        };
        assert!(chat_is_gone("chat-13"));
        assert!(matches!(
            slack.outcome(&slack.refuse(&gone).unwrap()),
            Outcome::Permanent { .. }
        ));
        assert!(matches!(
            slack.outcome(&slack.rate_limited()),
            Outcome::ChannelRateLimited { retry_after, .. } if retry_after == Duration::from_secs(1)
        ));
    }
}
