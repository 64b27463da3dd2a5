//! The structure design.md describes, checked on the source: imports only point down the
//! layers (`abi`/`report` -> `plugin` -> `transport` -> `oob` -> `verbs` -> `log` -> `config`
//! -> the shared leaves); `abi` imports only `plugin` and the shared leaves, `report` only
//! `plugin`, `config`, the transports' facts and the leaves; the transport contract
//! (`transport/mod.rs`, `registry.rs`, `facts.rs`) names no transport, `transport/either.rs`
//! is the one place that names both, and the two transports never import each other or
//! `either`; `unsafe` appears only in `abi/`, `verbs/` and the buffer type `abi` hands down;
//! and no source file grows past what one can read in a sitting. Each rule is also run on a
//! planted violation, so a checker that can no longer fail is noticed.

use std::path::{Path, PathBuf};

/// A module's layer: higher layers may import lower ones and their own, never higher.
fn layer(module: &str) -> Option<u32> {
    Some(match module {
        "abi" | "report" => 9,
        "plugin" => 8,
        "transport" => 7,
        "oob" => 6,
        "verbs" => 5,
        "log" => 4,
        "config" => 3,
        "error" | "buffer" | "random" | "sysfs" | "ffi" => 1,
        _ => return None,
    })
}

/// The modules below everything, which any layer may use.
const LEAVES: [&str; 6] = ["error", "buffer", "random", "sysfs", "ffi", "log"];

/// What a top module may import besides its own modules, where the layers alone allow more:
/// the C boundary only the core and the leaves; the info report the core, the settings and
/// the transports' facts (data), never a transport's internals.
fn allowed_imports(top: &str) -> Option<&'static [&'static str]> {
    match top {
        "abi" => Some(&["plugin"]),
        "report" => Some(&["plugin", "config", "transport::facts"]),
        _ => None,
    }
}

/// Files of the transport contract: they name no transport.
fn is_contract(rel: &str) -> bool {
    matches!(
        rel,
        "transport/mod.rs" | "transport/registry.rs" | "transport/facts.rs"
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
