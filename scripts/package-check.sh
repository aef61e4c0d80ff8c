#!/usr/bin/env bash
# Installs the release artifacts on clean Debian systems and runs them there:
#   scripts/package-check.sh [--out DIR] [--cache DIR] [--prepare]
#
#   1. Debian 12 (bookworm): installs gpusnap_*_amd64.deb with dpkg into a
#      fresh root, checks the files it put where (binary, preload library,
#      unit, man pages, completions), runs `gpusnap --version`, `gpusnap
#      doctor` (no GPU here: doctor reports the driver missing and exits 0,
#      as it does whenever it could look) and `gpusnap run --light true`
#      (the binary finds its preload library in /usr/lib/gpusnap), then
#      purges the package and checks that nothing of it is left.
#   2. Debian 11 (bullseye, glibc 2.31, the oldest gpusnap supports): unpacks
#      gpusnap-*-x86_64-linux-gnu.tar.gz into /usr/local of a fresh root and
#      runs the same commands there.
#
# DIR (default target/package/out) holds what `scripts/package.sh --deb`
# wrote; the checksums beside the artifacts are verified first. Each root is
# made once with `debootstrap --variant=minbase` from the Debian mirror this
# machine's apt uses and kept as a tarball in the cache (default
# /var/tmp/gpusnap-package-check); every run unpacks a fresh copy, so nothing
# of a previous run is left in it (--prepare: make the cached roots, nothing
# else; no artifacts needed). Needs root (chroot, mounts) and debootstrap
# (`apt-get install debootstrap`).
#
# Slow (minutes the first time: two debootstraps) and needs the Debian
# mirror, so it is not part of scripts/test.sh or CI: run it before a
# release. Results: bench/results/*-package-check.md.
#
# Exit codes: 0 done, 1 failed (the error says what), 2 bad usage.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"

SCRIPT_NAME=package-check
# shellcheck source=scripts/package-lib.sh
. scripts/package-lib.sh
say() { printf '\n== %s\n' "$*"; }

out=${CARGO_TARGET_DIR:-$root/target}/package/out
cache=/var/tmp/gpusnap-package-check
prepare=0
while (($#)); do
	case $1 in
		--out)
			(($# >= 2)) || usage "--out needs a directory"
			out=$2
			shift
			;;
		--cache)
			(($# >= 2)) || usage "--cache needs a directory"
			cache=$2
			shift
			;;
		--prepare) prepare=1 ;;
		-h | --help)
			print_help
			exit 0
			;;
		*) usage "unknown argument $1 (--out DIR, --cache DIR, --prepare, --help)" ;;
	esac
	shift
done

((EUID == 0)) || die "needs root (chroot and mounts)"
command -v debootstrap >/dev/null || die "debootstrap not found: apt-get install debootstrap"
out=$(realpath -m -- "$out")

# The mirror this machine's apt uses for Debian itself.
mirror=$(
	{
		grep -hs '^URIs:' /etc/apt/sources.list.d/*.sources | awk '{print $2}' || true
		grep -hs '^deb ' /etc/apt/sources.list /etc/apt/sources.list.d/*.list | awk '{print $2}' || true
	} 2>/dev/null | grep -v security | head -n 1 || true
)
mirror=${mirror:-http://deb.debian.org/debian}

# The cached base of SUITE (a tarball of its root), debootstrapped if missing.
cached_base() {
	local suite=$1
	local base=$cache/$suite-minbase.tar.gz
	mkdir -p -- "$cache"
	if [[ ! -s $base ]]; then
		log "debootstrap $suite from $mirror (once; kept as $base)"
		local tmp
		tmp=$(mktemp -d "$cache/$suite.XXXXXX")
		chmod 755 "$tmp"
		debootstrap --variant=minbase "$suite" "$tmp" "$mirror" >"$cache/$suite-debootstrap.log" 2>&1 ||
			die "debootstrap $suite failed: see $cache/$suite-debootstrap.log"
		tar -C "$tmp" -czf "$base.part" . && mv -- "$base.part" "$base"
		rm -rf -- "$tmp"
	fi
}

# A fresh root of SUITE in a new directory, printed.
fresh_root() {
	cached_base "$1"
	local dir
	dir=$(mktemp -d /tmp/gpusnap-package-check.XXXXXX)
	tar -C "$dir" -xzf "$cache/$1-minbase.tar.gz"
	chmod 755 "$dir"
	printf '%s\n' "$dir"
}

if ((prepare)); then
	cached_base bookworm
	cached_base bullseye
	log "roots cached in $cache"
	exit 0
fi

shopt -s nullglob
debs=("$out"/gpusnap_*_amd64.deb)
tars=("$out"/gpusnap-*-x86_64-linux-gnu.tar.gz)
shopt -u nullglob
((${#debs[@]} == 1)) || die "want one gpusnap_*_amd64.deb in $out, found ${#debs[@]} (run scripts/package.sh --deb)"
((${#tars[@]} == 1)) || die "want one gpusnap-*-x86_64-linux-gnu.tar.gz in $out, found ${#tars[@]} (run scripts/package.sh)"
deb=${debs[0]}
tarball=${tars[0]}

say "artifacts"
(cd "$out" && sha256sum -c "$(basename "$deb").sha256" "$(basename "$tarball").sha256")
ls -l "$deb" "$tarball" | awk '{print $5, $9}'
dpkg-deb --info "$deb" | sed -n '/Package:/,/Description:/p'

roots=()
mounted=()
cleanup() {
	local m
	for ((i = ${#mounted[@]} - 1; i >= 0; i--)); do
		umount -l -- "${mounted[i]}" 2>/dev/null || true
	done
	for r in "${roots[@]}"; do
		# Never remove a root that still has the host's /dev or /proc mounted in it.
		if findmnt -rn -o TARGET | grep -q "^$r/"; then
			log "left $r (still mounted)"
		else
			rm -rf -- "$r"
		fi
	done
}
trap cleanup EXIT

# Mounts /proc, /sys and /dev into root $1 (gpusnap reads /proc, doctor /sys).
mounts() {
	local r=$1
	mount -t proc proc "$r/proc" && mounted+=("$r/proc")
	mount -t sysfs sysfs "$r/sys" && mounted+=("$r/sys")
	mount --bind /dev "$r/dev" && mounted+=("$r/dev")
}

# Runs gpusnap (path $2) in root $1: --version, doctor, run --light.
exercise() {
	local r=$1 bin=$2 rc
	say "$bin --version"
	chroot "$r" "$bin" --version
	say "$bin doctor"
	local doc
	rc=0
	doc=$(chroot "$r" env -i PATH=/usr/local/bin:/usr/bin:/bin "$bin" doctor) || rc=$?
	printf '%s\n' "$doc"
	echo "exit code: $rc"
	((rc == 0)) || die "doctor exited $rc (it exits 0 whenever it could look at the host)"
	grep -q '^ERROR driver .*libcuda' <<<"$doc" || die "doctor did not report the driver missing"
	say "$bin run --light (finds the preload library, which loads into the program)"
	rc=0
	# shellcheck disable=SC2016 # $$ and $l are the program's, in its shell
	chroot "$r" env -i PATH=/usr/local/bin:/usr/bin:/bin "$bin" run --light -- \
		sh -c 'l=$(grep -m 1 libgpusnap_preload.so /proc/$$/maps) && echo "in the program: ${l##* }"' || rc=$?
	echo "exit code: $rc"
	((rc == 0)) || die "run --light exited $rc"
}

say "Debian 12 (bookworm): the .deb"
r=$(fresh_root bookworm)
roots+=("$r")
mounts "$r"
chroot "$r" sh -c '. /etc/os-release; echo "$PRETTY_NAME, $(ldd --version | head -n 1)"'
cp -- "$deb" "$r/tmp/"
chroot "$r" dpkg -i "/tmp/$(basename "$deb")"
chroot "$r" dpkg -L gpusnap | grep -v '/$' | sort | while read -r f; do
	[[ -d $r$f ]] || printf '%8s %s\n' "$(stat -c %s "$r$f")" "$f"
done
for f in /usr/bin/gpusnap /usr/lib/gpusnap/libgpusnap_preload.so /lib/systemd/system/gpusnap-agent.service; do
	[[ -e $r$f ]] || die "the .deb installed no $f"
done
grep -q '^ExecStart=/usr/bin/gpusnap ' "$r/lib/systemd/system/gpusnap-agent.service" ||
	die "the unit does not start /usr/bin/gpusnap"
chroot "$r" getent group gpusnap >/dev/null || die "the .deb created no group gpusnap"
exercise "$r" /usr/bin/gpusnap
say "dpkg --purge gpusnap"
chroot "$r" dpkg --purge gpusnap
for f in /usr/bin/gpusnap /usr/lib/gpusnap /lib/systemd/system/gpusnap-agent.service /usr/share/doc/gpusnap; do
	[[ ! -e $r$f ]] || die "$f is left after purge"
done
echo "nothing of gpusnap left"

say "Debian 11 (bullseye): the tarball in /usr/local"
r=$(fresh_root bullseye)
roots+=("$r")
mounts "$r"
chroot "$r" sh -c '. /etc/os-release; echo "$PRETTY_NAME, $(ldd --version | head -n 1)"'
tar -C "$r/usr/local" --strip-components=1 -xzf "$tarball"
(cd "$r/usr/local" && find . -type f | sort | while read -r f; do printf '%8s %s\n' "$(stat -c %s "$f")" "/usr/local/${f#./}"; done)
exercise "$r" /usr/local/bin/gpusnap

say "all checks passed"
