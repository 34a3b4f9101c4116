/**
 * The NUMA placement policy (lib/numa.ts): which parts the pool is cut into
 * for the served devices' nodes, and the kernel's node lists.
 */
import assert from "node:assert/strict";
import { onlineNodes, parseNodeList, PART_ALIGN_BYTES, planPlacement } from "../../lib/numa.ts";

const GB = 1 << 30;

Deno.test("devices on two nodes cut the pool in two equal aligned parts, each device pointing at its node's", () => {
  const nodeOf = new Map([[0, 0], [1, 0], [2, 1], [3, 1]]);
  const p = planPlacement(10 * GB + 12345, [0, 1, 2, 3], nodeOf, [0, 1])!;
  assert.equal(p.parts.length, 2);
  assert.equal(p.parts[0].bytes % PART_ALIGN_BYTES, 0);
  assert.equal(p.parts[0].bytes + p.parts[1].bytes, 10 * GB + 12345);
  assert.deepEqual(p.parts.map((x) => x.node), [0, 1]);
  assert.deepEqual([...p.partOfDevice], [[0, 0], [1, 0], [2, 1], [3, 1]]);
});

Deno.test("one known node, unknown nodes or a pool too small for parts leave the pool whole", () => {
  assert.equal(planPlacement(GB, [0, 1], new Map([[0, 0], [1, 0]]), [0, 1]), undefined);
  assert.equal(planPlacement(GB, [0, 1], new Map([[0, -1], [1, -1]]), [0]), undefined);
  assert.equal(
    planPlacement(PART_ALIGN_BYTES, [0, 1], new Map([[0, 0], [1, 1]]), [0, 1]),
    undefined,
  );
});

Deno.test("a part on a node this host lacks is planned but left unbound; a device of unknown node has no part", () => {
  const p = planPlacement(GB, [0, 1, 2], new Map([[0, 0], [1, 3]]), [0])!;
  assert.deepEqual(p.parts.map((x) => x.node), [0, -1]);
  assert.deepEqual(p.partNodes, [0, 3]);
  assert.equal(p.partOfDevice.get(2), undefined);
});

Deno.test("node lists parse the kernel's format; a host without sysfs counts as one node", () => {
  assert.deepEqual(parseNodeList("0"), [0]);
  assert.deepEqual(parseNodeList("0-2,4"), [0, 1, 2, 4]);
  assert.throws(() => parseNodeList("zero"), /not a NUMA node list/);
  assert.deepEqual(onlineNodes(() => "0-1\n"), [0, 1]);
  assert.deepEqual(
    onlineNodes(() => {
      throw new Deno.errors.NotFound("no sysfs");
    }),
    [0],
  );
});
