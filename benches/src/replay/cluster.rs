//! Several caches as one fleet: *pooled* (every block lives on the node that owns its key by
//! weighted rendezvous hashing, exactly as the kvpool client routes) or *private* (each node a
//! separate cache, requests spread round-robin: what a fleet without a shared pool gets).

use kvpool::placement::{ClusterView, NodeInfo};

use super::cache::BlockCache;
use super::pool_engine::block_key;
use super::tiers::TierStats;

/// N caches pooled into one by key placement.
pub struct Pooled {
    nodes: Vec<Box<dyn BlockCache>>,
    view: ClusterView,
}

impl Pooled {
    /// Pools `nodes` with equal weights.
    pub fn new(nodes: Vec<Box<dyn BlockCache>>) -> Self {
        let view = ClusterView::from_nodes(
            (0..nodes.len() as u32)
                .map(|id| NodeInfo::serving(id, 1))
                .collect(),
        );
        Pooled { nodes, view }
    }

    fn owner(&self, block: u64) -> usize {
        self.view
            .owner(&block_key(block))
            .map_or(0, |n| n.0 as usize)
    }

    /// Splits blocks by owner, keeping each block's index in the request.
    fn split(&self, blocks: &[u64], next: &[u64]) -> Vec<(Vec<u64>, Vec<u64>, Vec<usize>)> {
        let mut parts = vec![(Vec::new(), Vec::new(), Vec::new()); self.nodes.len()];
        for (i, &b) in blocks.iter().enumerate() {
            let p = &mut parts[self.owner(b)];
            p.0.push(b);
            p.1.push(next.get(i).copied().unwrap_or(u64::MAX));
            p.2.push(i);
        }
        parts
    }
}

impl BlockCache for Pooled {
    /// One lookup per owner; the leading run over the whole request is the smallest index of a
    /// block some owner did not vouch for.
    fn lookup(&mut self, blocks: &[u64]) -> anyhow::Result<usize> {
        let mut run = blocks.len();
        for (node, (sub, _, idx)) in self.split(blocks, &[]).into_iter().enumerate() {
            if sub.is_empty() {
                continue;
            }
            let n = self.nodes[node].lookup(&sub)?;
            if n < sub.len() {
                run = run.min(idx[n]);
            }
        }
        Ok(run)
    }

    fn store(&mut self, blocks: &[u64], next_use: &[u64]) -> anyhow::Result<()> {
        for (node, (sub, next, _)) in self.split(blocks, next_use).into_iter().enumerate() {
            if !sub.is_empty() {
                self.nodes[node].store(&sub, &next)?;
            }
        }
        Ok(())
    }
}

/// N separate caches; request `i` goes to node `i mod N` (its lookup and its store alike).
pub struct Private {
    nodes: Vec<Box<dyn BlockCache>>,
    next: usize,
}

impl Private {
    /// Private caches.
    pub fn new(nodes: Vec<Box<dyn BlockCache>>) -> Self {
        Private { nodes, next: 0 }
    }
}

impl BlockCache for Private {
    fn lookup(&mut self, blocks: &[u64]) -> anyhow::Result<usize> {
        self.nodes[self.next].lookup(blocks)
    }

    fn store(&mut self, blocks: &[u64], next_use: &[u64]) -> anyhow::Result<()> {
        let r = self.nodes[self.next].store(blocks, next_use);
        self.next = (self.next + 1) % self.nodes.len();
        r
    }

    /// Every node's tiers summed: each serves whole requests, so its hits are the requests'.
    fn tiers(&self) -> Option<TierStats> {
        self.nodes
            .iter()
            .map(|n| n.tiers())
            .try_fold(TierStats::default(), |sum, t| Some(sum.sum(t?)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::replay::cache::Unbounded;

    #[test]
    fn pooled_lookup_is_the_leading_run_over_all_owners() {
        let mut p = Pooled::new(
            (0..3)
                .map(|_| Box::new(Unbounded::default()) as Box<dyn BlockCache>)
                .collect(),
        );
        p.store(&[1, 2, 3, 4, 5, 6, 7, 8], &[]).unwrap();
        assert_eq!(p.lookup(&[1, 2, 3, 4, 5, 6, 7, 8]).unwrap(), 8);
        assert_eq!(p.lookup(&[1, 2, 3, 99, 5, 6]).unwrap(), 3);
        assert_eq!(p.lookup(&[99]).unwrap(), 0);
        // Blocks really are spread.
        let owners: std::collections::HashSet<usize> = (0..100).map(|b| p.owner(b)).collect();
        assert_eq!(owners.len(), 3);
    }

    #[test]
    fn private_caches_do_not_share() {
        let mut p = Private::new(
            (0..2)
                .map(|_| Box::new(Unbounded::default()) as Box<dyn BlockCache>)
                .collect(),
        );
        assert_eq!(p.lookup(&[1]).unwrap(), 0);
        p.store(&[1], &[]).unwrap(); // node 0
        assert_eq!(p.lookup(&[1]).unwrap(), 0); // node 1 has not seen it
        p.store(&[1], &[]).unwrap();
        assert_eq!(p.lookup(&[1]).unwrap(), 1); // node 0 again
    }
}
