//! Which keys this node has taken a write or a remove of: what lets a client serve a key from
//! its *previous* owner without ever shadowing a newer write acknowledged here.
//!
//! After the view changes, a client that misses a key on its owner may look it up on the
//! key's owner under its previous view (`fallback_window`). That copy is older than any write
//! of the key this node acknowledged since it took the key over, so the client may only use it
//! when this node *vouches*: it has taken no write (put, batch put, alloc) and no remove of the
//! key since its horizon, and at the horizon it did not own the key. The horizon is the
//! process start (a fresh process holds nothing and has acknowledged nothing), or, once the
//! record grew to [`MAX_WRITTEN`] keys, the moment it was emptied, with the view this node held
//! then.
//!
//! Why that is sound: every write or remove of a key that this node acknowledged after the
//! horizon was noted here before it was acknowledged, so a vouched key has none. A write
//! before the horizon (before an emptying; there is none before a start) was of a key this
//! node no longer owned at the horizon, so another node owned it later and any copy the
//! previous owner holds from that later ownership is newer. Fingerprints that collide only
//! refuse more (a miss, never a stale value), except through [`Written::forget`].
//!
//! Not noted: a cluster peer's copy (the mover handing this node a key it now owns), which is
//! the previous owner's own data. Forgotten: a key this node handed over with its latest write
//! (the mover's handoff), after which no copy elsewhere is older than a write it acknowledged.

use std::collections::HashSet;
use std::sync::Mutex;

use kvpool::placement::ClusterView;
use kvpool::NodeId;

/// Most keys noted before the record is emptied (8 bytes each, plus the table's overhead).
pub(crate) const MAX_WRITTEN: usize = 1 << 20;

/// The keys written or removed here since the horizon.
#[derive(Default)]
pub(crate) struct Written {
    inner: Mutex<Inner>,
}

#[derive(Default)]
struct Inner {
    /// Fingerprints of `(namespace, key)` written or removed since the horizon.
    keys: HashSet<u64>,
    /// The view at the horizon: None when the horizon is the process start.
    horizon: Option<ClusterView>,
}

impl Written {
    /// Notes a write or remove of `key`, before it is acknowledged. `view` gives this node's
    /// current view, needed only when the record is full and starts again.
    pub(crate) fn note(&self, ns: u32, key: &[u8], view: impl FnOnce() -> ClusterView) {
        let fp = fingerprint(ns, key);
        let mut g = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        if g.keys.len() >= MAX_WRITTEN && !g.keys.contains(&fp) {
            // Start again from now: keys this node owns now are never vouched for again, and
            // the ones it does not own have had every later write noted.
            g.keys = HashSet::new();
            g.horizon = Some(view());
        }
        g.keys.insert(fp);
    }

    /// Forgets the writes and removes of `key` noted here. Only for a key whose owners were
    /// shown to hold this node's latest write of it (the same bytes, and no newer generation
    /// here: the mover's handoff), so no copy elsewhere can be older than a write acknowledged
    /// here. A fingerprint shared with another key (odds 2^-64 a pair) forgets that key's
    /// record too.
    pub(crate) fn forget(&self, ns: u32, key: &[u8]) {
        let fp = fingerprint(ns, key);
        let mut g = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        g.keys.remove(&fp);
    }

    /// Runs `f` (a commit of a peer's copy of `key`) only if this node vouches for that copy
    /// ([`Written::vouches`]), under the lock that every [`Written::note`] takes: a write or
    /// remove of the key noted before is seen and refuses the copy, and one noted after comes
    /// after the copy's commit and replaces or removes it. None when refused.
    pub(crate) fn if_vouched<T>(
        &self,
        (ns, key): (u32, &[u8]),
        me: NodeId,
        replicas: usize,
        f: impl FnOnce() -> T,
    ) -> Option<T> {
        let g = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        Self::vouched(&g, ns, key, me, replicas).then(f)
    }

    /// True when a copy of `key` on another node can't shadow a write acknowledged here: no
    /// write or remove of it since the horizon, and `me` was not among its first `replicas`
    /// owners at the horizon.
    pub(crate) fn vouches(&self, ns: u32, key: &[u8], me: NodeId, replicas: usize) -> bool {
        let g = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        Self::vouched(&g, ns, key, me, replicas)
    }

    fn vouched(g: &Inner, ns: u32, key: &[u8], me: NodeId, replicas: usize) -> bool {
        if g.keys.contains(&fingerprint(ns, key)) {
            return false;
        }
        g.horizon
            .as_ref()
            .is_none_or(|v| !v.owners(key, replicas.max(1)).contains(&me))
    }
}

fn fingerprint(ns: u32, key: &[u8]) -> u64 {
    xxhash_rust::xxh3::xxh3_64_with_seed(key, u64::from(ns))
}

#[cfg(test)]
mod tests {
    use kvpool::placement::NodeInfo;

    use super::*;

    fn view(ids: &[u32]) -> ClusterView {
        ClusterView::from_nodes(ids.iter().map(|&id| NodeInfo::serving(id, 1)).collect())
    }

    #[test]
    fn a_written_or_removed_key_is_never_vouched_for() {
        let w = Written::default();
        let me = NodeId(1);
        assert!(w.vouches(0, b"k", me, 1));
        w.note(0, b"k", || view(&[0, 1]));
        assert!(!w.vouches(0, b"k", me, 1));
        // Namespaces are apart.
        assert!(w.vouches(1, b"k", me, 1));
    }

    #[test]
    fn after_emptying_keys_owned_at_the_horizon_are_refused() {
        let w = Written::default();
        let me = NodeId(1);
        let v = view(&[0, 1]);
        {
            let mut g = w.inner.lock().unwrap();
            g.keys = (0..MAX_WRITTEN as u64).collect();
        }
        w.note(0, b"trigger", || v.clone());
        let g = w.inner.lock().unwrap();
        assert_eq!(g.keys.len(), 1, "emptied, then the new key noted");
        drop(g);
        let keys: Vec<Vec<u8>> = (0..200u32).map(|i| i.to_le_bytes().to_vec()).collect();
        let (mine, theirs): (Vec<_>, Vec<_>) = keys.iter().partition(|k| v.owner(k) == Some(me));
        assert!(!mine.is_empty() && !theirs.is_empty());
        assert!(mine.iter().all(|k| !w.vouches(0, k, me, 1)));
        assert!(theirs.iter().all(|k| w.vouches(0, k, me, 1)));
        // With two replicas this node owned every key of a two-node view.
        assert!(theirs.iter().all(|k| !w.vouches(0, k, me, 2)));
    }

    #[test]
    fn a_peer_copy_commits_only_while_vouched_for() {
        let w = Written::default();
        let me = NodeId(1);
        assert_eq!(w.if_vouched((0, b"k"), me, 1, || 7), Some(7));
        w.note(0, b"k", || view(&[0, 1]));
        let mut ran = false;
        assert_eq!(w.if_vouched((0, b"k"), me, 1, || ran = true), None);
        assert!(!ran, "refused without running the commit");
        w.forget(0, b"k");
        assert_eq!(w.if_vouched((0, b"k"), me, 1, || 8), Some(8));
    }
}
