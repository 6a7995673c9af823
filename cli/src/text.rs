//! Keys and values as the command line gives and prints them: stdin, hex, and keys escaped into
//! one line of text.

use std::io::Read;

use anyhow::{bail, Context};

/// Everything on stdin.
pub(crate) fn read_stdin() -> anyhow::Result<Vec<u8>> {
    let mut v = Vec::new();
    std::io::stdin().lock().read_to_end(&mut v)?;
    Ok(v)
}

/// A key given in hex (`--hex`).
pub(crate) fn decode_hex(s: &str) -> anyhow::Result<Vec<u8>> {
    if s.len() % 2 != 0 {
        bail!("hex key {s:?} has an odd length");
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).with_context(|| format!("bad hex key {s:?}")))
        .collect()
}

/// A key as one line of text: UTF-8 as it is, but a backslash, control characters (a newline
/// would split the line) and bytes that are not UTF-8 escaped.
pub(crate) fn printable(key: &[u8]) -> String {
    let mut s = String::with_capacity(key.len());
    for chunk in key.utf8_chunks() {
        for c in chunk.valid().chars() {
            if c == '\\' || c.is_control() {
                s.extend(c.escape_default());
            } else {
                s.push(c);
            }
        }
        for b in chunk.invalid() {
            s.push_str(&format!("\\x{b:02x}"));
        }
    }
    s
}
