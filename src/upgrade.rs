//! What a rolling upgrade asks of an outbox: the schema version this build writes, and
//! the contract step that stops older builds' writes once none is live (see
//! docs/OPERATING.md "Upgrades"). Above the registry of processes it reads.

use crate::error::Result;
use crate::outbox::Outbox;
use crate::registry::{ContractStep, PROCESS_LEASE, Process};
use crate::store::release;

impl Outbox {
    /// The schema version this build writes on this outbox's store (SQLite and
    /// PostgreSQL count their own).
    pub fn schema_version(&self) -> i64 {
        self.store().schema_version()
    }

    /// Takes the contract step this build's schema is due, if any: the schema stops
    /// accepting builds older than [`writable_from`](ContractStep::Applied) (what its
    /// migrations dropped the older builds' way for). It waits while a process of such
    /// a build is live (registered and seen within [`PROCESS_LEASE`]) unless `force`,
    /// which stops those processes' writes; builds from before the registry do not
    /// register, so nothing is seen of them. No process takes it by opening the
    /// outbox: `outbox migrate` takes it, or says who it waits for.
    ///
    /// # Errors
    ///
    /// Database errors; [`Error::ReadOnly`](crate::Error::ReadOnly) through a
    /// read-only handle.
    pub fn contract_step(&self, force: bool) -> Result<ContractStep> {
        let wanted = if crate::sabotage::planted("contract_step") {
            // A test's build whose schema is a contract step (see `sabotage`).
            self.store().schema_version()
        } else {
            self.store().writable_from()
        };
        if self.read(|tx| tx.writable_from())? >= wanted {
            return Ok(ContractStep::NotDue);
        }
        let since = self.options().now_ms() - PROCESS_LEASE.as_millis() as i64;
        let migrated_by = release(self.store().schema_version());
        self.change_rules_with(|tx| {
            let writable_from = tx.writable_from()?;
            if writable_from >= wanted {
                return Ok(ContractStep::NotDue);
            }
            let older: Vec<Process> = tx
                .processes(since)?
                .into_iter()
                .filter(|p| p.schema_level < wanted)
                .map(Process::from)
                .collect();
            if !older.is_empty() && !force {
                return Ok(ContractStep::Waiting {
                    writable_from: wanted,
                    older,
                });
            }
            tx.set_writable_from(wanted, &migrated_by)?;
            Ok(ContractStep::Applied {
                writable_from: wanted,
                stopped: older,
            })
        })
    }
}
