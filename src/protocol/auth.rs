//! Cluster authentication: proving knowledge of the cluster secret in the handshake, without
//! sending it.
//!
//! Every node's `Hello` reply carries a fresh random `challenge`. A cluster peer (another node,
//! or an operator's tool holding the secret) answers with [`crate::protocol::Op::ClusterAuth`]:
//! a fresh random nonce of its own and `HMAC-SHA256(secret, transcript("peer"))`. The node
//! checks it in constant time and answers with `HMAC-SHA256(secret, transcript("node"))`, which
//! the peer checks in turn: both ends learn that the other holds the secret, the secret never
//! crosses the wire, and neither proof can be replayed on another connection (each covers the
//! other end's fresh random bytes). The transcript is
//!
//! ```text
//! "kvpool cluster auth v1" | 0 | role ("peer" or "node") | 0 | node id (u32 LE) | challenge | nonce
//! ```
//!
//! What it does not do: bind the proof to the transport. On plaintext TCP an attacker in the
//! path can still read the traffic and take over an authenticated connection; see
//! docs/SECURITY.md.

use ring::hmac;
use ring::rand::{SecureRandom, SystemRandom};
use thiserror::Error;

/// Bytes of a challenge, a nonce and a proof.
pub const AUTH_LEN: usize = 32;
/// Shortest accepted cluster secret, bytes.
pub const MIN_SECRET_LEN: usize = 32;

/// A challenge, a nonce or a proof.
pub type AuthBytes = [u8; AUTH_LEN];

/// The cluster secret: every node of a cluster holds the same one; clients never do.
#[derive(Clone)]
pub struct ClusterSecret {
    key: hmac::Key,
}

/// Why a cluster secret was refused, or randomness could not be had.
#[derive(Clone, Copy, Debug, Error, PartialEq, Eq)]
pub enum AuthError {
    /// The secret is shorter than [`MIN_SECRET_LEN`] bytes.
    #[error("the cluster secret must be at least {MIN_SECRET_LEN} bytes (not counting surrounding whitespace), found {0}")]
    TooShort(usize),
    /// The system's random number generator failed.
    #[error("the system random number generator failed")]
    Random,
}

impl std::fmt::Debug for ClusterSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ClusterSecret(..)")
    }
}

impl ClusterSecret {
    /// The secret as stored in a secret file: the text with surrounding whitespace removed,
    /// at least [`MIN_SECRET_LEN`] bytes.
    pub fn from_file_contents(contents: &[u8]) -> Result<ClusterSecret, AuthError> {
        let s = contents.trim_ascii();
        if s.len() < MIN_SECRET_LEN {
            return Err(AuthError::TooShort(s.len()));
        }
        Ok(ClusterSecret {
            key: hmac::Key::new(hmac::HMAC_SHA256, s),
        })
    }

    /// A new secret file's contents: 32 random bytes as 64 hex digits and a newline.
    pub fn generate_file_contents() -> Result<String, AuthError> {
        let bytes = random()?;
        let mut s: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
        s.push('\n');
        Ok(s)
    }

    /// What a peer sends to node `node` that issued `challenge`, with its own `nonce`.
    pub fn peer_proof(&self, node: u32, challenge: &AuthBytes, nonce: &AuthBytes) -> AuthBytes {
        self.sign(b"peer", node, challenge, nonce)
    }

    /// What node `node` answers a peer that proved itself.
    pub fn node_proof(&self, node: u32, challenge: &AuthBytes, nonce: &AuthBytes) -> AuthBytes {
        self.sign(b"node", node, challenge, nonce)
    }

    /// Checks a peer's proof (in constant time).
    pub fn verify_peer(
        &self,
        node: u32,
        challenge: &AuthBytes,
        nonce: &AuthBytes,
        proof: &AuthBytes,
    ) -> bool {
        self.verify(b"peer", node, challenge, nonce, proof)
    }

    /// Checks a node's answer (in constant time).
    pub fn verify_node(
        &self,
        node: u32,
        challenge: &AuthBytes,
        nonce: &AuthBytes,
        proof: &AuthBytes,
    ) -> bool {
        self.verify(b"node", node, challenge, nonce, proof)
    }

    fn verify(
        &self,
        role: &[u8],
        node: u32,
        challenge: &AuthBytes,
        nonce: &AuthBytes,
        proof: &AuthBytes,
    ) -> bool {
        let t = transcript(role, node, challenge, nonce);
        hmac::verify(&self.key, &t, proof).is_ok()
    }

    fn sign(&self, role: &[u8], node: u32, challenge: &AuthBytes, nonce: &AuthBytes) -> AuthBytes {
        let tag = hmac::sign(&self.key, &transcript(role, node, challenge, nonce));
        let mut out = [0u8; AUTH_LEN];
        out.copy_from_slice(tag.as_ref());
        out
    }
}

/// Whether `presented` is `configured`, in time that depends on neither's contents nor on
/// where they first differ: both are hashed (SHA-256) and the digests compared without an early
/// exit, so a peer timing its attempts learns nothing about a token's bytes or its length
/// (beyond the number of 64-byte blocks hashed).
pub fn token_matches(presented: &[u8], configured: &[u8]) -> bool {
    digests_equal(&token_digest(presented), &token_digest(configured))
}

/// The SHA-256 of a token, for [`digests_equal`] (hash the presented token once and compare it
/// with each configured one).
pub fn token_digest(token: &[u8]) -> [u8; 32] {
    let d = ring::digest::digest(&ring::digest::SHA256, token);
    let mut out = [0u8; 32];
    out.copy_from_slice(d.as_ref());
    out
}

/// Compares two digests with no data-dependent branch or early exit.
pub fn digests_equal(a: &[u8; 32], b: &[u8; 32]) -> bool {
    let mut diff = 0u8;
    for (x, y) in a.iter().zip(b) {
        diff |= x ^ y;
    }
    std::hint::black_box(diff) == 0
}

/// Fresh random bytes from the operating system, for a challenge or a nonce.
pub fn random() -> Result<AuthBytes, AuthError> {
    let mut b = [0u8; AUTH_LEN];
    SystemRandom::new()
        .fill(&mut b)
        .map_err(|_| AuthError::Random)?;
    Ok(b)
}

const DOMAIN: &[u8] = b"kvpool cluster auth v1";

fn transcript(role: &[u8], node: u32, challenge: &AuthBytes, nonce: &AuthBytes) -> Vec<u8> {
    let mut t = Vec::with_capacity(DOMAIN.len() + 2 + role.len() + 4 + 2 * AUTH_LEN);
    t.extend_from_slice(DOMAIN);
    t.push(0);
    t.extend_from_slice(role);
    t.push(0);
    t.extend_from_slice(&node.to_le_bytes());
    t.extend_from_slice(challenge);
    t.extend_from_slice(nonce);
    t
}

#[cfg(test)]
mod tests {
    use super::*;

    fn secret(s: &str) -> ClusterSecret {
        ClusterSecret::from_file_contents(s.as_bytes()).unwrap()
    }

    #[test]
    fn proofs_check_only_under_the_same_secret_node_and_bytes() {
        let a = secret("0123456789abcdef0123456789abcdef\n");
        let b = secret("fedcba9876543210fedcba9876543210");
        let (c, n) = (random().unwrap(), random().unwrap());
        let p = a.peer_proof(3, &c, &n);
        assert!(a.verify_peer(3, &c, &n, &p));
        assert!(!b.verify_peer(3, &c, &n, &p), "another secret");
        assert!(!a.verify_peer(4, &c, &n, &p), "another node");
        assert!(!a.verify_peer(3, &n, &c, &p), "other bytes");
        assert!(
            !a.verify_node(3, &c, &n, &p),
            "a peer proof is not a node proof"
        );
        let q = a.node_proof(3, &c, &n);
        assert!(a.verify_node(3, &c, &n, &q));
        assert_ne!(p, q);
    }

    #[test]
    fn tokens_match_only_themselves() {
        assert!(token_matches(b"team-token", b"team-token"));
        assert!(!token_matches(b"team-token", b"team-tokeN"));
        assert!(!token_matches(b"team-token", b"team-token "));
        assert!(!token_matches(b"", b"x"));
        assert!(token_matches(b"", b""));
        let d = token_digest(b"a");
        assert!(digests_equal(&d, &token_digest(b"a")));
        assert!(!digests_equal(&d, &token_digest(b"b")));
    }

    #[test]
    fn short_secrets_are_refused_and_generated_ones_are_accepted() {
        assert_eq!(
            ClusterSecret::from_file_contents(b"  short \n").unwrap_err(),
            AuthError::TooShort(5)
        );
        let g = ClusterSecret::generate_file_contents().unwrap();
        assert_eq!(g.trim().len(), 64);
        assert!(ClusterSecret::from_file_contents(g.as_bytes()).is_ok());
        assert_ne!(g, ClusterSecret::generate_file_contents().unwrap());
    }
}
