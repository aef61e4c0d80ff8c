//! Who may act on a service through the admin socket. The socket itself
//! admits root and the agent's group ([`crate::peer`]); a service that names
//! `allow_users` or `allow_groups` narrows its actions (suspend, resume,
//! hibernate, wake, restart) to those and root. Reading the services stays
//! open to every peer the socket admits.

use crate::config::ServiceConfig;
use crate::peer::{group_id, user_id, Peer};

/// Whether `peer` may act on the service configured as `cfg`.
pub fn may_act(peer: &Peer, cfg: &ServiceConfig) -> bool {
    let Some(uid) = peer.uid else { return false };
    if uid == 0 {
        return true;
    }
    if cfg.allow_users.is_none() && cfg.allow_groups.is_none() {
        return true;
    }
    let user = cfg.allow_users.iter().flatten().filter_map(|u| user_id(u.get_ref())).any(|u| u == uid);
    let group =
        cfg.allow_groups.iter().flatten().filter_map(|g| group_id(g.get_ref())).any(|g| peer.in_group(g));
    user || group
}

#[cfg(test)]
mod tests {
    use super::*;

    fn service(extra: &str) -> ServiceConfig {
        let text = format!(
            "[[service]]\nname = \"a\"\nlisten = \"127.0.0.1:1\"\nbackend = \"127.0.0.1:2\"\ncommand = [\"x\"]\n{extra}\n"
        );
        crate::Config::parse(&text, "t.toml").unwrap().service.remove(0)
    }

    fn peer(uid: u32, gid: u32, groups: &[u32]) -> Peer {
        Peer { uid: Some(uid), gid: Some(gid), groups: groups.to_vec(), ..Default::default() }
    }

    #[test]
    fn a_service_without_lists_is_every_peers() {
        assert!(may_act(&peer(1000, 1000, &[]), &service("")));
        assert!(!may_act(&Peer::default(), &service("")));
    }

    #[test]
    fn a_service_with_lists_is_theirs_and_roots() {
        let s = service("allow_users = [\"1000\"]\nallow_groups = [\"4242\"]");
        assert!(may_act(&peer(0, 0, &[]), &s));
        assert!(may_act(&peer(1000, 1000, &[]), &s));
        assert!(may_act(&peer(1001, 1001, &[4242]), &s));
        assert!(may_act(&peer(1001, 4242, &[]), &s));
        assert!(!may_act(&peer(1001, 1001, &[4343]), &s));
    }

    #[test]
    fn an_unknown_user_is_refused_in_the_file() {
        let text = "[[service]]\nname = \"a\"\nlisten = \"127.0.0.1:1\"\nbackend = \"127.0.0.1:2\"\ncommand = [\"x\"]\nallow_users = [\"no-such-user-here\"]\n";
        let e = crate::Config::parse(text, "t.toml").unwrap_err().to_string();
        assert!(e.contains("t.toml:6:") && e.contains("allow_users"), "{e}");
    }
}
