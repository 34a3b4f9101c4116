// The house rules a reader relies on (issue 10): no file in lib/ over ~500 lines, and no function
// in the server's code over ~80 lines unless the comment block right above it says why, with
// `long function: <reason>` (a table of metric definitions, a handler table whose entries are each
// short). Functions are found by Deno's own parser through a lint plugin, so an arrow function in a
// const, a method and a nested function all count.
import assert from "node:assert/strict";

const MAX_FILE_LINES = 500;
const MAX_FUNCTION_LINES = 80;
const REASON = "long function:";
const ROOTS = ["lib", "ffi", "main.ts", "router.ts"];

function tsFiles(root: string): string[] {
  const info = Deno.statSync(root);
  if (info.isFile) return root.endsWith(".ts") ? [root] : [];
  const out: string[] = [];
  for (const e of Deno.readDirSync(root)) out.push(...tsFiles(`${root}/${e.name}`));
  return out.sort();
}

/** True when the comment block that ends on the line before `line` (1-based) states a reason. */
function statedReason(lines: string[], line: number): boolean {
  for (let i = line - 2; i >= 0; i--) {
    const t = lines[i].trim();
    if (!(t.startsWith("//") || t.startsWith("/*") || t.startsWith("*"))) return false;
    if (t.includes(REASON)) return true;
  }
  return false;
}

const longFunctions: Deno.lint.Plugin = {
  name: "house",
  rules: {
    "long-function": {
      create(ctx) {
        const text = ctx.sourceCode.text;
        const lines = text.split("\n");
        const check = (node: Deno.lint.Node) => {
          const [start, end] = node.range;
          const n = text.slice(start, end).split("\n").length;
          if (n <= MAX_FUNCTION_LINES) return;
          const line = text.slice(0, start).split("\n").length;
          // A method's or a const arrow's comment sits above the line its name is on.
          if (statedReason(lines, line)) return;
          ctx.report({ node, message: `line ${line}: a function of ${n} lines` });
        };
        return {
          FunctionDeclaration: check,
          FunctionExpression: check,
          ArrowFunctionExpression: check,
        };
      },
    },
  },
};

function fail(what: string, offenders: string[]): void {
  if (offenders.length > 0) throw new Error(`${what}:\n  ${offenders.join("\n  ")}`);
}

Deno.test("no file in lib/ is over the house's line budget", () => {
  const offenders = tsFiles("lib").flatMap((f) => {
    const n = Deno.readTextFileSync(f).split("\n").length - 1;
    return n > MAX_FILE_LINES ? [`${f}: ${n} lines (budget ${MAX_FILE_LINES})`] : [];
  });
  fail("files over budget", offenders);
});

Deno.test("no function is over the house's line budget without a stated reason", () => {
  const offenders = ROOTS.flatMap(tsFiles).flatMap((f) =>
    Deno.lint.runPlugin(longFunctions, f, Deno.readTextFileSync(f)).map((d) => `${f} ${d.message}`)
  );
  fail(
    `functions over ${MAX_FUNCTION_LINES} lines (split them, or say why with "${REASON}")`,
    offenders,
  );
});

Deno.test("the function rule sees every kind of function and honours a stated reason", () => {
  const body = (n: number) => Array.from({ length: n }, (_, i) => `  x += ${i};`).join("\n");
  const src = [
    `function decl() {\n${body(85)}\n}`,
    `const arrow = () => {\n${body(85)}\n};`,
    `class C {\n  method() {\n${body(85)}\n  }\n}`,
    `// long function: a table, each entry short\nfunction excused() {\n${body(85)}\n}`,
    `function short() {\n${body(10)}\n}`,
  ].join("\n");
  const found = Deno.lint.runPlugin(longFunctions, "probe.ts", src).map((d) =>
    d.message.split(":")[0]
  );
  assert.deepEqual(found, ["line 1", "line 88", "line 176"]);
});
