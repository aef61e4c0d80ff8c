#!/usr/bin/env bash
# Installs CRIU >= 4.2 into a private prefix: scripts/install-criu.sh [PREFIX]
#
# Debian bookworm's criu 3.17 fails on kernel 6.18 ("vdso: Unexpected rt vDSO
# area bounds"); criu 4.1 cannot dump any process holding an inet socket on
# kernels >= 6.16 ("Can't get 1:16 opt: Operation not supported", fixed in
# 4.2). Debian forky has 4.2.1, built against a newer glibc than bookworm's.
# So forky's criu and its whole dependency closure (glibc included) are
# unpacked with `dpkg -x` into PREFIX/root, and criu runs through that root's
# own dynamic loader. Nothing is installed into the system and the system's apt
# state is not touched. See docs/design/driver.md.
#
# PREFIX defaults to /opt/gpusnap/criu. Afterwards PREFIX/bin/criu is the
# command to run, and as root /usr/local/bin/criu links to it unless a good
# enough criu is already on PATH.
#
# --cuda-plugin also builds CRIU's CUDA plugin (cuda_plugin.so, which Debian
# does not package) from Debian's source package of the same criu version
# (.dsc, .orig.tar, .debian.tar from the same mirror, verified by apt against
# the signed index; Debian's patches applied) and installs it as
# PREFIX/lib/criu/cuda_plugin.so. criu loads it only when told to
# (`--libdir PREFIX/lib/criu` or CRIU_LIBS_DIR=PREFIX/lib/criu): gpusnap's
# own hibernate and wake do not want it (docs/design/driver.md). Building needs
# build-essential pkg-config protobuf-c-compiler libprotobuf-c-dev
# protobuf-compiler libprotobuf-dev libnl-3-dev libnet1-dev libcap-dev
# libbsd-dev uuid-dev python3 (bookworm has them all; about 2 minutes on 2
# cores). A plugin already built for this criu version is kept.
#
# --crun also unpacks Debian $SUITE's crun (built with CRIU support, which
# it loads at run time as libcriu.so.2) and libcriu2, with their own glibc,
# into PREFIX/crun-root, and writes PREFIX/bin/crun, the command a container
# engine names as its crun (`[engine.runtimes] crun = [...]` in podman's
# containers.conf). Debian bookworm's crun 1.8.1 is built without CRIU and
# answers that it does not support checkpoint/restore. As root,
# /usr/local/bin/crun links to it unless a crun is there already. A crun
# already installed there (`crun --version` says +CRIU) is kept.
#
# Environment:
#   CRIU_DEBIAN_MIRROR  archive URI to fetch from (default: the URI this
#                       machine's apt sources use for its own release)
#   CRIU_DEBIAN_SUITE   suite to take criu from (default: forky)
#   CRIU_MIN_VERSION    oldest criu accepted (default: 4.2)
set -euo pipefail

MIN_VERSION=${CRIU_MIN_VERSION:-4.2}
SUITE=${CRIU_DEBIAN_SUITE:-forky}
KEYRING=/usr/share/keyrings/debian-archive-keyring.gpg

log() { printf 'install-criu: %s\n' "$*" >&2; }
die() {
	log "error: $*"
	exit 1
}

CUDA_PLUGIN=0
CRUN=0
args=()
for a in "$@"; do
	case $a in
		--cuda-plugin) CUDA_PLUGIN=1 ;;
		--crun) CRUN=1 ;;
		-h | --help)
			sed -n '2,/^set -euo/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//'
			exit 0
			;;
		-*) die "unknown option $a (--cuda-plugin, --crun, --help)" ;;
		*) args+=("$a") ;;
	esac
done
((${#args[@]} <= 1)) || die "usage: $0 [--cuda-plugin] [--crun] [PREFIX]"
PREFIX=$(realpath -m -- "${args[0]:-/opt/gpusnap/criu}")
WRAPPER=$PREFIX/bin/criu
PLUGIN_DIR=$PREFIX/lib/criu
started=$SECONDS

# `criu --version` prints "Version: 4.1.1" (plus a GitID line on some builds).
criu_version() { "$1" --version 2>/dev/null | sed -n 's/^Version: *//p' | head -n 1; }

version_ge() { # A B: is version A >= B?
	[[ -n $1 && $(printf '%s\n%s\n' "$1" "$2" | sort -V | head -n 1) == "$2" ]]
}

new_enough() {
	local v
	v=$(criu_version "$1") || return 1
	version_ge "$v" "$MIN_VERSION"
}

# A good enough criu on PATH that is not our own wrapper (or a link to it).
system_criu() {
	local c
	c=$(command -v criu 2>/dev/null) || return 1
	[[ $(realpath -e -- "$c" 2>/dev/null) != "$WRAPPER" ]] || return 1
	new_enough "$c" || return 1
	printf '%s\n' "$c"
}

# As root, make `criu` on PATH mean the wrapper, unless a good enough criu
# is there already. Never overwrites a regular file.
link_into_path() {
	local link=/usr/local/bin/criu
	((EUID == 0)) || return 0
	system_criu >/dev/null && return 0
	if [[ -e $link && ! -L $link ]]; then
		log "warning: $link is a regular file; not replacing it with a link to $WRAPPER"
		return 0
	fi
	[[ -L $link && $(readlink -- "$link") == "$WRAPPER" ]] && return 0
	mkdir -p "${link%/*}"
	ln -sfn -- "$WRAPPER" "$link"
	log "linked $link -> $WRAPPER"
	local c
	c=$(command -v criu 2>/dev/null) || c=
	if [[ $c != "$link" ]] && ! new_enough "${c:-/nonexistent}"; then
		log "warning: 'criu' on PATH is ${c:-missing}, not $link; put $PREFIX/bin first on PATH"
	fi
}

finish() {
	if ((CUDA_PLUGIN)); then
		cuda_plugin
	fi
	if ((CRUN)); then
		crun_install
	fi
	link_into_path
	log "criu $(criu_version "$WRAPPER") ready at $WRAPPER ($((SECONDS - started)) s)"
	exit 0
}

# private_apt: a private apt for Debian $SUITE (its own lists and cache, an
# empty dpkg status, deb-src too with --cuda-plugin). Sets work, apt_opts,
# cand (criu's version there) and upstream. Once.
APT_READY=0
private_apt() {
	((APT_READY)) && return 0
	APT_READY=1
	for tool in apt-get apt-cache dpkg dpkg-deb; do
		command -v "$tool" >/dev/null || die "$tool not found: this script needs a Debian-based system"
	done
	arch=$(dpkg --print-architecture)
	[[ $arch == amd64 ]] || die "only amd64 is supported (this is $arch)"
	[[ -r $KEYRING ]] || die "$KEYRING missing: apt-get install debian-archive-keyring"

	# The URI this machine's apt uses for its own release (deb.debian.org, a
	# local mirror, a snapshot...). Reads one-line and deb822 sources.
	debian_mirror() {
		local codename
		# shellcheck disable=SC1091
		codename=$(. /etc/os-release && printf '%s' "${VERSION_CODENAME:-}")
		shopt -s nullglob
		local lists=(/etc/apt/sources.list /etc/apt/sources.list.d/*.list)
		local deb822=(/etc/apt/sources.list.d/*.sources)
		shopt -u nullglob
		{
			for f in "${lists[@]}"; do
				[[ -r $f ]] || continue
				# deb [opts] URI SUITE COMPONENTS...
				sed -e 's/#.*//' -e 's/\[[^]]*\]//' "$f" |
					awk '$1 == "deb" { print $2, $3 }'
			done
			for f in "${deb822[@]}"; do
				[[ -r $f ]] || continue
				awk '
					function flush() {
						if (types ~ /(^| )deb( |$)/ && tolower(enabled) != "no")
							for (i = 1; i <= ns; i++) print uri, s[i]
						types = uri = enabled = ""; ns = 0
					}
					/^#/ { next }
					/^[ \t]*$/ { flush(); next }
					{
						key = tolower($1); sub(/:$/, "", key)
						if (key == "types") { $1 = ""; types = $0 " " }
						else if (key == "uris") uri = $2
						else if (key == "enabled") enabled = $2
						else if (key == "suites") { ns = 0; for (i = 2; i <= NF; i++) s[++ns] = $i }
					}
					END { flush() }' "$f"
			done
		} | awk -v codename="$codename" '
			$1 ~ /^(https?|file):/ && $2 !~ /-(security|updates|backports)$/ && $1 !~ /security/ {
				if ($2 == codename || $2 == "stable") { print $1; found = 1; exit }
				if (first == "") first = $1
			}
			END { if (!found && first != "") print first }'
	}

	mirror=${CRIU_DEBIAN_MIRROR:-$(debian_mirror)}
	[[ -n $mirror ]] || die "found no Debian archive in /etc/apt/sources.list*; set CRIU_DEBIAN_MIRROR"
	mirror=${mirror%/}

	work=$(mktemp -d "${TMPDIR:-/tmp}/install-criu.XXXXXX")
	trap 'rm -rf -- "$work"' EXIT
	mkdir -p "$work/lists/partial" "$work/cache/archives/partial" "$work/debs"
	# deb-src: the plugin is built from criu's source package.
	local types=deb
	if ((CUDA_PLUGIN)); then types+=' deb-src'; fi
	cat >"$work/$SUITE.sources" <<-EOF
		Types: $types
		URIs: $mirror
		Suites: $SUITE
		Components: main
		Signed-By: $KEYRING
	EOF
	# apt drops privileges to _apt for downloads; let it write there.
	if ((EUID == 0)) && id _apt >/dev/null 2>&1; then
		chmod 0755 "$work"
		chown -R _apt "$work/lists" "$work/debs"
	fi

	# A private apt: only the $SUITE list, its own lists and cache, an empty
	# dpkg status (so the whole dependency closure is resolved, whatever the
	# system has installed). Proxy and similar settings from /etc/apt still apply.
	apt_opts=(
		-o "Dir::Etc::SourceList=$work/$SUITE.sources"
		-o "Dir::Etc::SourceParts=/nonexistent"
		-o "Dir::State::Lists=$work/lists"
		-o "Dir::Cache=$work/cache"
		-o "Dir::State::status=/dev/null"
		-o "APT::Architecture=amd64"
		-o "APT::Architectures::=amd64"
		-o "Acquire::IndexTargets::deb::DEP-11::DefaultEnabled=false"
		-o "Acquire::Languages=none"
	)

	log "fetching the $SUITE package index from $mirror"
	if ! out=$(apt-get "${apt_opts[@]}" -qq update 2>&1) || grep -q '^[WE]:' <<<"$out"; then
		printf '%s\n' "$out" >&2
		if grep -q NO_PUBKEY <<<"$out"; then
			die "$KEYRING lacks the keys $SUITE is signed with: apt-get update && apt-get install debian-archive-keyring"
		fi
		die "apt-get update of $SUITE from $mirror failed"
	fi

	cand=$(apt-cache "${apt_opts[@]}" policy criu | sed -n 's/^ *Candidate: *//p')
	[[ -n $cand && $cand != "(none)" ]] || die "$SUITE at $mirror has no criu package"
	upstream=${cand#*:}
	upstream=${upstream%-*}
	version_ge "$upstream" "$MIN_VERSION" || die "$SUITE has criu $cand, need >= $MIN_VERSION"
}

# cuda_plugin: PLUGIN_DIR/cuda_plugin.so for the criu at $WRAPPER, built from
# Debian $SUITE's source package of that very version (CRIU resolves a
# plugin's symbols against its own binary, so the two must match).
cuda_plugin() {
	local want dsc tool missing=() probe
	want=$(criu_version "$WRAPPER")
	if [[ -f $PLUGIN_DIR/cuda_plugin.so && $(cat "$PLUGIN_DIR/.cuda_plugin.version" 2>/dev/null) == "$want" ]]; then
		log "CUDA plugin for criu $want already at $PLUGIN_DIR/cuda_plugin.so"
		return 0
	fi
	for tool in cc make pkg-config protoc protoc-c python3 dpkg-source; do
		command -v "$tool" >/dev/null || missing+=("$tool")
	done
	((${#missing[@]} == 0)) || die "building the CUDA plugin needs ${missing[*]}: apt-get install build-essential pkg-config protobuf-c-compiler libprotobuf-c-dev protobuf-compiler libprotobuf-dev libnl-3-dev libnet1-dev libcap-dev libbsd-dev uuid-dev python3"
	private_apt
	[[ $upstream == "$want" ]] ||
		die "criu at $WRAPPER is $want, $SUITE's source package is $cand: the plugin must be built from the source of the criu that loads it"
	log "fetching the source package of criu $cand"
	mkdir -p "$work/src"
	if ((EUID == 0)) && id _apt >/dev/null 2>&1; then chown _apt "$work/src"; fi
	# Each file of the source package, checked by apt against the SHA256 the
	# signed Sources index gives for it.
	local dir files=() f sha name got=()
	dir=$(apt-cache "${apt_opts[@]}" showsrc criu |
		awk -v v="$cand" '/^Package: / { p = 0 } /^Version: / { p = ($2 == v) } p && /^Directory: / { print $2; exit }')
	mapfile -t files < <(apt-cache "${apt_opts[@]}" showsrc criu |
		awk -v v="$cand" '
			/^Package: / { p = 0 } /^Version: / { p = ($2 == v) }
			/^[^ ]/ { sect = $1 }
			p && sect == "Checksums-Sha256:" && /^ / { print $1, $3 }')
	[[ -n $dir && ${#files[@]} -gt 0 ]] || die "$SUITE's Sources index has no files for criu $cand"
	for f in "${files[@]}"; do
		sha=${f%% *} name=${f#* }
		if /usr/lib/apt/apt-helper "${apt_opts[@]}" download-file "$mirror/$dir/$name" "$work/src/$name" "SHA256:$sha" \
			>"$work/fetch.log" 2>&1; then
			got+=("$name")
		else
			log "could not fetch $mirror/$dir/$name: $(grep -m 1 -E '^(E|W):' "$work/fetch.log" || tail -n 1 "$work/fetch.log")"
		fi
	done
	dsc=$(find "$work/src" -maxdepth 1 -name 'criu_*.dsc' -print -quit)
	if [[ -n $dsc ]] && ((${#got[@]} == ${#files[@]})); then
		# Debian's patches applied, as in the binary package.
		(cd "$work/src" && dpkg-source -x "${dsc##*/}" criu >"$work/unpack.log" 2>&1) || {
			cat -- "$work/unpack.log" >&2
			die "dpkg-source -x ${dsc##*/} failed"
		}
	else
		# Debian's own changes are packaging; the plugin and the headers it
		# builds against are upstream's, which the .orig tarball holds.
		local orig
		orig=$(find "$work/src" -maxdepth 1 -name 'criu_*.orig.tar.*' -print -quit)
		[[ -n $orig ]] || die "could not fetch criu $cand's source (.orig.tar) from $mirror"
		log "warning: building from the upstream tarball alone (${orig##*/}): Debian's patches could not be fetched"
		mkdir -p "$work/src/criu"
		tar -xf "$orig" -C "$work/src/criu" --strip-components=1 || die "cannot unpack ${orig##*/}"
	fi
	log "building cuda_plugin.so (criu $cand; a few minutes)"
	if ! make -C "$work/src/criu" -j"$(nproc)" cuda_plugin >"$work/build.log" 2>&1; then
		tail -n 40 -- "$work/build.log" >&2
		die "building the CUDA plugin failed (the packages it needs are named in --help)"
	fi
	mkdir -p "$PLUGIN_DIR"
	install -m 0755 "$work/src/criu/plugins/cuda/cuda_plugin.so" "$PLUGIN_DIR/cuda_plugin.so.new"
	mv -f -- "$PLUGIN_DIR/cuda_plugin.so.new" "$PLUGIN_DIR/cuda_plugin.so"
	printf '%s\n' "$want" >"$PLUGIN_DIR/.cuda_plugin.version"
	# criu must load it: a dump of a throwaway process names the plugin in
	# its log (a dump that fails for other reasons, a sandbox without the
	# privileges, only warns).
	setsid sleep 60 </dev/null >/dev/null 2>&1 &
	probe=$!
	mkdir -p "$work/probe"
	"$WRAPPER" dump --tree "$probe" --images-dir "$work/probe" --leave-running --libdir "$PLUGIN_DIR" \
		-v4 --log-file "$work/probe/dump.log" >/dev/null 2>&1 || true
	kill "$probe" 2>/dev/null || true
	wait "$probe" 2>/dev/null || true
	if grep -q 'Plugin "cuda_plugin"' "$work/probe/dump.log" 2>/dev/null; then
		log "installed $PLUGIN_DIR/cuda_plugin.so (criu loads it with --libdir $PLUGIN_DIR or CRIU_LIBS_DIR=$PLUGIN_DIR)"
	elif grep -q 'cuda_plugin' "$work/probe/dump.log" 2>/dev/null; then
		grep 'cuda_plugin\|Error' "$work/probe/dump.log" | head -n 5 >&2
		die "criu $want does not load the plugin it was built with"
	else
		log "warning: installed $PLUGIN_DIR/cuda_plugin.so, but a probe dump could not show that criu loads it here: $(grep -m 1 Error "$work/probe/dump.log" 2>/dev/null | grep -v RLIMIT || echo 'no log')"
	fi
}

# crun_install: PREFIX/bin/crun, Debian $SUITE's crun with CRIU support and
# libcriu2, unpacked with their whole dependency closure into
# PREFIX/crun-root and run through its own loader (as criu is).
crun_install() {
	local w=$PREFIX/bin/crun croot=$PREFIX/crun-root stage loader_rel='' crun_rel='' libs='' d listing
	local -a cpkgs
	if [[ -x $w ]] && "$w" --version 2>/dev/null | grep -q '+CRIU'; then
		log "crun with CRIU support already at $w"
		crun_link
		return 0
	fi
	exec 8>"$PREFIX/.install-crun.lock"
	flock 8 2>/dev/null || true
	if [[ -x $w ]] && "$w" --version 2>/dev/null | grep -q '+CRIU'; then
		crun_link
		return 0
	fi
	private_apt
	mapfile -t cpkgs < <(apt-cache "${apt_opts[@]}" depends --recurse --important crun libcriu2 |
		grep -v -e '^ ' -e '^<' | sort -u)
	((${#cpkgs[@]} > 2)) || die "could not resolve the dependencies of crun in $SUITE"
	((${#cpkgs[@]} < 80)) || die "crun's dependency closure in $SUITE has ${#cpkgs[@]} packages; refusing"
	mkdir -p "$work/crun-debs"
	if ((EUID == 0)) && id _apt >/dev/null 2>&1; then chown _apt "$work/crun-debs"; fi
	log "downloading ${#cpkgs[@]} packages (crun, libcriu2 and what they need)"
	(cd "$work/crun-debs" && apt-get "${apt_opts[@]}" -qq download "${cpkgs[@]}" >&2) ||
		die "apt-get download of crun from $mirror failed"
	stage=$croot.new
	rm -rf -- "$stage"
	mkdir -p "$stage"
	for deb in "$work"/crun-debs/*.deb; do
		dpkg-deb -x "$deb" "$stage"
	done
	for d in usr/lib64/ld-linux-x86-64.so.2 lib64/ld-linux-x86-64.so.2 usr/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2; do
		if [[ -e $stage/$d ]]; then loader_rel=$d && break; fi
	done
	[[ -n $loader_rel ]] || die "no ld-linux-x86-64.so.2 in the unpacked libc6 (crun)"
	for d in usr/bin/crun bin/crun usr/sbin/crun; do
		if [[ -x $stage/$d ]]; then crun_rel=$d && break; fi
	done
	[[ -n $crun_rel ]] || die "no crun binary in the unpacked crun package"
	[[ -e $stage/usr/lib/x86_64-linux-gnu/libcriu.so.2 ]] || die "no libcriu.so.2 in the unpacked libcriu2"
	listing=$("$stage/$loader_rel" --inhibit-cache --library-path "$stage/usr/lib/x86_64-linux-gnu" \
		--list "$stage/$crun_rel" 2>&1) || die "the unpacked crun does not load: $listing"
	if grep -q 'not found' <<<"$listing"; then
		die "the unpacked crun misses libraries: $(grep 'not found' <<<"$listing" | tr -s ' \t\n' ' ')"
	fi
	rm -rf -- "$croot"
	mv -- "$stage" "$croot"
	libs=$croot/usr/lib/x86_64-linux-gnu
	cat >"$w.new" <<-EOF
		#!/bin/sh
		# Written by gpusnap's scripts/install-criu.sh --crun: Debian $SUITE's crun
		# (CRIU support through libcriu.so.2), run through its own glibc in $croot.
		exec $(printf '%q' "$croot/$loader_rel") --inhibit-cache --library-path $(printf '%q' "$libs") --argv0 "\$0" $(printf '%q' "$croot/$crun_rel") "\$@"
	EOF
	chmod 0755 "$w.new"
	mv -f -- "$w.new" "$w"
	"$w" --version 2>/dev/null | grep -q '+CRIU' ||
		die "$w does not report CRIU support: $("$w" --version 2>&1 | tr '\n' ' ')"
	log "installed crun $("$w" --version | sed -n 's/^crun version //p') with CRIU support at $w"
	crun_link
}

# As root, /usr/local/bin/crun links to PREFIX/bin/crun unless another
# file is there.
crun_link() {
	local link=/usr/local/bin/crun
	((EUID == 0)) || return 0
	[[ -e $link && ! -L $link ]] && return 0
	[[ -L $link && $(readlink -- "$link") == "$PREFIX/bin/crun" ]] && return 0
	[[ -L $link ]] && return 0
	ln -sfn -- "$PREFIX/bin/crun" "$link"
	log "linked $link -> $PREFIX/bin/crun"
}

# 1. Already installed.
if [[ -x $WRAPPER ]] && new_enough "$WRAPPER"; then
	finish
fi

# One install at a time; whoever waited may find the work done.
mkdir -p "$PREFIX/bin"
exec 9>"$PREFIX/.install.lock"
flock 9 2>/dev/null || true
if [[ -x $WRAPPER ]] && new_enough "$WRAPPER"; then
	finish
fi

# 2. The system has a good one: use it.
if sys=$(system_criu); then
	log "system criu $(criu_version "$sys") at $sys is new enough; linking $WRAPPER to it"
	ln -sfn -- "$sys" "$WRAPPER"
	finish
fi

# 3. Unpack Debian $SUITE's criu into PREFIX/root.
private_apt

# criu and everything it needs at run time (Depends and Pre-Depends, all
# the way down), by the names $SUITE uses (libgnutls30t64, not libgnutls30;
# libnet9, not libnet1).
mapfile -t pkgs < <(apt-cache "${apt_opts[@]}" depends --recurse --important criu |
	grep -v -e '^ ' -e '^<' | sort -u)
((${#pkgs[@]} > 1)) || die "could not resolve the dependencies of criu in $SUITE"
((${#pkgs[@]} < 80)) || die "criu's dependency closure in $SUITE has ${#pkgs[@]} packages; refusing"
log "downloading ${#pkgs[@]} packages (criu $cand and what it needs): ${pkgs[*]}"
(cd "$work/debs" && apt-get "${apt_opts[@]}" -qq download "${pkgs[@]}" >&2) ||
	die "apt-get download from $mirror failed"

stage=$PREFIX/root.new
rm -rf -- "$stage"
mkdir -p "$stage"
for deb in "$work"/debs/*.deb; do
	dpkg-deb -x "$deb" "$stage"
done

# Where Debian >= 13 puts things (merged /usr): the loader is usr/lib64's link to
# usr/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2, libraries are in
# usr/lib/x86_64-linux-gnu. Look for both layouts all the same.
loader_rel=
for cand_rel in usr/lib64/ld-linux-x86-64.so.2 lib64/ld-linux-x86-64.so.2 usr/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2; do
	if [[ -e $stage/$cand_rel ]]; then
		loader_rel=$cand_rel
		break
	fi
done
[[ -n $loader_rel ]] || die "no ld-linux-x86-64.so.2 in the unpacked libc6"
criu_rel=
for cand_rel in usr/sbin/criu sbin/criu usr/bin/criu; do
	if [[ -x $stage/$cand_rel ]]; then
		criu_rel=$cand_rel
		break
	fi
done
[[ -n $criu_rel ]] || die "no criu binary in the unpacked criu package"
lib_rels=()
for d in usr/lib/x86_64-linux-gnu lib/x86_64-linux-gnu usr/lib64 lib64; do
	if [[ -e $stage/$d/libc.so.6 || -e $stage/$d/libcompel.so.1 ]]; then
		lib_rels+=("$d")
	fi
done

lib_path() { # ROOT -> colon-separated library dirs
	local out='' d
	for d in "${lib_rels[@]}"; do out+=${out:+:}$1/$d; done
	printf '%s' "$out"
}

# Every library criu links against must come from the unpacked root, never
# from the system (whose glibc is too old).
listing=$("$stage/$loader_rel" --inhibit-cache --library-path "$(lib_path "$stage")" \
	--list "$stage/$criu_rel" 2>&1) || die "the unpacked criu does not load: $listing"
if grep -q 'not found' <<<"$listing"; then
	die "the unpacked criu misses libraries: $(grep 'not found' <<<"$listing" | tr -s ' \t\n' ' ')"
fi
outside=''
while IFS= read -r lib; do
	[[ $lib == "$stage/"* ]] || outside+=" $lib"
done < <(sed -n 's/^.* => \(\/.*\) (0x[0-9a-f]*)$/\1/p' <<<"$listing")
[[ -z $outside ]] || die "the unpacked criu would load system libraries: $outside"

# Swap in the new root, then write the wrapper against the final paths.
rm -rf -- "$PREFIX/root"
mv -- "$stage" "$PREFIX/root"
root=$PREFIX/root
cat >"$WRAPPER.new" <<EOF
#!/bin/sh
# Written by gpusnap's scripts/install-criu.sh: Debian $SUITE's criu $cand,
# run through its own glibc in $root.
exec $(printf '%q' "$root/$loader_rel") --inhibit-cache --library-path $(printf '%q' "$(lib_path "$root")") --argv0 "\$0" $(printf '%q' "$root/$criu_rel") "\$@"
EOF
chmod 0755 "$WRAPPER.new"
mv -f -- "$WRAPPER.new" "$WRAPPER"

new_enough "$WRAPPER" || die "$WRAPPER does not run: $("$WRAPPER" --version 2>&1 | head -n 3)"
log "installed criu $cand from $mirror $SUITE into $root"
finish
