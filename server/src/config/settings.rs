//! What each subsystem is given: derived from the file's sections, and checked on the way.

use std::sync::Arc;

use anyhow::bail;
use kvpool::pool::NamespaceConfig;
use kvpool::protocol::Limits;

use super::file::{Config, DiskAdmit, NamespaceEntry};
use crate::http::Url;

impl Config {
    /// Per namespace (in the pool's id order), `f` of its `[[namespace]]` entry, or `absent`
    /// for a namespace without one (`default` and `weights` when not configured).
    fn per_namespace<T: Clone>(
        &self,
        pool_namespaces: &[(String, u32)],
        absent: T,
        f: impl Fn(&NamespaceEntry) -> T,
    ) -> Vec<T> {
        let mut out = vec![absent; pool_namespaces.len()];
        for (name, id) in pool_namespaces {
            if let Some(n) = self.namespaces.iter().find(|n| &n.name == name) {
                out[*id as usize] = f(n);
            }
        }
        out
    }

    /// Per namespace (in the pool's id order), the tokens that may use it.
    pub fn namespace_tokens(&self, pool_namespaces: &[(String, u32)]) -> Vec<Vec<String>> {
        self.per_namespace(pool_namespaces, Vec::new(), |n| n.tokens.clone())
    }

    /// Per namespace (in the pool's id order), the tokens that may only read it.
    pub fn namespace_read_tokens(&self, pool_namespaces: &[(String, u32)]) -> Vec<Vec<String>> {
        self.per_namespace(pool_namespaces, Vec::new(), |n| n.read_tokens.clone())
    }

    /// Per namespace (in the pool's id order): (replicas, pinned replicas).
    pub fn replication(&self, pool_namespaces: &[(String, u32)]) -> Vec<(u32, u32)> {
        self.per_namespace(pool_namespaces, (1, 2), |n| {
            (n.replicas.max(1), n.pinned_replicas.max(1))
        })
    }

    /// Per namespace (in the pool's id order): its bulk rate cap, bytes per second.
    pub fn bulk_rates(&self, pool_namespaces: &[(String, u32)]) -> Vec<Option<u64>> {
        self.per_namespace(pool_namespaces, None, |n| n.bulk_rate.filter(|&r| r > 0))
    }

    /// How this node learns the cluster: heartbeats to `peers`, or etcd.
    pub(crate) fn membership(&self) -> anyhow::Result<MembershipConfig> {
        let c = &self.cluster;
        if c.etcd.is_empty() {
            return Ok(MembershipConfig::Static {
                peers: c.peers.clone(),
            });
        }
        if !c.peers.is_empty() {
            bail!("cluster: set either peers (static membership) or etcd, not both");
        }
        if c.etcd_prefix.is_empty() {
            bail!("cluster.etcd_prefix must not be empty");
        }
        let endpoints = c
            .etcd
            .iter()
            .map(|u| Url::parse(u).map_err(|e| anyhow::anyhow!("cluster.etcd: {e}")))
            .collect::<anyhow::Result<Vec<Url>>>()?;
        let auth = match (&c.etcd_user, &c.etcd_password_file) {
            (None, None) => None,
            (Some(user), Some(file)) if !user.is_empty() => {
                let text = std::fs::read_to_string(file).map_err(|e| {
                    anyhow::anyhow!("cluster.etcd_password_file {}: {e}", file.display())
                })?;
                let password = text.trim().to_string();
                if password.is_empty() {
                    bail!("cluster.etcd_password_file {} is empty", file.display());
                }
                Some(EtcdAuth {
                    user: user.clone(),
                    password,
                })
            }
            _ => bail!("cluster: etcd_user and etcd_password_file go together"),
        };
        let tls = self.etcd_tls(&endpoints)?;
        Ok(MembershipConfig::Etcd(EtcdConfig {
            endpoints,
            prefix: c.etcd_prefix.clone(),
            auth,
            tls,
        }))
    }

    /// The TLS client configuration for etcd's `https://` endpoints: needed by them, refused
    /// without them (a CA or certificate that would never be used is a mistake worth saying).
    fn etcd_tls(&self, endpoints: &[Url]) -> anyhow::Result<Option<Arc<rustls::ClientConfig>>> {
        let c = &self.cluster;
        let https = endpoints.iter().any(|u| u.tls);
        let client = match (&c.etcd_cert_file, &c.etcd_key_file) {
            (None, None) => None,
            (Some(cert), Some(key)) => Some((cert.as_path(), key.as_path())),
            _ => bail!("cluster: etcd_cert_file and etcd_key_file go together"),
        };
        match (&c.etcd_ca_file, https) {
            (None, false) if client.is_none() => Ok(None),
            (Some(ca), true) => crate::tls::https_client_config(ca, client)
                .map(|t| Some(Arc::new(t)))
                .map_err(|e| anyhow::anyhow!("cluster.etcd_ca_file: {e:#}")),
            (None, true) => bail!(
                "cluster.etcd has https:// URLs: set cluster.etcd_ca_file to the CA that \
                 signed etcd's certificate"
            ),
            (_, false) => bail!(
                "cluster: etcd_ca_file, etcd_cert_file and etcd_key_file are for https:// \
                 etcd URLs, and every URL is http://"
            ),
        }
    }

    /// The wire limits.
    pub fn wire_limits(&self) -> anyhow::Result<Limits> {
        let l = &self.limits;
        if l.max_header == 0 || l.max_header > u32::MAX as u64 || l.max_batch == 0 {
            bail!("limits: max_header must be 1..4GiB and max_batch at least 1");
        }
        if !(1..=kvpool::MAX_KEY_LEN as u32).contains(&l.max_key_len) {
            bail!(
                "limits: max_key_len must be 1..={} (the format's longest key)",
                kvpool::MAX_KEY_LEN
            );
        }
        if l.max_pending_per_connection == 0 {
            bail!("limits: max_pending_per_connection must be at least 1");
        }
        self.ledger_bounds()?;
        Ok(Limits {
            max_header: l.max_header as u32,
            max_payload: l.max_payload,
            max_batch: l.max_batch,
        })
    }

    /// The bounds of the resource ledger (`[limits] max_*_per_connection`,
    /// `max_*_per_namespace`, `max_held_share`, `max_staging_per_token`).
    pub(crate) fn ledger_bounds(&self) -> anyhow::Result<crate::ledger::Bounds> {
        use crate::ledger::Resource;
        let l = &self.limits;
        let per_namespace = [
            ("max_pending_per_namespace", l.max_pending_per_namespace),
            ("max_holds_per_namespace", l.max_holds_per_namespace),
            ("max_watches_per_namespace", l.max_watches_per_namespace),
            (
                "max_subscriptions_per_namespace",
                l.max_subscriptions_per_namespace,
            ),
            (
                "max_event_subscriptions_per_namespace",
                l.max_event_subscriptions_per_namespace,
            ),
            ("max_leases_per_namespace", l.max_leases_per_namespace),
            (
                "max_tombstones_per_namespace",
                l.max_tombstones_per_namespace,
            ),
        ];
        if let Some((name, _)) = per_namespace.iter().find(|(_, v)| *v == 0) {
            bail!("limits: {name} must be at least 1");
        }
        if !(l.max_held_share > 0.0 && l.max_held_share <= 1.0) {
            bail!("limits: max_held_share must be more than 0 and at most 1");
        }
        let mut b = crate::ledger::Bounds {
            per_connection: [0; crate::ledger::RESOURCES.len()],
            per_namespace: [0; crate::ledger::RESOURCES.len()],
            held_share: l.max_held_share,
            staging_per_token: l.max_staging_per_token,
        };
        let mut set = |r: Resource, conn: u32, ns: u32| {
            b.per_connection[r as usize] = conn as u64;
            b.per_namespace[r as usize] = ns as u64;
        };
        set(
            Resource::Pending,
            l.max_pending_per_connection,
            l.max_pending_per_namespace,
        );
        set(
            Resource::Holds,
            l.max_holds_per_connection,
            l.max_holds_per_namespace,
        );
        set(
            Resource::Watches,
            l.max_watches_per_connection,
            l.max_watches_per_namespace,
        );
        set(
            Resource::Subscriptions,
            l.max_subscriptions_per_connection,
            l.max_subscriptions_per_namespace,
        );
        set(
            Resource::KvEvents,
            l.max_event_subscriptions_per_connection,
            l.max_event_subscriptions_per_namespace,
        );
        set(Resource::Leases, 0, l.max_leases_per_namespace);
        set(Resource::Tombstones, 0, l.max_tombstones_per_namespace);
        Ok(b)
    }

    /// The wire limits before the handshake: a small header and no payload (a `Hello` has
    /// none).
    pub fn hello_limits(&self) -> anyhow::Result<Limits> {
        let l = self.wire_limits()?;
        let max = self.limits.max_header_unauthenticated;
        if max == 0 || max > l.max_header as u64 {
            bail!("limits: max_header_unauthenticated must be 1..=max_header");
        }
        Ok(Limits {
            max_header: max as u32,
            max_payload: 0,
            ..l
        })
    }

    /// The pool's configuration.
    pub fn pool_config(&self) -> anyhow::Result<kvpool::PoolConfig> {
        use kvpool::segment::{Backing, HugePages};
        let m = &self.memory;
        let backing = match m.backing.as_str() {
            "shm" | "file" => Backing::File(self.data_dir()),
            "anonymous" => Backing::Anonymous,
            other => bail!("memory.backing must be \"shm\" or \"anonymous\", not {other:?}"),
        };
        let huge_pages = match m.huge_pages.as_str() {
            "auto" => HugePages::Auto,
            "off" => HugePages::Off,
            other => bail!("memory.huge_pages must be \"auto\" or \"off\", not {other:?}"),
        };
        let mut namespaces: Vec<NamespaceConfig> = self
            .namespaces
            .iter()
            .map(|n| {
                Ok(NamespaceConfig {
                    name: n.name.clone(),
                    quota_bytes: n.quota,
                    eviction: n
                        .eviction
                        .parse()
                        .map_err(|e: String| anyhow::anyhow!("namespace {:?}: {e}", n.name))?,
                    own_segment: n.own_segment.unwrap_or(
                        n.quota.is_some() && !(n.tokens.is_empty() && n.read_tokens.is_empty()),
                    ),
                })
            })
            .collect::<anyhow::Result<_>>()?;
        if !namespaces
            .iter()
            .any(|n| n.name == kvpool::pool::DEFAULT_NAMESPACE)
        {
            namespaces.insert(
                0,
                NamespaceConfig::unlimited(kvpool::pool::DEFAULT_NAMESPACE),
            );
        }
        // Model weights (docs/WEIGHTS.md) have a namespace of their own on every node, so
        // `kvpool weights put` works on a default daemon; configure it to give it a quota.
        if !namespaces
            .iter()
            .any(|n| n.name == kvpool::weights::DEFAULT_NAMESPACE)
        {
            namespaces.push(NamespaceConfig::unlimited(
                kvpool::weights::DEFAULT_NAMESPACE,
            ));
        }
        Ok(kvpool::PoolConfig {
            node: kvpool::NodeId(self.node_id),
            segment_size: m.size,
            segments: m.segments,
            backing,
            huge_pages,
            prefault: m.prefault,
            alloc: kvpool::alloc::AllocConfig {
                page_size: m.page_size,
                ..Default::default()
            },
            shards: m.shards,
            pending_timeout_ms: m.pending_timeout_ms,
            max_lease_ms: m.max_lease_ms,
            max_key_len: self.limits.max_key_len as usize,
            namespaces,
        })
    }
}

impl Config {
    /// The disk tier's settings (`[disk]`), checked; None when the tier is off (no `path`).
    pub fn disk_tier(&self) -> anyhow::Result<Option<DiskSettings>> {
        let d = &self.disk;
        let Some(path) = &d.path else {
            if d.capacity.is_some() {
                bail!(
                    "disk.capacity is set but disk.path is not: set both to turn the disk tier on"
                );
            }
            return Ok(None);
        };
        if path.as_os_str().is_empty() {
            bail!("disk.path must not be empty (leave it unset to keep the disk tier off)");
        }
        let Some(capacity) = d.capacity else {
            bail!(
                "disk.path is set but disk.capacity is not: say how many bytes the tier may take \
                 (\"64GiB\")"
            );
        };
        if d.region_size == 0 || d.region_size % kvpool::disk::ALIGN != 0 {
            bail!(
                "disk.region_size must be a positive multiple of 4 KiB, not {}",
                d.region_size
            );
        }
        if capacity / d.region_size < 2 {
            bail!(
                "disk.capacity ({capacity} bytes) must hold at least two regions of \
                 disk.region_size ({} bytes): one written, one to drop when full",
                d.region_size
            );
        }
        if d.queue == 0 {
            bail!(
                "disk.queue must be at least 1 byte (it bounds the objects waiting for the disk)"
            );
        }
        Ok(Some(DiskSettings {
            store: kvpool::disk::DiskConfig::new(path.clone(), capacity).region_size(d.region_size),
            queue: d.queue,
            admit: d.admit,
            io: d.io,
        }))
    }
}

/// What the disk tier is given: where its store lives and how demotion to it is bounded.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DiskSettings {
    /// The store: directory, capacity, region size.
    pub store: kvpool::disk::DiskConfig,
    /// Most bytes of evicted objects waiting to be written.
    pub queue: u64,
    /// Which evicted objects are written.
    pub admit: DiskAdmit,
    /// How the files are read and written.
    pub io: kvpool::disk::IoEngine,
}

/// How a node learns the cluster.
#[derive(Clone, Debug)]
pub(crate) enum MembershipConfig {
    /// Heartbeats to these peers (and every node they tell of).
    Static {
        /// TCP addresses of other nodes.
        peers: Vec<String>,
    },
    /// Registration in etcd, and the view derived from it.
    Etcd(EtcdConfig),
}

/// Where etcd is and where in it this cluster lives.
#[derive(Clone, Debug)]
pub(crate) struct EtcdConfig {
    /// Client URLs of the etcd members; tried in turn.
    pub(crate) endpoints: Vec<Url>,
    /// Prefix of every key of this cluster.
    pub(crate) prefix: String,
    /// etcd's own authentication (`etcd_user`, `etcd_password_file`); None: etcd has it off.
    pub(crate) auth: Option<EtcdAuth>,
    /// TLS for `https://` endpoints (`etcd_ca_file`, and the client certificate if any).
    pub(crate) tls: Option<Arc<rustls::ClientConfig>>,
}

/// A user of etcd's own authentication: the node trades the password for a token
/// (`/v3/auth/authenticate`) and sends the token with every request.
#[derive(Clone)]
pub(crate) struct EtcdAuth {
    pub(crate) user: String,
    pub(crate) password: String,
}

impl std::fmt::Debug for EtcdAuth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdAuth")
            .field("user", &self.user)
            .finish_non_exhaustive()
    }
}
