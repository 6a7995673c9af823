//! The daemon's configuration: a TOML file, overridden by environment variables, overridden by
//! flags. Every default suits one node on a laptop; docs/OPERATIONS.md lists them all.
//!
//! - `file`: the file's sections, plain data with their defaults;
//! - `settings`: what each subsystem is given, derived from the sections and checked;
//! - `parse`: sizes, rates, modes and addresses as the file and the flags write them.

mod file;
mod parse;
mod settings;
#[cfg(test)]
mod tests;

pub use file::{
    AuthConfig, ClusterConfig, Config, DiskAdmit, DiskConfig, LimitsConfig, ListenConfig,
    MemoryConfig, NamespaceEntry, NamespaceMetrics, RespConfig, TlsConfig,
};
pub use parse::{parse_listen, parse_rate, parse_size};
pub use settings::DiskSettings;
pub(crate) use settings::{EtcdAuth, EtcdConfig, MembershipConfig};
