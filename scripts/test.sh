#!/usr/bin/env bash
# The test suite, run with cargo-nextest (settings in .config/nextest.toml).
#
#   scripts/test.sh [NEXTEST ARGS]         the whole suite (no GPU needed: the
#                                           tests run against the fake driver
#                                           and NVML, docs/design/fakes.md; the image
#                                           tests drive a real CRIU); under 10
#                                           minutes on 2 cores
#   scripts/test.sh --fast [NEXTEST ARGS]  the quick loop while editing: unit
#                                           tests and the fake-driver tests
#                                           that need no CRIU; under 3 minutes
#                                           on 2 cores once built
#
# Extra arguments go to `cargo nextest run` (a test name filters, e.g.
# `scripts/test.sh -E 'binary(lifecycle)'`). It builds every target of the
# workspace once, runs the tests from that build (each test in a process of
# its own; the CRIU-heavy ones take turns), then the doc-tests where there
# are any. It never retries a failed test and fails a test that hangs. It
# prints nextest's summary, one line per test binary, and ends with
# `N passed, N failed, N skipped`; it exits non-zero when the build or any
# test fails.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

profile=default
if [[ ${1-} == --fast ]]; then
	profile=fast
	shift
fi

# The criu that scripts/install-criu.sh puts in its default prefix.
if [[ -x /opt/gpusnap/criu/bin/criu ]]; then
	PATH=/opt/gpusnap/criu/bin:$PATH
fi

if ! cargo nextest --version >/dev/null 2>&1; then
	echo "scripts/test.sh: cargo-nextest is missing (cargo install cargo-nextest --locked)" >&2
	exit 2
fi

# The tree speaks of the product only (no narrative of how it was made).
if [[ $profile != fast ]]; then
	scripts/check-narrative.sh
fi

cargo build --workspace --all-targets
# The fakes were just built with everything else: the test binaries link
# them without building them again each.
export GPUSNAP_TEST_PREBUILT=1

log=$(mktemp)
trap 'rm -f -- "$log"' EXIT
set +e
cargo nextest run --workspace --profile "$profile" "$@" 2>&1 | tee "$log"
rc=${PIPESTATUS[0]}
set -e

# Doc-tests, where a doc comment of the workspace holds a Rust example
# (nextest does not run them; rustdoc per crate is slow, so only then).
doc_rc=0
examples=$(find crates -path '*/src/*' -name '*.rs' -exec awk '
	FNR == 1 { open = 0 }
	/^[ \t]*\/\/[\/!][ \t]*```/ {
		info = $0
		sub(/^[ \t]*\/\/[\/!][ \t]*```[ \t]*/, "", info)
		if (!open && info !~ /^(text|ignore|sh|bash|console|json|toml|yaml|c)([ ,]|$)/) print FILENAME
		open = !open
	}' {} +)
if [[ $profile == default && -n $examples ]]; then
	set +e
	cargo test --workspace --doc 2>&1 | tee -a "$log"
	doc_rc=${PIPESTATUS[0]}
	set -e
fi

echo
echo "==> test summary"
awk '
	# nextest: "PASS [   1.234s] (12/250) gpusnap::images a_test_name"
	/^ *(PASS|FAIL|TIMEOUT|SIG[A-Z]+|LEAK[-A-Z]*) +\[ *[0-9.]+s\]/ {
		status = $1
		line = $0
		sub(/^.*\] +(\( *[0-9]+\/[0-9]+\) +)?/, "", line)
		# The failures are listed again at the end: each test counts once.
		if (line in seen) next
		seen[line] = 1
		split(line, f, " ")
		bin = f[1]
		if (!(bin in nrun)) order[++nbin] = bin
		nrun[bin]++
		if (status == "PASS" || status == "LEAK") npass[bin]++
		else { nfail[bin]++; badlist[++nbad] = line }
	}
	# "     Summary [ 300.123s] 250 tests run: 249 passed, 1 failed, 3 skipped"
	/^ *Summary \[/ {
		summary = $0
		for (i = 1; i <= NF; i++) {
			w = $(i); gsub(/[,:]/, "", w)
			if (w == "run" && $(i - 1) ~ /^tests?$/) run = $(i - 2)
			if (w == "passed") passed = $(i - 1)
			if (w == "skipped") skipped = $(i - 1)
		}
	}
	# cargo test --doc: "test result: ok. 3 passed; 0 failed; 1 ignored; ..."
	/^test result:/ {
		for (i = 1; i <= NF; i++) {
			if ($(i) ~ /^passed;?$/) dpassed += $(i - 1)
			if ($(i) ~ /^failed;?$/) dfailed += $(i - 1)
			if ($(i) ~ /^ignored;?$/) dskipped += $(i - 1)
		}
		printf "%-60s %s\n", "doc-tests", $0
	}
	END {
		for (i = 1; i <= nbin; i++) {
			b = order[i]
			printf "%-60s %d passed, %d failed\n", b, npass[b] + 0, nfail[b] + 0
		}
		for (i = 1; i <= nbad; i++) print "FAILED: " badlist[i]
		failed = run - passed + dfailed
		if (summary == "") failed = failed > 0 ? failed : 1
		printf "%d passed, %d failed, %d skipped\n", passed + dpassed, failed, skipped + dskipped
	}' "$log"
if ((rc != 0)); then
	echo "cargo nextest failed (exit $rc)" >&2
	exit "$rc"
fi
if ((doc_rc != 0)); then
	echo "cargo test --doc failed (exit $doc_rc)" >&2
	exit "$doc_rc"
fi
