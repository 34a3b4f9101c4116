/** A default's size label is derived from its value and reads back as that value. */
import assert from "node:assert/strict";
import fc from "fast-check";
import { formatSize, parseSize } from "../../lib/cli/flags.ts";
import { serveCommand } from "../../lib/server/config.ts";
import { DEFAULT_SEGMENT_BYTES, DEFAULT_SSD_CAPACITY } from "../../lib/ssd/tier.ts";

Deno.test("formatSize picks the largest unit that divides the value", () => {
  assert.equal(formatSize(512 * 1024 ** 3), "512gb");
  assert.equal(formatSize(64 * 1024 ** 2), "64mb");
  assert.equal(formatSize(3 * 1024 ** 4), "3tb");
  assert.equal(formatSize(1536), "1536");
  assert.equal(formatSize(0), "0");
});

Deno.test("every size label reads back as the same number of bytes", () => {
  fc.assert(fc.property(fc.nat({ max: 2 ** 50 }), (n) => parseSize(formatSize(n)) === n));
});

Deno.test("--help shows the SSD defaults the tier uses", () => {
  const help = serveCommand().helpInformation().replace(/\s+/g, " ");
  assert.match(
    help,
    new RegExp(`--ssd-cache-capacity <size>.*\\(default: ${formatSize(DEFAULT_SSD_CAPACITY)},`),
  );
  assert.match(
    help,
    new RegExp(`--ssd-segment-size <size>.*\\(default: ${formatSize(DEFAULT_SEGMENT_BYTES)},`),
  );
  assert.equal(formatSize(DEFAULT_SSD_CAPACITY), "512gb");
});
