//! One process's memory still to fill: its pieces, which of them are in
//! flight, and where the background fill goes on (after the faults, up or
//! down).

use crate::image::Iov;
use crate::pieces::{Piece, Pieces};

#[derive(Default)]
pub(crate) struct MmState {
    pub(crate) pieces: Pieces,
    pub(crate) gone: bool,
    /// Where the background fill goes on: just past the last fault (the
    /// process, or the driver inside it, reads on from there) or the last
    /// background batch; from the lowest missing address when nothing is
    /// missing past it.
    pub(crate) hint: Option<u64>,
    /// Pieces filled since the event thread last began a read: a fork's
    /// child lacks those whose copy came after the kernel let copies into
    /// the parent go on again (once the FORK event is read), so it gets
    /// them too (a page the child has already gives EEXIST).
    pub(crate) recent: Vec<Iov>,
    /// The previous fault's page, and whether the faults go downwards
    /// (two in a row below their predecessor): the background fill then
    /// follows them down instead of up.
    pub(crate) last_fault: Option<u64>,
    pub(crate) backward_run: u32,
    pub(crate) down: bool,
    /// The runs of contiguous memory to fill, `(start, end)` in address
    /// order, as they were at the start (for [`Options::follow_min`]; the
    /// events that change the layout later do not matter to a heuristic).
    pub(crate) runs: Vec<(u64, u64)>,
}

impl MmState {
    /// Pieces still to fill, none taken.
    pub(crate) fn of(iovs: Vec<Iov>) -> Self {
        let pieces = Pieces::new(iovs.into_iter().map(|iov| Piece { iov, owner: 0 }));
        // The pieces in address order, contiguous ones joined.
        let mut runs: Vec<(u64, u64)> = Vec::new();
        for p in pieces.iter() {
            match runs.last_mut() {
                Some(r) if r.1 == p.iov.start => r.1 = p.iov.end,
                _ => runs.push((p.iov.start, p.iov.end)),
            }
        }
        Self { pieces, runs, ..Default::default() }
    }
    /// Whether the background fill should follow a fault at `addr`: it lies
    /// in a run of at least `min` bytes (see [`Options::follow_min`]).
    pub(crate) fn follows(&self, addr: u64, min: u64) -> bool {
        if min == 0 {
            return true;
        }
        let i = self.runs.partition_point(|r| r.0 <= addr);
        i > 0 && {
            let (a, b) = self.runs[i - 1];
            addr < b && b - a >= min
        }
    }
    /// Starts the background fill at the first run of contiguous pieces of
    /// at least `min` bytes (see [`Options::big_first`]).
    pub(crate) fn big_first(mut self, min: u64) -> Self {
        if min > 0 {
            self.hint = self.runs.iter().find(|r| r.1 - r.0 >= min).map(|r| r.0);
        }
        self
    }
    pub(crate) fn iovs(&self) -> Vec<Iov> {
        self.pieces.iter().map(|p| p.iov).collect()
    }
    pub(crate) fn drop_range(&mut self, a: u64, b: u64) -> u64 {
        self.pieces.drop_range(a, b)
    }
    pub(crate) fn remap(&mut self, from: u64, to: u64, len: u64) {
        self.pieces.remap(from, to, len)
    }
    /// Notes a fault at `addr`; true when it is below the previous one.
    pub(crate) fn note_fault(&mut self, addr: u64) -> bool {
        let back = self.last_fault.is_some_and(|l| addr < l);
        self.last_fault = Some(addr);
        if back {
            self.backward_run = self.backward_run.saturating_add(1);
            if self.backward_run >= 2 {
                self.down = true;
            }
        } else {
            self.backward_run = 0;
            self.down = false;
        }
        back
    }
    /// As [`MmState::take`], downwards: up to `max` bytes ending at
    /// `below` (or at the hint), in the highest piece still to fill under it.
    pub(crate) fn take_down(&mut self, below: Option<u64>, max: u64, id: u64) -> Option<Iov> {
        let from = below.or(self.hint)?;
        let p = self.pieces.last_free_below(from)?.iov;
        let end = p.end.min(from);
        let start = p.start.max(end.saturating_sub(max));
        let iov = self.pieces.claim(p.start, start, end, id);
        if below.is_none() {
            self.hint = Some(start);
        }
        Some(iov)
    }
    /// Marks up to `max` bytes from `addr` (or from the first piece still
    /// to fill) as taken by fill `id`.
    pub(crate) fn take(&mut self, addr: Option<u64>, max: u64, id: u64) -> Option<Iov> {
        if addr.is_none() && self.down {
            if let Some(iov) = self.take_down(None, max, id) {
                return Some(iov);
            }
        }
        let from = self.hint.unwrap_or(0);
        let p = match addr {
            Some(a) => self.pieces.at(a).filter(|p| p.owner == 0).copied()?,
            None => match self.pieces.first_free_from(from) {
                Some(p) => p,
                None => self.pieces.first_free_from(0)?,
            },
        }
        .iov;
        let start = addr.unwrap_or(if from > p.start && from < p.end { from } else { p.start });
        let end = p.end.min(start + max);
        let iov = self.pieces.claim(p.start, start, end, id);
        if addr.is_none() {
            self.hint = Some(end);
        }
        Some(iov)
    }
    pub(crate) fn in_flight(&self, addr: u64) -> Option<bool> {
        self.pieces.at(addr).map(|p| p.owner != 0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(crate) fn st(ranges: &[(u64, u64)]) -> MmState {
        MmState {
            pieces: Pieces::new(
                ranges
                    .iter()
                    .map(|&(s, e)| Piece { iov: Iov { start: s, end: e, off: s * 10 }, owner: 0 })
                    .collect::<Vec<_>>(),
            ),
            ..Default::default()
        }
    }

    #[test]
    pub(crate) fn the_background_fill_follows_faults_downwards() {
        let mut s = st(&[(0x1000, 0x40000)]);
        // Ascending faults: the fill goes up.
        assert!(!s.note_fault(0x10000));
        assert!(!s.note_fault(0x12000));
        assert!(!s.down);
        // Two in a row below their predecessor: the reader goes down.
        assert!(s.note_fault(0x11000));
        assert!(!s.down, "one step back is not a direction");
        s.note_fault(0x30000);
        s.note_fault(0x2f000);
        s.note_fault(0x2e000);
        assert!(s.down);
        let f = s.take_down(Some(0x2e000 + 0x1000), 0x3000, 1).unwrap();
        assert_eq!((f.start, f.end), (0x2c000, 0x2f000));
        s.hint = Some(f.start);
        let a = s.take(None, 0x2000, 2).unwrap();
        assert_eq!((a.start, a.end), (0x2a000, 0x2c000));
        let b = s.take(None, 0x2000, 3).unwrap();
        assert_eq!((b.start, b.end), (0x28000, 0x2a000));
        // Nothing below: up from the hint, then from the lowest.
        s.hint = Some(0x1000);
        let c = s.take(None, 0x2000, 4).unwrap();
        assert_eq!((c.start, c.end), (0x1000, 0x3000));
        // A fault going up again turns the fill back.
        assert!(!s.note_fault(0x2f000));
        assert!(!s.down);
    }

    #[test]
    pub(crate) fn only_faults_in_large_runs_steer_the_fill() {
        let iov = |start: u64, end: u64| Iov { start, end, off: 0 };
        let mut st = MmState::of(vec![
            iov(0x1000, 0x3000),
            iov(0x10_0000, 0x20_0000),
            iov(0x20_0000, 0x80_0000),
            iov(0x90_0000, 0x1000_0000),
        ]);
        assert_eq!(st.runs, vec![(0x1000, 0x3000), (0x10_0000, 0x80_0000), (0x90_0000, 0x1000_0000)]);
        assert!(st.follows(0x2000, 0) && st.follows(0x5000, 0), "0: every fault");
        assert!(!st.follows(0x2000, 64 << 20) && !st.follows(0x40_0000, 64 << 20));
        assert!(st.follows(0x40_0000, 4 << 20) && st.follows(0x90_0000, 64 << 20));
        assert!(!st.follows(0x5000, 1) && !st.follows(0x1000_0000, 1), "outside every run");
        // A fault off the large runs takes its own batch, leaving the hint.
        st.hint = Some(0x90_0000);
        let f = st.take(Some(0x2000), 0x1000, 1).unwrap();
        assert_eq!((f.start, f.end, st.hint), (0x2000, 0x3000, Some(0x90_0000)));
    }

    #[test]
    pub(crate) fn the_fill_starts_at_the_first_large_run() {
        let iov = |start: u64, end: u64| Iov { start, end, off: 0 };
        let st = MmState::of(vec![
            iov(0x1000, 0x3000),
            iov(0x10_0000, 0x20_0000),
            iov(0x20_0000, 0x80_0000),
            iov(0x90_0000, 0x1000_0000),
        ]);
        // 0x10_0000..0x80_0000 is one run of 7 MiB; the last is 247 MiB.
        assert_eq!(MmState::of(st.iovs()).big_first(4 << 20).hint, Some(0x10_0000));
        assert_eq!(MmState::of(st.iovs()).big_first(64 << 20).hint, Some(0x90_0000));
        assert_eq!(MmState::of(st.iovs()).big_first(1 << 30).hint, None);
        assert_eq!(MmState::of(st.iovs()).big_first(0).hint, None);
    }

    #[test]
    pub(crate) fn batches_taken_one_by_one_cover_every_piece_once() {
        // Many mappings (as a CUDA process has), taken in batches that
        // cut pieces in the middle: every byte is handed out exactly once.
        let ranges: Vec<(u64, u64)> =
            (0..500u64).map(|k| (0x10_0000 * k + 0x1000, 0x10_0000 * k + 0x9_3000)).collect();
        let total: u64 = ranges.iter().map(|(a, b)| b - a).sum();
        let mut s = st(&ranges);
        let mut got = Vec::new();
        let mut id = 1;
        while let Some(iov) = s.take(None, 0x2_5000, id) {
            got.push(iov);
            id += 1;
        }
        assert_eq!(got.iter().map(|i| i.len()).sum::<u64>(), total);
        got.sort_by_key(|i| i.start);
        assert!(got.windows(2).all(|w| w[0].end <= w[1].start));
        assert!(s.pieces.to_vec().windows(2).all(|w| w[0].iov.end <= w[1].iov.start));
        assert!(s.pieces.iter().all(|p| p.owner != 0));
        // The offsets into the pages file follow the addresses.
        assert!(got.iter().all(|i| {
            let r = ranges.iter().find(|r| r.0 <= i.start && i.start < r.1).unwrap();
            i.end <= r.1 && i.off == r.0 * 10 + (i.start - r.0)
        }));
    }

    #[test]
    pub(crate) fn take_splits_and_marks() {
        let mut s = st(&[(0x1000, 0x9000)]);
        let a = s.take(Some(0x3000), 0x2000, 7).unwrap();
        assert_eq!((a.start, a.end, a.off), (0x3000, 0x5000, 0x1000 * 10 + 0x2000));
        assert_eq!(s.in_flight(0x3000), Some(true));
        assert_eq!(s.in_flight(0x1000), Some(false));
        let b = s.take(None, 0x10000, 8).unwrap();
        assert_eq!((b.start, b.end), (0x1000, 0x3000));
        assert_eq!(s.pieces.iter().map(|p| p.iov.len()).sum::<u64>(), 0x8000);
    }

    #[test]
    pub(crate) fn the_background_fill_follows_the_last_fault() {
        let mut s = st(&[(0x1000, 0x20000)]);
        s.hint = Some(0x8000);
        let a = s.take(None, 0x2000, 1).unwrap();
        assert_eq!((a.start, a.end), (0x8000, 0xa000));
        let b = s.take(None, 0x2000, 2).unwrap();
        assert_eq!((b.start, b.end), (0xa000, 0xc000));
        // Nothing missing past the hint: from the lowest again.
        s.hint = Some(0x30000);
        let c = s.take(None, 0x2000, 3).unwrap();
        assert_eq!((c.start, c.end), (0x1000, 0x3000));
    }

    #[test]
    pub(crate) fn remove_and_remap_edit_pieces_in_flight_too() {
        let mut s = st(&[(0x1000, 0x5000), (0x8000, 0xa000)]);
        s.take(Some(0x2000), 0x2000, 3).unwrap();
        assert_eq!(s.drop_range(0x3000, 0x9000), 0x3000);
        s.remap(0x1000, 0x101000, 0x2000);
        let v: Vec<(u64, u64, u64)> = s.pieces.iter().map(|p| (p.iov.start, p.iov.end, p.owner)).collect();
        assert_eq!(v, vec![(0x9000, 0xa000, 0), (0x101000, 0x102000, 0), (0x102000, 0x103000, 3)]);
        // The moved piece still reads from where it was in the image.
        assert_eq!(s.pieces.to_vec()[2].iov.off, 0x1000 * 10 + 0x1000);
    }
}
