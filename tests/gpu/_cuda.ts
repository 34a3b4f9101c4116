/**
 * Whether this machine can open a cuda engine: the GPU suite's tests are
 * ignored, naming why, where it cannot.
 */
import { Engine } from "../../ffi/mod.ts";

function probeCuda(): string | undefined {
  try {
    Engine.open({ backend: "cuda" }).close();
    return undefined;
  } catch (e) {
    return e instanceof Error ? e.message : String(e);
  }
}

/** Why no cuda engine opens here; undefined where one does. */
export const noCuda: string | undefined = probeCuda();
