//! Chunk and delivery statuses, as stored and as shown.

use std::fmt;

use serde::{Deserialize, Serialize};

macro_rules! status_enum {
    ($(#[$meta:meta])* $name:ident { $($(#[$vmeta:meta])* $variant:ident = $text:literal,)+ }) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
        #[serde(rename_all = "lowercase")]
        #[non_exhaustive]
        pub enum $name {
            $($(#[$vmeta])* $variant,)+
        }

        impl $name {
            /// Every status, in lifecycle order.
            pub const ALL: &'static [$name] = &[$($name::$variant,)+];

            /// The word stored in the database and printed by `Display`.
            pub fn as_str(self) -> &'static str {
                match self {
                    $($name::$variant => $text,)+
                }
            }

            /// The status `as_str` gives this word, if any.
            pub(crate) fn from_word(word: &str) -> Option<Self> {
                match word {
                    $($text => Some($name::$variant),)+
                    _ => None,
                }
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(self.as_str())
            }
        }
    };
}

status_enum! {
    /// Where one chunk stands. See the state machine in the crate docs.
    ChunkStatus {
        /// Not sent yet: waiting to become due, or due now.
        Pending = "pending",
        /// Claimed by a worker whose lease has not been settled.
        Sending = "sending",
        /// A send failed transiently (or was rate limited); due again at `next_attempt_at`.
        Retry = "retry",
        /// Dead letter: a permanent error or no attempts left.
        Failed = "failed",
        /// The platform accepted it.
        Delivered = "delivered",
        /// It may have been sent; held until resolved (see [`ReplayPolicy::Hold`](crate::rules::ReplayPolicy::Hold)).
        Uncertain = "uncertain",
    }
}

status_enum! {
    /// Where one delivery stands, derived from its chunks and its lane.
    DeliveryStatus {
        /// Waiting behind an earlier delivery to the same chat.
        Queued = "queued",
        /// Active in its lane; no chunk delivered yet.
        Pending = "pending",
        /// Some chunks delivered, the rest on their way.
        Partial = "partial",
        /// A chunk may have been sent and waits for a decision.
        Uncertain = "uncertain",
        /// A chunk failed for good: a dead letter.
        Failed = "failed",
        /// Every chunk delivered and the message written to `outbound_messages`.
        Delivered = "delivered",
        /// Withdrawn before any of its chunks started (see
        /// [`Outbox::cancel`](crate::Outbox::cancel)); nothing of it was sent.
        Cancelled = "cancelled",
        /// Every chunk reached its chat, but the application's finalization statement
        /// refused the reply (a constraint or trigger of the application's table); the
        /// view's `finalize_error` says why. It is finalized again by
        /// [`Outbox::recover`](crate::Outbox::recover) and
        /// [`Outbox::finalize_again`](crate::Outbox::finalize_again) once the
        /// application fixed its table.
        Unfinalized = "unfinalized",
    }
}

impl DeliveryStatus {
    /// Whether this delivery still has work ahead of it without operator action.
    pub fn is_in_flight(self) -> bool {
        matches!(
            self,
            DeliveryStatus::Queued | DeliveryStatus::Pending | DeliveryStatus::Partial
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `lane::HEAD_SQL` reads an active or queued delivery as the one range
    /// `'partial'..='queued'` of the status text: that range holds exactly the statuses
    /// in flight, and no other.
    #[test]
    fn the_statuses_in_flight_are_one_range_of_the_text_order() {
        let in_range: Vec<_> = DeliveryStatus::ALL
            .iter()
            .filter(|s| ("partial"..="queued").contains(&s.as_str()))
            .collect();
        let in_flight: Vec<_> = DeliveryStatus::ALL
            .iter()
            .filter(|s| s.is_in_flight())
            .collect();
        assert_eq!(in_range, in_flight);
        assert_eq!(in_flight.len(), 3);
    }

    #[test]
    fn statuses_round_trip_through_text() {
        for s in ChunkStatus::ALL {
            assert_eq!(s.as_str().parse::<ChunkStatus>().unwrap(), *s);
        }
        for s in DeliveryStatus::ALL {
            assert_eq!(s.as_str().parse::<DeliveryStatus>().unwrap(), *s);
        }
        assert!("bogus".parse::<ChunkStatus>().is_err());
    }
}
