//! `kvpool-bench tier`: the disk tier's figures on real daemons, each part its own subcommand.
//!
//! - `interference`: 4 KiB gets of a hot set that stays in DRAM while a writer keeps DRAM
//!   evicting, on a daemon without a disk tier and on one whose tier takes every eviction
//!   (`--disk-admit all`), in alternating pairs; the ratio of their p99s.
//! - `restart`: a disk tier filled with `--objects` small objects, the daemon stopped cleanly
//!   and started again on the same directory, timed from the spawn to its ready line and to
//!   the first value served from disk, with the page cache of the tier's files dropped and not.
//!
//! Both put the tier's directory on a real file system (`--disk-dir`; tmpfs and ramfs are
//! refused unless `--any-fs`: a tier in memory measures no disk, only the demotion path's own
//! cost). Every run is bounded and stops by itself; nothing here asserts on time.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use clap::{Args, Subcommand};

mod interference;
mod restart;

/// Arguments of `kvpool-bench tier`.
#[derive(Args, Debug)]
pub(crate) struct TierArgs {
    #[command(subcommand)]
    part: Part,
}

#[derive(Subcommand, Debug)]
enum Part {
    /// DRAM gets while the disk tier demotes at full rate, against the same gets with the tier
    /// off, in alternating pairs of daemons.
    Interference(interference::InterferenceArgs),
    /// Time to serve again after a restart with many objects on disk.
    Restart(restart::RestartArgs),
}

/// Runs the part asked for.
pub(crate) fn run(args: TierArgs) -> anyhow::Result<()> {
    match args.part {
        Part::Interference(a) => interference::run(a),
        Part::Restart(a) => restart::run(a),
    }
}

/// A fresh directory for a disk tier under `base`, which must be on a real file system unless
/// `any_fs`.
fn disk_dir(base: &Path, name: &str, any_fs: bool) -> anyhow::Result<PathBuf> {
    let kind = fs_kind(base)?;
    if !any_fs && matches!(kind, "tmpfs" | "ramfs") {
        bail!(
            "{} is on {kind}: the disk tier must be on a real disk (pass --disk-dir)",
            base.display()
        );
    }
    let dir = base.join(format!("kvpool-bench-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    Ok(dir)
}

/// The file system `path` is on, by `statfs(2)`'s magic number (what `stat -f` prints).
fn fs_kind(path: &Path) -> anyhow::Result<&'static str> {
    let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes())?;
    // SAFETY: all-zero bytes are a valid `statfs` (plain integers), filled in below.
    let mut s: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: `c` is a NUL-terminated path and `s` a valid, writable `statfs`.
    if unsafe { libc::statfs(c.as_ptr(), &mut s) } != 0 {
        return Err(std::io::Error::last_os_error())
            .with_context(|| format!("statfs {}", path.display()));
    }
    Ok(match s.f_type as i64 {
        0x0102_1994 => "tmpfs",
        0x8584_58f6 => "ramfs",
        0xef53 => "ext2/ext3/ext4",
        0x5846_5342 => "xfs",
        0x9123_683e => "btrfs",
        0x2fc1_2fc1 => "zfs",
        0x794c_7630 => "overlayfs",
        _ => "another file system",
    })
}

/// Bytes free to an unprivileged writer on the file system of `path`.
fn free_bytes(path: &Path) -> anyhow::Result<u64> {
    let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes())?;
    // SAFETY: all-zero bytes are a valid `statvfs` (plain integers), filled in below.
    let mut s: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: `c` is a NUL-terminated path and `s` a valid, writable `statvfs`.
    if unsafe { libc::statvfs(c.as_ptr(), &mut s) } != 0 {
        return Err(std::io::Error::last_os_error())
            .with_context(|| format!("statvfs {}", path.display()));
    }
    Ok(s.f_bavail as u64 * s.f_frsize as u64)
}
