//! A connection of the store: tokio-postgres driven by a runtime of its own, as the
//! blocking `postgres` client is, plus what that client cannot do: send several
//! statements before reading their answers ([`Client::pipeline`]).
//!
//! A statement whose answer the rules do not read (a transaction's `BEGIN`, a lock) is
//! kept back by the transaction and sent with the next one that must be answered: one
//! round trip for both. The server runs them in the order sent, so a statement sent
//! after a lock runs once the lock is granted, and after an error every later
//! statement of the transaction fails ("current transaction is aborted").

use std::future::Future;
use std::pin::{Pin, pin};
use std::task::Poll;

use postgres::types::{ToSql, Type};
use postgres::{Error, Row, SimpleQueryMessage, Statement};
use tokio_postgres::tls::NoTlsStream;
use tokio_postgres::{Connection, NoTls, Socket, ToStatement};

#[cfg(test)]
thread_local! {
    /// The round trips this thread's connections made (each [`Client::run`] is one:
    /// a pipeline's requests are written before its first answer is read).
    pub(crate) static ROUND_TRIPS: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// A connection to the server and the runtime that drives it.
pub(crate) struct Client {
    runtime: tokio::runtime::Runtime,
    connection: Pin<Box<Connection<Socket, NoTlsStream>>>,
    /// The connection has ended (closed, or failed).
    ended: bool,
    /// `None` only while dropped (dropping it tells the connection to end).
    client: Option<tokio_postgres::Client>,
}

/// One statement of a pipeline: its text or prepared statement, its values, and what
/// of its answer is wanted.
pub(crate) struct Request<'a> {
    pub(crate) sql: Sql<'a>,
    pub(crate) want: Want,
}

/// A statement to send.
pub(crate) enum Sql<'a> {
    /// A simple query: one or more statements without parameters.
    Simple(&'a str),
    /// A prepared statement.
    Prepared(&'a Statement, Vec<&'a (dyn ToSql + Sync)>),
    /// Text prepared for this use only.
    Text(&'a str, Vec<&'a (dyn ToSql + Sync)>),
    /// A statement sent unnamed, with its parameters' types (behind a transaction
    /// pooler).
    Unnamed(&'a str, Vec<(&'a (dyn ToSql + Sync), Type)>),
}

/// What of a statement's answer is wanted (as the client's `query`, `query_one`,
/// `query_opt` and `execute` answer); a simple query answers its messages.
#[derive(Clone, Copy)]
pub(crate) enum Want {
    Rows,
    One,
    Opt,
    Count,
}

/// What the server answered a [`Request`].
pub(crate) enum Answer {
    Simple(Vec<SimpleQueryMessage>),
    Rows(Vec<Row>),
    One(Row),
    Opt(Option<Row>),
    Count(u64),
}

type Reply<'a> = Pin<Box<dyn Future<Output = Result<Answer, Error>> + Send + 'a>>;

/// What `want` asks of `stmt` (prepared, or text prepared for this use).
async fn answer<S: ?Sized + ToStatement + Sync>(
    client: &tokio_postgres::Client,
    stmt: &S,
    params: &[&(dyn ToSql + Sync)],
    want: Want,
) -> Result<Answer, Error> {
    match want {
        Want::Rows => client.query(stmt, params).await.map(Answer::Rows),
        Want::One => client.query_one(stmt, params).await.map(Answer::One),
        Want::Opt => client.query_opt(stmt, params).await.map(Answer::Opt),
        Want::Count => client.execute(stmt, params).await.map(Answer::Count),
    }
}

/// The answer `request` asks `client` for.
fn reply<'a>(client: &'a tokio_postgres::Client, request: &'a Request<'a>) -> Reply<'a> {
    use Answer as A;
    match (&request.sql, request.want) {
        (Sql::Simple(sql), _) => {
            Box::pin(async move { client.simple_query(sql).await.map(A::Simple) })
        }
        (Sql::Prepared(stmt, params), want) => Box::pin(answer(client, *stmt, params, want)),
        (Sql::Text(sql, params), want) => Box::pin(answer(client, *sql, params, want)),
        (Sql::Unnamed(sql, params), want) => Box::pin(async move {
            match want {
                Want::Rows => client.query_typed(sql, params).await.map(A::Rows),
                Want::One => client.query_typed_one(sql, params).await.map(A::One),
                Want::Opt => client.query_typed_opt(sql, params).await.map(A::Opt),
                Want::Count => client.execute_typed(sql, params).await.map(A::Count),
            }
        }),
    }
}

impl Client {
    pub(crate) fn connect(config: &tokio_postgres::Config) -> crate::Result<Client> {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|source| crate::Error::Io {
                path: "a PostgreSQL connection's runtime".into(),
                source,
            })?;
        let (client, connection) =
            runtime
                .block_on(config.connect(NoTls))
                .map_err(|e| crate::Error::Connection {
                    target: describe(config),
                    // What the OS or the server said, not only "error connecting".
                    message: with_causes(&e),
                })?;
        Ok(Client {
            runtime,
            connection: Box::pin(connection),
            ended: false,
            client: Some(client),
        })
    }

    /// Runs the future `f` makes of the client, driving the connection meanwhile.
    fn run<'s, T, F>(
        &'s mut self,
        f: impl FnOnce(&'s tokio_postgres::Client) -> F,
    ) -> Result<T, Error>
    where
        F: Future<Output = Result<T, Error>> + 's,
    {
        let Client {
            runtime,
            connection,
            ended,
            client,
        } = self;
        let client = client
            .as_ref()
            .expect("the client is taken only when dropped");
        #[cfg(test)]
        ROUND_TRIPS.with(|n| n.set(n.get() + 1));
        let mut work = pin!(f(client));
        runtime.block_on(std::future::poll_fn(|cx| {
            if !*ended {
                match connection.as_mut().poll(cx) {
                    Poll::Ready(Err(e)) => {
                        *ended = true;
                        return Poll::Ready(Err(e));
                    }
                    Poll::Ready(Ok(())) => *ended = true,
                    Poll::Pending => {}
                }
            }
            work.as_mut().poll(cx)
        }))
    }

    /// Sends every request before reading any answer: one round trip. The answers
    /// come in the order of the requests; the outer error is the connection's.
    pub(crate) fn pipeline(
        &mut self,
        requests: &[Request<'_>],
    ) -> Result<Vec<Result<Answer, Error>>, Error> {
        self.run(|client| {
            // Each is polled once, in order, before any is awaited: every request is
            // written before the first answer is read.
            let pending = requests.iter().map(|r| reply(client, r));
            let all = futures_util::future::join_all(pending);
            async move { Ok(all.await) }
        })
    }

    pub(crate) fn prepare(&mut self, sql: &str) -> Result<Statement, Error> {
        self.run(|c| c.prepare(sql))
    }

    pub(crate) fn simple_query(&mut self, sql: &str) -> Result<Vec<SimpleQueryMessage>, Error> {
        self.run(|c| c.simple_query(sql))
    }

    pub(crate) fn batch_execute(&mut self, sql: &str) -> Result<(), Error> {
        self.run(|c| c.batch_execute(sql))
    }

    pub(crate) fn query_one<S: ?Sized + ToStatement + Sync>(
        &mut self,
        stmt: &S,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<Row, Error> {
        self.run(|c| c.query_one(stmt, params))
    }

    pub(crate) fn execute<S: ?Sized + ToStatement + Sync>(
        &mut self,
        stmt: &S,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<u64, Error> {
        self.run(|c| c.execute(stmt, params))
    }

    pub(crate) fn is_closed(&self) -> bool {
        // (A connection that ended has closed the client's channel.)
        self.client.as_ref().is_none_or(|c| c.is_closed())
    }
}

impl Drop for Client {
    /// Tells the server the session ends (as the blocking client does), and waits for
    /// the connection to close.
    fn drop(&mut self) {
        drop(self.client.take());
        if self.ended {
            return;
        }
        let connection = &mut self.connection;
        let _ = self
            .runtime
            .block_on(std::future::poll_fn(|cx| connection.as_mut().poll(cx)));
    }
}

/// Column `i` of the last row a simple query answered, if it has one and it is not
/// NULL.
pub(crate) fn simple_column(answer: &[postgres::SimpleQueryMessage], i: usize) -> Option<&str> {
    answer
        .iter()
        .rev()
        .find_map(|m| match m {
            postgres::SimpleQueryMessage::Row(row) => Some(row),
            _ => None,
        })
        .and_then(|row| row.try_get(i).ok().flatten())
}

/// Hosts, ports and database of a connection string, never its password:
/// `postgres://db.internal:5432/chat`, or for a Unix socket
/// `postgres:///chat?host=/run/postgresql&port=5432`; with several hosts, each of them
/// (`postgres://a:5432,b:5432/chat`, or `host=/a,/b port=5432,5432 dbname=chat` when a
/// socket is among them).
pub(crate) fn describe(config: &tokio_postgres::Config) -> String {
    use postgres::config::Host;
    let ports = config.get_ports();
    let port = |i: usize| ports.get(i).or(ports.first()).copied().unwrap_or(5432);
    let db = config.get_dbname().unwrap_or("");
    match config.get_hosts() {
        [] => format!("postgres://localhost:{}/{db}", port(0)),
        #[cfg(unix)]
        [Host::Unix(path)] => format!("postgres:///{db}?host={}&port={}", path.display(), port(0)),
        hosts if hosts.iter().all(|h| matches!(h, Host::Tcp(_))) => {
            let each: Vec<String> = hosts
                .iter()
                .enumerate()
                .map(|(i, h)| match h {
                    Host::Tcp(name) => format!("{name}:{}", port(i)),
                    #[cfg(unix)]
                    Host::Unix(_) => unreachable!("only TCP hosts here"),
                })
                .collect();
            format!("postgres://{}/{db}", each.join(","))
        }
        hosts => {
            let (names, ports): (Vec<String>, Vec<String>) = hosts
                .iter()
                .enumerate()
                .map(|(i, h)| {
                    let name = match h {
                        Host::Tcp(name) => name.clone(),
                        #[cfg(unix)]
                        Host::Unix(path) => path.display().to_string(),
                    };
                    (name, port(i).to_string())
                })
                .unzip();
            format!(
                "host={} port={} dbname={db}",
                names.join(","),
                ports.join(",")
            )
        }
    }
}

/// An error with every cause it carries ("error connecting to server: Connection
/// refused (os error 111)"), not only its first line.
pub(crate) fn with_causes(err: &dyn std::error::Error) -> String {
    let mut message = err.to_string();
    let mut source = err.source();
    while let Some(cause) = source {
        let text = cause.to_string();
        if !message.contains(&text) {
            message.push_str(": ");
            message.push_str(&text);
        }
        source = cause.source();
    }
    message
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::test_server::server_url;

    /// A connection the server ended says so (the pool drops it, instead of handing it
    /// out again), once a statement has met the end.
    #[test]
    fn a_connection_the_server_ended_is_closed() {
        let Some(url) = server_url() else {
            return;
        };
        let config: tokio_postgres::Config = url.parse().unwrap();
        let mut client = Client::connect(&config).unwrap();
        let pid: i32 = client
            .query_one("SELECT pg_backend_pid()", &[])
            .unwrap()
            .get(0);
        assert!(!client.is_closed(), "a live connection");
        let mut admin = postgres::Client::connect(&url, postgres::NoTls).unwrap();
        admin
            .execute("SELECT pg_terminate_backend($1)", &[&pid])
            .unwrap();
        assert!(client.batch_execute("SELECT 1").is_err());
        assert!(client.is_closed(), "a connection the server ended");
    }
}
