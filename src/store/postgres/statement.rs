//! The application's finalization statement on PostgreSQL: its `:name` parameters
//! become `$n`, its values are bound as the types PostgreSQL infers for them (a text
//! column gets the uid as text, a `uuid` column a UUID, a `timestamptz` column the
//! time), and what the application's schema refuses is told apart from a failure of
//! the database.

use std::error::Error as StdError;

use bytes::BytesMut;
use postgres::types::{IsNull, ToSql, Type, to_sql_checked};

use super::tx::PgTx;
use crate::error::server_message as message;
use crate::error::{Error, Result};
use crate::rules::parameter_index;
use crate::store::StatementShape;

/// A statement with its parameters numbered: the text PostgreSQL prepares, and each
/// parameter's name (with its `:`), `None` for one written `$n`.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Numbered {
    pub text: String,
    pub parameters: Vec<Option<String>>,
    /// The first keyword, lowercased.
    pub verb: String,
}

/// Numbers the `:name` parameters of `sql` (the same name, the same number), leaving
/// strings, quoted names, dollar-quoted bodies, comments and `::` casts as they are.
/// Refuses more than one statement.
pub(crate) fn number(sql: &str) -> std::result::Result<Numbered, String> {
    let chars: Vec<char> = sql.chars().collect();
    let mut out = String::with_capacity(sql.len());
    let mut names: Vec<String> = Vec::new();
    let mut ended = false;
    let mut i = 0;
    let until = |from: usize, end: &str| -> usize {
        let end: Vec<char> = end.chars().collect();
        let mut j = from;
        while j < chars.len() {
            if chars[j..].starts_with(&end) {
                return j + end.len();
            }
            j += 1;
        }
        chars.len()
    };
    while i < chars.len() {
        let c = chars[i];
        let next = chars.get(i + 1).copied();
        let start = i;
        if ended && !c.is_whitespace() && c != ';' {
            return Err("it holds more than one statement; give exactly one".into());
        }
        match c {
            '\'' | '"' => {
                // '' and "" inside are the quote itself: the scan resumes after them.
                let mut j = i + 1;
                while j < chars.len() {
                    if chars[j] == c {
                        if chars.get(j + 1) == Some(&c) {
                            j += 2;
                            continue;
                        }
                        break;
                    }
                    j += 1;
                }
                i = (j + 1).min(chars.len());
            }
            '-' if next == Some('-') => i = until(i, "\n"),
            '/' if next == Some('*') => i = until(i + 2, "*/"),
            '$' if next.is_some_and(|n| n.is_ascii_digit()) => {
                let mut j = i + 1;
                while j < chars.len() && chars[j].is_ascii_digit() {
                    j += 1;
                }
                let number: usize = chars[i + 1..j]
                    .iter()
                    .collect::<String>()
                    .parse()
                    .unwrap_or(0);
                names.push(format!("${number}"));
                out.push_str(&format!("${}", names.len()));
                i = j;
                continue;
            }
            '$' => {
                // A dollar-quoted body: $tag$ ... $tag$.
                let mut j = i + 1;
                while j < chars.len() && (chars[j].is_alphanumeric() || chars[j] == '_') {
                    j += 1;
                }
                if chars.get(j) == Some(&'$') {
                    let tag: String = chars[i..=j].iter().collect();
                    i = until(j + 1, &tag);
                } else {
                    i += 1;
                }
            }
            ':' if next == Some(':') => i += 2,
            ':' if next.is_some_and(|n| n.is_alphabetic() || n == '_') => {
                let mut j = i + 1;
                while j < chars.len() && (chars[j].is_alphanumeric() || chars[j] == '_') {
                    j += 1;
                }
                let name: String = chars[i..j].iter().collect();
                let at = match names.iter().position(|n| *n == name) {
                    Some(at) => at,
                    None => {
                        names.push(name);
                        names.len() - 1
                    }
                };
                out.push_str(&format!("${}", at + 1));
                i = j;
                continue;
            }
            ';' => {
                ended = true;
                i += 1;
                continue;
            }
            _ => i += 1,
        }
        out.extend(&chars[start..i]);
    }
    let verb = first_keyword(&out);
    Ok(Numbered {
        text: out,
        parameters: names
            .into_iter()
            .map(|n| n.starts_with(':').then_some(n))
            .collect(),
        verb,
    })
}

/// The first word of a statement, past comments and parentheses, lowercased.
fn first_keyword(sql: &str) -> String {
    let mut rest = sql.trim_start();
    loop {
        if let Some(after) = rest.strip_prefix("--") {
            rest = after.split_once('\n').map_or("", |(_, r)| r).trim_start();
        } else if let Some(after) = rest.strip_prefix("/*") {
            rest = after.split_once("*/").map_or("", |(_, r)| r).trim_start();
        } else if let Some(after) = rest.strip_prefix('(') {
            rest = after.trim_start();
        } else {
            break;
        }
    }
    rest.chars()
        .take_while(|c| c.is_alphabetic())
        .collect::<String>()
        .to_lowercase()
}

/// How PostgreSQL reads the application's statement, prepared inside a savepoint (a
/// statement that does not prepare would otherwise end the transaction).
pub(crate) fn describe(
    tx: &PgTx<'_>,
    sql: &str,
) -> Result<std::result::Result<StatementShape, String>> {
    let numbered = match number(sql) {
        Ok(numbered) => numbered,
        Err(reason) => return Ok(Err(reason)),
    };
    tx.batch("SAVEPOINT chunked_outbox_describe")?;
    let prepared = tx.with_client(|c| c.prepare(&numbered.text))?;
    let shape = match prepared {
        Ok(stmt) => Ok(StatementShape {
            read_only: matches!(
                numbered.verb.as_str(),
                "select" | "values" | "table" | "show" | "explain"
            ),
            returns_rows: !stmt.columns().is_empty(),
            parameters: numbered.parameters,
        }),
        Err(e) => Err(format!(
            "it does not prepare against this database: {}",
            message(&e)
        )),
    };
    tx.batch(
        "ROLLBACK TO SAVEPOINT chunked_outbox_describe;
         RELEASE SAVEPOINT chunked_outbox_describe",
    )?;
    Ok(shape)
}

/// A value of the finalized delivery.
#[derive(Debug, Clone)]
pub(crate) enum Value {
    Null,
    Int(i64),
    Text(String),
}

/// Runs the application's statement with `values` (in the order of
/// [`FINALIZE_PARAMETERS`](crate::rules::FINALIZE_PARAMETERS)).
pub(crate) fn run(tx: &PgTx<'_>, sql: &str, values: &[Value]) -> Result<()> {
    let numbered =
        number(sql).map_err(|reason| Error::invalid("finalization statement", reason))?;
    let mut bound: Vec<&(dyn ToSql + Sync)> = Vec::new();
    for name in &numbered.parameters {
        // Checked when it was set; a statement stored by hand may still be wrong.
        let name = name.as_deref().unwrap_or("$");
        let at = parameter_index(name).ok_or_else(|| {
            Error::invalid(
                "finalization statement",
                format!("unknown parameter {name}"),
            )
        })?;
        bound.push(&values[at]);
    }
    tx.with_client(|c| c.execute(numbered.text.as_str(), &bound))??;
    Ok(())
}

/// Microseconds from the Unix epoch to PostgreSQL's (2000-01-01).
const PG_EPOCH_US: i64 = 946_684_800_000_000;

impl ToSql for Value {
    fn to_sql(
        &self,
        ty: &Type,
        out: &mut BytesMut,
    ) -> std::result::Result<IsNull, Box<dyn StdError + Sync + Send>> {
        let text_like = matches!(*ty, Type::TEXT | Type::VARCHAR | Type::BPCHAR | Type::NAME);
        match self {
            Value::Null => Ok(IsNull::Yes),
            Value::Int(v) => match *ty {
                Type::INT8 => v.to_sql(ty, out),
                Type::INT4 => i32::try_from(*v)?.to_sql(ty, out),
                Type::INT2 => i16::try_from(*v)?.to_sql(ty, out),
                Type::TIMESTAMPTZ | Type::TIMESTAMP => {
                    (v.saturating_mul(1000) - PG_EPOCH_US).to_sql(&Type::INT8, out)
                }
                _ if text_like => v.to_string().as_str().to_sql(ty, out),
                _ => Err(format!("a whole number cannot be bound as {ty}").into()),
            },
            Value::Text(s) => match *ty {
                Type::UUID => {
                    out.extend_from_slice(uuid::Uuid::parse_str(s)?.as_bytes());
                    Ok(IsNull::No)
                }
                Type::JSON => {
                    out.extend_from_slice(s.as_bytes());
                    Ok(IsNull::No)
                }
                Type::JSONB => {
                    out.extend_from_slice(&[1]);
                    out.extend_from_slice(s.as_bytes());
                    Ok(IsNull::No)
                }
                // A numeric chat id into an integer column, as SQLite's affinity does.
                Type::INT8 => s.parse::<i64>()?.to_sql(ty, out),
                Type::INT4 => s.parse::<i32>()?.to_sql(ty, out),
                Type::INT2 => s.parse::<i16>()?.to_sql(ty, out),
                Type::TIMESTAMPTZ | Type::TIMESTAMP => {
                    let at = chrono::DateTime::parse_from_rfc3339(s)?;
                    (at.timestamp_micros() - PG_EPOCH_US).to_sql(&Type::INT8, out)
                }
                _ if text_like => s.as_str().to_sql(ty, out),
                _ => Err(format!("a text cannot be bound as {ty}").into()),
            },
        }
    }

    fn accepts(_: &Type) -> bool {
        true
    }

    to_sql_checked!();
}

/// The message of an error in which the application's schema refused its statement (a
/// constraint, a trigger's exception, a missing table or column, a value its type does
/// not take, a missing privilege), or the error itself when the database failed.
pub(crate) fn refusal(error: Error) -> Result<String> {
    match error {
        Error::Postgres(e) => {
            let refused = match e.code() {
                // 22: data exception, 23: integrity constraint, 42: syntax or access
                // rule, P0: a PL/pgSQL RAISE, 0A: a feature the statement needs.
                Some(code) => ["22", "23", "42", "P0", "0A"]
                    .iter()
                    .any(|class| code.code().starts_with(class)),
                // A value that could not be bound as the column's type.
                None => e.to_string().starts_with("error serializing parameter"),
            };
            if refused {
                Ok(match e.source() {
                    Some(source) if e.code().is_none() => format!("{e}: {source}"),
                    _ => message(&e),
                })
            } else {
                Err(Error::Postgres(e))
            }
        }
        other => Err(other),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn numbered(sql: &str) -> (String, Vec<Option<String>>) {
        let n = number(sql).unwrap();
        (n.text, n.parameters)
    }

    #[test]
    fn named_parameters_are_numbered_once_each() {
        assert_eq!(
            numbered("INSERT INTO m VALUES (:delivery_id, :content, :delivery_id)"),
            (
                "INSERT INTO m VALUES ($1, $2, $1)".into(),
                vec![Some(":delivery_id".into()), Some(":content".into())]
            )
        );
    }

    #[test]
    fn strings_quoted_names_bodies_comments_and_casts_are_left_alone() {
        let sql = "INSERT INTO \"t:x\" VALUES (':no', 'it''s :no', :chat_id::text, \
                   $f$ :no $f$) -- :no\n /* :no */";
        let (text, parameters) = numbered(sql);
        assert_eq!(parameters, vec![Some(":chat_id".into())]);
        assert_eq!(text, sql.replace(":chat_id::text", "$1::text"));
    }

    #[test]
    fn positional_parameters_are_reported_without_a_name() {
        assert_eq!(
            numbered("INSERT INTO m VALUES ($1, :content)").1,
            vec![None, Some(":content".into())]
        );
    }

    #[test]
    fn a_second_statement_is_refused() {
        assert!(number("INSERT INTO m VALUES (1); DELETE FROM m").is_err());
        assert!(number("INSERT INTO m VALUES (';');  ").is_ok());
    }

    #[test]
    fn the_verb_is_the_first_keyword() {
        assert_eq!(number("  /* x */ (SELECT 1)").unwrap().verb, "select");
        assert_eq!(
            number("-- c\nINSERT INTO m VALUES (1)").unwrap().verb,
            "insert"
        );
    }

    #[test]
    fn only_the_applications_refusals_are_contained() {
        assert!(matches!(refusal(Error::Busy), Err(Error::Busy)));
        assert!(matches!(refusal(Error::DiskFull), Err(Error::DiskFull)));
    }
}
