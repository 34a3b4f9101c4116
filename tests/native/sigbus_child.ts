/**
 * Test helper process: with the library's SIGBUS guard installed (an engine
 * is open), touches a shrunk shm object through an UNGUARDED view. The fault
 * is not the library's, so the process must die by SIGBUS as it would have
 * without the library.
 */
import { Engine, SharedMemory } from "../../ffi/mod.ts";

const engine = Engine.open({ backend: "host" });
const name = `/pegaflow-test-sigbus-${Deno.pid}`;
const shm = SharedMemory.open(name, 4096, { create: true, unlink: true });
const view = shm.view();
Deno.truncateSync(`/dev/shm${name}`, 0);
Deno.removeSync(`/dev/shm${name}`); // nothing left behind when the fault kills us
console.log("guard installed; touching the shrunk mapping");
view[0] = 1;
console.log("survived (the guard swallowed a fault that was not its own)");
engine.close();
