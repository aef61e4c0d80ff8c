#!/usr/bin/env bash
# The test suite: scripts/test.sh [ARGS for cargo test]
#
# Builds every target of the workspace, then runs `cargo test --workspace`
# (no GPU needed: the tests run against the fake driver and NVML,
# docs/design/fakes.md). Exits non-zero when the build or any test fails, and ends
# with the summary line of every test binary.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

# The criu that scripts/install-criu.sh puts in its default prefix.
if [[ -x /opt/gpusnap/criu/bin/criu ]]; then
	PATH=/opt/gpusnap/criu/bin:$PATH
fi

cargo build --workspace --all-targets

log=$(mktemp)
trap 'rm -f -- "$log"' EXIT
set +e
cargo test --workspace --no-fail-fast "$@" 2>&1 | tee "$log"
rc=${PIPESTATUS[0]}
set -e

echo
echo "==> test summary"
awk '
	# "Running unittests src/lib.rs (target/debug/deps/gpusnap_core-0123abcd)"
	/^ *Running / {
		sub(/^ *Running /, "")
		suite = $0
		if (match($0, /\/deps\/[^)]*-[0-9a-f]+\)$/)) {
			name = substr($0, RSTART + 6, RLENGTH - 7)
			sub(/-[0-9a-f]+$/, "", name)
			suite = name " " substr($0, 1, index($0, " (") - 1)
		}
	}
	/^ *Doc-tests / { sub(/^ *Doc-tests /, ""); suite = "doc-tests " $0 }
	/^test result:/ {
		printf "%-60s %s\n", suite, $0
		for (i = 1; i <= NF; i++) {
			if ($(i) ~ /^passed;?$/) passed += $(i - 1)
			if ($(i) ~ /^failed;?$/) failed += $(i - 1)
			if ($(i) ~ /^ignored;?$/) ignored += $(i - 1)
		}
	}
	/^test .* \.\.\. FAILED$/ { bad[++nbad] = $2 }
	END {
		printf "total: %d passed, %d failed, %d skipped\n", passed, failed, ignored
		for (i = 1; i <= nbad; i++) print "FAILED: " bad[i]
	}' "$log"
if ((rc != 0)); then
	echo "cargo test failed (exit $rc)" >&2
fi
exit "$rc"
