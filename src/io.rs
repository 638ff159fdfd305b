//! Reading byte ranges from the SSD: direct or buffered `pread`s run as futures on tokio's
//! blocking pool, with the number in flight bounded by a semaphore (the queue depth).
//!
//! Direct I/O (Linux `O_DIRECT`; macOS `F_NOCACHE` + `F_RDAHEAD 0`) keeps the page cache
//! out of the way so a miss costs what the disk costs and measurements stay honest.
//! `O_DIRECT` needs offset, length and buffer aligned to the logical block size: a range
//! that is not aligned is read as its aligned enclosing range into scratch memory.

use std::alloc::Layout;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::ptr::NonNull;
use std::sync::Arc;

use tokio::sync::Semaphore;

use crate::checkpoint::ALIGN;
use crate::error::{Error, Result};

/// Alignment and length granule of [`AlignedBuf`]: a 16 KiB page, so a slot pool can also
/// be wrapped as no-copy Metal buffers on Apple Silicon (whose pages are 16 KiB); a
/// multiple of [`ALIGN`].
pub const PAGE: usize = 16 << 10;

/// Zeroed, [`PAGE`]-aligned heap memory that direct reads can land in: `len` bytes (a
/// multiple of [`ALIGN`]) in an allocation of whole pages.
pub struct AlignedBuf {
    ptr: NonNull<u8>,
    len: usize,
    capacity: usize,
}

// SAFETY: AlignedBuf owns its allocation like a Vec<u8>.
unsafe impl Send for AlignedBuf {}
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    /// Allocates `len` zeroed bytes (rounded up to a multiple of [`ALIGN`]; the allocation
    /// to a multiple of [`PAGE`]).
    /// Errors: the allocation fails (reported, not aborted, so a pool too large for the
    /// machine is a clear error).
    pub fn zeroed(len: usize) -> Result<Self> {
        let too_large = || Error::Pool(format!("a buffer of {len} bytes is too large"));
        let rounded = len
            .max(1)
            .checked_next_multiple_of(ALIGN)
            .ok_or_else(too_large)?;
        let capacity = rounded
            .checked_next_multiple_of(PAGE)
            .ok_or_else(too_large)?;
        let layout = Layout::from_size_align(capacity, PAGE)
            .map_err(|e| Error::Pool(format!("buffer of {capacity} bytes: {e}")))?;
        // SAFETY: layout has non-zero size.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        let ptr = NonNull::new(ptr).ok_or_else(|| {
            Error::Pool(format!(
                "could not allocate {capacity} bytes of aligned memory"
            ))
        })?;
        Ok(AlignedBuf {
            ptr,
            len: rounded,
            capacity,
        })
    }

    /// Bytes allocated (whole pages, at least `len`).
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: ptr is valid for len bytes for the life of self.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as above, and &mut self gives exclusive access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }

    /// Raw base pointer, for the slot pool's disjoint per-slot access.
    pub(crate) fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// Gives the whole pages of `offset..offset + len` back to the OS (Linux
    /// `madvise(MADV_DONTNEED)`: they read as zeros when touched again; macOS
    /// `MADV_FREE`: the OS takes them when it needs them; elsewhere nothing); returns the
    /// bytes advised (0 where nothing was). The memory stays allocated and valid.
    ///
    /// # Safety
    /// Nothing may read or write the range while this runs, and nothing may count on its
    /// contents afterwards (the slot pool calls it on retired slots alone).
    pub(crate) unsafe fn release(&self, offset: usize, len: usize) -> usize {
        let page = page_size();
        let start = (self.ptr.as_ptr() as usize + offset).next_multiple_of(page);
        let end = (self.ptr.as_ptr() as usize + (offset + len).min(self.capacity)) / page * page;
        if end <= start {
            return 0;
        }
        #[cfg(target_os = "linux")]
        let advice = libc::MADV_DONTNEED;
        #[cfg(target_os = "macos")]
        let advice = libc::MADV_FREE;
        #[cfg(any(target_os = "linux", target_os = "macos"))]
        {
            // SAFETY: the range lies inside this allocation (private anonymous memory)
            // and, by the caller's contract, nothing uses it.
            let rc = unsafe { libc::madvise(start as *mut libc::c_void, end - start, advice) };
            if rc == 0 {
                return end - start;
            }
            tracing::debug!(error = %std::io::Error::last_os_error(), "madvise failed; the pages stay");
        }
        0
    }
}

/// The OS's page size in bytes (4096 where it cannot be read).
pub fn page_size() -> usize {
    // SAFETY: sysconf has no preconditions.
    let n = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if n > 0 {
        n as usize
    } else {
        4096
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        // SAFETY: allocated in `zeroed` with this exact layout.
        unsafe {
            std::alloc::dealloc(
                self.ptr.as_ptr(),
                Layout::from_size_align_unchecked(self.capacity, PAGE),
            )
        }
    }
}

/// How files are read.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum IoMode {
    /// Bypass the page cache (`O_DIRECT` / `F_NOCACHE`).
    Direct,
    /// Plain `pread`, then drop the range from the page cache (`POSIX_FADV_DONTNEED`).
    Buffered,
}

impl std::str::FromStr for IoMode {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "direct" => Ok(IoMode::Direct),
            "buffered" => Ok(IoMode::Buffered),
            _ => Err(format!(
                "unknown I/O mode `{s}` (expected direct or buffered)"
            )),
        }
    }
}

/// Positional reads from one file. The real implementation is [`DiskFile`]; tests
/// substitute faulty ones (short reads, EIO).
pub trait ReadAt: Send + Sync {
    /// Reads up to `buf.len()` bytes at `offset` (one `pread`).
    fn read_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<usize>;
    /// The file's path, for error messages.
    fn path(&self) -> &Path;
    /// Whether reads must be `ALIGN`-aligned in offset, length and memory.
    fn direct(&self) -> bool;
    /// Errors if the file changed since it was opened (size or modification time), so a
    /// checkpoint rewritten under a running engine is an error, not silent garbage.
    fn check_unchanged(&self) -> std::io::Result<()>;
}

/// A file opened for direct or buffered reads, with the stamp it had when opened.
pub struct DiskFile {
    path: PathBuf,
    file: File,
    direct: bool,
    stamp: (u64, Option<std::time::SystemTime>),
}

fn stamp_of(meta: &std::fs::Metadata) -> (u64, Option<std::time::SystemTime>) {
    (meta.len(), meta.modified().ok())
}

impl DiskFile {
    /// Opens `path` in `mode`. Direct mode falls back to buffered, with a warning, where
    /// the filesystem refuses it (tmpfs, some network filesystems).
    pub fn open(path: &Path, mode: IoMode) -> Result<Self> {
        let (file, direct) = match mode {
            IoMode::Direct => match open_direct(path) {
                Ok(f) => (f, true),
                Err(e) => {
                    tracing::warn!(path = %path.display(), error = %e, "direct I/O refused; using buffered reads");
                    (File::open(path).map_err(|e| Error::io(path, e))?, false)
                }
            },
            IoMode::Buffered => (File::open(path).map_err(|e| Error::io(path, e))?, false),
        };
        #[cfg(target_os = "linux")]
        if !direct {
            use std::os::fd::AsRawFd;
            // Records are read at random: readahead would only fill the page cache with
            // neighbours that DONTNEED below does not cover.
            // SAFETY: advisory call on a valid descriptor.
            unsafe {
                libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_RANDOM);
            }
        }
        let meta = file.metadata().map_err(|e| Error::io(path, e))?;
        Ok(DiskFile {
            path: path.to_path_buf(),
            file,
            direct,
            stamp: stamp_of(&meta),
        })
    }
}

#[cfg(target_os = "linux")]
fn open_direct(path: &Path) -> std::io::Result<File> {
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(path)
}

#[cfg(target_os = "macos")]
fn open_direct(path: &Path) -> std::io::Result<File> {
    use std::os::fd::AsRawFd;
    let f = File::open(path)?;
    // SAFETY: fcntl on a valid descriptor with integer arguments.
    unsafe {
        if libc::fcntl(f.as_raw_fd(), libc::F_NOCACHE, 1) == -1
            || libc::fcntl(f.as_raw_fd(), libc::F_RDAHEAD, 0) == -1
        {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(f)
}

#[cfg(not(any(target_os = "linux", target_os = "macos")))]
fn open_direct(_path: &Path) -> std::io::Result<File> {
    Err(std::io::Error::new(
        std::io::ErrorKind::Unsupported,
        "direct I/O is not implemented on this platform",
    ))
}

impl ReadAt for DiskFile {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<usize> {
        use std::os::unix::fs::FileExt;
        let n = self.file.read_at(buf, offset)?;
        #[cfg(target_os = "linux")]
        if !self.direct && n > 0 {
            use std::os::fd::AsRawFd;
            // SAFETY: advisory call on a valid descriptor.
            unsafe {
                libc::posix_fadvise(
                    self.file.as_raw_fd(),
                    offset as i64,
                    n as i64,
                    libc::POSIX_FADV_DONTNEED,
                );
            }
        }
        Ok(n)
    }

    fn path(&self) -> &Path {
        &self.path
    }

    fn direct(&self) -> bool {
        self.direct
    }

    fn check_unchanged(&self) -> std::io::Result<()> {
        let now = stamp_of(&std::fs::metadata(&self.path)?);
        if now != self.stamp {
            return Err(std::io::Error::other(
                "file changed since it was opened (size or modification time)",
            ));
        }
        Ok(())
    }
}

/// Reads exactly `buf.len()` bytes at `offset`: short reads continue, `EINTR` is
/// retried, end of file and I/O errors name the file and offset.
pub fn read_exact_at(file: &dyn ReadAt, buf: &mut [u8], offset: u64) -> Result<()> {
    let got = read_until_eof(file, buf, offset)?;
    if got < buf.len() {
        return Err(Error::io(
            file.path(),
            std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                format!(
                    "unexpected end of file reading {} bytes at offset {}",
                    buf.len() - got,
                    offset + got as u64
                ),
            ),
        ));
    }
    Ok(())
}

/// A small read the model asks for besides expert records (an n-gram table row's
/// packed words, scales or biases): `len` bytes at `offset` of `file`.
#[derive(Clone)]
pub struct RangeRead {
    /// The open file (a checkpoint shard).
    pub file: Arc<dyn ReadAt>,
    /// Byte offset in the file.
    pub offset: u64,
    /// Bytes to read.
    pub len: usize,
}

impl RangeRead {
    /// Reads the range into a new buffer. Errors: as [`read_range`].
    pub fn read(&self) -> Result<Vec<u8>> {
        let mut buf = vec![0u8; self.len];
        read_range(self.file.as_ref(), self.offset, &mut buf)?;
        Ok(buf)
    }
}

/// Reads `dst.len()` bytes at `offset` of `file` into `dst`, honouring direct-I/O
/// alignment: aligned requests go straight into `dst`; others go through
/// [`with_range`]'s scratch memory.
pub fn read_range(file: &dyn ReadAt, offset: u64, dst: &mut [u8]) -> Result<()> {
    let aligned = offset.is_multiple_of(ALIGN as u64)
        && dst.len().is_multiple_of(ALIGN)
        && (dst.as_ptr() as usize).is_multiple_of(ALIGN);
    if !file.direct() || aligned {
        read_exact_at(file, dst, offset)?;
        file.check_unchanged()
            .map_err(|e| Error::io(file.path(), e))
    } else {
        with_range(file, offset, dst.len(), |bytes| dst.copy_from_slice(bytes))
    }
}

/// Reads `len` bytes at `offset` of `file` into scratch memory (the aligned enclosing
/// range for direct I/O) and passes them to `f`: for bytes that go to several places (a
/// sweep's piece of several records) or to a destination direct I/O cannot read into.
/// Errors: the read fails or the file ends first (naming the file and offset), or the
/// file changed.
pub fn with_range<R>(
    file: &dyn ReadAt,
    offset: u64,
    len: usize,
    f: impl FnOnce(&[u8]) -> R,
) -> Result<R> {
    let a = if file.direct() { ALIGN as u64 } else { 1 };
    let start = offset / a * a;
    let end = (offset + len as u64).next_multiple_of(a);
    let span = (end - start) as usize;
    let mut scratch = AlignedBuf::zeroed(span)?;
    // The aligned range may run past the end of the file: read what exists.
    let read = read_until_eof(file, &mut scratch.as_mut_slice()[..span], start);
    let skip = (offset - start) as usize;
    let result = match read {
        Ok(got) if got >= skip + len => Ok(f(&scratch.as_slice()[skip..skip + len])),
        Ok(_) => Err(Error::io(
            file.path(),
            std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                format!("unexpected end of file reading {len} bytes at offset {offset}"),
            ),
        )),
        Err(e) => Err(e),
    };
    let value = result?;
    file.check_unchanged()
        .map_err(|e| Error::io(file.path(), e))?;
    Ok(value)
}

/// Like [`read_exact_at`] but stops quietly at end of file; returns the bytes read.
fn read_until_eof(file: &dyn ReadAt, buf: &mut [u8], offset: u64) -> Result<usize> {
    let mut done = 0;
    while done < buf.len() {
        match file.read_at(&mut buf[done..], offset + done as u64) {
            Ok(0) => break,
            Ok(n) => done += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => {
                return Err(Error::io(
                    file.path(),
                    std::io::Error::new(
                        e.kind(),
                        format!("reading at offset {}: {e}", offset + done as u64),
                    ),
                ))
            }
        }
    }
    Ok(done)
}

/// A set of open files and the semaphore that bounds reads in flight.
pub struct Reader {
    files: Vec<Arc<dyn ReadAt>>,
    demand: Arc<Semaphore>,
    queue_depth: usize,
}

impl Reader {
    /// Opens `paths` in `mode` with at most `queue_depth` (>= 1) reads in flight.
    pub fn open(paths: &[PathBuf], mode: IoMode, queue_depth: usize) -> Result<Self> {
        let files = paths
            .iter()
            .map(|p| DiskFile::open(p, mode).map(|f| Arc::new(f) as Arc<dyn ReadAt>))
            .collect::<Result<Vec<_>>>()?;
        Ok(Self::from_files(files, queue_depth))
    }

    /// A reader over already-open files (tests inject faulty ones here).
    pub fn from_files(files: Vec<Arc<dyn ReadAt>>, queue_depth: usize) -> Self {
        let queue_depth = queue_depth.max(1);
        Reader {
            files,
            demand: Arc::new(Semaphore::new(queue_depth)),
            queue_depth,
        }
    }

    pub fn queue_depth(&self) -> usize {
        self.queue_depth
    }

    /// Whether every file is read with direct I/O.
    pub fn direct(&self) -> bool {
        self.files.iter().all(|f| f.direct())
    }

    pub(crate) fn file(&self, i: usize) -> Arc<dyn ReadAt> {
        self.files[i].clone()
    }

    pub(crate) fn semaphore(&self) -> Arc<Semaphore> {
        self.demand.clone()
    }
}
