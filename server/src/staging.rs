//! Staging areas: where a same-host writer whose segments are mapped read-only puts its values.
//!
//! A same-host client that maps a segment read-write could store into any byte of it,
//! committed objects included, whatever allocation it was given, and could shrink the segment's
//! file under the node. So the node hands every client its segments read-only and a writer a
//! staging area instead: a memory file of its own (`memfd`), passed as a descriptor after
//! `Staging`, sealed against shrinking and growing (`F_SEAL_SHRINK | F_SEAL_GROW`, then
//! `F_SEAL_SEAL`) before it is passed, so every byte of it the node reads stays there whatever
//! the client does (a hole it punches reads as zeros).
//! The client copies each value into a range of it and names the range in `CommitStaged`; the
//! node copies the range into the value's pending allocation (checked as any one-sided write
//! is: pending, right key, generation and bounds), hashing the bytes as they land, and commits
//! it under the same claim (`Commit::claimed`).
//! So a client's stores reach its staging area and nothing else, and a value reaches the pool
//! only through an allocation the client was given. One copy more than a read-write mapping;
//! a socket put makes the same one copy on the node.
//!
//! An area lives as long as the connection that asked for it, and serves only connections that
//! authenticated with the same token (its id alone does not admit another tenant). The areas
//! of one token are bounded by `limits.max_staging_per_token` (the resource ledger), all of
//! them by `memory.staging_total`.

use std::collections::HashMap;
use std::os::fd::{AsRawFd, FromRawFd};
use std::sync::{Arc, Mutex};

/// Checks `memory.same_host_writes`. Every segment is mapped read-only by every same-host
/// client and writers go through staging areas: `"staged"`, and `"auto"`, its old default
/// name, are the same. `"direct"` (writers mapping segments read-write) is refused: a client
/// holding a writable descriptor of a segment file could shrink the file under the node,
/// whose next access to the memory past the new end would kill it with `SIGBUS`.
pub(crate) fn check_setting(s: &str) -> anyhow::Result<()> {
    match s {
        "staged" | "auto" => Ok(()),
        "direct" => anyhow::bail!(
            "memory.same_host_writes = \"direct\" is not offered: a same-host client given a \
             writable segment could shrink it under the node; writers use staging areas \
             (\"staged\"), which cost no throughput (docs/SECURITY.md, \"Same host\")"
        ),
        other => anyhow::bail!("memory.same_host_writes must be \"staged\", not {other:?}"),
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
    /// Where each token's areas are charged.
    ledger: Arc<crate::ledger::Ledger>,
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
            self.stagings.ledger.release_staging(&a.owner, a.len());
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
    #[error("{0}")]
    Refused(crate::ledger::Refused),
    #[error("creating a staging area failed: {0}")]
    Io(#[from] std::io::Error),
    #[error("no randomness for a staging area's id: {0}")]
    Random(#[from] kvpool::protocol::auth::AuthError),
}

impl Stagings {
    /// Areas of `size` bytes, at most `total` bytes of them at once; `gauge` follows the bytes
    /// handed out.
    pub(crate) fn new(
        (size, total): (u64, u64),
        ledger: Arc<crate::ledger::Ledger>,
        gauge: prometheus_client::metrics::gauge::Gauge,
    ) -> Arc<Stagings> {
        Arc::new(Stagings {
            ledger,
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
            self.ledger
                .charge_staging(&owner, self.size)
                .map_err(StagingError::Refused)?;
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
                self.release(&owner, self.size);
                return Err(e.into());
            }
        };
        let id = match kvpool::protocol::auth::random() {
            Ok(r) => u64::from_le_bytes(r[..8].try_into().expect("8 bytes")),
            Err(e) => {
                self.release(&owner, self.size);
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

    /// Gives back `bytes` reserved for an area of `owner`'s that was not made.
    fn release(&self, owner: &[u8; 32], bytes: u64) {
        let mut guard = self.areas.lock().unwrap_or_else(|e| e.into_inner());
        guard.1 -= bytes;
        self.gauge.set(guard.1 as i64);
        self.ledger.release_staging(owner, bytes);
    }
}

/// An anonymous memory file of `len` bytes, closed on exec, sealed at that length: nobody
/// holding a descriptor of it (the client it is passed to) can shrink or grow it, or lift the
/// seals, so the node's mapping of it never reaches past the file's end.
fn memfd(len: u64) -> std::io::Result<std::fs::File> {
    let flags = libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING;
    // SAFETY: the name is a NUL-terminated C string; the call only reads it.
    let fd = unsafe { libc::memfd_create(c"kvpool-staging".as_ptr(), flags) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `fd` is a descriptor this process just opened and owns alone.
    let file = unsafe { std::fs::File::from_raw_fd(fd) };
    file.set_len(len)?;
    let seals = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;
    // SAFETY: `file` is an open memfd this process owns; F_ADD_SEALS takes an int argument
    // and touches no memory of ours.
    if unsafe { libc::fcntl(file.as_raw_fd(), libc::F_ADD_SEALS, seals) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(file)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writers_are_always_staged() {
        check_setting("staged").unwrap();
        check_setting("auto").unwrap();
        let e = check_setting("direct").unwrap_err().to_string();
        assert!(e.contains("shrink"), "{e}");
        let e = check_setting("Direct").unwrap_err().to_string();
        assert!(e.contains("memory.same_host_writes"), "{e}");
    }

    fn ledger(per_token: u64) -> Arc<crate::ledger::Ledger> {
        let mut b = crate::ledger::Bounds::none();
        b.staging_per_token = per_token;
        crate::ledger::Ledger::new(&b, &[1 << 30])
    }

    #[test]
    fn an_area_is_sealed_at_its_length() {
        let s = Stagings::new((1 << 20, 4 << 20), ledger(0), Default::default());
        let (id, _held, file) = s.create([1; 32]).unwrap();
        for len in [0, 1 << 19, 2 << 20] {
            let e = file.set_len(len).unwrap_err();
            assert_eq!(e.kind(), std::io::ErrorKind::PermissionDenied, "{len}: {e}");
        }
        // A punched hole reads back as zeros, through the node's mapping too.
        std::os::unix::fs::FileExt::write_all_at(&file, &[7u8; 8192], 0).unwrap();
        // SAFETY: punching a hole in a file this test owns; no memory is passed.
        let punched = unsafe {
            libc::fallocate(
                file.as_raw_fd(),
                libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                0,
                8192,
            )
        };
        assert_eq!(punched, 0);
        let mut out = [1u8; 8192];
        s.get(id, &[1; 32]).unwrap().copy_out(0, &mut out).unwrap();
        assert_eq!(out, [0u8; 8192]);
    }

    #[test]
    fn a_token_meets_its_own_bound_before_the_nodes() {
        let s = Stagings::new((1 << 20, 8 << 20), ledger(2 << 20), Default::default());
        let (_a1, _h1, _) = s.create([1; 32]).unwrap();
        let (_a2, h2, _) = s.create([1; 32]).unwrap();
        match s.create([1; 32]) {
            Err(StagingError::Refused(r)) => {
                assert_eq!(r.limit, crate::ledger::Limit::StagingPerToken)
            }
            other => panic!("{:?}", other.map(|(id, ..)| id)),
        }
        s.create([2; 32]).unwrap();
        drop(h2);
        s.create([1; 32]).unwrap();
    }

    #[test]
    fn areas_are_bounded_owned_and_retired_with_their_holder() {
        let gauge = prometheus_client::metrics::gauge::Gauge::default();
        let s = Stagings::new((1 << 20, 2 << 20), ledger(0), gauge.clone());
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
        assert!(Stagings::new((0, 1 << 30), ledger(0), gauge)
            .create([0; 32])
            .is_err());
    }
}
