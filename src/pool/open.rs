//! Opening a pool, in its steps: the configuration checked, the memory laid out and created,
//! the index and the journal built, then a previous life's objects recovered.

use std::io;
use std::sync::atomic::{AtomicU64, AtomicUsize};
use std::sync::Mutex;

use crate::addr::MacKey;
use crate::error::MAX_KEY_LEN;
use crate::journal::{Journal, SharedJournal};
use crate::segment::{Backing, LAYOUT_VERSION};

use super::config::{invalid, namespaces_of};
use super::index::Shard;
use super::layout::{create_segments, plan_segments, unreserved_memory};
use super::namespace::{Namespace, NamespaceConfig};
use super::pending::PendingShard;
use super::recover::{Previous, Recovery};
use super::{stats, Pool, PoolConfig};

impl Pool {
    /// Creates the segments and the index. With file-backed segments, the objects a previous
    /// life of this node left in the directory are recovered first (see [`Pool::recovery`]),
    /// and from then on every change of the index is journaled so the next life can recover
    /// this one's. `secret` keys the memory keys of every address
    /// this pool hands out; the daemon draws it from the OS at start-up. The pool's incarnation
    /// (see [`crate::addr`]) is derived from it, so it is as random and as fresh as the secret.
    pub fn new(cfg: &PoolConfig, secret: [u8; 16]) -> io::Result<Pool> {
        let mac = MacKey::new(secret);
        let incarnation = mac.incarnation();
        if cfg.segments == 0 || cfg.segments > u16::MAX as u32 {
            return Err(invalid(format!(
                "segments must be 1..=65535, not {}",
                cfg.segments
            )));
        }
        // The previous life's journal and segments, mapped before the new files replace them.
        let previous = match &cfg.backing {
            Backing::File(dir) => Some(Previous::open(dir, cfg.node)),
            Backing::Anonymous => None,
        };
        let ns_cfg = namespaces_of(cfg)?;
        let layout = plan_segments(cfg, &ns_cfg).map_err(invalid)?;
        let segments = create_segments(cfg, &layout, incarnation)?;
        let unreserved = unreserved_memory(&segments, &layout, &ns_cfg)?;
        let nshards = cfg.shards.clamp(1, 1 << 16).next_power_of_two();
        let shards = index_shards(&ns_cfg, nshards);
        let journal = open_journal(cfg, &ns_cfg)?;
        let mut pool = Pool {
            node: cfg.node,
            incarnation,
            mac,
            segments,
            shards,
            pending: (0..nshards)
                .map(|_| Mutex::new(PendingShard::default()))
                .collect(),
            cancelled: Mutex::default(),
            namespaces: ns_cfg
                .iter()
                .map(|n| Namespace::new(n, unreserved))
                .collect(),
            ns_segments: layout.ns_segments,
            // Generations start at a point drawn with the incarnation (below 2^40, leaving 2^62
            // for this life), so even the version words of a dead daemon's segment file would
            // not recognise this life's generations.
            next_generation: AtomicU64::new((incarnation >> 24) | 1),
            segment_cursor: AtomicUsize::new(0),
            evict_cursor: AtomicUsize::new(0),
            clock: AtomicU64::new(0),
            pending_timeout: cfg.pending_timeout_ms,
            max_key_len: match cfg.max_key_len {
                0 => MAX_KEY_LEN,
                n => n.min(MAX_KEY_LEN),
            },
            max_lease: cfg.max_lease_ms,
            counters: stats::Counters::default(),
            observer: std::sync::OnceLock::new(),
            prefault: std::sync::OnceLock::new(),
            lower: std::sync::OnceLock::new(),
            shared_used: AtomicU64::new(0),
            unreserved,
            journal,
            recovery: Recovery::default(),
        };
        pool.recover_previous(previous, &cfg.backing);
        Ok(pool)
    }

    /// Recovers the objects of `previous` life, if any, with the journal's records held back
    /// meanwhile; then removes the segment files beyond this pool's (after recovery, which
    /// read them).
    fn recover_previous(&mut self, previous: Option<Previous>, backing: &Backing) {
        if let Some(prev) = previous {
            self.journal(Journal::hold);
            self.recovery = self.recover(prev);
            self.journal(Journal::release);
        }
        if let Backing::File(dir) = backing {
            crate::segment::remove_beyond(dir, self.node, self.segments.len() as u32);
        }
    }
}

/// The index shards: per namespace, one policy instance per shard, built together so they
/// share state.
fn index_shards(ns_cfg: &[NamespaceConfig], nshards: usize) -> Box<[Mutex<Shard>]> {
    let mut policies: Vec<_> = ns_cfg
        .iter()
        .map(|n| n.eviction.build_shards(nshards).into_iter())
        .collect();
    (0..nshards)
        .map(|_| {
            let ns = policies
                .iter_mut()
                .map(|p| p.next().expect("one per shard"));
            Mutex::new(Shard::new(ns.collect()))
        })
        .collect()
}

/// The index journal of file-backed segments, created anew (see [`crate::journal`]); None
/// for anonymous ones.
fn open_journal(cfg: &PoolConfig, ns_cfg: &[NamespaceConfig]) -> io::Result<Option<SharedJournal>> {
    match &cfg.backing {
        Backing::File(dir) => {
            let names: Vec<String> = ns_cfg.iter().map(|n| n.name.clone()).collect();
            Ok(Some(SharedJournal::new(Journal::create(
                dir,
                cfg.node,
                LAYOUT_VERSION,
                &names,
            )?)))
        }
        Backing::Anonymous => Ok(None),
    }
}
