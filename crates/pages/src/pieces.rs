//! A process's memory still to fill: pieces by address, each free or taken
//! by one fill.
//!
//! The fill threads take a batch and give it back done under the process's
//! lock tens of thousands of times a wake, so both are O(log n) here: a
//! CUDA process's image holds a piece per lazy mapping (thousands), cut
//! further by the batches in flight, and a sorted `Vec` edited in
//! place (a full pass to find a fill's pieces, another to remove them, a
//! shift of the tail to split one) kept 8 fill threads 26.5 s waiting for
//! that lock, summed, in an 8.4 s fill (H200, bench/results/038; 0.65 s with this
//! map, the fill 5.9 -> 10.9 GB/s, bench/results/039). Events (fork, remap,
//! unmap, remove) are rare and edit the whole list.

use crate::image::Iov;
use std::collections::BTreeMap;
use std::ops::Bound::{Excluded, Unbounded};

#[derive(Debug, Clone, Copy)]
pub(crate) struct Piece {
    pub iov: Iov,
    /// 0: still to fill; else the fill that has it.
    pub owner: u64,
}

fn split(p: &Piece, at: u64) -> (Piece, Piece) {
    let l = Piece { iov: Iov { start: p.iov.start, end: at, off: p.iov.off }, owner: p.owner };
    let r =
        Piece { iov: Iov { start: at, end: p.iov.end, off: p.iov.off + (at - p.iov.start) }, owner: p.owner };
    (l, r)
}

/// Cuts the pieces at `a` and `b`, so that every piece is inside or outside [a, b).
fn cut(ps: Vec<Piece>, a: u64, b: u64) -> Vec<Piece> {
    let mut out = Vec::with_capacity(ps.len() + 2);
    for p in ps {
        let mut cur = p;
        for at in [a, b] {
            if at > cur.iov.start && at < cur.iov.end {
                let (l, r) = split(&cur, at);
                out.push(l);
                cur = r;
            }
        }
        out.push(cur);
    }
    out
}

/// Non-overlapping pieces by start address.
#[derive(Default, Debug)]
pub(crate) struct Pieces(BTreeMap<u64, Piece>);

impl Pieces {
    pub fn new(ps: impl IntoIterator<Item = Piece>) -> Self {
        Self(ps.into_iter().map(|p| (p.iov.start, p)).collect())
    }
    /// In address order.
    pub fn iter(&self) -> impl DoubleEndedIterator<Item = &Piece> {
        self.0.values()
    }
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
    pub fn len(&self) -> usize {
        self.0.len()
    }
    #[cfg(test)]
    pub fn to_vec(&self) -> Vec<Piece> {
        self.iter().copied().collect()
    }
    /// The piece holding `addr`.
    pub fn at(&self, addr: u64) -> Option<&Piece> {
        self.0.range(..=addr).next_back().map(|(_, p)| p).filter(|p| addr < p.iov.end)
    }
    /// The first free piece whose end is past `from`.
    pub fn first_free_from(&self, from: u64) -> Option<Piece> {
        let holding = self.at(from).into_iter();
        holding
            .chain(self.0.range((Excluded(from), Unbounded)).map(|(_, p)| p))
            .find(|p| p.owner == 0)
            .copied()
    }
    /// The last free piece that starts below `from`.
    pub fn last_free_below(&self, from: u64) -> Option<Piece> {
        self.0.range(..from).rev().map(|(_, p)| p).find(|p| p.owner == 0).copied()
    }
    /// Marks [start, end), which lies inside the piece starting at `key`,
    /// as taken by fill `id`, splitting only that piece.
    pub fn claim(&mut self, key: u64, start: u64, end: u64, id: u64) -> Iov {
        let mut cur = self.0.remove(&key).expect("a piece of the list");
        if start > cur.iov.start {
            let (l, r) = split(&cur, start);
            self.0.insert(l.iov.start, l);
            cur = r;
        }
        if end < cur.iov.end {
            let (l, r) = split(&cur, end);
            self.0.insert(r.iov.start, r);
            cur = l;
        }
        cur.owner = id;
        self.0.insert(cur.iov.start, cur);
        cur.iov
    }
    /// Removes fill `id`'s pieces, which it took as `iov`, once its pages
    /// are in; returns them. Where events moved or cut them meanwhile, the
    /// whole list is searched.
    pub fn finish(&mut self, id: u64, iov: Iov) -> Vec<Iov> {
        let mine: Vec<u64> =
            self.0.range(iov.start..iov.end).filter(|(_, p)| p.owner == id).map(|(&k, _)| k).collect();
        let bytes: u64 = mine.iter().map(|k| self.0[k].iov.len()).sum();
        if bytes == iov.len() {
            return mine.iter().filter_map(|k| self.0.remove(k)).map(|p| p.iov).collect();
        }
        let done: Vec<Iov> = self.iter().filter(|p| p.owner == id).map(|p| p.iov).collect();
        self.0.retain(|_, p| p.owner != id);
        done
    }
    /// Gives fill `id`'s pieces back, still to fill; returns where they
    /// are now (an event may have moved them since the claim).
    pub fn release(&mut self, id: u64) -> Vec<Iov> {
        let mut back = Vec::new();
        for p in self.0.values_mut().filter(|p| p.owner == id) {
            p.owner = 0;
            back.push(p.iov);
        }
        back
    }
    /// Drops [a, b); returns the bytes dropped.
    pub fn drop_range(&mut self, a: u64, b: u64) -> u64 {
        let (keep, gone): (Vec<Piece>, Vec<Piece>) =
            cut(self.take_all(), a, b).into_iter().partition(|p| p.iov.end <= a || p.iov.start >= b);
        *self = Self::new(keep);
        gone.iter().map(|p| p.iov.len()).sum()
    }
    /// Moves what lies in [from, from + len) to `to` (mremap).
    pub fn remap(&mut self, from: u64, to: u64, len: u64) {
        let mut ps = cut(self.take_all(), from, from + len);
        for p in &mut ps {
            if p.iov.start >= from && p.iov.end <= from + len {
                p.iov.start = p.iov.start - from + to;
                p.iov.end = p.iov.end - from + to;
            }
        }
        *self = Self::new(ps);
    }
    fn take_all(&mut self) -> Vec<Piece> {
        std::mem::take(&mut self.0).into_values().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn free(s: u64, e: u64) -> Piece {
        Piece { iov: Iov { start: s, end: e, off: s * 10 }, owner: 0 }
    }

    #[test]
    fn lookups_claims_and_finishes() {
        let mut ps = Pieces::new([free(0x1000, 0x3000), free(0x5000, 0x9000)]);
        assert_eq!(ps.at(0x2fff).map(|p| p.iov.start), Some(0x1000));
        assert!(ps.at(0x3000).is_none() && ps.at(0x500).is_none() && ps.at(0x9000).is_none());
        assert_eq!(ps.first_free_from(0x2000).map(|p| p.iov.start), Some(0x1000));
        assert_eq!(ps.first_free_from(0x3000).map(|p| p.iov.start), Some(0x5000));
        assert!(ps.first_free_from(0x9000).is_none());
        let iov = ps.claim(0x5000, 0x6000, 0x7000, 7);
        assert_eq!((iov.start, iov.end, iov.off), (0x6000, 0x7000, 0x5000 * 10 + 0x1000));
        let v: Vec<(u64, u64, u64)> = ps.iter().map(|p| (p.iov.start, p.iov.end, p.owner)).collect();
        assert_eq!(v, [(0x1000, 0x3000, 0), (0x5000, 0x6000, 0), (0x6000, 0x7000, 7), (0x7000, 0x9000, 0)]);
        assert_eq!(ps.first_free_from(0x6800).map(|p| p.iov.start), Some(0x7000));
        assert_eq!(ps.last_free_below(0x7000).map(|p| p.iov.start), Some(0x5000));
        assert_eq!(ps.finish(7, iov).len(), 1);
        assert!(ps.at(0x6000).is_none());
        // Cut by an event while in flight: found all the same.
        let iov = ps.claim(0x7000, 0x7000, 0x9000, 8);
        assert_eq!(ps.drop_range(0x7800, 0x8000), 0x800);
        assert_eq!(ps.finish(8, iov).iter().map(|i| i.len()).sum::<u64>(), 0x1800);
        // Moved by an event while in flight: found by the whole search.
        let iov = ps.claim(0x1000, 0x1000, 0x2000, 9);
        ps.remap(0x1000, 0x20000, 0x2000);
        let done = ps.finish(9, iov);
        assert_eq!((done[0].start, done[0].end), (0x20000, 0x21000));
        let v: Vec<(u64, u64, u64)> = ps.iter().map(|p| (p.iov.start, p.iov.end, p.owner)).collect();
        assert_eq!(v, [(0x5000, 0x6000, 0), (0x21000, 0x22000, 0)]);
        // Given back.
        ps.claim(0x5000, 0x5000, 0x6000, 10);
        let back = ps.release(10);
        assert_eq!(back.iter().map(|i| (i.start, i.end)).collect::<Vec<_>>(), [(0x5000, 0x6000)]);
        assert!(ps.iter().all(|p| p.owner == 0));
    }
}
