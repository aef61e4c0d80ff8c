//! The names gpusnap and the preload library agree on: environment
//! variables, the fast-swap control socket's abstract name and the light
//! guard's socket file.

/// Where the light guard listens (a path), set by `gpusnap run --light`.
pub const GUARD_SOCKET_ENV: &str = "GPUSNAP_GUARD_SOCKET";
/// How long a dying process waits without a word from the guard (ms).
pub const GUARD_WAIT_ENV: &str = "GPUSNAP_GUARD_WAIT_MS";
/// Set to `1` by `run --light --fast-swap`: the library serves fast swap.
pub const FAST_SWAP_ENV: &str = "GPUSNAP_FAST_SWAP";
/// Set to `1` beside [`FAST_SWAP_ENV`] by `run --keep-pinned`: the library
/// keeps its pinned host copies after each resume.
pub const KEEP_PINNED_ENV: &str = "GPUSNAP_FAST_SWAP_KEEP";
/// Replaces the control socket's whole abstract name (tests: a name taken
/// in advance).
pub const FAST_SWAP_NAME_ENV: &str = "GPUSNAP_FAST_SWAP_NAME";

/// What every fast-swap control socket's abstract name starts with (after
/// the leading NUL, which `/proc/net/unix` and `ss` show as `@`).
pub const SWAP_PREFIX: &str = "gpusnap-swap-";
/// The longest abstract name a control socket has, after the prefix.
const SWAP_REST_MAX: usize = 89;

/// The control socket name of process `pid` with the random bytes `random`:
/// `gpusnap-swap-PID-HEX` (the pid for people reading `ss -xl`, the random
/// bits so that no one can take the name first).
pub fn swap_name(pid: u32, random: &[u8; 16]) -> String {
    let hex: String = random.iter().map(|b| format!("{b:02x}")).collect();
    format!("{SWAP_PREFIX}{pid}-{hex}")
}

/// The abstract name (without `@`) if `shown` is a control socket's name as
/// `/proc/net/unix` shows it (`@gpusnap-swap-` and then letters, digits and
/// dashes only); `None` for any other name.
pub fn swap_name_shown(shown: &str) -> Option<&str> {
    let name = shown.strip_prefix('@')?;
    let rest = name.strip_prefix(SWAP_PREFIX)?;
    let ok = !rest.is_empty()
        && rest.len() <= SWAP_REST_MAX
        && rest.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-');
    ok.then_some(name)
}

/// The file name of the light guard's socket for the `gpusnap run --light`
/// with pid `run_pid`, in gpusnap's guards directory.
pub fn guard_socket_file(run_pid: u32) -> String {
    format!("light-{run_pid}.sock")
}

/// The run's pid if `file` is a light guard's socket file name
/// (`light-PID.sock`, at most ten digits).
pub fn guard_socket_pid(file: &str) -> Option<u64> {
    let pid = file.strip_prefix("light-")?.strip_suffix(".sock")?;
    let ok = !pid.is_empty() && pid.len() <= 10 && pid.bytes().all(|b| b.is_ascii_digit());
    ok.then(|| pid.parse().ok()).flatten()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn swap_names_round_trip() {
        let n = swap_name(7, &[0xab; 16]);
        assert_eq!(n, format!("gpusnap-swap-7-{}", "ab".repeat(16)));
        assert_eq!(swap_name_shown(&format!("@{n}")), Some(n.as_str()));
        for bad in ["gpusnap-swap-7", "@gpusnap-swap-", "@other-7", "@gpusnap-swap-7 x", "@gpusnap-swap-7/x"]
        {
            assert_eq!(swap_name_shown(bad), None, "{bad}");
        }
        assert_eq!(swap_name_shown(&format!("@gpusnap-swap-{}", "a".repeat(90))), None);
    }

    #[test]
    fn guard_socket_files_round_trip() {
        assert_eq!(guard_socket_pid(&guard_socket_file(4242)), Some(4242));
        assert_eq!(guard_socket_pid(&guard_socket_file(u32::MAX)), Some(u64::from(u32::MAX)));
        for bad in
            ["light-.sock", "light-12a.sock", "light-12.socket", "heavy-12.sock", "light-12345678901.sock"]
        {
            assert_eq!(guard_socket_pid(bad), None, "{bad}");
        }
    }
}
