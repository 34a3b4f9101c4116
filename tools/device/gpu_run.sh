#!/usr/bin/env bash
# GPU runs on a machine that has CUDA but no Deno, no liburing and no network
# (the device machine). Carried beside the tree, in .carry/ (ignored by git):
#   deno.xz          xz -T2 -6 -c tools/deno/node_modules/deno/deno
#   deno_npm.tar.xz  tar -C .cache -cJf .carry/deno_npm.tar.xz deno/npm
# and build/ (libpegaflow.so built where nvcc is: `make native`); for `peer`, also
#   redis/           redis-server and the libraries it needs that the machine lacks
#                    (libjemalloc.so.2, liblzf.so.1, libatomic.so.1, from Debian's redis-server)
#   ip/              Debian's /bin/ip and its libraries (libbpf, libelf, libmnl, libbsd, libcap,
#                    libmd, libz): the machine has no iproute2, and with it the nodes run in
#                    network namespaces joined by veth, as the benchmark means, not on loopback
#
# Usage: tools/device/gpu_run.sh STEP...   (each step's output goes to $OUT/STEP.log)
#   suite        deno task test:gpu (the GPU test suite)
#   pytest-gpu   python/tests that need a GPU (CUDA IPC, the engine's flash paths, CUDA graphs)
#   server       bench/server.ts --backend cuda (warm load, save ratio, query)
#   native       bench/run.ts --backend cuda --only size,submit (copy paths)
#   ttft         bench/ttft.py (cold/warm TTFT, Llama-3.1-8B shape); TTFT_ARGS adds flags
#   peer         bench/peer_fetch.ts (peer fetch over TCP vs raw TCP; the machine's cores)
#   variants     bench/decode_variants.py (decode at 0 % hits: off, on, without the save gate, a
#                late-save probe; VARIANTS_ARGS adds flags)
#   control      bench/query_load_latency.py (a warm request's control plane before its copy,
#                host backend; CONTROL_ARGS adds flags)
#   router       bench/router_overhead.ts (the P/D router's added latency; no GPU, the machine's
#                cores; ROUTER_ARGS replaces the default --requests 8192 --workers 4)
# Results this run writes under bench/results/ are copied to $OUT too.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/pegaflow-out}
mkdir -p "$OUT"
# Only results this run writes come back (the tool returns at most 8 files).
stamp=/tmp/pf-gpu-run.stamp
touch "$stamp"
. tools/device/_carry_env.sh
DENO="$PEGAFLOW_DENO"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"

rc=0
for step in "$@"; do
  echo "=== $step ($(date +%T))"
  case "$step" in
    suite) $DENO test --allow-all --cached-only tests/gpu/ ;;
    pytest-gpu) (cd python && python3 -m pytest -q -p no:cacheprovider tests/test_cuda_ipc_gpu.py tests/test_minivllm_gpu.py tests/test_minivllm_graphs_gpu.py tests/test_gpu_wait_gpu.py) ;;
    server) $DENO run --allow-all --cached-only bench/server.ts --backend cuda --tokens 10000 --iters 20 ;;
    native) $DENO run --allow-all --cached-only bench/run.ts --backend cuda --only size,submit ;;
    ttft) python3 bench/ttft.py ${TTFT_ARGS:-} ;;
    variants) python3 bench/decode_variants.py ${VARIANTS_ARGS:-} ;;
    control) python3 bench/query_load_latency.py ${CONTROL_ARGS:-} ;;
    router) $DENO run --allow-all --cached-only --unstable-no-legacy-abort --unstable-net \
      bench/router_overhead.ts ${ROUTER_ARGS:---requests 8192 --workers 4} ;;
    peer) ipdir=/tmp/pf-ip
      if [ -x .carry/ip/ip ]; then # `ip` on the PATH; its libraries for it alone, not its children
        mkdir -p $ipdir && printf '#!/bin/sh\nexec /lib64/ld-linux-x86-64.so.2 --library-path %s %s "$@"\n' \
          "$PWD/.carry/ip" "$PWD/.carry/ip/ip" >$ipdir/ip && chmod +x $ipdir/ip
      fi
      PATH="$ipdir:$PATH" PEGAFLOW_REDIS_SERVER="$PWD/.carry/redis/redis-server" \
      LD_LIBRARY_PATH="$PWD/.carry/redis:$LD_LIBRARY_PATH" \
      $DENO run --allow-all --cached-only bench/peer_fetch.ts ;;
    *) echo "unknown step $step"; false ;;
  esac 2>&1 | sed 's/\x1b\[[0-9;]*m//g' | tee "$OUT/$step.log"
  s=${PIPESTATUS[0]}
  echo "=== $step exit $s"
  [ "$s" -eq 0 ] || rc=1
done
for f in bench/results/ttft-cuda*.json bench/results/ttft-cuda*.png bench/results/server-cuda*.json \
  bench/results/peer_fetch.json bench/results/query-load-latency*.json bench/results/router*.json \
  bench/results/decode-variants*.json; do
  [ -f "$f" ] && [ "$f" -nt "$stamp" ] && cp "$f" "$OUT/"
done
exit $rc
