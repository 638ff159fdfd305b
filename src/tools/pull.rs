//! `slotstream pull`: downloads a checkpoint from a Hugging Face-compatible hub into a plain
//! directory (one file per repository file, under its repository path; not the hub's own
//! cache layout of blobs and snapshots).
//!
//! The hub's API as `huggingface_hub` uses it (hf_api.py `list_repo_tree`,
//! file_download.py `hf_hub_url`): the listing is
//! `GET {endpoint}/api/models/{repo}/tree/{revision}?recursive=true`, paginated by `Link:
//! <...>; rel="next"` headers, each file with its `size` and, for LFS files, `lfs.oid`
//! (the sha256 of the content); a file's bytes are at
//! `{endpoint}/{repo}/resolve/{revision}/{path}`, which redirects to a CDN. The revision is
//! percent-encoded whole (`quote(revision, safe="")`), the path with its slashes kept.
//!
//! A file is written to `PATH.part` and renamed into place only once its size and sha256
//! match the listing, so no half-written file ever has its final name. An interrupted
//! download (a dropped connection now, or a killed run before) resumes from the part's
//! length with a `Range` request.

use std::path::{Path, PathBuf};

use futures::{StreamExt, TryStreamExt};
use serde::Deserialize;
use sha2::{Digest, Sha256};
use tokio::io::AsyncWriteExt;

use crate::pack::hex;

/// The hub used when `HF_ENDPOINT` is not set.
pub const DEFAULT_ENDPOINT: &str = "https://huggingface.co";

/// Attempts per file before a dropped connection or a server error fails the pull; each
/// resumes where the last stopped.
const ATTEMPTS: usize = 4;

/// Why a pull failed.
#[derive(Debug, thiserror::Error)]
pub enum PullError {
    /// The repository id is not `ORG/NAME`.
    #[error(
        "{0:?} is not a hub repository id: expected ORG/NAME (letters, digits, '.', '_', '-')"
    )]
    BadRepo(String),
    /// The request could not be made or its body not read (after every attempt).
    #[error("{url}: {source}")]
    Http {
        url: String,
        #[source]
        source: reqwest::Error,
    },
    /// The hub answered with an error status.
    #[error("{url}: the hub answered {status}{hint}")]
    Status {
        url: String,
        status: reqwest::StatusCode,
        hint: &'static str,
    },
    /// The listing is not the hub's JSON, or names a path outside the directory.
    #[error("{url}: unexpected file listing: {detail}")]
    Listing { url: String, detail: String },
    /// A local file could not be read, written or renamed.
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A downloaded file's sha256 differs from the hub's; its part file was deleted.
    #[error("{file}: sha256 {actual} does not match the hub's {expected}; the download was deleted, run pull again (a repeated mismatch means the hub or a proxy serves wrong bytes)")]
    Checksum {
        file: String,
        expected: String,
        actual: String,
    },
    /// A download ended at another length than the hub lists.
    #[error("{file}: the server sent {actual} bytes, the hub lists {expected}")]
    Size {
        file: String,
        expected: u64,
        actual: u64,
    },
    /// Too little free space for what remains to download.
    #[error("{}: {needed} bytes remain to download but only {available} are free", dir.display())]
    NoSpace {
        dir: PathBuf,
        needed: u64,
        available: u64,
    },
}

type Result<T> = std::result::Result<T, PullError>;

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> PullError + '_ {
    move |source| PullError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// One file of a repository at a revision, as the hub lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RemoteFile {
    /// Path in the repository, `/`-separated.
    pub path: String,
    /// Bytes.
    pub size: u64,
    /// Lower-case hex sha256 of the content, for LFS files (the hub lists only a git blob
    /// id for the others, whose size is checked instead).
    pub sha256: Option<String>,
}

/// What a pull did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PullReport {
    /// Files in the repository.
    pub files: usize,
    /// Files already complete and matching, left as they were.
    pub skipped: usize,
    /// Bytes downloaded by this run.
    pub downloaded: u64,
}

/// Whether `repo` is an `ORG/NAME` hub id (as `--model` and `pull` take it).
pub fn is_repo_id(repo: &str) -> bool {
    let ok = |s: &str| {
        !s.is_empty()
            && !s.starts_with('.')
            && s.chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'))
    };
    matches!(repo.split_once('/'), Some((org, name)) if ok(org) && ok(name))
}

/// The directory name a repository gets under a models directory: `ORG--NAME`.
pub fn dir_name(repo: &str) -> String {
    repo.replace('/', "--")
}

/// A Hugging Face-compatible hub: its endpoint, a token, one HTTP client.
pub struct Hub {
    endpoint: String,
    token: Option<String>,
    client: reqwest::Client,
}

impl Hub {
    /// A hub at `endpoint` (e.g. `https://huggingface.co`), sending `token` as a bearer
    /// token when given (the client drops it on redirects to other hosts). Errors: the
    /// client cannot be built (no TLS roots).
    pub fn new(endpoint: &str, token: Option<String>) -> Result<Self> {
        let client = reqwest::Client::builder()
            .user_agent(concat!("slotstream/", env!("CARGO_PKG_VERSION")))
            .connect_timeout(std::time::Duration::from_secs(30))
            .read_timeout(std::time::Duration::from_secs(60))
            .build()
            .map_err(|source| PullError::Http {
                url: endpoint.to_string(),
                source,
            })?;
        Ok(Self {
            endpoint: endpoint.trim_end_matches('/').to_string(),
            token: token.filter(|t| !t.is_empty()),
            client,
        })
    }

    /// The hub `HF_ENDPOINT` names (else [`DEFAULT_ENDPOINT`]) with `HF_TOKEN`, as
    /// `huggingface_hub` reads them.
    pub fn from_env() -> Result<Self> {
        let endpoint = std::env::var("HF_ENDPOINT")
            .ok()
            .filter(|e| !e.is_empty())
            .unwrap_or_else(|| DEFAULT_ENDPOINT.to_string());
        Self::new(&endpoint, std::env::var("HF_TOKEN").ok())
    }

    fn get(&self, url: &str) -> reqwest::RequestBuilder {
        let request = self.client.get(url);
        match &self.token {
            Some(token) => request.bearer_auth(token),
            None => request,
        }
    }

    /// Every file of `repo` at `revision` (a branch, tag or commit). Errors: the hub
    /// refuses (401/403: a gated or private repository without `HF_TOKEN`; 404: no such
    /// repository or revision), or its listing is not what the hub sends.
    pub async fn list(&self, repo: &str, revision: &str) -> Result<Vec<RemoteFile>> {
        if !is_repo_id(repo) {
            return Err(PullError::BadRepo(repo.to_string()));
        }
        #[derive(Deserialize)]
        struct Entry {
            #[serde(rename = "type")]
            kind: String,
            path: String,
            #[serde(default)]
            size: u64,
            lfs: Option<Lfs>,
        }
        #[derive(Deserialize)]
        struct Lfs {
            oid: String,
        }
        let mut url = Some(format!(
            "{}/api/models/{repo}/tree/{}?recursive=true",
            self.endpoint,
            encode(revision, false)
        ));
        let mut files = Vec::new();
        while let Some(page) = url.take() {
            let response = self.checked(&page, None).await?;
            // The hub sends absolute URLs; a relative one is resolved as a browser would.
            url = next_page(response.headers())
                .and_then(|next| response.url().join(&next).ok())
                .map(String::from);
            let text = response.text().await.map_err(|source| PullError::Http {
                url: page.clone(),
                source,
            })?;
            let entries: Vec<Entry> =
                serde_json::from_str(&text).map_err(|e| PullError::Listing {
                    url: page.clone(),
                    detail: e.to_string(),
                })?;
            for e in entries.into_iter().filter(|e| e.kind == "file") {
                if !safe_path(&e.path) {
                    return Err(PullError::Listing {
                        url: page.clone(),
                        detail: format!(
                            "{:?} is not a relative path inside the repository",
                            e.path
                        ),
                    });
                }
                let sha256 = e.lfs.map(|l| l.oid.to_ascii_lowercase());
                files.push(RemoteFile {
                    path: e.path,
                    size: e.size,
                    sha256,
                });
            }
        }
        Ok(files)
    }

    /// Sends a GET (with `range`'s start when given) and fails on an error status.
    async fn checked(&self, url: &str, range: Option<u64>) -> Result<reqwest::Response> {
        let mut request = self.get(url);
        if let Some(start) = range {
            request = request.header(reqwest::header::RANGE, format!("bytes={start}-"));
        }
        let response = request.send().await.map_err(|source| PullError::Http {
            url: url.to_string(),
            source,
        })?;
        let status = response.status();
        if status.is_success()
            || (range.is_some() && status == reqwest::StatusCode::RANGE_NOT_SATISFIABLE)
        {
            return Ok(response);
        }
        let hint = match status.as_u16() {
            401 | 403 => " (a private or gated repository: set HF_TOKEN to a token with access)",
            404 => " (no such repository, revision or file on this hub)",
            _ => "",
        };
        Err(PullError::Status {
            url: url.to_string(),
            status,
            hint,
        })
    }

    /// Downloads `files` of `repo` at `revision` into `dir`, `jobs` files at a time,
    /// advancing `bar` by the bytes each file has (its length is set to their total).
    /// Files already complete and matching are skipped; parts left by an interrupted run
    /// resume. Errors: too little free space in `dir` for what remains, a file the hub
    /// does not serve, a size or sha256 mismatch (naming the file), a local I/O error.
    pub async fn pull(
        &self,
        repo: &str,
        revision: &str,
        files: &[RemoteFile],
        dir: &Path,
        jobs: usize,
        bar: &indicatif::ProgressBar,
    ) -> Result<PullReport> {
        std::fs::create_dir_all(dir).map_err(io_err(dir))?;
        let needed: u64 = files.iter().map(|f| remaining(dir, f)).sum();
        let available = free_bytes(dir)?;
        if needed > available {
            return Err(PullError::NoSpace {
                dir: dir.to_path_buf(),
                needed,
                available,
            });
        }
        bar.set_length(files.iter().map(|f| f.size).sum());
        let base = format!(
            "{}/{repo}/resolve/{}",
            self.endpoint,
            encode(revision, false)
        );
        let outcomes: Vec<Option<u64>> = futures::stream::iter(files)
            .map(|file| self.fetch(&base, file, dir, bar))
            .buffer_unordered(jobs.max(1))
            .try_collect()
            .await?;
        Ok(PullReport {
            files: files.len(),
            skipped: outcomes.iter().filter(|o| o.is_none()).count(),
            downloaded: outcomes.iter().flatten().sum(),
        })
    }

    /// One file: `None` when it was already in place, else the bytes this run downloaded.
    async fn fetch(
        &self,
        base: &str,
        file: &RemoteFile,
        dir: &Path,
        bar: &indicatif::ProgressBar,
    ) -> Result<Option<u64>> {
        let dest = dir.join(&file.path);
        if complete(&dest, file).await? {
            tracing::debug!(file = %file.path, "already complete");
            bar.inc(file.size);
            return Ok(None);
        }
        if let Some(parent) = dest.parent() {
            std::fs::create_dir_all(parent).map_err(io_err(parent))?;
        }
        let part = part_path(&dest);
        let url = format!("{base}/{}", encode(&file.path, true));
        // The part's bytes so far, hashed once; what arrives is hashed as it is written.
        let (mut hasher, mut have) = match tokio::fs::metadata(&part).await {
            Ok(meta) if meta.len() <= file.size => (hash_file(&part).await?, meta.len()),
            _ => (Sha256::new(), 0),
        };
        bar.inc(have);
        let mut out = tokio::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&part)
            .await
            .map_err(io_err(&part))?;
        if have == 0 {
            out.set_len(0).await.map_err(io_err(&part))?;
        }
        let start = have;
        // A body that ends early without an error leaves the part short: the size check
        // below reports it.
        for attempt in 1..=ATTEMPTS {
            if have >= file.size {
                break;
            }
            match self
                .receive(&url, &part, &mut out, &mut hasher, &mut have, bar)
                .await
            {
                Ok(()) => break,
                Err(e) if attempt < ATTEMPTS && retryable(&e) => {
                    tracing::warn!(file = %file.path, have, "{e}; resuming");
                    tokio::time::sleep(std::time::Duration::from_millis(200 * attempt as u64))
                        .await;
                }
                Err(e) => return Err(e),
            }
        }
        out.flush().await.map_err(io_err(&part))?;
        out.sync_all().await.map_err(io_err(&part))?;
        drop(out);
        if have != file.size {
            return Err(PullError::Size {
                file: file.path.clone(),
                expected: file.size,
                actual: have,
            });
        }
        let actual = hex(&hasher.finalize());
        if let Some(expected) = &file.sha256 {
            if actual != *expected {
                // A wrong part would resume into a wrong file again: start over next time.
                let _ = std::fs::remove_file(&part);
                return Err(PullError::Checksum {
                    file: file.path.clone(),
                    expected: expected.clone(),
                    actual,
                });
            }
        }
        std::fs::rename(&part, &dest).map_err(io_err(&dest))?;
        tracing::debug!(file = %file.path, bytes = have - start, "downloaded");
        Ok(Some(have - start))
    }

    /// One request for the rest of a file from `*have`, appending to `out`. A server that
    /// ignores the range (200 instead of 206) sends the whole file: the part starts over.
    async fn receive(
        &self,
        url: &str,
        part: &Path,
        out: &mut tokio::fs::File,
        hasher: &mut Sha256,
        have: &mut u64,
        bar: &indicatif::ProgressBar,
    ) -> Result<()> {
        let response = self.checked(url, (*have > 0).then_some(*have)).await?;
        match response.status() {
            reqwest::StatusCode::PARTIAL_CONTENT => {}
            // The part is already as long as the file: the listing's size decides.
            reqwest::StatusCode::RANGE_NOT_SATISFIABLE => return Ok(()),
            _ if *have > 0 => {
                tracing::debug!(url, "the server ignored the range; starting over");
                out.set_len(0).await.map_err(io_err(part))?;
                bar.dec(*have);
                *hasher = Sha256::new();
                *have = 0;
            }
            _ => {}
        }
        let mut body = response.bytes_stream();
        while let Some(chunk) = body.next().await {
            let chunk = chunk.map_err(|source| PullError::Http {
                url: url.to_string(),
                source,
            })?;
            out.write_all(&chunk).await.map_err(io_err(part))?;
            hasher.update(&chunk);
            *have += chunk.len() as u64;
            bar.inc(chunk.len() as u64);
        }
        Ok(())
    }
}

/// Whether another attempt may succeed: a dropped connection or timeout, or a server
/// error (5xx, 429); not a refusal such as 404.
fn retryable(e: &PullError) -> bool {
    match e {
        PullError::Http { .. } => true,
        PullError::Status { status, .. } => {
            status.is_server_error() || *status == reqwest::StatusCode::TOO_MANY_REQUESTS
        }
        _ => false,
    }
}

/// `dest` with `.part` appended.
fn part_path(dest: &Path) -> PathBuf {
    let mut name = dest.as_os_str().to_owned();
    name.push(".part");
    PathBuf::from(name)
}

/// Bytes `file` still needs in `dir`: none when in place at its size (checked fully
/// before it is skipped), else what its part lacks.
fn remaining(dir: &Path, file: &RemoteFile) -> u64 {
    let dest = dir.join(&file.path);
    let len = |p: &Path| std::fs::metadata(p).map(|m| m.len()).ok();
    if len(&dest) == Some(file.size) {
        return 0;
    }
    let have = len(&part_path(&dest))
        .filter(|&n| n <= file.size)
        .unwrap_or(0);
    file.size - have
}

/// Whether `dest` already holds `file`: its size, and its sha256 when the hub lists one.
async fn complete(dest: &Path, file: &RemoteFile) -> Result<bool> {
    match tokio::fs::metadata(dest).await {
        Ok(meta) if meta.is_file() && meta.len() == file.size => {}
        _ => return Ok(false),
    }
    Ok(match &file.sha256 {
        Some(expected) => hex(&hash_file(dest).await?.finalize()) == *expected,
        None => true,
    })
}

/// A hasher fed with `path`'s bytes (on a blocking thread: a shard is gigabytes).
async fn hash_file(path: &Path) -> Result<Sha256> {
    let owned = path.to_path_buf();
    tokio::task::spawn_blocking(move || {
        let mut hasher = Sha256::new();
        let mut f = std::fs::File::open(&owned)?;
        std::io::copy(&mut f, &mut hasher)?;
        Ok(hasher)
    })
    .await
    .map_err(|e| std::io::Error::other(e.to_string()))
    .and_then(|r| r)
    .map_err(io_err(path))
}

/// Bytes an unprivileged user may still write in the file system holding `dir`.
fn free_bytes(dir: &Path) -> Result<u64> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(dir.as_os_str().as_bytes()).map_err(|e| PullError::Io {
        path: dir.to_path_buf(),
        source: std::io::Error::other(e),
    })?;
    let mut stat = std::mem::MaybeUninit::<libc::statvfs>::uninit();
    // SAFETY: `c` is a NUL-terminated path and `stat` a buffer statvfs fills on success.
    if unsafe { libc::statvfs(c.as_ptr(), stat.as_mut_ptr()) } != 0 {
        return Err(PullError::Io {
            path: dir.to_path_buf(),
            source: std::io::Error::last_os_error(),
        });
    }
    // SAFETY: statvfs returned 0, so it filled `stat`.
    let stat = unsafe { stat.assume_init() };
    #[allow(clippy::unnecessary_cast)] // the fields' types differ between platforms
    Ok(stat.f_bavail as u64 * stat.f_frsize as u64)
}

/// Whether a listed path stays inside the directory: relative, no `..`, `.` or empty
/// components, no backslashes.
fn safe_path(path: &str) -> bool {
    !path.is_empty()
        && !path.contains('\\')
        && path
            .split('/')
            .all(|c| !c.is_empty() && c != "." && c != "..")
}

/// Percent-encodes all but RFC 3986's unreserved characters (and `/` when `keep_slash`).
fn encode(s: &str, keep_slash: bool) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric()
            || matches!(b, b'-' | b'.' | b'_' | b'~')
            || (keep_slash && b == b'/')
        {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// The `rel="next"` URL of a `Link` header, the hub's pagination.
fn next_page(headers: &reqwest::header::HeaderMap) -> Option<String> {
    let link = headers.get(reqwest::header::LINK)?.to_str().ok()?;
    link.split(',').find_map(|part| {
        let (url, params) = part.split_once(';')?;
        params
            .split(';')
            .any(|p| p.trim().trim_start_matches("rel=").trim_matches('"') == "next")
            .then(|| {
                url.trim()
                    .trim_start_matches('<')
                    .trim_end_matches('>')
                    .to_string()
            })
    })
}
