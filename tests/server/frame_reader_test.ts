import assert from "node:assert/strict";
import { FrameReader } from "../../lib/local_rpc/wire.ts";

function frame(callId: number, tag: number, payloadBytes: number): Uint8Array {
  const f = new Uint8Array(9 + payloadBytes);
  const dv = new DataView(f.buffer);
  dv.setUint32(0, 5 + payloadBytes, true);
  dv.setUint32(4, callId, true);
  f[8] = tag;
  f.fill(7, 9);
  return f;
}

Deno.test("a reader lets go of the buffer one huge frame grew once the frame is taken; small frames keep theirs", () => {
  const r = new FrameReader(64 << 20);
  r.push(frame(1, 2, 8 << 20));
  const big = r.next();
  assert.equal(big?.callId, 1);
  assert.equal(big?.payload.length, 8 << 20);
  assert.equal(r.next(), null);
  assert.ok(r.bufferBytes <= 1 << 20, `kept ${r.bufferBytes} bytes after the 8 MiB frame`);
  // A frame split over two pushes is still whole after the reset.
  const f = frame(3, 4, 100_000);
  r.push(f.subarray(0, 50_000));
  assert.equal(r.next(), null);
  r.push(f.subarray(50_000));
  const got = r.next();
  assert.equal(got?.callId, 3);
  assert.equal(got?.payload.length, 100_000);
  assert.ok(got?.payload.every((b) => b === 7));
});
