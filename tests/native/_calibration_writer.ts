/** Child of copy_calibration_test.ts: writes `count` entries `<prefix>-<i>` into one cache file. */
import { writeCalibration } from "../../lib/copy_calibration.ts";

const [file, prefix, count] = Deno.args;
const table = (direction: "d2h" | "h2d") => ({
  direction,
  sizes: [32768],
  peak: 55,
  gbps: { kernel: [50], dma_batch: [50], dma: [20], mixed: [50] },
});
for (let i = 0; i < Number(count); i++) {
  writeCalibration(file, `${prefix}-${i}`, { d2h: table("d2h"), h2d: table("h2d") });
}
