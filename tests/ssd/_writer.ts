/**
 * A separate process for the restart test: opens the tier on a directory,
 * writes N blocks (content derived from the key), closes cleanly, exits.
 * Usage: deno run -A tests/ssd/_writer.ts <dir> <count> <blockBytes>
 */
import { harness } from "./_harness.ts";

const [dir, count, blockBytes] = [Deno.args[0], Number(Deno.args[1]), Number(Deno.args[2])];
const h = await harness(64 << 20);
const tier = await h.openTier({
  paths: [dir],
  capacityBytes: 64 << 20,
  segmentBytes: 4 << 20,
});
const blocks = Array.from({ length: count }, (_, i) => {
  const key = `ns-restart/${i}`;
  h.fill(key, i * blockBytes, blockBytes);
  return h.block(key, i * blockBytes, blockBytes);
});
h.write(tier, blocks);
await tier.flushWrites();
const s = tier.stats();
await tier.close();
await h.close();
console.log(JSON.stringify({ written: s.writeBlocks, failures: s.writeFailures }));
