//! The cluster secret on disk. Cluster control (gossip, drain, the mover's copies) is only
//! accepted from connections that prove they hold it (see [`kvpool::protocol::auth`]), so it
//! must be the same on every node and never handed to clients.
//!
//! Where it comes from, in order:
//! 1. `cluster.secret_file` (`--cluster-secret-file`, `KVPOOL_CLUSTER_SECRET_FILE`): read;
//!    the file must exist.
//! 2. `<data_dir>/cluster.secret`, when it exists (written by an earlier start, or put there
//!    by the operator).
//! 3. A node that joins no one (no peers, no etcd) generates 32 random bytes into
//!    `<data_dir>/cluster.secret` (mode 0600) and logs where; other nodes are then started
//!    with that file. A node told to join others but given no secret refuses to start: a
//!    fresh random secret could only be refused by its peers, and there is no shared default.

use std::io::Write;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use kvpool::protocol::auth::ClusterSecret;

/// Name of the secret file in the data directory.
pub const SECRET_FILE_NAME: &str = "cluster.secret";

/// The secret a node runs with, and where it came from.
#[derive(Debug)]
pub struct Loaded {
    /// The secret.
    pub secret: ClusterSecret,
    /// The file it was read from or written to.
    pub path: PathBuf,
    /// True when this start generated it.
    pub generated: bool,
}

/// Finds (or, for a node that joins no one, generates) the cluster secret; see the module
/// documentation for the order. `joins`: the node is configured to join others.
pub fn load_or_generate(
    configured: Option<&Path>,
    data_dir: &Path,
    joins: bool,
) -> anyhow::Result<Loaded> {
    if let Some(p) = configured {
        return read(p).map(|secret| Loaded {
            secret,
            path: p.to_path_buf(),
            generated: false,
        });
    }
    let path = data_dir.join(SECRET_FILE_NAME);
    if path.exists() {
        return read(&path).map(|secret| Loaded {
            secret,
            path,
            generated: false,
        });
    }
    if joins {
        bail!(
            "this node joins a cluster (cluster.peers or cluster.etcd) but has no cluster \
             secret: give it the cluster's secret with --cluster-secret-file (cluster.secret_file, \
             KVPOOL_CLUSTER_SECRET_FILE), e.g. a copy of the first node's {}, or put that copy \
             at {}",
            SECRET_FILE_NAME,
            path.display()
        );
    }
    let contents = ClusterSecret::generate_file_contents()?;
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&path)
        .with_context(|| format!("creating the cluster secret {}", path.display()))?;
    f.write_all(contents.as_bytes())
        .and_then(|()| f.sync_all())
        .with_context(|| format!("writing the cluster secret {}", path.display()))?;
    let secret = ClusterSecret::from_file_contents(contents.as_bytes())?;
    Ok(Loaded {
        secret,
        path,
        generated: true,
    })
}

fn read(path: &Path) -> anyhow::Result<ClusterSecret> {
    let meta = std::fs::metadata(path)
        .with_context(|| format!("reading the cluster secret {}", path.display()))?;
    if meta.permissions().mode() & 0o077 != 0 {
        tracing::warn!(
            path = %path.display(),
            "the cluster secret file is readable by other users: chmod 600 it"
        );
    }
    let bytes = std::fs::read(path)
        .with_context(|| format!("reading the cluster secret {}", path.display()))?;
    ClusterSecret::from_file_contents(&bytes)
        .with_context(|| format!("the cluster secret {}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("kvpool-secret-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn a_lone_node_generates_a_private_secret_and_reuses_it() {
        let d = dir("lone");
        let first = load_or_generate(None, &d, false).unwrap();
        assert!(first.generated);
        assert_eq!(first.path, d.join(SECRET_FILE_NAME));
        let mode = std::fs::metadata(&first.path).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
        let again = load_or_generate(None, &d, true).unwrap();
        assert!(!again.generated, "reused, also by a node that joins");
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn a_joining_node_without_a_secret_refuses_to_start() {
        let d = dir("join");
        let e = load_or_generate(None, &d, true).unwrap_err().to_string();
        assert!(e.contains("--cluster-secret-file"), "{e}");
        assert!(!d.join(SECRET_FILE_NAME).exists(), "nothing generated");
        let missing = d.join("nope");
        assert!(load_or_generate(Some(&missing), &d, false).is_err());
        std::fs::write(d.join("short"), "abc").unwrap();
        assert!(load_or_generate(Some(&d.join("short")), &d, false).is_err());
        let _ = std::fs::remove_dir_all(&d);
    }
}
