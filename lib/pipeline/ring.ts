/**
 * A fixed-capacity FIFO over a preallocated array. Queues use it so that
 * offering and taking never allocate (Array#shift is O(n) and an unbounded
 * array is exactly the hidden buffer the pipelines are built to avoid).
 *
 * @module
 */

/**
 * Fixed-capacity FIFO ring.
 *
 * @example
 * ```ts
 * const r = new Ring<number>(2);
 * r.push(1); r.push(2);
 * r.push(3); // false: full
 * r.shift(); // 1
 * ```
 */
export class Ring<T> {
  readonly #slots: (T | undefined)[];
  #head = 0;
  #size = 0;

  constructor(readonly capacity: number) {
    if (!Number.isInteger(capacity) || capacity < 0) {
      throw new RangeError(`ring capacity must be a non-negative integer, got ${capacity}`);
    }
    this.#slots = new Array<T | undefined>(capacity);
  }

  /** Items held. */
  get size(): number {
    return this.#size;
  }

  /** Appends at the tail; false when full. */
  push(item: T): boolean {
    if (this.#size === this.capacity) return false;
    this.#slots[(this.#head + this.#size) % this.capacity] = item;
    this.#size++;
    return true;
  }

  /** Removes and returns the head, or undefined when empty. */
  shift(): T | undefined {
    if (this.#size === 0) return undefined;
    const item = this.#slots[this.#head];
    this.#slots[this.#head] = undefined; // let the item be collected
    this.#head = (this.#head + 1) % this.capacity;
    this.#size--;
    return item;
  }

  /** The head without removing it. */
  peek(): T | undefined {
    return this.#size === 0 ? undefined : this.#slots[this.#head];
  }
}
