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
    /// The copies of the files, the model directory first, when there are mirrors.
    replicas: Vec<Arc<Replica>>,
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
            replicas: Vec::new(),
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

/// Readings of a copy's speed expire after this long with no read in flight, so a copy
/// that looked slow is tried again (reference-system.md B.7).
pub const MIRROR_FORGET: std::time::Duration = std::time::Duration::from_secs(1);

/// One copy of a checkpoint's files: the model directory, or a `--mirror` directory
/// (which holds byte-identical copies of some or all of them). It learns its own speed:
/// seconds per byte over the time it had a read in flight (not per read, which would
/// count the queueing twice), forgotten after [`MIRROR_FORGET`] idle.
pub struct Replica {
    dir: PathBuf,
    state: std::sync::Mutex<ReplicaState>,
    dropped: std::sync::atomic::AtomicBool,
}

struct ReplicaState {
    /// Bytes of the reads in flight.
    queued: u64,
    in_flight: usize,
    /// Since when a read has been in flight (while one is).
    busy_since: Option<std::time::Instant>,
    /// Since when none has been (while none is).
    idle_since: std::time::Instant,
    /// Busy seconds and bytes read since the readings were last forgotten.
    busy: f64,
    bytes: u64,
    /// The same since the copy was opened (statistics).
    total_busy: f64,
    total_bytes: u64,
}

/// What one copy read ([`Reader::mirror_stats`]).
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct MirrorStats {
    /// The copy's directory.
    pub dir: PathBuf,
    /// Bytes read from it since it was opened.
    pub bytes: u64,
    /// Seconds with at least one read in flight on it.
    pub busy_seconds: f64,
    /// `bytes / busy_seconds / 1e9`.
    pub gb_per_s: f64,
    /// Whether it was dropped after a failed read.
    pub dropped: bool,
}

impl Replica {
    /// A copy in `dir`, nothing learned yet.
    pub fn new(dir: &Path) -> Arc<Self> {
        Arc::new(Replica {
            dir: dir.to_path_buf(),
            state: std::sync::Mutex::new(ReplicaState {
                queued: 0,
                in_flight: 0,
                busy_since: None,
                idle_since: std::time::Instant::now(),
                busy: 0.0,
                bytes: 0,
                total_busy: 0.0,
                total_bytes: 0,
            }),
            dropped: std::sync::atomic::AtomicBool::new(false),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, ReplicaState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Seconds per byte learned, and the bytes queued; `None` for the rate before
    /// anything is learned (or after [`MIRROR_FORGET`] idle, when it is forgotten).
    fn reading(&self) -> (Option<f64>, u64) {
        let mut s = self.lock();
        if s.in_flight == 0 && s.idle_since.elapsed() > MIRROR_FORGET {
            s.busy = 0.0;
            s.bytes = 0;
        }
        let per_byte = (s.bytes > 0).then(|| s.busy / s.bytes as f64);
        (per_byte, s.queued)
    }

    fn start(&self, len: usize) {
        let mut s = self.lock();
        if s.in_flight == 0 {
            s.busy_since = Some(std::time::Instant::now());
        }
        s.in_flight += 1;
        s.queued += len as u64;
    }

    fn finish(&self, len: usize, read: usize) {
        let mut s = self.lock();
        s.in_flight -= 1;
        s.queued -= len as u64;
        s.bytes += read as u64;
        s.total_bytes += read as u64;
        if s.in_flight == 0 {
            let now = std::time::Instant::now();
            let busy = s.busy_since.take().map_or(0.0, |t| (now - t).as_secs_f64());
            s.busy += busy;
            s.total_busy += busy;
            s.idle_since = now;
        }
    }

    fn stats(&self) -> MirrorStats {
        let s = self.lock();
        // A busy period still open counts up to now.
        let open = s.busy_since.map_or(0.0, |t| t.elapsed().as_secs_f64());
        let busy = s.total_busy + open;
        MirrorStats {
            dir: self.dir.clone(),
            bytes: s.total_bytes,
            busy_seconds: busy,
            gb_per_s: if busy > 0.0 {
                s.total_bytes as f64 / busy / 1e9
            } else {
                0.0
            },
            dropped: self.dropped.load(std::sync::atomic::Ordering::Relaxed),
        }
    }

    fn live(&self) -> bool {
        !self.dropped.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Drops the copy after a failed read (one warning); false when it was already.
    fn drop_after(&self, file: &Path, error: &std::io::Error) -> bool {
        let first = !self
            .dropped
            .swap(true, std::sync::atomic::Ordering::Relaxed);
        if first {
            tracing::warn!(
                copy = %self.dir.display(),
                file = %file.display(),
                %error,
                "a read from this copy failed: it is dropped, the other copies serve the run"
            );
        }
        first
    }
}

/// A file with byte-identical copies on several disks ([`Replica`]s): each read goes to
/// the copy with the earliest estimated finish, and a copy whose read fails (or whose
/// file changed) is dropped and the read is made again on another.
pub struct MirroredFile {
    copies: Vec<(Arc<Replica>, Arc<dyn ReadAt>)>,
}

impl MirroredFile {
    /// A file read from `copies` (the first the original). Tests build one from faulty
    /// or slowed files.
    pub fn new(copies: Vec<(Arc<Replica>, Arc<dyn ReadAt>)>) -> Self {
        MirroredFile { copies }
    }
}

impl ReadAt for MirroredFile {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<usize> {
        loop {
            let live: Vec<&(Arc<Replica>, Arc<dyn ReadAt>)> =
                self.copies.iter().filter(|(r, _)| r.live()).collect();
            // The estimated finish: (bytes queued + this read) x seconds per byte. A copy
            // whose rate is not known (yet, or again) is taken to be as fast as the
            // fastest known, so it is tried without taking every read at once; equal
            // estimates go to the copy with fewer bytes queued.
            let readings: Vec<(Option<f64>, u64)> = live.iter().map(|c| c.0.reading()).collect();
            let fastest = readings
                .iter()
                .filter_map(|r| r.0)
                .min_by(f64::total_cmp)
                .unwrap_or(1.0);
            let Some(&(replica, file)) = live
                .iter()
                .zip(&readings)
                .map(|(c, &(per_byte, queued))| {
                    let finish = (queued + buf.len() as u64) as f64 * per_byte.unwrap_or(fastest);
                    (finish, queued, c)
                })
                .min_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)))
                .map(|(_, _, c)| c)
            else {
                return Err(std::io::Error::other("every copy of the file was dropped"));
            };
            replica.start(buf.len());
            // A changed copy (truncated, replaced, removed) may have served anything.
            let result = file
                .read_at(buf, offset)
                .and_then(|n| file.check_unchanged().map(|()| n));
            replica.finish(buf.len(), *result.as_ref().unwrap_or(&0));
            match result {
                Ok(n) => return Ok(n),
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) if live.len() > 1 => {
                    replica.drop_after(file.path(), &e);
                }
                Err(e) => return Err(e),
            }
        }
    }

    fn path(&self) -> &Path {
        self.copies[0].1.path()
    }

    /// Reads are aligned when any copy needs it (a buffered copy takes aligned reads too).
    fn direct(&self) -> bool {
        self.copies.iter().any(|(_, f)| f.direct())
    }

    /// Each read checks the copy it used.
    fn check_unchanged(&self) -> std::io::Result<()> {
        Ok(())
    }
}

/// The bytes that identify a checkpoint file for [`open_mirrored`]'s check: a
/// safetensors file's header (its length and JSON), else the first 64 KiB.
fn file_header(path: &Path) -> Result<Vec<u8>> {
    use std::os::unix::fs::FileExt;
    let file = File::open(path).map_err(|e| Error::io(path, e))?;
    let size = file.metadata().map_err(|e| Error::io(path, e))?.len();
    let mut len = size.min(64 << 10);
    if path.extension().is_some_and(|e| e == "safetensors") && size >= 8 {
        let mut n = [0u8; 8];
        file.read_exact_at(&mut n, 0)
            .map_err(|e| Error::io(path, e))?;
        len = (8 + u64::from_le_bytes(n)).min(size).min(100 << 20);
    }
    let mut buf = vec![0u8; len as usize];
    file.read_exact_at(&mut buf, 0)
        .map_err(|e| Error::io(path, e))?;
    Ok(buf)
}

impl Reader {
    /// [`Reader::open`] with copies of the files in `mirrors` (`--mirror`): each
    /// directory's file of the same name, where it has one, is checked against the
    /// original by size and header and read as another copy ([`MirroredFile`]).
    /// Errors: a mirror that holds none of the files, or a copy whose size or header
    /// differs (naming both files), besides [`Reader::open`]'s.
    pub fn open_mirrored(
        paths: &[PathBuf],
        mirrors: &[PathBuf],
        mode: IoMode,
        queue_depth: usize,
    ) -> Result<Self> {
        if mirrors.is_empty() {
            return Self::open(paths, mode, queue_depth);
        }
        let model_dir = paths
            .first()
            .and_then(|p| p.parent())
            .unwrap_or(Path::new("."));
        let replicas: Vec<Arc<Replica>> = std::iter::once(model_dir)
            .chain(mirrors.iter().map(PathBuf::as_path))
            .map(Replica::new)
            .collect();
        let mut used = vec![false; mirrors.len()];
        let mut files = Vec::with_capacity(paths.len());
        for path in paths {
            let original: Arc<dyn ReadAt> = Arc::new(DiskFile::open(path, mode)?);
            let mut copies = vec![(replicas[0].clone(), original)];
            let name = path.file_name().unwrap_or_default();
            for (m, dir) in mirrors.iter().enumerate() {
                let copy = dir.join(name);
                if !copy.exists() {
                    continue;
                }
                let size = |p: &Path| {
                    std::fs::metadata(p)
                        .map(|m| m.len())
                        .map_err(|e| Error::io(p, e))
                };
                let (a, b) = (size(path)?, size(&copy)?);
                if a != b {
                    return Err(Error::InvalidInput(format!(
                        "--mirror {}: {} is {b} bytes, but {} is {a}: not a copy",
                        dir.display(),
                        copy.display(),
                        path.display()
                    )));
                }
                if file_header(path)? != file_header(&copy)? {
                    return Err(Error::InvalidInput(format!(
                        "--mirror {}: the header of {} differs from {}'s: not a copy",
                        dir.display(),
                        copy.display(),
                        path.display()
                    )));
                }
                used[m] = true;
                copies.push((
                    replicas[m + 1].clone(),
                    Arc::new(DiskFile::open(&copy, mode)?),
                ));
            }
            files.push(if copies.len() == 1 {
                copies.pop().map(|c| c.1).expect("the original")
            } else {
                Arc::new(MirroredFile::new(copies)) as Arc<dyn ReadAt>
            });
        }
        if let Some(m) = used.iter().position(|u| !u) {
            return Err(Error::InvalidInput(format!(
                "--mirror {}: none of the files read from the model directory is there ({})",
                mirrors[m].display(),
                paths
                    .iter()
                    .filter_map(|p| p.file_name())
                    .map(|n| n.to_string_lossy())
                    .collect::<Vec<_>>()
                    .join(", ")
            )));
        }
        let mut reader = Self::from_files(files, queue_depth);
        reader.replicas = replicas;
        Ok(reader)
    }

    /// What each copy read (the model directory first), when there are mirrors; empty
    /// otherwise.
    pub fn mirror_stats(&self) -> Vec<MirrorStats> {
        self.replicas.iter().map(|r| r.stats()).collect()
    }

    /// A reader over `files` whose copies are `replicas` (tests of the choice of copy).
    pub fn with_replicas(
        files: Vec<Arc<dyn ReadAt>>,
        replicas: Vec<Arc<Replica>>,
        queue_depth: usize,
    ) -> Self {
        let mut reader = Self::from_files(files, queue_depth);
        reader.replicas = replicas;
        reader
    }
}
