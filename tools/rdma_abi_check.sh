#!/usr/bin/env bash
# Checks csrc/pf_verbs.h's hand-written ibverbs declarations against
# rdma-core's <infiniband/verbs.h> at compile time (tools/rdma_abi_check.c).
# Headers: $IBV_INCLUDE (a directory holding infiniband/verbs.h), else
# /usr/include if libibverbs-dev is installed, else Debian's libibverbs-dev
# is fetched with `apt-get download` into a temporary directory (nothing is
# installed). Exit 0 = every size, offset and enum value matches.
set -euo pipefail
cd "$(dirname "$0")/.."
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
inc=${IBV_INCLUDE:-}
if [ -z "$inc" ]; then
  if [ -f /usr/include/infiniband/verbs.h ]; then
    inc=/usr/include
  else
    (cd "$tmp" && apt-get download -q libibverbs-dev >/dev/null 2>&1 && dpkg -x libibverbs-dev_*.deb x)
    inc=$tmp/x/usr/include
  fi
fi
sed -E 's/\bibv_/my_ibv_/g; s/\bIBV_/MY_IBV_/g' csrc/pf_verbs.h >"$tmp/my_verbs.h"
gcc -std=gnu11 -I"$inc" -DMY_VERBS="\"$tmp/my_verbs.h\"" -fsyntax-only tools/rdma_abi_check.c
echo "ok: pf_verbs.h's ibverbs declarations match $(ls "$tmp"/libibverbs-dev_*.deb 2>/dev/null | xargs -r -n1 basename || echo "$inc/infiniband/verbs.h")"
