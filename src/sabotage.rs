//! Planted faults, one per verdict of the torture and the demo, for the check that each
//! verdict can fail (`tests/sabotage.rs`, run by CI). Compiled only with the feature
//! `sabotage`; even then each fault is off unless the environment variable
//! `OUTBOX_SABOTAGE` names it. A fault sits in the code it breaks, so a refactoring
//! that moves that code moves the fault with it, and the check keeps meaning what it
//! says.

/// The faults, by the verdict that must catch each.
#[cfg(feature = "sabotage")]
pub const FAULTS: &[&str] = &[
    "lost",
    "out_of_order",
    "unexplained_duplicates",
    "missing_finalizations",
    "wrong_finalizations",
    "max_uncertain_per_kill",
    "uncertain_left",
    "unexpected_dead_letters",
];

/// Faults of a store's locks, which a single process never shows: the lane hammer
/// (`tests/hammer.rs`) must catch each.
#[cfg(feature = "sabotage")]
pub const LOCK_FAULTS: &[&str] = &["no_lane_locks", "no_claim_locks"];

/// Faults of settling a possibly-sent part by asking its platform: the decision
/// removed, so that every part is held (`settle_holds`) or sent again blindly
/// (`settle_resends`), whatever the platform answered. The settle tests (`tests/settle.rs`,
/// the adapters' and `tests/platforms_dedupe.rs`) must fail under each.
#[cfg(feature = "sabotage")]
pub const SETTLE_FAULTS: &[&str] = &["settle_holds", "settle_resends"];

/// A fault of the PostgreSQL store under failover: a commit whose answer was lost is
/// looked up on whichever server answers next, as if a promoted standby could tell
/// (`tests/pg_failover.rs` must catch it).
#[cfg(feature = "sabotage")]
pub const FAILOVER_FAULTS: &[&str] = &["lost_commit_asked_anywhere"];

/// A fault of SQLite's dead-letter counts, which its writers keep (schema 12): the
/// torture's verdict `dead_letters_miscounted` must catch it (`tests/sabotage.rs`).
#[cfg(feature = "sabotage")]
pub const COUNT_FAULTS: &[&str] = &["dead_letters_miscounted"];

/// Faults of a rolling upgrade: `contract_step` makes this build's schema a contract
/// step (it accepts no older build), for the tests of what waits for older processes
/// (`tests/upgrade.rs`); `expand_refuses_old_writers` makes the newest migration refuse
/// the builds it should keep writing, which the mixed-version run must catch.
#[cfg(feature = "sabotage")]
pub const UPGRADE_FAULTS: &[&str] = &["contract_step", "expand_refuses_old_writers"];

/// Whether the fault `name` (one of the lists above) is planted in this process.
#[cfg(feature = "sabotage")]
pub fn planted(name: &str) -> bool {
    static CHOSEN: std::sync::OnceLock<Option<String>> = std::sync::OnceLock::new();
    CHOSEN
        .get_or_init(|| std::env::var("OUTBOX_SABOTAGE").ok())
        .as_deref()
        == Some(name)
}

/// Without the feature no fault exists.
#[cfg(not(feature = "sabotage"))]
#[inline(always)]
pub fn planted(_name: &str) -> bool {
    false
}
