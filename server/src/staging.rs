//! Staging areas: where a same-host writer whose segments are mapped read-only puts its values.
//!
//! A same-host client that maps a segment read-write can store into any byte of it, committed
//! objects included, whatever allocation it was given. Where that matters (a segment holding a
//! namespace with tokens, under `memory.same_host_writes = "auto"`, or every segment under
//! `"staged"`) the node maps segments read-only for every client and hands a writer a staging
//! area instead: a memory file of its own (`memfd`), passed as a descriptor after `Staging`.
//! The client copies each value into a range of it and names the range in `CommitStaged`; the
//! node copies the range into the value's pending allocation (checked as any one-sided write
//! is: pending, right key, generation and bounds), hashing the bytes as they land, and commits
//! it under the same claim (`Pool::commit_claimed`).
//! So a client's stores reach its staging area and nothing else, and a value reaches the pool
//! only through an allocation the client was given. One copy more than a read-write mapping;
//! a socket put makes the same one copy on the node.
//!
//! An area lives as long as the connection that asked for it, and serves only connections that
//! authenticated with the same token (its id alone does not admit another tenant). The areas
//! together are bounded by `memory.staging_total`.

use std::collections::HashMap;
use std::os::fd::FromRawFd;
use std::sync::{Arc, Mutex};

/// Which segments a same-host writer maps read-only (`memory.same_host_writes`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Policy {
    /// Read-write wherever the token may write every namespace of the segment.
    Direct,
    /// Read-only everywhere; writers use staging areas.
    Staged,
    /// Staged for segments holding a namespace with tokens, direct for the others.
    Auto,
}

impl Policy {
    /// The setting's value.
    pub(crate) fn parse(s: &str) -> anyhow::Result<Policy> {
        Ok(match s {
            "direct" => Policy::Direct,
            "staged" => Policy::Staged,
            "auto" => Policy::Auto,
            other => anyhow::bail!(
                "memory.same_host_writes must be \"auto\", \"staged\" or \"direct\", not {other:?}"
            ),
        })
    }
}

/// One staging area.
pub(crate) struct Area {
    /// Who may name it: the SHA-256 digest of the token its connection authenticated with.
    owner: [u8; 32],
    map: memmap2::MmapRaw,
}

impl Area {
    /// Its length.
    pub(crate) fn len(&self) -> u64 {
        self.map.len() as u64
    }

    /// Copies `dst.len()` bytes from `offset` into `dst` and returns the xxh3 of the bytes
    /// that landed in `dst` (one pass); None when the range is outside the area.
    pub(crate) fn copy_out(&self, offset: u64, dst: &mut [u8]) -> Option<u64> {
        let end = offset.checked_add(dst.len() as u64)?;
        if end > self.len() {
            return None;
        }
        // SAFETY: [offset, end) is inside the mapping (checked above), which lives as long as
        // `self`, and `dst` is a distinct buffer this caller holds exclusively. The client may
        // store into the area at any time: `copy_checksum` only reads the source through raw
        // pointers and hashes what it wrote to `dst` (which no client can write), so a value
        // changed during the copy fails its commit's checksum instead of landing.
        Some(unsafe {
            kvpool::checksum::copy_checksum(
                self.map.as_ptr().add(offset as usize),
                dst.as_mut_ptr(),
                dst.len(),
            )
        })
    }
}

/// Every staging area of the node, by id.
pub(crate) struct Stagings {
    /// Bytes of one area (0: none handed out).
    pub(crate) size: u64,
    /// Most bytes of all areas together.
    total: u64,
    /// The areas by id, and the bytes reserved for them.
    areas: Mutex<(HashMap<u64, Arc<Area>>, u64)>,
    /// `kvpool_staging_bytes`: the bytes reserved, for the metrics page.
    gauge: prometheus_client::metrics::gauge::Gauge,
}

/// An area's registration, held by the connection that asked for it: dropping it (the
/// connection closing) retires the area.
pub(crate) struct Held {
    stagings: Arc<Stagings>,
    id: u64,
}

impl Drop for Held {
    fn drop(&mut self) {
        let mut guard = self
            .stagings
            .areas
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        let (areas, used) = &mut *guard;
        if let Some(a) = areas.remove(&self.id) {
            *used -= a.len();
            self.stagings.gauge.set(*used as i64);
        }
    }
}

/// Why no area was handed out.
#[derive(Debug, thiserror::Error)]
pub(crate) enum StagingError {
    #[error("this node hands out no staging areas (memory.staging = 0)")]
    Off,
    #[error("the node's staging areas are all in use (memory.staging_total)")]
    Full,
    #[error("creating a staging area failed: {0}")]
    Io(#[from] std::io::Error),
    #[error("no randomness for a staging area's id: {0}")]
    Random(#[from] kvpool::protocol::auth::AuthError),
}

impl Stagings {
    /// Areas of `size` bytes, at most `total` bytes of them at once; `gauge` follows the bytes
    /// handed out.
    pub(crate) fn new(
        size: u64,
        total: u64,
        gauge: prometheus_client::metrics::gauge::Gauge,
    ) -> Arc<Stagings> {
        Arc::new(Stagings {
            size,
            total,
            areas: Mutex::new((HashMap::new(), 0)),
            gauge,
        })
    }

    /// A new area for a connection authenticated with the token of digest `owner`: its id, the
    /// registration that keeps it, and the descriptor to pass.
    pub(crate) fn create(
        self: &Arc<Self>,
        owner: [u8; 32],
    ) -> Result<(u64, Held, std::fs::File), StagingError> {
        if self.size == 0 {
            return Err(StagingError::Off);
        }
        {
            let mut guard = self.areas.lock().unwrap_or_else(|e| e.into_inner());
            let used = &mut guard.1;
            if used.saturating_add(self.size) > self.total {
                return Err(StagingError::Full);
            }
            *used += self.size; // reserved now, so two creations never pass the total together
            self.gauge.set(*used as i64);
        }
        let made = memfd(self.size).and_then(|file| {
            let map = memmap2::MmapOptions::new()
                .len(self.size as usize)
                .map_raw(&file)?;
            Ok((file, map))
        });
        let (file, map) = match made {
            Ok(m) => m,
            Err(e) => {
                self.release(self.size);
                return Err(e.into());
            }
        };
        let id = match kvpool::protocol::auth::random() {
            Ok(r) => u64::from_le_bytes(r[..8].try_into().expect("8 bytes")),
            Err(e) => {
                self.release(self.size);
                return Err(e.into());
            }
        };
        let area = Arc::new(Area { owner, map });
        self.areas
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .0
            .insert(id, area);
        let held = Held {
            stagings: self.clone(),
            id,
        };
        Ok((id, held, file))
    }

    /// The area `id`, when a connection authenticated with the token of digest `owner` may
    /// use it.
    pub(crate) fn get(&self, id: u64, owner: &[u8; 32]) -> Option<Arc<Area>> {
        let guard = self.areas.lock().unwrap_or_else(|e| e.into_inner());
        let area = guard.0.get(&id)?;
        kvpool::protocol::auth::digests_equal(&area.owner, owner).then(|| area.clone())
    }

    fn release(&self, bytes: u64) {
        let mut guard = self.areas.lock().unwrap_or_else(|e| e.into_inner());
        guard.1 -= bytes;
        self.gauge.set(guard.1 as i64);
    }
}

/// An anonymous memory file of `len` bytes, closed on exec.
fn memfd(len: u64) -> std::io::Result<std::fs::File> {
    // SAFETY: the name is a NUL-terminated C string; the call only reads it.
    let fd = unsafe { libc::memfd_create(c"kvpool-staging".as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `fd` is a descriptor this process just opened and owns alone.
    let file = unsafe { std::fs::File::from_raw_fd(fd) };
    file.set_len(len)?;
    Ok(file)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_setting_takes_three_values() {
        assert_eq!(Policy::parse("auto").unwrap(), Policy::Auto);
        assert_eq!(Policy::parse("staged").unwrap(), Policy::Staged);
        assert_eq!(Policy::parse("direct").unwrap(), Policy::Direct);
        let e = Policy::parse("Direct").unwrap_err().to_string();
        assert!(e.contains("memory.same_host_writes"), "{e}");
    }

    #[test]
    fn areas_are_bounded_owned_and_retired_with_their_holder() {
        let gauge = prometheus_client::metrics::gauge::Gauge::default();
        let s = Stagings::new(1 << 20, 2 << 20, gauge.clone());
        let (a, held_a, file) = s.create([1; 32]).unwrap();
        let (_b, held_b, _) = s.create([2; 32]).unwrap();
        assert!(matches!(s.create([1; 32]), Err(StagingError::Full)));
        assert_eq!(gauge.get(), 2 << 20);
        // What the client stores through its descriptor is what the node copies out.
        std::os::unix::fs::FileExt::write_all_at(&file, b"staged bytes", 4096).unwrap();
        let area = s.get(a, &[1; 32]).expect("its owner finds it");
        assert!(s.get(a, &[2; 32]).is_none(), "another token does not");
        let mut out = [0u8; 12];
        let hashed = area.copy_out(4096, &mut out);
        assert_eq!(&out, b"staged bytes");
        assert_eq!(hashed, Some(kvpool::checksum::checksum(b"staged bytes")));
        assert!(
            area.copy_out((1 << 20) - 4, &mut out).is_none(),
            "past its end"
        );
        assert!(
            area.copy_out(u64::MAX, &mut out).is_none(),
            "an offset that overflows"
        );
        drop(held_a);
        assert!(s.get(a, &[1; 32]).is_none(), "retired with its connection");
        assert_eq!(gauge.get(), 1 << 20);
        s.create([3; 32]).unwrap();
        drop(held_b);
        assert!(Stagings::new(0, 1 << 30, gauge).create([0; 32]).is_err());
    }
}
