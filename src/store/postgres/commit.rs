//! The commit protocol: a commit whose answer was lost is looked up on the server it
//! ran on, and the counts of finished replies ride with the `COMMIT`.

use std::time::Duration;

use super::client;
use super::client::simple_column;
use super::error::connection_lost;
use super::listen;
use super::pipeline::{owned, requests_of, unasked, values_of};
use super::pool::{PgStore, ServerIdentity};
use super::tx::PgTx;
use crate::error::{Error, Result};
use crate::store::connections::Announce;

/// The id of the transaction, if it wrote anything.
const TXID_SQL: &str = "SELECT txid_current_if_assigned()";

/// Why a commit did not end well.
enum LostCommit {
    /// The server refused it, or the transaction failed before it: nothing happened.
    Failed(Error),
    /// The connection was lost with the commit under way; `xid` (if the transaction
    /// wrote anything) tells the server's log whether it happened.
    Lost {
        xid: Option<i64>,
        message: String,
        /// The server the transaction ran on: the only one that can tell.
        server: ServerIdentity,
    },
}

impl PgStore {
    /// Commits `tx` (see [`PgTx::commit_or_lose`]). When the connection is lost during
    /// the commit, asks the same server (and timeline) on another connection whether
    /// the transaction committed, for up to `patience`: a commit that happened is a
    /// success, one that did not is [`Error::Connection`] (nothing happened, a retry is
    /// safe); a server that stays out of reach, or another one in its place (a
    /// promoted standby), makes it [`Error::CommitUnknown`].
    pub(crate) fn commit(
        &self,
        tx: PgTx<'_>,
        announce: Announce,
        patience: Duration,
    ) -> Result<()> {
        let announce = match announce {
            Announce::Yes => true,
            Announce::IfMadeDue => tx.made_due.get(),
            Announce::No => false,
        };
        let (xid, message, server) = match tx.commit_or_lose(announce) {
            Ok(()) => return Ok(()),
            Err(LostCommit::Failed(e)) => return Err(e),
            Err(LostCommit::Lost {
                xid: None,
                message,
                server,
            }) => {
                // It wrote nothing: there was nothing to lose.
                return Err(self.lost(&server, message));
            }
            Err(LostCommit::Lost {
                xid: Some(xid),
                message,
                server,
            }) => (xid, message, server),
        };
        match self.committed(xid, &server, patience) {
            Some(true) => {
                tracing::warn!(xid, error = %message, "the connection was lost while committing; the server says the commit happened");
                Ok(())
            }
            Some(false) => Err(self.lost(
                &server,
                format!("{message} (during the commit, which the server rolled back)"),
            )),
            None => Err(Error::CommitUnknown {
                target: self.answered_by(&server),
                message,
            }),
        }
    }

    /// The connection string's hosts, and the one that answered when it is known:
    /// `postgres://a:5432,b:5432/chat (answered by 10.0.0.2:5432)`.
    pub(crate) fn answered_by(&self, server: &ServerIdentity) -> String {
        match &server.address {
            Some(address) => format!("{} (answered by {address})", self.target),
            None => self.target.clone(),
        }
    }

    fn lost(&self, server: &ServerIdentity, message: String) -> Error {
        Error::Connection {
            target: self.answered_by(server),
            message,
        }
    }

    /// Whether transaction `xid`, which ran on `origin`, committed (`None`: nobody
    /// can tell within `patience`). Only `origin` is asked: another server (a standby
    /// promoted meanwhile) knows nothing of it, and may have given its id to a
    /// transaction of its own. A transaction the server still runs (its backend has not
    /// yet noticed the lost connection) is asked about again.
    fn committed(&self, xid: i64, origin: &ServerIdentity, patience: Duration) -> Option<bool> {
        let give_up = std::time::Instant::now() + patience;
        let mut pause = Duration::from_millis(5);
        loop {
            let status = self.connection().and_then(|mut conn| {
                // (The pool checks a connection idle for a while when it hands it out,
                // so this one still reaches the server it noted.)
                if !conn.server.answers_for(origin)
                    && !crate::sabotage::planted("lost_commit_asked_anywhere")
                {
                    return Ok(Err(conn.server.may_answer_for(origin)));
                }
                Ok(Ok(conn
                    .client
                    // (a simple query: a transaction pooler passes it whole)
                    .simple_query(&format!("SELECT txid_status({xid})"))
                    .map(|answer| {
                        simple_column(&answer, 0).map(str::to_owned)
                    })?))
            });
            match status.as_ref().map(|s| s.as_ref().map(|s| s.as_deref())) {
                Ok(Ok(Some("committed"))) => return Some(true),
                Ok(Ok(Some("aborted"))) => return Some(false),
                // Too old to be known (cannot be ours), or an unknown word.
                Ok(Ok(None)) => return None,
                // Another server, that will never be the one it ran on.
                Ok(Err(false)) => {
                    tracing::warn!(
                        xid,
                        "a commit's answer was lost and another server answers now (a failover?); it cannot tell whether the commit happened"
                    );
                    return None;
                }
                Ok(Ok(Some(_))) | Ok(Err(true)) | Err(_) => {}
            }
            if std::time::Instant::now() + pause > give_up {
                return None;
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(250));
        }
    }
}

impl PgTx<'_> {
    /// Commits the transaction; with `announce`, its commit also wakes the idle
    /// dispatchers of every process listening on this outbox (see [`listen`]), in the
    /// same round trip. The transaction's id is read first, so that a commit whose
    /// answer is lost can be looked up ([`PgStore::commit`]).
    fn commit_or_lose(self, announce: bool) -> std::result::Result<(), LostCommit> {
        if self.unsent()
            && self.deferred.borrow().len() == self.opening
            && !announce
            && self.assumed_rules.get().is_none()
        {
            // Nothing was sent, nor kept back but the `BEGIN`, nor taken on trust that
            // its answer must confirm: there is nothing to commit.
            self.open.set(false);
            return Ok(());
        }
        // Known from a write that returned it, else read now, with whatever was kept
        // back: a statement of those that failed has made the COMMIT a rollback.
        let xid = match self.xid.get() {
            Some(xid) => Some(xid),
            None => match self.query_one(TXID_SQL, &[]) {
                Ok(row) => row.get::<_, Option<i64>>(0),
                Err(e) => return Err(LostCommit::Failed(e)),
            },
        };
        self.open.set(false);
        let mut minutes = self.activity.take();
        minutes.sort_by_key(|m| m.bucket);
        for minute in crate::store::ActivityRow::merged(minutes) {
            self.defer(
                ACTIVITY_SQL,
                vec![
                    owned(minute.bucket),
                    owned(minute.delivered),
                    owned(minute.failed),
                    owned(minute.latency_sum_ms),
                    owned(minute.latency_max_ms),
                ],
                None,
            )
            .map_err(LostCommit::Failed)?;
        }
        let sql = if announce {
            listen::COMMIT_ANNOUNCED
        } else {
            "COMMIT"
        };
        // What was kept back (writes whose answers the rules do not read) rides with
        // the COMMIT: if one of them fails, the COMMIT is a rollback.
        let deferred = self.deferred.take();
        let values = values_of(&deferred);
        let mut requests = requests_of(&deferred, &values);
        requests.push(client::Request {
            sql: client::Sql::Simple(sql),
            want: client::Want::Rows,
        });
        let server = self.conn.borrow().server.clone();
        let lost = |e: &postgres::Error| LostCommit::Lost {
            xid,
            message: e.to_string(),
            server: server.clone(),
        };
        let before = self.time.local_ms();
        let mut answers = match self.conn.borrow_mut().client.pipeline(&requests) {
            Ok(answers) => answers,
            Err(e) if connection_lost(&e) => return Err(lost(&e)),
            Err(e) => return Err(LostCommit::Failed(e.into())),
        };
        let after = self.time.local_ms();
        let commit = answers.pop();
        let mut failed = None;
        for (d, answer) in deferred.iter().zip(answers) {
            match answer {
                Err(e) if connection_lost(&e) => return Err(lost(&e)),
                Err(e) => failed = failed.or(Some(d.error(e))),
                Ok(answer) => {
                    if let Err(e) = self.settle(d, answer, before, after) {
                        failed = failed.or(Some(e));
                    }
                }
            }
        }
        let mut conn = self.conn.borrow_mut();
        match commit {
            Some(Ok(_)) if failed.is_none() => Ok(()),
            // The server refused the commit (a serialization failure, say), or a
            // statement sent with it failed: it did not happen. (A backend ended
            // while it commits answers with an error too, `57P01`, when the commit
            // may well have happened: that is a lost one.)
            Some(Err(e)) if connection_lost(&e) => Err(lost(&e)),
            commit => {
                // If the notification failed, COMMIT never ran: end the transaction
                // (after a refused COMMIT there is none left, and this does nothing).
                let _ = conn.client.batch_execute("ROLLBACK");
                let refused = match commit {
                    Some(Err(e)) => Some(Error::from(e)),
                    _ => None,
                };
                Err(LostCommit::Failed(
                    failed.or(refused).unwrap_or_else(|| unasked(None)),
                ))
            }
        }
    }
}

/// Adds to a minute's count of finished replies (see `PgTx::commit_or_lose`).
const ACTIVITY_SQL: &str = "INSERT INTO outbound_activity AS a
         (minute, shard, delivered, failed, latency_sum_ms, latency_max_ms)
     VALUES ($1, pg_backend_pid() % 16, $2, $3, $4, $5)
     ON CONFLICT (minute, shard) DO UPDATE
     SET delivered = a.delivered + $2, failed = a.failed + $3,
         latency_sum_ms = a.latency_sum_ms + $4,
         latency_max_ms = greatest(a.latency_max_ms, $5)";
