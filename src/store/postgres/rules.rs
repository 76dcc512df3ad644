//! The stored rules on PostgreSQL (`outbound_policy`, `outbound_channels`).

use std::collections::HashMap;

use super::tx::PgTx;
use crate::error::Result;
use crate::rules::{self, ChannelPolicy, FileColumns, FileRules, Rules, Stored};
use crate::store::RuleStore;

const BUMP: &str = "UPDATE outbound_policy SET version = version + 1 WHERE id = 1";

impl RuleStore for PgTx<'_> {
    fn rules_version(&self) -> Result<i64> {
        if let Some(version) = self.version_read_at_begin()? {
            return Ok(version);
        }
        Ok(self
            .query_one("SELECT version FROM outbound_policy WHERE id = 1", &[])?
            .try_get(0)?)
    }

    /// Taken on trust while the `BEGIN` that reads it under the rules' lock is still
    /// kept back: it is confirmed in the transaction's first round trip.
    fn rules_version_or(&self, cached: i64) -> Result<i64> {
        if self.assume_rules_version(cached) {
            return Ok(cached);
        }
        self.rules_version()
    }

    fn load_rules(&self) -> Result<Stored> {
        let r = self.query_one(
            "SELECT version, lane_order, lane_failure, retry, replay, lane_interval_ms,
                    channel_interval_us, finalize_sql
             FROM outbound_policy WHERE id = 1",
            &[],
        )?;
        let version: i64 = r.try_get(0)?;
        let (mut policy, declared) = FileColumns {
            lane_order: r.try_get(1)?,
            lane_failure: r.try_get(2)?,
            retry: r.try_get(3)?,
            replay: r.try_get(4)?,
            lane_ms: r.try_get(5)?,
            channel_us: r.try_get(6)?,
        }
        .policy()?;
        let finalize_sql = r.try_get(7)?;
        let mut channel_ids = HashMap::new();
        for r in self.query(
            "SELECT id, name, replay, lane_interval_ms, channel_interval_us, retry
             FROM outbound_channels",
            &[],
        )? {
            let name: String = r.try_get(1)?;
            channel_ids.insert(name.clone(), r.try_get(0)?);
            if let Some(replay) = r.try_get::<_, Option<&str>>(2)? {
                let of_channel = rules::channel_from_columns(
                    replay,
                    r.try_get(3)?,
                    r.try_get(4)?,
                    r.try_get(5)?,
                )?;
                policy.channels.insert(name, of_channel);
            }
        }
        Ok(Stored {
            version,
            policy,
            finalize_sql,
            declared,
            channel_ids,
        })
    }

    fn store_file_rules(&self, policy: &Rules, which: FileRules) -> Result<()> {
        let d = &policy.default_channel;
        self.execute(
            "UPDATE outbound_policy
             SET version = version + 1,
                 lane_order = CASE WHEN $1 THEN $2 ELSE lane_order END,
                 lane_failure = CASE WHEN $3 THEN $4 ELSE lane_failure END,
                 retry = CASE WHEN $5 THEN $6 ELSE retry END,
                 replay = CASE WHEN $7 THEN $8 ELSE replay END,
                 lane_interval_ms = CASE WHEN $7 THEN $9 ELSE lane_interval_ms END,
                 channel_interval_us = CASE WHEN $7 THEN $10 ELSE channel_interval_us END
             WHERE id = 1",
            &[
                &which.lane_order,
                &rules::lane_order_str(policy.lane_order),
                &which.lane_failure,
                &rules::lane_failure_str(policy.lane_failure),
                &which.retry,
                &rules::retry_to_json(&policy.retry),
                &which.default_channel,
                &rules::replay_str(d.replay),
                &rules::stored_ms(d.lane_interval),
                &rules::stored_us(d.channel_interval),
            ],
        )?;
        Ok(())
    }

    fn store_channel_rules(&self, channel: &str, of: Option<&ChannelPolicy>) -> Result<()> {
        self.execute(
            "INSERT INTO outbound_channels (name, replay, lane_interval_ms, channel_interval_us, retry)
             VALUES ($1, $2, $3, $4, $5)
             ON CONFLICT (name) DO UPDATE SET replay = excluded.replay,
                 lane_interval_ms = excluded.lane_interval_ms,
                 channel_interval_us = excluded.channel_interval_us, retry = excluded.retry",
            &[
                &channel,
                &of.map(|r| rules::replay_str(r.replay)),
                &of.map(|r| rules::stored_ms(r.lane_interval)),
                &of.map(|r| rules::stored_us(r.channel_interval)),
                &of.and_then(|r| r.retry.as_ref()).map(rules::retry_to_json),
            ],
        )?;
        self.execute(BUMP, &[])?;
        Ok(())
    }

    fn channel_number(&self, channel: &str) -> Result<i64> {
        if let Some(r) = self.query_opt(
            "SELECT id FROM outbound_channels WHERE name = $1",
            &[&channel],
        )? {
            return Ok(r.try_get(0)?);
        }
        // A registration of the same name under way elsewhere is waited for, and then
        // this one does nothing: the name has the number it got there.
        let inserted = self.query_opt(
            "INSERT INTO outbound_channels (name) VALUES ($1)
             ON CONFLICT (name) DO NOTHING RETURNING id",
            &[&channel],
        )?;
        match inserted {
            Some(r) => {
                // Other handles learn the new channel's number at their next write.
                self.execute(BUMP, &[])?;
                Ok(r.try_get(0)?)
            }
            None => Ok(self
                .query_one(
                    "SELECT id FROM outbound_channels WHERE name = $1",
                    &[&channel],
                )?
                .try_get(0)?),
        }
    }

    fn finalization_statement(&self) -> Result<Option<String>> {
        Ok(self
            .query_one("SELECT finalize_sql FROM outbound_policy WHERE id = 1", &[])?
            .try_get(0)?)
    }

    fn store_finalization_statement(&self, sql: Option<&str>) -> Result<()> {
        self.execute(
            "UPDATE outbound_policy SET version = version + 1, finalize_sql = $1 WHERE id = 1",
            &[&sql],
        )?;
        Ok(())
    }

    fn writable_from(&self) -> Result<i64> {
        Ok(self
            .query_one(
                "SELECT writable_from FROM outbound_policy WHERE id = 1",
                &[],
            )?
            .try_get(0)?)
    }

    fn set_writable_from(&self, writable_from: i64, migrated_by: &str) -> Result<()> {
        self.execute(
            "UPDATE outbound_policy SET writable_from = $1 WHERE id = 1",
            &[&writable_from],
        )?;
        self.execute("UPDATE outbound_meta SET migrated_by = $1", &[&migrated_by])?;
        Ok(())
    }
}
