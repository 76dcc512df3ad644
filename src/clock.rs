//! Time, injectable so tests move it instead of sleeping.

use std::fmt::Debug;
use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::Duration;

use chrono::{DateTime, Utc};

/// A source of wall-clock time in milliseconds since the Unix epoch.
///
/// The outbox reads every timestamp it stores (enqueue time, due times, lease expiry)
/// from its clock. Production code uses [`SystemClock`]; tests use [`ManualClock`] and
/// advance it explicitly.
pub trait Clock: Send + Sync + Debug {
    /// Milliseconds since the Unix epoch.
    fn now_ms(&self) -> i64;

    /// Whether this clock tells the time of day as its host sees it, moving by itself
    /// (the default). On a store shared by several hosts (PostgreSQL) such a clock is
    /// corrected by the server's, so that hosts whose clocks disagree act on one time.
    /// A clock that moves only when told to ([`ManualClock`]) answers `false`: its
    /// reading *is* the outbox's time, as a test sets it.
    fn is_wall_clock(&self) -> bool {
        true
    }
}

/// The system's wall clock.
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now_ms(&self) -> i64 {
        Utc::now().timestamp_millis()
    }
}

/// A clock that only moves when told to. Cloning it shares the same time.
///
/// ```
/// use std::time::Duration;
/// use chunked_outbox::clock::{Clock, ManualClock};
///
/// let clock = ManualClock::new(1_000);
/// clock.advance(Duration::from_secs(5));
/// assert_eq!(clock.now_ms(), 6_000);
/// ```
#[derive(Debug, Clone, Default)]
pub struct ManualClock(Arc<AtomicI64>);

impl ManualClock {
    /// A clock standing at `ms` milliseconds since the epoch.
    pub fn new(ms: i64) -> Self {
        ManualClock(Arc::new(AtomicI64::new(ms)))
    }

    /// Moves the clock forward by `by`.
    pub fn advance(&self, by: Duration) {
        self.0.fetch_add(duration_ms(by), Ordering::SeqCst);
    }

    /// Sets the clock to `ms` milliseconds since the epoch.
    pub fn set(&self, ms: i64) {
        self.0.store(ms, Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    fn now_ms(&self) -> i64 {
        self.0.load(Ordering::SeqCst)
    }

    fn is_wall_clock(&self) -> bool {
        false
    }
}

/// The system's clock off by a fixed amount: a host whose clock runs ahead or behind,
/// for trying what a deployment's skewed clocks do.
///
/// ```
/// use std::time::Duration;
/// use chunked_outbox::clock::{Clock, SkewedClock, SystemClock};
///
/// let ahead = SkewedClock::ahead(Duration::from_secs(120));
/// assert!(ahead.now_ms() >= SystemClock.now_ms() + 119_000);
/// ```
#[derive(Debug, Clone, Copy)]
pub struct SkewedClock {
    by_ms: i64,
}

impl SkewedClock {
    /// A clock `by` ahead of the system's.
    pub fn ahead(by: Duration) -> Self {
        SkewedClock {
            by_ms: duration_ms(by),
        }
    }

    /// A clock `by` behind the system's.
    pub fn behind(by: Duration) -> Self {
        SkewedClock {
            by_ms: -duration_ms(by),
        }
    }
}

impl Clock for SkewedClock {
    fn now_ms(&self) -> i64 {
        SystemClock.now_ms().saturating_add(self.by_ms)
    }
}

/// A duration in whole milliseconds, saturating instead of overflowing.
pub(crate) fn duration_ms(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

/// Milliseconds since the epoch as a UTC time. Out-of-range values clamp to the
/// representable range rather than panicking.
pub(crate) fn to_datetime(ms: i64) -> DateTime<Utc> {
    DateTime::from_timestamp_millis(ms).unwrap_or(if ms < 0 {
        DateTime::<Utc>::MIN_UTC
    } else {
        DateTime::<Utc>::MAX_UTC
    })
}

/// The time of a handle on a store shared by several hosts (PostgreSQL): the server's
/// clock, as the handle's own clock carries it forward.
///
/// Every time the rules store or compare (leases, due times, a reply's age, pacing,
/// purge cutoffs) is read from here, so every host acts on one clock whatever its own
/// says: a host 90 s ahead takes over no live lease, one 2 minutes behind dead-letters
/// no fresh reply for its age. A wall clock ([`Clock::is_wall_clock`]) is corrected by
/// the offset to the server's, measured when the handle connects and again at every
/// write (the server's time comes back in the round trip of its `BEGIN`); the offset
/// moves when the new measure differs by more than its error (half the round trip), so
/// an NTP step or a suspended host is followed within one write. A clock that moves only
/// when told to is the outbox's time as given, so tests stay deterministic.
#[derive(Debug)]
#[cfg_attr(not(feature = "postgres"), allow(dead_code))]
pub(crate) struct ServerTime {
    local: Arc<dyn Clock>,
    /// Server time minus the handle's clock, in milliseconds (0 for a clock not
    /// corrected).
    offset: AtomicI64,
    /// The latest time handed out (of a wall clock).
    latest: AtomicI64,
}

/// How far back a corrected wall clock may move and be held where it was instead: a
/// new reading of the offset is off by its error (half a round trip, and a millisecond
/// of rounding), which would move the time back now and then, and a due time this
/// handle just wrote would not be due to its own next claim. A step back beyond this
/// (a clock set back) is followed.
const HELD_BACK_MS: i64 = 1_000;

#[cfg_attr(not(feature = "postgres"), allow(dead_code))]
impl ServerTime {
    pub(crate) fn new(local: Arc<dyn Clock>) -> Self {
        ServerTime {
            local,
            offset: AtomicI64::new(0),
            latest: AtomicI64::new(i64::MIN),
        }
    }

    /// The handle's own clock, for bracketing a reading of the server's.
    pub(crate) fn local_ms(&self) -> i64 {
        self.local.now_ms()
    }

    /// The server's clock read `server` while this handle's read from `before` to
    /// `after` (the round trip that carried the reading).
    pub(crate) fn observe(&self, server: i64, before: i64, after: i64) {
        if !self.local.is_wall_clock() {
            return;
        }
        let half = (after - before).max(0) / 2;
        let sample = server - (before + half);
        if (sample - self.offset.load(Ordering::Acquire)).abs() > half + 1 {
            self.offset.store(sample, Ordering::Release);
        }
    }
}

impl Clock for ServerTime {
    fn now_ms(&self) -> i64 {
        let now = self
            .local
            .now_ms()
            .saturating_add(self.offset.load(Ordering::Acquire));
        if !self.local.is_wall_clock() {
            return now;
        }
        let latest = self.latest.fetch_max(now, Ordering::AcqRel);
        if now >= latest {
            now
        } else if latest - now <= HELD_BACK_MS {
            latest
        } else {
            self.latest.store(now, Ordering::Release);
            now
        }
    }

    fn is_wall_clock(&self) -> bool {
        self.local.is_wall_clock()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A wall clock the test moves.
    #[derive(Debug)]
    struct Wall(ManualClock);
    impl Clock for Wall {
        fn now_ms(&self) -> i64 {
            self.0.now_ms()
        }
    }

    #[test]
    fn a_wall_clock_carries_the_servers_time_and_follows_its_steps() {
        let host = ManualClock::new(1_000_000);
        let time = ServerTime::new(Arc::new(Wall(host.clone())));
        // The server is 90 s ahead; the reading took 10 ms.
        time.observe(1_090_005, 1_000_000, 1_000_010);
        assert_eq!(time.now_ms(), 1_090_000);
        host.advance(Duration::from_millis(500));
        assert_eq!(
            time.now_ms(),
            1_090_500,
            "the host's clock carries it forward"
        );
        // A reading within its own error moves nothing.
        time.observe(1_090_508, 1_000_500, 1_000_510);
        assert_eq!(time.now_ms(), 1_090_500);
        // The host's clock stepped back 30 s (NTP): the next reading follows.
        host.set(970_510);
        time.observe(1_090_515, 970_510, 970_520);
        assert_eq!(time.now_ms(), 1_090_510);
    }

    #[test]
    fn the_offset_moves_only_beyond_the_readings_error() {
        let time = ServerTime::new(Arc::new(Wall(ManualClock::new(0))));
        // Readings that took 10 ms: each is off by up to 5 ms, plus 1 for rounding.
        time.observe(1_005, 0, 10);
        assert_eq!(time.now_ms(), 1_000);
        time.observe(1_011, 0, 10);
        assert_eq!(time.now_ms(), 1_000, "6 ms off is within the error");
        time.observe(1_012, 0, 10);
        assert_eq!(time.now_ms(), 1_007, "7 ms off is beyond it");
    }

    /// Found: a claim right after an enqueue on one handle missed the reply now and
    /// then, its due time a millisecond or two after the claim's time (a new reading
    /// of the offset had moved the time back by its error).
    #[test]
    fn a_corrected_clock_never_moves_back_by_a_readings_error() {
        let host = ManualClock::new(0);
        let time = ServerTime::new(Arc::new(Wall(host.clone())));
        time.observe(1_000, 0, 0);
        assert_eq!(time.now_ms(), 1_000);
        // A reading 2 ms behind the last (beyond its error: it moves the offset).
        time.observe(998, 0, 0);
        assert_eq!(time.now_ms(), 1_000, "held where it was");
        host.advance(Duration::from_millis(1));
        assert_eq!(time.now_ms(), 1_000);
        host.advance(Duration::from_millis(2));
        assert_eq!(time.now_ms(), 1_001, "and on from there");
        // A step back beyond a second is the clock set back: followed.
        time.observe(-2_000, 3, 3);
        assert_eq!(time.now_ms(), -2_000);
        host.advance(Duration::from_millis(1));
        assert_eq!(time.now_ms(), -1_999);
    }

    #[test]
    fn a_skewed_clock_runs_ahead_or_behind_the_systems() {
        let by = Duration::from_secs(120);
        let before = SystemClock.now_ms();
        let ahead = SkewedClock::ahead(by).now_ms();
        let behind = SkewedClock::behind(by).now_ms();
        let after = SystemClock.now_ms();
        assert!(
            (before + 120_000..=after + 120_000).contains(&ahead),
            "{ahead}"
        );
        assert!(
            (before - 120_000..=after - 120_000).contains(&behind),
            "{behind}"
        );
        assert!(SkewedClock::behind(by).is_wall_clock());
    }

    #[test]
    fn a_manual_clock_is_the_time_as_given() {
        let clock = ManualClock::new(5_000);
        let time = ServerTime::new(Arc::new(clock.clone()));
        time.observe(1_090_000, 5_000, 5_010);
        assert_eq!(time.now_ms(), 5_000);
        clock.advance(Duration::from_secs(1));
        assert_eq!(time.now_ms(), 6_000);
        assert!(!time.is_wall_clock());
    }
}
