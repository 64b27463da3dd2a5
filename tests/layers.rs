//! The structure design.md describes, checked on the source: imports only point down the
//! layers (`abi`/`report` -> `plugin` -> `transport` -> `oob` -> `verbs` -> `log` -> `config`
//! -> the shared leaves); `abi` imports only `plugin` and the shared leaves, `report` only
//! `plugin`, `config`, the transports' facts and the leaves; the transport contract
//! (`transport/mod.rs`, `registry.rs`, `facts.rs`) names no transport, `transport/either.rs`
//! is the one place that names both, and the two transports never import each other or
//! `either`; `unsafe` appears only in `abi/`, `verbs/` and the buffer type `abi` hands down;
//! no import circle joins the crate's files (a file imports another by naming a module or an
//! item of it: `crate::`, `super::`, `self::` or a module it declares); and no source file
//! grows past what one can read in a sitting. Each rule is also run on a planted violation,
//! so a checker that can no longer fail is noticed.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// A module's layer: higher layers may import lower ones and their own, never higher.
fn layer(module: &str) -> Option<u32> {
    Some(match module {
        "abi" | "report" | "protocol" => 9,
        "plugin" => 8,
        "transport" => 7,
        "oob" => 6,
        "verbs" => 5,
        "log" => 4,
        "config" => 3,
        "error" | "codec" | "buffer" | "random" | "sysfs" | "ffi" => 1,
        _ => return None,
    })
}

/// The modules below everything, which any layer may use.
const LEAVES: [&str; 7] = ["error", "codec", "buffer", "random", "sysfs", "ffi", "log"];

/// What a top module may import besides its own modules, where the layers alone allow more:
/// the C boundary only the core and the leaves; the info report the core, the settings and
/// the transports' facts (data), never a transport's internals.
fn allowed_imports(top: &str) -> Option<&'static [&'static str]> {
    match top {
        "abi" => Some(&["plugin"]),
        "report" => Some(&["plugin", "config", "transport::facts"]),
        "protocol" => Some(&["oob", "transport::either"]),
        _ => None,
    }
}

/// Files of the transport contract: they name no transport.
fn is_contract(rel: &str) -> bool {
    matches!(
        rel,
        "transport/mod.rs" | "transport/bounds.rs" | "transport/registry.rs" | "transport/facts.rs"
    )
}

/// The one file that names both transports.
const EITHER: &str = "transport/either.rs";

/// Files of `transport` (under `transport/`) that are the transport `name`'s own.
fn in_transport(rel: &str, name: &str) -> bool {
    rel.strip_prefix("transport/")
        .is_some_and(|r| r == format!("{name}.rs") || r.starts_with(&format!("{name}/")))
}

/// Files where `unsafe` may appear: the C boundary, the verbs calls, and the buffer type
/// the boundary hands down.
fn unsafe_allowed(rel: &str) -> bool {
    rel.starts_with("abi/") || rel.starts_with("verbs/") || rel == "buffer.rs"
}

/// Longest a source file may be.
const MAX_LINES: usize = 850;

/// The module path of a file under src/ (`transport/verbs/send.rs` ->
/// [transport, verbs, send]).
fn module_of(rel: &str) -> Vec<String> {
    let mut parts: Vec<String> = rel
        .trim_end_matches(".rs")
        .split('/')
        .map(str::to_string)
        .collect();
    if parts.last().is_some_and(|p| p == "mod" || p == "lib") {
        parts.pop();
    }
    parts
}

/// Code lines of `text`: comments dropped (line comments and doc comments), strings kept.
fn code_lines(text: &str) -> impl Iterator<Item = (usize, &str)> {
    text.lines().enumerate().filter_map(|(i, l)| {
        let t = l.trim_start();
        (!t.starts_with("//")).then(|| (i + 1, l.split(" // ").next().unwrap_or(l)))
    })
}

/// Every `crate::<first>::<second>` path named in `text`, as (line, first, second), with
/// grouped imports (`use crate::{a::b, c};`) expanded.
fn crate_paths(text: &str) -> Vec<(usize, String, Option<String>)> {
    let mut out = Vec::new();
    let code: Vec<(usize, &str)> = code_lines(text).collect();
    let joined: String = code.iter().map(|(_, l)| format!("{l}\n")).collect();
    let line_at = |offset: usize| {
        let nl = joined[..offset].matches('\n').count();
        code.get(nl).map_or(0, |(n, _)| *n)
    };
    let mut rest = 0;
    while let Some(found) = joined[rest..].find("crate::") {
        let at = rest + found;
        rest = at + "crate::".len();
        // `$crate::` (macros) and `nccl_net_erdma_crate::`-style words are not paths.
        let before = joined[..at].chars().last();
        if before.is_some_and(|c| c.is_alphanumeric() || c == '_' || c == '$') {
            continue;
        }
        let tail = &joined[rest..];
        if let Some(group) = tail.strip_prefix('{') {
            let end = group.find('}').unwrap_or(group.len());
            for item in group[..end].split(',') {
                let mut segs = item.trim().split("::");
                let first = segs.next().unwrap_or("").trim().to_string();
                let second = segs
                    .next()
                    .map(|s| s.trim().trim_start_matches('{').to_string());
                if !first.is_empty() {
                    out.push((line_at(at), first, second));
                }
            }
            continue;
        }
        let path: String = tail
            .chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_' || *c == ':')
            .collect();
        let mut segs = path.split("::").filter(|s| !s.is_empty());
        if let Some(first) = segs.next() {
            out.push((
                line_at(at),
                first.to_string(),
                segs.next().map(str::to_string),
            ));
        }
    }
    out
}

/// Every transport path named in `text` (`transport::tcp`, `super::verbs`, `tcp::Thing`
/// ...): (line, transport), comments dropped.
fn transport_names(text: &str) -> Vec<(usize, &'static str)> {
    let mut out = Vec::new();
    for (n, line) in code_lines(text) {
        for name in ["tcp", "verbs"] {
            let path = format!("{name}::");
            let mut rest = line;
            while let Some(at) = rest.find(&path) {
                let before = rest[..at].chars().last();
                // `crate::verbs::` is the verbs layer (libibverbs), not the transport.
                let layer = rest[..at].ends_with("crate::");
                if !before.is_some_and(|c| c.is_alphanumeric() || c == '_') && !layer {
                    out.push((n, name));
                }
                rest = &rest[at + path.len()..];
            }
        }
    }
    out
}

/// The import rules' violations in the file at `rel` (relative to src/) holding `text`.
fn import_violations(rel: &str, text: &str) -> Vec<String> {
    let module = module_of(rel);
    let Some(top) = module.first() else {
        return Vec::new(); // lib.rs: the crate root declares every module
    };
    let Some(own) = layer(top) else {
        return vec![format!(
            "{rel}: module `{top}` has no layer in tests/layers.rs"
        )];
    };
    let mut bad = Vec::new();
    for (line, first, second) in crate_paths(text) {
        let Some(theirs) = layer(&first) else {
            // A re-export of the crate root (`crate::protocol`) or an item of lib.rs.
            continue;
        };
        if theirs > own {
            bad.push(format!(
                "{rel}:{line}: `{top}` imports `crate::{first}`, a higher layer"
            ));
        }
        if let Some(allowed) = allowed_imports(top) {
            let path = match &second {
                Some(s) => format!("{first}::{s}"),
                None => first.clone(),
            };
            let ok = first == *top
                || LEAVES.contains(&first.as_str())
                || allowed
                    .iter()
                    .any(|a| *a == first || (a.contains("::") && path.starts_with(a)));
            if !ok {
                bad.push(format!(
                    "{rel}:{line}: `{top}` imports `crate::{path}`; it may import only {allowed:?} \
                     and the shared leaves"
                ));
            }
        }
        // The transports are siblings behind one contract: neither names the other, nor the
        // room above both.
        if top == "transport" && first == "transport" {
            let (mine, other) = (module.get(1).map(String::as_str), second.as_deref());
            let sibling = |m: Option<&str>| matches!(m, Some("tcp" | "verbs"));
            if sibling(mine) && (sibling(other) || other == Some("either")) && mine != other {
                bad.push(format!(
                    "{rel}:{line}: transport::{} imports transport::{}",
                    mine.unwrap_or("?"),
                    other.unwrap_or("?")
                ));
            }
        }
    }
    // Only `either` names a transport from outside it: not the contract, not the core.
    for (line, name) in transport_names(text) {
        if rel == EITHER || in_transport(rel, name) {
            continue;
        }
        let what = if is_contract(rel) {
            "the transport contract names"
        } else {
            "only transport/either.rs may name"
        };
        bad.push(format!("{rel}:{line}: {what} transport `{name}`"));
    }
    bad
}

/// The text of a file without its unit tests (a `#[cfg(test)]` module at its end, or a file of
/// the test fabric under a `tests/` folder): they import the rooms they test, which is no part
/// of the structure.
fn structure_of<'a>(rel: &str, text: &'a str) -> &'a str {
    if rel.contains("/tests/") || rel.ends_with("/tests.rs") {
        return "";
    }
    text.find("#[cfg(test)]\nmod tests")
        .map_or(text, |at| &text[..at])
}

/// The module paths named in `text` (comments dropped) that start with `crate::`, `super::`,
/// `self::` or one of `children` (modules the file declares), grouped imports expanded: each
/// as its segments, the first one of the four kinds kept.
fn module_paths(text: &str, children: &[String]) -> Vec<Vec<String>> {
    fn expand(prefix: Vec<String>, tail: &str, out: &mut Vec<Vec<String>>) {
        let tail = tail.trim_start();
        if let Some(group) = tail.strip_prefix('{') {
            // The items up to the matching brace, split at top-level commas.
            let (mut depth, mut start) = (0, 0);
            for (i, c) in group.char_indices() {
                match c {
                    '{' => depth += 1,
                    '}' if depth == 0 => {
                        expand(prefix.clone(), &group[start..i], out);
                        return;
                    }
                    '}' => depth -= 1,
                    ',' if depth == 0 => {
                        expand(prefix.clone(), &group[start..i], out);
                        start = i + 1;
                    }
                    _ => {}
                }
            }
            return;
        }
        let mut segs = prefix;
        let mut rest = tail;
        loop {
            let name: String = rest
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_')
                .collect();
            if name.is_empty() {
                break;
            }
            rest = &rest[name.len()..];
            segs.push(name);
            match rest.strip_prefix("::") {
                Some(r) if r.starts_with('{') => return expand(segs, r, out),
                Some(r) => rest = r,
                None => break,
            }
        }
        out.push(segs);
    }
    let code: String = code_lines(text).map(|(_, l)| format!("{l}\n")).collect();
    let mut heads: Vec<String> = vec!["crate".into(), "super".into(), "self".into()];
    heads.extend(children.iter().cloned());
    let mut out = Vec::new();
    let bytes = code.as_bytes();
    let mut at = 0;
    while at < code.len() {
        let boundary =
            at == 0 || !(bytes[at - 1].is_ascii_alphanumeric() || b"_$:".contains(&bytes[at - 1]));
        let head = heads
            .iter()
            .find(|h| boundary && code[at..].starts_with(&format!("{h}::")));
        match head {
            Some(h) => {
                let tail = &code[at + h.len() + 2..];
                expand(vec![h.clone()], tail, &mut out);
                at += h.len() + 2;
            }
            None => at += 1,
        }
    }
    out
}

/// The modules `text` declares (`mod x;`, with any visibility or attributes).
fn declared_modules(text: &str) -> Vec<String> {
    code_lines(text)
        .filter_map(|(_, l)| {
            let l = l.trim();
            let decl = l.split("mod ").nth(1).filter(|_| {
                l.starts_with("mod ")
                    || l.starts_with("pub mod ")
                    || l.starts_with("pub(crate) mod ")
            })?;
            decl.strip_suffix(';').map(|m| m.trim().to_string())
        })
        .collect()
}

/// The files each file imports (see the module doc), keyed by path relative to src/.
fn import_graph(files: &[(String, String)]) -> BTreeMap<String, BTreeSet<String>> {
    let by_module: BTreeMap<Vec<String>, String> = files
        .iter()
        .map(|(rel, _)| (module_of(rel), rel.clone()))
        .collect();
    let mut graph = BTreeMap::new();
    for (rel, text) in files {
        let text = structure_of(rel, text);
        let here = module_of(rel);
        let children = declared_modules(text);
        let mut targets = BTreeSet::new();
        for path in module_paths(text, &children) {
            let mut abs = match path[0].as_str() {
                "crate" => Vec::new(),
                "self" => here.clone(),
                "super" => {
                    let mut m = here.clone();
                    m.pop();
                    m
                }
                _ => {
                    let mut m = here.clone();
                    m.push(path[0].clone());
                    m
                }
            };
            let mut rest = &path[1..];
            while rest.first().is_some_and(|s| s == "super") {
                abs.pop();
                rest = &rest[1..];
            }
            abs.extend(rest.iter().cloned());
            // The longest prefix that is a file's module: the module, or the one the item
            // named lives in.
            let target = (0..=abs.len()).rev().find_map(|n| by_module.get(&abs[..n]));
            if let Some(t) = target.filter(|t| *t != rel) {
                targets.insert(t.clone());
            }
        }
        graph.insert(rel.clone(), targets);
    }
    graph
}

/// The import circles of `graph`: each as the files it runs through, the first file the
/// smallest.
fn circles(graph: &BTreeMap<String, BTreeSet<String>>) -> Vec<Vec<String>> {
    // Strongly connected components (Tarjan), each of more than one file a circle.
    struct Walk<'a> {
        graph: &'a BTreeMap<String, BTreeSet<String>>,
        index: BTreeMap<&'a str, usize>,
        low: BTreeMap<&'a str, usize>,
        stack: Vec<&'a str>,
        on_stack: BTreeSet<&'a str>,
        found: Vec<Vec<String>>,
    }
    impl<'a> Walk<'a> {
        fn visit(&mut self, v: &'a str) {
            let i = self.index.len();
            self.index.insert(v, i);
            self.low.insert(v, i);
            self.stack.push(v);
            self.on_stack.insert(v);
            for w in self.graph.get(v).into_iter().flatten() {
                let w = w.as_str();
                if !self.index.contains_key(w) {
                    self.visit(w);
                    let lw = self.low[w];
                    let lv = self.low.get_mut(v).unwrap();
                    *lv = (*lv).min(lw);
                } else if self.on_stack.contains(w) {
                    let iw = self.index[w];
                    let lv = self.low.get_mut(v).unwrap();
                    *lv = (*lv).min(iw);
                }
            }
            if self.low[v] == self.index[v] {
                let mut component = Vec::new();
                while let Some(w) = self.stack.pop() {
                    self.on_stack.remove(w);
                    component.push(w.to_string());
                    if w == v {
                        break;
                    }
                }
                if component.len() > 1 {
                    component.sort();
                    self.found.push(component);
                }
            }
        }
    }
    let mut walk = Walk {
        graph,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on_stack: BTreeSet::new(),
        found: Vec::new(),
    };
    for v in graph.keys() {
        if !walk.index.contains_key(v.as_str()) {
            walk.visit(v);
        }
    }
    walk.found
}

/// Lines of `text` outside the allowed files that use `unsafe`.
fn unsafe_violations(rel: &str, text: &str) -> Vec<String> {
    if unsafe_allowed(rel) {
        return Vec::new();
    }
    code_lines(text)
        .filter(|(_, l)| {
            ["unsafe {", "unsafe fn", "unsafe impl", "unsafe extern"]
                .iter()
                .any(|u| l.contains(u))
        })
        .map(|(n, _)| format!("{rel}:{n}: `unsafe` outside abi/, verbs/ and buffer.rs"))
        .collect()
}

fn sources() -> Vec<(String, String)> {
    fn walk(dir: &Path, root: &Path, out: &mut Vec<(String, String)>) {
        for entry in std::fs::read_dir(dir).expect("src/ is readable") {
            let path: PathBuf = entry.unwrap().path();
            if path.is_dir() {
                walk(&path, root, out);
            } else if path.extension().is_some_and(|e| e == "rs") {
                let rel = path
                    .strip_prefix(root)
                    .unwrap()
                    .to_string_lossy()
                    .into_owned();
                out.push((rel, std::fs::read_to_string(&path).unwrap()));
            }
        }
    }
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut out = Vec::new();
    if root.is_dir() {
        walk(&root, &root, &mut out);
    }
    out.sort();
    out
}

#[test]
fn imports_only_point_down_and_unsafe_stays_in_its_places() {
    let files = sources();
    if files.is_empty() {
        // A staged test binary (the Soft-RoCE tier) has no source tree next to it.
        eprintln!("skipped: no source tree here");
        return;
    }
    assert!(files.len() > 20, "found only {} source files", files.len());
    let mut bad = Vec::new();
    for (rel, text) in &files {
        bad.extend(import_violations(rel, text));
        bad.extend(unsafe_violations(rel, text));
        let lines = text.lines().count();
        if lines > MAX_LINES {
            bad.push(format!("{rel}: {lines} lines (at most {MAX_LINES})"));
        }
    }
    for circle in circles(&import_graph(&files)) {
        bad.push(format!("import circle: {}", circle.join(" <-> ")));
    }
    assert!(
        bad.is_empty(),
        "structure rules broken:\n{}",
        bad.join("\n")
    );
}

/// Asserts that the import rules catch `text` in `rel` with a message containing `rule`.
fn caught(rel: &str, text: &str, rule: &str) {
    let found = import_violations(rel, text);
    assert!(
        found.iter().any(|v| v.contains(rule)),
        "{rel}: {text:?} not caught by the rule `{rule}`: {found:?}"
    );
}

#[test]
fn the_checker_catches_planted_violations() {
    // Upward, in a use line, a grouped import and a path in code.
    caught(
        "verbs/x.rs",
        "use crate::transport::Completion;\n",
        "a higher layer",
    );
    caught(
        "config.rs",
        "use crate::{error::Result, oob::Handle};\n",
        "a higher layer",
    );
    caught(
        "oob/x.rs",
        "fn f() { crate::plugin::get(); }\n",
        "a higher layer",
    );
    caught("config.rs", "use crate::log::INIT;\n", "a higher layer");
    // A transport naming its sibling, or the room above both.
    caught(
        "transport/tcp.rs",
        "use crate::transport::verbs::wire;\n",
        "transport::tcp imports transport::verbs",
    );
    caught(
        "transport/verbs/send.rs",
        "use crate::transport::either::AnySender;\n",
        "transport::verbs imports transport::either",
    );
    // The contract naming a transport, and the core naming one.
    caught(
        "transport/mod.rs",
        "pub(crate) use verbs::Look;\n",
        "the transport contract names transport `verbs`",
    );
    caught(
        "transport/registry.rs",
        "fn f() -> tcp::TcpSender { }\n",
        "the transport contract names transport `tcp`",
    );
    caught(
        "plugin/comm.rs",
        "use crate::transport::verbs::VerbsSender;\n",
        "only transport/either.rs may name transport `verbs`",
    );
    // abi beyond the core and the leaves; report into a transport or libibverbs.
    caught(
        "abi/slots.rs",
        "use crate::transport::MAX_RECVS;\n",
        "it may import only",
    );
    caught(
        "abi/mod.rs",
        "use crate::oob::HANDLE_SIZE;\n",
        "it may import only",
    );
    caught(
        "report.rs",
        "use crate::verbs::VerbsLib;\n",
        "it may import only",
    );
    caught(
        "report.rs",
        "use crate::transport::verbs::profile;\n",
        "it may import only",
    );
    // Downward, sideways within a layer, the allowed rooms, and comments are fine.
    assert!(import_violations(
        "transport/verbs/send.rs",
        "use crate::transport::{Completion, MAX_RECVS};\nuse crate::verbs::nic::Nic;\n\
         // crate::plugin is above us\n"
    )
    .is_empty());
    assert!(import_violations(
        "transport/either.rs",
        "use super::tcp::TcpSender;\nuse super::verbs::VerbsSender;\n"
    )
    .is_empty());
    assert!(
        import_violations("transport/mod.rs", "pub(crate) mod tcp;\n// tcp:: here\n").is_empty()
    );
    assert!(import_violations(
        "abi/tables.rs",
        "use crate::plugin::{self, NAME};\nuse crate::ffi::*;\nuse crate::error::Result;\n"
    )
    .is_empty());
    assert!(import_violations(
        "report.rs",
        "use crate::plugin::Plugin;\nuse crate::config::Config;\n\
         pub use crate::transport::facts::Port;\n"
    )
    .is_empty());
    caught("mystery/x.rs", "", "has no layer");
    // unsafe outside its places, and not in comments.
    assert_eq!(
        unsafe_violations("plugin/mod.rs", "let x = unsafe { f() };\n").len(),
        1
    );
    assert!(unsafe_violations("plugin/mod.rs", "// no unsafe { here }\n").is_empty());
    assert!(unsafe_violations("verbs/dma.rs", "let x = unsafe { f() };\n").is_empty());
}

/// The circles of a planted tree of (file, text).
fn planted(tree: &[(&str, &str)]) -> Vec<Vec<String>> {
    let files: Vec<(String, String)> = tree
        .iter()
        .map(|(r, t)| (r.to_string(), t.to_string()))
        .collect();
    circles(&import_graph(&files))
}

#[test]
fn the_checker_finds_planted_import_circles() {
    // Two siblings naming each other, through `super::` and a grouped `crate::` import.
    let two = planted(&[
        ("transport/verbs/mod.rs", "mod a;\nmod b;\n"),
        ("transport/verbs/a.rs", "use super::b::Thing;\n"),
        (
            "transport/verbs/b.rs",
            "use crate::transport::{verbs::a::Other, MAX};\n",
        ),
        ("transport/mod.rs", "pub(crate) const MAX: usize = 8;\n"),
    ]);
    assert_eq!(two, [vec!["transport/verbs/a.rs", "transport/verbs/b.rs"]]);
    // Three, one of them through an item of a parent that re-exports a child's.
    let three = planted(&[
        (
            "x/mod.rs",
            "mod y;\npub(crate) use y::Y;\npub(crate) struct X;\n",
        ),
        ("x/y.rs", "fn f() -> crate::z::Z { }\n"),
        ("z.rs", "use crate::x::X;\n"),
    ]);
    assert_eq!(three, [vec!["x/mod.rs", "x/y.rs", "z.rs"]]);
    // Downward only, and unit tests at a file's end, are no circle.
    assert!(planted(&[
        ("x/mod.rs", "mod y;\nuse y::Y;\n"),
        (
            "x/y.rs",
            "use crate::z::Z;\n#[cfg(test)]\nmod tests {\n    use crate::x::X;\n}\n"
        ),
        ("z.rs", "pub(crate) struct Z;\n"),
    ])
    .is_empty());
}
