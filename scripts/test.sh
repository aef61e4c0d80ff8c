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
# prints nextest's summary, one line per test binary, the tests that could
# not run on this machine (a missing tool, no root, no systemd: each says
# why, crates/testkit), and ends with `N passed, N failed, N skipped`, where
# a skipped test is never counted as passed; it exits non-zero when the
# build or any test fails. Under CI=true a test that skips fails unless
# .config/ci-skips.txt names it with the reason CI cannot run it.
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
# Each test that cannot run on this machine records its name and reason
# here (crates/testkit): the summary counts it as skipped, not passed.
skips=$(mktemp -d)
export GPUSNAP_TEST_SKIPS=$skips
trap 'rm -f -- "$log"; rm -rf -- "$skips"' EXIT
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
skipped_list=$(mktemp)
cat "$skips"/* >"$skipped_list" 2>/dev/null || true
awk -v skipfile="$skipped_list" '
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
		if (status == "PASS" || status == "LEAK") { npass[bin]++; ok[line] = 1 }
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
		# Tests that returned early because this machine lacks what they
		# need: "BINARY_ID TEST_NAME<TAB>why", one a line.
		nskip = 0
		while ((getline rec < skipfile) > 0) {
			split(rec, r, "\t")
			# A skip that failed (CI=true, not allowed) counts as failed.
			if (!(r[1] in ok) || (r[1] in skipseen)) continue
			skipseen[r[1]] = 1
			split(r[1], f, " ")
			nskipbin[f[1]]++
			skiplist[++nskip] = r[1] ": " r[2]
		}
		for (i = 1; i <= nbin; i++) {
			b = order[i]
			printf "%-60s %d passed, %d failed, %d skipped\n", b, npass[b] - nskipbin[b], nfail[b] + 0, nskipbin[b] + 0
		}
		for (i = 1; i <= nbad; i++) print "FAILED: " badlist[i]
		for (i = 1; i <= nskip; i++) print "skipped: " skiplist[i]
		if (skipped + dskipped > 0) printf "(%d more not run: ignored or filtered out)\n", skipped + dskipped
		failed = run - passed + dfailed
		if (summary == "") failed = failed > 0 ? failed : 1
		printf "%d passed, %d failed, %d skipped\n", passed + dpassed - nskip, failed, nskip + skipped + dskipped
	}' "$log"
rm -f -- "$skipped_list"
if ((rc != 0)); then
	echo "cargo nextest failed (exit $rc)" >&2
	exit "$rc"
fi
if ((doc_rc != 0)); then
	echo "cargo test --doc failed (exit $doc_rc)" >&2
	exit "$doc_rc"
fi
