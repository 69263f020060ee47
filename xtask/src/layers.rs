//! The host's layering, checked: no module of `kvpages-host` uses a module that uses it back,
//! directly or through others (ARCHITECTURE.md, the host's code map and its invariant).
//!
//! A module is a top-level file or directory of `crates/host/src`; it uses another when its
//! code (comments aside) names `crate::OTHER`, alone or in a `use crate::{...}` group.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// Each top-level module of the crate at `src` and the other top-level modules it uses.
pub fn graph(src: &Path) -> BTreeMap<String, BTreeSet<String>> {
    let mut files = Vec::new();
    collect(src, &mut files);
    let top = |p: &Path| -> String {
        let rel = p.strip_prefix(src).expect("below src");
        let first = rel.components().next().expect("a file").as_os_str().to_string_lossy().into_owned();
        first.trim_end_matches(".rs").to_owned()
    };
    let mut modules: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for f in &files {
        modules.entry(top(f)).or_default();
    }
    for f in &files {
        let from = top(f);
        let code = strip_comments(&std::fs::read_to_string(f).expect("readable source"));
        for to in used(&code) {
            if to != from && modules.contains_key(&to) {
                modules.get_mut(&from).expect("listed").insert(to);
            }
        }
    }
    modules.remove("lib");
    modules.remove("main");
    for deps in modules.values_mut() {
        deps.remove("lib");
    }
    modules
}

fn collect(dir: &Path, out: &mut Vec<std::path::PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("readable dir") {
        let path = entry.expect("dir entry").path();
        if path.is_dir() {
            collect(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The code without `//` comments (doc comments name modules they do not use).
fn strip_comments(src: &str) -> String {
    src.lines().map(|l| l.split_once("//").map_or(l, |(code, _)| code)).collect::<Vec<_>>().join("\n")
}

/// The modules `code` names after `crate::`, including each name of a `crate::{a, b::c}` group.
fn used(code: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let ident = |s: &str| s.chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect::<String>();
    for (i, _) in code.match_indices("crate::") {
        let rest = &code[i + "crate::".len()..];
        if let Some(group) = rest.strip_prefix('{') {
            // Top-level names of the group: at brace depth 0, after `{` or `,`.
            let (mut depth, mut start) = (0usize, true);
            for (j, c) in group.char_indices() {
                match c {
                    '{' => depth += 1,
                    '}' if depth == 0 => break,
                    '}' => depth -= 1,
                    ',' if depth == 0 => start = true,
                    c if start && !c.is_whitespace() => {
                        out.insert(ident(&group[j..]));
                        start = false;
                    }
                    _ => {}
                }
            }
        } else {
            out.insert(ident(rest));
        }
    }
    out.remove("");
    out
}

/// A cycle of `graph` (its modules in order), if it has one.
pub fn cycle(graph: &BTreeMap<String, BTreeSet<String>>) -> Option<Vec<String>> {
    // Depth-first search; a module met again while still on the path closes a cycle.
    fn visit<'a>(
        m: &'a str,
        graph: &'a BTreeMap<String, BTreeSet<String>>,
        path: &mut Vec<&'a str>,
        done: &mut BTreeSet<&'a str>,
    ) -> Option<Vec<String>> {
        if let Some(at) = path.iter().position(|p| *p == m) {
            return Some(path[at..].iter().map(|s| s.to_string()).chain([m.to_owned()]).collect());
        }
        if !done.insert(m) {
            return None;
        }
        path.push(m);
        for next in graph.get(m).into_iter().flatten() {
            if let Some(c) = visit(next, graph, path, done) {
                return Some(c);
            }
        }
        path.pop();
        None
    }
    let mut done = BTreeSet::new();
    graph.keys().find_map(|m| visit(m, graph, &mut Vec::new(), &mut done))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uses_are_read_from_paths_and_groups_not_comments() {
        let code = strip_comments(
            "use crate::api::X;\nuse crate::{engine::{A, B}, durable, plugin::Calls};\n// crate::server\nlet x = crate::telemetry::f();",
        );
        let got: Vec<String> = used(&code).into_iter().collect();
        assert_eq!(got, ["api", "durable", "engine", "plugin", "telemetry"]);
    }

    #[test]
    fn a_cycle_is_found_and_a_layering_passes() {
        let g = |edges: &[(&str, &str)]| {
            let mut g: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
            for (a, b) in edges {
                g.entry(a.to_string()).or_default().insert(b.to_string());
                g.entry(b.to_string()).or_default();
            }
            g
        };
        assert_eq!(cycle(&g(&[("server", "app"), ("app", "engine"), ("server", "engine")])), None);
        let c = cycle(&g(&[("server", "app"), ("app", "metrics"), ("metrics", "server")])).unwrap();
        assert_eq!(c, ["app", "metrics", "server", "app"]);
    }

    #[test]
    fn the_host_has_no_import_cycle() {
        let g = graph(&crate::root().join("crates/host/src"));
        for m in ["app", "server", "routes", "telemetry", "durable", "plugin"] {
            assert!(g.contains_key(m), "no module {m} in {g:?}");
        }
        assert!(g["server"].contains("app") && g["app"].contains("engine"), "{g:?}");
        assert_eq!(cycle(&g), None, "the host's modules use each other in a circle: {g:?}");
    }
}
