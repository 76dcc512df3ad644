//! The contract of each store primitive, checked primitive by primitive on every store:
//! one file per seam trait, above the stores (a contract drives an [`Outbox`] on the
//! store and calls the primitive in a write transaction of it).
//!
//! Each contract is a function of a fresh outbox on the store under test (and the
//! manual clock it runs on): it seeds rows through the public API or through other
//! primitives, calls the primitive, and checks what the primitive returned and what it
//! left. [`contracts!`] makes one test of each contract for a store; a new store adds
//! one line at the bottom.

mod batches;
mod chunks;
mod claims;
mod deliveries;
mod finalize;
mod lanes;
mod operator;
#[cfg(feature = "postgres")]
mod plans;
mod reads;
mod rules;

use crate::claim::Claim;
use crate::clock::ManualClock;
use crate::ids::DeliveryId;
use crate::options::OutboxOptions;
use crate::outbox::Outbox;
use crate::reply::NewDelivery;
use crate::store::{LaneRef, StoreTx};
use std::sync::Arc;
use std::time::Duration;

/// The time every contract starts at, ms.
const T0: i64 = 1_767_225_600_000;

/// A store under test: a fresh outbox on it, on a manual clock at [`T0`].
type Fresh = fn(OutboxOptions) -> Outbox;

fn options(clock: &ManualClock) -> OutboxOptions {
    OutboxOptions::default()
        .with_clock(Arc::new(clock.clone()))
        .with_lease(Duration::from_secs(30))
}

/// A fresh outbox on the store, on a manual clock at [`T0`] that the contract leaves there.
fn fresh_at_t0(fresh: Fresh) -> Outbox {
    fresh(options(&ManualClock::new(T0)))
}

/// Runs `f` in one write transaction of `ob`'s store.
fn write<T: Send>(
    ob: &Outbox,
    mut f: impl FnMut(&dyn StoreTx) -> crate::error::Result<T> + Send,
) -> T {
    ob.write(|tx, _| f(tx)).unwrap()
}

fn lane<'a>(chat: &'a str) -> LaneRef<'a> {
    LaneRef::new("t", chat)
}

fn row(ob: &Outbox, id: DeliveryId) -> i64 {
    ob.delivery_rowid(id)
}

fn enqueue(ob: &Outbox, chat: &str, text: &str) -> DeliveryId {
    ob.enqueue(&NewDelivery::single("t", chat, text))
        .unwrap()
        .id
}

/// Channel `t` as the claim reads it.
fn channel_t(ob: &Outbox) -> crate::store::ChannelRow {
    write(ob, |tx| Ok(tx.channels(Some("t"))?.remove(0)))
}

fn claim_one(ob: &Outbox) -> Claim {
    let mut claims = ob.claim(1).unwrap();
    assert_eq!(claims.len(), 1, "one chunk due");
    claims.remove(0)
}

/// The view of delivery `id` as the store reads it.
fn view(ob: &Outbox, id: DeliveryId) -> crate::inspect::DeliveryView {
    write(ob, |tx| tx.delivery_view(row(ob, id), &id.to_string())).expect("stored")
}

/// Runs `mine` (a store's own version of a batched primitive) and `composed` (its
/// composition of the one-at-a-time primitives) from the same rows, each undone after:
/// both return the same and leave the same rows, which differ from the rows before.
fn same_both_ways<R: PartialEq + std::fmt::Debug>(
    tx: &dyn StoreTx,
    what: &str,
    mine: impl Fn() -> crate::error::Result<R>,
    composed: impl Fn() -> crate::error::Result<R>,
) -> crate::error::Result<()> {
    let before = tx.table_rows()?;
    let run = |f: &dyn Fn() -> crate::error::Result<R>| -> crate::error::Result<(R, Vec<String>)> {
        tx.begin_nested()?;
        let returned = f()?;
        let rows = tx.table_rows()?;
        tx.end_nested(false)?;
        Ok((returned, rows))
    };
    let (returned, rows) = run(&mine)?;
    let (expected, expected_rows) = run(&composed)?;
    assert_eq!(returned, expected, "{what}: what it returned");
    assert_ne!(rows, before, "{what} wrote nothing");
    assert_eq!(rows, expected_rows, "{what}: the rows it left");
    assert_eq!(tx.table_rows()?, before, "{what}: undone");
    Ok(())
}

/// One test per contract for store `$store` (skipped, loudly, when `$available` is
/// false: a store without its server; see `test_server`), named
/// `contracts::<store>::<area>::<contract>`.
macro_rules! contracts {
    ($store:ident, $fresh:expr) => {
        contracts!($store, $fresh, true);
    };
    ($store:ident, $fresh:expr, $available:expr) => {
        mod $store {
            contracts!(@area $fresh, $available; lanes: lane_positions_follow_insert_order, the_head_is_the_first_queued_when_nothing_is_active, a_lane_is_held_by_uncertain_and_unacknowledged_dead_letters, lane_due_times_wait_for_pauses_and_intervals, a_pause_pushes_the_lanes_due_chunks, activation_and_later_chunks_are_due_through_the_lane, a_held_delivery_is_queued_again, lanes_are_entered_as_their_reads_say, the_only_writer_holds_every_lock);
            contracts!(@area $fresh, $available; claims: due_chunks_come_in_due_order_up_to_the_limit, a_stale_token_is_refused, leases_are_marked_renewed_and_expire, channel_pauses_and_slots);
            contracts!(@area $fresh, $available; chunks: a_queued_replys_chunk_is_supplied, budgets_count_and_reset, chunks_are_rescheduled, chunks_and_deliveries_are_set_aside, corrupt_rows_are_failed_with_their_lane);
            contracts!(@area $fresh, $available; deliveries: keys_are_found_per_channel, nested_transactions_undo_or_keep, staged_replies_are_listed_taken_and_renumbered);
            contracts!(@area $fresh, $available; rules: channel_numbers_are_stable, a_version_taken_on_trust_is_the_stored_one, rules_read_back_as_stored, the_oldest_writer_is_read_and_raised, processes_are_noted_renewed_pruned_and_forgotten);
            contracts!(@area $fresh, $available; finalize: history_takes_a_delivery_once, unfinalized_are_those_with_every_chunk_delivered, deliveries_count_and_finalize, channel_counters_add_up, statements_are_described_and_run, a_finalization_without_its_delivery_is_refused, finished_replies_are_counted_per_minute_as_they_finish);
            contracts!(@area $fresh, $available; operator: dead_letters_are_listed_and_acknowledged, cancels_remove_chunks, operator_lookups_match_row_and_uid, uncertain_chunks_are_asked_about_once, an_unasked_part_carries_the_platform_id_before_it, purges_spare_the_newest_and_the_unfinished, idle_lanes_are_forgotten);
            contracts!(@area $fresh, $available; reads: health_counts_unfinished_rows, deliveries_are_viewed_listed_and_reported, dead_letters_are_counted_as_they_come_and_go, finished_replies_are_counted_by_time);
            contracts!(@area $fresh, $available; batches: batched_reads_agree_with_one_at_a_time, batched_writes_leave_the_rows_one_at_a_time_leaves, advancing_lanes_in_one_go_leaves_what_the_rules_leave);
        }
    };
    (@area $fresh:expr, $available:expr; $area:ident: $($contract:ident),* $(,)?) => {
        mod $area {
            $(
                #[test]
                fn $contract() {
                    if $available {
                        crate::contracts::$area::$contract($fresh);
                    }
                }
            )*
        }
    };
}

contracts!(sqlite, |options| crate::Outbox::open_in_memory(options)
    .unwrap());

#[cfg(feature = "postgres")]
contracts!(
    postgres,
    |options| {
        let url = crate::store::test_server::fresh_schema_url().expect("the test server");
        crate::Outbox::connect(&url, options).unwrap()
    },
    crate::store::test_server::server_url().is_some()
);
