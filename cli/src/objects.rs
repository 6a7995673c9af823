//! `kvpool put`, `get`, `exists`, `rm` and `keys`: objects by key.

use std::io::Write;

use anyhow::Context;
use kvpool_client::blocking::Client;

use crate::text::{printable, read_stdin};
use crate::Cli;

/// The value of `kvpool put`: FILE, or stdin when FILE is - or absent.
pub(crate) fn read_value(file: Option<&std::path::Path>) -> anyhow::Result<Vec<u8>> {
    match file {
        None => read_stdin(),
        Some(p) if p.as_os_str() == "-" => read_stdin(),
        Some(p) => std::fs::read(p).with_context(|| format!("reading {}", p.display())),
    }
}

/// `kvpool put`: `pin` keeps the object from eviction.
pub(crate) fn put(client: &Client, key: &[u8], value: &[u8], pin: bool) -> anyhow::Result<i32> {
    if pin {
        client.put_pinned(key, value)?
    } else {
        client.put(key, value)?
    }
    eprintln!("stored {} bytes", value.len());
    Ok(0)
}

/// `kvpool get`: exits 1 on a miss.
pub(crate) fn get(
    client: &Client,
    key: &[u8],
    output: Option<&std::path::Path>,
) -> anyhow::Result<i32> {
    let Some(v) = client.get(key)? else {
        eprintln!("miss");
        return Ok(1);
    };
    match output {
        Some(p) => std::fs::write(p, &v).with_context(|| format!("writing {}", p.display()))?,
        None => std::io::stdout().lock().write_all(&v)?,
    }
    Ok(0)
}

/// `kvpool exists`: exits 1 when the first key is missing.
pub(crate) fn exists(client: &Client, keys: &[Vec<u8>]) -> anyhow::Result<i32> {
    let refs: Vec<&[u8]> = keys.iter().map(|k| k.as_slice()).collect();
    let n = client.batch_exists(&refs)?;
    println!("{n}");
    Ok(if n == 0 { 1 } else { 0 })
}

/// `kvpool rm`: one key at a time, in order; prints how many objects were removed.
pub(crate) fn rm(cli: &Cli, client: &Client, keys: &[String], all: bool) -> anyhow::Result<i32> {
    if all {
        println!("{}", client.remove_all()?);
        return Ok(0);
    }
    let mut n = 0;
    for k in keys {
        n += client.remove(&cli.key(k)?)? as u64;
    }
    println!("{n}");
    Ok(0)
}

/// `kvpool keys`: one key per line, sorted.
pub(crate) fn keys(cli: &Cli, client: &Client, prefix: &[u8]) -> anyhow::Result<i32> {
    let mut out = std::io::stdout().lock();
    for k in client.keys_with_prefix(prefix)? {
        let line = if cli.hex {
            k.iter().map(|b| format!("{b:02x}")).collect()
        } else {
            printable(&k)
        };
        writeln!(out, "{line}")?;
    }
    Ok(0)
}
