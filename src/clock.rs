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
