//! Sizes, rates, permission modes and listen addresses, as the file and the flags write them.

use std::net::SocketAddr;

use anyhow::Context;
use serde::{Deserialize, Deserializer};

/// Parses `"1GiB"`, `"512 MiB"`, `"64k"`, `"1g"` or a plain number of bytes.
pub fn parse_size(s: &str) -> anyhow::Result<u64> {
    kvpool::units::parse_size(s).map_err(anyhow::Error::msg)
}

/// Parses a socket address, or none for an empty string.
pub fn parse_listen(s: &str) -> anyhow::Result<Option<SocketAddr>> {
    if s.is_empty() {
        return Ok(None);
    }
    Ok(Some(
        s.parse()
            .with_context(|| format!("bad listen address {s:?}"))?,
    ))
}

#[derive(Deserialize)]
#[serde(untagged)]
enum SizeRepr {
    Num(u64),
    Text(String),
}

pub(super) fn de_size<'de, D: Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
    match SizeRepr::deserialize(d)? {
        SizeRepr::Num(n) => Ok(n),
        SizeRepr::Text(s) => parse_size(&s).map_err(serde::de::Error::custom),
    }
}

/// Permission bits: an octal string (`"0660"`) or a TOML integer (`0o660`), at most `0o777`.
pub(super) fn de_mode<'de, D: Deserializer<'de>>(d: D) -> Result<u32, D::Error> {
    let n = match SizeRepr::deserialize(d)? {
        SizeRepr::Num(n) => n,
        SizeRepr::Text(s) => u64::from_str_radix(s.trim().trim_start_matches("0o"), 8)
            .map_err(|_| serde::de::Error::custom(format!("{s:?} is not an octal mode")))?,
    };
    u32::try_from(n)
        .ok()
        .filter(|&m| m <= 0o777)
        .ok_or_else(|| serde::de::Error::custom(format!("mode {n:o} is beyond 0777")))
}

pub(super) fn de_opt_size<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
    de_size(d).map(Some)
}

/// Parses a rate in bytes per second: a size (`"500MiB"`), optionally followed by `/s`.
pub fn parse_rate(s: &str) -> anyhow::Result<u64> {
    let t = s.trim();
    parse_size(t.strip_suffix("/s").unwrap_or(t).trim_end())
}

pub(super) fn de_rate<'de, D: Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
    match SizeRepr::deserialize(d)? {
        SizeRepr::Num(n) => Ok(n),
        SizeRepr::Text(s) => parse_rate(&s).map_err(serde::de::Error::custom),
    }
}

pub(super) fn de_opt_rate<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
    de_rate(d).map(Some)
}
