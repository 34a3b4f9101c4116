/**
 * A separate process for the drop restart test: opens the tier on a directory, writes N blocks
 * (content derived from the key), drops the ones named, waits for the drop to end, and exits
 * without closing the tier (as a crash would: no final sync, the kernel drops the lock).
 * Usage: deno run -A tests/ssd/_dropper.ts <dir> <count> <blockBytes> <index,index,...>
 */
import { harness } from "./_harness.ts";

const [dir, count, blockBytes] = [Deno.args[0], Number(Deno.args[1]), Number(Deno.args[2])];
const drop = Deno.args[3].split(",").map((i) => `ns-drop-crash/${i}`);
const h = await harness(64 << 20);
const tier = await h.openTier({ paths: [dir], capacityBytes: 64 << 20, segmentBytes: 4 << 20 });
const blocks = Array.from({ length: count }, (_, i) => {
  const key = `ns-drop-crash/${i}`;
  h.fill(key, i * blockBytes, blockBytes);
  return h.block(key, i * blockBytes, blockBytes);
});
h.write(tier, blocks);
await tier.flushWrites();
const dropped = tier.drop(drop);
await tier.flushWrites();
const s = tier.stats();
console.log(JSON.stringify({ written: s.writeBlocks, dropped, pads: s.dropPads }));
Deno.removeSync(h.dir, { recursive: true }); // the harness's own temp dir (unused here)
Deno.exit(0);
