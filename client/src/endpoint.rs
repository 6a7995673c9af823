//! Endpoints: `tcp://host:port`, `tls://host:port`, `quic://host:port`,
//! `fabric://host:port` and `unix:///path/to/kvpool.sock`.
//!
//! Uses `error` only.

use std::fmt;
use std::path::PathBuf;

use crate::error::ClientError;

/// Where a node listens.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Endpoint {
    /// Plain TCP (`host:port`).
    Tcp(String),
    /// QUIC over UDP with TLS 1.3 (`host:port`).
    Quic(String),
    /// TCP with TLS 1.3 (`host:port`: a node's `listen.tls`).
    Tls(String),
    /// A Unix domain socket on this host.
    Unix(PathBuf),
    /// TCP for requests (`host:port`, the node's TCP listener), and values read one-sidedly
    /// over the node's fabric (`[listen] fabric`: libfabric's tcp, shm, verbs or EFA).
    Fabric(String),
}

impl Endpoint {
    /// Parses `tcp://…`, `tls://…`, `quic://…`, `fabric://…`, `unix://…`; a bare `host:port`
    /// means TCP.
    pub fn parse(s: &str) -> Result<Endpoint, ClientError> {
        let bad = || {
            ClientError::Endpoint(format!(
                "{s:?}: expected tcp://host:port, tls://host:port, quic://host:port, \
                 fabric://host:port or unix:///path"
            ))
        };
        if let Some(rest) = s.strip_prefix("tcp://") {
            return host_port(rest).map(Endpoint::Tcp).ok_or_else(bad);
        }
        if let Some(rest) = s.strip_prefix("quic://") {
            return host_port(rest).map(Endpoint::Quic).ok_or_else(bad);
        }
        if let Some(rest) = s.strip_prefix("tls://") {
            return host_port(rest).map(Endpoint::Tls).ok_or_else(bad);
        }
        if let Some(rest) = s.strip_prefix("fabric://") {
            return host_port(rest).map(Endpoint::Fabric).ok_or_else(bad);
        }
        if let Some(rest) = s.strip_prefix("unix://") {
            return if rest.is_empty() {
                Err(bad())
            } else {
                Ok(Endpoint::Unix(PathBuf::from(rest)))
            };
        }
        if s.contains("://") {
            return Err(bad());
        }
        host_port(s).map(Endpoint::Tcp).ok_or_else(bad)
    }

    /// The host part, for TLS server names.
    pub(crate) fn host(&self) -> Option<&str> {
        match self {
            Endpoint::Tcp(hp) | Endpoint::Quic(hp) | Endpoint::Tls(hp) | Endpoint::Fabric(hp) => hp
                .rsplit_once(':')
                .map(|(h, _)| h.trim_start_matches('[').trim_end_matches(']')),
            Endpoint::Unix(_) => None,
        }
    }
}

impl fmt::Display for Endpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Endpoint::Tcp(a) => write!(f, "tcp://{a}"),
            Endpoint::Quic(a) => write!(f, "quic://{a}"),
            Endpoint::Tls(a) => write!(f, "tls://{a}"),
            Endpoint::Fabric(a) => write!(f, "fabric://{a}"),
            Endpoint::Unix(p) => write!(f, "unix://{}", p.display()),
        }
    }
}

fn host_port(s: &str) -> Option<String> {
    let (host, port) = s.rsplit_once(':')?;
    (!host.is_empty() && port.parse::<u16>().is_ok()).then(|| s.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_every_form() {
        assert_eq!(
            Endpoint::parse("tcp://127.0.0.1:7370").unwrap(),
            Endpoint::Tcp("127.0.0.1:7370".into())
        );
        assert_eq!(
            Endpoint::parse("localhost:7370").unwrap(),
            Endpoint::Tcp("localhost:7370".into())
        );
        assert_eq!(
            Endpoint::parse("quic://[::1]:7371").unwrap().host(),
            Some("::1")
        );
        assert_eq!(
            Endpoint::parse("tls://kv.example:7373").unwrap(),
            Endpoint::Tls("kv.example:7373".into())
        );
        assert_eq!(
            Endpoint::parse("tls://kv.example:7373")
                .unwrap()
                .to_string(),
            "tls://kv.example:7373"
        );
        assert_eq!(
            Endpoint::parse("fabric://10.0.0.7:7370").unwrap(),
            Endpoint::Fabric("10.0.0.7:7370".into())
        );
        assert_eq!(
            Endpoint::parse("fabric://10.0.0.7:7370")
                .unwrap()
                .to_string(),
            "fabric://10.0.0.7:7370"
        );
        assert_eq!(
            Endpoint::parse("unix:///tmp/k.sock").unwrap(),
            Endpoint::Unix("/tmp/k.sock".into())
        );
        for bad in [
            "tcp://nope",
            "http://x:1",
            "unix://",
            "tcp://:80",
            "tcp://h:99999",
            "tls://nope",
            "fabric://nope",
        ] {
            assert!(Endpoint::parse(bad).is_err(), "{bad}");
        }
    }
}
