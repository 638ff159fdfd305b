//! Tools built on the engine rather than part of it: synthetic checkpoints ([`synth`]),
//! `slotstream bench` ([`bench`](mod@bench)), cache policy replay ([`cachesim`], with
//! the routing model's calibration figures), the benchmarks' charts ([`plot`]) and
//! downloads from a hub ([`pull`]).
//!
//! The engine modules never import from here: a tool may use any engine module, so an
//! import the other way would tie the engine to benchmark and test code (issue 21's
//! layering). The command line and the tests are the tools' users.

pub mod bench;
pub mod cachesim;
pub mod plot;
pub mod pull;
pub mod synth;
