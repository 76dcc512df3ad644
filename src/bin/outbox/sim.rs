//! The simulated world shared by `outbox demo` and `outbox torture`: three platforms
//! that fail in the ways real ones do and record what they accept in their own SQLite
//! file, replies of realistic shapes, and the operator who settles uncertain chunks.

use std::collections::{HashMap, HashSet};
use std::path::Path;
use std::sync::Mutex;
use std::time::Duration;

use chunked_outbox::{
    Backoff, ChannelAdapter, ChunkStatus, Claim, DeliveryStatus, LaneFailurePolicy, ListFilter,
    Outbox, OutboxOptions, Outcome, ReplayPolicy, Resolution, RetryPolicy, Splitter,
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
}

pub const CHANNELS: [SimChannel; 3] = [
    SimChannel {
        name: "telegram",
        splitter: Splitter::telegram(),
        dedupes: false,
        gone_error: "Bad Request: chat not found",
    },
    SimChannel {
        name: "discord",
        splitter: Splitter::discord(),
        dedupes: true,
        gone_error: "Unknown Channel (code 10003)",
    },
    SimChannel {
        name: "slack",
        splitter: Splitter::slack(),
        dedupes: false,
        gone_error: "channel_not_found",
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

    fn replay(&self) -> ReplayPolicy {
        if self.dedupes {
            ReplayPolicy::Replay
        } else {
            ReplayPolicy::Hold
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

/// What an operator (or the application's reconciliation job) does: for every chunk
/// held as uncertain, ask the platform whether it arrived and resolve accordingly; and
/// acknowledge dead letters so their chats move on.
pub fn resolve_like_an_operator(outbox: &Outbox, platform: &Connection) -> CliResult<u64> {
    let mut resolved = 0;
    let filter = ListFilter {
        status: Some(DeliveryStatus::Uncertain),
        limit: 10_000,
        ..ListFilter::default()
    };
    for d in outbox.list(&filter)? {
        let Some(view) = outbox.delivery(d.id)? else {
            continue;
        };
        for chunk in view
            .chunks
            .iter()
            .filter(|c| c.status == ChunkStatus::Uncertain)
        {
            let arrived: bool = platform.query_row(
                "SELECT EXISTS (SELECT 1 FROM received WHERE key = ?1)",
                [&chunk.idempotency_key],
                |r| r.get(0),
            )?;
            let resolution = if arrived {
                Resolution::Delivered {
                    platform_message_id: None,
                }
            } else {
                Resolution::Resend
            };
            outbox.resolve_uncertain(chunk.id, resolution)?;
            resolved += 1;
        }
    }
    outbox.acknowledge_dead_letters()?;
    Ok(resolved)
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

    /// Second arrivals of a key: (allowed, unexplained). A platform that deduplicates
    /// never stores a second copy; the replays it dropped are allowed by its policy.
    pub fn duplicates(&self) -> (u64, u64) {
        let (mut allowed, mut unexplained) = (self.replays_dropped, 0);
        let mut seen = HashSet::new();
        for (channel, _, key) in &self.received {
            if !seen.insert(key) {
                if CHANNELS.iter().any(|c| c.name == channel && c.dedupes) {
                    allowed += 1;
                } else {
                    unexplained += 1;
                }
            }
        }
        (allowed, unexplained)
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

/// `messages` rows beyond one per delivery, and the number of distinct deliveries.
pub fn finalizations(outbox_db: &Path) -> CliResult<(u64, u64)> {
    let conn = Connection::open(outbox_db)?;
    let (rows, distinct): (i64, i64) = conn.query_row(
        "SELECT count(*), count(DISTINCT delivery_id) FROM messages",
        [],
        |r| Ok((r.get(0)?, r.get(1)?)),
    )?;
    Ok(((rows - distinct) as u64, distinct as u64))
}
