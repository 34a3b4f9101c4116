/**
 * Test helper process: destroys the completion ring from inside a
 * completions$ subscriber (the BATCH record of its only batch), while the
 * ring's reader is still walking the records of that wake. Prints what
 * destroy() did; a reader left on unmapped ring memory kills the process.
 */
import { COMPLETION_KIND, CompletionRing, CopyBatch, Engine, loadLibrary } from "../../ffi/mod.ts";

const engine = Engine.open({ backend: "host", workers: 1 });
const pool = engine.createPool(1 << 20);
const region = engine.allocRegion(1 << 16);
const ring = new CompletionRing(64);
let outcome = "";
const seen = new Promise<void>((resolve) => {
  ring.completions$.subscribe((c) => {
    if (c.kind !== COMPLETION_KIND.BATCH) return;
    try {
      ring.destroy();
      outcome = "destroyed";
    } catch (e) {
      outcome = `refused: ${(e as Error).message}`;
    }
    resolve();
  });
});
const b = new CopyBatch(4, 4).reset("d2h");
for (let g = 0; g < 4; g++) b.group(region, g).seg(g * 1024, g * 1024, 1024);
const desc = b.finish();
const rc = loadLibrary().pf_copy_submit(
  engine.handle,
  pool.handle,
  ring.handle,
  desc,
  BigInt(desc.length),
  1n,
);
if (rc !== 0) throw new Error(`pf_copy_submit: ${rc}`);
await seen;
// Let the reader finish that wake (and start its next wait, if any).
await new Promise((r) => setTimeout(r, 50));
console.log(outcome);
if (outcome !== "destroyed") {
  await ring.shutdown();
  ring.destroy();
}
region.close();
pool.close();
engine.close();
console.log("exited cleanly");
