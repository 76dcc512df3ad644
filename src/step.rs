//! One step of a dispatcher: record the outcomes of its finished sends and claim its
//! next ones in one transaction.

use crate::claim::{self, Claim, Isolation};
use crate::error::Result;
use crate::outbox::Outbox;
use crate::outcome::{self, Outcome};
use crate::rules::Stored;
use crate::state::{DeadLetter, Recorded};
use crate::store::StoreTx;
use crate::store::connections::Announce;

/// What one record-and-claim step of a dispatcher did.
pub(crate) struct Step {
    /// The result of each outcome, in order.
    pub recorded: Vec<Result<Recorded>>,
    /// The chunks claimed.
    pub claims: Vec<Claim>,
    /// Every delivery the step made a dead letter: by an outcome, or by the claim (a
    /// chunk out of attempts or age, an expired lease on its last attempt, a row that
    /// cannot be read).
    pub dead_letters: Vec<DeadLetter>,
    /// Whether the claim stopped at a suspect chunk it could not send alone: the
    /// claimer should wait for its sends in flight to be recorded, then claim again.
    pub held_back: bool,
}

impl Outbox {
    /// Records the outcomes of a dispatcher's finished sends and claims its next ones in
    /// one transaction, so a known outcome is durable before the next send starts and
    /// one commit serves both. `limit` 0 only records.
    pub(crate) fn record_and_claim(
        &self,
        outcomes: &[(Claim, Outcome)],
        channels: &[&str],
        limit: usize,
        isolation: Isolation,
    ) -> Result<Step> {
        // `limit` is a dispatcher's validated batch size (or 0), so within range.
        let step = |tx: &dyn StoreTx, rules: &Stored| {
            let now = self.options().now_ms();
            let recorded =
                outcome::record_in(tx, rules, outcomes.iter().map(|(c, o)| (c, o.clone())), now)?;
            let (claims, held_back) = if limit > 0 {
                claim::claim_in(tx, self, rules, Some(channels), limit, isolation, now)?
            } else {
                (Vec::new(), false)
            };
            let dead_letters = DeadLetter::taken(tx)?;
            Ok(Step {
                recorded,
                claims,
                dead_letters,
                held_back,
            })
        };
        if outcomes.is_empty() {
            self.write(step)
        } else {
            self.write_and_wake(Announce::No, step)
        }
    }
}
