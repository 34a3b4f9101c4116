/**
 * Test helper process: opens an engine of the backend named in argv[0] and
 * prints, as JSON, how many of this process's threads carry each name given
 * after it, once with the engine open and once after it closed. A process of
 * its own, so no other test's engine shares its threads.
 */
import { Engine } from "../../ffi/mod.ts";
import { threadsNamed } from "./process.ts";

const [backend, ...names] = Deno.args;
const engine = Engine.open({ backend: backend as "host" | "cuda", workers: 3 });
const open: Record<string, number> = {};
for (const n of names) open[n] = await threadsNamed(n, 1);
engine.close();
const closed: Record<string, number> = {};
for (const n of names) closed[n] = await threadsNamed(n);
console.log(JSON.stringify({ open, closed }));
