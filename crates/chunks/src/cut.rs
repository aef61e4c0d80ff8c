//! Where chunks end: content-defined, at page granularity.
//!
//! Everything the store chunks is a CRIU pages file: whole 4 KiB pages, and
//! what moves between two images (one process's private pages before pages
//! both share, a region grown or shrunk) moves by whole pages. So a chunk
//! may end only at a page's end, and whether it ends there is decided by
//! that page's content alone: a hash of a few words sampled across it.
//! The same pages in two files give the same cuts once a cut has been
//! found in both, as a rolling hash over every byte (FastCDC) does, at a
//! fraction of its cost: FastCDC reads every byte of the data a second
//! time besides blake3, ~0.6 CPU-ns a byte on the development machine,
//! ~30 CPU-seconds for a 49 GB hibernate (docs/benchmarks.md "Chunks cut
//! at page ends"); this reads 128 bytes of each 4 KiB page.
//!
//! Written here: no crate cuts on page boundaries by sampled content (the
//! CDC crates, `fastcdc` included, roll a hash over every byte).
//!
//! A page whose samples equal those of its neighbours (zero pages, a
//! repeated pattern) decides the same way each time: such a run is cut
//! every [`MIN_CHUNK`] or every [`MAX_CHUNK`] bytes, which dedups as well
//! (equal runs give equal chunks) and loses the alignment only inside the
//! run. A tail shorter than a page (never in a pages file) ends the last
//! chunk.

use crate::{AVG_CHUNK, MAX_CHUNK, MIN_CHUNK};

/// The granularity of the cuts.
pub const PAGE: usize = 4096;

const MIN_PAGES: usize = MIN_CHUNK as usize / PAGE;
const MAX_PAGES: usize = MAX_CHUNK as usize / PAGE;
/// A page past the minimum ends a chunk with probability 1 / (average -
/// minimum, in pages): chunks of about [`AVG_CHUNK`] on average (a little
/// less: some reach the maximum first).
const CUT_BELOW: u64 = (1u64 << 32) / ((AVG_CHUNK - MIN_CHUNK) as u64 / PAGE as u64);
/// The words of a page the decision reads: 16 words, one in each 256 bytes,
/// at offsets that do not repeat with the 256-byte stride (so that a
/// structure repeating at a power of two is not sampled at one phase only).
const SAMPLES: [usize; 16] = {
    let mut s = [0usize; 16];
    let mut k = 0;
    while k < 16 {
        s[k] = k * 256 + ((k * 40) % 248);
        k += 1;
    }
    s
};

/// Whether a chunk may end after `page` (exactly [`PAGE`] bytes).
#[inline]
fn ends_chunk(page: &[u8]) -> bool {
    let mut h: u64 = 0x243f_6a88_85a3_08d3;
    for &o in &SAMPLES {
        let mut w = [0u8; 8];
        w.copy_from_slice(&page[o..o + 8]);
        h = (h ^ u64::from_le_bytes(w)).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        h ^= h >> 29;
    }
    // splitmix64's finalizer: every sampled bit reaches the top bits.
    h ^= h >> 30;
    h = h.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    h ^= h >> 27;
    h = h.wrapping_mul(0x94d0_49bb_1331_11eb);
    h ^= h >> 31;
    (h >> 32) < CUT_BELOW
}

/// The chunks of `data` as `(offset, length)`, in order, covering it.
pub struct Cuts<'a> {
    data: &'a [u8],
    at: usize,
}

impl<'a> Cuts<'a> {
    pub fn new(data: &'a [u8]) -> Self {
        Cuts { data, at: 0 }
    }
}

impl Iterator for Cuts<'_> {
    type Item = (usize, usize);

    fn next(&mut self) -> Option<(usize, usize)> {
        let start = self.at;
        let rest = self.data.len() - start;
        if rest == 0 {
            return None;
        }
        let mut len = rest.min(MAX_CHUNK as usize);
        // Pages before the minimum are not looked at.
        let mut p = MIN_PAGES;
        while p < MAX_PAGES && (p + 1) * PAGE <= rest {
            let page = &self.data[start + p * PAGE..start + (p + 1) * PAGE];
            if ends_chunk(page) {
                len = (p + 1) * PAGE;
                break;
            }
            p += 1;
        }
        self.at = start + len;
        Some((start, len))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn noise(n: usize, seed: u64) -> Vec<u8> {
        use rand::{RngCore, SeedableRng};
        let mut v = vec![0u8; n];
        rand::rngs::StdRng::seed_from_u64(seed).fill_bytes(&mut v);
        v
    }

    fn cuts(d: &[u8]) -> Vec<(usize, usize)> {
        Cuts::new(d).collect()
    }

    #[test]
    fn cuts_cover_the_data_at_page_ends_within_the_bounds() {
        let d = noise((64 << 20) + 3 * PAGE + 100, 5);
        let c = cuts(&d);
        let mut off = 0;
        for (i, &(o, n)) in c.iter().enumerate() {
            assert_eq!(o, off);
            assert!(n <= MAX_CHUNK as usize);
            if i + 1 < c.len() {
                assert_eq!(n % PAGE, 0);
                assert!(n >= MIN_CHUNK as usize);
            }
            off += n;
        }
        assert_eq!(off, d.len());
        // About AVG_CHUNK on average (geometric, some capped at the max).
        let avg = d.len() / c.len();
        assert!((640 << 10..=1200 << 10).contains(&avg), "average chunk {avg}");
    }

    #[test]
    fn the_same_pages_give_the_same_cuts_after_a_shift() {
        let shared = noise(32 << 20, 9);
        let mut a = noise(37 * PAGE, 1);
        a.extend_from_slice(&shared);
        let mut b = noise(5 * PAGE, 2);
        b.extend_from_slice(&shared);
        let ends = |d: &[u8], front: usize| -> std::collections::HashSet<usize> {
            cuts(d).iter().map(|&(o, n)| o + n).filter(|&e| e > front).map(|e| e - front).collect()
        };
        let (ea, eb) = (ends(&a, 37 * PAGE), ends(&b, 5 * PAGE));
        let common = ea.intersection(&eb).count();
        assert!(common + 2 >= ea.len().min(eb.len()), "{common} of {} / {}", ea.len(), eb.len());
    }

    #[test]
    fn uniform_pages_are_cut_at_a_bound() {
        for d in [vec![0u8; 16 << 20], vec![0xa5u8; 16 << 20]] {
            let c = cuts(&d);
            let n = c[0].1;
            assert!(n == MIN_CHUNK as usize || n == MAX_CHUNK as usize, "{n}");
            assert!(c.iter().all(|&(_, k)| k == n));
        }
    }
}
