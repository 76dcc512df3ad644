//! Accepting deliveries: validation, idempotency, and the insert.

use serde::Serialize;

use crate::error::{Error, Result};
use crate::ids::{CHUNK_STRIDE, DeliveryId};
use crate::lane::{self, LaneHead};
use crate::outbox::Outbox;
pub use crate::reply::{MAX_ENQUEUE_BATCH, NewDelivery};
use crate::rules::LaneOrder;
use crate::rules::Stored;
use crate::status::DeliveryStatus;
use crate::store::connections::Announce;
use crate::store::{LaneRef, NewRow, StoreTx, StoredContent};

/// What [`Outbox::enqueue`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct Enqueued {
    /// The delivery's id.
    pub id: DeliveryId,
    /// False when the idempotency key named an existing delivery with the same content,
    /// so nothing was written.
    pub created: bool,
}

impl Outbox {
    /// Stores a delivery and its chunks in one transaction, before any network call.
    ///
    /// ```
    /// use chunked_outbox::{NewDelivery, Outbox, OutboxOptions};
    ///
    /// let outbox = Outbox::open_in_memory(OutboxOptions::default())?;
    /// let first = outbox.enqueue(&NewDelivery::single("slack", "C042", "deploy finished").with_idempotency_key("k1"))?;
    /// let again = outbox.enqueue(&NewDelivery::single("slack", "C042", "deploy finished").with_idempotency_key("k1"))?;
    /// assert_eq!(first.id, again.id);
    /// assert!(first.created && !again.created);
    /// # Ok::<(), chunked_outbox::Error>(())
    /// ```
    ///
    /// # Errors
    ///
    /// [`Error::InvalidInput`] for an empty channel, chat id or text, no chunks, an
    /// empty or whitespace-only chunk, or anything over the `MAX_*` limits of this
    /// module; [`Error::IdempotencyConflict`] if the key names a delivery with different
    /// content. Nothing is written in either case.
    pub fn enqueue(&self, delivery: &NewDelivery) -> Result<Enqueued> {
        delivery.validate()?;
        self.storable(delivery)?;
        let enqueued = self.write_and_wake(Announce::IfMadeDue, |tx, rules| {
            lock_for(tx, &[delivery])?;
            let now = self.options().now_ms();
            match insert_keyless(tx, self, rules, &[delivery], now)? {
                Some(mut stored) => Ok(stored.remove(0)),
                None => insert(tx, self, rules, delivery),
            }
        })?;
        if enqueued.created {
            crate::telemetry::enqueued(&delivery.channel);
        }
        Ok(enqueued)
    }

    /// Stores several deliveries in one transaction: all of them, or none.
    ///
    /// One commit for the lot is what makes it faster than one [`enqueue`](Self::enqueue)
    /// each: an engine that answers several chats at once, or imports a backlog, pays
    /// the commit once. Each delivery is treated as `enqueue` treats it — lanes,
    /// idempotency keys (a key repeated within the batch names the first delivery), the
    /// stored rules — and the results come back in the order given.
    ///
    /// ```
    /// use chunked_outbox::{NewDelivery, Outbox, OutboxOptions};
    ///
    /// let outbox = Outbox::open_in_memory(OutboxOptions::default())?;
    /// let replies: Vec<NewDelivery> = (0..3)
    ///     .map(|chat| NewDelivery::single("telegram", chat.to_string(), "the build is green"))
    ///     .collect();
    /// let stored = outbox.enqueue_batch(&replies)?;
    /// assert_eq!(stored.len(), 3);
    /// assert_eq!(outbox.health()?.totals.due_chunks, 3);
    ///
    /// // One bad delivery refuses the whole batch; nothing of it is written.
    /// let bad = [NewDelivery::single("telegram", "9", "fine"), NewDelivery::single("telegram", "9", "")];
    /// assert!(outbox.enqueue_batch(&bad).is_err());
    /// assert_eq!(outbox.health()?.totals.total_deliveries, 3);
    /// # Ok::<(), chunked_outbox::Error>(())
    /// ```
    ///
    /// # Errors
    ///
    /// As [`enqueue`](Self::enqueue), for the first delivery that fails, and
    /// [`Error::InvalidInput`] for more than [`MAX_ENQUEUE_BATCH`] deliveries. Nothing
    /// is written in either case.
    pub fn enqueue_batch<'a>(
        &self,
        deliveries: impl IntoIterator<Item = &'a NewDelivery>,
    ) -> Result<Vec<Enqueued>> {
        let deliveries: Vec<&NewDelivery> = deliveries.into_iter().collect();
        if deliveries.len() > MAX_ENQUEUE_BATCH {
            return Err(Error::invalid(
                "deliveries",
                format!(
                    "{} deliveries in one batch; at most {MAX_ENQUEUE_BATCH}: split it",
                    deliveries.len()
                ),
            ));
        }
        for d in &deliveries {
            d.validate()?;
            self.storable(d)?;
        }
        if deliveries.is_empty() {
            return Ok(Vec::new());
        }
        let stored = self.write_and_wake(Announce::IfMadeDue, |tx, rules| {
            lock_for(tx, &deliveries)?;
            let now = self.options().now_ms();
            match insert_keyless(tx, self, rules, &deliveries, now)? {
                Some(stored) => Ok(stored),
                None => deliveries
                    .iter()
                    .map(|d| insert(tx, self, rules, d))
                    .collect::<Result<Vec<_>>>(),
            }
        })?;
        for (d, e) in deliveries.iter().zip(&stored) {
            if e.created {
                crate::telemetry::enqueued(&d.channel);
            }
        }
        Ok(stored)
    }

    /// Splits `text` with `splitter` and enqueues the chunks in one call.
    ///
    /// ```
    /// use chunked_outbox::{Outbox, OutboxOptions, Splitter};
    ///
    /// let outbox = Outbox::open_in_memory(OutboxOptions::default())?;
    /// let id = outbox.enqueue_text("telegram", "42", &"long reply ".repeat(800), &Splitter::telegram())?.id;
    /// assert_eq!(outbox.delivery(id)?.unwrap().chunk_count, 3);
    /// # Ok::<(), chunked_outbox::Error>(())
    /// ```
    ///
    /// # Errors
    ///
    /// As [`Splitter::split`](crate::Splitter::split) and [`enqueue`](Self::enqueue).
    pub fn enqueue_text(
        &self,
        channel: &str,
        chat_id: &str,
        text: &str,
        splitter: &crate::split::Splitter,
    ) -> Result<Enqueued> {
        self.enqueue(&NewDelivery::split(channel, chat_id, text, splitter)?)
    }

    /// Enqueues `delivery` in the transaction `tx` runs in, which the caller holds
    /// (see [`enqueue_in`](Self::enqueue_in)), inside a nested transaction: nothing of
    /// it stays if it fails, even if the caller goes on to commit.
    pub(crate) fn enqueue_on(&self, tx: &dyn StoreTx, delivery: &NewDelivery) -> Result<Enqueued> {
        tx.begin_nested()?;
        match self.rules_uncached(tx).and_then(|rules| {
            lock_for(tx, &[delivery])?;
            insert(tx, self, &rules, delivery)
        }) {
            Ok(enqueued) => {
                tx.end_nested(true)?;
                // Not visible before the caller commits: waking dispatchers now would
                // have them look for it too early. The caller wakes them after its
                // commit; otherwise a poll finds it.
                Ok(enqueued)
            }
            Err(e) => {
                tx.end_nested(false)?;
                Err(e)
            }
        }
    }
}

impl Outbox {
    /// Refuses what this outbox's store cannot keep as given: a NUL character where
    /// its text holds none (PostgreSQL's; SQLite's does).
    pub(crate) fn storable(&self, d: &NewDelivery) -> Result<()> {
        if self.store().capabilities().nul_in_text {
            return Ok(());
        }
        let fields = [
            ("chat id", Some(&d.chat_id)),
            ("text", Some(&d.text)),
            ("idempotency key", d.idempotency_key.as_ref()),
            ("sender", d.sender.as_ref()),
            ("metadata", d.metadata.as_ref()),
        ];
        for (what, value) in fields {
            if value.is_some_and(|v| v.contains('\0')) {
                return Err(Error::invalid(
                    what,
                    "contains a NUL character, which PostgreSQL text cannot store",
                ));
            }
        }
        if d.chunks.iter().any(|c| c.contains('\0')) {
            return Err(Error::invalid(
                "chunk",
                "contains a NUL character, which PostgreSQL text cannot store",
            ));
        }
        Ok(())
    }
}

/// Locks what enqueueing `deliveries` reads and then writes by what it read: their
/// caller keys (is the key free?) and their lanes (which delivery is the head?), each
/// kind in sorted order.
fn lock_for(tx: &dyn StoreTx, deliveries: &[&NewDelivery]) -> Result<()> {
    if let [d] = deliveries {
        // One reply (most enqueues): nothing to sort.
        if let Some(key) = &d.idempotency_key {
            tx.lock_key(&d.channel, key)?;
        }
        return tx.lock_lanes(&mut [LaneRef::new(&d.channel, &d.chat_id)]);
    }
    let mut keys: Vec<(&str, &str)> = deliveries
        .iter()
        .filter_map(|d| Some((d.channel.as_str(), d.idempotency_key.as_deref()?)))
        .collect();
    keys.sort_unstable();
    keys.dedup();
    for (channel, key) in keys {
        tx.lock_key(channel, key)?;
    }
    let mut lanes: Vec<LaneRef<'_>> = deliveries
        .iter()
        .map(|d| LaneRef::new(&d.channel, &d.chat_id))
        .collect();
    tx.lock_lanes(&mut lanes)
}

/// Stores deliveries without caller keys, whose lanes the caller holds ([`lock_for`]),
/// as [`insert`] one by one would — each a row drawn under its lane's lock and a place
/// in its lane's order — with the lanes read, the rows drawn and the deliveries stored
/// in one go each. `None` (nothing written) when a delivery has a caller key (its key
/// decides whether it is stored at all) or replies an application staged wait in one
/// of the lanes: those take [`insert`].
fn insert_keyless(
    tx: &dyn StoreTx,
    outbox: &Outbox,
    rules: &Stored,
    deliveries: &[&NewDelivery],
    now: i64,
) -> Result<Option<Vec<Enqueued>>> {
    if deliveries.iter().any(|d| d.idempotency_key.is_some()) {
        return Ok(None);
    }
    let mut lanes: Vec<LaneRef<'_>> = deliveries
        .iter()
        .map(|d| LaneRef::new(&d.channel, &d.chat_id))
        .collect();
    lanes.sort_unstable();
    lanes.dedup();
    let (entries, rows) = tx.enter_lanes(&lanes, deliveries.len())?;
    if entries.iter().any(|e| e.staged_before) {
        // (The rows drawn are left unused.)
        return Ok(None);
    }
    // Where each FIFO lane stands as the deliveries before join it: busy once one of
    // them (or one before) is active.
    let mut heads = Vec::with_capacity(lanes.len());
    if rules.policy.lane_order == LaneOrder::Fifo {
        for (lane, entry) in lanes.iter().zip(&entries) {
            heads.push(lane::head_of(
                tx,
                crate::rules::LaneHold::of(&rules.policy, lane.channel),
                *lane,
                entry.head.clone(),
            )?);
        }
    }
    if rows
        .last()
        .is_some_and(|row| row.checked_mul(CHUNK_STRIDE).is_none())
    {
        return Err(Error::invalid(
            "delivery",
            "the database has used up its row ids; purge it or start a new file",
        ));
    }
    // A channel the stored rules do not know yet is registered once, not per delivery.
    let mut registered: Vec<(&str, i64)> = Vec::new();
    let mut channel_ids = Vec::with_capacity(deliveries.len());
    for d in deliveries {
        let known = rules.channel_ids.get(&d.channel).copied().or_else(|| {
            registered
                .iter()
                .find(|(name, _)| *name == d.channel)
                .map(|(_, id)| *id)
        });
        channel_ids.push(match known {
            Some(id) => id,
            None => {
                let id = tx.channel_number(&d.channel)?;
                registered.push((&d.channel, id));
                id
            }
        });
    }
    let mut ids = Vec::with_capacity(deliveries.len());
    let mut plans = Vec::with_capacity(deliveries.len());
    for ((d, row), channel_id) in deliveries.iter().zip(&rows).zip(channel_ids) {
        let lane = LaneRef::new(&d.channel, &d.chat_id);
        let at = lanes.partition_point(|l| *l < lane);
        let active = match rules.policy.lane_order {
            LaneOrder::Parallel => true,
            LaneOrder::Fifo => match std::mem::replace(&mut heads[at], LaneHead::Busy) {
                LaneHead::Idle => true,
                LaneHead::Busy => false,
                // A queued delivery with nothing in front of it: start that one first.
                LaneHead::Next(waiting) => {
                    lane::activate(tx, &waiting, lane, now)?;
                    false
                }
            },
        };
        // The head chunk of an active delivery is inserted already due (see
        // `insert_new`), at the lane's due time of its earliest start.
        let head_due = active.then(|| {
            now.max(d.not_before.unwrap_or(i64::MIN))
                .max(entries[at].free_at)
        });
        let id = outbox.new_delivery_id(*row, now);
        ids.push(id);
        plans.push((*row, id.to_string(), channel_id, active, head_due));
    }
    let new_rows: Vec<NewRow<'_>> = deliveries
        .iter()
        .zip(&plans)
        .map(|(d, (row, uid, channel_id, active, head_due))| NewRow {
            row: *row,
            uid,
            delivery: d,
            channel_id: *channel_id,
            active: *active,
            now,
            head_due: *head_due,
            chunk_rows: *active || !stored_at_activation(d),
        })
        .collect();
    // Without caller keys nothing can refuse a row.
    if tx.insert_deliveries(&new_rows)?.contains(&false) {
        return Err(Error::Busy);
    }
    Ok(Some(
        ids.into_iter()
            .map(|id| Enqueued { id, created: true })
            .collect(),
    ))
}

/// Stores one delivery; its caller holds its key and lane ([`lock_for`]).
fn insert(tx: &dyn StoreTx, outbox: &Outbox, rules: &Stored, d: &NewDelivery) -> Result<Enqueued> {
    if let Some(existing) = existing(tx, d)? {
        return existing;
    }
    match insert_new(tx, outbox, rules, d, None, outbox.options().now_ms())? {
        Some((_, id)) => Ok(Enqueued { id, created: true }),
        // An application's transaction that staged a reply with this key (PostgreSQL)
        // committed while this one waited for its row: that reply is the one.
        None => existing(tx, d)?.unwrap_or(Err(Error::Busy)),
    }
}

/// What an enqueue of `d` returns if its caller key names a stored delivery: that
/// delivery if its content is the same, else the conflict.
fn existing(tx: &dyn StoreTx, d: &NewDelivery) -> Result<Option<Result<Enqueued>>> {
    let Some(key) = &d.idempotency_key else {
        return Ok(None);
    };
    let Some((row, uid)) = tx.find_by_key(&d.channel, key)? else {
        return Ok(None);
    };
    Ok(Some(found_by_key(
        d,
        uid.parse()?,
        Some(tx.stored_content(row)?),
    )))
}

/// The answer of an enqueue whose caller key names delivery `existing`, `found` as
/// stored (`None` if it cannot be read): nothing made if it has the same content, else
/// [`Error::IdempotencyConflict`].
pub(crate) fn found_by_key(
    d: &NewDelivery,
    existing: DeliveryId,
    found: Option<StoredContent>,
) -> Result<Enqueued> {
    match found {
        Some(found) if same_content(&found, d) => Ok(Enqueued {
            id: existing,
            created: false,
        }),
        _ => Err(Error::IdempotencyConflict {
            key: d.idempotency_key.clone().unwrap_or_default(),
            existing,
        }),
    }
}

/// Makes the replies that applications' own transactions staged (PostgreSQL's
/// `outbound_enqueue`: a row, no lane decided) deliveries of their lanes, exactly as
/// an enqueue would have — a row drawn under the lane's lock, the lane's head decided
/// — keeping the uid each application was given. Lanes other transactions hold now
/// are not waited for: their replies are left for a later claim (the handle's hint
/// says so). Whether the round was full (more may be staged).
pub(crate) fn activate_staged(
    tx: &dyn StoreTx,
    outbox: &Outbox,
    rules: &Stored,
    now: i64,
) -> Result<bool> {
    const ROUND: usize = 100;
    let staged = tx.staged(ROUND as i64)?;
    let full = staged.len() == ROUND;
    // A lane passed over stays passed over in this round: its later replies must not
    // go before the earlier one.
    let mut passed: Vec<(String, String)> = Vec::new();
    for s in staged {
        let d = &s.delivery;
        let lane = (d.channel.clone(), d.chat_id.clone());
        if passed.contains(&lane) || !tx.try_lock_lane(LaneRef::new(&d.channel, &d.chat_id))? {
            passed.push(lane);
            outbox.hint_staged();
            continue;
        }
        start_staged(tx, outbox, rules, &s, now)?;
    }
    Ok(full)
}

/// Makes every reply staged in `lane`, whose lock the caller holds, a delivery of it,
/// in the order they were staged.
fn activate_lane(
    tx: &dyn StoreTx,
    outbox: &Outbox,
    rules: &Stored,
    lane: LaneRef<'_>,
    now: i64,
) -> Result<()> {
    for s in tx.staged_in_lane(lane)? {
        start_staged(tx, outbox, rules, &s, now)?;
    }
    Ok(())
}

/// Makes staged reply `s`, whose lane the caller holds, a delivery of its lane.
fn start_staged(
    tx: &dyn StoreTx,
    outbox: &Outbox,
    rules: &Stored,
    s: &crate::store::Staged,
    now: i64,
) -> Result<()> {
    // A row this build cannot start (written by an older `outbound_enqueue`, or by hand)
    // is set aside as unreadable rows are, once, not met again by every claim.
    if let Err(e) = s.delivery.validate() {
        let reason = format!("a staged reply that cannot be started: {e}");
        let chunk = s.row * crate::ids::CHUNK_STRIDE;
        return crate::state::set_aside_corrupt(tx, rules, chunk, s.row, &reason, now);
    }
    // Cancelled meanwhile: nothing to start.
    if !tx.take_staged(s.row)? {
        return Ok(());
    }
    // Its key stays this transaction's (the row removed holds it until the commit), so
    // nothing can take it in between.
    let (row, _) = insert_new(tx, outbox, rules, &s.delivery, Some(s.uid.parse()?), now)?
        .ok_or(Error::Busy)?;
    tx.note_renumbered(s.row, row)
}

/// Stores `d` as a new delivery of its lane, whose lane (and key) its caller holds: a
/// row drawn now, which the uid names — or, for a reply an application staged, the uid
/// it was given. Its row and uid; `None` if its key was taken meanwhile (see
/// [`DeliveryStore::insert_delivery`](crate::store::DeliveryStore::insert_delivery)).
fn insert_new(
    tx: &dyn StoreTx,
    outbox: &Outbox,
    rules: &Stored,
    d: &NewDelivery,
    uid: Option<DeliveryId>,
    now: i64,
) -> Result<Option<(i64, DeliveryId)>> {
    let channel_id = match rules.channel_ids.get(&d.channel) {
        Some(id) => *id,
        None => tx.channel_number(&d.channel)?,
    };
    let lane = LaneRef::new(&d.channel, &d.chat_id);
    // The row is chosen here, under the lane's lock, so the uid can be derived from it
    // (the uid needs no index of its own) and it is the delivery's lane position.
    let (mut row, staged_before) = tx.next_delivery_row_in(lane)?;
    if staged_before && uid.is_none() {
        // Replies applications staged in this lane committed before this enqueue: they
        // go first (the row drawn is left unused).
        activate_lane(tx, outbox, rules, lane, now)?;
        row = tx.next_delivery_row()?;
    }
    if row.checked_mul(CHUNK_STRIDE).is_none() {
        return Err(Error::invalid(
            "delivery",
            "the database has used up its row ids; purge it or start a new file",
        ));
    }
    let id = uid.unwrap_or_else(|| outbox.new_delivery_id(row, now));
    let active = match rules.policy.lane_order {
        LaneOrder::Parallel => true,
        LaneOrder::Fifo => match lane::head(tx, &rules.policy, lane)? {
            LaneHead::Idle => true,
            LaneHead::Busy => false,
            // A queued delivery with nothing in front of it: start that one first.
            LaneHead::Next(waiting) => {
                lane::activate(tx, &waiting, lane, now)?;
                false
            }
        },
    };
    // The head chunk of an active delivery is inserted already due, so it enters the
    // claim index once instead of being inserted and then updated.
    let head_due = if active {
        let earliest = now.max(d.not_before.unwrap_or(i64::MIN));
        Some(tx.lane_due_time(lane, earliest)?)
    } else {
        None
    };
    let stored = tx.insert_delivery(&NewRow {
        row,
        uid: &id.to_string(),
        delivery: d,
        channel_id,
        active,
        now,
        head_due,
        chunk_rows: active || !stored_at_activation(d),
    })?;
    Ok(stored.then_some((row, id)))
}

/// Whether a queued delivery's chunk row waits for its activation: a reply sent as one
/// chunk holding its whole text has nothing to store in that row but its state, which
/// is `pending` with nothing due until the lane reaches it. [`lane::activate`] stores
/// the row then, so a reply enqueued behind another writes two b-tree pages instead of
/// three — most of an enqueue's cost is its commit's page writes.
fn stored_at_activation(d: &NewDelivery) -> bool {
    matches!(d.chunks.as_slice(), [only] if *only == d.text)
}

/// Whether a stored delivery is what `d` would store (an enqueue with the same key
/// is then the same reply).
pub(crate) fn same_content(stored: &StoredContent, d: &NewDelivery) -> bool {
    if stored.channel != d.channel
        || stored.chat_id != d.chat_id
        || stored.sender != d.sender
        || stored.text != d.text
        || stored.metadata != d.metadata
    {
        return false;
    }
    if stored.status == DeliveryStatus::Cancelled {
        // Its chunks were removed; the key names it, whatever chunks it was given.
        return true;
    }
    stored.chunks.len() == d.chunks.len()
        && stored
            .chunks
            .iter()
            .zip(&d.chunks)
            .all(|(chunk, new)| chunk.as_ref().unwrap_or(&stored.text) == new)
}
