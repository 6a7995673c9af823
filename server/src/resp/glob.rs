//! Redis's glob patterns (`SCAN ... MATCH`): `*`, `?`, `[abc]`, `[^a-z]` and `\` escapes.
//!
//! Matching backtracks only to the last `*`, so it takes O(pattern × key) steps whatever the
//! pattern: a peer cannot make it exponential (as nested stars once did in Redis).

/// Does `key` match `pat`?
pub(crate) fn matches(pat: &[u8], key: &[u8]) -> bool {
    let (mut p, mut k) = (0, 0);
    // Where to resume after the last `*`: the pattern after it, and the key position it
    // currently absorbs up to.
    let mut star: Option<(usize, usize)> = None;
    while k < key.len() {
        if p < pat.len() {
            match pat[p] {
                b'*' => {
                    star = Some((p + 1, k));
                    p += 1;
                    continue;
                }
                b'?' => {
                    p += 1;
                    k += 1;
                    continue;
                }
                b'[' => {
                    if let Some((hit, next)) = class(pat, p, key[k]) {
                        if hit {
                            p = next;
                            k += 1;
                            continue;
                        }
                    }
                }
                b'\\' if p + 1 < pat.len() => {
                    if pat[p + 1] == key[k] {
                        p += 2;
                        k += 1;
                        continue;
                    }
                }
                c => {
                    if c == key[k] {
                        p += 1;
                        k += 1;
                        continue;
                    }
                }
            }
        }
        // Mismatch: let the last star absorb one more byte, or fail.
        match star {
            Some((sp, sk)) => {
                star = Some((sp, sk + 1));
                p = sp;
                k = sk + 1;
            }
            None => return false,
        }
    }
    pat[p..].iter().all(|&c| c == b'*')
}

/// Matches byte `c` against the class starting at `pat[at] == b'['`: whether it matched and
/// where the pattern goes on. An unterminated class runs to the end of the pattern, as in Redis.
fn class(pat: &[u8], at: usize, c: u8) -> Option<(bool, usize)> {
    let mut i = at + 1;
    let negate = pat.get(i) == Some(&b'^');
    if negate {
        i += 1;
    }
    let mut hit = false;
    while i < pat.len() && pat[i] != b']' {
        if pat[i] == b'\\' && i + 1 < pat.len() {
            hit |= pat[i + 1] == c;
            i += 2;
        } else if i + 2 < pat.len() && pat[i + 1] == b'-' && pat[i + 2] != b']' {
            let (lo, hi) = (pat[i].min(pat[i + 2]), pat[i].max(pat[i + 2]));
            hit |= (lo..=hi).contains(&c);
            i += 3;
        } else {
            hit |= pat[i] == c;
            i += 1;
        }
    }
    // Past the closing bracket (or at the end when there is none).
    Some((hit != negate, (i + 1).min(pat.len())))
}

#[cfg(test)]
mod tests {
    use super::matches;

    #[test]
    fn redis_glob_semantics() {
        let yes: &[(&str, &str)] = &[
            ("*", ""),
            ("*", "anything"),
            ("model/keys/rank_0/*", "model/keys/rank_0/layer.0.weight"),
            ("h?llo", "hello"),
            ("h[ae]llo", "hallo"),
            ("h[^e]llo", "hallo"),
            ("h[a-b]llo", "hbllo"),
            ("a\\*b", "a*b"),
            ("*a*b*", "xxaxxbxx"),
            ("a*", "a"),
        ];
        for (p, k) in yes {
            assert!(matches(p.as_bytes(), k.as_bytes()), "{p} ~ {k}");
        }
        let no: &[(&str, &str)] = &[
            ("h?llo", "hllo"),
            ("h[ae]llo", "hillo"),
            ("h[^e]llo", "hello"),
            ("a\\*b", "axb"),
            ("model/keys/rank_0/*", "model/keys/rank_1/x"),
            ("abc", "abcd"),
        ];
        for (p, k) in no {
            assert!(!matches(p.as_bytes(), k.as_bytes()), "{p} !~ {k}");
        }
    }

    #[test]
    fn many_stars_stay_linear() {
        let pat = "*a".repeat(50) + "b";
        let key = "a".repeat(5000);
        assert!(!matches(pat.as_bytes(), key.as_bytes()));
    }
}
