//! Lanes: which delivery of a chat may send next, and when.
//!
//! A chunk becomes claimable by getting a `due_at`. Only this module (and the outcome
//! code that moves a chunk's own `due_at`) hands one out, so the ordering rules live in
//! one place:
//!
//! * the head chunk of a delivery is the one at `chunk_index = delivered_count`; later
//!   chunks have no `due_at` until the one before them is delivered;
//! * with [`LaneOrder::Fifo`] a lane `(channel, chat_id)` has at most one active
//!   delivery (`pending`/`partial`); the others are `queued` and wait for
//!   [`advance`] to activate the first one in lane order;
//! * a lane paused by a rate limit hands out nothing due before the pause ends, nor
//!   anything before its channel's lane interval has passed since its last send
//!   started, whoever sent it.
//!
//! Every function here reads a lane and writes it by what it read: its caller holds
//! the lane ([`Locks::lock_lanes`](crate::store::Locks::lock_lanes)).

use crate::clock::duration_ms;
use crate::error::Result;
use crate::rules::{LaneHold, LaneOrder, Rules, Stored};
use crate::status::DeliveryStatus;
use crate::store::{Activation, HeadRow, LaneRef, StoreTx, Waiting};

/// Where a lane stands for scheduling purposes.
pub(crate) enum LaneHead {
    /// A delivery is active, or a failed/uncertain head blocks the lane.
    Busy,
    /// Nothing is active; this queued delivery should go next.
    Next(Waiting),
    /// Nothing active and nothing queued.
    Idle,
}

/// Decides who may send next in a lane, reading only its unfinished deliveries.
pub(crate) fn head(tx: &dyn StoreTx, rules: &Rules, lane: LaneRef<'_>) -> Result<LaneHead> {
    head_of(
        tx,
        LaneHold::of(rules, lane.channel),
        lane,
        tx.lane_head(lane)?,
    )
}

/// [`head`], from the lane's first unfinished delivery as read, with `hold` holding it.
pub(crate) fn head_of(
    tx: &dyn StoreTx,
    hold: LaneHold,
    lane: LaneRef<'_>,
    first: Option<HeadRow>,
) -> Result<LaneHead> {
    let next = match first {
        Some(HeadRow::Active) => return Ok(LaneHead::Busy),
        Some(HeadRow::Queued(waiting)) => Some(waiting),
        None => None,
    };
    if held(tx, hold, lane)?.is_some_and(|held| next.as_ref().is_none_or(|n| held < n.position)) {
        return Ok(LaneHead::Busy);
    }
    Ok(next.map_or(LaneHead::Idle, LaneHead::Next))
}

/// The oldest delivery row that, set aside, holds `lane` under `hold` (an uncertain
/// reply, a dead letter nobody dismissed: [`LaneStore::lane_held`]), if any. The
/// console asks the same when it shows what holds a chat.
///
/// [`LaneStore::lane_held`]: crate::store::LaneStore::lane_held
pub(crate) fn held(tx: &dyn StoreTx, hold: LaneHold, lane: LaneRef<'_>) -> Result<Option<i64>> {
    if hold == LaneHold::Nothing {
        return Ok(None);
    }
    tx.lane_held(lane, hold == LaneHold::Everything)
}

/// Activates the next queued delivery of a FIFO lane if the lane is free, making its
/// head chunk due no earlier than `earliest`. Does nothing for parallel lanes, whose
/// deliveries are active from the start.
pub(crate) fn advance(
    tx: &dyn StoreTx,
    rules: &Rules,
    lane: LaneRef<'_>,
    earliest: i64,
) -> Result<()> {
    advance_many(tx, rules, &mut vec![lane], earliest)
}

/// [`advance`] of several lanes. A lane given twice advances once (the second would
/// find the first's activation).
pub(crate) fn advance_many(
    tx: &dyn StoreTx,
    rules: &Rules,
    lanes: &mut Vec<LaneRef<'_>>,
    earliest: i64,
) -> Result<()> {
    if rules.lane_order == LaneOrder::Parallel {
        // Every delivery of a parallel lane is active from the start.
        return Ok(());
    }
    lanes.sort_unstable();
    lanes.dedup();
    let holds: Vec<LaneHold> = lanes
        .iter()
        .map(|lane| LaneHold::of(rules, lane.channel))
        .collect();
    if tx.advance_lanes(lanes, &holds, earliest)? {
        return Ok(());
    }
    advance_lanes(tx, lanes, &holds, earliest)
}

/// The rule of [`advance`] for distinct FIFO lanes, each held by what `holds` says,
/// composed of the store's reads and writes — the lanes' heads read, then the next
/// queued delivery of each free lane activated — where the store does not do it in one
/// go ([`LaneStore::advance_lanes`](crate::store::LaneStore::advance_lanes)).
pub(crate) fn advance_lanes(
    tx: &dyn StoreTx,
    lanes: &[LaneRef<'_>],
    holds: &[LaneHold],
    earliest: i64,
) -> Result<()> {
    let mut starting = Vec::new();
    for ((lane, first), hold) in lanes.iter().zip(tx.lane_heads(lanes)?).zip(holds) {
        if let LaneHead::Next(waiting) = head_of(tx, *hold, *lane, first)? {
            starting.push(activation(waiting, *lane, earliest));
        }
    }
    tx.activate_many(&starting)
}

/// When a waiting delivery may start: no earlier than `earliest`, and a delayed reply
/// no earlier than asked (once started, it goes on as usual).
fn start_time(waiting: &Waiting, earliest: i64) -> i64 {
    match waiting.not_before {
        Some(at) if waiting.head_index == 0 => earliest.max(at),
        _ => earliest,
    }
}

/// How a waiting delivery becomes active: `partial` when chunks of it were delivered
/// before it was set aside, else `pending`, its head chunk due no earlier than
/// `earliest` (see [`start_time`]).
fn activation(waiting: Waiting, lane: LaneRef<'_>, earliest: i64) -> Activation<'_> {
    let status = if waiting.head_index > 0 {
        DeliveryStatus::Partial
    } else {
        DeliveryStatus::Pending
    };
    Activation {
        earliest: start_time(&waiting, earliest),
        waiting,
        status,
        lane,
    }
}

/// Marks a delivery active and makes its head chunk due; a delayed reply starts no
/// earlier than asked (once started, it goes on as usual).
pub(crate) fn activate(
    tx: &dyn StoreTx,
    waiting: &Waiting,
    lane: LaneRef<'_>,
    earliest: i64,
) -> Result<()> {
    tx.activate(&activation(waiting.clone(), lane, earliest))
}

/// Notes that a send of the lane starts `now`: under a lane interval, no other send of
/// the lane may start before `now + interval`, whichever process makes it. Nothing is
/// written for channels without one.
pub(crate) fn note_send(
    tx: &dyn StoreTx,
    rules: &Stored,
    lane: LaneRef<'_>,
    now: i64,
) -> Result<()> {
    let interval = duration_ms(rules.policy.channel(lane.channel).lane_interval);
    if interval == 0 {
        return Ok(());
    }
    tx.note_lane_send(lane, now.saturating_add(interval))
}

/// Puts a delivery that was held aside (requeued, or resolved with chunks left) back
/// into its lane: active at once for parallel lanes; queued behind whatever is active
/// for FIFO lanes, and activated if the lane is free.
pub(crate) fn rejoin(
    tx: &dyn StoreTx,
    rules: &Rules,
    delivery: i64,
    lane: LaneRef<'_>,
    earliest: i64,
) -> Result<()> {
    // Out of the dead letters (and unfinished) first, whatever the lane order: a
    // dead letter that starts again is counted so, and no longer finished.
    tx.set_queued(delivery)?;
    if rules.lane_order == LaneOrder::Parallel {
        return activate(tx, &tx.waiting(delivery)?, lane, earliest);
    }
    advance(tx, rules, lane, earliest)
}

/// Moves stored rows with a change of the lane rules, so that no reply waits under a
/// rule that no longer holds: under `Parallel` every queued delivery starts; under FIFO
/// (with a changed failure policy, or a channel's replay policy) each lane with a
/// queued delivery gets the head the new rules give it. Its caller holds the rules
/// exclusively, so no lane changes under it.
pub(crate) fn follow_rule_change(
    tx: &dyn StoreTx,
    before: &Rules,
    after: &Rules,
    now: i64,
) -> Result<()> {
    // What holds a lane, on channels of the default rules and on every channel named.
    let held_alike = |name: &str| LaneHold::of(before, name) == LaneHold::of(after, name);
    let holds_alike = before.lane_failure == after.lane_failure
        && before.default_channel.replay == after.default_channel.replay
        && before
            .channels
            .keys()
            .chain(after.channels.keys())
            .all(|n| held_alike(n));
    if before.lane_order == after.lane_order && holds_alike {
        return Ok(());
    }
    let mut lanes = std::collections::BTreeSet::new();
    for queued in tx.queued_deliveries()? {
        let lane = LaneRef::new(&queued.channel, &queued.chat_id);
        if after.lane_order == LaneOrder::Parallel {
            activate(tx, &tx.waiting(queued.id)?, lane, now)?;
        } else if lanes.insert((queued.channel.clone(), queued.chat_id.clone())) {
            advance(tx, after, lane, now)?;
        }
    }
    Ok(())
}
