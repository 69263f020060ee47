//! The data directory's lock: one server per directory.

use std::fs::{self, File, OpenOptions};
use std::io;
use std::path::Path;

/// The lock file of a data directory: one process at a time holds an `flock` on it.
pub const LOCK_FILE: &str = "LOCK";

/// A data directory's lock, held while this lives. It is an `flock`, so it dies with its
/// process: a server killed with `kill -9` leaves a file that blocks nobody.
#[derive(Debug)]
pub struct DirLock {
    _file: File,
}

/// Takes `dir`'s lock (creating the directory if needed), or says which process holds it.
pub fn lock_dir(dir: &Path) -> Result<DirLock, String> {
    use std::os::unix::fs::FileExt;
    fs::create_dir_all(dir).map_err(|e| format!("cannot create --data-dir {}: {e}", dir.display()))?;
    let path = dir.join(LOCK_FILE);
    let at = |e: io::Error| format!("{}: {e}", path.display());
    let file = OpenOptions::new().read(true).write(true).create(true).truncate(false).open(&path).map_err(at)?;
    match rustix::fs::flock(&file, rustix::fs::FlockOperation::NonBlockingLockExclusive) {
        Ok(()) => {}
        Err(rustix::io::Errno::WOULDBLOCK) => {
            let holder = fs::read_to_string(&path).unwrap_or_default();
            let holder = holder.trim();
            let who = if holder.is_empty() { "another process".to_owned() } else { format!("pid {holder}") };
            return Err(format!(
                "data dir {} is in use by {who}: one kvpages server per data directory. Stop that one, or \
                 point --data-dir elsewhere",
                dir.display()
            ));
        }
        Err(e) => return Err(at(e.into())),
    }
    file.set_len(0).and_then(|()| file.write_all_at(format!("{}\n", std::process::id()).as_bytes(), 0)).map_err(at)?;
    Ok(DirLock { _file: file })
}
