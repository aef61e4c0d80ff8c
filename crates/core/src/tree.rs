//! Process trees: the descendants of a process, the roots of a set of
//! processes. CRIU dumps whole trees, and a guard follows one.

use procfs::process::Process;
use std::collections::HashMap;

/// The tree rooted at `root`, parents before children: (pid, ppid).
pub fn process_tree(root: i32) -> Vec<(i32, i32)> {
    let mut children: HashMap<i32, Vec<i32>> = HashMap::new();
    if let Ok(all) = procfs::process::all_processes() {
        for p in all.filter_map(Result::ok) {
            if let Ok(st) = p.stat() {
                children.entry(st.ppid).or_default().push(st.pid);
            }
        }
    }
    let ppid = Process::new(root).and_then(|p| p.stat()).map(|s| s.ppid).unwrap_or(0);
    let mut out = vec![(root, ppid)];
    let mut i = 0;
    while i < out.len() {
        let pid = out[i].0;
        if let Some(c) = children.get(&pid) {
            let mut c = c.clone();
            c.sort();
            out.extend(c.into_iter().map(|k| (k, pid)));
        }
        i += 1;
    }
    out
}

/// Of `pids`, those with no ancestor among them: the roots of the trees
/// that hold them all (a group's trees, for CRIU, which dumps whole trees).
pub fn roots_of(pids: &[i32]) -> Vec<i32> {
    let set: std::collections::HashSet<i32> = pids.iter().copied().collect();
    let ppid = |p: i32| Process::new(p).and_then(|x| x.stat()).map(|s| s.ppid).unwrap_or(0);
    let mut out = Vec::new();
    for &p in pids {
        let mut a = ppid(p);
        let mut inside = false;
        // Bounded: a pid chain is never longer than the pid space.
        for _ in 0..4096 {
            if a <= 1 {
                break;
            }
            if set.contains(&a) {
                inside = true;
                break;
            }
            a = ppid(a);
        }
        if !inside && !out.contains(&p) {
            out.push(p);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roots_of_a_process_and_its_child() {
        let me = std::process::id() as i32;
        let mut child = std::process::Command::new("sleep").arg("5").spawn().unwrap();
        let kid = child.id() as i32;
        assert_eq!(roots_of(&[kid, me]), vec![me]);
        assert_eq!(roots_of(&[kid]), vec![kid]);
        assert_eq!(roots_of(&[me, me]), vec![me]);
        assert!(process_tree(me).iter().any(|(p, pp)| *p == kid && *pp == me));
        let _ = child.kill();
        let _ = child.wait();
    }
}
