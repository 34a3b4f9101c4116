/**
 * Test helper process: leaves several ring waits pending, shuts the ring
 * down, and must then exit on its own (no hang on a blocked FFI call).
 */
import { CompletionRing, loadLibrary } from "../../ffi/mod.ts";

const pf = loadLibrary();
const ring = new CompletionRing(16);
const sub = ring.completions$.subscribe();
const raw = [pf.pf_ring_wait(ring.handle, 0n, -1), pf.pf_ring_wait(ring.handle, 0n, -1)];
await new Promise((r) => setTimeout(r, 50));
console.log("waiting");
await ring.shutdown();
await Promise.all(raw);
sub.unsubscribe();
ring.destroy();
console.log("shut down");
