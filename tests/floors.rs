//! The library's floors, read from its sources: no import circle between modules
//! (a module may use its parent's items, and a parent declares its children, nothing
//! else goes round); the store is a floor (nothing under `src/store/` names a rule
//! module outside its inline tests, `error.rs` names no store); and each store keeps
//! one concept a file (none over 650 lines before its inline tests).
//!
//! A module's imports are the `crate::`, `super::` and `self::` paths it names outside
//! comments and its inline tests, each resolved to the module that defines the item,
//! through the re-exports (`pub use`) on the way.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// A module's path from the crate root (`["store", "sqlite", "tx"]`; the root is `[]`).
type Module = Vec<String>;

/// The rule modules, which the store must not name.
const RULE_MODULES: &[&str] = &[
    "outbox", "claim", "state", "lane", "inspect", "health", "finalize", "operator", "enqueue",
];

/// Longest a store's file may be before its inline tests.
const STORE_FILE_LINES: usize = 650;

struct Source {
    file: PathBuf,
    /// The text outside comments and inline tests.
    code: String,
    /// Lines before the inline tests.
    lines: usize,
}

/// Every module of the library (not the binaries) with its source.
fn sources(src: &Path) -> BTreeMap<Module, Source> {
    let mut out = BTreeMap::new();
    let mut dirs = vec![src.to_path_buf()];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).expect("the source folder") {
            let path = entry.expect("a source entry").path();
            let rel = path.strip_prefix(src).expect("under src");
            if rel.starts_with("bin") {
                continue;
            }
            if path.is_dir() {
                dirs.push(path);
                continue;
            }
            if path.extension().is_none_or(|e| e != "rs") {
                continue;
            }
            let mut module: Module = rel
                .with_extension("")
                .iter()
                .map(|c| c.to_string_lossy().into_owned())
                .collect();
            if matches!(module.last().map(String::as_str), Some("mod" | "lib")) {
                module.pop();
            }
            let text = std::fs::read_to_string(&path).expect("a source file");
            let before_tests = text
                .find("\n#[cfg(test)]\nmod tests")
                .map_or(text.as_str(), |at| &text[..at]);
            out.insert(
                module,
                Source {
                    file: path.clone(),
                    code: without_comments(before_tests),
                    lines: before_tests.lines().count(),
                },
            );
        }
    }
    out
}

/// `text` without its line comments (doc comments included).
fn without_comments(text: &str) -> String {
    text.lines()
        .map(|line| {
            // A `//` inside a string ("postgres://") cuts the rest of its line, which
            // holds no import.
            line.find("//").map_or(line, |at| &line[..at])
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// The paths of a `use` tree (`a::{b, c::{d as e}}` → `a::b`, `a::c::d`), each with
/// the name it binds.
fn expand(tree: &str) -> Vec<(Vec<String>, String)> {
    fn split_top(s: &str) -> Vec<&str> {
        let (mut parts, mut depth, mut start) = (Vec::new(), 0, 0);
        for (i, c) in s.char_indices() {
            match c {
                '{' => depth += 1,
                '}' => depth -= 1,
                ',' if depth == 0 => {
                    parts.push(&s[start..i]);
                    start = i + 1;
                }
                _ => {}
            }
        }
        parts.push(&s[start..]);
        parts.into_iter().filter(|p| !p.trim().is_empty()).collect()
    }
    fn walk(prefix: &[String], tree: &str, out: &mut Vec<(Vec<String>, String)>) {
        for part in split_top(tree) {
            let part = part.trim();
            if let Some(open) = part.find('{') {
                let mut head = prefix.to_vec();
                head.extend(segments(&part[..open]));
                let close = part.rfind('}').unwrap_or(part.len());
                walk(&head, &part[open + 1..close], out);
            } else {
                let (path, alias) = match part.split_once(" as ") {
                    Some((path, alias)) => (path, Some(alias.trim())),
                    None => (part, None),
                };
                let mut full = prefix.to_vec();
                full.extend(segments(path));
                let name = alias
                    .map(str::to_owned)
                    .or_else(|| full.last().cloned())
                    .unwrap_or_default();
                out.push((full, name));
            }
        }
    }
    let mut out = Vec::new();
    walk(&[], tree, &mut out);
    out
}

fn segments(path: &str) -> Vec<String> {
    path.split("::")
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(str::to_owned)
        .collect()
}

/// The `use` declarations of `code`: (public, tree).
fn uses(code: &str) -> Vec<(bool, String)> {
    let mut out = Vec::new();
    let mut rest = code;
    while let Some(at) = rest.find("use ") {
        let before = &rest[..at];
        let boundary = before
            .chars()
            .last()
            .is_none_or(|c| !c.is_alphanumeric() && c != '_');
        let after = &rest[at + 4..];
        let Some(end) = after.find(';') else { break };
        let tree = after[..end].trim();
        if boundary
            && (tree.starts_with("crate::")
                || tree.starts_with("super::")
                || tree.starts_with("self::"))
        {
            let line_start = before.rfind('\n').map_or(0, |i| i + 1);
            let public = before[line_start..].trim_start().starts_with("pub");
            out.push((public, tree.to_owned()));
        }
        rest = &after[end..];
    }
    out
}

/// The inline paths of `code` (`crate::a::b`, `super::c`).
fn inline_paths(code: &str) -> Vec<Vec<String>> {
    let mut out = Vec::new();
    for start in ["crate::", "super::"] {
        let mut rest = code;
        while let Some(at) = rest.find(start) {
            let boundary = rest[..at]
                .chars()
                .last()
                .is_none_or(|c| !c.is_alphanumeric() && c != '_' && c != '$');
            let path: String = rest[at..]
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_' || *c == ':')
                .collect();
            if boundary {
                out.push(segments(&path));
            }
            rest = &rest[at + start.len()..];
        }
    }
    out
}

struct Crate {
    modules: BTreeMap<Module, Source>,
    /// Per module, what its `pub use` makes nameable there: name → (path, from module).
    reexports: BTreeMap<Module, BTreeMap<String, Vec<String>>>,
}

impl Crate {
    fn read(src: &Path) -> Self {
        let modules = sources(src);
        let reexports = modules
            .iter()
            .map(|(module, source)| {
                let names = uses(&source.code)
                    .into_iter()
                    .filter(|(public, _)| *public)
                    .flat_map(|(_, tree)| expand(&tree))
                    .map(|(path, name)| (name, path))
                    .collect();
                (module.clone(), names)
            })
            .collect();
        Crate { modules, reexports }
    }

    /// The module that defines what `path` names, seen from `here`, through at most
    /// `8 - depth` re-exports (none from a `depth` of 8 or more: the module it names).
    fn resolve(&self, path: &[String], here: &Module, depth: usize) -> Option<Module> {
        let (mut base, mut rest): (Module, &[String]) = match path.first().map(String::as_str) {
            Some("crate") => (Vec::new(), &path[1..]),
            Some("super" | "self") => (here.clone(), path),
            _ => return None,
        };
        while let Some(first) = rest.first() {
            match first.as_str() {
                "super" => {
                    base.pop();
                }
                "self" => {}
                _ => break,
            }
            rest = &rest[1..];
        }
        let mut at = base;
        for (i, segment) in rest.iter().enumerate() {
            let mut next = at.clone();
            next.push(segment.clone());
            if self.modules.contains_key(&next) {
                at = next;
                continue;
            }
            if depth < 8
                && let Some(target) = self.reexports.get(&at).and_then(|r| r.get(segment))
            {
                let mut through = target.clone();
                through.extend(rest[i + 1..].iter().cloned());
                if let Some(found) = self.resolve(&through, &at, depth + 1) {
                    return Some(found);
                }
            }
            break;
        }
        self.modules.contains_key(&at).then_some(at)
    }

    /// Each module's imports, without the ones of a module to its own ancestors.
    fn imports(&self) -> BTreeMap<Module, BTreeSet<Module>> {
        self.modules
            .iter()
            .map(|(module, source)| {
                let paths = uses(&source.code)
                    .into_iter()
                    .flat_map(|(_, tree)| expand(&tree))
                    .map(|(path, _)| path)
                    .filter(|path| path.last().is_none_or(|l| l != "*"))
                    .chain(inline_paths(&source.code));
                // The module a path goes through counts as well as the one that
                // defines the item: `crate::inspect::ListFilter` names `inspect`.
                let targets = paths
                    .flat_map(|path| {
                        let named = self.resolve(&path, module, usize::MAX);
                        let defined = self.resolve(&path, module, 0);
                        named.into_iter().chain(defined)
                    })
                    .filter(|target| !module.starts_with(target))
                    .collect();
                (module.clone(), targets)
            })
            .collect()
    }
}

fn name(module: &Module) -> String {
    if module.is_empty() {
        "lib".to_owned()
    } else {
        module.join("::")
    }
}

/// The import circles of `graph`: its strongly connected parts of two modules or more.
fn circles(graph: &BTreeMap<Module, BTreeSet<Module>>) -> Vec<Vec<String>> {
    // Two modules are in one circle when each reaches the other.
    let reach = |from: &Module| {
        let mut seen = BTreeSet::new();
        let mut todo = vec![from.clone()];
        while let Some(m) = todo.pop() {
            for next in graph.get(&m).into_iter().flatten() {
                if seen.insert(next.clone()) {
                    todo.push(next.clone());
                }
            }
        }
        seen
    };
    let reached: BTreeMap<&Module, BTreeSet<Module>> =
        graph.keys().map(|m| (m, reach(m))).collect();
    let mut placed = BTreeSet::new();
    let mut out = Vec::new();
    for (m, from_m) in &reached {
        if placed.contains(*m) || !from_m.contains(*m) {
            continue;
        }
        let circle: Vec<&Module> = from_m
            .iter()
            .filter(|other| reached.get(other).is_some_and(|r| r.contains(*m)))
            .collect();
        placed.extend(circle.iter().map(|c| (*c).clone()));
        if circle.len() > 1 {
            out.push(circle.into_iter().map(name).collect());
        }
    }
    out
}

fn library() -> Crate {
    Crate::read(&Path::new(env!("CARGO_MANIFEST_DIR")).join("src"))
}

#[test]
fn no_module_imports_go_round_in_a_circle() {
    let found = circles(&library().imports());
    assert!(found.is_empty(), "import circles: {found:#?}");
}

#[test]
fn the_store_names_no_rule_module_and_the_error_type_no_store() {
    let krate = library();
    let imports = krate.imports();
    let mut wrong = Vec::new();
    for (module, targets) in &imports {
        let store = module.first().is_some_and(|m| m == "store");
        for target in targets {
            let rule = target.len() == 1 && RULE_MODULES.contains(&target[0].as_str());
            let names_store = target.first().is_some_and(|t| t == "store");
            if (store && rule) || (module == &vec!["error".to_owned()] && names_store) {
                wrong.push(format!("{} imports {}", name(module), name(target)));
            }
        }
    }
    assert!(wrong.is_empty(), "{wrong:#?}");
}

#[test]
fn each_store_file_is_one_concept_of_bounded_length() {
    let krate = library();
    let long: Vec<String> = krate
        .modules
        .values()
        .filter(|s| {
            ["sqlite", "postgres"]
                .iter()
                .any(|store| s.file.components().any(|c| c.as_os_str() == *store))
                && s.file.components().any(|c| c.as_os_str() == "store")
        })
        .filter(|s| s.lines > STORE_FILE_LINES)
        .map(|s| format!("{}: {} lines", s.file.display(), s.lines))
        .collect();
    assert!(long.is_empty(), "{long:#?}");
}

/// The checks above can fail: a circle, a store naming a rule module and a long file
/// planted in a copy of the sources are each found.
#[test]
fn each_check_finds_what_is_planted() {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let src = dir.path().join("src");
    std::fs::create_dir_all(src.join("store/sqlite")).unwrap();
    let write = |path: &str, text: &str| std::fs::write(src.join(path), text).unwrap();
    write(
        "lib.rs",
        "mod a;\nmod b;\nmod error;\nmod lane;\nmod store;\n",
    );
    write("a.rs", "use crate::b::B;\npub struct A;\n");
    write("b.rs", "pub struct B(crate::a::A);\n");
    write("lane.rs", "pub struct LaneHold;\n");
    write("error.rs", "pub enum Error { X(crate::store::S) }\n");
    write(
        "store/mod.rs",
        "pub mod sqlite;\npub struct S;\nuse crate::lane::LaneHold;\n",
    );
    write(
        "store/sqlite/mod.rs",
        &format!(
            "{}\n#[cfg(test)]\nmod tests {{}}\n",
            "// a line\n".repeat(STORE_FILE_LINES + 1)
        ),
    );
    let krate = Crate::read(&src);
    let imports = krate.imports();
    assert_eq!(
        circles(&imports),
        vec![vec!["a".to_owned(), "b".to_owned()]]
    );
    let store = vec!["store".to_owned()];
    assert!(imports[&store].contains(&vec!["lane".to_owned()]));
    assert!(imports[&vec!["error".to_owned()]].contains(&store));
    let sqlite = &krate.modules[&vec!["store".to_owned(), "sqlite".to_owned()]];
    assert_eq!(sqlite.lines, STORE_FILE_LINES + 1);
    // A child naming its parent, and a parent its child, is no circle.
    write("store/sqlite/mod.rs", "use super::S;\n");
    write(
        "store/mod.rs",
        "pub mod sqlite;\npub struct S;\nuse self::sqlite::T;\n",
    );
    let krate = Crate::read(&src);
    let found = circles(&krate.imports());
    assert_eq!(found, vec![vec!["a".to_owned(), "b".to_owned()]]);
}
