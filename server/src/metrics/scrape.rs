//! One scrape of the page: the daemon's series and a snapshot of the pool's, encoded in the
//! OpenMetrics text format.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use kvpool::pool::PoolStats;
use kvpool::protocol::DiskTierStats;
use kvpool::Pool;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::text;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric, NoLabelSet};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::{Registry, Unit};

use super::series::{
    Daemon, Metrics, BUCKETS, HANDOFF_FAILURES, NODE_STATES, OPS, REAP_CAUSES, RESP_COMMANDS,
    TRANSPORTS,
};
use crate::disk_tier::DiskTier;
use crate::ledger::{Ledger, Limit, RESOURCES};

impl Metrics {
    /// The page in the OpenMetrics text format, ending in `# EOF`; the per-namespace series
    /// only with `namespaces`.
    pub(crate) fn render(
        &self,
        pool: &Pool,
        ledger: &Ledger,
        disk: Option<&DiskTier>,
        namespaces: bool,
    ) -> Result<String, std::fmt::Error> {
        let mut registry = Registry::default();
        registry.register_collector(Box::new(Scrape {
            daemon: self.daemon.clone(),
            resources: RESOURCES.map(|r| (r.name(), ledger.total(r))),
            pool: pool.stats(),
            long_keys: pool.long_keys_refused(),
            huge_regions: pool.segments().map(|s| s.huge_regions()).collect(),
            prefaulted: pool.prefaulted_bytes().collect(),
            journal: pool.journal_stats(),
            disk: disk.map_or_else(Default::default, DiskTier::stats),
            namespaces,
        }));
        let mut out = String::with_capacity(16 << 10);
        text::encode(&mut out, &registry)?;
        Ok(out)
    }
}

/// One scrape: the daemon's counters and a snapshot of the pool's.
#[derive(Debug)]
struct Scrape {
    daemon: Arc<Daemon>,
    pool: PoolStats,
    /// Keys the pool refused for their length (every door checks keys with the pool's check,
    /// which counts them): the `key_length` series.
    long_keys: u64,
    /// Per segment: its data area's 2 MiB regions collapsed into huge pages, and those the
    /// kernel refused (`Segment::huge_regions`).
    huge_regions: Vec<(u64, u64)>,
    /// Per segment: bytes faulted in ahead of the allocations (`Segment::prefaulted_bytes`).
    prefaulted: Vec<u64>,
    /// The index journal's, when the segments are files (`Pool::journal_stats`).
    journal: Option<kvpool::journal::JournalStats>,
    /// What peers make the node hold, by resource (the ledger's totals).
    resources: [(&'static str, u64); RESOURCES.len()],
    /// The disk tier's (all zero when the tier is off).
    disk: DiskTierStats,
    namespaces: bool,
}

/// Writes one metric family: its descriptor, then each series with its labels.
fn family<S: EncodeLabelSet, M: EncodeMetric>(
    enc: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    unit: Option<&Unit>,
    kind: MetricType,
    series: impl IntoIterator<Item = (S, M)>,
) -> std::fmt::Result {
    let mut family = enc.encode_descriptor(name, help, unit, kind)?;
    for (labels, metric) in series {
        metric.encode(family.encode_family(&labels)?)?;
    }
    Ok(())
}

/// Writes a metric family of one series without labels.
fn single(
    enc: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    unit: Option<&Unit>,
    kind: MetricType,
    metric: &impl EncodeMetric,
) -> std::fmt::Result {
    metric.encode(enc.encode_descriptor(name, help, unit, kind)?)
}

fn gauge(v: u64) -> ConstGauge<u64> {
    ConstGauge::new(v)
}

fn counter(v: u64) -> ConstCounter<u64> {
    ConstCounter::new(v)
}

impl Collector for Scrape {
    fn encode(&self, mut enc: DescriptorEncoder) -> std::fmt::Result {
        let node = self.pool.node.to_string();
        self.encode_pool(&mut enc, &node)?;
        self.encode_journal(&mut enc, &node)?;
        self.encode_disk(&mut enc, &node)?;
        if self.namespaces {
            self.encode_namespaces(&mut enc, &node)?;
        }
        self.encode_daemon(&mut enc)?;
        self.encode_latency(&mut enc)
    }
}

impl Scrape {
    /// The pool's objects, counters and segments.
    fn encode_pool(&self, e: &mut DescriptorEncoder, node: &str) -> std::fmt::Result {
        let st = &self.pool;
        let (gauge_t, counter_t) = (MetricType::Gauge, MetricType::Counter);
        family(
            e,
            "kvpool_objects",
            "Committed objects.",
            None,
            gauge_t,
            [([("node", node)], gauge(st.objects))],
        )?;
        family(
            e,
            "kvpool_pending_allocations",
            "Allocations not yet committed.",
            None,
            gauge_t,
            [([("node", node)], gauge(st.pending))],
        )?;
        for (name, help, v) in [
            ("kvpool_hits", "Lookups that found their object.", st.hits),
            ("kvpool_misses", "Lookups that did not.", st.misses),
            (
                "kvpool_evictions",
                "Objects evicted for space.",
                st.evictions,
            ),
            ("kvpool_commits", "Objects committed.", st.commits),
            (
                "kvpool_reaped",
                "Abandoned allocations reclaimed.",
                st.reaped,
            ),
        ] {
            family(
                e,
                name,
                help,
                None,
                counter_t,
                [([("node", node)], counter(v))],
            )?;
        }
        self.encode_segments(e, node)
    }

    /// Each segment's bytes by state, huge-page regions and fragmentation.
    fn encode_segments(&self, e: &mut DescriptorEncoder, node: &str) -> std::fmt::Result {
        let (st, bytes, gauge_t) = (&self.pool, Some(&Unit::Bytes), MetricType::Gauge);
        let ids: Vec<String> = st.segments.iter().map(|s| s.id.to_string()).collect();
        family(
            e,
            "kvpool_segment",
            "Segment bytes by state (used, free, capacity).",
            bytes,
            gauge_t,
            st.segments.iter().zip(&ids).flat_map(|(s, id)| {
                [
                    ("capacity", s.capacity),
                    ("used", s.used_bytes),
                    ("free", s.free_bytes),
                ]
                .map(|(state, v)| {
                    (
                        [("node", node), ("segment", id), ("state", state)],
                        gauge(v),
                    )
                })
            }),
        )?;
        family(
            e,
            "kvpool_segment_prefaulted_bytes",
            "Bytes of the data area faulted in ahead of the allocations by the prefaulting \
             thread ([memory] prefault_ahead): docs/OPERATIONS.md.",
            None,
            MetricType::Counter,
            self.prefaulted
                .iter()
                .zip(&ids)
                .map(|(&v, id)| ([("node", node), ("segment", id)], counter(v))),
        )?;
        family(
            e,
            "kvpool_segment_huge_regions",
            "The data area's 2 MiB regions collapsed into huge pages as they were first used \
             (collapsed), and those the kernel did not collapse (refused): docs/ARCHITECTURE.md.",
            None,
            gauge_t,
            self.huge_regions
                .iter()
                .zip(&ids)
                .flat_map(|(&(done, refused), id)| {
                    [("collapsed", done), ("refused", refused)].map(|(state, v)| {
                        (
                            [("node", node), ("segment", id), ("state", state)],
                            gauge(v),
                        )
                    })
                }),
        )?;
        family(
            e,
            "kvpool_segment_fragmentation",
            "1 - largest free run / free bytes.",
            None,
            gauge_t,
            st.segments.iter().zip(&ids).map(|(s, id)| {
                (
                    [("node", node), ("segment", id)],
                    ConstGauge::new(s.external_fragmentation),
                )
            }),
        )
    }

    /// The index journal's state, when there is one (docs/RELIABILITY.md).
    fn encode_journal(&self, e: &mut DescriptorEncoder, node: &str) -> std::fmt::Result {
        let Some(j) = self.journal else {
            return Ok(());
        };
        let labels = [("node", node)];
        for (name, help, unit, v) in [
            (
                "kvpool_journal_healthy",
                "1 while the index journal is written; 0 once a write failed and it was \
                 deleted (the next start will be empty).",
                None,
                u64::from(j.healthy),
            ),
            (
                "kvpool_journal",
                "The index journal's header and records.",
                Some(&Unit::Bytes),
                j.bytes,
            ),
            (
                "kvpool_journal_records",
                "Records in the index journal since it was last written whole.",
                None,
                j.records,
            ),
        ] {
            family(e, name, help, unit, MetricType::Gauge, [(labels, gauge(v))])?;
        }
        for (name, help, v) in [
            (
                "kvpool_journal_compactions",
                "Index journal compactions finished.",
                j.compactions,
            ),
            (
                "kvpool_journal_compaction_failures",
                "Index journal compactions that could not be written (the journal was kept; \
                 they are tried again).",
                j.compaction_failures,
            ),
        ] {
            family(
                e,
                name,
                help,
                None,
                MetricType::Counter,
                [(labels, counter(v))],
            )?;
        }
        Ok(())
    }

    /// The disk tier: its occupancy, then its counters.
    fn encode_disk(&self, e: &mut DescriptorEncoder, node: &str) -> std::fmt::Result {
        let (s, d) = (&self.disk, &self.disk);
        let labels = [("node", node)];
        let bytes = Some(&Unit::Bytes);
        for (name, help, unit, v) in [
            (
                "kvpool_disk_capacity",
                "The most bytes the disk tier's files may hold (0: the tier is off).",
                bytes,
                s.capacity,
            ),
            ("kvpool_disk_objects", "Objects on disk.", None, s.objects),
            (
                "kvpool_disk",
                "Bytes on disk of the objects there (whole records).",
                bytes,
                s.bytes,
            ),
            (
                "kvpool_disk_queued",
                "Bytes of evicted objects waiting for their disk write.",
                bytes,
                d.queued_bytes,
            ),
        ] {
            family(e, name, help, unit, MetricType::Gauge, [(labels, gauge(v))])?;
        }
        self.encode_disk_counters(e, node)
    }

    /// The disk tier's counters: demotion's, then the store's.
    fn encode_disk_counters(&self, e: &mut DescriptorEncoder, node: &str) -> std::fmt::Result {
        let d = &self.disk;
        let labels = [("node", node)];
        let bytes = Some(&Unit::Bytes);
        for (name, help, unit, v) in [
            (
                "kvpool_disk_demotions",
                "Evicted objects written to disk.",
                None,
                d.demoted,
            ),
            (
                "kvpool_disk_demoted",
                "Value bytes of the evicted objects written to disk.",
                bytes,
                d.demoted_bytes,
            ),
            (
                "kvpool_disk_not_admitted",
                "Evicted objects the admission filter kept off the disk.",
                None,
                d.not_admitted,
            ),
            (
                "kvpool_disk_queue_drops",
                "Evicted objects not written because the demotion queue was full.",
                None,
                d.queue_drops,
            ),
            (
                "kvpool_disk_write_failures",
                "Evicted objects the store refused (too large, or the write failed).",
                None,
                d.write_failures,
            ),
            (
                "kvpool_disk_already_on_disk",
                "Evicted objects whose value was already on disk (not written again).",
                None,
                d.already_on_disk,
            ),
            (
                "kvpool_disk_share_refused",
                "Evicted objects refused because their namespace had its share of the disk.",
                None,
                d.share_refused,
            ),
            (
                "kvpool_disk_withdrawn",
                "Demotions not kept because their key was written or removed meanwhile.",
                None,
                d.withdrawn,
            ),
            (
                "kvpool_disk_promotions",
                "Objects read up from disk into DRAM.",
                None,
                d.promoted,
            ),
            (
                "kvpool_disk_promoted",
                "Value bytes read up from disk into DRAM.",
                bytes,
                d.promoted_bytes,
            ),
            (
                "kvpool_disk_promotion_failures",
                "Disk hits DRAM could not take (quota or memory refused).",
                None,
                d.promotion_failures,
            ),
        ] {
            family(
                e,
                name,
                help,
                unit,
                MetricType::Counter,
                [(labels, counter(v))],
            )?;
        }
        self.encode_disk_store(e, node)
    }

    /// The disk store's counters: bytes written, reads, failures and regions dropped.
    fn encode_disk_store(&self, e: &mut DescriptorEncoder, node: &str) -> std::fmt::Result {
        let s = &self.disk;
        let labels = [("node", node)];
        for (name, help, unit, v) in [
            (
                "kvpool_disk_read",
                "Value bytes read from the disk tier's files.",
                Some(&Unit::Bytes),
                s.bytes_read,
            ),
            (
                "kvpool_disk_written",
                "Bytes written to the disk tier's files (records, tombstones included).",
                Some(&Unit::Bytes),
                s.bytes_written,
            ),
            (
                "kvpool_disk_hits",
                "Disk reads that returned a value.",
                None,
                s.hits,
            ),
            (
                "kvpool_disk_misses",
                "Disk reads that did not.",
                None,
                s.misses,
            ),
            (
                "kvpool_disk_checksum_failures",
                "Disk copies dropped because what was read did not check out.",
                None,
                s.checksum_failures,
            ),
            (
                "kvpool_disk_io_errors",
                "Disk reads, writes, syncs and truncations that failed.",
                None,
                s.io_errors,
            ),
            (
                "kvpool_disk_regions_dropped",
                "Disk regions dropped, oldest first, to make room.",
                None,
                s.regions_dropped,
            ),
            (
                "kvpool_disk_evictions",
                "Objects that left the disk with a dropped region.",
                None,
                s.evicted,
            ),
        ] {
            family(
                e,
                name,
                help,
                unit,
                MetricType::Counter,
                [(labels, counter(v))],
            )?;
        }
        Ok(())
    }

    /// Per namespace: bytes by kind and objects.
    fn encode_namespaces(&self, e: &mut DescriptorEncoder, node: &str) -> std::fmt::Result {
        let (st, bytes, gauge_t) = (&self.pool, Some(&Unit::Bytes), MetricType::Gauge);
        family(
            e,
            "kvpool_namespace",
            "Namespace bytes by kind (used, pinned, quota).",
            bytes,
            gauge_t,
            st.namespaces.iter().flat_map(|n| {
                [
                    ("used", n.used_bytes),
                    ("pinned", n.pinned_bytes),
                    ("quota", n.quota_bytes),
                ]
                .into_iter()
                .filter(|&(kind, v)| !(kind == "quota" && v == u64::MAX))
                .map(|(kind, v)| {
                    (
                        [
                            ("node", node),
                            ("namespace", n.name.as_str()),
                            ("kind", kind),
                        ],
                        gauge(v),
                    )
                })
            }),
        )?;
        family(
            e,
            "kvpool_namespace_objects",
            "Committed objects per namespace.",
            None,
            gauge_t,
            st.namespaces.iter().map(|n| {
                (
                    [("node", node), ("namespace", n.name.as_str())],
                    gauge(n.objects),
                )
            }),
        )
    }

    /// The daemon's connections, protocol errors, payload bytes and operations.
    fn encode_daemon(&self, e: &mut DescriptorEncoder) -> std::fmt::Result {
        let (d, bytes) = (&*self.daemon, Some(&Unit::Bytes));
        let (gauge_t, counter_t) = (MetricType::Gauge, MetricType::Counter);
        family(
            e,
            "kvpool_connections",
            "Open connections by transport.",
            None,
            gauge_t,
            TRANSPORTS.map(|t| ([("transport", t.name())], d.connections[t.index()].clone())),
        )?;
        family(
            e,
            "kvpool_connections_accepted",
            "Connections accepted by transport.",
            None,
            counter_t,
            TRANSPORTS.map(|t| {
                (
                    [("transport", t.name())],
                    d.connections_accepted[t.index()].clone(),
                )
            }),
        )?;
        single(
            e,
            "kvpool_protocol_errors",
            "Frames that broke the protocol.",
            None,
            counter_t,
            &d.protocol_errors,
        )?;
        self.encode_resp(e)?;
        family(
            e,
            "kvpool_payload",
            "Payload bytes by direction.",
            bytes,
            counter_t,
            [
                ([("direction", "in")], d.bytes_in.clone()),
                ([("direction", "out")], d.bytes_out.clone()),
            ],
        )?;
        self.encode_transfers(e)
    }

    /// Bulk transfers by priority, the handover's objects, and operations by outcome.
    fn encode_transfers(&self, e: &mut DescriptorEncoder) -> std::fmt::Result {
        let (d, bytes) = (&*self.daemon, Some(&Unit::Bytes));
        let (gauge_t, counter_t) = (MetricType::Gauge, MetricType::Counter);
        let prios = [
            kvpool::protocol::Priority::Background,
            kvpool::protocol::Priority::Low,
            kvpool::protocol::Priority::Normal,
            kvpool::protocol::Priority::High,
        ];
        family(
            e,
            "kvpool_bulk_chunks",
            "Bulk chunks moved in their turn, by priority.",
            None,
            counter_t,
            prios.map(|p| ([("priority", p.name())], d.bulk_chunks[p as usize].clone())),
        )?;
        family(
            e,
            "kvpool_bulk",
            "Bulk bytes moved in their turn, by priority.",
            bytes,
            counter_t,
            prios.map(|p| ([("priority", p.name())], d.bulk_bytes[p as usize].clone())),
        )?;
        single(
            e,
            "kvpool_bulk_deadline_refusals",
            "Bulk requests refused up front because their deadline could not be met.",
            None,
            counter_t,
            &d.bulk_refused,
        )?;
        single(
            e,
            "kvpool_handover_objects",
            "Unpinned objects handed to their new owner after a view change (drain or join).",
            None,
            counter_t,
            &d.handover_objects,
        )?;
        single(
            e,
            "kvpool_handover",
            "Bytes of the unpinned objects handed to their new owner.",
            bytes,
            counter_t,
            &d.handover_bytes,
        )?;
        single(
            e,
            "kvpool_handover_dropped",
            "Copies dropped without sending: the new owner held the key or a newer value or remove.",
            None,
            counter_t,
            &d.handover_dropped,
        )?;
        single(
            e,
            "kvpool_handover_pending",
            "Objects another node now owns that the last handover pass left here for a later one.",
            None,
            gauge_t,
            &d.handover_pending,
        )?;
        let t = &d.peer_traffic;
        family(
            e,
            "kvpool_peer_bytes",
            "Bytes of this node's calls to its peers (whole frames), by kind: membership \
             (heartbeats, gossip) or data (moves, handover copies, lookups), and direction: \
             sent (requests) or received (replies).",
            None,
            counter_t,
            (0..2).flat_map(|k| {
                let kind = super::series::PEER_KINDS[k];
                [
                    ([("kind", kind), ("direction", "sent")], t.sent[k].clone()),
                    (
                        [("kind", kind), ("direction", "received")],
                        t.received[k].clone(),
                    ),
                ]
            }),
        )?;
        family(
            e,
            "kvpool_handoff_failures",
            "Handoff keys given up, by how: their producer failed them (Fail), the request was \
             cancelled (Cancel), or their handoff lease lapsed unrenewed (Expire).",
            None,
            counter_t,
            HANDOFF_FAILURES.map(|(h, n)| ([("cause", n)], d.handoff_failures[h as usize].clone())),
        )?;
        family(
            e,
            "kvpool_cluster_nodes",
            "Nodes in this node's cluster view, by state.",
            None,
            gauge_t,
            NODE_STATES.map(|s| ([("state", s.name())], d.cluster_nodes[s as usize].clone())),
        )?;
        family(
            e,
            "kvpool_operations",
            "Operations by type and outcome.",
            None,
            counter_t,
            OPS.iter().zip(&d.ops).flat_map(|((_, op), s)| {
                [
                    ([("op", *op), ("outcome", "ok")], s.ok.clone()),
                    ([("op", *op), ("outcome", "error")], s.err.clone()),
                ]
            }),
        )
    }

    /// The RESP front door's commands, error replies and protocol errors.
    fn encode_resp(&self, e: &mut DescriptorEncoder) -> std::fmt::Result {
        let d = &*self.daemon;
        let counter_t = MetricType::Counter;
        family(
            e,
            "kvpool_resp_commands",
            "Commands served by the RESP front door, by command.",
            None,
            counter_t,
            RESP_COMMANDS
                .iter()
                .map(|(c, n)| ([("command", *n)], d.resp_commands[c.index()].clone())),
        )?;
        family(
            e,
            "kvpool_resp_command_errors",
            "RESP commands answered with an error reply, by command.",
            None,
            counter_t,
            RESP_COMMANDS
                .iter()
                .map(|(c, n)| ([("command", *n)], d.resp_errors[c.index()].clone())),
        )?;
        single(
            e,
            "kvpool_resp_protocol_errors",
            "RESP connections closed for bytes that were not RESP.",
            None,
            counter_t,
            &d.resp_protocol_errors,
        )?;
        single(
            e,
            "kvpool_resp_input_refusals",
            "RESP connections closed because the door's input buffers were full ([resp] input_memory).",
            None,
            counter_t,
            &d.resp_input_refusals,
        )?;
        single(
            e,
            "kvpool_auth_failures",
            "Wrong tokens presented (Hello, RESP AUTH).",
            None,
            counter_t,
            &d.auth_failures,
        )?;
        single(
            e,
            "kvpool_auth_throttled",
            "Authentications refused unchecked: the peer address failed too often ([limits] auth_failures), or failed recently while the node's budget was spent (auth_failures_per_second).",
            None,
            counter_t,
            &d.auth_throttled,
        )?;
        single(
            e,
            "kvpool_cluster_auth_failures",
            "Wrong proofs of the cluster secret presented (ClusterAuth).",
            None,
            counter_t,
            &d.cluster_auth_failures,
        )?;
        single(
            e,
            "kvpool_cluster_auth_throttled",
            "Proofs of the cluster secret refused unchecked: the peer address failed recently while the node's budget was spent ([limits] cluster_auth_failures_per_second).",
            None,
            counter_t,
            &d.cluster_auth_throttled,
        )?;
        self.encode_limits(e)
    }

    /// Connections reaped, staging areas, refusals by limit, and the resource ledger's totals.
    fn encode_limits(&self, e: &mut DescriptorEncoder) -> std::fmt::Result {
        let d = &*self.daemon;
        let counter_t = MetricType::Counter;
        family(
            e,
            "kvpool_connections_reaped",
            "Unauthenticated connections closed to admit a new connection, by cause.",
            None,
            counter_t,
            REAP_CAUSES.map(|(c, n)| ([("cause", n)], d.reaped[c as usize].clone())),
        )?;
        single(
            e,
            "kvpool_staging",
            "Bytes of the staging areas handed to same-host writers of read-only segments (memory.same_host_writes).",
            Some(&Unit::Bytes),
            MetricType::Gauge,
            &d.staging_bytes,
        )?;
        single(
            e,
            "kvpool_fabric_registered",
            "Bytes of segments registered with the fabric for one-sided reads (listen.fabric).",
            Some(&Unit::Bytes),
            MetricType::Gauge,
            &d.fabric_registered,
        )?;
        family(
            e,
            "kvpool_fabric_offers",
            "FabricInfo requests: answered with the fabric's keys (served) or refused.",
            None,
            counter_t,
            [("served", 0), ("refused", 1)]
                .map(|(n, i)| ([("result", n)], d.fabric_offers[i].clone())),
        )?;
        self.encode_kv_events(e)?;
        family(
            e,
            "kvpool_limit_refusals",
            "Requests and connections refused by a limit on what a peer controls, by limit.",
            None,
            counter_t,
            Limit::ALL.map(|l| {
                let v = match l {
                    Limit::KeyLength => self.long_keys,
                    _ => d.limit_refusals[l as usize].get(),
                };
                ([("limit", l.names().0)], ConstCounter::new(v))
            }),
        )?;
        family(
            e,
            "kvpool_resources",
            "What peers make the node hold beyond their objects, by resource, over every \
             namespace (the resource ledger; bounds in [limits]).",
            None,
            MetricType::Gauge,
            self.resources
                .map(|(name, v)| ([("resource", name)], gauge(v))),
        )?;
        Ok(())
    }

    /// KV events for routers: queued, dropped for lag, subscribed connections.
    fn encode_kv_events(&self, e: &mut DescriptorEncoder) -> std::fmt::Result {
        let k = &self.daemon.kv_events;
        single(
            e,
            "kvpool_kv_events_published",
            "KV events queued for subscribers (one per subscriber that gets it).",
            None,
            MetricType::Counter,
            &k.published,
        )?;
        single(
            e,
            "kvpool_kv_events_dropped",
            "KV events a subscriber lost because its queue was full (it is sent a lag marker).",
            None,
            MetricType::Counter,
            &k.dropped,
        )?;
        single(
            e,
            "kvpool_kv_event_subscribers",
            "Connections subscribed to KV events (KvEvents).",
            None,
            MetricType::Gauge,
            &k.subscribers,
        )
    }

    /// Operation latency: one histogram per operation.
    fn encode_latency(&self, e: &mut DescriptorEncoder) -> std::fmt::Result {
        let d = &*self.daemon;
        let mut latency = e.encode_descriptor(
            "kvpool_operation",
            "Operation latency inside the daemon.",
            Some(&Unit::Seconds),
            MetricType::Histogram,
        )?;
        for ((_, op), s) in OPS.iter().zip(&d.ops) {
            let buckets: Vec<(f64, u64)> = s
                .buckets
                .iter()
                .enumerate()
                .map(|(b, n)| {
                    let le = if b + 1 < BUCKETS {
                        (1u64 << b) as f64 / 1e6
                    } else {
                        f64::INFINITY
                    };
                    (le, n.load(Ordering::Relaxed))
                })
                .collect();
            let count = buckets.iter().map(|(_, n)| n).sum();
            let sum = s.sum_us.load(Ordering::Relaxed) as f64 / 1e6;
            latency
                .encode_family(&[("op", *op)])?
                .encode_histogram::<NoLabelSet>(sum, count, &buckets, None)?;
        }
        Ok(())
    }
}
