//! Settling a part that may have reached its platform by asking the platform.
//!
//! A send that timed out after its request was written, or a process that died while
//! sending, leaves a part that may or may not be in the chat. Under the channel's
//! [`ReplayPolicy::Ask`](crate::rules::ReplayPolicy::Ask) such a part is held as
//! `uncertain` like under `Hold`, and then a dispatcher asks the channel's adapter
//! ([`ChannelAdapter::settle`](crate::ChannelAdapter::settle),
//! [`AsyncChannelAdapter::settle`](crate::AsyncChannelAdapter::settle)) what the
//! platform can tell about it, and acts on the answer:
//!
//! | the adapter answers | the part |
//! |---|---|
//! | [`Decision::Delivered`]: the platform has it (Slack: found by its key in the message metadata; LINE: 409 naming the accepted request) | delivered, with the platform's id; the reply goes on (or is finalized) |
//! | [`Decision::Resend`]: the platform does not have it, or will deduplicate a resend (Discord's nonce, LINE's retry key, Matrix's transaction id, inside their windows) | sent again under the same key, with a fresh attempt budget |
//! | [`Decision::Hold`]: the platform cannot tell (a lookup failed, a window passed, a platform with no way to ask) | stays `uncertain` for a person (`outbox resolve`, the console) |
//! | [`Decision::Later`]: not yet (a lookup asked to wait) | asked again at the next round |
//!
//! Each decision but `Later` is kept on the part, what was asked and what the platform
//! answered with it ([`ChunkView::settlement`](crate::monitoring::ChunkView::settlement),
//! `outbox show`), reported as [`DispatchEvent::Settled`](crate::dispatch::DispatchEvent::Settled)
//! and counted (`outbox_settlements_total`). A part is asked about once each time it
//! becomes uncertain, and its chat waits for the answer: the chat's next reply is sent
//! after the part is delivered or sent again, or once it is held for a person. Two
//! processes may ask about the same part at once; the first answer recorded wins and
//! the other is dropped, so a part is settled once.
//!
//! An application without a dispatcher does the same with
//! [`Outbox::possibly_sent`] and [`Outbox::settle`]:
//!
//! ```
//! use chunked_outbox::{NewDelivery, Outbox, OutboxOptions, Outcome};
//! use chunked_outbox::monitoring::ChunkStatus;
//! use chunked_outbox::rules::ChannelPolicy;
//! use chunked_outbox::settle::Settlement;
//!
//! let options = OutboxOptions::default().with_channel("slack", ChannelPolicy::asking());
//! let outbox = Outbox::open_in_memory(options)?;
//! outbox.enqueue(&NewDelivery::single("slack", "C1", "hi"))?;
//! let claim = outbox.claim(1)?.remove(0);
//! outbox.record(&claim, Outcome::Ambiguous { error: "read timeout".into() })?;
//!
//! for part in outbox.possibly_sent("slack", 16)? {
//!     // ... look the part's key up in the channel's history ...
//!     let answer = Settlement::found(
//!         "conversations.history of C1 for the key",
//!         "a message with the key, ts 1700000000.000100",
//!         Some("1700000000.000100".into()),
//!     );
//!     let recorded = outbox.settle(&part, &answer)?.expect("nobody settled it before");
//!     assert_eq!(recorded.status, ChunkStatus::Delivered);
//! }
//! let view = outbox.delivery(claim.delivery_id)?.unwrap();
//! assert!(view.chunks[0].settlement.as_deref().unwrap().contains("ts 1700000000.000100"));
//! # Ok::<(), chunked_outbox::Error>(())
//! ```

use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::Serialize;

use crate::claim::Claim;
use crate::clock::to_datetime;
use crate::error::Result;
use crate::ids::{ChunkId, ClaimantId, DeliveryId, chunk_idempotency_key};
use crate::outbox::Outbox;
use crate::state::{self, Recorded};
use crate::status::ChunkStatus;
use crate::store::Unasked;
use crate::store::connections::Announce;

/// A part held as `uncertain` that nobody has asked its platform about yet, as an
/// adapter's [`settle`](crate::ChannelAdapter::settle) sees it.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct PossiblySent {
    /// The send asked about, as the part's sends carried it: chunk, reply, channel, chat,
    /// index, text, key ([`Claim::compact_key`], [`Claim::key_uuid`] as well) and
    /// metadata. Its `attempt` is the attempts counted so far; it holds no lease.
    pub claim: Claim,
    /// When a send of the part was first claimed, by the outbox's clock: the earliest
    /// moment it can have reached the platform. A lookup searches from a little before
    /// it; a deduplication window runs from it.
    pub first_sent_at: DateTime<Utc>,
    /// When the part became uncertain, by the outbox's clock.
    pub uncertain_since: DateTime<Utc>,
    /// The outbox's clock when the part was read.
    pub now: DateTime<Utc>,
    /// The outbox handle whose claim left the part uncertain when its lease ran out (a
    /// process that died, or hung, sending it); `None` for a send whose outcome was
    /// recorded as ambiguous.
    pub claimant: Option<ClaimantId>,
    /// The platform's id for the reply's previous part (delivered before this one was
    /// sent), or, for a reply's first part, for the last part of the chat's latest reply
    /// delivered before it was first sent (looked for among the 1,000 replies enqueued
    /// before it), if one has it: where a platform's ids are its own times (Slack's
    /// `ts`), a lookup searches from there, whatever the clocks of the outbox and the
    /// platform say.
    pub previous_platform_id: Option<String>,
    /// The delivery row's last change (ms): recording an answer checks nothing moved.
    since_ms: i64,
}

impl PossiblySent {
    fn from_row(row: Unasked, now: i64) -> Option<PossiblySent> {
        // A row whose uid does not parse is set aside by the next claim; nothing to ask.
        let delivery_id: DeliveryId = row.uid.parse().ok()?;
        let c = row.chunk;
        let index = c.index as u32;
        Some(PossiblySent {
            claim: Claim {
                chunk_id: ChunkId(c.id),
                idempotency_key: chunk_idempotency_key(&delivery_id, index),
                delivery_id,
                channel: c.channel,
                chat_id: c.chat_id,
                index,
                total: c.total as u32,
                text: row.text,
                attempt: c.attempts,
                lease_until: to_datetime(now),
                metadata: row.metadata,
                token: 0,
                suspect: false,
            },
            first_sent_at: to_datetime(row.first_sent_at),
            uncertain_since: to_datetime(row.since),
            now: to_datetime(now),
            claimant: row.token.map(ClaimantId::of_token),
            previous_platform_id: row.previous_platform_id,
            since_ms: row.since,
        })
    }

    /// A part of no outbox, to unit-test an adapter's `settle`: `claim`'s chunk, first
    /// sent at `first_sent_at`, uncertain since then, read at `now`. Settling it in an
    /// outbox changes nothing there.
    pub fn for_testing(
        claim: Claim,
        first_sent_at: DateTime<Utc>,
        now: DateTime<Utc>,
    ) -> PossiblySent {
        PossiblySent {
            claim,
            first_sent_at,
            uncertain_since: first_sent_at,
            now,
            claimant: None,
            previous_platform_id: None,
            since_ms: i64::MIN,
        }
    }

    /// How long ago a send of the part was first claimed (zero if the clocks say it is
    /// in the future).
    pub fn since_first_send(&self) -> Duration {
        (self.now - self.first_sent_at).to_std().unwrap_or_default()
    }

    /// How long the part has been uncertain.
    pub fn uncertain_for(&self) -> Duration {
        (self.now - self.uncertain_since)
            .to_std()
            .unwrap_or_default()
    }
}

/// What the platform's answer decides for a [`PossiblySent`] part.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase", tag = "decision")]
#[non_exhaustive]
pub enum Decision {
    /// The platform has it: the part is delivered.
    Delivered {
        /// The platform's id for the message, if it gave one.
        platform_message_id: Option<String>,
    },
    /// The platform does not have it, or will deduplicate a resend: sent again under
    /// the same key.
    Resend,
    /// The platform cannot tell: held for a person.
    Hold,
    /// Not yet: asked again at the dispatcher's next round, or once the
    /// [`wait`](Settlement::wait) is over; nothing is recorded on the part.
    Later,
}

impl Decision {
    /// The decision in one word: `delivered`, `resend`, `hold` or `later` (the label of
    /// `outbox_settlements_total`).
    pub fn as_str(&self) -> &'static str {
        match self {
            Decision::Delivered { .. } => "delivered",
            Decision::Resend => "resend",
            Decision::Hold => "hold",
            Decision::Later => "later",
        }
    }
}

/// An adapter's answer about a [`PossiblySent`] part: the decision, with what was asked
/// and what the platform answered, kept on the part as they are given.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct Settlement {
    /// What the answer decides.
    pub decision: Decision,
    /// What was asked (`"conversations.history of C1 since 12:00:00 for key …"`).
    pub asked: String,
    /// What the platform answered (`"found, ts 1700000000.000100"`).
    pub answer: String,
    /// For a [`Resend`](Decision::Resend) that a deduplication window allows, the time
    /// by which it must go (see [`within_window`](Self::within_window)): kept on the
    /// part, and a claim at or after it holds the part instead of sending it.
    pub resend_by: Option<DateTime<Utc>>,
    /// For a [`Later`](Decision::Later), how long the platform asked to be left alone
    /// (a rate limit's `Retry-After`): a dispatcher asks nothing more of the channel
    /// until it is over.
    pub wait: Option<Duration>,
}

impl Settlement {
    /// The platform has the part (a lookup found it).
    pub fn found(
        asked: impl Into<String>,
        answer: impl Into<String>,
        platform_message_id: Option<String>,
    ) -> Settlement {
        Settlement::new(
            Decision::Delivered {
                platform_message_id,
            },
            asked,
            answer,
        )
    }

    /// Sending again is safe: the platform does not have the part, or will return the
    /// message it has instead of posting another.
    pub fn resend(asked: impl Into<String>, answer: impl Into<String>) -> Settlement {
        Settlement::new(Decision::Resend, asked, answer)
    }

    /// The platform cannot tell: a person decides.
    pub fn hold(asked: impl Into<String>, answer: impl Into<String>) -> Settlement {
        Settlement::new(Decision::Hold, asked, answer)
    }

    /// Ask again later.
    pub fn later(asked: impl Into<String>, answer: impl Into<String>) -> Settlement {
        Settlement::new(Decision::Later, asked, answer)
    }

    /// Ask again, and ask the channel's platform nothing more, once `wait` is over (a
    /// rate-limited lookup: the answer's `Retry-After`).
    ///
    /// ```
    /// use std::time::Duration;
    /// use chunked_outbox::settle::{Decision, Settlement};
    ///
    /// let later = Settlement::later_after("conversations.history", "ratelimited", Duration::from_secs(60));
    /// assert_eq!((later.decision, later.wait), (Decision::Later, Some(Duration::from_secs(60))));
    /// ```
    pub fn later_after(
        asked: impl Into<String>,
        answer: impl Into<String>,
        wait: Duration,
    ) -> Settlement {
        let mut later = Settlement::new(Decision::Later, asked, answer);
        later.wait = Some(wait);
        later
    }

    fn new(decision: Decision, asked: impl Into<String>, answer: impl Into<String>) -> Settlement {
        Settlement {
            decision,
            asked: asked.into(),
            answer: answer.into(),
            resend_by: None,
            wait: None,
        }
    }

    /// For a platform that deduplicates a resend under the same key for `window` after
    /// the first send (Discord's nonce, LINE's retry key, a Matrix homeserver's
    /// transaction ids): [`resend`](Self::resend) while the part's first send is less
    /// than `window` ago, [`hold`](Self::hold) after. `what` names the key and the
    /// platform (`"Discord nonce"`).
    ///
    /// The window is used less a margin for the send's own time on the wire (a tenth of
    /// the window, at most a minute: Discord's 2 minutes count as 108 s), and the resend
    /// carries that deadline ([`resend_by`](Self::resend_by)): one that cannot be
    /// claimed by then — its platform answering 503s, its lane or its backoff holding
    /// it — is held instead of sent late, and asked about again (then: hold).
    ///
    /// ```
    /// use std::time::Duration;
    /// use chunked_outbox::Claim;
    /// use chunked_outbox::settle::{Decision, PossiblySent, Settlement};
    ///
    /// let first = chrono::Utc::now();
    /// let claim = Claim::for_testing("discord", "1", "hi");
    /// let soon = PossiblySent::for_testing(claim.clone(), first, first + chrono::Duration::seconds(30));
    /// let late = PossiblySent::for_testing(claim, first, first + chrono::Duration::minutes(5));
    /// let window = Duration::from_secs(120);
    /// assert_eq!(Settlement::within_window(&soon, window, "Discord nonce").decision, Decision::Resend);
    /// assert_eq!(Settlement::within_window(&late, window, "Discord nonce").decision, Decision::Hold);
    /// ```
    pub fn within_window(part: &PossiblySent, window: Duration, what: &str) -> Settlement {
        let since = part.since_first_send();
        let asked = format!(
            "the {what} deduplicates for {}; first sent {} ago",
            seconds(window),
            seconds(since)
        );
        // The resend must be claimed by the window's end less the margin; asked later
        // than that, too late already.
        let usable = window - (window / 10).min(Duration::from_secs(60));
        if since < usable {
            let mut resend =
                Settlement::resend(asked, "inside the window: a resend is deduplicated");
            resend.resend_by = chrono::Duration::from_std(usable)
                .ok()
                .map(|usable| part.first_sent_at + usable);
            resend
        } else {
            Settlement::hold(
                asked,
                "the window has passed (less the time a send takes): a resend could post it twice",
            )
        }
    }

    /// The text kept on the part.
    pub(crate) fn record(&self) -> String {
        let decided = match &self.decision {
            Decision::Delivered {
                platform_message_id: Some(id),
            } => format!("delivered ({id})"),
            Decision::Delivered { .. } => "delivered".to_owned(),
            Decision::Resend => "sent again".to_owned(),
            Decision::Hold => "held for a person".to_owned(),
            Decision::Later => "asked again later".to_owned(),
        };
        crate::state::storable_error(&format!(
            "asked: {}; answered: {}; {decided}",
            self.asked, self.answer
        ))
        .into_owned()
    }
}

fn seconds(d: Duration) -> String {
    format!("{} s", d.as_secs())
}

impl Outbox {
    /// Up to `limit` parts of `channel` held as `uncertain` that nobody asked the
    /// platform about since they became uncertain, oldest reply first (see
    /// [`settle`](crate::settle)).
    ///
    /// # Errors
    ///
    /// Database errors.
    pub fn possibly_sent(&self, channel: &str, limit: usize) -> Result<Vec<PossiblySent>> {
        let now = self.options().now_ms();
        let rows = self.read(|tx| tx.unasked_uncertain(channel, limit))?;
        Ok(rows
            .into_iter()
            .filter_map(|row| PossiblySent::from_row(row, now))
            .collect())
    }

    /// Acts on the platform's answer about a part read with
    /// [`possibly_sent`](Self::possibly_sent), keeping the answer on the part: delivered,
    /// sent again or held (see [`Decision`]). Returns the part's new state, or `None`
    /// when nothing was recorded: a [`Decision::Later`], or a part that is no longer the
    /// one read (settled, resolved or sent again meanwhile, by another process too).
    ///
    /// # Errors
    ///
    /// Database errors; nothing is changed then.
    pub fn settle(&self, part: &PossiblySent, settlement: &Settlement) -> Result<Option<Recorded>> {
        if settlement.decision == Decision::Later {
            return Ok(None);
        }
        let planted = if crate::sabotage::planted("settle_holds") {
            Some(Decision::Hold)
        } else if crate::sabotage::planted("settle_resends") {
            Some(Decision::Resend)
        } else {
            None
        };
        self.write_and_wake(Announce::Yes, |tx, rules| {
            let Ok(chunk) = crate::operator::locked_chunk(tx, part.claim.chunk_id) else {
                return Ok(None); // purged meanwhile
            };
            let retry = rules.policy.retry_for(&chunk.channel);
            // A resend is another attempt: once they are spent, a person decides, as
            // for any part that keeps failing. (A planted resend is blind to that too.)
            let spent = planted.is_none()
                && settlement.decision == Decision::Resend
                && chunk.attempts >= retry.max_attempts;
            let (decision, text, resend_by) = if spent {
                let held = Settlement::hold(
                    settlement.asked.clone(),
                    format!(
                        "{}; but it was sent {} times, its every attempt: a person decides",
                        settlement.answer, chunk.attempts
                    ),
                );
                (Decision::Hold, held.record(), None)
            } else {
                let decision = planted
                    .clone()
                    .unwrap_or_else(|| settlement.decision.clone());
                let resend_by = settlement.resend_by.map(|by| by.timestamp_millis());
                (decision, settlement.record(), resend_by)
            };
            if !tx.note_settlement(chunk.id, part.since_ms, &text, resend_by)? {
                return Ok(None);
            }
            let now = self.options().now_ms();
            let recorded = match decision {
                Decision::Delivered {
                    platform_message_id,
                } => state::deliver_held(tx, rules, &chunk, platform_message_id.as_deref(), now)?,
                Decision::Resend => {
                    // Sent again with the attempts it had, after the backoff its last
                    // attempt earned, once its lane lets it.
                    let earliest = now + retry.delay_ms(chunk.attempts);
                    state::rejoin_lane(tx, rules, &chunk, chunk.attempts, earliest, None)?;
                    Recorded::settled(ChunkStatus::Retry)
                }
                Decision::Hold | Decision::Later => {
                    // The chat waited for the answer; held for a person, it goes on.
                    crate::lane::advance(tx, &rules.policy, chunk.lane(), now)?;
                    Recorded::settled(ChunkStatus::Uncertain)
                }
            };
            Ok(Some(recorded))
        })
    }
}
