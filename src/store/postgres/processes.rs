//! The processes that write the schema, on PostgreSQL.

use super::tx::PgTx;
use crate::error::Result;
use crate::store::{ProcessRow, ProcessStore, pg_param};

impl ProcessStore for PgTx<'_> {
    fn note_process(&self, row: &ProcessRow, gone_before: i64) -> Result<()> {
        self.execute(
            crate::store::prune_processes_sql!(pg_param),
            &[&gone_before],
        )?;
        self.execute(
            crate::store::note_process_sql!(pg_param),
            &[
                &row.id,
                &row.schema_level,
                &row.release,
                &row.program,
                &row.host,
                &row.pid,
                &row.started_at,
                &row.seen_at,
            ],
        )?;
        Ok(())
    }

    fn forget_process(&self, id: &str) -> Result<()> {
        self.execute(crate::store::forget_process_sql!(pg_param), &[&id])?;
        Ok(())
    }

    fn processes(&self, since: i64) -> Result<Vec<ProcessRow>> {
        self.query(crate::store::processes_sql!(pg_param), &[&since])?
            .iter()
            .map(|r| {
                Ok(ProcessRow {
                    id: r.try_get(0)?,
                    schema_level: r.try_get(1)?,
                    release: r.try_get(2)?,
                    program: r.try_get(3)?,
                    host: r.try_get(4)?,
                    pid: r.try_get(5)?,
                    started_at: r.try_get(6)?,
                    seen_at: r.try_get(7)?,
                })
            })
            .collect()
    }
}
