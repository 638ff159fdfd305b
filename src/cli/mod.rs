//! The subcommands of the `slotstream` binary, one module each (`cachesim` and
//! `routing-calibration` share `routing`), over the flag groups in [`flags`] and the
//! engine loading in [`load`]. The binary's own: the library does not see them.

pub mod bench;
pub mod chat;
pub mod demo;
pub mod devices;
pub mod flags;
pub mod generate;
pub mod launch;
pub mod load;
pub mod pack;
pub mod plan;
pub mod pull;
pub mod routing;
pub mod score;
pub mod serve;
pub mod synth;

/// slotstream's cache directory: `$XDG_CACHE_HOME/slotstream`, else
/// `~/.cache/slotstream`, else under the system's temporary directory (the demo model,
/// `launch`'s logs and per-run configurations, `pull`'s models).
pub fn cache_dir() -> std::path::PathBuf {
    std::env::var_os("XDG_CACHE_HOME")
        .filter(|d| !d.is_empty())
        .map(std::path::PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| std::path::PathBuf::from(h).join(".cache")))
        .unwrap_or_else(std::env::temp_dir)
        .join("slotstream")
}
