/**
 * docs/server.md says what the server does: every metric a default server
 * exports (real server process, host backend) is in the metrics table, and
 * `--help`'s line for `--max-message-size` says what the flags table says
 * (the limit applies both ways: grpc-js's receive and send limits).
 */
import assert from "node:assert/strict";
import { parseServeArgs } from "../../lib/server/config.ts";
import { startServer } from "./harness.ts";

const DOC = new URL("../../docs/server.md", import.meta.url);

/** The table right under `heading` in docs/server.md, one string per row. */
function tableAfter(heading: string): string[] {
  const lines = Deno.readTextFileSync(DOC).split("\n");
  const at = lines.findIndex((l) => l.startsWith(heading));
  assert.ok(at >= 0, `docs/server.md has no "${heading}"`);
  const start = lines.findIndex((l, i) => i > at && l.startsWith("|"));
  const end = lines.findIndex((l, i) => i > start && !l.startsWith("|"));
  return lines.slice(start, end);
}

Deno.test("every metric a default server exports is in docs/server.md's metrics table", async () => {
  const names = tableAfter("## Metrics").map((row) => row.split("|")[1]).join(" ");
  const srv = await startServer();
  let text: string;
  try {
    text = await (await srv.http_get("/metrics")).text();
  } finally {
    await srv.stop();
  }
  const exported = text.split("\n").filter((l) => l.startsWith("# TYPE ")).map((l) =>
    l.split(" ")[2]
  );
  assert.ok(exported.length > 20, text);
  // A row names a metric in full, or as `_rest` after one of the same prefix.
  const documented = (m: string) =>
    new RegExp(`\`(${m}|${m.replace(/^pegaflow_/, "_")})[\`{]`).test(names);
  assert.deepEqual(exported.filter((m) => !documented(m)), [], "exported, not in the table");
});

Deno.test("--help and docs/server.md say the same of --max-message-size", () => {
  const row = tableAfter("| flag").find((r) => r.includes("`--max-message-size <size>`"));
  assert.ok(row, "no --max-message-size row");
  const meaning = row.split("|")[3].trim();
  const help = parseServeArgs(["--help"]);
  assert.ok(help.kind === "exit" && help.code === 0);
  const line = help.output.replace(/\s+/g, " ").match(/--max-message-size <size> (.*?) \(default/)
    ?.[1];
  assert.equal(line, meaning);
  assert.match(meaning, /accepted or sent/, "grpc-js limits both directions (server.ts)");
});
