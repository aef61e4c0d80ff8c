//! The page server against a stand-in for `criu restore --lazy-pages`: an
//! image written with CRIU's framing and schemas, this process's own memory
//! registered with a userfaultfd, handed over as CRIU hands it.

use gpusnap_pages::{sys, Options, Server};
use prost::Message;
use std::io::Write;
use std::os::fd::{AsFd, AsRawFd};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

#[allow(clippy::all, dead_code, non_camel_case_types)]
mod pb {
    include!(concat!(env!("OUT_DIR"), "/_.rs"));
}

const PAGE: usize = 4096;

fn image(path: &Path, magic: u32, entries: &[Vec<u8>]) {
    let mut f = std::fs::File::create(path).unwrap();
    f.write_all(&0x5456_4319u32.to_ne_bytes()).unwrap();
    f.write_all(&magic.to_ne_bytes()).unwrap();
    for e in entries {
        f.write_all(&(e.len() as u32).to_ne_bytes()).unwrap();
        f.write_all(e).unwrap();
    }
}

fn byte(page: usize) -> u8 {
    (page % 251) as u8 + 1
}

/// CRIU's images of this process in `dir`: one anonymous private mapping
/// (`vma`: start, pages), its pagemap `entries` (address, pages, flags)
/// and `pages` for pages-7.img.
fn criu_image(dir: &Path, vma: (u64, usize), entries: &[(u64, u64, u32)], pages: &[u8]) {
    let pid = std::process::id() as i32;
    let entry = |&(vaddr, nr, flags): &(u64, u64, u32)| {
        pb::PagemapEntry {
            vaddr,
            compat_nr_pages: nr as u32,
            in_parent: None,
            flags: Some(flags),
            nr_pages: Some(nr),
        }
        .encode_to_vec()
    };
    let mut pagemap = vec![pb::PagemapHead { pages_id: 7 }.encode_to_vec()];
    pagemap.extend(entries.iter().map(entry));
    image(&dir.join(format!("pagemap-{pid}.img")), 0x5608_4025, &pagemap);
    let vma = pb::VmaEntry {
        start: vma.0,
        end: vma.0 + (vma.1 * PAGE) as u64,
        pgoff: 0,
        shmid: 0,
        prot: 3,
        flags: 0x22,
        status: 0,
        fd: -1,
        madv: None,
        fdflags: None,
    };
    let mm = pb::MmEntry { vmas: vec![vma], ..Default::default() };
    image(&dir.join(format!("mm-{pid}.img")), 0x5749_2820, &[mm.encode_to_vec()]);
    std::fs::write(dir.join("pages-7.img"), pages).unwrap();
}

/// `n` fresh pages of anonymous private memory of this process (unmapped
/// by the test), registered with `uffd` for missing pages.
fn mapped(uffd: &std::os::fd::OwnedFd, n: usize) -> u64 {
    // SAFETY: a fresh anonymous private mapping, unmapped at the end.
    let base = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            n * PAGE,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    assert_ne!(base, libc::MAP_FAILED);
    let base = base as u64;
    sys::register_missing(uffd.as_fd(), base, (n * PAGE) as u64).unwrap();
    base
}

/// What CRIU does: (with `zombie`) a zombie's negated pid and no fd, then
/// our pid and the userfaultfd as SCM_RIGHTS with one byte.
fn hand_over(work: &Path, uffd: &std::os::fd::OwnedFd, zombie: bool) -> UnixStream {
    use nix::sys::socket::{sendmsg, ControlMessage, MsgFlags};
    let s = UnixStream::connect(work.join("lazy-pages.socket")).unwrap();
    if zombie {
        (&s).write_all(&(-4242i32).to_ne_bytes()).unwrap();
    }
    (&s).write_all(&(std::process::id() as i32).to_ne_bytes()).unwrap();
    let fds = [uffd.as_raw_fd()];
    let dummy = [0u8; 1];
    sendmsg::<()>(
        s.as_raw_fd(),
        &[std::io::IoSlice::new(&dummy)],
        &[ControlMessage::ScmRights(&fds)],
        MsgFlags::empty(),
        None,
    )
    .unwrap();
    s
}

/// Waits (at most 60 s) until the server has every page in place.
fn wait_all(server: Server) -> (Result<gpusnap_pages::Report, gpusnap_pages::PagesError>, Server) {
    let (tx, rx) = std::sync::mpsc::channel();
    let waiter = std::thread::spawn(move || {
        let r = server.wait();
        let _ = tx.send(());
        (r, server)
    });
    rx.recv_timeout(Duration::from_secs(60)).expect("every page in place within 60 s");
    waiter.join().unwrap()
}

/// Pages 0..`n` of the mapping at `base` hold the image's bytes.
fn assert_pages(base: u64, n: usize) {
    // SAFETY: pages of our mapping that the server put in place.
    let mem = unsafe { std::slice::from_raw_parts(base as *const u8, n * PAGE) };
    for p in 0..n {
        assert!(mem[p * PAGE..(p + 1) * PAGE].iter().all(|&b| b == byte(p)), "page {p}");
    }
}

/// Stops the server and unmaps the `n` pages at `base`.
fn end(server: Server, uffd: std::os::fd::OwnedFd, base: u64, n: usize) {
    drop(server);
    // Its UNMAP event would wait for a reader: close the userfaultfd first.
    drop(uffd);
    // SAFETY: our own mapping; nothing refers to it any more.
    unsafe { libc::munmap(base as *mut libc::c_void, n * PAGE) };
}

/// CRIU's "restore finished".
fn restore_finished(s: &UnixStream) {
    (&*s).write_all(&0x5253_5446u32.to_ne_bytes()).unwrap();
}

#[test]
fn serves_lazy_pages_zero_fills_the_rest_and_skips_what_is_not_lazy() {
    let Ok((uffd, features)) = sys::open(sys::NONCOOP) else {
        gpusnap_testkit::skip("no userfaultfd here");
        return;
    };
    assert_eq!(features & sys::NONCOOP, sys::NONCOOP);
    // 64 pages of our own: pages 0..40 lazy in the image (two entries, a
    // present-but-not-lazy one between them shifting the offset), 40..64
    // not in the image at all (zero pages).
    let n = 64;
    let base = mapped(&uffd, n);

    let dir = tempfile::tempdir().unwrap();
    let (lazy, present) = (2u32 | 4, 4u32);
    let mut pages = Vec::new();
    for p in 0..30 {
        pages.extend(std::iter::repeat_n(byte(p), PAGE));
    }
    pages.extend(std::iter::repeat_n(0xEE, 3 * PAGE));
    for p in 30..40 {
        pages.extend(std::iter::repeat_n(byte(p), PAGE));
    }
    criu_image(
        dir.path(),
        (base, n),
        &[
            (base, 30, lazy),
            // Another mapping's pages, restored by CRIU itself: not served,
            // but they take their room in pages-7.img.
            (0x1000, 3, present),
            (base + 30 * PAGE as u64, 10, lazy),
        ],
        &pages,
    );

    let work = tempfile::tempdir().unwrap();
    let opts = Options {
        threads: 2,
        batch: 8 * PAGE as u64,
        wake_chunk: 2 * PAGE as u64,
        fault_batch: 2 * PAGE as u64,
        ..Options::default()
    };
    let server = Server::start(dir.path(), work.path(), opts).unwrap();
    assert_eq!(server.total_bytes(), 40 * PAGE as u64);

    let s = hand_over(work.path(), &uffd, true);

    // Faults before the restore is "finished" are served at once.
    let reader = std::thread::spawn(move || {
        // SAFETY: a page of our mapping; reading it faults it in.
        let lazy = unsafe { std::ptr::read_volatile((base + 35 * PAGE as u64) as *const u8) };
        // SAFETY: as above, a page the image does not cover.
        let zero = unsafe { std::ptr::read_volatile((base + 50 * PAGE as u64) as *const u8) };
        (lazy, zero)
    });
    let (lazy_byte, zero) = reader.join().unwrap();
    assert_eq!(lazy_byte, byte(35));
    assert_eq!(zero, 0);
    restore_finished(&s);

    let (r, server) = wait_all(server);
    let r = r.unwrap();
    assert_eq!(r.processes, 1);
    assert_eq!(r.bytes, 40 * PAGE as u64);
    assert!(r.zero_pages >= 1);
    assert_eq!(server.done_bytes(), 40 * PAGE as u64);
    // The report says who brought the pages in: the one fault in the
    // image (two pages from page 35 on) and the background fill.
    assert!(r.faults >= 2, "{r:?}");
    assert_eq!(r.fault_bytes, 2 * PAGE as u64, "{r:?}");
    assert_eq!(r.fault_bytes + r.fill_bytes + r.eexist_pages * PAGE as u64, 40 * PAGE as u64, "{r:?}");
    assert!(r.first_fault_ms.is_some() && r.restore_done_ms.is_some(), "{r:?}");
    assert!(r.first_fault_ms <= r.restore_done_ms, "faults were served before the restore was done: {r:?}");
    assert!(r.last_page_ms >= r.restore_done_ms.unwrap(), "{r:?}");
    assert_eq!(r.options.as_ref().map(|o| o.wake_chunk), Some(2 * PAGE as u64));
    assert_pages(base, 40);
    end(server, uffd, base, n);
}

#[test]
fn a_fault_that_waited_for_a_fill_which_gave_its_pieces_back_is_served_at_once() {
    let Ok((uffd, _)) = sys::open(sys::NONCOOP) else {
        gpusnap_testkit::skip("no userfaultfd here");
        return;
    };
    // 32 lazy pages; one fill thread that takes 16 at a time and sleeps
    // 800 ms before each 2 pages it copies; after its first 2 it gives
    // its pieces back, as on an EAGAIN (the layout changing under it).
    let n = 32;
    let base = mapped(&uffd, n);
    let dir = tempfile::tempdir().unwrap();
    let pages: Vec<u8> = (0..n).flat_map(|p| std::iter::repeat_n(byte(p), PAGE)).collect();
    criu_image(dir.path(), (base, n), &[(base, n as u64, 2 | 4)], &pages);
    let work = tempfile::tempdir().unwrap();
    let opts = Options {
        threads: 1,
        batch: 16 * PAGE as u64,
        wake_chunk: 2 * PAGE as u64,
        fault_batch: 2 * PAGE as u64,
        head_start: gpusnap_pages::HeadStart::Bytes(0),
        slow: Some(Duration::from_millis(800)),
        give_back_at: Some(2 * PAGE as u64),
        ..Options::default()
    };
    let server = Server::start(dir.path(), work.path(), opts).unwrap();
    let s = hand_over(work.path(), &uffd, false);
    restore_finished(&s);
    // Page 10 is read while the fill holds pages 0..16 (its first copy is
    // 800 ms away): the fault leaves it to that fill, which then gives it
    // back. Without a wake for what it gave back, the read waited until
    // the fill came round to it again, after pages 16..32 (~7 s here).
    std::thread::sleep(Duration::from_millis(300));
    let reader = std::thread::spawn(move || {
        // SAFETY: a page of our mapping; reading it faults it in.
        unsafe { std::ptr::read_volatile((base + 10 * PAGE as u64) as *const u8) }
    });
    assert_eq!(reader.join().unwrap(), byte(10));
    let done = server.done_bytes();
    let r = server.report();
    assert!(r.faults_in_flight >= 1, "the read did not wait for the fill: {r:?}");
    assert!(done <= 12 * PAGE as u64, "the read waited for the fill to come round: {done} bytes in: {r:?}");
    // Every page still comes, each intact.
    let (r, server) = wait_all(server);
    // (What the fill copied before it gave its pieces back is copied
    // again, found there, and counted again.)
    let r = r.unwrap();
    assert!(r.bytes >= (n * PAGE) as u64 && r.eexist_pages <= 2, "{r:?}");
    assert_pages(base, n);
    end(server, uffd, base, n);
}
