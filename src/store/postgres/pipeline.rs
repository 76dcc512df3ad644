//! The transaction's pipeline: statements whose answers the rules do not read are kept
//! back and sent with the next one that must be answered, in one round trip.

use std::sync::Arc;

use postgres::Statement;
use postgres::types::{ToSql, Type};

use super::begin::STATE_SQL;
use super::client;
use crate::error::Error;

/// The parameters of a statement.
pub(crate) type Params<'a> = &'a [&'a (dyn ToSql + Sync)];

/// How a statement of the crate runs on a connection (see [`PgConn::types`]).
pub(super) enum Prepared {
    Named(Statement),
    Unnamed(Arc<[Type]>),
}

/// `params` with the types the statement takes.
pub(super) fn typed<'p>(
    params: &[&'p (dyn ToSql + Sync)],
    types: &[Type],
) -> Vec<(&'p (dyn ToSql + Sync), Type)> {
    params.iter().copied().zip(types.iter().cloned()).collect()
}

/// An answer of another kind than the one asked for: [`client`] answers each request
/// with the kind it names.
pub(super) fn unasked(answer: Option<client::Answer>) -> ! {
    let kind = answer.map(|a| std::mem::discriminant(&a));
    unreachable!("the client answered a statement with another kind of answer ({kind:?})")
}

/// A value of a statement kept back (see [`PgTx::defer`]).
pub(crate) fn owned<T: ToSql + Sync + Send + 'static>(value: T) -> Box<dyn ToSql + Sync + Send> {
    Box::new(value)
}

/// The values of each statement kept back, as the client takes them.
pub(super) fn values_of<'d>(deferred: &'d [Deferred<'_>]) -> Vec<Vec<&'d (dyn ToSql + Sync)>> {
    deferred
        .iter()
        .map(|d| match d {
            Deferred::Begin { .. } | Deferred::State(_) => Vec::new(),
            Deferred::Statement { values, .. } => {
                values.iter().map(|v| &**v as &(dyn ToSql + Sync)).collect()
            }
        })
        .collect()
}

/// The requests that send what was kept back (`values`: [`values_of`] it).
pub(super) fn requests_of<'d>(
    deferred: &'d [Deferred<'_>],
    values: &'d [Vec<&'d (dyn ToSql + Sync)>],
) -> Vec<client::Request<'d>> {
    deferred
        .iter()
        .zip(values)
        .map(|(d, values)| client::Request {
            sql: match d {
                Deferred::Begin { sql, .. } => client::Sql::Simple(sql),
                Deferred::State(Prepared::Named(stmt))
                | Deferred::Statement {
                    prepared: Prepared::Named(stmt),
                    ..
                } => client::Sql::Prepared(stmt, values.clone()),
                Deferred::State(Prepared::Unnamed(_)) => {
                    client::Sql::Unnamed(STATE_SQL, Vec::new())
                }
                Deferred::Statement {
                    sql,
                    prepared: Prepared::Unnamed(types),
                    ..
                } => client::Sql::Unnamed(sql, typed(values, types)),
            },
            want: client::Want::Rows,
        })
        .collect()
}

/// What a transaction keeps back until its next round trip.
pub(super) enum Deferred<'c> {
    /// Its `BEGIN` (see [`Begins`]); with `state`, a simple query that answers what
    /// [`STATE_SQL`] reads.
    Begin { sql: &'c str, state: bool },
    /// [`STATE_SQL`], prepared: the end of a write's opening (see [`OPENING_SQL`]).
    State(Prepared),
    /// A statement whose answer the rules do not read; with `xid`, the column of its
    /// row that holds the transaction's id; with `refusal`, the error it stands for
    /// when it fails its own check (see [`CHECK_FAILED`]).
    Statement {
        sql: &'static str,
        prepared: Prepared,
        values: Vec<Box<dyn ToSql + Sync + Send>>,
        xid: Option<usize>,
        refusal: Option<fn() -> Error>,
    },
}

/// How a statement kept back checks what the rules would check in its answer, which
/// they no longer read: it divides by zero when the check fails, so that the server
/// fails it (and the transaction, the `COMMIT` it may ride with included), and the
/// store reports the refusal it stands for ([`Deferred::Statement`]'s `refusal`).
pub(super) const CHECK_FAILED: postgres::error::SqlState =
    postgres::error::SqlState::DIVISION_BY_ZERO;

impl Deferred<'_> {
    /// The error of this statement's answer: its refusal when its check failed.
    pub(super) fn error(&self, e: postgres::Error) -> Error {
        match self {
            Deferred::Statement {
                refusal: Some(refusal),
                ..
            } if e.code() == Some(&CHECK_FAILED) => refusal(),
            _ => e.into(),
        }
    }
}
