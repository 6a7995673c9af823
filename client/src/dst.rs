//! Where the bytes of a get go: the caller's buffers for each value, and the part of them
//! that one value fills.

/// Where one value of a batched get goes: buffers it fills in order (one, for a plain get
/// into a buffer; several, to scatter it, e.g. a KV block into per-layer pages). A value
/// shorter than them fills the first bytes.
pub(crate) type Dst<'a, 'b> = &'a mut [&'b mut [u8]];

/// The bytes `dst` holds.
pub(crate) fn dst_len(dst: &[&mut [u8]]) -> u64 {
    dst.iter().map(|p| p.len() as u64).sum()
}

/// The first bytes of a [`Dst`] that one value fills: one buffer's front (the plain get, no
/// allocation), or the pieces it reaches, the last one cut short.
pub(crate) enum Fit<'a> {
    One([&'a mut [u8]; 1]),
    Many(Vec<&'a mut [u8]>),
}

impl<'a> Fit<'a> {
    pub(crate) fn pieces(&mut self) -> &mut [&'a mut [u8]] {
        match self {
            Fit::One(one) => one,
            Fit::Many(many) => many,
        }
    }
}

/// The first `len` bytes of `dst`; None when it holds fewer.
pub(crate) fn fit<'a>(dst: &'a mut [&mut [u8]], len: u64) -> Option<Fit<'a>> {
    let mut left = usize::try_from(len).ok()?;
    if let [one] = dst {
        return one.get_mut(..left).map(|d| Fit::One([d]));
    }
    let mut out = Vec::with_capacity(dst.len());
    for p in dst.iter_mut() {
        if left == 0 {
            break;
        }
        let take = left.min(p.len());
        out.push(&mut p[..take]);
        left -= take;
    }
    (left == 0).then_some(Fit::Many(out))
}
