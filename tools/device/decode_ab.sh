#!/usr/bin/env bash
# Decode at 0 % hits, one host, two trees alternated: a base tree (an earlier commit) and this one,
# so that the server's CPU per decode step (by thread) and the on/off ratio of a change are compared
# on the same machine instead of across hosts (whose spread is as large as most changes).
# Carried beside the tree, in .carry/ (ignored by git), besides what gpu_run.sh needs:
#   base.tar.xz   git archive BASE | xz -T2 -6 > .carry/base.tar.xz
#   base_build/   libpegaflow.so and pf_kernel.fatbin built from BASE (`make native` in a worktree)
# Usage: tools/device/decode_ab.sh   (ROUNDS, default 2; REPEATS, the bench's --decode-repeats, 6)
# Writes $OUT/dec-{base,new}-ROUND.json: bench/ttft.py's JSON (decode.on.server_cpu_ms_per_step*,
# targets."decode with PegaFlow on ...").
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/pegaflow-out}
mkdir -p "$OUT" /tmp/pf-base
tar -C /tmp/pf-base -xJf .carry/base.tar.xz
ln -sfn "$PWD/.carry" /tmp/pf-base/.carry
ln -sfn "$PWD/.carry/base_build" /tmp/pf-base/build
. tools/device/_carry_env.sh
args="--tokens 4096 --runs 3 --warmup 1 --skip-transformers --decode-repeats ${REPEATS:-6}"
rc=0
for r in $(seq 1 "${ROUNDS:-2}"); do
  for v in base new; do
    tree=/tmp/pf-base
    [ "$v" = new ] && tree=$PWD
    echo "=== $v round $r ($(date +%T))"
    # shellcheck disable=SC2086
    (cd "$tree" && python3 bench/ttft.py $args --out "$OUT/dec-$v-$r.json") 2>&1 |
      grep -E "decode|server CPU" | sed 's/\x1b\[[0-9;]*m//g'
    [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
  done
done
exit $rc
