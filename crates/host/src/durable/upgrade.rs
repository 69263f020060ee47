//! Opening a data directory: its format version checked, and an older format upgraded in place
//! by crash-safe steps (the step from format 1 is here too).

use std::fs::{self, File};
use std::io;
use std::path::Path;
use std::time::Instant;

use super::format::{FORMATS, Formats, Upgrade, format_text, names, numbered, parse_format, sync_dir};
use super::lock::LOCK_FILE;
use super::snapshot::{parse_snapshot, write_atomically, write_snapshot_file};

/// Opens (creating if needed) a data directory and checks its format version; an older
/// version is upgraded in place first (see [`open_dir_with`]).
pub fn open_dir(dir: &Path) -> Result<(), String> {
    open_dir_with(dir, &FORMATS, &mut |_| Ok(()))
}

/// [`open_dir`] with a version table, and a hook called before every change to the disk
/// (tests make it fail to stand in for a crash at that point).
///
/// An upgrade from version N is crash-safe in three phases, each resumable from what is on
/// disk: (1) the step writes N + 1's files into `upgrade/`, every file is fsynced, then
/// `upgrade/FORMAT` is written — from here on the upgrade only goes forward; (2) the files of
/// format N move into `format-N/` (a backup for going back to the older release), `FORMAT`
/// last; (3) the new files move into place and `upgrade/FORMAT` is renamed to `FORMAT`, the
/// atomic switch. A crash in phase 1 leaves format N as it was (the staging is discarded); a
/// crash in phases 2 and 3 is finished by the next start. A version newer than this build's,
/// or one without a step, is refused.
pub fn open_dir_with(
    dir: &Path,
    formats: &Formats,
    fault: &mut dyn FnMut(&str) -> io::Result<()>,
) -> Result<(), String> {
    let at = |what: &Path, e: io::Error| format!("{}: {e}", what.display());
    let format = dir.join("FORMAT");
    let staging = dir.join(STAGING);
    if !dir.exists() {
        fs::create_dir_all(dir).map_err(|e| format!("cannot create --data-dir {}: {e}", dir.display()))?;
    }
    loop {
        let version = match fs::read_to_string(&format) {
            Ok(text) => parse_format(dir, &text)?,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                if staging.join("FORMAT").exists() {
                    // Phase 3 was interrupted: the old files are in their backup already.
                    finish_upgrade(dir, fault)
                        .map_err(|e| format!("finishing the upgrade of {}: {e}", dir.display()))?;
                    continue;
                }
                return write_first_format(dir, formats.current, fault);
            }
            Err(e) => return Err(at(&format, e)),
        };
        if version == formats.current {
            if staging.exists() {
                // The switch happened; only the empty staging directory is left.
                fault("remove staging").map_err(|e| at(&staging, e))?;
                fs::remove_dir_all(&staging).and_then(|()| sync_dir(dir)).map_err(|e| at(&staging, e))?;
            }
            return Ok(());
        }
        let step = step_from(dir, version, formats)?;
        tracing::info!("upgrading --data-dir {} from format {version} to {}", dir.display(), version + 1);
        let started = Instant::now();
        upgrade_step(dir, step, fault)
            .map_err(|e| format!("upgrading {} from format {version}: {e}; nothing was lost", dir.display()))?;
        tracing::info!(
            seconds = started.elapsed().as_secs_f64(),
            "upgraded --data-dir {} to format {}; the format-{version} files are kept in {} (delete it once \
             you will not go back)",
            dir.display(),
            version + 1,
            dir.join(format!("format-{version}")).display()
        );
    }
}

/// The `FORMAT` of a new data directory, at `version`; a directory with other files in it is
/// refused.
fn write_first_format(dir: &Path, version: u32, fault: &mut dyn FnMut(&str) -> io::Result<()>) -> Result<(), String> {
    let at = |what: &Path, e: io::Error| format!("{}: {e}", what.display());
    let format = dir.join("FORMAT");
    // A `FORMAT.tmp` alone is a first start that crashed before its FORMAT was in place.
    let stray = names(dir).map_err(|e| at(dir, e))?.iter().any(|n| n != "FORMAT.tmp" && n != LOCK_FILE);
    if stray {
        return Err(format!(
            "--data-dir {} is not empty and has no FORMAT file: it is not a kvpages data directory",
            dir.display()
        ));
    }
    fault("write FORMAT").map_err(|e| at(&format, e))?;
    write_atomically(dir, "FORMAT", format_text(version).as_bytes()).map_err(|e| at(&format, e))
}

/// The step that upgrades `version`, or why there is none: it is newer than this build's, or
/// too old for any step.
fn step_from<'a>(dir: &Path, version: u32, formats: &'a Formats) -> Result<&'a Upgrade, String> {
    if version > formats.current {
        return Err(format!(
            "--data-dir {} has format version {version}, written by a newer kvpages; this kvpages reads \
             version {} (and upgrades older ones). Run the release that wrote it, or point --data-dir elsewhere",
            dir.display(),
            formats.current
        ));
    }
    formats.upgrades.iter().find(|u| u.from == version).ok_or_else(|| {
        format!(
            "--data-dir {} has format version {version}, which this kvpages cannot upgrade (it reads version \
             {} and upgrades from {}). Upgrade it with an intermediate release first",
            dir.display(),
            formats.current,
            if formats.upgrades.is_empty() {
                "none".to_owned()
            } else {
                formats.upgrades.iter().map(|u| u.from.to_string()).collect::<Vec<_>>().join(", ")
            }
        )
    })
}

/// Where an upgrade writes the new format's files before the switch.
const STAGING: &str = "upgrade";

/// Phases 1 and 2 of an upgrade by one step (see [`open_dir_with`]), then phase 3.
fn upgrade_step(dir: &Path, step: &Upgrade, fault: &mut dyn FnMut(&str) -> io::Result<()>) -> Result<(), String> {
    let at = |what: &Path, e: io::Error| format!("{}: {e}", what.display());
    let staging = dir.join(STAGING);
    let backup_name = format!("format-{}", step.from);
    let backup = dir.join(&backup_name);
    if !staging.join("FORMAT").exists() {
        // Phase 1 (again, if a crash interrupted it: what it left is discarded).
        if backup.exists() {
            return Err(format!(
                "{} already exists (from an earlier upgrade?); move it out of the data directory first",
                backup.display()
            ));
        }
        if staging.exists() {
            fault("remove staging").map_err(|e| at(&staging, e))?;
            fs::remove_dir_all(&staging).map_err(|e| at(&staging, e))?;
        }
        fault("stage").map_err(|e| at(&staging, e))?;
        fs::create_dir(&staging).map_err(|e| at(&staging, e))?;
        (step.run)(dir, &staging)?;
        for name in names(&staging).map_err(|e| at(&staging, e))? {
            let path = staging.join(&name);
            File::open(&path).and_then(|f| f.sync_all()).map_err(|e| at(&path, e))?;
        }
        fault("write staged FORMAT").map_err(|e| at(&staging, e))?;
        write_atomically(&staging, "FORMAT", format_text(step.from + 1).as_bytes())
            .and_then(|()| sync_dir(dir))
            .map_err(|e| at(&staging, e))?;
    }
    // Phase 2: the old files into the backup, FORMAT last (its absence marks the phase done).
    if !backup.exists() {
        fault("create backup").map_err(|e| at(&backup, e))?;
        fs::create_dir(&backup).and_then(|()| sync_dir(dir)).map_err(|e| at(&backup, e))?;
    }
    for name in names(dir).map_err(|e| at(dir, e))? {
        let keep = name == STAGING
            || name == "FORMAT"
            || name == LOCK_FILE
            || name.to_str().is_some_and(|n| n.starts_with("format-") && dir.join(n).is_dir());
        if !keep {
            fault("move old file").map_err(|e| at(dir, e))?;
            fs::rename(dir.join(&name), backup.join(&name)).map_err(|e| at(&dir.join(&name), e))?;
        }
    }
    sync_dir(&backup).map_err(|e| at(&backup, e))?;
    fault("move old FORMAT").map_err(|e| at(dir, e))?;
    fs::rename(dir.join("FORMAT"), backup.join("FORMAT"))
        .and_then(|()| sync_dir(&backup))
        .and_then(|()| sync_dir(dir))
        .map_err(|e| at(dir, e))?;
    finish_upgrade(dir, fault).map_err(|e| at(dir, e))
}

/// Phase 3: the staged files into place, then the switch of `FORMAT`.
fn finish_upgrade(dir: &Path, fault: &mut dyn FnMut(&str) -> io::Result<()>) -> io::Result<()> {
    let staging = dir.join(STAGING);
    for name in names(&staging)? {
        if name != "FORMAT" {
            fault("move new file")?;
            fs::rename(staging.join(&name), dir.join(&name))?;
        }
    }
    sync_dir(dir)?;
    fault("switch FORMAT")?;
    fs::rename(staging.join("FORMAT"), dir.join("FORMAT"))?;
    sync_dir(&staging)?;
    sync_dir(dir)?;
    fault("remove staging")?;
    fs::remove_dir(&staging)?;
    sync_dir(dir)
}

/// Format 1 → 2. Only the snapshots' core bytes differ: format 2 holds the core's snapshot
/// format 2 (its key table and page tables as fixed-width records, ~3× faster to write through
/// the plugin; see `kvpages-core`'s `state/snapshot.rs`). Each snapshot is restored (the core
/// still reads its format 1) and written again; the log segments, and any other file, are
/// copied as they are. So is a snapshot that does not restore: recovery then refuses it with
/// its usual advice, as it did before the upgrade (the core reads both snapshot formats, so a
/// copied one is no less readable).
pub(super) fn upgrade_from_1(dir: &Path, staging: &Path) -> Result<(), String> {
    let at = |what: &Path, e: io::Error| format!("{}: {e}", what.display());
    let snapshots = numbered(dir, "snapshot-", ".bin").map_err(|e| at(dir, e))?;
    for name in names(dir).map_err(|e| at(dir, e))? {
        let path = dir.join(&name);
        if name == "FORMAT" || name == STAGING || name == LOCK_FILE || path.is_dir() {
            continue;
        }
        if let Some(&(seq, _)) = snapshots.iter().find(|(_, p)| *p == path) {
            let bytes = fs::read(&path).map_err(|e| at(&path, e))?;
            let restored = parse_snapshot(&bytes, seq)
                .and_then(|body| kvpages_core::Core::restore(body).map_err(|e| e.to_string()));
            match restored {
                Ok(core) => {
                    write_snapshot_file(staging, seq, &core.snapshot()).map_err(|e| at(staging, e))?;
                    continue;
                }
                Err(why) => tracing::warn!("upgrade: {} does not restore ({why}); copied as it is", path.display()),
            }
        }
        fs::copy(&path, staging.join(&name)).map_err(|e| at(&path, e))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use super::*;
    use crate::durable::format::FORMAT_VERSION;
    use crate::durable::recover;
    use crate::durable::tests::tmp;

    #[test]
    fn an_unknown_format_is_refused() {
        let d = tmp("format");
        open_dir(&d).unwrap();
        assert_eq!(fs::read_to_string(d.join("FORMAT")).unwrap(), format_text(FORMAT_VERSION));
        open_dir(&d).unwrap();
        fs::write(d.join("FORMAT"), "kvpages-data 99\n").unwrap();
        let err = open_dir(&d).unwrap_err();
        assert!(
            err.contains(&format!(
                "has format version 99, written by a newer kvpages; this kvpages reads version {FORMAT_VERSION}"
            )),
            "{err}"
        );
        // Garbage, and near misses of the real text, are not guessed at.
        for text in [
            "",
            "hello\n",
            "kvpages-data\n",
            "kvpages-data 1",
            "kvpages-data 01\n",
            "kvpages-data -1\n",
            "kvpages-data 1 \n",
            "kvpages-data x\n",
        ] {
            fs::write(d.join("FORMAT"), text).unwrap();
            let err = open_dir(&d).unwrap_err();
            assert!(
                err.contains(&format!("its FORMAT file reads {text:?}, not \"kvpages-data N\"")),
                "{text:?}: {err}"
            );
        }
        // An older version with no step to upgrade it.
        fs::write(d.join("FORMAT"), "kvpages-data 1\n").unwrap();
        let table = Formats { current: 3, upgrades: &[Upgrade { from: 2, run: v2_to_v3 }] };
        let err = open_dir_with(&d, &table, &mut |_| Ok(())).unwrap_err();
        assert!(
            err.contains(
                "format version 1, which this kvpages cannot upgrade (it reads version 3 and upgrades from 2)"
            ),
            "{err}"
        );
        let e = tmp("stray");
        fs::create_dir_all(&e).unwrap();
        fs::write(e.join("x"), "").unwrap();
        assert!(open_dir(&e).unwrap_err().contains("not a kvpages data directory"));
        // A first start that crashed while writing FORMAT is not a stray file.
        fs::remove_file(e.join("x")).unwrap();
        fs::write(e.join("FORMAT.tmp"), "kvpages-").unwrap();
        open_dir(&e).unwrap();
        assert_eq!(names(&e).unwrap(), ["FORMAT"]);
        fs::remove_dir_all(&d).unwrap();
        fs::remove_dir_all(&e).unwrap();
    }

    // Two made-up formats for the upgrade machinery (the real step is tested on the golden
    // directory, `tests/data_format.rs`): format 2 prefixes every file with "v2:", format 3
    // renames `x` to `x.3`.
    fn v1_to_v2(dir: &Path, staging: &Path) -> Result<(), String> {
        for name in names(dir).unwrap() {
            let path = dir.join(&name);
            if path.is_file() && name != "FORMAT" {
                let mut bytes = b"v2:".to_vec();
                bytes.extend(fs::read(&path).unwrap());
                fs::write(staging.join(&name), bytes).unwrap();
            }
        }
        Ok(())
    }

    fn v2_to_v3(dir: &Path, staging: &Path) -> Result<(), String> {
        for name in names(dir).unwrap() {
            let path = dir.join(&name);
            if path.is_file() && name != "FORMAT" {
                fs::copy(&path, staging.join(format!("{}.3", name.to_str().unwrap()))).unwrap();
            }
        }
        Ok(())
    }

    const TEST_FORMATS: Formats =
        Formats { current: 3, upgrades: &[Upgrade { from: 1, run: v1_to_v2 }, Upgrade { from: 2, run: v2_to_v3 }] };

    /// Every file under `dir` with its bytes, by relative path.
    fn tree(dir: &Path) -> Vec<(String, Vec<u8>)> {
        let mut out = Vec::new();
        for name in names(dir).unwrap() {
            let path = dir.join(&name);
            let name = name.to_str().unwrap().to_owned();
            if path.is_dir() {
                out.extend(tree(&path).into_iter().map(|(n, b)| (format!("{name}/{n}"), b)));
            } else {
                out.push((name, fs::read(&path).unwrap()));
            }
        }
        out
    }

    /// `v1_dir`'s files as an upgrade keeps them, by relative path.
    fn v1_backup() -> Vec<(String, Vec<u8>)> {
        [
            ("FORMAT", "kvpages-data 1\n"),
            ("snapshot-00000000000000000007.bin", "snap"),
            ("wal-00000000000000000001.log", "log"),
        ]
        .map(|(name, bytes)| (format!("format-1/{name}"), bytes.as_bytes().to_vec()))
        .to_vec()
    }

    fn v1_dir(name: &str) -> PathBuf {
        let d = tmp(name);
        open_dir_with(&d, &Formats { current: 1, upgrades: &[] }, &mut |_| Ok(())).unwrap();
        fs::write(d.join("wal-00000000000000000001.log"), b"log").unwrap();
        fs::write(d.join("snapshot-00000000000000000007.bin"), b"snap").unwrap();
        d
    }

    #[test]
    fn an_older_format_is_upgraded_step_by_step_and_kept_as_a_backup() {
        let d = v1_dir("upgrade");
        let mut points = Vec::new();
        open_dir_with(&d, &TEST_FORMATS, &mut |p| {
            points.push(p.to_owned());
            Ok(())
        })
        .unwrap();
        let t = |s: &str| s.as_bytes().to_vec();
        let want = [
            vec![("FORMAT".to_owned(), t("kvpages-data 3\n"))],
            v1_backup(),
            vec![
                ("format-2/FORMAT".into(), t("kvpages-data 2\n")),
                ("format-2/snapshot-00000000000000000007.bin".into(), t("v2:snap")),
                ("format-2/wal-00000000000000000001.log".into(), t("v2:log")),
                ("snapshot-00000000000000000007.bin.3".into(), t("v2:snap")),
                ("wal-00000000000000000001.log.3".into(), t("v2:log")),
            ],
        ]
        .concat();
        assert_eq!(tree(&d), want);
        // Two steps, each with the same points.
        let step = [
            "stage",
            "write staged FORMAT",
            "create backup",
            "move old file",
            "move old file",
            "move old FORMAT",
            "move new file",
            "move new file",
            "switch FORMAT",
            "remove staging",
        ];
        assert_eq!(points, [step, step].concat());
        // Opening again changes nothing; this build's own FORMAT 1 is now refused as newer.
        open_dir_with(&d, &TEST_FORMATS, &mut |_| panic!("no change expected")).unwrap();
        assert_eq!(tree(&d), want);
        assert!(open_dir(&d).unwrap_err().contains("format version 3, written by a newer kvpages"));
        // An upgrade refuses to overwrite an earlier backup.
        let e = v1_dir("upgrade-backup");
        fs::create_dir(e.join("format-1")).unwrap();
        let err = open_dir_with(&e, &TEST_FORMATS, &mut |_| Ok(())).unwrap_err();
        assert!(err.contains("format-1 already exists"), "{err}");
        assert_eq!(fs::read_to_string(e.join("FORMAT")).unwrap(), "kvpages-data 1\n");
        fs::remove_dir_all(&d).unwrap();
        fs::remove_dir_all(&e).unwrap();
    }

    #[test]
    fn the_step_from_format_1_copies_a_snapshot_that_does_not_restore() {
        // `v1_dir`'s snapshot is the bytes "snap": recovery must go on refusing it with its
        // advice, as format 1 did, instead of the upgrade failing on it.
        let d = v1_dir("upgrade-real");
        open_dir(&d).unwrap();
        let t = |s: &str| s.as_bytes().to_vec();
        let want = [
            vec![("FORMAT".to_owned(), format_text(FORMAT_VERSION).into_bytes())],
            v1_backup(),
            vec![
                ("snapshot-00000000000000000007.bin".into(), t("snap")),
                ("wal-00000000000000000001.log".into(), t("log")),
            ],
        ]
        .concat();
        assert_eq!(tree(&d), want);
        let err = recover(&d).unwrap_err();
        assert!(err.contains("is damaged (not a kvpages snapshot file)") && err.contains("Move it aside"), "{err}");
        fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn an_upgrade_interrupted_at_any_point_finishes_on_the_next_start() {
        let clean = v1_dir("upgrade-clean");
        open_dir_with(&clean, &TEST_FORMATS, &mut |_| Ok(())).unwrap();
        let want = tree(&clean);
        let mut crash_at = 0;
        loop {
            let d = v1_dir("upgrade-crash");
            let mut n = 0;
            let crashed = open_dir_with(&d, &TEST_FORMATS, &mut |p| {
                n += 1;
                if n == crash_at + 1 { Err(io::Error::other(format!("crash before {p}"))) } else { Ok(()) }
            });
            let Err(err) = crashed else {
                // Past the last point: every point was tried.
                assert_eq!(crash_at, 20, "two steps of 10 points");
                fs::remove_dir_all(&d).unwrap();
                break;
            };
            assert!(err.contains("crash before"), "{err}");
            // Before the first step's staged FORMAT, format 1 is untouched (bar the staging).
            if crash_at < 2 {
                assert_eq!(fs::read_to_string(d.join("FORMAT")).unwrap(), "kvpages-data 1\n");
            }
            open_dir_with(&d, &TEST_FORMATS, &mut |_| Ok(()))
                .unwrap_or_else(|e| panic!("after a crash at point {crash_at}: {e}"));
            assert_eq!(tree(&d), want, "after a crash at point {crash_at}");
            fs::remove_dir_all(&d).unwrap();
            crash_at += 1;
        }
        fs::remove_dir_all(&clean).unwrap();
    }
}
