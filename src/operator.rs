//! Operator actions: requeue dead letters and uncertain chunks, resolve, acknowledge,
//! cancel.

use std::collections::BTreeSet;

use crate::error::{Error, Result};
use crate::finalize::{self, Tally};
use crate::ids::{ChunkId, DeliveryId};
use crate::lane;
use crate::outbox::Outbox;
use crate::state::{self, Recorded, expect_status, requeue};
use crate::status::{ChunkStatus, DeliveryStatus};
use crate::store::connections::Announce;
use crate::store::{ChunkProgress, ChunkRef, DeliveryState, LaneRef, StoreTx};

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
        self.write_and_wake(Announce::Yes, |tx, rules| {
            let chunk = locked_chunk(tx, chunk)?;
            requeue(tx, rules, &chunk, "requeue", self.options().now_ms())
        })
    }

    /// Requeues the `failed` or `uncertain` chunk of a delivery (see
    /// [`requeue_chunk`](Self::requeue_chunk)).
    ///
    /// ```
    /// use chunked_outbox::{NewDelivery, Outbox, OutboxOptions, Outcome};
    /// use chunked_outbox::monitoring::DeliveryStatus;
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
        self.write_and_wake(Announce::Yes, |tx, rules| {
            lock_lane_of(self, tx, delivery)?;
            let chunk = held_or_head_chunk(self, tx, delivery)?;
            if !matches!(chunk.status, ChunkStatus::Failed | ChunkStatus::Uncertain) {
                let status = delivery_row(self, tx, delivery)?.1;
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
        self.write_and_wake(Announce::Yes, |tx, rules| {
            let now = self.options().now_ms();
            let listed = tx.dead_letter_chunks(channel)?;
            let mut lanes: Vec<LaneRef<'_>> = listed.iter().map(|c| c.lane()).collect();
            tx.lock_lanes(&mut lanes)?;
            // Read again under the lanes: one may have been requeued meanwhile.
            let mut requeued = 0;
            for chunk in tx.dead_letter_chunks(channel)? {
                if lanes.contains(&chunk.lane()) {
                    requeue(tx, rules, &chunk, "requeue", now)?;
                    requeued += 1;
                }
            }
            Ok(requeued)
        })
    }

    /// Settles a chunk held as `uncertain` (see [`Resolution`]).
    ///
    /// ```
    /// use chunked_outbox::{NewDelivery, Outbox, OutboxOptions, Outcome};
    /// use chunked_outbox::maintenance::Resolution;
    /// use chunked_outbox::monitoring::ChunkStatus;
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
        self.write_and_wake(Announce::Yes, |tx, rules| {
            let chunk = locked_chunk(tx, chunk)?;
            expect_status(&chunk, &[ChunkStatus::Uncertain], "resolve", "uncertain")?;
            let now = self.options().now_ms();
            match &resolution {
                Resolution::Delivered {
                    platform_message_id,
                } => state::deliver_held(tx, rules, &chunk, platform_message_id.as_deref(), now),
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
        self.write_and_wake(Announce::Yes, |tx, rules| {
            let (id, status, channel, chat_id) = lock_lane_of(self, tx, delivery)?;
            if status != DeliveryStatus::Unfinalized {
                return Err(Error::DeliveryState {
                    delivery,
                    status,
                    action: "finalize",
                    expected: "unfinalized",
                });
            }
            let created_at = tx.created_at(id)?;
            let now = self.options().now_ms();
            let mut tally = Tally::default();
            let lane = LaneRef::new(&channel, &chat_id);
            match finalize::finalize(tx, rules, id, lane, (created_at, now), &mut tally)? {
                None => tally.write(tx),
                Some(message) => Err(Error::FinalizationRefused { delivery, message }),
            }
        })
    }

    /// Dismisses every dead letter not dismissed yet (of one channel, or of all for
    /// `None`): an operator has seen it. Dismissed dead letters stay listed (and
    /// requeueable) until purged, but no longer count in health's
    /// `unacknowledged_dead_letters`, and a lane blocked by one
    /// ([`LaneFailurePolicy::Block`](crate::rules::LaneFailurePolicy::Block)) moves on. Returns
    /// how many were dismissed. (`outbox dismiss-dead-letters`.)
    ///
    /// # Errors
    ///
    /// Database errors; nothing is changed then.
    pub fn dismiss_dead_letters(&self, channel: Option<&str>) -> Result<u64> {
        self.write_and_wake(Announce::Yes, |tx, rules| {
            let now = self.options().now_ms();
            // One write that decides nothing; the lanes it frees are locked before their
            // heads are read.
            let acknowledged = tx.acknowledge_dead_letters(channel, now)?;
            let count = acknowledged.len() as u64;
            let lanes: BTreeSet<(String, String)> = acknowledged.into_iter().collect();
            let mut refs: Vec<LaneRef<'_>> = lanes
                .iter()
                .map(|(c, chat)| LaneRef::new(c, chat))
                .collect();
            tx.lock_lanes(&mut refs)?;
            for lane in refs {
                lane::advance(tx, &rules.policy, lane, now)?;
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
    /// use chunked_outbox::{NewDelivery, Outbox, OutboxOptions};
    /// use chunked_outbox::monitoring::DeliveryStatus;
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
        self.write_and_wake(Announce::Yes, |tx, rules| {
            let (id, status, channel, chat_id) = lock_lane_of(self, tx, delivery)?;
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
            if let Some(started) = tx.chunk_progress(id)?.into_iter().find(may_have_started) {
                return Err(Error::CancelTooLate {
                    delivery,
                    chunk: ChunkId(started.id),
                    index: started.index,
                    status: started.status,
                    attempts: started.attempts,
                });
            }
            let now = self.options().now_ms();
            tx.delete_chunks(id)?;
            tx.mark_cancelled(id, now)?;
            if status == DeliveryStatus::Pending {
                lane::advance(tx, &rules.policy, LaneRef::new(&channel, &chat_id), now)?;
            }
            Ok(())
        })
    }
}

/// Chunk `id` read under its lane's lock: read, locked, and read again, since the
/// lane is known only from the row.
pub(crate) fn locked_chunk(tx: &dyn StoreTx, id: ChunkId) -> Result<ChunkRef> {
    let chunk = state::load_chunk(tx, id)?;
    tx.lock_lanes(&mut [chunk.lane()])?;
    state::load_chunk(tx, id)
}

/// A delivery's status and lane, by its public id, read again once its lane is locked.
fn lock_lane_of(outbox: &Outbox, tx: &dyn StoreTx, delivery: DeliveryId) -> Result<DeliveryState> {
    let (_, _, channel, chat_id) = delivery_row(outbox, tx, delivery)?;
    tx.lock_lanes(&mut [LaneRef::new(&channel, &chat_id)])?;
    delivery_row(outbox, tx, delivery)
}

/// The failed or uncertain chunk of a delivery, or else its current head chunk (for the
/// error message).
fn held_or_head_chunk(outbox: &Outbox, tx: &dyn StoreTx, delivery: DeliveryId) -> Result<ChunkRef> {
    match tx.held_or_head_chunk(outbox.delivery_rowid(delivery), &delivery.to_string())? {
        Some(chunk) => Ok(chunk),
        // A cancelled delivery has no chunks left.
        None => Err(not_requeueable(
            delivery,
            delivery_row(outbox, tx, delivery)?.1,
        )),
    }
}

/// A delivery's row, status, channel and chat, by its public id.
fn delivery_row(outbox: &Outbox, tx: &dyn StoreTx, delivery: DeliveryId) -> Result<DeliveryState> {
    tx.delivery_state(outbox.delivery_rowid(delivery), &delivery.to_string())?
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

/// Whether a send of the chunk may have started: it is past `pending` and `retry`, or
/// was charged an attempt, now or in an earlier budget. A cancel comes too late then.
fn may_have_started(chunk: &ChunkProgress) -> bool {
    !matches!(chunk.status, ChunkStatus::Pending | ChunkStatus::Retry)
        || chunk.attempts > 0
        || chunk.sent_before
}
