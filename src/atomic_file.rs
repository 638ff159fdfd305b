//! Output files that appear complete or not at all: written under a temporary name in
//! the destination's directory, synced, then renamed over the destination.

use std::fs::File;
use std::path::{Path, PathBuf};

use crate::error::{Error, Result};

/// Name prefix of the temporary files ([`AtomicFile::create`]); a writer that owns its
/// directory (`synth`) removes ones an interrupted run left.
pub const TEMP_PREFIX: &str = ".slotstream-tmp-";

/// A file being written; [`AtomicFile::commit`] puts it in place.
pub struct AtomicFile {
    tmp: tempfile::NamedTempFile,
    dest: PathBuf,
    mode: Option<std::fs::Permissions>,
}

impl AtomicFile {
    /// Starts writing `dest`. A symlink is followed (its target is replaced, not the
    /// link); an existing destination keeps its permissions, a new one gets 0644.
    /// Errors: the directory is missing or not writable, or `dest` exists and is not a
    /// regular file (a device or directory is never replaced).
    pub fn create(dest: &Path) -> Result<Self> {
        let (dest, mode) = match std::fs::metadata(dest) {
            Ok(meta) if !meta.is_file() => {
                return Err(Error::io(
                    dest,
                    std::io::Error::other(
                        "exists and is not a regular file; refusing to replace it",
                    ),
                ))
            }
            Ok(meta) => (
                std::fs::canonicalize(dest).map_err(|e| Error::io(dest, e))?,
                Some(meta.permissions()),
            ),
            Err(_) => (dest.to_path_buf(), None),
        };
        let dir = dest
            .parent()
            .filter(|p| !p.as_os_str().is_empty())
            .unwrap_or(Path::new("."));
        let tmp = tempfile::Builder::new()
            .prefix(TEMP_PREFIX)
            .tempfile_in(dir)
            .map_err(|e| Error::io(dir, e))?;
        Ok(AtomicFile { tmp, dest, mode })
    }

    /// The temporary file to write.
    pub fn file(&self) -> &File {
        self.tmp.as_file()
    }

    /// Where the data is being written (to re-read it before committing).
    pub fn temp_path(&self) -> &Path {
        self.tmp.path()
    }

    /// Syncs the data, sets the permissions and renames the file over the destination.
    pub fn commit(self) -> Result<()> {
        let dest = self.dest;
        self.tmp
            .as_file()
            .sync_all()
            .map_err(|e| Error::io(&dest, e))?;
        let mode = self.mode.unwrap_or_else(|| {
            use std::os::unix::fs::PermissionsExt;
            std::fs::Permissions::from_mode(0o644)
        });
        self.tmp
            .as_file()
            .set_permissions(mode)
            .map_err(|e| Error::io(&dest, e))?;
        self.tmp
            .persist(&dest)
            .map_err(|e| Error::io(&dest, e.error))?;
        Ok(())
    }
}

/// Checks before long work that `path` could be written: its directory exists and it
/// is not a device or directory.
pub fn check_writable(path: &Path) -> Result<()> {
    AtomicFile::create(path).map(drop)
}
