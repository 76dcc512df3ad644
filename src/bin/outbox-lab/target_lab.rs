//! What the harnesses do with an outbox's place beyond opening it: read its history,
//! make and drop a fresh schema, end its connections.

use std::collections::HashMap;

use crate::CliResult;
use crate::target::Target;

impl Target {
    /// The value that names this target again (`--db`, `OUTBOX_DB`).
    pub fn as_arg(&self) -> &std::ffi::OsStr {
        match self {
            Target::File(path) => path.as_os_str(),
            Target::Postgres(url) => url.as_ref(),
        }
    }

    /// The crate's history as stored: delivery id → (content, chunk count).
    pub fn history(&self) -> CliResult<HashMap<String, (String, u32)>> {
        match self {
            Target::File(path) => crate::sim::history(path),
            Target::Postgres(url) => pg::history(url),
        }
    }

    /// A new, empty schema `name` in this database, as a target of its own (PostgreSQL
    /// only: a harness's fresh outbox beside whatever else the database holds), its
    /// sessions with `settings` too (`-c synchronous_commit=on`) and named
    /// `application` if given.
    pub fn fresh_schema(
        &self,
        name: &str,
        settings: &str,
        application: Option<&str>,
    ) -> CliResult<Target> {
        match self {
            Target::File(_) => Err("a fresh schema needs a PostgreSQL --db".into()),
            Target::Postgres(url) => Ok(Target::Postgres(pg::fresh_schema(
                url,
                name,
                settings,
                application,
            )?)),
        }
    }

    /// Ends, from the server's side, every connection whose `application_name` is
    /// `application` (PostgreSQL only); how many there were.
    pub fn terminate_connections(&self, application: &str) -> CliResult<u64> {
        match self {
            Target::File(_) => Err("connections to end need a PostgreSQL --db".into()),
            Target::Postgres(url) => pg::terminate(url, application),
        }
    }

    /// Removes the schema a [`fresh_schema`](Self::fresh_schema) made.
    pub fn drop_schema(&self, name: &str) -> CliResult<()> {
        match self {
            Target::File(_) => Ok(()),
            Target::Postgres(url) => pg::drop_schema(url, name),
        }
    }
}

#[cfg(feature = "postgres")]
mod pg {
    use super::*;

    fn client(url: &str) -> CliResult<postgres::Client> {
        Ok(postgres::Client::connect(url, postgres::NoTls)?)
    }

    pub fn history(url: &str) -> CliResult<HashMap<String, (String, u32)>> {
        let rows = client(url)?.query(
            "SELECT delivery_id, content, chunk_count FROM outbound_messages",
            &[],
        )?;
        Ok(rows
            .iter()
            .map(|r| {
                let count: i64 = r.get(2);
                (r.get(0), (r.get(1), count as u32))
            })
            .collect())
    }

    /// Only names the harnesses make: letters, digits and `_`.
    fn checked(name: &str) -> CliResult<&str> {
        if name.is_empty() || !name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
            return Err(format!("{name:?} is not a schema name this tool makes").into());
        }
        Ok(name)
    }

    pub fn fresh_schema(
        url: &str,
        name: &str,
        settings: &str,
        application: Option<&str>,
    ) -> CliResult<String> {
        let name = checked(name)?;
        client(url)?.batch_execute(&format!("CREATE SCHEMA {name}"))?;
        let options = format!("-c search_path={name} {settings}");
        let options = options.trim_end();
        // As the URL is written: its parameters, or key-value pairs.
        Ok(if url.contains("://") {
            let sep = if url.contains('?') { '&' } else { '?' };
            let mut out = format!(
                "{url}{sep}options={}",
                options.replace(' ', "%20").replace('=', "%3D")
            );
            if let Some(application) = application {
                out.push_str(&format!("&application_name={application}"));
            }
            out
        } else {
            let mut out = format!("{url} options='{options}'");
            if let Some(application) = application {
                out.push_str(&format!(" application_name={application}"));
            }
            out
        })
    }

    pub fn terminate(url: &str, application: &str) -> CliResult<u64> {
        let ended = client(url)?.query(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity
             WHERE application_name = $1 AND pid <> pg_backend_pid()",
            &[&application],
        )?;
        Ok(ended.len() as u64)
    }

    pub fn drop_schema(url: &str, name: &str) -> CliResult<()> {
        let name = checked(name)?;
        client(url)?.batch_execute(&format!("DROP SCHEMA IF EXISTS {name} CASCADE"))?;
        Ok(())
    }
}

#[cfg(not(feature = "postgres"))]
mod pg {
    use super::*;
    use crate::target::NO_POSTGRES;

    pub fn history(_: &str) -> CliResult<HashMap<String, (String, u32)>> {
        Err(NO_POSTGRES.into())
    }

    pub fn fresh_schema(_: &str, _: &str, _: &str, _: Option<&str>) -> CliResult<String> {
        Err(NO_POSTGRES.into())
    }

    pub fn drop_schema(_: &str, _: &str) -> CliResult<()> {
        Err(NO_POSTGRES.into())
    }

    pub fn terminate(_: &str, _: &str) -> CliResult<u64> {
        Err(NO_POSTGRES.into())
    }
}
