//! Fetching chunks into the caller's buffers: each from its owner, then from its next replicas;
//! on the same host copied and checked straight out of the mapping, spread over the free
//! cores, otherwise read one-sided over sockets, a bounded number at once.

use std::collections::HashMap;

use futures_util::future::join_all;

use super::{LoadReport, Weights, WeightsError, KEYS_PER_REQUEST};
use crate::cores::CopyThreads;
use crate::{Client, Located};

/// Rounds of a fetch: one, and more while the view changes under it.
const FETCH_ROUNDS: usize = 3;

/// One-sided reads of one loader in flight at once, over all nodes.
const READS_IN_FLIGHT: usize = 16;

/// A chunk to fetch: its key, its expected xxh3 and where its bytes go.
pub(super) struct Sink<'a> {
    pub(super) key: Vec<u8>,
    pub(super) xxh3: u64,
    pub(super) dst: &'a mut [u8],
}

/// What became of one chunk's same-host copy (sink index).
enum Copied {
    Done(usize),
    Failed(usize),
    /// Not mapped by this client: to be read over a socket.
    Remote(usize, Located),
}

/// One chunk's same-host verified copy into its sink: Some(true) when copied and checked,
/// Some(false) when it failed (logged), None when this client does not map its node.
fn local_copy(kv: &Client, l: &Located, sink: &mut Sink<'_>) -> Option<bool> {
    if l.addr.len != sink.dst.len() as u64 {
        return Some(false);
    }
    match kv.read_local_verified(l, sink.dst)? {
        Ok(_) => Some(true),
        Err(e) => {
            tracing::warn!(
                chunk = %String::from_utf8_lossy(&sink.key),
                error = %e,
                "a chunk's same-host copy could not be read"
            );
            Some(false)
        }
    }
}

impl Weights {
    /// Fetches chunks into their sinks: each from its owner, then from its next replicas
    /// while it is missing there or fails its check. Returns the sinks found in no copy.
    pub(super) async fn fetch(
        &self,
        sinks: &mut [Sink<'_>],
        report: &mut LoadReport,
    ) -> Result<Vec<usize>, WeightsError> {
        let mut todo: Vec<usize> = (0..sinks.len()).collect();
        // A view change while the replicas are asked in turn (a node lost mid-load) can make a
        // later replica one that has no copy yet, while the new first owner has one: the
        // chunks still missing are asked again, under the new view, a few times.
        for _ in 0..FETCH_ROUNDS {
            let stamp = self.kv.routing_view().stamp();
            todo = self.fetch_round(sinks, todo, report).await?;
            if todo.is_empty() {
                break;
            }
            // Best effort: the node asked may be the one that went away.
            let _ = self.kv.view().await;
            if self.kv.routing_view().stamp() == stamp {
                break;
            }
        }
        Ok(todo)
    }

    /// One round of [`Weights::fetch`]: the chunks `todo` from each replica in turn.
    async fn fetch_round(
        &self,
        sinks: &mut [Sink<'_>],
        mut todo: Vec<usize>,
        report: &mut LoadReport,
    ) -> Result<Vec<usize>, WeightsError> {
        for replica in 0..self.kv.pinned_replicas() {
            if todo.is_empty() {
                break;
            }
            let mut failed = Vec::new();
            for group in todo.chunks(KEYS_PER_REQUEST) {
                let keys: Vec<&[u8]> = group.iter().map(|&i| &sinks[i].key[..]).collect();
                let found = self.kv.lease_replica(&keys, 0, replica).await?;
                let mut remote = Vec::new();
                for (&i, f) in group.iter().zip(found) {
                    match f {
                        Some(l) if l.checksum == sinks[i].xxh3 => remote.push((i, l)),
                        Some(_) => {
                            tracing::warn!(
                                chunk = %String::from_utf8_lossy(&sinks[i].key),
                                replica,
                                "a chunk's copy has another checksum than its manifest"
                            );
                            failed.push(i);
                        }
                        None => failed.push(i),
                    }
                }
                let remote = self.read_local(sinks, remote, &mut failed);
                self.read_remote(sinks, remote, &mut failed).await?;
            }
            let ok = todo.len() - failed.len();
            report.chunks_from_pool += ok;
            if replica > 0 {
                report.chunks_from_replicas += ok;
            }
            let bytes = |idx: &[usize]| idx.iter().map(|&i| sinks[i].dst.len() as u64).sum::<u64>();
            report.bytes_from_pool += bytes(&todo) - bytes(&failed);
            failed.sort_unstable();
            todo = failed;
        }
        Ok(todo)
    }

    /// Copies the located chunks this process maps (same host), checked in the same pass,
    /// on the cores other copies leave free when there are enough bytes to share
    /// ([`CopyThreads`]); returns the others.
    fn read_local(
        &self,
        sinks: &mut [Sink<'_>],
        located: Vec<(usize, Located)>,
        failed: &mut Vec<usize>,
    ) -> Vec<(usize, Located)> {
        let sinks_len = sinks.len();
        let asked: Vec<usize> = located.iter().map(|l| l.0).collect();
        let mut at: Vec<Option<Located>> = vec![None; sinks_len];
        for (i, l) in located {
            at[i] = Some(l);
        }
        let mut jobs: Vec<(usize, Located, &mut Sink<'_>)> = sinks
            .iter_mut()
            .enumerate()
            .filter_map(|(i, s)| at[i].map(|l| (i, l, s)))
            .collect();
        let bytes: u64 = jobs.iter().map(|j| j.1.addr.len).sum();
        let claim = CopyThreads::claim(bytes, jobs.len());
        let threads = claim.get();
        let per = jobs.len().div_ceil(threads).max(1);
        let kv = &self.kv;
        let copy = |part: &mut [(usize, Located, &mut Sink<'_>)]| {
            let mut out = Vec::new();
            for (i, l, sink) in part.iter_mut() {
                out.push(match local_copy(kv, l, sink) {
                    Some(true) => Copied::Done(*i),
                    Some(false) => Copied::Failed(*i),
                    None => Copied::Remote(*i, *l),
                });
            }
            out
        };
        let outcomes: Vec<Copied> = if threads == 1 {
            copy(&mut jobs)
        } else {
            std::thread::scope(|s| {
                let handles: Vec<_> = jobs
                    .chunks_mut(per)
                    .map(|part| s.spawn(move || copy(part)))
                    .collect();
                handles
                    .into_iter()
                    .flat_map(|h| h.join().unwrap_or_default())
                    .collect()
            })
        };
        let mut reported = vec![false; sinks_len];
        let mut remote = Vec::new();
        for o in outcomes {
            match o {
                Copied::Done(i) => reported[i] = true,
                Copied::Failed(i) => {
                    reported[i] = true;
                    failed.push(i);
                }
                Copied::Remote(i, l) => {
                    reported[i] = true;
                    remote.push((i, l));
                }
            }
        }
        // The chunks of a copying thread that died were not checked: they failed.
        failed.extend(asked.into_iter().filter(|&i| !reported[i]));
        remote
    }

    /// One-sided reads of the located chunks over sockets, [`READS_IN_FLIGHT`] at once, each
    /// hashed as it arrives and compared with the manifest.
    async fn read_remote(
        &self,
        sinks: &mut [Sink<'_>],
        located: Vec<(usize, Located)>,
        failed: &mut Vec<usize>,
    ) -> Result<(), WeightsError> {
        let by_index: HashMap<usize, Located> = located.into_iter().collect();
        let mut work: Vec<(usize, &mut Sink<'_>, Located)> = sinks
            .iter_mut()
            .enumerate()
            .filter_map(|(i, s)| by_index.get(&i).map(|l| (i, s, *l)))
            .collect();
        while !work.is_empty() {
            let take = work.len().min(READS_IN_FLIGHT);
            let batch: Vec<_> = work.drain(..take).collect();
            let answers = join_all(batch.into_iter().map(|(i, s, l)| async move {
                if l.addr.len != s.dst.len() as u64 {
                    return (i, Ok(false));
                }
                // Hashed as the bytes arrive: this task polls every read in flight, and
                // hashing a whole chunk here would stop it draining the others' sockets.
                let read = self.kv.read_hashed(&l.addr, s.dst).await;
                (i, read.map(|sum| sum == Some(s.xxh3)))
            }))
            .await;
            for (i, a) in answers {
                match a {
                    Ok(true) => {}
                    // A copy gone, replaced, failing its check, or on a node that went away:
                    // the next replica.
                    Ok(false) => failed.push(i),
                    Err(e) if e.is_unreachable() => failed.push(i),
                    Err(e) => return Err(e.into()),
                }
            }
        }
        Ok(())
    }
}
