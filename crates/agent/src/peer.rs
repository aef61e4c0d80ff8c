//! Who may use the API: root, or a member (primary or supplementary) of
//! the configured group, as the peer's credentials (SO_PEERCRED) say.

/// The peer's credentials, read once per connection.
#[derive(Clone, Copy, Debug)]
pub struct Peer {
    pub pid: Option<i32>,
    pub uid: Option<u32>,
    pub gid: Option<u32>,
}

impl Peer {
    /// Root, or in `group` (a name or a numeric gid).
    pub fn allowed(&self, group: Option<&str>) -> bool {
        let Some(uid) = self.uid else { return false };
        if uid == 0 {
            return true;
        }
        let Some(gid) = group.and_then(group_id) else { return false };
        self.gid == Some(gid) || self.pid.is_some_and(|pid| supplementary_groups(pid).contains(&gid))
    }
}

/// A group's id, from its name or its number.
pub fn group_id(name: &str) -> Option<u32> {
    if let Ok(n) = name.parse::<u32>() {
        return Some(n);
    }
    nix::unistd::Group::from_name(name).ok().flatten().map(|g| g.gid.as_raw())
}

/// The peer's supplementary groups, from /proc (SO_PEERCRED carries only the primary one).
fn supplementary_groups(pid: i32) -> Vec<u32> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("Groups:"))
        .map(|g| g.split_whitespace().filter_map(|x| x.parse().ok()).collect())
        .unwrap_or_default()
}
