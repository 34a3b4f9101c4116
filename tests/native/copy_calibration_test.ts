/** The calibration cache: measured once per GPU model + driver, read back after, never trusted blindly. */
import assert from "node:assert/strict";
import { dirname, join } from "node:path";
import type { CalibrationTable, Direction } from "../../ffi/mod.ts";
import {
  CALIBRATION_FORMAT,
  calibrationKey,
  type CalibrationTables,
  defaultCalibrationFile,
  loadOrMeasure,
  readCalibration,
} from "../../lib/copy_calibration.ts";
import { PathPolicy } from "../../lib/copy_path.ts";

const H100 = { deviceName: "NVIDIA H100 80GB HBM3", driverVersion: 13000, abiVersion: 4 };

function table(direction: Direction, dmaBatch32k: number): CalibrationTable {
  return {
    direction,
    sizes: [8192, 32768, 131072],
    peak: 55,
    gbps: {
      kernel: [47, 51, 52],
      dma_batch: [18, dmaBatch32k, 54],
      dma: [3, 11, 26],
      mixed: [25, 52, 53],
    },
  };
}

/** A fake measurement that counts its calls. */
function measurer(dmaBatch32k: number) {
  const m = {
    calls: 0,
    measure: (): CalibrationTables => {
      m.calls++;
      return { d2h: table("d2h", dmaBatch32k), h2d: table("h2d", dmaBatch32k) };
    },
  };
  return m;
}

function tempFile(): { dir: string; file: string } {
  const dir = Deno.makeTempDirSync({ prefix: "pf-calib-" });
  return { dir, file: join(dir, "sub", "calibration.json") };
}

Deno.test("a GPU is measured once: the next start reads its table from the cache", () => {
  const { dir, file } = tempFile();
  try {
    const m = measurer(52.5);
    const first = loadOrMeasure(H100, { file, recalibrate: false, measure: m.measure });
    assert.equal(first.source, "measured");
    assert.equal(first.cacheError, undefined);
    const second = loadOrMeasure(H100, { file, recalibrate: false, measure: m.measure });
    assert.equal(second.source, "cache");
    assert.equal(m.calls, 1);
    assert.deepEqual(second.tables, first.tables);
    // The cached table drives the same choice as the measured one.
    assert.equal(new PathPolicy(second.tables).choose("d2h", 32768), "dma_batch");
  } finally {
    Deno.removeSync(dir, { recursive: true });
  }
});

Deno.test("the cache is keyed by device name and driver: another driver is measured and both are kept", () => {
  const { dir, file } = tempFile();
  try {
    const m = measurer(52.5);
    loadOrMeasure(H100, { file, recalibrate: false, measure: m.measure });
    const newer = { ...H100, driverVersion: 13010 };
    const r = loadOrMeasure(newer, { file, recalibrate: false, measure: m.measure });
    assert.equal(r.source, "measured");
    assert.equal(m.calls, 2);
    const doc = JSON.parse(Deno.readTextFileSync(file));
    assert.equal(doc.format, CALIBRATION_FORMAT);
    assert.deepEqual(Object.keys(doc.entries).sort(), [
      calibrationKey(H100),
      calibrationKey(newer),
    ]);
    assert.match(calibrationKey(H100), /NVIDIA H100 80GB HBM3 \| driver 13000/);
  } finally {
    Deno.removeSync(dir, { recursive: true });
  }
});

Deno.test("--recalibrate measures although the cache has the GPU, and replaces its entry", () => {
  const { dir, file } = tempFile();
  try {
    loadOrMeasure(H100, { file, recalibrate: false, measure: measurer(30).measure });
    const m = measurer(52.5);
    const r = loadOrMeasure(H100, { file, recalibrate: true, measure: m.measure });
    assert.equal(r.source, "measured");
    assert.equal(m.calls, 1);
    assert.equal(readCalibration(file, calibrationKey(H100))?.d2h.gbps.dma_batch[1], 52.5);
  } finally {
    Deno.removeSync(dir, { recursive: true });
  }
});

Deno.test("a malformed cache is measured over, named in the report, and rewritten valid", () => {
  const { dir, file } = tempFile();
  try {
    Deno.mkdirSync(join(dir, "sub"));
    const cases: Array<[string, RegExp]> = [
      ["{ not json", /is not JSON/],
      [JSON.stringify({ format: "other/9", entries: {} }), /format is "other\/9"/],
      [
        JSON.stringify({
          format: CALIBRATION_FORMAT,
          entries: {
            [calibrationKey(H100)]: {
              d2h: table("d2h", 50),
              h2d: { ...table("h2d", 50), gbps: { kernel: [1] } },
            },
          },
        }),
        /h2d: gbps\.kernel must hold 3 non-negative numbers/,
      ],
    ];
    for (const [text, why] of cases) {
      Deno.writeTextFileSync(file, text);
      const m = measurer(52.5);
      const r = loadOrMeasure(H100, { file, recalibrate: false, measure: m.measure });
      assert.equal(r.source, "measured");
      assert.equal(m.calls, 1);
      assert.ok(r.cacheError?.includes(file), r.cacheError ?? "no cache error");
      assert.match(r.cacheError ?? "", why);
      assert.equal(readCalibration(file, calibrationKey(H100))?.d2h.gbps.dma_batch[1], 52.5);
    }
  } finally {
    Deno.removeSync(dir, { recursive: true });
  }
});

Deno.test("a cache that cannot be written still yields measured tables and says why", () => {
  const { dir } = tempFile();
  try {
    const blocker = join(dir, "a-file");
    Deno.writeTextFileSync(blocker, "x");
    const file = join(blocker, "calibration.json"); // its parent is a file
    const r = loadOrMeasure(H100, { file, recalibrate: false, measure: measurer(52.5).measure });
    assert.equal(r.source, "measured");
    assert.match(r.cacheError ?? "", /cannot be written/);
  } finally {
    Deno.removeSync(dir, { recursive: true });
  }
});

Deno.test("without a cache file every start measures and nothing is written", () => {
  const m = measurer(52.5);
  loadOrMeasure(H100, { file: undefined, recalibrate: false, measure: m.measure });
  loadOrMeasure(H100, { file: undefined, recalibrate: false, measure: m.measure });
  assert.equal(m.calls, 2);
});

Deno.test("the default cache lives under XDG_CACHE_HOME, else ~/.cache", () => {
  const env = (vars: Record<string, string>) => (n: string) => vars[n];
  assert.equal(
    defaultCalibrationFile(env({ XDG_CACHE_HOME: "/x", HOME: "/h" })),
    "/x/pegaflow/calibration.json",
  );
  assert.equal(defaultCalibrationFile(env({ HOME: "/h" })), "/h/.cache/pegaflow/calibration.json");
  assert.equal(defaultCalibrationFile(env({})), undefined);
});

Deno.test("a cache that can be neither read nor replaced: both problems are reported and no temp file is left", () => {
  const { dir, file } = tempFile();
  try {
    // A directory where the file should be: reading fails, and so does renaming over it.
    Deno.mkdirSync(join(file, "x"), { recursive: true });
    const r = loadOrMeasure(H100, { file, recalibrate: false, measure: measurer(52.5).measure });
    assert.equal(r.source, "measured");
    assert.match(r.cacheError ?? "", /cannot be read/);
    assert.match(r.cacheError ?? "", /cannot be written/);
    assert.ok(r.cacheError?.includes(file), r.cacheError ?? "no cache error");
    const left = [...Deno.readDirSync(join(dir, "sub"))].map((e) => e.name).sort();
    // The writers' lock file stays (removing it would let two writers lock two files).
    assert.deepEqual(left, ["calibration.json", "calibration.json.lock"]);
  } finally {
    Deno.removeSync(dir, { recursive: true });
  }
});

Deno.test("servers writing one cache at once keep every entry (GPUs of a node calibrating together)", async () => {
  const { dir, file } = tempFile();
  try {
    const writers = 4, each = 25;
    const children = Array.from({ length: writers }, (_, w) =>
      new Deno.Command(Deno.execPath(), {
        args: [
          "run",
          "-A",
          "--cached-only",
          new URL("./_calibration_writer.ts", import.meta.url).pathname,
          file,
          `gpu${w}`,
          String(each),
        ],
        stdout: "null",
      }).output());
    for (const r of await Promise.all(children)) {
      assert.equal(r.code, 0, new TextDecoder().decode(r.stderr));
    }
    const doc = JSON.parse(Deno.readTextFileSync(file));
    const missing = [];
    for (let w = 0; w < writers; w++) {
      for (let i = 0; i < each; i++) {
        if (!(`gpu${w}-${i}` in doc.entries)) missing.push(`gpu${w}-${i}`);
      }
    }
    assert.deepEqual(missing, [], `${missing.length} entries lost`);
    assert.deepEqual(
      [...Deno.readDirSync(dirname(file))].map((e) => e.name).filter((n) => n.endsWith(".tmp")),
      [],
      "temp files left",
    );
  } finally {
    Deno.removeSync(dir, { recursive: true });
  }
});
