#!/usr/bin/env bash
# Release artifacts that install without a Rust toolchain:
#   scripts/package.sh [--out DIR] [--deb] [--native]
#
# Builds `gpusnap` and its preload library (`run --light` loads it) in release
# mode for x86-64 Linux with glibc 2.31 or newer (Debian 11, Ubuntu 20.04 and
# later), checks with objdump that no symbol needs a newer glibc, and writes
# into DIR (default target/package/out):
#   gpusnap-VERSION-x86_64-linux-gnu.tar.gz         a tree to unpack into /usr/local
#   gpusnap-VERSION-x86_64-linux-gnu.tar.gz.sha256
# and with --deb also
#   gpusnap_VERSION-1_amd64.deb, gpusnap_VERSION-1_amd64.deb.sha256
#
# The tarball holds bin/gpusnap, lib/gpusnap/libgpusnap_preload.so (the
# binary finds it in ../lib/gpusnap/), share/man/man1/*.1, the bash, zsh and
# fish completions, lib/systemd/system/gpusnap-agent.service (from dist/,
# starting /usr/local/bin/gpusnap), share/gpusnap/install-criu.sh and
# share/doc/gpusnap/ (README, the guides,
# LICENSE where the workspace has one). Man pages and completions come from
# the built binary (`gpusnap man --dir DIR`, `gpusnap completions SHELL`): a
# binary without those commands gets a warning and a package without them.
#
# The old glibc comes from cargo-zigbuild, which links against zig's copy of
# glibc 2.31 instead of the build host's (target x86_64-unknown-linux-gnu.2.31):
#   cargo install --locked cargo-zigbuild && pip install ziglang
# --deb needs cargo-deb (`cargo install --locked cargo-deb`); the .deb takes its
# description from crates/cli/Cargo.toml ([package.metadata.deb]) and installs
# /usr/bin/gpusnap, /usr/lib/gpusnap/libgpusnap_preload.so and the unit with
# /usr/bin in its ExecStart.
# --native builds with the host's own toolchain instead of zig: the result
# needs the host's glibc or newer, and the script says which.
#
# Environment: CARGO_TARGET_DIR (default target/).
#
# Exit codes: 0 done, 1 failed (the error says what), 2 bad usage.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"

SCRIPT_NAME=package
# shellcheck source=scripts/package-lib.sh
. scripts/package-lib.sh

MAX_GLIBC=2.31
TRIPLE=x86_64-unknown-linux-gnu
out=
deb=0
native=0
while (($#)); do
	case $1 in
		--out)
			(($# >= 2)) || usage "--out needs a directory"
			out=$2
			shift
			;;
		--out=*) out=${1#--out=} ;;
		--deb) deb=1 ;;
		--native) native=1 ;;
		-h | --help)
			print_help
			exit 0
			;;
		*) usage "unknown argument $1 (--out DIR, --deb, --native, --help)" ;;
	esac
	shift
done

[[ $(uname -m) == x86_64 ]] || die "builds x86_64 packages on an x86_64 host only (this is $(uname -m))"
command -v objdump >/dev/null || die "objdump not found (apt-get install binutils)"
target_dir=${CARGO_TARGET_DIR:-$root/target}
out=$(realpath -m -- "${out:-$target_dir/package/out}")

# --- build -------------------------------------------------------------------
if ((native)); then
	log "building with the host toolchain (--native)"
	cargo build --release --locked --target "$TRIPLE" -p gpusnap -p gpusnap-preload
else
	cargo zigbuild --help >/dev/null 2>&1 ||
		die "cargo-zigbuild not found: cargo install --locked cargo-zigbuild (or --native to build against this host's glibc)"
	if ! command -v zig >/dev/null && ! python3 -c 'import ziglang' 2>/dev/null; then
		die "zig not found: pip install ziglang (or --native)"
	fi
	log "building for $TRIPLE with glibc $MAX_GLIBC (cargo zigbuild)"
	cargo zigbuild --release --locked --target "$TRIPLE.$MAX_GLIBC" -p gpusnap -p gpusnap-preload
fi
rel=$target_dir/$TRIPLE/release
bin=$rel/gpusnap
lib=$rel/libgpusnap_preload.so
[[ -x $bin && -f $lib ]] || die "the build left no $bin or $lib"

# --- glibc check -------------------------------------------------------------
# The newest GLIBC_x.y any dynamic symbol of FILE asks for.
newest_glibc() {
	objdump -T "$1" | grep -o 'GLIBC_[0-9][0-9.]*' | sed 's/GLIBC_//' | sort -uV | tail -n 1
}
for f in "$bin" "$lib"; do
	need=$(newest_glibc "$f")
	if ((native)); then
		log "$(basename "$f") needs glibc $need or newer"
	elif [[ $(printf '%s\n%s\n' "$need" "$MAX_GLIBC" | sort -V | tail -n 1) != "$MAX_GLIBC" ]]; then
		objdump -T "$f" | grep -F "GLIBC_$need" >&2 || true
		die "$(basename "$f") needs glibc $need, newer than $MAX_GLIBC (symbols above)"
	else
		log "$(basename "$f") needs glibc $need (at most $MAX_GLIBC)"
	fi
done

version=$("$bin" --version | awk '{print $2}')
[[ $version =~ ^[0-9]+\.[0-9]+\.[0-9]+ ]] || die "cannot read the version from \`$bin --version\`"
name=gpusnap-$version-x86_64-linux-gnu

# --- man pages and completions ----------------------------------------------
# Generated once into $gen; the tarball and the .deb take them from there.
gen=$target_dir/package/generated
rm -rf -- "$gen"
mkdir -p -- "$gen/man1" "$gen/completions"
if "$bin" man --help >/dev/null 2>&1; then
	"$bin" man --dir "$gen/man1"
	compgen -G "$gen/man1/*.1" >/dev/null || die "\`gpusnap man --dir\` wrote no man page"
else
	log "warning: this gpusnap has no \`man\` command: no man pages in the packages"
fi
if "$bin" completions --help >/dev/null 2>&1; then
	"$bin" completions bash >"$gen/completions/gpusnap"
	"$bin" completions zsh >"$gen/completions/_gpusnap"
	"$bin" completions fish >"$gen/completions/gpusnap.fish"
else
	log "warning: this gpusnap has no \`completions\` command: no shell completions in the packages"
fi

# Stages the installed tree under $1 with $2 as the directory the binary is in.
stage() {
	local dest=$1 bindir=$2
	install -D -m 0755 "$bin" "$dest/bin/gpusnap"
	install -D -m 0644 "$lib" "$dest/lib/gpusnap/libgpusnap_preload.so"
	# Keep the symbol table (panics name their functions), drop line tables.
	strip --strip-debug "$dest/bin/gpusnap" "$dest/lib/gpusnap/libgpusnap_preload.so"
	local m
	for m in "$gen"/man1/*.1; do
		[[ -e $m ]] || continue
		install -D -m 0644 "$m" "$dest/share/man/man1/$(basename "$m")"
	done
	local c=$gen/completions
	[[ ! -s $c/gpusnap ]] || install -D -m 0644 "$c/gpusnap" "$dest/share/bash-completion/completions/gpusnap"
	[[ ! -s $c/_gpusnap ]] || install -D -m 0644 "$c/_gpusnap" "$dest/share/zsh/site-functions/_gpusnap"
	[[ ! -s $c/gpusnap.fish ]] || install -D -m 0644 "$c/gpusnap.fish" "$dest/share/fish/vendor_completions.d/gpusnap.fish"
	mkdir -p "$dest/lib/systemd/system"
	sed -e "s|/usr/local/bin/gpusnap|$bindir/gpusnap|g" \
		-e "s|/usr/share/doc/gpusnap|${bindir%/bin}/share/doc/gpusnap|g" \
		dist/gpusnap-agent.service >"$dest/lib/systemd/system/gpusnap-agent.service"
	chmod 0644 "$dest/lib/systemd/system/gpusnap-agent.service"
	# CRIU 4.2 (for hibernate and wake) is in no Debian stable release yet.
	install -D -m 0755 scripts/install-criu.sh "$dest/share/gpusnap/install-criu.sh"
	install -D -m 0644 README.md "$dest/share/doc/gpusnap/README.md"
	local d
	while IFS= read -r d; do
		install -D -m 0644 "$d" "$dest/share/doc/gpusnap/${d#docs/}"
	done < <(find docs -name '*.md' | sort)
	[[ ! -f LICENSE ]] || install -D -m 0644 LICENSE "$dest/share/doc/gpusnap/LICENSE"
}

mkdir -p -- "$out"
work=$target_dir/package/stage
rm -rf -- "$work"
mkdir -p -- "$work"

# --- tarball -----------------------------------------------------------------
# The tree is a prefix: README and LICENSE are in share/doc/gpusnap/, so that
# `tar -C /usr/local --strip-components=1 -xzf` leaves nothing beside it.
stage "$work/$name" /usr/local/bin
tarball=$out/$name.tar.gz
# Owned by root, files in a stable order, dated by the last commit: the same
# tree gives the same tarball.
mtime=$(git log -1 --format=%ct 2>/dev/null || date +%s)
tar --sort=name --owner=0 --group=0 --numeric-owner --mtime="@$mtime" \
	-C "$work" -cf - "$name" | gzip -9n >"$tarball"
(cd "$out" && sha256sum "$name.tar.gz" >"$name.tar.gz.sha256")
log "wrote $tarball ($(du -h "$tarball" | cut -f1))"

# --- .deb --------------------------------------------------------------------
if ((deb)); then
	cargo deb --version >/dev/null 2>&1 || die "cargo-deb not found: cargo install --locked cargo-deb"
	# crates/cli/Cargo.toml's assets name this tree (target/release/ there
	# means the target's release directory to cargo-deb).
	stage "$rel/deb" /usr/bin
	# The .deb takes the binaries as the tarball has them (line tables
	# stripped here: --no-strip below), install-criu.sh with its own mode,
	# and everything under share/ as it lies, where zsh reads the
	# completions of packages from vendor-completions.
	mv -- "$rel/deb/share/gpusnap/install-criu.sh" "$rel/deb/install-criu.sh"
	rmdir -- "$rel/deb/share/gpusnap"
	if [[ -d $rel/deb/share/zsh/site-functions ]]; then
		mv -- "$rel/deb/share/zsh/site-functions" "$rel/deb/share/zsh/vendor-completions"
	fi
	debs=$(mktemp -d)
	trap 'rm -rf -- "$debs"' EXIT
	cargo deb --no-build --no-strip --target "$TRIPLE" -p gpusnap --output "$debs"
	for d in "$debs"/*.deb; do
		mv -- "$d" "$out/"
		(cd "$out" && sha256sum "$(basename "$d")" >"$(basename "$d").sha256")
		log "wrote $out/$(basename "$d") ($(du -h "$out/$(basename "$d")" | cut -f1))"
	done
fi
