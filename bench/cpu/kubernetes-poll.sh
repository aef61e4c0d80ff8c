#!/usr/bin/env bash
# What one look of the agent at a Kubernetes node costs: the CRI calls of a
# poll (`[kubernetes] poll_interval`), ListPodSandbox and, for each pod,
# ListContainers and a verbose ContainerStatus, against a containerd of its
# own (crates/cli/tests/kubernetes: the CRI plugin, the native snapshotter, a
# bridge network) with 1, 8 and 32 pods that sleep. ROUNDS polls each;
# prints a markdown table of medians and maxima and records it with
# bench/record.sh.
#
#   sudo bench/cpu/kubernetes-poll.sh          ROUNDS=50 sudo bench/cpu/kubernetes-poll.sh
#
# Needs root, containerd, runc and the CNI plugins (containernetworking-plugins).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
export ROUNDS=${ROUNDS:-20}
out=$(mktemp)
trap 'rm -f "$out"' EXIT
cargo test -q -p gpusnap --test kubernetes -- --ignored --exact bench_cri_poll --nocapture 2>/dev/null |
	grep '^|' >"$out"
{
	echo "The CRI calls of one poll of the agent's \`[kubernetes]\` follower, ROUNDS=$ROUNDS, containerd $(containerd --version | awk '{print $3}'), $(nproc) cores."
	echo
	cat "$out"
} | BENCH_TITLE="CRI poll cost by pods on the node" BENCH_CMD="ROUNDS=$ROUNDS bench/cpu/kubernetes-poll.sh" \
	bench/record.sh kubernetes-poll
cat "$out"
