//! The simulated world shared by `outbox demo` and `outbox torture`: three platforms
//! that fail in the ways real ones do and record what they accept in their own SQLite
//! file, replies of realistic shapes, and the operator who settles uncertain chunks.
//!
//! The operator knows only what a real one could: what the outbox shows, and what a
//! platform's own API answers where it has one (Slack lets a bot look its messages up
//! by metadata; Telegram has no such call). It never reads the platforms' record — that
//! is for the verdict alone.

use std::collections::{HashMap, HashSet};
use std::path::Path;
use std::sync::Mutex;
use std::time::Duration;

use chunked_outbox::{
    Backoff, ChannelAdapter, ChannelPolicy, ChunkStatus, Claim, DeliveryStatus, LaneFailurePolicy,
    ListFilter, Outbox, OutboxOptions, Outcome, Resolution, RetryPolicy, Splitter,
};
use rusqlite::{Connection, OptionalExtension, params};

use crate::CliResult;

/// One simulated platform's traits.
pub struct SimChannel {
    pub name: &'static str,
    pub splitter: Splitter,
    /// Deduplicates by idempotency key (so replays are safe).
    pub dedupes: bool,
    /// The error text for a chat that no longer exists.
    pub gone_error: &'static str,
    /// The platform has an API that tells whether a message arrived (Slack:
    /// `conversations.history` with the message metadata the bot sent). Telegram has
    /// none; Discord does not need one (it deduplicates by nonce, so it replays).
    pub lookup: bool,
}

pub const CHANNELS: [SimChannel; 3] = [
    SimChannel {
        name: "telegram",
        splitter: Splitter::telegram(),
        dedupes: false,
        gone_error: "Bad Request: chat not found",
        lookup: false,
    },
    SimChannel {
        name: "discord",
        splitter: Splitter::discord(),
        dedupes: true,
        gone_error: "Unknown Channel (code 10003)",
        lookup: false,
    },
    SimChannel {
        name: "slack",
        splitter: Splitter::slack(),
        dedupes: false,
        gone_error: "channel_not_found",
        lookup: true,
    },
];

/// The simulation's outbox settings, shared by the engine and every worker: a retry schedule
/// in milliseconds instead of seconds (so the demo finishes quickly), a short lease,
/// and strict lane order (a lane waits for its uncertain or dead head to be settled).
pub fn sim_options() -> OutboxOptions {
    OutboxOptions::default()
        .with_retry(RetryPolicy {
            backoff: Backoff::Schedule([50, 100, 200, 400].map(Duration::from_millis).to_vec()),
            max_attempts: 8,
            ..RetryPolicy::default()
        })
        .with_lease(Duration::from_secs(2))
        .with_lane_failure(LaneFailurePolicy::Block)
        // Declared here too, not only by the dispatcher's adapters, so that every
        // process that recovers expired leases (the operator, a restarted worker before
        // its dispatcher is built) follows the same replay policy.
        .with_channel("discord", ChannelPolicy::replayable())
}

pub fn open_platform(path: &Path) -> rusqlite::Result<Connection> {
    let conn = Connection::open(path)?;
    conn.busy_timeout(Duration::from_secs(10))?;
    conn.execute_batch(
        "PRAGMA journal_mode = WAL;
         CREATE TABLE IF NOT EXISTS received (
             id INTEGER PRIMARY KEY, channel TEXT NOT NULL, chat TEXT NOT NULL, key TEXT NOT NULL);
         CREATE INDEX IF NOT EXISTS received_key ON received (key);
         CREATE TABLE IF NOT EXISTS deduplicated (key TEXT NOT NULL);",
    )?;
    Ok(conn)
}

/// One simulated platform. It accepts most sends, fails some transiently, rate-limits
/// some, times out on some after (maybe) accepting them, and rejects chats that are gone.
pub struct SimPlatform {
    channel: &'static str,
    dedupes: bool,
    gone_error: &'static str,
    record: Mutex<Connection>,
    rng: Mutex<fastrand::Rng>,
}

impl SimPlatform {
    /// A platform for `channel` recording into `record`, with its own random stream.
    pub fn new(channel: &SimChannel, record: Connection, seed: u64) -> SimPlatform {
        SimPlatform {
            channel: channel.name,
            dedupes: channel.dedupes,
            gone_error: channel.gone_error,
            record: Mutex::new(record),
            rng: Mutex::new(fastrand::Rng::with_seed(seed)),
        }
    }

    fn accept(&self, claim: &Claim) -> rusqlite::Result<()> {
        let conn = self.record.lock().unwrap_or_else(|e| e.into_inner());
        let seen: Option<i64> = conn
            .query_row(
                "SELECT id FROM received WHERE key = ?1",
                [&claim.idempotency_key],
                |r| r.get(0),
            )
            .optional()?;
        if seen.is_some() && self.dedupes {
            conn.execute(
                "INSERT INTO deduplicated (key) VALUES (?1)",
                [&claim.idempotency_key],
            )?;
        } else {
            conn.execute(
                "INSERT INTO received (channel, chat, key) VALUES (?1, ?2, ?3)",
                params![self.channel, claim.chat_id, claim.idempotency_key],
            )?;
        }
        Ok(())
    }
}

impl ChannelAdapter for SimPlatform {
    fn send(&self, claim: &Claim) -> Outcome {
        let (roll, delivered_anyway, latency) = {
            let mut rng = self.rng.lock().unwrap_or_else(|e| e.into_inner());
            (rng.u32(0..1000), rng.bool(), rng.u64(0..1500))
        };
        std::thread::sleep(Duration::from_micros(latency)); // the network round trip
        if chat_is_gone(&claim.chat_id) {
            return Outcome::from_error_text(self.gone_error);
        }
        let outcome = match roll {
            0..40 => return Outcome::from_error_text("HTTP 502 Bad Gateway"),
            40..55 => return Outcome::from_error_text("Too Many Requests: retry after 0.3"),
            55..75 => {
                // A timeout after the request was written: it may or may not have landed.
                if delivered_anyway && self.accept(claim).is_err() {
                    return Outcome::Transient {
                        error: "platform record busy".into(),
                    };
                }
                return Outcome::Ambiguous {
                    error: "read timeout after the request was sent".into(),
                };
            }
            _ => Outcome::delivered(Some(format!("{}-{}", self.channel, claim.idempotency_key))),
        };
        match self.accept(claim) {
            Ok(()) => outcome,
            Err(e) => Outcome::Transient {
                error: format!("platform record: {e}"),
            },
        }
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
/// acknowledge dead letters so their chats move on.
///
/// Every decision is appended to `log` before it is carried out, as lines
/// `uncertain <claimant or -> <attempts> <key>`, then `lookup <key>` or `blind <key>`,
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
    let filter = ListFilter {
        status: Some(DeliveryStatus::Uncertain),
        limit: 10_000,
        ..ListFilter::default()
    };
    let ripe = chrono::Utc::now() - grace;
    for d in outbox.list(&filter)? {
        let Some(view) = outbox.delivery(d.id)? else {
            continue;
        };
        if view.updated_at > ripe {
            continue;
        }
        for chunk in view
            .chunks
            .iter()
            .filter(|c| c.status == ChunkStatus::Uncertain)
        {
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
    outbox.acknowledge_dead_letters(None)?;
    Ok(settled)
}

/// What an operator's log says (see [`settle_like_an_operator`]).
#[derive(Debug, Default)]
pub struct OperatorLog {
    /// Keys resent without being able to ask the platform.
    pub blind: HashSet<String>,
    /// Decisions taken by asking the platform.
    pub looked_up: u64,
    /// Per claimant, the distinct (attempts, key) of chunks it left uncertain.
    pub uncertain_by_claimant: HashMap<String, HashSet<(u32, String)>>,
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

    /// Second arrivals of a key, by cause: dropped by a platform that deduplicates
    /// (the replay policy working as designed), caused by a resend the operator chose
    /// without being able to ask the platform (`blind`), or unexplained — a duplicate
    /// nobody decided on, which the outbox exists to prevent.
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
            if CHANNELS.iter().any(|c| c.name == channel && c.dedupes) {
                d.deduplicated += 1;
            } else if blind.contains(key) {
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

/// Duplicate arrivals by cause (see [`PlatformRecord::duplicates`]).
#[derive(Debug, Default, Clone, Copy)]
pub struct Duplicates {
    pub deduplicated: u64,
    pub by_policy: u64,
    pub unexplained: u64,
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
