/**
 * Facts owned by csrc/pegaflow.h (and lib/limits.ts) that another language
 * mirrors agree with their owner: read from the header's text, so a change
 * on one side without the other fails here, not in a copy that goes wrong.
 */
import assert from "node:assert/strict";
import {
  DIRECTION_CODES,
  EXPECTED_ABI_VERSION,
  HANDLE_BYTES,
  PATH_CODES,
  PF_STATUS,
} from "../../ffi/mod.ts";
import { RING_HEADER_BYTES } from "../../ffi/ring.ts";
import { DEVICE_NAME_BYTES } from "../../ffi/structs.ts";
import { IO_HDR_BYTES } from "../../ffi/uring.ts";
import { LEASE_ID_BYTES, MAX_PREFETCH_WAIT_MS, REGION_HANDLE_BYTES } from "../../lib/limits.ts";
import { LOCAL_RPC_METHODS } from "../../lib/local_rpc/wire.ts";

const ROOT = new URL("../../", import.meta.url);
const HEADER = Deno.readTextFileSync(new URL("csrc/pegaflow.h", ROOT));

/** `#define NAME 123u` in the header. */
function define(name: string): number {
  const m = new RegExp(`^#define ${name} (\\d+)u?$`, "m").exec(HEADER);
  assert.ok(m, `pegaflow.h has no #define ${name}`);
  return Number(m[1]);
}

/** `NAME = -3` / `NAME = 2` inside an enum of the header. */
function enumValue(name: string): number {
  const m = new RegExp(`\\b${name} = (-?\\d+)`).exec(HEADER);
  assert.ok(m, `pegaflow.h has no enum value ${name}`);
  return Number(m[1]);
}

Deno.test("the sizes ffi/ mirrors are the header's", () => {
  assert.equal(EXPECTED_ABI_VERSION, define("PF_ABI_VERSION"));
  assert.equal(HANDLE_BYTES, define("PF_HANDLE_BYTES"));
  assert.equal(REGION_HANDLE_BYTES, define("PF_HANDLE_BYTES"));
  assert.equal(RING_HEADER_BYTES, define("PF_RING_HEADER_BYTES"));
  assert.equal(IO_HDR_BYTES, define("PF_IO_HDR_BYTES"));
  assert.equal(DEVICE_NAME_BYTES, define("PF_DEVICE_NAME_BYTES"));
});

Deno.test("path, direction and status codes are the header's enums", () => {
  for (const [name, code] of Object.entries(PATH_CODES)) {
    assert.equal(code, enumValue(`PF_PATH_${name.toUpperCase()}`), `path ${name}`);
  }
  assert.equal(DIRECTION_CODES.d2h, enumValue("PF_D2H"));
  assert.equal(DIRECTION_CODES.h2d, enumValue("PF_H2D"));
  for (const [name, code] of Object.entries(PF_STATUS)) {
    assert.equal(code, enumValue(name), name);
  }
});

Deno.test("the Python client's lease id size is lib/limits.ts's", () => {
  const py = Deno.readTextFileSync(new URL("python/pegaflow/client.py", ROOT));
  const m = /^LEASE_ID_BYTES = (\d+)$/m.exec(py);
  assert.ok(m, "python/pegaflow/client.py defines no LEASE_ID_BYTES");
  assert.equal(Number(m[1]), LEASE_ID_BYTES);
});

Deno.test("the Python client's longest WaitPrefetch hold is lib/limits.ts's", () => {
  const py = Deno.readTextFileSync(new URL("python/pegaflow/client.py", ROOT));
  const m = /^MAX_PREFETCH_WAIT_MS = (\d+)$/m.exec(py);
  assert.ok(m, "python/pegaflow/client.py defines no MAX_PREFETCH_WAIT_MS");
  assert.equal(Number(m[1]), MAX_PREFETCH_WAIT_MS);
});

Deno.test("the Python client's local RPC method ids are lib/local_rpc/wire.ts's", () => {
  const py = Deno.readTextFileSync(new URL("python/pegaflow/local_rpc.py", ROOT));
  const m = /^METHOD_IDS: Dict\[str, int\] = \{([^}]*)\}$/m.exec(py);
  assert.ok(m, "python/pegaflow/local_rpc.py defines no METHOD_IDS");
  const ids = Object.fromEntries(
    [...m[1].matchAll(/"(\w+)": (\d+)/g)].map(([, name, id]) => [Number(id), name]),
  );
  const ts = Object.fromEntries(
    Object.entries(LOCAL_RPC_METHODS).map(([id, name]) => [
      Number(id),
      name[0].toUpperCase() + name.slice(1),
    ]),
  );
  assert.deepEqual(ids, ts);
});
