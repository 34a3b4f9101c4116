/** `--help` says what each flag does when it is not given. */
import assert from "node:assert/strict";
import { parseServeArgs } from "../../lib/server/config.ts";

Deno.test("serve --help says which devices are served without --devices", () => {
  const r = parseServeArgs(["--help"]);
  assert.ok(r.kind === "exit" && r.code === 0);
  const line = r.output.replace(/\s+/g, " ").match(/--devices <ids> (.*?)--/)?.[1] ?? "";
  assert.match(line, /default: every visible GPU on cuda, 0 on host/, line);
});
