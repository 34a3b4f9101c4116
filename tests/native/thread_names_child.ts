/**
 * Test helper process: opens an engine of the backend named in argv[0] and
 * prints, as JSON, how many of this process's threads carry each name given
 * after it as NAME=MIN (counted once MIN of them are named: threads name
 * themselves as they start), with the engine open and after it closed. A
 * process of its own, so no other test's engine shares its threads.
 */
import { Engine } from "../../ffi/mod.ts";
import { threadsNamed } from "./process.ts";

const [backend, ...wanted] = Deno.args;
const names = wanted.map((w) => w.split("=") as [string, string]);
const engine = Engine.open({ backend: backend as "host" | "cuda", workers: 3 });
const open: Record<string, number> = {};
for (const [n, min] of names) open[n] = await threadsNamed(n, Number(min));
engine.close();
const closed: Record<string, number> = {};
for (const [n] of names) closed[n] = await threadsNamed(n);
console.log(JSON.stringify({ open, closed }));
