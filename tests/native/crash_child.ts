/**
 * Test helper process: exports a host region, prints its shm name, then
 * dies on an uncaught error without closing anything.
 */
import { Engine } from "../../ffi/mod.ts";

const engine = Engine.open({ backend: "host" });
const region = engine.allocRegion(4096);
console.log(new TextDecoder().decode(region.handle).replace(/\0+$/, ""));
throw new Error("the exporter crashes on purpose");
