//! The processes that write the file, on SQLite.

use rusqlite::params;

use super::tx::Tx;
use crate::error::Result;
use crate::store::{ProcessRow, ProcessStore, sqlite_param};

impl ProcessStore for Tx<'_> {
    fn note_process(&self, row: &ProcessRow, gone_before: i64) -> Result<()> {
        self.prepare_cached(crate::store::prune_processes_sql!(sqlite_param))?
            .execute([gone_before])?;
        self.prepare_cached(crate::store::note_process_sql!(sqlite_param))?
            .execute(params![
                row.id,
                row.schema_level,
                row.release,
                row.program,
                row.host,
                row.pid,
                row.started_at,
                row.seen_at
            ])?;
        Ok(())
    }

    fn forget_process(&self, id: &str) -> Result<()> {
        self.prepare_cached(crate::store::forget_process_sql!(sqlite_param))?
            .execute([id])?;
        Ok(())
    }

    fn processes(&self, since: i64) -> Result<Vec<ProcessRow>> {
        let mut statement = self.prepare_cached(crate::store::processes_sql!(sqlite_param))?;
        let rows = statement.query_map([since], |r| {
            Ok(ProcessRow {
                id: r.get(0)?,
                schema_level: r.get(1)?,
                release: r.get(2)?,
                program: r.get(3)?,
                host: r.get(4)?,
                pid: r.get(5)?,
                started_at: r.get(6)?,
                seen_at: r.get(7)?,
            })
        })?;
        Ok(rows.collect::<rusqlite::Result<_>>()?)
    }
}
