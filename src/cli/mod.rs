//! The subcommands of the `slotstream` binary, one module each (`cachesim` and
//! `routing-calibration` share `routing`), over the flag groups in [`flags`] and the
//! engine loading in [`load`]. The binary's own: the library does not see them.

pub mod bench;
pub mod chat;
pub mod demo;
pub mod devices;
pub mod flags;
pub mod generate;
pub mod load;
pub mod pack;
pub mod plan;
pub mod routing;
pub mod score;
pub mod serve;
pub mod synth;
