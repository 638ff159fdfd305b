//! The machine's memory, as the memory planner reads it (`plan::AutoPlan`): total and
//! available RAM, the cgroup v2 limit a container runs under, and on macOS the GPU's
//! recommended working set where the GPU backend shares memory with the CPU.
//!
//! Linux: `/proc/meminfo` (`MemTotal`, `MemAvailable`) and the cgroup v2 `memory.max` and
//! `memory.current` of this process's cgroup and its ancestors (the tightest limit wins),
//! or on a cgroup v1 host the memory controller's `memory.limit_in_bytes` and
//! `memory.usage_in_bytes`; the cgroup's inactive file cache (`memory.stat`), which the
//! kernel reclaims first, is not counted as used. Memory pressure: PSI's
//! `/proc/pressure/memory` where the kernel has it.
//! macOS: `sysctl hw.memsize`; the available memory is taken as the total, since macOS
//! compresses and reclaims memory rather than leaving it free (so the elastic pool's
//! watcher, [`MemoryProbe`], never sees it short there).
//!
//! For tests, `SLOTSTREAM_SIM_RAM_GB` (a number of GiB, fractions allowed) replaces the
//! probe with a machine of that much RAM, all of it available, and no cgroup.

use std::path::{Path, PathBuf};

/// The environment variable that simulates a machine of this many GiB (for tests).
pub const SIM_RAM_ENV: &str = "SLOTSTREAM_SIM_RAM_GB";

/// A machine's memory, in bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct MachineMemory {
    /// Physical RAM (`MemTotal`, `hw.memsize`).
    pub total: u64,
    /// What the OS can give without swapping (`MemAvailable`, reclaimable page cache
    /// included).
    pub available: u64,
    /// The cgroup v2 `memory.max` of this process (the least of its cgroup's and its
    /// ancestors'), when one is set.
    pub cgroup_max: Option<u64>,
    /// The cgroup's `memory.current` (bytes it is charged now) less its inactive file
    /// cache, when `cgroup_max` is set.
    pub cgroup_current: Option<u64>,
    /// The GPU's recommended working set (Metal's `recommendedMaxWorkingSetSize`) where
    /// a unified-memory GPU runs the model; `None` elsewhere.
    pub gpu_working_set: Option<u64>,
}

impl MachineMemory {
    /// Reads this machine ([`SIM_RAM_ENV`] first). `None` where neither `/proc/meminfo` nor
    /// `sysctl` answers (the caller then cannot plan by the machine).
    pub fn probe() -> Option<Self> {
        if let Ok(gib) = std::env::var(SIM_RAM_ENV) {
            return match gib.trim().parse::<f64>() {
                Ok(g) if g > 0.0 && g.is_finite() => {
                    let bytes = (g * (1u64 << 30) as f64) as u64;
                    Some(MachineMemory {
                        total: bytes,
                        available: bytes,
                        ..Default::default()
                    })
                }
                _ => {
                    tracing::warn!(value = %gib, "{SIM_RAM_ENV} is not a positive number of GiB; ignored");
                    Self::probe_os()
                }
            };
        }
        Self::probe_os()
    }

    #[cfg(target_os = "linux")]
    fn probe_os() -> Option<Self> {
        let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
        let (total, available) = parse_meminfo(&meminfo)?;
        let (cgroup_max, cgroup_current) = std::fs::read_to_string("/proc/self/cgroup")
            .ok()
            .map_or((None, None), |text| {
                let v2 = cgroup_dir(&text, Path::new("/sys/fs/cgroup"))
                    .map_or((None, None), |dir| cgroup_limits(&dir, CgroupVersion::V2));
                if v2.0.is_some() {
                    return v2;
                }
                cgroup_v1_dir(&text, Path::new("/sys/fs/cgroup/memory"))
                    .map_or((None, None), |dir| cgroup_limits(&dir, CgroupVersion::V1))
            });
        Some(MachineMemory {
            total,
            available,
            cgroup_max,
            cgroup_current,
            gpu_working_set: None,
        })
    }

    #[cfg(target_os = "macos")]
    fn probe_os() -> Option<Self> {
        let mut total: u64 = 0;
        let mut len = std::mem::size_of::<u64>();
        // SAFETY: `hw.memsize` is a u64; `len` says the buffer's size.
        let rc = unsafe {
            libc::sysctlbyname(
                c"hw.memsize".as_ptr(),
                (&mut total as *mut u64).cast(),
                &mut len,
                std::ptr::null_mut(),
                0,
            )
        };
        (rc == 0 && total > 0).then_some(MachineMemory {
            total,
            available: total,
            ..Default::default()
        })
    }

    #[cfg(not(any(target_os = "linux", target_os = "macos")))]
    fn probe_os() -> Option<Self> {
        None
    }

    /// The RAM this process may use at most: the total, or the cgroup's limit when lower.
    pub fn ram(&self) -> u64 {
        self.cgroup_max.map_or(self.total, |m| m.min(self.total))
    }

    /// What this process can take now without swapping: the available memory, or what
    /// the cgroup's limit leaves above its current charge when that is less.
    pub fn room(&self) -> u64 {
        let cgroup_room = match (self.cgroup_max, self.cgroup_current) {
            (Some(max), Some(current)) => max.saturating_sub(current),
            (Some(max), None) => max,
            _ => u64::MAX,
        };
        self.available.min(cgroup_room)
    }
}

/// `MemTotal` and `MemAvailable` of a `/proc/meminfo` text, in bytes. `None` when either
/// is missing or malformed.
pub fn parse_meminfo(text: &str) -> Option<(u64, u64)> {
    let field = |name: &str| -> Option<u64> {
        let line = text.lines().find(|l| l.starts_with(name))?;
        let rest = line[name.len()..].trim_start().strip_prefix(':')?;
        let mut words = rest.split_whitespace();
        let n: u64 = words.next()?.parse().ok()?;
        match words.next() {
            Some("kB") => n.checked_mul(1024),
            None => Some(n),
            Some(_) => None,
        }
    };
    Some((field("MemTotal")?, field("MemAvailable")?))
}

/// A cgroup memory file (v2 `memory.max`, `memory.current`; v1 `memory.limit_in_bytes`,
/// `memory.usage_in_bytes`) in bytes: `None` for `max` (no limit), a v1 "no limit" (the
/// largest page-aligned `i64`, anything from 2^62 up) or a malformed text.
pub fn parse_cgroup_bytes(text: &str) -> Option<u64> {
    text.trim().parse().ok().filter(|&b: &u64| b < 1 << 62)
}

/// Which cgroup hierarchy a directory belongs to (its files are named differently).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CgroupVersion {
    /// `memory.max`, `memory.current`, `memory.stat`'s `inactive_file`.
    V2,
    /// `memory.limit_in_bytes`, `memory.usage_in_bytes`, `memory.stat`'s
    /// `total_inactive_file`.
    V1,
}

impl CgroupVersion {
    fn files(self) -> (&'static str, &'static str, &'static str) {
        match self {
            CgroupVersion::V2 => ("memory.max", "memory.current", "inactive_file"),
            CgroupVersion::V1 => (
                "memory.limit_in_bytes",
                "memory.usage_in_bytes",
                "total_inactive_file",
            ),
        }
    }
}

/// The directory of this process's cgroup v2 under `root`, from a `/proc/self/cgroup`
/// text (its `0::/path` line). `None` without a v2 entry.
pub fn cgroup_dir(proc_self_cgroup: &str, root: &Path) -> Option<PathBuf> {
    let path = proc_self_cgroup
        .lines()
        .find_map(|l| l.strip_prefix("0::"))?
        .trim();
    Some(root.join(path.trim_start_matches('/')))
}

/// The directory of this process's cgroup v1 memory controller under `root` (the
/// controller's mount), from a `/proc/self/cgroup` text (its `N:memory:/path` line).
/// `None` without one.
pub fn cgroup_v1_dir(proc_self_cgroup: &str, root: &Path) -> Option<PathBuf> {
    let path = proc_self_cgroup.lines().find_map(|l| {
        let mut parts = l.splitn(3, ':');
        let (_, controllers, path) = (parts.next()?, parts.next()?, parts.next()?);
        controllers
            .split(',')
            .any(|c| c == "memory")
            .then_some(path)
    })?;
    Some(root.join(path.trim().trim_start_matches('/')))
}

/// The tightest memory limit of `dir` and its ancestors that have one, with what the
/// cgroup that sets it is charged, less its inactive file cache (`memory.stat`), which
/// the kernel reclaims before it fails an allocation.
pub fn cgroup_limits(dir: &Path, version: CgroupVersion) -> (Option<u64>, Option<u64>) {
    let (max_file, current_file, inactive_key) = version.files();
    let read = |d: &Path, file: &str| {
        std::fs::read_to_string(d.join(file))
            .ok()
            .and_then(|t| parse_cgroup_bytes(&t))
    };
    let inactive = |d: &Path| {
        let stat = std::fs::read_to_string(d.join("memory.stat")).ok()?;
        stat.lines().find_map(|l| {
            let (key, value) = l.split_once(' ')?;
            (key == inactive_key).then(|| value.trim().parse::<u64>().ok())?
        })
    };
    let mut best: (Option<u64>, Option<u64>) = (None, None);
    for d in dir.ancestors() {
        if let Some(max) = read(d, max_file) {
            if best.0.is_none_or(|b| max < b) {
                let current =
                    read(d, current_file).map(|c| c.saturating_sub(inactive(d).unwrap_or(0)));
                best = (Some(max), current);
            }
        }
    }
    best
}

/// Memory pressure: PSI's `some avg10` of a `/proc/pressure/memory` text, the share (in
/// percent) of the last 10 seconds in which some task stalled waiting for memory. `None`
/// when the line is missing or malformed.
pub fn parse_pressure(text: &str) -> Option<f64> {
    let line = text.lines().find(|l| l.starts_with("some "))?;
    line.split_whitespace()
        .find_map(|w| w.strip_prefix("avg10="))?
        .parse()
        .ok()
}

/// What the elastic pool's watcher reads: the machine's memory, and its memory pressure
/// where the OS reports one.
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize)]
pub struct MemoryReading {
    pub memory: MachineMemory,
    /// PSI `some avg10` (percent, 0 to 100; [`parse_pressure`]); `None` where absent.
    pub pressure: Option<f64>,
}

/// A source of [`MemoryReading`]s: the OS ([`OsMemory`]), or a script in tests.
pub trait MemoryProbe: Send + Sync {
    /// The memory now; `None` when it cannot be read (the watcher then leaves the pool
    /// as it is).
    fn read(&self) -> Option<MemoryReading>;
}

/// The machine's own memory ([`MachineMemory::probe`], [`SIM_RAM_ENV`] included) and
/// `/proc/pressure/memory`.
#[derive(Clone, Copy, Debug, Default)]
pub struct OsMemory;

impl MemoryProbe for OsMemory {
    fn read(&self) -> Option<MemoryReading> {
        let memory = MachineMemory::probe()?;
        // A simulated machine has no pressure of its own.
        let pressure = match std::env::var_os(SIM_RAM_ENV) {
            Some(_) => None,
            None => std::fs::read_to_string("/proc/pressure/memory")
                .ok()
                .and_then(|t| parse_pressure(&t)),
        };
        Some(MemoryReading { memory, pressure })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn meminfo_parses_in_bytes() {
        let text = "MemTotal:       24591236 kB\nMemFree:         1169828 kB\nMemAvailable:   17031344 kB\nBuffers:          402468 kB\n";
        assert_eq!(
            parse_meminfo(text),
            Some((24591236 * 1024, 17031344 * 1024))
        );
        // An old kernel without MemAvailable, and a malformed value.
        assert_eq!(parse_meminfo("MemTotal: 100 kB\nMemFree: 50 kB\n"), None);
        assert_eq!(
            parse_meminfo("MemTotal: lots kB\nMemAvailable: 1 kB\n"),
            None
        );
        assert_eq!(parse_meminfo("MemTotal: 1 MB\nMemAvailable: 1 kB\n"), None);
    }

    #[test]
    fn cgroup_files_parse() {
        assert_eq!(parse_cgroup_bytes("max\n"), None);
        assert_eq!(parse_cgroup_bytes("8589934592\n"), Some(8 << 30));
        assert_eq!(parse_cgroup_bytes(""), None);
        assert_eq!(parse_cgroup_bytes("9223372036854771712\n"), None);
        let root = Path::new("/sys/fs/cgroup/memory");
        assert_eq!(
            cgroup_v1_dir("5:devices:/\n4:memory:/process_api/abc\n0::/\n", root),
            Some(root.join("process_api/abc"))
        );
        assert_eq!(
            cgroup_v1_dir("3:cpu,memory:/x\n", root),
            Some(root.join("x"))
        );
        assert_eq!(cgroup_v1_dir("0::/\n4:memoryx:/y\n", root), None);
        let root = Path::new("/sys/fs/cgroup");
        assert_eq!(cgroup_dir("0::/\n", root), Some(root.to_path_buf()));
        assert_eq!(
            cgroup_dir("12:memory:/x\n0::/user.slice/app.scope\n", root),
            Some(root.join("user.slice/app.scope"))
        );
        assert_eq!(cgroup_dir("4:memory:/docker/abc\n", root), None);
    }

    #[test]
    fn the_tightest_ancestor_limit_wins() {
        let root = std::env::temp_dir().join(format!("slotstream-cgroup-{}", std::process::id()));
        let leaf = root.join("a/b");
        std::fs::create_dir_all(&leaf).unwrap();
        std::fs::write(leaf.join("memory.max"), "max\n").unwrap();
        std::fs::write(root.join("a/memory.max"), "4294967296\n").unwrap();
        std::fs::write(root.join("a/memory.current"), "1207959552\n").unwrap();
        // 128 MiB of it inactive file cache, which is not counted.
        std::fs::write(
            root.join("a/memory.stat"),
            "anon 1073741824\nfile 134217728\ninactive_file 134217728\n",
        )
        .unwrap();
        std::fs::write(root.join("memory.max"), "8589934592\n").unwrap();
        assert_eq!(
            cgroup_limits(&leaf, CgroupVersion::V2),
            (Some(4 << 30), Some(1 << 30))
        );
        // The same limits under v1's names.
        std::fs::write(leaf.join("memory.limit_in_bytes"), "9223372036854771712\n").unwrap();
        std::fs::write(root.join("a/memory.limit_in_bytes"), "4294967296\n").unwrap();
        std::fs::write(root.join("a/memory.usage_in_bytes"), "1207959552\n").unwrap();
        std::fs::write(
            root.join("a/memory.stat"),
            "cache 134217728\ntotal_inactive_file 134217728\n",
        )
        .unwrap();
        assert_eq!(
            cgroup_limits(&leaf, CgroupVersion::V1),
            (Some(4 << 30), Some(1 << 30))
        );
        std::fs::remove_dir_all(&root).unwrap();
        let m = MachineMemory {
            total: 16 << 30,
            available: 10 << 30,
            cgroup_max: Some(4 << 30),
            cgroup_current: Some(1 << 30),
            gpu_working_set: None,
        };
        assert_eq!((m.ram(), m.room()), (4 << 30, 3 << 30));
    }

    #[test]
    fn pressure_parses() {
        let text = "some avg10=12.50 avg60=3.00 avg300=0.80 total=123456\nfull avg10=1.00 avg60=0.00 avg300=0.00 total=1\n";
        assert_eq!(parse_pressure(text), Some(12.5));
        assert_eq!(parse_pressure("full avg10=1.00\n"), None);
        assert_eq!(parse_pressure("some avg10=x\n"), None);
    }
}
