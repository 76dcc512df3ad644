//! Operator actions: requeue dead letters and uncertain chunks, resolve, acknowledge,
//! cancel.

use std::collections::BTreeSet;

use rusqlite::{OptionalExtension, params};

use crate::finalize::Tally;
use crate::ids::{DELETE_CHUNKS_SQL, chunks_of_delivery};
use crate::outcome::{ChunkRef, Recorded, chunk_ref_where, deliver_chunk};
use crate::policy::Stored;
use crate::status::{ChunkStatus, DeliveryStatus};
use crate::tx::Tx;
use crate::{ChunkId, DeliveryId, Error, Outbox, Result, lane};

/// How to settle a chunk held as `uncertain`.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Resolution {
    /// It did reach the platform: mark it delivered (finalizing the delivery if it was
    /// the last chunk) and carry on with the next chunk.
    Delivered {
        /// The platform's id for the message, if known.
        platform_message_id: Option<String>,
    },
    /// It did not arrive (or a duplicate is acceptable): send it again, with the same
    /// idempotency key and a fresh attempt budget.
    Resend,
}

impl Outbox {
    /// Sends a `failed` or `uncertain` chunk again with a fresh attempt budget. Its
    /// delivery rejoins its lane: in a FIFO lane it waits until the lane's active
    /// delivery (if any) is done.
    ///
    /// # Errors
    ///
    /// [`Error::ChunkNotFound`]; [`Error::InvalidState`] if the chunk is neither
    /// `failed` nor `uncertain`.
    pub fn requeue_chunk(&self, chunk: ChunkId) -> Result<()> {
        self.write_and_wake(|tx, rules| {
            let chunk = ChunkRef::load(tx, chunk)?;
            requeue(tx, rules, &chunk, "requeue", self.options().now_ms())
        })
    }

    /// Requeues the `failed` or `uncertain` chunk of a delivery (see
    /// [`requeue_chunk`](Self::requeue_chunk)).
    ///
    /// ```
    /// use chunked_outbox::{DeliveryStatus, NewDelivery, Outbox, OutboxOptions, Outcome};
    ///
    /// let outbox = Outbox::open_in_memory(OutboxOptions::default())?;
    /// let id = outbox.enqueue(&NewDelivery::single("slack", "C1", "hi"))?.id;
    /// let claim = outbox.claim(1)?.remove(0);
    /// outbox.record(&claim, Outcome::Permanent { error: "not_in_channel".into() })?;
    /// assert_eq!(outbox.delivery(id)?.unwrap().status, DeliveryStatus::Failed);
    /// // The bot was invited to the channel: send it again.
    /// outbox.requeue_delivery(id)?;
    /// assert_eq!(outbox.claim(1)?.len(), 1);
    /// # Ok::<(), chunked_outbox::Error>(())
    /// ```
    ///
    /// # Errors
    ///
    /// [`Error::DeliveryNotFound`]; [`Error::DeliveryState`] (naming the delivery and its
    /// status) if nothing in it is failed or uncertain.
    pub fn requeue_delivery(&self, delivery: DeliveryId) -> Result<()> {
        self.write_and_wake(|tx, rules| {
            let chunk = held_or_head_chunk(self, tx, delivery)?;
            if !matches!(chunk.status, ChunkStatus::Failed | ChunkStatus::Uncertain) {
                let status = delivery_row(self, tx, delivery)?.0;
                return Err(not_requeueable(delivery, status));
            }
            requeue(tx, rules, &chunk, "requeue", self.options().now_ms())
        })
    }

    /// Requeues every dead letter (`failed` delivery), oldest first — of one channel, or
    /// of all for `None`. Returns how many. Rows set aside as corrupt stay failed.
    ///
    /// # Errors
    ///
    /// Database errors; nothing is changed then.
    pub fn requeue_dead_letters(&self, channel: Option<&str>) -> Result<u64> {
        self.write_and_wake(|tx, rules| {
            let now = self.options().now_ms();
            let mut stmt = tx.prepare_cached(DEAD_LETTER_CHUNKS_SQL)?;
            let chunks = stmt
                .query_map([channel], ChunkRef::from_row)?
                .collect::<rusqlite::Result<Vec<_>>>()?;
            for chunk in &chunks {
                requeue(tx, rules, chunk, "requeue", now)?;
            }
            Ok(chunks.len() as u64)
        })
    }

    /// Settles a chunk held as `uncertain` (see [`Resolution`]).
    ///
    /// ```
    /// use chunked_outbox::{ChunkStatus, NewDelivery, Outbox, OutboxOptions, Outcome, Resolution};
    ///
    /// let outbox = Outbox::open_in_memory(OutboxOptions::default())?;
    /// outbox.enqueue(&NewDelivery::single("telegram", "42", "hi"))?;
    /// let claim = outbox.claim(1)?.remove(0);
    /// let held = outbox.record(&claim, Outcome::Ambiguous { error: "read timeout".into() })?;
    /// assert_eq!(held.status, ChunkStatus::Uncertain);
    /// // The user confirms they saw it.
    /// let done = outbox.resolve_uncertain(claim.chunk_id, Resolution::Delivered { platform_message_id: None })?;
    /// assert!(done.finalized);
    /// # Ok::<(), chunked_outbox::Error>(())
    /// ```
    ///
    /// # Errors
    ///
    /// [`Error::ChunkNotFound`]; [`Error::InvalidState`] if the chunk is not
    /// `uncertain`.
    pub fn resolve_uncertain(&self, chunk: ChunkId, resolution: Resolution) -> Result<Recorded> {
        self.write_and_wake(|tx, rules| {
            let chunk = ChunkRef::load(tx, chunk)?;
            expect_status(&chunk, &[ChunkStatus::Uncertain], "resolve", "uncertain")?;
            let now = self.options().now_ms();
            match resolution {
                Resolution::Delivered {
                    platform_message_id,
                } => {
                    let mut tally = Tally::default();
                    let id = platform_message_id.as_deref();
                    let recorded = deliver_chunk(tx, rules, &chunk, id, now, false, &mut tally)?;
                    tally.write(tx)?;
                    Ok(recorded)
                }
                Resolution::Resend if crate::sabotage::planted("uncertain_left") => {
                    Ok(Recorded::settled(ChunkStatus::Retry))
                }
                Resolution::Resend => {
                    requeue(tx, rules, &chunk, "resolve", now)?;
                    Ok(Recorded::settled(ChunkStatus::Retry))
                }
            }
        })
    }

    /// Finalizes again a reply that the application's finalization statement refused
    /// ([`DeliveryStatus::Unfinalized`]): every chunk reached the chat, and once the
    /// application fixed its table the reply is written to the history as if its last
    /// ack had just been recorded. [`recover`](Self::recover) does this for every such
    /// reply.
    ///
    /// # Errors
    ///
    /// [`Error::DeliveryNotFound`]; [`Error::DeliveryState`] if the reply is not
    /// unfinalized; [`Error::FinalizationRefused`] if the statement refuses it again
    /// (nothing changes then).
    pub fn finalize_again(&self, delivery: DeliveryId) -> Result<()> {
        self.write_and_wake(|tx, rules| {
            let (status, channel, chat_id) = delivery_row(self, tx, delivery)?;
            if status != DeliveryStatus::Unfinalized {
                return Err(Error::DeliveryState {
                    delivery,
                    status,
                    action: "finalize",
                    expected: "unfinalized",
                });
            }
            let id = self.delivery_rowid(delivery);
            let created_at: i64 = tx
                .prepare_cached("SELECT created_at FROM outbound_deliveries WHERE id = ?1")?
                .query_row([id], |r| r.get(0))?;
            let now = self.options().now_ms();
            let mut tally = Tally::default();
            let lane = (channel.as_str(), chat_id.as_str());
            match crate::finalize::finalize(tx, rules, id, lane, (created_at, now), &mut tally)? {
                None => tally.write(tx),
                Some(message) => Err(Error::FinalizationRefused { delivery, message }),
            }
        })
    }

    /// Marks every unacknowledged dead letter (of one channel, or of all for `None`) as
    /// seen. They stay listed (and requeueable) until purged, but no longer count as
    /// unacknowledged in health, and a lane blocked by one
    /// ([`LaneFailurePolicy::Block`](crate::LaneFailurePolicy::Block)) moves on. Returns
    /// how many were acknowledged.
    ///
    /// # Errors
    ///
    /// Database errors; nothing is changed then.
    pub fn acknowledge_dead_letters(&self, channel: Option<&str>) -> Result<u64> {
        self.write_and_wake(|tx, rules| {
            let now = self.options().now_ms();
            let mut stmt = tx.prepare_cached(
                "UPDATE outbound_deliveries SET acknowledged_at = ?1
                 WHERE status = 'failed' AND status <> 'delivered' AND acknowledged_at IS NULL
                   AND (?2 IS NULL OR channel = ?2)
                 RETURNING channel, chat_id",
            )?;
            let lanes = stmt
                .query_map(params![now, channel], |r| {
                    Ok((r.get::<_, String>(0)?, r.get::<_, String>(1)?))
                })?
                .collect::<rusqlite::Result<Vec<_>>>()?;
            let count = lanes.len() as u64;
            for (channel, chat_id) in lanes.into_iter().collect::<BTreeSet<_>>() {
                lane::advance(tx, &rules.policy, &channel, &chat_id, now)?;
            }
            Ok(count)
        })
    }

    /// Withdraws a reply none of whose chunks has started: the user deleted the
    /// question, or a newer answer supersedes it. The delivery becomes `cancelled`, its
    /// chunks are removed (the delivery keeps its text), nothing of it is sent or
    /// finalized, and the next reply of its lane goes on. Cancelling a cancelled
    /// delivery again does nothing. Its caller idempotency key still names it until it
    /// is purged ([`purge`](Self::purge) removes cancelled deliveries like delivered
    /// ones).
    ///
    /// "Started" means a chunk was claimed for a send that may have reached the
    /// platform: it is `sending`, delivered, `uncertain`, or has used a send attempt
    /// (a send that was given back unstarted, or refused by a rate limit, has not) —
    /// in its current attempt budget or in one before an operator's requeue or
    /// [`Resolution::Resend`] gave it a fresh one.
    /// **A started reply is not cut short**: the chat may already show its first part,
    /// and stopping there would leave a fragment that the history never records. Such a
    /// cancel is refused with [`Error::CancelTooLate`] and changes nothing; let the reply
    /// finish, then edit or delete it on the platform if it must not stand.
    ///
    /// ```
    /// use chunked_outbox::{DeliveryStatus, NewDelivery, Outbox, OutboxOptions};
    ///
    /// let outbox = Outbox::open_in_memory(OutboxOptions::default())?;
    /// let first = outbox.enqueue(&NewDelivery::single("telegram", "42", "Working on it..."))?;
    /// let second = outbox.enqueue(&NewDelivery::single("telegram", "42", "Here it is."))?;
    /// outbox.cancel(first.id)?;
    /// assert_eq!(outbox.delivery(first.id)?.unwrap().status, DeliveryStatus::Cancelled);
    /// // The lane moved on: the second reply is the one a dispatcher sends now.
    /// assert_eq!(outbox.delivery(second.id)?.unwrap().status, DeliveryStatus::Pending);
    /// # Ok::<(), chunked_outbox::Error>(())
    /// ```
    ///
    /// # Errors
    ///
    /// [`Error::DeliveryNotFound`]; [`Error::DeliveryState`] if the delivery is partly
    /// or wholly delivered, uncertain or failed; [`Error::CancelTooLate`] if a send of
    /// it has started.
    pub fn cancel(&self, delivery: DeliveryId) -> Result<()> {
        self.write_and_wake(|tx, rules| {
            let id = self.delivery_rowid(delivery);
            let (status, channel, chat_id) = delivery_row(self, tx, delivery)?;
            match status {
                DeliveryStatus::Cancelled => return Ok(()),
                DeliveryStatus::Queued | DeliveryStatus::Pending => {}
                DeliveryStatus::Partial
                | DeliveryStatus::Uncertain
                | DeliveryStatus::Failed
                | DeliveryStatus::Delivered
                | DeliveryStatus::Unfinalized => {
                    return Err(Error::DeliveryState {
                        delivery,
                        status,
                        action: "cancel",
                        expected: "queued or pending",
                    });
                }
            }
            let started: Option<(i64, u32, ChunkStatus, u32)> = tx
                .prepare_cached(concat!(
                    "SELECT id, chunk_index, status, attempts FROM outbound_delivery_chunks AS c WHERE ",
                    chunks_of_delivery!("c", "?1"),
                    " AND (status NOT IN ('pending', 'retry') OR attempts > 0 OR sent_before)
                     ORDER BY id LIMIT 1"
                ))?
                .query_row([id], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?)))
                .optional()?;
            if let Some((chunk, index, status, attempts)) = started {
                return Err(Error::CancelTooLate {
                    delivery,
                    chunk: ChunkId(chunk),
                    index,
                    status,
                    attempts,
                });
            }
            let now = self.options().now_ms();
            tx.prepare_cached(DELETE_CHUNKS_SQL)?.execute([id])?;
            tx.prepare_cached(
                "UPDATE outbound_deliveries
                 SET status = 'cancelled', updated_at = ?2, finished_at = ?2 WHERE id = ?1",
            )?
            .execute(params![id, now])?;
            if status == DeliveryStatus::Pending {
                lane::advance(tx, &rules.policy, &channel, &chat_id, now)?;
            }
            Ok(())
        })
    }
}

fn expect_status(
    chunk: &ChunkRef,
    allowed: &[ChunkStatus],
    action: &'static str,
    expected: &'static str,
) -> Result<()> {
    if allowed.contains(&chunk.status) {
        Ok(())
    } else {
        Err(Error::InvalidState {
            chunk: ChunkId(chunk.id),
            status: chunk.status,
            action,
            expected,
        })
    }
}

fn requeue(
    tx: &Tx<'_>,
    rules: &Stored,
    chunk: &ChunkRef,
    action: &'static str,
    now: i64,
) -> Result<()> {
    expect_status(
        chunk,
        &[ChunkStatus::Failed, ChunkStatus::Uncertain],
        action,
        "failed or uncertain",
    )?;
    tx.prepare_cached(
        "UPDATE outbound_delivery_chunks
         SET status = 'retry', attempts = 0, rate_limits = 0, due_at = NULL, claim_token = NULL,
             sent_before = (sent_before OR attempts > 0)
         WHERE id = ?1",
    )?
    .execute([chunk.id])?;
    lane::rejoin(
        tx,
        &rules.policy,
        chunk.delivery,
        &chunk.channel,
        &chunk.chat_id,
        now,
    )
}

/// The failed chunks of dead letters, oldest delivery first. Starts from the index of
/// unfinished deliveries (a join led by the chunk table would read all of history).
/// `?1` is a channel, or NULL for all.
pub(crate) const DEAD_LETTER_CHUNKS_SQL: &str = chunk_ref_where!(
    "d.id IN (SELECT id FROM outbound_deliveries WHERE status = 'failed' AND status <> 'delivered'
               AND corrupt IS NULL AND (?1 IS NULL OR channel = ?1))
     AND c.status = 'failed'
     ORDER BY d.id"
);

/// The failed or uncertain chunk of a delivery, or else its current head chunk (for the
/// error message).
fn held_or_head_chunk(outbox: &Outbox, tx: &Tx<'_>, delivery: DeliveryId) -> Result<ChunkRef> {
    let chunk = tx
        .prepare_cached(chunk_ref_where!(
            "d.id = ?1 AND d.uid = ?2
             ORDER BY c.status IN ('failed', 'uncertain') DESC,
                      c.chunk_index = min(d.delivered_count, d.chunk_count - 1) DESC
             LIMIT 1"
        ))?
        .query_row(
            params![outbox.delivery_rowid(delivery), delivery.to_string()],
            ChunkRef::from_row,
        )
        .optional()?;
    match chunk {
        Some(chunk) => Ok(chunk),
        // A cancelled delivery has no chunks left.
        None => Err(not_requeueable(
            delivery,
            delivery_row(outbox, tx, delivery)?.0,
        )),
    }
}

/// A delivery's status, channel and chat, by its public id.
fn delivery_row(
    outbox: &Outbox,
    tx: &Tx<'_>,
    delivery: DeliveryId,
) -> Result<(DeliveryStatus, String, String)> {
    tx.prepare_cached(
        "SELECT status, channel, chat_id FROM outbound_deliveries WHERE id = ?1 AND uid = ?2",
    )?
    .query_row(
        params![outbox.delivery_rowid(delivery), delivery.to_string()],
        |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)),
    )
    .optional()?
    .ok_or(Error::DeliveryNotFound(delivery))
}

/// Why a delivery in `status` cannot be requeued.
fn not_requeueable(delivery: DeliveryId, status: DeliveryStatus) -> Error {
    Error::DeliveryState {
        delivery,
        status,
        action: "requeue",
        expected: "failed or uncertain",
    }
}
