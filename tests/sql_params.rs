//! Every SQL value is bound as a parameter. This reads the library's source and finds
//! every `format!` whose text is SQL; what it interpolates must be SQL the crate wrote
//! itself (a shared column list, a placeholder number, a pragma name or a computed
//! number), never a value that came from a caller.

use std::path::Path;

/// What SQL built with `format!` may interpolate: crate-written fragments and numbers.
const ALLOWED: &[&str] = &[
    "DELIVERY_SELECT",           // a constant column list
    "Self::SELECT",              // ditto, ChunkRef's
    "ChunkRef::SELECT",          // ditto
    "columns",                   // due_sql's column list, from the two callers' literals
    "bound",                     // due_sql's bound condition, ditto
    "placeholders.join(\", \")", // "?3, ?4, ..."
    "i+3",                       // a placeholder number
    "values.len()",              // a placeholder number
    "pragma",                    // a pragma name from the crate's own list
    "wanted",                    // a page count the crate computed (pragmas take no parameters)
    "quoted_schema",             // the outbox's schema, quoted as an identifier by the server
    "xid",                       // a transaction id (an integer) the server returned
    "lock_ms",                   // a timeout in ms the crate computed (an integer)
    "idle_ms",                   // ditto
    "begin",                     // a BEGIN statement the crate wrote
    "rules_lock",                // a literal of the crate's: 'shared', 'exclusive' or NULL
];

const SQL_WORDS: &[&str] = &[
    "SELECT", "INSERT", "UPDATE", "DELETE", "PRAGMA", "WHERE", " AND ", " LIMIT ", "ORDER BY",
];

fn rust_files(dir: &Path, out: &mut Vec<std::path::PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            if path.file_name().is_some_and(|n| n != "bin") {
                rust_files(&path, out);
            }
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The text of each `format!(...)` call, from its opening to its closing parenthesis.
fn format_calls(source: &str) -> Vec<String> {
    let mut calls = Vec::new();
    let mut rest = source;
    while let Some(at) = rest.find("format!(") {
        let body = &rest[at + "format!(".len()..];
        let (mut depth, mut in_str, mut escaped, mut end) = (1, false, false, 0);
        for (i, c) in body.char_indices() {
            match c {
                _ if escaped => escaped = false,
                '\\' if in_str => escaped = true,
                '"' => in_str = !in_str,
                '(' if !in_str => depth += 1,
                ')' if !in_str => {
                    depth -= 1;
                    if depth == 0 {
                        end = i;
                        break;
                    }
                }
                _ => {}
            }
        }
        calls.push(body[..end].to_owned());
        rest = &body[end..];
    }
    calls
}

/// The interpolated expressions of a call: inline `{name}` and positional arguments.
fn interpolations(call: &str) -> (String, Vec<String>) {
    let literal_end = call[1..].find("\",").map_or(call.len(), |i| i + 2);
    let literal = call[..literal_end.min(call.len())].to_owned();
    let mut found = Vec::new();
    let mut rest = literal.as_str();
    while let Some(open) = rest.find('{') {
        let after = &rest[open + 1..];
        if let Some(stripped) = after.strip_prefix('{') {
            rest = stripped;
            continue;
        }
        let close = after.find('}').unwrap_or(after.len());
        let name = after[..close].split(':').next().unwrap_or("").trim();
        if !name.is_empty() {
            found.push(name.to_owned());
        }
        rest = &after[close.min(after.len())..];
    }
    if literal_end < call.len() {
        let args = &call[literal_end..];
        let mut depth = 0;
        let mut current = String::new();
        for c in args.chars() {
            match c {
                '(' => depth += 1,
                ')' => depth -= 1,
                ',' if depth == 0 => {
                    found.push(std::mem::take(&mut current));
                    continue;
                }
                _ => {}
            }
            current.push(c);
        }
        found.push(current);
    }
    let found = found
        .into_iter()
        .map(|a| {
            a.split_whitespace()
                .collect::<String>()
                .replace(",\"", ", \"")
        })
        .filter(|a| !a.is_empty())
        .collect();
    (literal, found)
}

#[test]
fn sql_text_never_interpolates_values() {
    let mut files = Vec::new();
    rust_files(
        &Path::new(env!("CARGO_MANIFEST_DIR")).join("src"),
        &mut files,
    );
    let mut checked = 0;
    for file in &files {
        let source = std::fs::read_to_string(file).unwrap();
        for call in format_calls(&source) {
            let (literal, args) = interpolations(&call);
            if !SQL_WORDS.iter().any(|w| literal.contains(w)) {
                continue;
            }
            checked += 1;
            for arg in args {
                let normalized: String = arg.split_whitespace().collect();
                let ok = ALLOWED
                    .iter()
                    .any(|a| a.split_whitespace().collect::<String>() == normalized);
                assert!(
                    ok,
                    "{}: SQL built with format! interpolates `{arg}`:\n{call}",
                    file.display()
                );
            }
        }
    }
    assert!(
        checked >= 5,
        "the scan found only {checked} SQL format! calls; is it still reading the source?"
    );
}

#[test]
fn the_scan_catches_an_interpolated_value() {
    let bad = r#"format!("SELECT * FROM messages WHERE chat_id = '{chat_id}'")"#;
    let (_, args) = interpolations(&format_calls(bad)[0]);
    assert_eq!(args, ["chat_id"]);
    assert!(!ALLOWED.contains(&"chat_id"));
    let positional = r#"format!("DELETE FROM t WHERE k = {}", key.clone())"#;
    let (_, args) = interpolations(&format_calls(positional)[0]);
    assert_eq!(args, ["key.clone()"]);
}
