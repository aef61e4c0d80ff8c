//! How many sequences (matches) a zstd frame holds: what its decoding costs.
//!
//! A frame made without entropy-coded literals ([`crate::Codec::Lz`])
//! decodes at a pace set by its sequences: a frame of a few long matches
//! (zero pages, repeated pages) at several GB/s, one of a match every 8
//! bytes (integers widened to int64) at ~0.5-0.7 GB/s a core, however small
//! it is. The encoder keeps a frame only if its sequences are few enough
//! (`crate::encode_with`). Written by hand: neither the zstd crate nor
//! another exposes a frame's sequence count short of decoding it, and the
//! count is in each block's header (RFC 8878, sections 3.1.1 and 3.1.1.3),
//! a few bytes to read per 128 KiB block.

/// The number of sequences in the zstd frame `f`, or `None` if it is not
/// a single frame this reads (compressed literals, a dictionary, a
/// malformed or truncated frame): the caller then stores the chunk raw.
pub fn sequences(f: &[u8]) -> Option<u64> {
    let rd = |at: usize, n: usize| f.get(at..at + n);
    if rd(0, 4)? != [0x28, 0xb5, 0x2f, 0xfd] {
        return None;
    }
    let fhd = *f.get(4)?;
    let single = fhd & 0x20 != 0;
    if fhd & 0x03 != 0 {
        return None; // a dictionary id
    }
    let fcs = match fhd >> 6 {
        0 => usize::from(single),
        1 => 2,
        2 => 4,
        _ => 8,
    };
    let mut at = 5 + usize::from(!single) + fcs;
    let mut seqs = 0u64;
    loop {
        let h = rd(at, 3)?;
        let h = u32::from(h[0]) | u32::from(h[1]) << 8 | u32::from(h[2]) << 16;
        let (last, kind, size) = (h & 1 != 0, (h >> 1) & 3, (h >> 3) as usize);
        at += 3;
        match kind {
            0 => at += size, // raw
            1 => at += 1,    // RLE: one byte, repeated
            2 => {
                seqs += block_sequences(rd(at, size)?)?;
                at += size;
            }
            _ => return None,
        }
        if last {
            break;
        }
    }
    if fhd & 0x04 != 0 {
        at += 4; // the content checksum
    }
    (at == f.len()).then_some(seqs)
}

/// The sequences of one compressed block whose literals are raw or RLE.
fn block_sequences(b: &[u8]) -> Option<u64> {
    let b0 = *b.first()?;
    let (kind, format) = (b0 & 3, (b0 >> 2) & 3);
    if kind > 1 {
        return None; // Huffman-coded literals
    }
    let (header, size) = match format {
        0 | 2 => (1, usize::from(b0 >> 3)),
        1 => (2, usize::from(b0 >> 4) | usize::from(*b.get(1)?) << 4),
        _ => (3, usize::from(b0 >> 4) | usize::from(*b.get(1)?) << 4 | usize::from(*b.get(2)?) << 12),
    };
    let at = header + if kind == 0 { size } else { 1 };
    let s0 = *b.get(at)?;
    Some(match s0 {
        0 => 0,
        1..=127 => u64::from(s0),
        128..=254 => (u64::from(s0 - 128) << 8) + u64::from(*b.get(at + 1)?),
        255 => u64::from(*b.get(at + 1)?) + (u64::from(*b.get(at + 2)?) << 8) + 0x7f00,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lz(data: &[u8]) -> Vec<u8> {
        let mut z = zstd::bulk::Compressor::new(1).unwrap();
        z.set_parameter(zstd::zstd_safe::CParameter::LiteralCompressionMode(
            zstd::zstd_safe::ParamSwitch::Disable,
        ))
        .unwrap();
        z.compress(data).unwrap()
    }

    /// Random int16 widened to int64: a match (the sign bytes) every 8.
    fn widened16(n: usize) -> Vec<u8> {
        let mut x = 0x2545_f491_4f6c_dd1du64;
        (0..n / 8)
            .flat_map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                (x as i16 as i64).to_le_bytes()
            })
            .collect()
    }

    #[test]
    fn counts_the_sequences_of_a_frame() {
        // Zero pages: a handful of long matches.
        assert!(sequences(&lz(&vec![0u8; 1 << 20])).unwrap() < 64);
        // A match every 8 bytes, over several 128 KiB blocks.
        let w = widened16(1 << 20);
        let n = sequences(&lz(&w)).unwrap();
        assert!((110_000..=140_000).contains(&n), "{n}");
        // Incompressible bytes: raw blocks, none.
        let r: Vec<u8> = w.iter().enumerate().map(|(i, b)| b ^ (i as u8).wrapping_mul(151)).collect();
        let _ = sequences(&lz(&r)).unwrap();
    }

    #[test]
    fn what_it_cannot_read_is_none() {
        let f = lz(&widened16(1 << 20));
        assert_eq!(sequences(&f[..f.len() - 1]), None, "truncated");
        let mut long = f.clone();
        long.push(0);
        assert_eq!(sequences(&long), None, "trailing bytes");
        assert_eq!(sequences(b"not a frame at all"), None);
        assert_eq!(sequences(&[]), None);
        // Entropy-coded literals (the zstd codec's frames).
        let mut x = 1u64;
        let skewed: Vec<u8> = (0..1 << 20)
            .map(|_| {
                x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                ((x >> 60) as u8) & 0x7
            })
            .collect();
        assert_eq!(sequences(&zstd::bulk::compress(&skewed, 1).unwrap()), None);
    }
}
