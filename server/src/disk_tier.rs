//! The disk tier under DRAM (`[disk]`, docs/OPERATIONS.md): the node's
//! [`DiskStore`](kvpool::disk::DiskStore), opened at start when `disk.path` is set, its index
//! rebuilt from the region files (docs/ARCHITECTURE.md, "Disk store").

use std::time::Instant;

use anyhow::Context;
use kvpool::disk::DiskStore;

use crate::config::{DiskAdmit, DiskSettings};

/// The node's disk tier: its store and what it admits.
#[cfg_attr(
    not(test),
    expect(
        dead_code,
        reason = "demotion and disk reads, which use it, are not wired yet"
    )
)]
pub(crate) struct DiskTier {
    /// The store of region files.
    pub(crate) store: DiskStore,
    /// Which evicted objects are worth a disk write.
    pub(crate) admit: DiskAdmit,
}

impl DiskTier {
    /// Opens the store `settings` describe (creating its directory if missing), reading every
    /// record back to rebuild its index, and logs what it found.
    pub(crate) fn open(settings: &DiskSettings) -> anyhow::Result<DiskTier> {
        let started = Instant::now();
        let dir = &settings.store.dir;
        let store = DiskStore::open(&settings.store)
            .with_context(|| format!("opening the disk tier in {}", dir.display()))?;
        let s = store.stats();
        tracing::info!(
            dir = %dir.display(),
            capacity = s.capacity,
            objects = s.objects,
            bytes = s.bytes,
            checksum_failures = s.checksum_failures,
            torn_regions = s.torn,
            io_errors = s.io_errors,
            millis = started.elapsed().as_millis() as u64,
            "disk tier ready"
        );
        Ok(DiskTier {
            store,
            admit: settings.admit,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;

    #[test]
    fn the_tier_opens_from_its_settings_and_finds_what_it_held() {
        let dir = std::env::temp_dir().join(format!("kvpool-disk-tier-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let toml = format!(
            "[disk]\npath = \"{}\"\ncapacity = \"1MiB\"\nregion_size = \"256KiB\"\nadmit = \"all\"",
            dir.display()
        );
        let settings = Config::from_toml(&toml)
            .unwrap()
            .disk_tier()
            .unwrap()
            .unwrap();
        let tier = DiskTier::open(&settings).unwrap();
        assert_eq!(tier.admit, DiskAdmit::All);
        assert_eq!(tier.store.stats().capacity, 1 << 20);
        assert_eq!(
            tier.store.insert(0, b"block", b"bytes"),
            kvpool::disk::Insert::Written
        );
        assert!(tier.store.sync());
        drop(tier);

        let again = DiskTier::open(&settings).unwrap();
        assert_eq!(
            again.store.stats().objects,
            1,
            "the index is rebuilt at open"
        );
        let mut buf = [0u8; 16];
        assert_eq!(
            again.store.get(0, b"block", &mut buf),
            kvpool::disk::Get::Hit { len: 5 }
        );
        assert_eq!(&buf[..5], b"bytes");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
