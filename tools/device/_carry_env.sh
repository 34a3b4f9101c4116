# Sourced by the device scripts (gpu_run.sh, decode_ab.sh), from the repository root: unpacks the
# carried Deno binary and npm cache (.carry/deno.xz, .carry/deno_npm.tar.xz) into /tmp/pf-deno and
# exports what the benchmarks and tests need to run Deno there (cached only) and to find libcuda.
mkdir -p /tmp/pf-deno/dir
xz -T0 -dc .carry/deno.xz >/tmp/pf-deno/deno && chmod +x /tmp/pf-deno/deno
tar -C /tmp/pf-deno/dir -xJf .carry/deno_npm.tar.xz --strip-components=1
export PEGAFLOW_DENO=/tmp/pf-deno/deno DENO_DIR=/tmp/pf-deno/dir PEGAFLOW_DENO_CACHED_ONLY=1
export LD_LIBRARY_PATH=/usr/local/nvidia/lib64:${LD_LIBRARY_PATH:-} PYTHONUNBUFFERED=1
