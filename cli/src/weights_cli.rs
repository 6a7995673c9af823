//! `kvpool weights`: publish, load, list, remove and inspect model weights (docs/WEIGHTS.md).

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::Context;
use clap::Subcommand;
use kvpool_client::blocking::Client;
use kvpool_client::weights::{PublishOptions, Sources, Weights};

/// `kvpool weights ...`.
#[derive(clap::Args, Debug)]
pub(crate) struct WeightsArgs {
    /// Namespace the weights live in.
    #[arg(long, default_value = kvpool::weights::DEFAULT_NAMESPACE)]
    weights_namespace: String,
    #[command(subcommand)]
    cmd: WeightsCmd,
}

#[derive(Subcommand, Debug)]
enum WeightsCmd {
    /// Publish a model: safetensors files (or a sharded checkpoint's *.index.json), tensor by
    /// tensor, as pinned chunks; other files (config.json, tokenizer) are stored whole.
    Put {
        /// Model name.
        name: String,
        /// Files of the model.
        #[arg(required = true)]
        files: Vec<PathBuf>,
        /// Copies of every chunk; the weights namespace must be configured to keep that many
        /// (`pinned_replicas`) [default: what it keeps].
        #[arg(long)]
        replicas: Option<u32>,
        /// Largest chunk a tensor is cut into, e.g. 16MiB.
        #[arg(long, default_value = "16MiB")]
        chunk_size: String,
    },
    /// Write a model's files into a directory, byte for byte as published.
    Get {
        /// Model name.
        name: String,
        /// Directory to write into.
        #[arg(long)]
        out: PathBuf,
        /// Directory with the original files: chunks missing from the pool are read from
        /// there (and put back).
        #[arg(long)]
        from: Option<PathBuf>,
    },
    /// List the published models.
    Ls,
    /// Remove a model.
    Rm {
        /// Model name.
        name: String,
    },
    /// A model's size, copies and where its chunks are.
    Stats {
        /// Model name.
        name: String,
        /// As JSON.
        #[arg(long)]
        json: bool,
    },
}

/// Runs a `kvpool weights` command.
pub(crate) fn run(client: &Client, args: &WeightsArgs) -> anyhow::Result<i32> {
    let (ns, cmd) = (&args.weights_namespace, &args.cmd);
    let w = Weights::new(client.async_client(), ns).with_context(|| format!("namespace {ns:?}"))?;
    match cmd {
        WeightsCmd::Put {
            name,
            files,
            replicas,
            chunk_size,
        } => publish(client, &w, name, files, *replicas, chunk_size),
        WeightsCmd::Get { name, out, from } => get(client, &w, name, out, from.as_deref()),
        WeightsCmd::Ls => {
            for name in client.block_on(w.list())? {
                println!("{name}");
            }
            Ok(0)
        }
        WeightsCmd::Rm { name } => {
            if client.block_on(w.remove(name))? {
                println!("removed {name}");
                Ok(0)
            } else {
                eprintln!("no model {name:?}");
                Ok(1)
            }
        }
        WeightsCmd::Stats { name, json } => stats(client, &w, name, *json),
    }
}

/// `kvpool weights put`.
fn publish(
    client: &Client,
    w: &Weights,
    name: &str,
    files: &[PathBuf],
    replicas: Option<u32>,
    chunk_size: &str,
) -> anyhow::Result<i32> {
    let opts = PublishOptions {
        chunk_size: kvpool::units::parse_size(chunk_size)
            .map_err(|e| anyhow::anyhow!("--chunk-size: {e}"))?,
        replicas,
    };
    let t = Instant::now();
    let m = client.block_on(w.publish(name, files, &opts))?;
    println!(
        "published {name}: {} tensors, {} bytes in {} files (+{} other), {} copies, {:.2} s",
        m.tensor_count(),
        m.tensor_bytes(),
        m.files.len(),
        m.extra.len(),
        m.replicas,
        t.elapsed().as_secs_f64()
    );
    Ok(0)
}

/// `kvpool weights get`.
fn get(
    client: &Client,
    w: &Weights,
    name: &str,
    out: &Path,
    from: Option<&Path>,
) -> anyhow::Result<i32> {
    let m = client.block_on(w.require(name))?;
    let sources = from.map(|d| Sources::dir(d, &m));
    let t = Instant::now();
    let r = client.block_on(w.write_files(&m, out, sources.as_ref()))?;
    println!(
        "wrote {name} into {}: {} bytes from the pool ({} chunks from another copy), {} from files, {:.2} s",
        out.display(),
        r.bytes_from_pool,
        r.chunks_from_replicas,
        r.bytes_from_files,
        t.elapsed().as_secs_f64()
    );
    Ok(0)
}

/// `kvpool weights stats`: as JSON with `json`.
fn stats(client: &Client, w: &Weights, name: &str, json: bool) -> anyhow::Result<i32> {
    let m = client.block_on(w.require(name))?;
    let s = client.block_on(w.stats(&m))?;
    if json {
        let nodes: Vec<_> = s
            .nodes
            .iter()
            .map(|(n, c, b)| serde_json::json!({"node": n, "chunks": c, "bytes": b}))
            .collect();
        println!(
            "{}",
            serde_json::json!({
                "name": name, "tensors": s.tensors, "tensor_bytes": s.tensor_bytes,
                "files": m.files.len(), "extra_files": m.extra.len(),
                "chunks": s.chunks, "chunk_size": m.chunk_size, "replicas": s.replicas,
                "under_replicated": s.under_replicated, "missing": s.missing,
                "nodes": nodes, "namespace_hits": s.namespace_hits,
            })
        );
    } else {
        println!(
            "{name}: {} tensors, {} bytes, {} chunks of up to {} bytes, {} copies each",
            s.tensors, s.tensor_bytes, s.chunks, m.chunk_size, s.replicas
        );
        for (n, c, b) in &s.nodes {
            println!("  node {n}: {c} chunk copies, {b} bytes");
        }
        println!(
            "  under-replicated: {}, missing: {}, weights-namespace hits: {}",
            s.under_replicated, s.missing, s.namespace_hits
        );
    }
    Ok(0)
}
