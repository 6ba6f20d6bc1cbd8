//! Snapshot hygiene: no pending insta snapshots left lying around, and no snapshot file that no test refers to.

use std::fs;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};

use crate::parse::snapshot_name;

/// Directory, relative to the repository root, where the fixtures keep their insta snapshots.
pub const SNAPSHOT_DIR: &str = "fixtures/snapshots";
/// Directory, relative to the repository root, whose `.rs` files may refer to those snapshots.
pub const FIXTURE_SOURCES: &str = "fixtures";

/// Problems found by [`check`], as paths relative to the repository root.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Findings {
    /// `*.snap.new` and `*.pending-snap` files: snapshots insta wrote but nobody reviewed.
    pub pending: Vec<PathBuf>,
    /// `*.snap` files under [`SNAPSHOT_DIR`] whose name no fixture source mentions.
    pub unreferenced: Vec<PathBuf>,
}

impl Findings {
    /// Whether nothing was found.
    pub fn is_clean(&self) -> bool {
        self.pending.is_empty() && self.unreferenced.is_empty()
    }
}

/// Checks the whole repository below `root`, skipping `root/target` and every `.git` directory.
pub fn check(root: &Path) -> Result<Findings> {
    let skip = root.join("target");
    let mut all = Vec::new();
    walk(root, &skip, &mut all)?;
    let pending = all
        .iter()
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.ends_with(".snap.new") || n.ends_with(".pending-snap"))
        })
        .map(|p| relative(root, p))
        .collect();

    let snapshot_dir = root.join(SNAPSHOT_DIR);
    let sources_dir = root.join(FIXTURE_SOURCES);
    let mut sources = Vec::new();
    for path in all.iter().filter(|p| p.starts_with(&sources_dir) && p.extension().is_some_and(|e| e == "rs")) {
        sources.push(fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?);
    }
    let unreferenced = all
        .iter()
        .filter(|p| p.starts_with(&snapshot_dir))
        .filter(|p| {
            // A file without a usable name (not `*.snap`) is not a snapshot and is left to the pending check above.
            p.file_name()
                .and_then(|n| n.to_str())
                .and_then(snapshot_name)
                .is_some_and(|name| !is_referenced(name, &sources))
        })
        .map(|p| relative(root, p))
        .collect();
    Ok(Findings { pending, unreferenced })
}

/// Whether the snapshot `name` is referenced: the quoted string `"<name>"` appears in one of the sources, as it does in
/// `insta::assert_snapshot!("<name>", ...)`.
pub fn is_referenced(name: &str, sources: &[String]) -> bool {
    let quoted = format!("\"{name}\"");
    sources.iter().any(|s| s.contains(&quoted))
}

/// Collects every regular file below `dir` into `out`, not following symbolic links (they could loop).
fn walk(dir: &Path, skip: &Path, out: &mut Vec<PathBuf>) -> Result<()> {
    for entry in fs::read_dir(dir).with_context(|| format!("listing {}", dir.display()))? {
        let entry = entry?;
        let path = entry.path();
        let kind = entry.file_type()?;
        if kind.is_dir() {
            if path != skip && entry.file_name() != ".git" {
                walk(&path, skip, out)?;
            }
        } else if kind.is_file() {
            out.push(path);
        }
    }
    Ok(())
}

fn relative(root: &Path, path: &Path) -> PathBuf {
    path.strip_prefix(root).unwrap_or(path).to_path_buf()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A scratch directory removed on drop, so that a failing test does not leave litter behind.
    struct Scratch(PathBuf);

    impl Scratch {
        fn new(tag: &str) -> Self {
            let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
            let dir = std::env::temp_dir().join(format!("xtask-{tag}-{}-{nanos}", std::process::id()));
            fs::create_dir_all(&dir).unwrap();
            Scratch(dir)
        }

        fn write(&self, rel: &str, text: &str) {
            let path = self.0.join(rel);
            fs::create_dir_all(path.parent().unwrap()).unwrap();
            fs::write(path, text).unwrap();
        }
    }

    impl Drop for Scratch {
        fn drop(&mut self) {
            let _ = fs::remove_dir_all(&self.0);
        }
    }

    #[test]
    fn quoted_name_counts_as_reference() {
        let sources = vec!["insta::assert_snapshot!(\"softmax_row\", text);".to_owned()];
        assert!(is_referenced("softmax_row", &sources));
        assert!(!is_referenced("softmax", &sources));
        assert!(!is_referenced("row", &sources));
    }

    #[test]
    fn clean_tree_passes() {
        let s = Scratch::new("clean");
        s.write("fixtures/src/lib.rs", "insta::assert_snapshot!(\"causal_4x4\", t);");
        s.write("fixtures/snapshots/attnproof_fixtures__causal_4x4.snap", "---\n");
        s.write("target/debug/leftover.snap.new", "ignored: build output");
        assert_eq!(check(&s.0).unwrap(), Findings::default());
    }

    #[test]
    fn finds_pending_and_unreferenced() {
        let s = Scratch::new("dirty");
        s.write("fixtures/src/lib.rs", "insta::assert_snapshot!(\"kept\", t);");
        s.write("fixtures/snapshots/attnproof_fixtures__kept.snap", "---\n");
        s.write("fixtures/snapshots/attnproof_fixtures__orphan.snap", "---\n");
        s.write("fixtures/snapshots/attnproof_fixtures__kept.snap.new", "---\n");
        s.write("oracle/src/.pending-snap", "{}\n");
        let found = check(&s.0).unwrap();
        let mut pending = found.pending.clone();
        pending.sort();
        assert_eq!(
            pending,
            vec![
                PathBuf::from("fixtures/snapshots/attnproof_fixtures__kept.snap.new"),
                PathBuf::from("oracle/src/.pending-snap"),
            ]
        );
        assert_eq!(found.unreferenced, vec![PathBuf::from("fixtures/snapshots/attnproof_fixtures__orphan.snap")]);
        assert!(!found.is_clean());
    }
}
