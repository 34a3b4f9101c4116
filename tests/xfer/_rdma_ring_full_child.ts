/**
 * Test child (_rdma_fake_cases.ts): an RDMA submit that cannot post a part
 * while its completion ring is full and the JS thread, the ring's only
 * consumer, is inside the submit. `deno run -A _rdma_ring_full_child.ts
 * MODE`, MODE `first` (the first part's post fails) or `second` (the second
 * part's post fails after the poller handled the first part's completion).
 * Prints one JSON line, {refused: message, code} or {accepted: true}, then
 * cleans up and exits 0. A submit that waits for ring room never prints:
 * the parent kills it.
 */
import { NativeError } from "../../ffi/mod.ts";
import { XferBatch } from "../../ffi/xfer.ts";
import { rdmaPair } from "./_fake_verbs.ts";

const RING = 16;
const mode = Deno.args[0];
if (mode !== "first" && mode !== "second") throw new Error(`mode "${mode}": first or second`);
const pair = await rdmaPair({ streams: 2, stripeBytes: 4096, ringA: RING });
// From here to the submit the JS thread never yields: nothing drains the ring.
const one = new XferBatch(1).reset("read", 5000).seg(0, 0, 4096);
const filled = Array.from({ length: RING }, () => pair.peerA.submit(one));
while (pair.epA.info().ok < RING) { /* the poller posts their records */ }
pair.fake.fake_fail_post(mode === "first" ? 0 : 1, mode === "first" ? 0 : 1);
const two = new XferBatch(2).reset("read", 5000).seg(0, 0, 4096).seg(8192, 8192, 4096);
let line: Record<string, unknown>;
try {
  pair.peerA.submit(two);
  line = { accepted: true };
} catch (e) {
  line = e instanceof NativeError ? { refused: e.message, code: e.codeName } : { error: String(e) };
}
console.log(JSON.stringify(line));
await Promise.all(filled);
await pair.close();
