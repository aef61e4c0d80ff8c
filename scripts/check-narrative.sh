#!/usr/bin/env bash
# Fails when the tree tells how its work was organised instead of what
# gpusnap does: sessions of work, engineers, rounds, sprints, issue numbers,
# plan labels (P1..P15), "Run 84" outside bench/results, "we tried",
# "yesterday" / "today" as history. Each hit is printed as FILE:LINE: TEXT;
# exit 1 when there is any, 0 when none, 2 on bad usage.
#
#   scripts/check-narrative.sh              every file git tracks or would
#   scripts/check-narrative.sh docs tests   only those paths
#
# Legitimate uses (the kernel's session leader, setsid, ...) are in
# scripts/narrative-allow.txt: one Perl regular expression a line, whose
# matches are blanked out of a line before it is checked; a line
# "PATH-REGEX<TAB>REGEX" applies only to the files whose path matches
# PATH-REGEX. In bench/results/ (the dated run data) "Run N" and commit ids
# are the data itself and are not checked.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
allow=scripts/narrative-allow.txt
[ -f "$allow" ] || {
    echo "check-narrative: $allow is missing" >&2
    exit 2
}
for p in "$@"; do
    [ -e "$p" ] || {
        echo "check-narrative: no such path: $p" >&2
        exit 2
    }
done

# The files: tracked and untracked-but-not-ignored, text only; this script
# and its allow-list name the words they look for.
git ls-files -z --cached --others --exclude-standard -- "$@" |
    grep -zv -e '^scripts/check-narrative\.sh$' -e '^scripts/narrative-allow\.txt$' -e '^Cargo\.lock$' |
    ALLOW=$allow xargs -0 -r perl -e '
use strict;
use warnings;
my (@global, @scoped);
open(my $a, "<", $ENV{ALLOW}) or die "check-narrative: $ENV{ALLOW}: $!\n";
while (my $l = <$a>) {
    chomp $l;
    next if $l =~ /^\s*(#|$)/;
    if ($l =~ /^([^\t]+)\t+(.+)$/) { push @scoped, [qr/$1/, qr/$2/i]; }
    else { push @global, qr/$l/i; }
}
close $a;
# What narrates the work. Case-insensitive unless marked (?-i).
my @bad = (
    qr/\bsessions?\b/i,
    qr/\bengineers?\b/i,
    qr/(?-i:\bCEO\b)/,
    qr/\brounds? of work\b|\b(this|next|last|previous|earlier|later|first|second|third) round\b|\bround \d+\b/i,
    qr/\bsprints?\b/i,
    qr/\b(this|that|the) (issue|ticket)\b|\bissues? #?\d+|\btickets? #?\d+|(?<![\w&\x27"\$])#\d{1,5}\b/i,
    qr/(?-i:\bP(?:[1-9]|1[0-5])\b)/,
    qr/\bPR ?#?\d+|\bpull request\b/i,
    qr/\bwe (tried|decided|did|found|changed|fixed|moved|chose)\b/i,
    qr/\byesterday\b|\btoday\b|\blast (week|night)\b/i,
    qr/\b(item|point) \d+\b/i,
    qr/\bwho did\b/i,
);
my $run = qr/(?-i:\bRuns? \d+\b)/;
my $hits = 0;
for my $f (@ARGV) {
    next unless -f $f && -T $f;
    my $results = $f =~ m{^bench/results/};
    my @allow = (@global, map { $_->[1] } grep { $f =~ $_->[0] } @scoped);
    open(my $h, "<", $f) or next;
    while (my $line = <$h>) {
        chomp $line;
        my $t = $line;
        $t =~ s/$_/ /g for @allow;
        # Commit ids (7-40 hex digits) are data, not issue numbers.
        $t =~ s/\b[0-9a-f]{7,40}\b/ /g;
        my $hit = grep { $t =~ $_ } @bad;
        $hit ||= !$results && $t =~ $run;
        if ($hit) {
            print "$f:$.: $line\n";
            $hits++;
        }
    }
    close $h;
}
exit($hits ? 1 : 0);
' || {
    rc=$?
    # xargs reports a child's exit 1 as 123.
    if [ "$rc" = 123 ] || [ "$rc" = 1 ]; then exit 1; fi
    exit "$rc"
}
